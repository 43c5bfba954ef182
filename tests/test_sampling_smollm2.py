"""A sampling-law test on the real model: SmolLM2 in fp32 with its committed Kangaroo adapter (trained, exit layer
4, a trimmed 8192-token draft head), under top-p and a temperature (issue 30, item 3).

The real-model tests elsewhere are greedy only. What this adds: the trained drafter's proposals on a 49,152-token
vocabulary, drawn through its trimmed head and mapped back, meet the engine's rejection sampling, and the tokens
follow the target's processed law p. The tiny-model tests cannot see a bug of the trimmed-head mapping under
top-p (a q reported over the full vocabulary but drawn on the map, say).

Cost: a full `generate` per draw would be two 30-layer forwards of SmolLM2 in fp32 each (about 0.3 s each on one
core), so the draws share one prefill. `engine.start` prefills the prompt once and samples t1; each draw then
copies that state and the drafter (the model's weights are shared, never copied), lets the real drafter
`propose` K = 1 token with the draw's own generator, and verifies it with the engine's `verify_sampling_chain`
against the target's processed p at [t1, x1]. The verification forward depends only on the proposed token, so it
is computed once per distinct draft inside p's top-p set (a handful) instead of per draw.

Tested: t2 | t1 on every draw (the first verified token: the accepted draft or the residual sample), with
helpers.law_test at helpers.ALPHA. The adapter's acceptance here is low (about 0.08: top-p keeps 6 target
tokens), so the residual path carries most of the law and a second position would have too few draws to test.
Power: DRAWS draws detect an effect of Cohen's w >= W_SMOL in the t2
test with probability >= 0.99 (helpers.chi2_power at the degrees of freedom left after pooling; asserted).
"""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import ALPHA, chi2_power, law_test

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name three colors."}]  # chat template: the prefill is shared
SAMPLER = dict(temperature=0.8, top_p=0.7)  # a few tokens keep 0.7 of the sharpened mass
K = 1
DRAWS = 450
W_SMOL = 0.35  # the smallest deviation (Cohen's w) of the t2 law the test must detect with 99 % power


def _shared_memo(*roots) -> dict:
    """A deepcopy memo mapping every module and every large tensor (>= 2**16 elements: weights, a trimmed head)
    reachable from `roots` to itself, so that a copy of a decode state or a drafter shares them and copies only
    its small, mutable parts (KV caches of a few positions, counters)."""
    memo: dict = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                memo[id(m)] = m
            for t in [*obj.parameters(), *obj.buffers()]:
                memo[id(t)] = t
            todo += list(vars(obj).values())
        elif isinstance(obj, torch.Tensor):
            if obj.numel() >= 2 ** 16:
                memo[id(obj)] = obj
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += list(vars(obj).values())
    return memo


@torch.no_grad()
def first_verified_draws(model, tok, method: str, n: int, sampler_kw: dict, k: int, **opts) -> dict:
    """n draws of one speculative step after a shared prefill (see the module docstring): the t1 of the prefill,
    per draw the first verified token t2 and, when x1 was accepted, t3; the exact p at every tested context."""
    from dvi_lite.core.engine import start
    from dvi_lite.core.generate import prompt_ids
    from dvi_lite.core.registry import get_method
    from dvi_lite.core.runner import Runner
    from dvi_lite.core.sampling import Sampler, make_generator
    from dvi_lite.core.verify import verify_sampling_chain

    sampler = Sampler(**sampler_kw)
    ids = prompt_ids(tok, PROMPT)
    runner = Runner.for_model(model)
    drafter = get_method(method).build(model, tok, K=k, **opts)
    state0 = start(runner, drafter, ids, 2 + k, sampler, make_generator(0, runner.device))
    ctx = state0.tokens  # prompt + t1 (pending)
    memo = _shared_memo(model, drafter, state0)
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def row(tail: tuple[int, ...]) -> torch.Tensor:
        """(V,) processed p after ctx + tail: one forward per distinct tail."""
        if tail not in rows:
            x = torch.tensor([ctx + list(tail)], device=runner.device)
            rows[tail] = sampler.probs(model(x).logits[0, -1].double()).float()
        return rows[tail]

    def target_probs(toks: tuple[int, ...]) -> torch.Tensor:
        """(k + 1, V) p after ctx + toks[:j]; a row after a token of probability 0 is never read by the verifier
        (that token is rejected for sure, u < 0 never holds), so it is row 0 again and costs no forward."""
        out = [row(())]
        for j in range(len(toks)):
            out.append(row(toks[: j + 1]) if out[-1][toks[j]] > 0 and len(out) == j + 1 else out[0])
        return torch.stack(out)

    t2s, accepted = [], 0
    for i in range(n):
        state = copy.deepcopy(state0, dict(memo))
        dr = copy.deepcopy(drafter, dict(memo))
        state.gen = make_generator(i, runner.device)
        prop = dr.propose(state)
        assert prop.parents is None and len(prop) == k and prop.q is not None, "a chain of k drafts with their q"
        toks = tuple(prop.tokens.tolist())
        n_acc, nxt = verify_sampling_chain(prop.tokens, prop.q, target_probs(toks), state.gen)
        t2s.append(toks[0] if n_acc else nxt)
        accepted += n_acc
    return {"t1": ctx[-1], "t2": t2s, "accepted": accepted, "p_t2": row(()), "forwards": len(rows)}


def test_kangaroo_on_smollm2_fp32_follows_the_target_law_under_top_p():
    from test_smollm2 import smollm2

    model, tok = smollm2("float32")
    res = first_verified_draws(model, tok, "kangaroo", DRAWS, SAMPLER, K, threshold=None)
    c2 = torch.zeros(1, res["p_t2"].numel(), dtype=torch.float64)
    for t in res["t2"]:
        c2[0, t] += 1
    t2 = law_test(c2, res["p_t2"][None], DRAWS, "t2 | t1")
    power = chi2_power(t2.df, t2.n, W_SMOL) if t2.testable else 0.0
    summary = (f"t1={res['t1']}, {DRAWS} draws, {res['accepted']} drafts accepted, {res['forwards']} target "
               f"forwards; {t2.name}: df {t2.df}, n {t2.n}, power at w = {W_SMOL}: {power:.3f}")
    print(summary)
    assert t2.impossible == 0, f"first verified tokens of probability 0 (outside top-p): {summary}"
    assert 0 < res["accepted"] < DRAWS, f"drafts must be both accepted and rejected: {summary}"
    assert power >= 0.99, f"the t2 test is under-powered: {summary}"
    assert t2.pvalue > ALPHA, f"{summary}, p = {t2.pvalue:.3g}"
