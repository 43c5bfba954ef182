"""dvi_lite.core.runner: the layer-by-layer forward equals the HF model, with a cache, chains and trees.

Tolerances: the fixture models have sharp logits (|logits| up to ~20), so float32 reassociation between
the batched full forward and the incremental one gives differences of ~1e-5 in absolute terms. We use
atol=1e-5 plus rtol=1e-5 (i.e. ~1e-4 at |logit| = 10): still 5+ orders of magnitude below what a wrong
mask or position (differences of order 1) produces.
"""
from __future__ import annotations

import pytest
import torch
from helpers import make_target

from dvi_lite.core.runner import Runner, ancestor_matrix, chain_mask, tree_depths, tree_mask

TOL = {"atol": 1e-5, "rtol": 1e-5}
SEQ = [3, 17, 42, 8, 29, 55, 11, 60, 5, 23, 37, 14]


def _close(a, b):
    torch.testing.assert_close(a, b, **TOL)


@torch.no_grad()
def _full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def test_forward_on_prompt_equals_model(target):
    r = Runner(target)
    ids = torch.tensor([SEQ[:7]])
    logits, h = r.forward(ids, None)
    _close(logits, target(ids).logits)
    assert h.shape == (1, 7, target.config.hidden_size)
    cache = r.new_cache(16)  # with a fresh cache: same logits, and the cache now holds the prompt
    logits2, _ = r.forward(ids, cache)
    _close(logits2, logits)
    assert cache.lens == [7] * r.n_layers


@torch.no_grad()
def test_incremental_decode_equals_full_sequence(target):
    r = Runner(target)
    full = _full_logits(target, SEQ)
    cache = r.new_cache(32)
    out, _ = r.forward(torch.tensor([SEQ[:5]]), cache)  # prompt
    _close(out[0], full[:5])
    for i in range(5, 8):  # one token at a time
        out, _ = r.forward(torch.tensor([[SEQ[i]]]), cache)
        _close(out[0, 0], full[i])
    assert chain_mask(3, 8, "cpu") is not None  # the next call really uses the explicit chain mask
    out, _ = r.forward(torch.tensor([SEQ[8:11]]), cache)  # a 3-token chain after 8 cached positions
    _close(out[0], full[8:11])
    assert len(cache) == 11


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


PARENTS = [-1, 0, 0, 1, -1, 4, 2, 3]
TOKENS = [9, 33, 12, 40, 9, 61, 2, 18]  # nodes 0 and 4 carry the same token at the same depth


@pytest.mark.parametrize("prefix", [5, 0])
@torch.no_grad()
def test_tree_attention_equals_each_root_to_node_chain(target, prefix):
    r = Runner(target)
    parents = torch.tensor(PARENTS)
    cache = r.new_cache(32) if prefix else None
    if prefix:
        r.forward(torch.tensor([SEQ[:prefix]]), cache)
    logits, _ = r.forward(torch.tensor([TOKENS]), cache, parents=parents)
    if prefix:
        assert cache.lens == [prefix + len(TOKENS)] * r.n_layers
    for i in range(len(TOKENS)):
        chain = SEQ[:prefix] + [TOKENS[j] for j in _path(PARENTS, i)]
        _close(logits[0, i], _full_logits(target, chain)[-1])


def test_positions_chain_and_tree(target):
    r = Runner(target)
    cache = r.new_cache(8)
    assert r.positions(None, 3).tolist() == [[0, 1, 2]]
    with torch.no_grad():
        r.forward(torch.tensor([[1, 2]]), cache)
    assert r.positions(cache, 3).tolist() == [[2, 3, 4]]
    assert r.positions(cache, 4, torch.tensor([-1, 0, -1, 1])).tolist() == [[2, 3, 2, 4]]


def test_ancestor_matrix_and_depths_hand_example():
    parents = torch.tensor([-1, 0, 0, 1, -1, 4])
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 0, 1]
    anc = ancestor_matrix(parents)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(anc, expected)
    m = tree_mask(parents, past=3)
    assert m.shape == (1, 1, 6, 9) and m[0, 0, :, :3].all() and torch.equal(m[0, 0, :, 3:], expected)


def test_chain_mask():
    assert chain_mask(1, 5, "cpu") is None and chain_mask(4, 0, "cpu") is None
    m = chain_mask(3, 2, "cpu")[0, 0]
    assert torch.equal(m, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))


@pytest.fixture(scope="module")
def eager_target():
    model = make_target()  # same weights as `target`, eager attention
    model.set_attn_implementation("eager")
    return model


def test_runner_rejects_non_sdpa_attention(eager_target):
    """Our masks use sdpa's conventions (None = causal, bool = attend); other backends get a clear error."""
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        Runner(eager_target)


def test_for_model_keys_on_the_attention_backend(target):
    r = Runner.for_model(target)
    assert r is Runner.for_model(target, "sdpa") and r.attention == "sdpa" and r.tree_kernel is None
    with pytest.raises(ValueError, match=r"attention must be one of \['sdpa', 'triton'\], got 'flash'"):
        Runner.for_model(target, "flash")
    with pytest.raises(ValueError, match="attention must be one of"):
        Runner(target, attention=None)


@torch.no_grad()
def test_tree_attention_hook_runs_the_models_own_attention_module(target):
    """The path `attention="triton"` takes, with the sdpa reference standing in for the kernel (so it runs
    without triton): the tree goes through HF's attention module to `hf_tree_attention`, which splits the
    layer's K/V into past and new nodes; the logits equal the dense-mask path's, and the config is restored."""
    from dvi_lite.core import runner as runner_mod
    from dvi_lite.methods.medusa.tree_attention import tree_attention_reference

    prepared = []

    def prepare(parents):
        prepared.append(parents.tolist())
        return lambda q, kc, vc, kn, vn, scale=None: tree_attention_reference(q, kc, vc, kn, vn, parents, scale)
    hooked, ref = Runner(target), Runner(target)
    from transformers import AttentionInterface

    AttentionInterface.register(runner_mod.HF_TREE_ATTENTION, runner_mod.hf_tree_attention)
    hooked.tree_kernel, hooked._attn_configs = prepare, [target.config]
    caches = [hooked.new_cache(32), ref.new_cache(32)]
    for r, c in zip((hooked, ref), caches, strict=True):
        r.forward(torch.tensor([SEQ[:5]]), c)  # a chain: no hook
    assert prepared == []
    got, _ = hooked.forward(torch.tensor([TOKENS]), caches[0], parents=torch.tensor(PARENTS))
    want, _ = ref.forward(torch.tensor([TOKENS]), caches[1], parents=torch.tensor(PARENTS))
    _close(got, want)
    assert prepared == [PARENTS] and target.config._attn_implementation == "sdpa"
    for i in range(ref.n_layers):
        _close(caches[0].layer(i)[0], caches[1].layer(i)[0])
