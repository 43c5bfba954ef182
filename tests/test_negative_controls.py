"""Negative controls: lossy verifiers injected into the engine must fail the shared losslessness check.

This is how we know the check has power. Each broken rule replaces the engine's verifier (monkeypatched
into dvi_lite.core.engine, so it runs inside the one loop, through generate()), and the very check every
method passes (helpers.assert_lossless_sampling, with its planned draw count) must fail on it. The real
verifier passes the same check at the same setting (the positive control), so the failures come from the
injected rules.

First verified token (t2 given t1). Chains: sps with an independent random 1-layer draft (alpha about 0.3,
so q is far enough from p that every rule matters), K = 1 (max_new_tokens = 2: t1 from the prefill, t2
verified). Trees: early_exit with branch = 2 (two point-mass candidates under the pending token). T = 1.0,
seeds 0..N-1, N = helpers.planned_draws() (1,225 here: 99 % power at w = 0.25, alpha = 2.5e-5, for t1 and
t2|t1). For both, the exact law each broken rule produces is computed from the models' exact distributions,
its effect size w must reach helpers.W_DESIGN, and the exact law of the real rule must have w = 0.

Deeper tokens. A rule that is right at depth 1 and wrong after it (K = 3, 5 new tokens) must pass t2|t1 and
fail t3|t2 or t4|t3; a bonus token drawn from the wrong row must pass t2|t1 and fail the bonus token's test.
And a law test left with no testable cell fails instead of passing with p = 1.
"""
from __future__ import annotations

import sys

import pytest
import torch
from helpers import (
    ALPHA,
    PROMPT8,
    W_DESIGN,
    NoTestableCell,
    exact_conditionals,
    law_test,
    lossless_report,
    make_target,
)

from dvi_lite.core import engine
from dvi_lite.core.sampling import Sampler, sample
from dvi_lite.core.verify import residual, verify_tree

T = 1.0
SPLIT = 1  # early_exit's exit layer on the 2-layer target8
CHAIN_BUGS = ("ignore_q", "resample_p", "accept_all", "shift_row")
DEEP_BUGS = ("deep_accept_all", "bonus_prev_row")  # wrong only past the first verified token (K = 3)
TREE_BUGS = ("resample_p", "accept_all", "shift_row")


@pytest.fixture(scope="module")
def indep8():
    """A draft that shares nothing with target8: a random 1-layer vocabulary-8 model."""
    return make_target(vocab=8, layers=1, seed=7)


def broken_chain(bug: str):
    """verify_sampling_chain with one mistake (signature and randomness as the real one)."""
    def verify(draft, q, p, gen=None):
        if bug == "shift_row":  # off by one: draft i is judged by the target row after it
            p = torch.cat([p[1:], p[-1:]])
        k = draft.numel()
        idx = torch.arange(k, device=p.device)
        if bug == "accept_all":
            n = k
        elif bug == "deep_accept_all":  # the first draft is judged, every later one accepted: depths >= 2 wrong
            u = torch.rand(k, generator=gen, device=p.device)
            n = k if float(u[0]) < float(p[0, draft[0]] / q[0, draft[0]]) else 0
        else:
            ratio = p[idx, draft] if bug == "ignore_q" else p[idx, draft] / q[idx, draft]
            u = torch.rand(k, generator=gen, device=p.device)
            n = int((u < ratio).int().cumprod(0).sum())
        if n < k:  # resample_p: a rejection samples p itself instead of the residual max(0, p - q)
            return n, sample(p[n] if bug == "resample_p" else residual(p[n], q[n]), gen)
        return n, sample(p[k - 1] if bug == "bonus_prev_row" else p[k], gen)  # bonus_prev_row: the draft's row
    return verify


