"""Caches against a fresh prefill: after every step of a run, the target's KV cache for the committed
positions equals a fresh prefill of the same tokens (helpers.assert_cache_equals_fresh, fp32 tolerance), and
strictly: the engine crops every layer after verification, so every layer holds exactly the committed
positions (no layer may keep a stale draft position), and sps's draft cache exactly the tokens it has run.

For every drafter that touches the target's cache or reuses its shallow states: early_exit, kangaroo
(chain and tree: shallow reuse + tree gathers), dvi (shallow reuse), draft_verify (writes draft KV into
the layers it runs), medusa (the tree gathers of each builder) and sps (the draft's own cache too).
Greedy and sampling (T = 1.0, seed 0), on the 4-layer model whose deep layers matter, so that runs see
both acceptances and rejections (asserted), and tree runs take a branch other than the first (a real
gather, asserted). 20 new tokens per prompt, DEEP_PROMPTS[0] and [3].
"""
from __future__ import annotations

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer, assert_cache_equals_fresh

from dvi_lite.core.engine import start, step
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.dvi.policy import DVIPolicy
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter
from dvi_lite.methods.medusa.heads import MedusaHeads

NEW = 20
SAMPLERS = {"greedy": Sampler(), "T1": Sampler(temperature=1.0)}
ACC = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]


