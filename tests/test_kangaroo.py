"""Kangaroo drafter: lossless greedy decoding, consistent adapter cache, clear errors."""
import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer, assert_lossless_sampling
from transformers import LlamaForCausalLM

import dvi_lite
from dvi_lite.core.engine import start, step
from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter, KangarooDrafter, load_adapter, save_adapter


@pytest.fixture(scope="module")
def model(deep_model):
    return deep_model


PROMPTS = DEEP_PROMPTS


@pytest.mark.parametrize("split,threshold,branch", [(1, None, 1), (2, 0.6, 1), (3, 0.95, 1), (1, None, 3), (2, 0.3, 2)])
def test_greedy_equals_ar(model, split, threshold, branch):
    adapter = KangarooAdapter(model, split).eval()
    alphas = []
    for p in PROMPTS:
        ar = dvi_lite.generate(model, IdTokenizer(), p, max_new_tokens=40, stop_at_eos=False)
        kg = dvi_lite.generate(model, IdTokenizer(), p, method="kangaroo", split=split, adapter=adapter,
                               threshold=threshold, branch=branch, max_new_tokens=40, stop_at_eos=False)
        assert kg.token_ids == ar.token_ids
        alphas.append(kg.stats.alpha)
    assert any(a < 1 for a in alphas)


@pytest.mark.parametrize("greedy,branch", [(True, 1), (False, 1), (True, 3), (False, 2)])
def test_adapter_cache_equals_fresh_computation(model, greedy, branch):
    """After any mix of accepts/rejects (incl. the all-accepted 'last draft token' case and accepted
    tree leaves), the adapter's cache + todo equal the adapter run once over every committed position."""
    split = 2
    adapter = KangarooAdapter(model, split).eval()
    runner = Runner(model)
    drafter = KangarooDrafter(runner, adapter, k=4, threshold=None, branch=branch)
    sampler = Sampler() if greedy else Sampler(temperature=1.0)
    state = start(runner, drafter, PROMPTS[0], 40, sampler, make_generator(0))
    all_accepted = False
    for _ in range(8):
        out, st = step(state, drafter)
        all_accepted |= st.accepted == st.depth
    committed = state.tokens[:-1]
    ids = torch.tensor([committed])
    with torch.no_grad():
        hk = runner.layers_forward(runner.embed(ids), None, runner.positions(None, len(committed)), 0, split)
        fresh = KVCache.for_model(model, 64, n_layers=1)
        pos = torch.arange(len(committed))[None]
        adapter(hk, runner.rotary(hk, pos), fresh)
    n = len(drafter.cache)
    todo = sum(t.shape[1] for t in drafter.todo)
    assert n + todo == len(committed)
    k_live, v_live = drafter.cache.layer(0)
    k_ref, v_ref = fresh.layer(0)
    torch.testing.assert_close(k_live, k_ref[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_live, v_ref[:, :, :n], atol=1e-4, rtol=1e-4)
    if todo:
        torch.testing.assert_close(torch.cat(drafter.todo, 1), hk[:, n:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("branch,threshold", [(1, None), (2, 0.3)])
def test_sampling_is_lossless_end_to_end(target8, tok8, branch, threshold):
    """Chain (rejection sampling with q) and tree (top-k point masses) drafts: output law = p's."""
    assert_lossless_sampling(target8, tok8, "kangaroo", split=1, adapter=KangarooAdapter(target8, 1).eval(),
                             k=3, threshold=threshold, branch=branch)


def test_missing_adapter_is_a_clear_error(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no Kangaroo adapter"):
        load_adapter(model, 2, tmp_path / "none.pt")


def test_adapter_for_another_model_is_rejected(model, tmp_path):
    torch.manual_seed(1)
    other = LlamaForCausalLM(model.config).eval()
    save_adapter(KangarooAdapter(other, 2), other, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="another model"):
        load_adapter(model, 2, tmp_path / "a.pt")


@pytest.mark.parametrize("kw,msg", [(dict(split=0), "split"), (dict(split=4), "split"),
                                    (dict(split=2, threshold=0.0), "threshold"),
                                    (dict(split=2, threshold=1.2), "threshold"),
                                    (dict(split=2, branch=0), "branch"), (dict(split=2, k=0), "'k'"),
                                    (dict(split=1), "trained for exit layer 2")])
def test_bad_inputs(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(model, IdTokenizer(), [1, 2], method="kangaroo", adapter=KangarooAdapter(model, 2), **kw)


def test_default_split(model, tmp_path, monkeypatch):
    """split=None: an adapter object's own exit layer, else the one default (default_split), per-split file."""
    from dvi_lite.core.checks import default_split
    from dvi_lite.methods.kangaroo import drafter as kd

    adapter = KangarooAdapter(model, 3).eval()
    assert kd.make_drafter(model, IdTokenizer(), adapter=adapter).split == 3
    torch.manual_seed(0)
    save_adapter(KangarooAdapter(model, default_split(4)), model, kd.adapter_path(default_split(4), tmp_path))
    monkeypatch.setattr(kd, "model_adapter_path", lambda m, split: kd.adapter_path(split, tmp_path))
    d = kd.make_drafter(model, IdTokenizer())
    assert d.split == d.adapter.split == default_split(4) and d.k == 6 and d.threshold == 0.6


def test_distillation_reduces_kl(model):
    from dvi_lite.methods.kangaroo.train import distill_loss

    torch.manual_seed(0)
    adapter = KangarooAdapter(model, 1).train()
    runner = Runner(model)
    opt = torch.optim.AdamW(adapter.parameters(), lr=3e-3)
    x = torch.randint(64, (4, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = distill_loss(adapter, runner, x).item()
    for _ in range(30):
        loss = distill_loss(adapter, runner, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the target stays frozen
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("argv, msg", [(["--steps", "0"], "--steps must be >= 1"), (["--split", "99"], "split")])
def test_train_cli_bad_inputs_are_usage_errors(argv, msg, capsys, tmp_path):
    from dvi_lite.methods.kangaroo.train import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "a.pt")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