def broken_tree(bug: str):
    """verify_tree (sampling) with one mistake; candidates are point masses when q is None."""
    def verify(tokens, parents, p, q, greedy, gen=None, probs=None):
        assert not greedy
        p = p if probs is None else probs(p)  # the engine hands logits and the sampler's rule: every row here
        children: dict[int, list[int]] = {}
        for i, par in enumerate(parents.tolist()):
            children.setdefault(par, []).append(i)
        tok, path, node = tokens.tolist(), [], -1
        while True:
            row = min(node + 2, p.shape[0] - 1) if bug == "shift_row" else node + 1  # shift: the child's row
            target, nxt = p[row], None
            for c in children.get(node, []):
                qc = q[c] if q is not None else torch.nn.functional.one_hot(tokens[c], p.shape[-1]).to(p.dtype)
                if bug == "accept_all" or float(torch.rand((), generator=gen)) < float(target[tok[c]] / qc[tok[c]]):
                    nxt = c
                    break
                if bug != "resample_p":  # resample_p forgets to remove what the rejected child covered
                    target = residual(target, qc)
            if nxt is None:
                return path, sample(target, gen)
            path.append(nxt)
            node = nxt
    return verify


# ---------------------------------------------------------------- exact laws of the broken rules (t2 given t1)

def effect_size(p1: torch.Tensor, rows: torch.Tensor, laws: torch.Tensor) -> float:
    """Cohen's w of the conditional laws laws[a] against rows[a], weighted by P(t1 = a); inf when a
    law puts mass where the target has none (then a token of probability 0 fails the check outright)."""
    if (laws[rows == 0] > 1e-12).any():
        return float("inf")
    safe = rows.clamp_min(1e-300)
    return float((p1[:, None] * torch.where(rows > 0, (laws - rows) ** 2 / safe, 0)).sum().sqrt())


@torch.no_grad()
def chain_laws(target8, draft, bug: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P(t1), P(t2 | t1) exact, P(t2 | t1) under `bug`) for sps with K = 1."""
    s, v = Sampler(T), target8.config.vocab_size
    p1, p2, p3 = exact_conditionals(target8, s, PROMPT8, 3)
    qs = s.probs(draft(torch.tensor([PROMPT8 + [a] for a in range(v)])).logits[:, -1].double()).double()  # (V, V)
    laws = torch.zeros(v, v, dtype=torch.float64)
    for a in range(v):
        p, q = p2[a], qs[a]
        if bug == "none":  # the real rule: accept min(p, q), else the residual
            acc = torch.minimum(p, q)
            laws[a] = acc + (1 - acc.sum()) * residual(p, q)
        elif bug == "ignore_q":
            laws[a] = q * p + (1 - (q * p).sum()) * residual(p, q)
        elif bug == "resample_p":
            acc = torch.minimum(p, q)
            laws[a] = acc + (1 - acc.sum()) * p
        elif bug == "accept_all":
            laws[a] = q
        else:  # shift_row: draft d judged by P(. | t1 = a, d), the residual too
            for d in range(v):
                if q[d] > 0:
                    pd = p3[a * v + d]
                    acc = min(1.0, float(pd[d] / q[d]))
                    laws[a, d] += q[d] * acc
                    laws[a] += q[d] * (1 - acc) * residual(pd, q)
    return p1[0], p2, laws


@torch.no_grad()
def tree_laws(target8, bug: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same for early_exit branch = 2: under the pending token a, the candidates c1, c2 are the top-2
    of the exit-layer draft, tested in order as point masses."""
    s, v = Sampler(T), target8.config.vocab_size
    p1, p2, p3 = exact_conditionals(target8, s, PROMPT8, 3)
    out = target8(torch.tensor([PROMPT8 + [a] for a in range(v)]), output_hidden_states=True)
    h = out.hidden_states[SPLIT][:, -1]  # (V, D): the exit layer's state at the pending token
    conf = s.probs(target8.lm_head(target8.model.norm(h)).double())
    laws = torch.zeros(v, v, dtype=torch.float64)
    for a in range(v):
        c1, c2 = conf[a].topk(2).indices.tolist()
        p = p2[a]
        if bug == "none":  # the real rule: c1 with p(c1), else c2 from the residual, else the residual's residual
            one = torch.nn.functional.one_hot(torch.tensor([c1, c2]), v).double()
            r1 = residual(p, one[0])
            laws[a] = p[c1] * one[0] + (1 - p[c1]) * (r1[c2] * one[1] + (1 - r1[c2]) * residual(r1, one[1]))
        elif bug == "accept_all":
            laws[a, c1] = 1
        elif bug == "resample_p":
            laws[a] = (1 - p[c1]) * (1 - p[c2]) * p
            laws[a, c1] += p[c1]
            laws[a, c2] += (1 - p[c1]) * p[c2]
        else:  # shift_row: the root's children are judged (losslessly) by the row after c1
            laws[a] = p3[a * v + c1]
    return p1[0], p2, laws


