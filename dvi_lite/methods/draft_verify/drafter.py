"""Draft & Verify (Zhang et al., ACL 2024): the model drafts for itself with some sub-layers skipped.

The draft is the same network with a set of attention and MLP sub-layers skipped (a mask
z in {0,1}^(2L), `core.runner.Skip`; see `skipset`); no extra parameters. Drafting writes KV only
into the layers whose attention it runs; those entries come from draft hidden states, so before
verification the engine crops every layer back to the committed length and the full model verifies
the whole draft in one pass (engine.verify_step with no Proposal.hidden).

Drafting stops when the draft's top-1 probability falls below gamma: a fixed `threshold`, or with
`adaptive=True` the paper's rule (`adaptive.AdaptiveThreshold`), which moves gamma so the acceptance
rate tracks a target. Sampling uses the shared rejection sampler: q is the skipped model's
(processed) distribution.

Which sub-layers to skip is found by Bayesian optimisation (`search`), saved per model and loaded
by `skipset.resolve_skip` (skip=None: this model's searched set).
"""
from __future__ import annotations

import torch

from dvi_lite.core.checks import check_int, check_prob
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.draft_verify.skipset import check_skip, resolve_skip


class DraftVerifyDrafter(Drafter):
    name = "draft_verify"

    def __init__(self, runner: Runner, skip: Skip, k: int = 8, threshold: float | None = 0.6,
                 adaptive: AdaptiveThreshold | None = None):
        self.runner = runner
        self.skip = check_skip(skip, runner.n_layers)
        self.k = self.max_draft = check_int("k (draft length)", k, 1)
        self.threshold = None if threshold is None else check_prob("threshold (gamma)", threshold)
        self.adaptive = adaptive

    @property
    def gamma(self) -> float | None:
        """The exit threshold in force: the adaptive rule's gamma, else the fixed threshold (None: never exit)."""
        return self.adaptive.gamma if self.adaptive is not None else self.threshold

    def should_stop(self, confidence: float) -> bool:
        """Stop drafting: the draft's top-1 probability is below gamma (the adaptive rule's, else the fixed one)."""
        if self.adaptive is not None:
            return self.adaptive.should_stop(confidence)
        return self.threshold is not None and confidence < self.threshold

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        if self.adaptive is not None:
            self.adaptive.reset()  # per generation, as in the authors' code

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        r, cache = self.runner, state.cache
        past = state.committed
        cache.crop(past)  # drop draft KV of the last round from the layers drafting ran
        steps = max(1, min(self.k, state.remaining - 1))
        tok, tokens, qs = state.pending, [], []
        for i in range(steps):
            ids = torch.tensor([[tok]], device=state.device)
            pos = torch.tensor([[past + i]], device=state.device)
            h = r.layers_forward(r.embed(ids), cache, pos, skip=self.skip)  # (1, 1, D)
            logits = r.logits(h)[0, -1]  # (V,)
            q = state.sampler.probs(logits)  # the law drafts are sampled from (one-hot when greedy)
            tok = int(q.argmax()) if state.sampler.greedy else int(torch.multinomial(q, 1, generator=state.gen))
            # stop on the draft's top-1 probability, never on the sampled token's own probability: keeping
            # x ~ q only when q(x) >= gamma would draft from q truncated, not q, and verification (which
            # divides by q) would no longer be lossless. Greedy: the same thing (x is the top-1).
            if i > 0 and self.gamma is not None and self.should_stop(float(state.sampler.confidence(logits).max())):
                break  # the draft is unsure here: stop (at least one token is always drafted)
            tokens.append(tok)
            qs.append(q)
        cache.crop(past)  # the draft KV came from skipped-layer states: verification recomputes every layer
        return Proposal(torch.tensor(tokens, device=state.device), None if state.sampler.greedy else torch.stack(qs))

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        if self.adaptive is not None:
            n, a = len(outcome.proposal), outcome.n_accepted
            self.adaptive.update(a, a + (a < n), reached_max=n >= self.k)


def make_drafter(model, tokenizer, skip=None, k: int = 8, threshold: float | None = 0.6, adaptive: bool = True,
                 target_alpha: float = 0.9) -> DraftVerifyDrafter:
    """Layer-skipping self-speculation; gamma starts at `threshold` and adapts towards target_alpha unless
    adaptive=False (then `threshold` is fixed; None = always draft k)."""
    if threshold is not None:
        threshold = check_prob("threshold (gamma, or its start value when adaptive)", threshold)
    ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=threshold if threshold is not None else 0.8) \
        if adaptive else None
    return DraftVerifyDrafter(Runner.for_model(model), resolve_skip(model, skip), k, threshold, ctl)
