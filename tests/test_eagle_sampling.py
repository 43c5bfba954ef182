"""EAGLE under sampling, through dvi_lite.generate: the output law equals the target's (helpers' law tests on the
vocabulary-8 target, planned draws), for the chain (speculative sampling with the head's q) and for the EAGLE-2
dynamic tree (deterministic candidates verified as point masses by the shared tree verifier's recursive
rejection). Negative control: the same tree check with a deliberately wrong acceptance rule injected into the
engine (a rejected child's probability is not removed: the next sibling is tested against p itself, not the
residual) must fail.

Drafts are K = 3 deep and max_new_tokens = 5 (the conventions of test_lossless.py): the first step verifies a
3-deep proposal, so the tests cover t1 (prefill), the verified depths t2|t1, t3|t2, t4|t3 and the bonus t5|t4.
The head is untrained (initialised from the target): its drafts are both accepted and rejected.
"""
from __future__ import annotations

import pytest
import torch
from helpers import PROMPT8, assert_lossless_sampling, lossless_report
from test_lossless import PLD_PROMPT

from dvi_lite.core import engine
from dvi_lite.core.sampling import sample
from dvi_lite.methods.eagle.head import EagleHead

NEW, K = 5, 3


@pytest.fixture(scope="module")
def head8(target8) -> EagleHead:
    return EagleHead(target8).eval()


TREE = dict(tree="dynamic", K=K, branch=2, max_nodes=6, temperature=0.7, top_k=4)  # the control's setting too


CASES = {"chain": dict(tree="chain", K=K, temperature=1.0, min_run=3),  # plain temperature
         "chain_top_p": dict(tree="chain", K=K, temperature=1.3, top_p=0.9, min_run=3),  # q filtered like p
         "dynamic": dict(TREE, min_run=2, min_depth=3),  # top-k, point-mass candidates
         # the tree with a prompt-lookup copy merged in, on a prompt whose copies are 3 deep
         "dynamic_lookup": dict(TREE, lookup=True, prompt=PLD_PROMPT, min_run=2, min_depth=3)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_eagle_is_lossless_under_sampling(target8, tok8, head8, case):
    """The chains must accept 3 drafts in a row once (then the bonus token is drawn); the tree must verify 3-deep
    proposals and accept 2-node paths (its untrained head's candidates rarely reach 3). With the other cases,
    EAGLE is tested under plain temperature, top-k and top-p."""
    opts = CASES[case]
    rep = assert_lossless_sampling(target8, tok8, "eagle", max_new_tokens=NEW, head=head8, **opts)
    print(rep)


def forgets_the_residual(tokens, parents, p, q, greedy, gen=None, probs=None):
    """verify_tree's sampling branch with one mistake: after a rejected child the next one is tested against the
    same target row p, never the residual (core.verify.residual), and the correction is drawn from p too. It
    over-weights the candidates, so the output law is no longer p."""
    assert not greedy and q is None
    p = p if probs is None else probs(p)  # the engine hands logits and the sampler's rule
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents.tolist()):
        children.setdefault(par, []).append(i)
    tok, path, node = tokens.tolist(), [], -1
    while True:
        target, nxt = p[node + 1], None
        for c in children.get(node, []):
            if float(torch.rand((), generator=gen)) < float(target[tok[c]]):
                nxt = c
                break
        if nxt is None:
            return path, sample(target, gen)
        path.append(nxt)
        node = nxt


@pytest.mark.slow
def test_a_wrong_tree_rule_fails_the_law_test(target8, tok8, head8, monkeypatch):
    """The negative control, through the engine, at the tree case's setting and planned draws: the check that the
    real rule passes above rejects a wrong multi-candidate rule."""
    monkeypatch.setattr(engine, "verify_tree", forgets_the_residual)
    rep = lossless_report(target8, tok8, "eagle", max_new_tokens=NEW, head=head8, prompt=PROMPT8, **TREE)
    assert rep.law_failed, str(rep)
    print(rep)
