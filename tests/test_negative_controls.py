"""Negative controls: lossy verifiers injected into the engine must fail the shared losslessness check.

This is how we know the check has power. Each broken rule replaces the engine's verifier (monkeypatched
into dvi_lite.core.engine, so it runs inside the one loop, through generate()), and the very check every
method passes (helpers.assert_lossless_sampling, with its default draw count) must fail on it, on the
law of the first verified token (t2 given t1). The real verifier passes the same check at the same
setting (the positive control), so the failures come from the injected rules.

Chains: sps with an independent random 1-layer draft (alpha about 0.3, so q is far enough from p that
every rule matters), K = 1 (max_new_tokens = 2: t1 from the prefill, t2 verified). Trees: early_exit
with branch = 2 (two point-mass candidates under the pending token). T = 1.0, seeds 0..N-1,
N = helpers.lossless_draws(). For both, the exact law each broken rule produces is computed from the
models' exact distributions, and its effect size w must reach helpers.W_DESIGN, the size the draw count
is powered for (99 % at alpha = 1e-3).
"""
from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, PROMPT8, W_DESIGN, exact_conditionals, lossless_draws, lossless_report, make_target

from dvi_lite.core import engine
from dvi_lite.core.sampling import Sampler, sample
from dvi_lite.core.verify import residual, verify_tree

T = 1.0
SPLIT = 1  # early_exit's exit layer on the 2-layer target8
CHAIN_BUGS = ("ignore_q", "resample_p", "accept_all", "shift_row")
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
        else:
            ratio = p[idx, draft] if bug == "ignore_q" else p[idx, draft] / q[idx, draft]
            u = torch.rand(k, generator=gen, device=p.device)
            n = int((u < ratio).int().cumprod(0).sum())
        if n < k:  # resample_p: a rejection samples p itself instead of the residual max(0, p - q)
            return n, sample(p[n] if bug == "resample_p" else residual(p[n], q[n]), gen)
        return n, sample(p[k], gen)
    return verify


def broken_tree(bug: str):
    """verify_tree (sampling) with one mistake; candidates are point masses when q is None."""
    def verify(tokens, parents, p, q, greedy, gen=None):
        assert not greedy
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
        if bug == "ignore_q":
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
        if bug == "accept_all":
            laws[a, c1] = 1
        elif bug == "resample_p":
            laws[a] = (1 - p[c1]) * (1 - p[c2]) * p
            laws[a, c1] += p[c1]
            laws[a, c2] += (1 - p[c1]) * p[c2]
        else:  # shift_row: the root's children are judged (losslessly) by the row after c1
            laws[a] = p3[a * v + c1]
    return p1[0], p2, laws


def test_the_draw_count_is_powered_for_every_control(target8, indep8):
    """Every control's exact deviation reaches W_DESIGN, the effect size lossless_draws() detects with
    99 % power; the point masses of a tree make 'ignore q' no mistake at all (next test)."""
    ws = {f"chain {b}": effect_size(*chain_laws(target8, indep8, b)) for b in CHAIN_BUGS}
    ws |= {f"tree {b}": effect_size(*tree_laws(target8, b)) for b in TREE_BUGS}
    assert min(ws.values()) >= W_DESIGN, ws
    p1, rows, _ = chain_laws(target8, indep8, "accept_all")
    assert effect_size(p1, rows, rows) == 0  # the real rule's law (= p) has no deviation


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


def _expect_failure(monkeypatch, name: str, fn, where: str, report_kw: dict) -> str:
    if fn is not None:
        monkeypatch.setattr(engine, where, fn)
    rep = lossless_report(**report_kw)
    if fn is None:  # the positive control: the real verifier passes the same check
        assert rep.ok, f"the real verifier failed the check: {rep}"
        return str(rep)
    assert rep.law_failed and not rep.ok, f"a lossy verifier ({name}) passed the check: {rep}"
    assert rep.pvalues["t2|t1"] <= ALPHA or rep.impossible["t2|t1"], f"t2|t1 did not catch {name}: {rep}"
    print(f"{name}: {rep}")  # the p-values, shown with -s
    return str(rep)


@pytest.mark.parametrize("bug", (None,) + CHAIN_BUGS)
def test_lossy_chain_verifiers_fail_the_check(monkeypatch, target8, indep8, tok8, bug):
    kw = dict(model=target8, tok=tok8, method="sps", temperature=T, max_new_tokens=2, n=lossless_draws(),
              draft_model=indep8, k=1)
    _expect_failure(monkeypatch, f"chain {bug}", bug and broken_chain(bug), "verify_sampling_chain", kw)


@pytest.mark.parametrize("bug", (None,) + TREE_BUGS)
def test_lossy_tree_verifiers_fail_the_check(monkeypatch, target8, tok8, bug):
    kw = dict(model=target8, tok=tok8, method="early_exit", temperature=T, max_new_tokens=2, n=lossless_draws(),
              split=SPLIT, k=1, branch=2)
    _expect_failure(monkeypatch, f"tree {bug}", bug and broken_tree(bug), "verify_tree", kw)