def perturbed(module: torch.nn.Module, params, seed: int, scale: float) -> torch.nn.Module:
    """Trainable pieces moved off their identity start (seeded), so their drafts differ from early exit."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module.eval()


def pieces(model, name: str) -> dict:
    if name.startswith("kangaroo"):
        return {"adapter": KangarooAdapter(model, 2).eval()}
    if name == "dvi":
        pol = DVIPolicy(model, 2)
        return {"state": perturbed(pol, pol.trainable(), 0, 0.05)}
    if name.startswith("medusa"):
        heads = MedusaHeads(model, 3)
        return {"heads": perturbed(heads, [b.linear.weight for b in heads.blocks], 0, 0.3)}
    return {}


# name -> (method, options); the model-dependent pieces come from pieces()
CASES = {
    "early_exit": ("early_exit", {"split": 2, "K": 4}),
    "kangaroo_chain": ("kangaroo", {"split": 2, "K": 4, "threshold": None}),
    "kangaroo_tree": ("kangaroo", {"split": 2, "K": 4, "threshold": None, "branch": 3}),
    "dvi": ("dvi", {"K": 4, "threshold": None}),
    "draft_verify": ("draft_verify", {"skip": Skip(attn=frozenset({2}), mlp=frozenset({1, 2})), "K": 4,
                                      "threshold": None, "adaptive": False}),
    "medusa_cartesian": ("medusa", {"K": 3, "branch": 2, "tree": "cartesian"}),
    "medusa_pruned": ("medusa", {"K": 3, "branch": 3, "tree": "pruned", "max_nodes": 8}),
    "medusa_sparse": ("medusa", {"K": 3, "branch": 3, "tree": "sparse", "accuracies": ACC, "max_nodes": 8}),
}


def run_checked(model, drafter, prompt, sampler, name, check_draft=None) -> list:
    """Decode NEW tokens step by step; after every step the target cache (and check_draft()) equal fresh prefills."""
    state = start(Runner.for_model(model), drafter, prompt, NEW, sampler, make_generator(0))
    outcomes = []
    while state.remaining > 0:
        out, st = step(state, drafter)
        outcomes.append((out, st))
        where = f"{name} step {len(outcomes)}"
        assert out.committed == len(state.cache), where
        if state.remaining > 0:
            assert len(state.cache) == state.committed, where
        # the engine crops every layer to the accepted path: each layer holds exactly the committed positions
        # (the last step may keep the KV of accepted tokens cut at max_new_tokens: exactly out.committed then)
        assert_cache_equals_fresh(model, state.cache, state.tokens[:-1], where=where, length=out.committed)
        if check_draft is not None:
            check_draft(state, where)
    return outcomes


@pytest.mark.parametrize("mode", list(SAMPLERS))
@pytest.mark.parametrize("case", list(CASES))
def test_target_cache_equals_a_fresh_prefill_after_every_step(deep_model, case, mode):
    method, opts = CASES[case]
    spec = get_method(method)
    steps = []
    for prompt in (DEEP_PROMPTS[0], DEEP_PROMPTS[3]):
        drafter = spec.build(deep_model, IdTokenizer(), **opts, **pieces(deep_model, case))
        steps += run_checked(deep_model, drafter, prompt, SAMPLERS[mode], f"{case}/{mode}")
    assert any(st.accepted > 0 for _, st in steps), f"{case}/{mode}: no step accepted a draft"
    assert any(st.accepted < st.depth for _, st in steps), f"{case}/{mode}: no step rejected a draft"
    if "tree" in case or method == "medusa":  # a kept path that is not a prefix of the node order: a real gather
        assert any(out.path != list(range(len(out.path))) for out, _ in steps), f"{case}/{mode}: no gather"


@pytest.mark.parametrize("mode", list(SAMPLERS))
def test_sps_target_and_draft_caches_equal_fresh_prefills(target, draft, prompts, mode):
    """The draft keeps its own cache: every committed token except its `todo` ones, checked every step."""
    drafter = get_method("sps").build(target, IdTokenizer(), draft_model=draft, K=4)

    def check_draft(state, where):
        # the drafter crops its cache to the committed tokens it has run: exactly those, in every layer. After
        # the last step the tokens are cut at max_new_tokens, and the draft may have run accepted tokens past
        # the cut, so there it may hold more (strict=False)
        assert_cache_equals_fresh(draft, drafter.cache, state.tokens[: -len(drafter.todo)], where=f"{where} draft",
                                  strict=state.remaining > 0)

    steps = []
    for prompt in prompts[:2]:
        steps += run_checked(target, drafter, prompt, SAMPLERS[mode], f"sps/{mode}", check_draft)
    assert any(st.accepted == st.depth for _, st in steps) and any(st.accepted < st.depth for _, st in steps)


def test_the_strict_check_catches_a_stale_position_in_one_layer(deep_model):
    """Negative control of strictness: a cache equal to a fresh prefill except that one layer keeps an extra
    (draft) position, as a crop that forgets a layer leaves it, passes the lenient check (strict=False: a
    layer may hold more) and must fail the strict one the engine's runs are held to."""
    r = Runner(deep_model)
    tokens = DEEP_PROMPTS[0]
    cache = r.new_cache(len(tokens) + 4)
    r.forward(torch.tensor([tokens]), cache)
    assert_cache_equals_fresh(deep_model, cache, tokens, where="fresh")
    _, _, heads, _, dim = cache.k.shape  # (L, 1, H, T, D)
    stale = torch.randn(1, heads, 1, dim, generator=torch.Generator().manual_seed(0))
    cache.update(stale, stale, r.n_layers - 1)  # the last layer keeps one position more than the others
    assert_cache_equals_fresh(deep_model, cache, tokens, where="lenient", strict=False)
    with pytest.raises(AssertionError, match="layer lengths"):
        assert_cache_equals_fresh(deep_model, cache, tokens, where="stale position")


def test_a_cache_that_skips_the_gather_is_caught(deep_model, monkeypatch):
    """Negative control of the check: a tree rollback that keeps the first nodes instead of the accepted
    path (a crop where a gather is needed) must fail it."""
    from dvi_lite.core.kvcache import KVCache

    monkeypatch.setattr(KVCache, "keep", lambda self, start, idx: self.crop(start + idx.numel()))
    method, opts = CASES["medusa_cartesian"]
    drafter = get_method(method).build(deep_model, IdTokenizer(), **opts, **pieces(deep_model, "medusa_cartesian"))
    with pytest.raises(AssertionError, match="K layer|V layer"):
        for prompt in DEEP_PROMPTS:
            run_checked(deep_model, drafter, prompt, SAMPLERS["greedy"], "medusa without gather")
