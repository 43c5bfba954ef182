"""Naive early-exit self-speculation: the target's first k layers draft, the remaining layers verify.

The draft distribution is the target's own head on the layer-k hidden state, q = softmax(lm_head(
norm(h_k))). No extra parameters: it is the baseline that Kangaroo's adapter and DVI's trained exit
head improve on. What it shares with them is the mechanics this module shows: the shallow layers'
KV cache and hidden states computed while drafting are *reused* by verification (Proposal.hidden),
so verification only runs layers [k, L) on those positions.

Drafting stops early when the draft's top-1 probability falls below `threshold` (Kangaroo's second
"early exit"), or after `max_steps` tokens.
"""
from __future__ import annotations

import torch

from dvi_lite.engine import DecodeState, Drafter, Proposal
from dvi_lite.methods import _runner, register


def check_split(split, n_layers: int) -> int:
    if not isinstance(split, int) or isinstance(split, bool) or not 0 < split < n_layers:
        raise ValueError(f"split (exit layer k) must be an int with 0 < k < {n_layers} (the model's layers), got {split!r}")
    return split


def check_threshold(threshold) -> float:
    if not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold (eta) must be in (0, 1], got {threshold!r}")
    return float(threshold)


class EarlyExitDrafter(Drafter):
    name = "early_exit"

    def __init__(self, runner, split: int, max_steps: int = 6, threshold: float | None = None):
        self.runner = runner
        self.split = check_split(split, runner.n_layers)
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = self.max_draft = max_steps
        self.threshold = None if threshold is None else check_threshold(threshold)

    def exit_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft head on layer-k hidden states (1, n, D) -> (1, n, V). Subclasses (Kangaroo) override."""
        return self.runner.logits(h)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        r, cache = self.runner, state.cache
        past = len(cache)
        cache.crop(past, range(0, self.split))
        steps = max(1, min(self.max_steps, state.remaining - 1))
        tok, hs, tokens, qs = state.pending, [], [], []
        for i in range(steps):
            pos = torch.tensor([[past + i]], device=state.device)
            h = r.layers_forward(r.embed(torch.tensor([[tok]], device=state.device)), cache, pos, 0, self.split)
            hs.append(h)
            logits = self.exit_logits(h)[0, -1]  # (V,)
            q = state.sampler.probs(logits)
            tok = int(q.argmax()) if state.sampler.greedy else int(torch.multinomial(q, 1, generator=state.gen))
            if self.threshold is not None and i > 0 and float(q.max()) < self.threshold:
                break  # not confident: drop this candidate; h of its input d_i is kept (all inputs covered)
            tokens.append(tok)
            qs.append(q)
        # shallow states of [pending, d1, ...]: n of them after a full run (d_n itself not yet fed),
        # n + 1 after an early stop (the last input was fed to find out it was not confident)
        hidden = torch.cat(hs, 1)
        return Proposal(torch.tensor(tokens, device=state.device),
                        None if state.sampler.greedy else torch.stack(qs), hidden=hidden, split=self.split)


@register("early_exit")
def _early_exit(model, tokenizer, split: int | None = None, max_steps: int = 6, threshold: float | None = None):
    """Self-speculation with the target's own first `split` layers and its own head (no training)."""
    r = _runner(model)
    return EarlyExitDrafter(r, split if split is not None else max(1, r.n_layers // 4), max_steps, threshold)
