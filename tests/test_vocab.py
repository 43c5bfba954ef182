"""The trimmed-vocabulary draft head (models.vocab): counted maps, q = 0 off the map, lossless greedy and sampling."""
from __future__ import annotations

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer, assert_lossless_sampling

import dvi_lite
from dvi_lite.core.engine import start
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.dvi.policy import DVIPolicy
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter
from dvi_lite.models.vocab import (
    TrimmedHead,
    build_vocab_map,
    count_tokens,
    load_vocab_ids,
    resolve_vocab,
    top_ids,
    vocab_map_path,
)

N = 16


class SpaceTokenizer:
    """Texts of space-separated ids -> those ids (what count_tokens needs: __call__ with input_ids)."""
    name_or_path = "space-ids"

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[int(x) for x in t.split()] for t in texts]}


@pytest.fixture(scope="module")
def model(deep_model):
    return deep_model


@pytest.fixture(scope="module")
def ar_texts(model):
    """The AR outputs of the test prompts, as texts: the 'corpus' the map is counted on."""
    out = [dvi_lite.generate(model, IdTokenizer(), p, max_new_tokens=40, stop_at_eos=False).token_ids
           for p in DEEP_PROMPTS]
    return [" ".join(map(str, ids)) for ids in out]


@pytest.fixture(scope="module")
def ids(model, ar_texts):
    return top_ids(count_tokens(SpaceTokenizer(), ar_texts, 64), N).long()


def test_count_and_top_ids():
    c = count_tokens(SpaceTokenizer(), ["3 3 5", "5 5 1", ""], 8)
    assert c.tolist() == [0, 1, 0, 2, 0, 3, 0, 0]
    assert top_ids(c, 4).tolist() == [5, 3, 1, 0]  # by count, ties by id
    assert top_ids(c, 4).dtype == torch.int32


def test_build_save_load_and_the_int_option(model, ar_texts, ids, tmp_path, monkeypatch):
    monkeypatch.setenv("DVI_MODELS_DIR", str(tmp_path))
    path = build_vocab_map(model, SpaceTokenizer(), N, texts=ar_texts)
    assert path == vocab_map_path(model, N) and path.is_relative_to(tmp_path)
    assert torch.equal(load_vocab_ids(model, path), ids)
    card = __import__("json").loads(path.with_suffix(".json").read_text())
    assert card["n"] == N and card["vocab_size"] == 64 and 0.5 < card["coverage"] <= 1.0
    head = resolve_vocab(model, None, N)  # the saved map is found by its size: no tokenizer needed now
    assert isinstance(head, TrimmedHead) and torch.equal(head.ids, ids)
    assert resolve_vocab(model, None, str(path)).ids.tolist() == ids.tolist()
    assert resolve_vocab(model, None, None) is None
    with pytest.raises(ValueError, match="tokenizer"):
        resolve_vocab(model, None, N + 1)  # no saved map of that size: counting needs the tokenizer
    with pytest.raises(FileNotFoundError, match="no vocabulary map"):
        resolve_vocab(model, None, str(tmp_path / "none.pt"))


@pytest.mark.parametrize("bad,msg", [(0, "vocab"), (65, "vocab"), ([70], "distinct token ids"), ([1, 1], "distinct"),
                                     ([], "non-empty"), (1.5, "vocab must be")])
def test_bad_vocab(model, bad, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_vocab(model, None, bad)


def test_trimmed_head_is_the_full_head_on_its_rows(model, ids):
    head = TrimmedHead(model.lm_head, ids)
    x = torch.randn(2, 3, model.config.hidden_size)
    full, trimmed = model.lm_head(x), head(x)  # (2, 3, V)
    torch.testing.assert_close(trimmed[..., ids], full[..., ids])
    off = torch.ones(64, dtype=torch.bool)
    off[ids] = False
    assert torch.isinf(trimmed[..., off]).all() and head.numel == N * model.config.hidden_size


def method_kwargs(model, method: str) -> dict:
    extra = {"early_exit": dict(split=2), "kangaroo": dict(adapter=KangarooAdapter(model, 2).eval()),
             "draft_verify": dict(skip=Skip(mlp=frozenset({1, 2})), adaptive=False, threshold=None),
             "dvi": dict(state=DVIPolicy(model, 2).eval())}
    return extra[method]


METHODS = ("early_exit", "kangaroo", "draft_verify", "dvi")


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_ar_with_a_trimmed_head(model, ids, method):
    kw = method_kwargs(model, method)
    alphas = []
    for p in DEEP_PROMPTS:
        ar = dvi_lite.generate(model, IdTokenizer(), p, max_new_tokens=40, stop_at_eos=False)
        out = dvi_lite.generate(model, IdTokenizer(), p, method=method, vocab=ids, K=4, max_new_tokens=40,
                                stop_at_eos=False, **kw)
        assert out.token_ids == ar.token_ids
        alphas.append(out.stats.alpha)
    assert any(a is not None and a < 1 for a in alphas) and any(a and a > 0 for a in alphas)


@pytest.mark.parametrize("method", METHODS)
def test_q_is_zero_outside_the_map(model, ids, method):
    from dvi_lite.core.registry import get_method

    drafter = get_method(method).build(model, IdTokenizer(), vocab=ids, K=4, **method_kwargs(model, method))
    assert drafter.extra_params() >= N * model.config.hidden_size
    off = torch.ones(64, dtype=torch.bool)
    off[ids] = False
    r = Runner.for_model(model)
    for seed in range(3):
        state = start(r, drafter, DEEP_PROMPTS[seed], 20, Sampler(temperature=1.0), make_generator(seed))
        prop = drafter.propose(state)
        assert prop.q is not None and (prop.q[:, off] == 0).all()  # (n, V): no mass off the map
        torch.testing.assert_close(prop.q.sum(-1), torch.ones(len(prop)))
        assert set(prop.tokens.tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("method", ["early_exit", "dvi"])
def test_sampling_is_lossless_with_a_trimmed_head(target8, tok8, method):
    """The output law is p's although q is 0 on 3 of the 8 tokens (tokens the target may still emit)."""
    kw = dict(split=1) if method == "early_exit" else dict(state=DVIPolicy(target8, 1).eval())
    assert_lossless_sampling(target8, tok8, method, K=3, vocab=[0, 2, 3, 4, 6], **kw)
