"""Draft & Verify (Zhang et al., ACL 2024): the model drafts for itself with some sub-layers skipped.

The draft is the same network with a set of attention and MLP sub-layers skipped (a mask
z in {0,1}^(2L), `core.runner.Skip`; see `skipset`); no extra parameters. Drafting writes KV only
into the layers whose attention it runs; those entries come from draft hidden states, so before
verification the engine crops every layer back to the committed length and the full model verifies
the whole draft in one pass (engine.verify_step with no Proposal.hidden).

Drafting stops after the first token whose top-1 probability falls below gamma (that token is still
proposed, as in the authors' decoding: their `drafted_n_tokens` counts it): a fixed `threshold`, or with
`adaptive=True` the authors' rule (`adaptive.AdaptiveThreshold`), which moves gamma after every
verification from accepted / drafted. Both start at the authors' th_stop_draft = 0.8. Sampling uses the
shared rejection sampler: q is the skipped model's (processed) distribution. `vocab`: a trimmed draft
head over the N most frequent tokens (models.vocab); verification keeps the full head (lossless).

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
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab


class DraftVerifyDrafter(Drafter):
    name = "draft_verify"

    def __init__(self, runner: Runner, skip: Skip, k: int = 8, threshold: float | None = 0.8,
                 adaptive: AdaptiveThreshold | None = None, vocab: TrimmedHead | None = None):
        self.runner = runner
        self.vocab = vocab  # None: the model's full LM head drafts
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

    def extra_params(self) -> int:
        """Values the drafter adds to the target: none (a skip set), but a trimmed head's selected rows."""
        return 0 if self.vocab is None else self.vocab.numel

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
            logits = (r.logits(h) if self.vocab is None else self.vocab(r.norm(h)))[0, -1]  # (V,)
            q = state.sampler.probs(logits)  # the law drafts are sampled from (one-hot when greedy)
            tok = int(q.argmax()) if state.sampler.greedy else int(torch.multinomial(q, 1, generator=state.gen))
            # stop on the draft's top-1 probability, never on the sampled token's own probability: keeping
            # x ~ q only when q(x) >= gamma would draft from q truncated, not q, and verification (which
            # divides by q) would no longer be lossless. Greedy: the same thing (x is the top-1).
            tokens.append(tok)
            qs.append(q)
            if self.gamma is not None and self.should_stop(float(state.sampler.confidence(logits).max())):
                break  # the draft is unsure here: this token is proposed, the next is not drafted
        cache.crop(past)  # the draft KV came from skipped-layer states: verification recomputes every layer
        return Proposal(torch.tensor(tokens, device=state.device), None if state.sampler.greedy else torch.stack(qs))

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        if self.adaptive is not None:  # the authors' matchness: (max_matched - 1) / drafted_n_tokens
            n, a = len(outcome.proposal), outcome.n_accepted
            self.adaptive.update(a, n, reached_max=n >= self.k)


def make_drafter(model, tokenizer, skip=None, k: int = 8, threshold: float | None = 0.8, adaptive: bool = True,
                 target_alpha: float = 0.9, vocab=None) -> DraftVerifyDrafter:
    """Layer-skipping self-speculation; gamma starts at `threshold` (the authors' 0.8) and adapts towards
    target_alpha unless adaptive=False (then `threshold` is fixed; None = always draft k). vocab: a trimmed
    draft head (models.vocab.resolve_vocab)."""
    if threshold is not None:
        threshold = check_prob("threshold (gamma, or its start value when adaptive)", threshold)
    ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=threshold if threshold is not None else 0.8) \
        if adaptive else None
    return DraftVerifyDrafter(Runner.for_model(model), resolve_skip(model, skip), k, threshold, ctl,
                              resolve_vocab(model, tokenizer, vocab))
