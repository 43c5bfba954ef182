"""Draft & Verify (Zhang et al., ACL 2024): the model drafts for itself with some sub-layers skipped.

The draft is the same network with a set of attention and MLP sub-layers skipped (a mask
z in {0,1}^(2L), `core.runner.Skip`; see `skipset`); no extra parameters. Drafting writes KV only
into the layers whose attention it runs; those entries come from draft hidden states, so before
verification the engine crops every layer back to the committed length and the full model verifies
the whole draft in one pass (engine.verify_step with no Proposal.hidden).

Drafting stops after the first token whose top-1 probability falls below gamma (that token is still
proposed, as in the authors' decoding: their `drafted_n_tokens` counts it): a fixed `threshold`, or with
`adaptive=True` the authors' rule (`adaptive.AdaptiveThreshold`), which moves gamma after every
verification from accepted / drafted. Both start at the authors' th_stop_draft = 0.8. The adaptive gamma is
carried across prompts as in the authors' harness (`adaptive` module): `generate` builds a drafter per call,
so `make_drafter` takes the gamma state from a per-model store keyed by the drafter's settings
(`carried_threshold`), and every drafter built for the same model and settings continues the same gamma;
`reset_gamma` (or `DraftVerifyDrafter.reset`) starts it over. Gamma only decides how long drafts are, never
which tokens are committed, so greedy output stays identical to AR whatever it carries. Sampling uses the
shared rejection sampler: q is the skipped model's (processed) distribution. `vocab`: a trimmed draft
head over the N most frequent tokens (models.vocab); verification keeps the full head (lossless).

Which sub-layers to skip is found by Bayesian optimisation (`search`), saved per model and loaded
by `skipset.resolve_skip` (skip=None: this model's searched set).
"""
from __future__ import annotations

import weakref
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from dvi_lite.core.checks import check_int, check_prob, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.draft_verify.skipset import check_skip, resolve_skip
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab


class DraftVerifyDrafter(Drafter):
    name = "draft_verify"

    def __init__(self, runner: Runner, skip: Skip, K: int = 8, threshold: float | None = 0.8,
                 adaptive: AdaptiveThreshold | None = None, vocab: TrimmedHead | None = None):
        self.runner = runner
        self.vocab = vocab  # None: the model's full LM head drafts
        self.skip = check_skip(skip, runner.n_layers)
        self.K = self.max_draft = check_int("K (draft tokens per step)", K, 1)
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

    def reset(self) -> None:
        """Start the adaptive gamma over (gamma0, running AR and traces cleared); a fixed threshold has no state.
        The explicit reset: prompts otherwise carry gamma from one to the next, as the authors' harness does."""
        if self.adaptive is not None:
            self.adaptive.reset()

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        if self.adaptive is not None:
            self.adaptive.start_prompt()  # running AR restarts per prompt; gamma is carried (the authors' harness)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        r, cache = self.runner, state.cache
        past = state.committed
        cache.crop(past)  # drop draft KV of the last round from the layers drafting ran
        steps = max(1, min(self.K, state.remaining - 1))
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
            self.adaptive.update(a, n, reached_max=n >= self.K)


# model -> {drafter settings: its carried AdaptiveThreshold}. Weak keys: a dropped model frees its entries (a
# threshold holds no reference to the model, so the value never keeps its key alive).
_CARRIED: weakref.WeakKeyDictionary[Any, dict[Hashable, AdaptiveThreshold]] = weakref.WeakKeyDictionary()


def _vocab_key(vocab: Any) -> Hashable:
    """The `vocab` option as part of a settings key: None, a size, a map's file; any other object by identity."""
    return vocab if vocab is None or isinstance(vocab, (int, str, Path)) else ("object", id(vocab))


def carried_threshold(model, settings: Hashable, target_alpha: float = 0.9, gamma0: float = 0.8) -> AdaptiveThreshold:
    """The adaptive threshold every drafter of `model` with these `settings` shares (made on first use).

    Why a store: `generate` (and so the bench) builds a new drafter for every prompt; the authors' harness
    carries gamma from prompt to prompt, so the state must outlive the drafter. Keyed by the settings that
    make a different drafter (skip set, K, target alpha, gamma0, draft head), so two arms never share gamma.
    """
    per = _CARRIED.setdefault(model, {})
    key = (settings, float(target_alpha), float(gamma0))
    ctl = per.get(key)
    if ctl is None:
        ctl = per[key] = AdaptiveThreshold(target_alpha=target_alpha, gamma0=gamma0)
    return ctl


def carried_thresholds(model) -> dict[Hashable, AdaptiveThreshold]:
    """The carried thresholds of `model` by settings key (a copy of the mapping): to read gamma and its trace."""
    return dict(_CARRIED.get(model, {}))


def reset_gamma(model=None) -> int:
    """Start every carried gamma of `model` (None: of every model) over at gamma0; returns how many were reset.
    Call it between experiments that must not inherit gamma from an earlier run in the same process."""
    per_model = [_CARRIED.get(model, {})] if model is not None else list(_CARRIED.values())
    ctls = [c for per in per_model for c in per.values()]
    for c in ctls:
        c.reset()
    return len(ctls)


def make_drafter(model, tokenizer, skip=None, K: int = 8, threshold: float | None = 0.8, adaptive: bool = True,
                 target_alpha: float = 0.9, vocab=None, carry: bool = True, **old) -> DraftVerifyDrafter:
    """Layer-skipping self-speculation; gamma starts at `threshold` (the authors' 0.8) and adapts towards
    target_alpha unless adaptive=False (then `threshold` is fixed; None = always draft K). vocab: a trimmed
    draft head (models.vocab.resolve_vocab).

    carry (adaptive only): gamma continues from the previous drafter of this model with the same settings
    (`carried_threshold`, the authors' harness); False = a fresh threshold, gamma0 at every prompt.
    """
    reject_renamed(old, "draft_verify.make_drafter")
    if threshold is not None:
        threshold = check_prob("threshold (gamma, or its start value when adaptive)", threshold)
    if not isinstance(carry, bool):
        raise ValueError(f"carry (keep gamma across prompts) must be True or False, got {carry!r}")
    skip = resolve_skip(model, skip)  # checked
    K = check_int("K (draft tokens per step)", K, 1)
    gamma0 = threshold if threshold is not None else 0.8
    ctl = None
    if adaptive and carry:
        settings = ("draft_verify", tuple(sorted(skip.attn)), tuple(sorted(skip.mlp)), K, _vocab_key(vocab))
        ctl = carried_threshold(model, settings, target_alpha, gamma0)
    elif adaptive:
        ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=gamma0, carry=False)
    return DraftVerifyDrafter(Runner.for_model(model), skip, K, threshold, ctl, resolve_vocab(model, tokenizer, vocab))
