"""Prompt lookup decoding (Saxena 2023): draft by copying what followed an earlier occurrence of the
last few tokens, in the prompt or in the text generated so far. No draft model, no training.

Why it pays: summaries, retrieval answers, translations and code edits copy long spans of their
prompt, and a memory-bound model verifies a handful of extra tokens almost for free (v(n) close to 1).
On open-ended chat there is little to copy, and it costs almost nothing either: no match, no draft.

The rule: for n = max_ngram down to 1, find the most recent earlier position where the last n tokens
(of prompt + generated, the pending token included) occurred, and propose up to K tokens that followed it.
The most recent match is the one whose continuation best reflects the text just written (in a list or
a repeated template, the next item rather than the first one).

Lossless: the draft is a deterministic function of the context, so its "draft distribution" is a point
mass on each proposed token. Greedy verification keeps the longest prefix equal to the target's argmax;
under sampling each token x is accepted with probability p(x) / 1 and a rejection samples from p with x
removed, which is exactly the target's law (core/verify.py with q = one-hot).
"""
from __future__ import annotations

import torch

from dvi_lite.core.checks import check_int, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Proposal


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, K: int = 6, max_ngram: int = 3, vocab: int | None = None):
        self.K = check_int("K (draft tokens per step)", K, 1)
        self.max_ngram = check_int("max_ngram (longest n-gram matched)", max_ngram, 1)
        self.max_draft = self.K
        self.vocab = vocab  # for the one-hot q under sampling (None: taken from the target at prefill)
        self._reset()

    def _reset(self) -> None:
        # index[n-1]: n-gram -> the position right after its most recent occurrence (its continuation start)
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram)]
        self.indexed = 0  # n-grams ending at positions < indexed are in the index

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        self._reset()
        if self.vocab is None:
            self.vocab = state.runner.lm_head.weight.shape[0]

    def _update(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the last n-gram must match an EARLIER one,
        and a match needs at least one token after it to propose)."""
        for end in range(max(self.indexed, 1), len(tokens)):  # n-grams tokens[end-n:end], continuation at `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self.index[n - 1][tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], K: int) -> list[int]:
        """Up to K tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        self._update(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self.index[n - 1].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + K]
        return []

    def propose(self, state: DecodeState) -> Proposal:
        k = min(self.K, state.remaining - 1)  # the bonus token comes anyway: drafting past the end is waste
        draft = self.lookup(state.tokens, k) if k > 0 else []
        tokens = torch.tensor(draft, dtype=torch.long, device=state.device)  # (N,)
        q = None  # greedy: verify reads only the tokens
        if draft and not state.sampler.greedy:  # point masses, so that the rejection rule stays exact
            q = torch.nn.functional.one_hot(tokens, self.vocab).float()  # (N, V)
        return Proposal(tokens, q)


def make_drafter(model, tokenizer, K: int = 6, max_ngram: int = 3, **old) -> Drafter:
    """Prompt lookup: up to K draft tokens copied after the last matching n-gram (n <= max_ngram)."""
    reject_renamed(old, "pld.make_drafter")
    return PromptLookupDrafter(K, max_ngram, model.get_output_embeddings().weight.shape[0])
