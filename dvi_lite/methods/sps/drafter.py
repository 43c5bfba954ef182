"""Classic speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a small draft model drafts.

The drafter keeps its own KV cache in step with the target's. Invariant (same as the target's):
the draft cache holds every committed token except those in `self.todo`, the tokens it has not
run yet (normally just the pending token; after a fully accepted step also the last draft token,
which the draft proposed but never fed back through itself).
"""
from __future__ import annotations

import torch

from dvi_lite.core.checks import check_int, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.core.runner import Runner
from dvi_lite.methods.sps.draft import added_values, resolve_draft
from dvi_lite.models.artifacts import model_defaults


class DraftModelDrafter(Drafter):
    name = "sps"

    def __init__(self, draft_model, K: int = 4, target=None):
        self.runner = Runner.for_model(draft_model)
        self.K = check_int("K (draft tokens per step)", K, 1)
        self.max_draft = self.K
        self._added = added_values(target, draft_model) if target is not None else None

    def extra_params(self) -> int:
        """Values the draft adds to the target (a shared embedding / head is not counted)."""
        if self._added is None:
            return sum(p.numel() for p in self.runner.model.parameters())
        return self._added

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        self.cache = self.runner.new_cache(state.cache.max_len)
        self.runner.forward(prompt, self.cache)
        self.todo = [state.pending]

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        k = max(1, min(self.K, state.remaining - 1))  # no point drafting past the end
        self.base = len(self.cache)
        self.n_todo = len(self.todo)
        inp = torch.tensor([self.todo], device=state.device)
        tokens, qs = [], []
        for i in range(k):
            logits, _ = self.runner.forward(inp, self.cache)
            last = logits[0, -1]  # (V,)
            if state.sampler.greedy:
                x = int(last.argmax())
            else:
                q = state.sampler.probs(last)
                x = int(torch.multinomial(q, 1, generator=state.gen))
                qs.append(q)
            tokens.append(x)
            if i < k - 1:
                inp = torch.tensor([[x]], device=state.device)
        q = torch.stack(qs) if qs else None
        return Proposal(torch.tensor(tokens, device=state.device), q)

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        n, k = outcome.n_accepted, len(outcome.proposal)
        # the draft ran todo + tokens[:k-1]; keep todo + the accepted ones it has run
        self.cache.crop(self.base + self.n_todo + min(n, k - 1))
        self.todo = ([int(outcome.proposal.tokens[-1])] if n == k else []) + [outcome.next_token]


def sized_k(model, draft_model=None, fallback: int = 4) -> int:
    """The draft length SpS runs at when none is given: the committed draft's sized K (defaults.json "sps", written
    by `sps-sizing --apply`), else `fallback`. Another draft has no sizing: the fallback."""
    return int(model_defaults(model).get("sps", {}).get("K", fallback)) if draft_model is None else fallback


def make_drafter(model, tokenizer, draft_model=None, K: int | None = None, **old) -> Drafter:
    """Speculative sampling with a separate small draft model (default: this model's committed draft,
    `draft.default_draft_path`), K draft tokens per step (None: `sized_k`)."""
    reject_renamed(old, "sps.make_drafter")
    K = sized_k(model, draft_model) if K is None else K
    return DraftModelDrafter(resolve_draft(model, draft_model), K, target=model)
