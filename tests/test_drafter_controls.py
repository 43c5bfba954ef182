"""Drafter-side negative controls: a drafter whose reported q is not the law it sampled its drafts from must fail
the shared losslessness check (helpers.lossless_report), as the lossy verifiers of test_negative_controls.py do.

The verifier's rule accepts a draft x with probability min(1, p(x) / q(x)) and resamples norm(max(0, p - q)):
lossless only when q is the law x was drawn from. Two mistakes a drafter can make, injected into sps's drafter
(DraftModelDrafter.propose, monkeypatched, run through generate()):
  * q_at_2T: it samples at temperature T but reports q at 2T (a flatter law);
  * topk_unnormalised: it samples from top-k (renormalised, as the Sampler does) but reports the untruncated
    softmax restricted to the top k, not renormalised (each q(x) too small by the top-k mass).
K = 1 (t2 is the verified token), at T = 1.5 where the mistakes are largest: q_at_2T with the 1-layer draft8
(exact w = 0.256), topk_unnormalised (top-2) with an independent random 1-layer draft (w = 0.144). Each mistake's
exact law of t2 given t1 is computed from the models' exact distributions, and the check runs
planned_draws(w = min(that w, W_DESIGN)) draws: 99 % power at ALPHA against the mistake's own size (2,175 at
w = 0.144, top-2 cells; a mistake below W_DESIGN is one the law tests of test_lossless.py are not sized for). The same
replacement reporting the q it sampled from (the positive control) passes the same check.
"""
from __future__ import annotations

import pytest
import torch
from helpers import (
    ALPHA,
    DEPTH_TESTS,
    PROMPT8,
    W_DESIGN,
    exact_conditionals,
    exact_joint,
    lossless_report,
    make_target,
    pair_laws,
    planned_depth_draws,
    planned_draws,
)

from dvi_lite.core.engine import Proposal
from dvi_lite.core.sampling import Sampler
from dvi_lite.core.verify import residual
from dvi_lite.methods.sps.drafter import DraftModelDrafter

# bug -> (the draft, the sampler): settings where the mistake is large (its exact w is printed and used)
BUGS = {"q_at_2T": ("draft8", dict(temperature=1.5)), "topk_unnormalised": ("indep8", dict(temperature=1.5, top_k=2))}


DEEP_REACH = (1.0, 0.55, 0.26, 0.14)  # step 1's reach of depth 1, 2, 3 and the bonus (see the last test)


@pytest.fixture(scope="module")
def indep8():
    """A draft that shares nothing with target8: a random 1-layer vocabulary-8 model."""
    return make_target(vocab=8, layers=1, seed=7)


