"""dvi_lite.core.sampling: Sampler validation and the processed distribution (temperature, top-k, top-p)."""
from __future__ import annotations

import math

import pytest
import torch

from dvi_lite.core.sampling import Sampler, make_generator, sample


@pytest.mark.parametrize("kw, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
])
def test_sampler_rejects_bad_parameters(kw, name):
    with pytest.raises(ValueError, match=name):
        Sampler(**kw)


def test_sampler_defaults_and_greedy_flag():
    assert Sampler().greedy
    assert Sampler(temperature=0.0, top_k=5, top_p=0.5).greedy
    assert not Sampler(temperature=0.7).greedy
    Sampler(temperature=1.0, top_k=0, top_p=1.0)  # boundary values are valid


def test_greedy_probs_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]])
    probs = Sampler().probs(logits)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert probs.dtype == torch.float32
    assert Sampler().pick(logits[0]) == 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scaling_matches_softmax(temperature):
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = Sampler(temperature=temperature).probs(logits)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k_tokens(k):
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(k))  # distinct values: no ties
    probs = Sampler(temperature=1.0, top_k=k).probs(logits)
    assert ((probs > 0).sum(-1) == k).all()
    top = torch.topk(logits, k, -1).indices
    assert (probs.gather(-1, top) > 0).all()  # the kept ones are the k largest
    kept = torch.full_like(logits, float("-inf")).scatter(-1, top, logits.gather(-1, top))
    torch.testing.assert_close(probs, kept.softmax(-1))  # renormalised over the kept tokens


def test_top_k_larger_than_vocab_is_a_no_op():
    logits = torch.randn(6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(Sampler(temperature=1.0, top_k=50).probs(logits), logits.softmax(-1))


# Hand-computed top-p example: probabilities 0.4, 0.3, 0.15, 0.1, 0.05, given out of order.
P5 = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])


@pytest.mark.parametrize("top_p, kept", [
    (0.3, {1}),  # 0.4 >= 0.3 already
    (0.65, {1, 3}),  # 0.4 < 0.65 <= 0.7
    (0.75, {1, 3, 4}),  # 0.7 < 0.75 <= 0.85
    (0.9, {1, 3, 4, 0}),  # 0.85 < 0.9 <= 0.95
    (0.97, {0, 1, 2, 3, 4}),  # 0.95 < 0.97
    (1.0, {0, 1, 2, 3, 4}),  # off
])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    probs = Sampler(temperature=1.0, top_p=top_p).probs(P5.log())
    assert set(torch.nonzero(probs > 0).flatten().tolist()) == kept
    idx = sorted(kept)
    torch.testing.assert_close(probs[idx], P5[idx] / P5[idx].sum())


def test_top_p_is_applied_after_temperature():
    # T = 0.5 squares and renormalises: 0.16/0.285 = 0.561 for the top token (0.4 < 0.55 at T = 1)
    probs = Sampler(temperature=0.5, top_p=0.55).probs(P5.log())
    assert set(torch.nonzero(probs > 0).flatten().tolist()) == {1}


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3},
                                {"temperature": 1.3, "top_p": 0.8}, {"temperature": 0.9, "top_k": 5, "top_p": 0.5},
                                {}])
def test_probs_sum_to_one(kw):
    logits = 3 * torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    probs = Sampler(**kw).probs(logits)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_pick_and_sample_are_reproducible_with_a_generator():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(4))
    s = Sampler(temperature=1.0)
    a = [s.pick(logits, make_generator(7)) for _ in range(3)]
    b = [s.pick(logits, make_generator(7)) for _ in range(3)]
    assert a == b
    assert sample(torch.tensor([0.0, 0.0, 1.0]), make_generator(0)) == 2
    assert make_generator(None).initial_seed() == 0
    assert math.isclose(s.probs(logits).sum().item(), 1.0, rel_tol=1e-6)


def test_sampler_rejects_nan_and_bool():
    with pytest.raises(ValueError, match="temperature"):
        Sampler(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_k"):
        Sampler(top_k=True)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(top_p=float("nan"))