def test_the_draw_count_is_powered_for_every_control(target8, indep8):
    """Every control's exact deviation reaches W_DESIGN, the effect size the planned draws detect with
    POWER (99 %) at ALPHA; the point masses of a tree make 'ignore q' no mistake at all (see below)."""
    ws = {f"chain {b}": effect_size(*chain_laws(target8, indep8, b)) for b in CHAIN_BUGS}
    ws |= {f"tree {b}": effect_size(*tree_laws(target8, b)) for b in TREE_BUGS}
    assert min(ws.values()) >= W_DESIGN, ws


def assert_law_is_p(laws_fn) -> None:
    """The exact law that laws_fn() computes for the real rule (from the package's residual) equals the
    target's: w = 0 up to float32 rounding in residual (a mistake gives w >= W_DESIGN). So the exact-law
    machinery the effect sizes above rest on agrees with the verifier's rule."""
    w = effect_size(*laws_fn())
    assert w < 1e-4, f"the real rule's exact law is not p: w = {w}"


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_the_real_rules_exact_law_is_p_and_a_wrong_residual_is_caught(target8, indep8, monkeypatch, kind):
    """Positive and negative control of the exact laws: the real rule's law has w = 0 (it used to compare p
    with itself, which cannot fail); the same law built with a wrong residual (p itself: 'resample p') fails."""
    laws_fn = (lambda: chain_laws(target8, indep8, "none")) if kind == "chain" else (lambda: tree_laws(target8, "none"))
    assert_law_is_p(laws_fn)
    monkeypatch.setattr(sys.modules[__name__], "residual", lambda p, q: p)
    with pytest.raises(AssertionError, match="not p"):
        assert_law_is_p(laws_fn)