def reported(bug: str | None, sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """The q a drafter with `bug` reports for a draft drawn from sampler.probs(logits) (None: that q itself)."""
    if bug == "q_at_2T":
        return Sampler(2 * sampler.temperature, sampler.top_k, sampler.top_p).probs(logits)
    q = sampler.probs(logits)
    if bug == "topk_unnormalised":
        return (logits.float() / sampler.temperature).softmax(-1) * (q > 0)
    return q


def lying_propose(bug: str | None, from_depth: int = 1):
    """DraftModelDrafter.propose, sampling each draft from q but reporting reported(bug) from `from_depth` on."""
    @torch.no_grad()
    def propose(self, state) -> Proposal:
        k = max(1, min(self.K, state.remaining - 1))
        self.base, self.n_todo = len(self.cache), len(self.todo)
        inp = torch.tensor([self.todo], device=state.device)
        tokens, qs = [], []
        for i in range(k):
            logits, _ = self.runner.forward(inp, self.cache)
            q = state.sampler.probs(logits[0, -1])
            x = int(torch.multinomial(q, 1, generator=state.gen))
            qs.append(reported(bug, state.sampler, logits[0, -1]) if i + 1 >= from_depth else q)
            tokens.append(x)
            inp = torch.tensor([[x]], device=state.device)
        return Proposal(torch.tensor(tokens, device=state.device), torch.stack(qs))
    return propose


@torch.no_grad()
def effect_size(target8, draft, bug: str) -> float:
    """Cohen's w of the exact law of t2 given t1 under `bug` (K = 1) against the target's, weighted by P(t1)."""
    s, v = Sampler(**BUGS[bug][1]), target8.config.vocab_size
    p1, p2 = exact_conditionals(target8, s, PROMPT8, 2)
    logits = draft(torch.tensor([PROMPT8 + [a] for a in range(v)])).logits[:, -1].double()
    w2 = 0.0
    for a in range(v):
        p, q, r = p2[a], s.probs(logits[a]).double(), reported(bug, s, logits[a]).double()
        acc = q * torch.clamp(p / r.clamp_min(1e-300), max=1.0) * (r > 0)
        law = acc + (1 - acc.sum()) * residual(p, r)
        w2 += float(p1[0, a] * torch.where(p > 0, (law - p) ** 2 / p.clamp_min(1e-300), law * 1e300).sum())
    return w2 ** 0.5


def draws_for(target8, draft, bug: str) -> tuple[float, int]:
    """(the mistake's exact w, the draws planned for 99 % power at min(w, W_DESIGN))."""
    w = effect_size(target8, draft, bug)
    laws = pair_laws(exact_joint(target8, Sampler(**BUGS[bug][1]), PROMPT8, 2))
    return w, planned_draws(laws, w=min(w, W_DESIGN))


@pytest.mark.parametrize("bug", [None, *BUGS])
def test_a_drafter_reporting_another_q_fails_the_check(monkeypatch, target8, draft8, indep8, tok8, bug):
    draft, sampling = BUGS.get(bug, ("indep8", dict(temperature=1.0)))
    draft = draft8 if draft == "draft8" else indep8
    w, n = (W_DESIGN, None) if bug is None else draws_for(target8, draft, bug)
    assert w > 0.1, f"{bug}: exact w = {w:.3f}, hardly a mistake in this setting"
    monkeypatch.setattr(DraftModelDrafter, "propose", lying_propose(bug))
    rep = lossless_report(target8, tok8, "sps", max_new_tokens=2, draft_model=draft, K=1, n=n, **sampling)
    if bug is None:  # the positive control: the replacement, reporting the q it sampled from, passes
        assert rep.ok, f"the honest replacement drafter failed the check: {rep}"
    else:
        assert rep.law_failed and not rep.ok, f"a drafter reporting {bug} passed the check: {rep}"
        assert rep.pvalues["t2|t1"] <= ALPHA or rep.impossible["t2|t1"], str(rep)
        assert rep.pvalues["t1"] > ALPHA, str(rep)  # t1 comes from the prefill: no drafter touches it
    print(f"{bug}: exact w {w:.3f}: {rep}")


def test_a_drafter_wrong_only_past_depth_one_is_caught_at_its_depth(monkeypatch, target8, draft8, tok8):
    """The depth tests have power of their own on the drafter side: q at 2T reported from depth 2 on (K = 3,
    5 new tokens, draft8 at T = 1.5) leaves t1 and depth 1 right and must fail the depth-2 test. The draws are
    planned from this setting's reach of depth 2 (measured with the honest drafter, 300 draws: depth 2 0.55,
    depth 3 0.26, bonus 0.14) for 99 % power at W_DESIGN at depths 1 and 2 (helpers.planned_depth_draws, 2,150
    draws), then doubled: this mistake is smaller than W_DESIGN at depth 2 (its p-value there was 2.7e-5 at
    2,150 draws, just above ALPHA, and 1.9e-17 at 7,550, the draws all four depths would take)."""
    monkeypatch.setattr(DraftModelDrafter, "propose", lying_propose("q_at_2T", from_depth=2))
    sampling = BUGS["q_at_2T"][1]
    laws = pair_laws(exact_joint(target8, Sampler(**sampling), PROMPT8, 5))
    n = 2 * planned_depth_draws(laws, dict(zip(DEPTH_TESTS[:2], DEEP_REACH[:2], strict=True)))
    rep = lossless_report(target8, tok8, "sps", max_new_tokens=5, draft_model=draft8, K=3, n=n, depths=True,
                          min_power=0.0, **sampling)
    assert rep.law_failed and not rep.ok, f"a drafter reporting q at 2T past depth 1 passed the check: {rep}"
    assert rep.pvalues["depth2"] <= ALPHA or rep.impossible["depth2"], str(rep)
    assert all(rep.pvalues[t] > ALPHA for t in ("t1", "depth1")), str(rep)  # the mistake cannot reach these
    print(f"q_at_2T from depth 2: {rep}")