def test_ignore_q_is_the_real_rule_for_point_masses():
    """A tree of point masses (q = None) has q(x) = 1: accepting with probability p(x) IS the rule, so
    there is no 'ignore q' mistake to inject into trees; the chain controls cover it."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 8, generator=g), -1)
    tokens, parents = torch.tensor([1, 2, 5]), torch.tensor([-1, -1, 0])
    for seed in range(200):
        a = verify_tree(tokens, parents, p, None, False, torch.Generator().manual_seed(seed))
        b = broken_tree("none")(tokens, parents, p, None, False, torch.Generator().manual_seed(seed))
        assert a == b, seed


def _expect_failure(monkeypatch, name: str, fn, where: str, report_kw: dict, caught_by: tuple[str, ...] = ("t2|t1",),
                    clean: tuple[str, ...] = ()) -> str:
    """Run the shared check with `fn` injected as engine.`where` (None: the real verifier, which must pass).
    A lossy rule must fail it, with a p-value <= ALPHA (or a probability-0 token) in some test of
    `caught_by`, while the tests in `clean` (the tokens the mistake cannot reach) pass."""
    if fn is not None:
        monkeypatch.setattr(engine, where, fn)
    rep = lossless_report(**report_kw)
    if fn is None:  # the positive control: the real verifier passes the same check
        assert rep.ok, f"the real verifier failed the check: {rep}"
        return str(rep)
    assert rep.law_failed and not rep.ok, f"a lossy verifier ({name}) passed the check: {rep}"
    caught = [t for t in caught_by if rep.pvalues.get(t, 1.0) <= ALPHA or rep.impossible.get(t)]
    assert caught, f"{caught_by} did not catch {name}: {rep}"
    assert all(rep.pvalues.get(t, 0.0) > ALPHA for t in clean), f"{name} is wrong only past {clean}, but: {rep}"
    print(f"{name}: {rep}")  # the p-values and powers, shown with -s
    return str(rep)


@pytest.mark.parametrize("bug", (None,) + CHAIN_BUGS)
def test_lossy_chain_verifiers_fail_the_check(monkeypatch, target8, indep8, tok8, bug):
    kw = dict(model=target8, tok=tok8, method="sps", temperature=T, max_new_tokens=2, draft_model=indep8, K=1)
    _expect_failure(monkeypatch, f"chain {bug}", bug and broken_chain(bug), "verify_sampling_chain", kw)


@pytest.mark.parametrize("bug", (None,) + TREE_BUGS)
def test_lossy_tree_verifiers_fail_the_check(monkeypatch, target8, tok8, bug):
    kw = dict(model=target8, tok=tok8, method="early_exit", temperature=T, max_new_tokens=2, split=SPLIT, K=1, branch=2)
    _expect_failure(monkeypatch, f"tree {bug}", bug and broken_tree(bug), "verify_tree", kw)


def test_a_mistake_past_the_first_verified_token_is_caught_at_its_depth(monkeypatch, target8, indep8, tok8):
    """The deeper tests have power of their own: a rule that judges the first draft right and accepts every
    later one (K = 3, 5 new tokens) passes t1 and t2|t1 and must fail at t3|t2 or t4|t3 (depths 2 and 3)."""
    kw = dict(model=target8, tok=tok8, method="sps", temperature=T, max_new_tokens=5, draft_model=indep8, K=3)
    _expect_failure(monkeypatch, "chain deep_accept_all", broken_chain("deep_accept_all"), "verify_sampling_chain",
                    kw, caught_by=("t3|t2", "t4|t3"), clean=("t1", "t2|t1"))


def test_a_wrong_bonus_token_is_caught(monkeypatch, target8, tok8):
    """The bonus token has a test of its own: with the target as its own draft every draft is accepted, so
    t3 (K = 1, 3 new tokens) is always the bonus; drawing it from the last draft's row p[K-1] instead of
    p[K] leaves t1 and t2 right and must fail t3|t2."""
    kw = dict(model=target8, tok=tok8, method="sps", temperature=T, max_new_tokens=3, draft_model=target8, K=1,
              drafts=False)
    _expect_failure(monkeypatch, "chain bonus_prev_row", broken_chain("bonus_prev_row"), "verify_sampling_chain",
                    kw, caught_by=("t3|t2",), clean=("t1", "t2|t1"))


def test_a_law_test_with_no_testable_cell_fails():
    """A test whose cells all pool into one cannot contradict the law: it must fail, never pass with p = 1
    (chi2_sf used to return 1.0 there). Negative control: the old rule is what this test rejects."""
    point = torch.zeros(1, 8, dtype=torch.float64)
    point[0, 3] = 1  # a deterministic token: one cell
    test = law_test(torch.tensor([[0, 0, 0, 40, 0, 0, 0, 0]]), point, name="t9|t8")
    assert not test.testable and test.power == 0
    with pytest.raises(NoTestableCell, match="no testable cell"):
        _ = test.pvalue
    few = law_test(torch.tensor([[1, 0, 1, 0, 0, 0, 0, 0]]), torch.full((1, 8), 1 / 8), name="few draws")
    with pytest.raises(NoTestableCell):
        _ = few.pvalue


def test_a_report_without_a_testable_cell_fails(target8, tok8):
    """End to end: 3 draws leave no testable cell in any test, so the report fails (it used to pass)."""
    rep = lossless_report(target8, tok8, "ar", max_new_tokens=2, n=3, drafts=False)
    assert not rep.ok and any("no testable cell" in p for p in rep.problems), str(rep)
