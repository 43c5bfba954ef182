"""transformers' own decoding as baselines: `generate`, assisted generation and prompt lookup.

They are not drafters for our loop: each factory returns an `HFBaseline`, the keyword arguments that
`model.generate` gets, and `dvi_lite.generate` times that call the same way as our engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dvi_lite.core.checks import reject_renamed


@dataclass
class HFBaseline:
    """Extra keyword arguments for transformers' `model.generate`."""
    kwargs: dict[str, Any] = field(default_factory=dict)


def hf_generate(model, tokenizer) -> HFBaseline:
    """transformers' `generate` (greedy or sampling): the reference our AR must match."""
    return HFBaseline()


def hf_assisted(model, tokenizer, draft_model=None, K: int | None = None, **old) -> HFBaseline:
    """transformers' assisted generation with the same draft model as `sps` (this model's committed draft by
    default: `sps.draft.resolve_draft`), at a constant K (None: SpS's sized K, `sps.drafter.sized_k`)."""
    from dvi_lite.methods.sps.draft import resolve_draft
    from dvi_lite.methods.sps.drafter import sized_k

    reject_renamed(old, "hf_assisted")
    K = sized_k(model, draft_model) if K is None else K
    return HFBaseline({"assistant_model": resolve_draft(model, draft_model), "num_assistant_tokens": K,
                       "num_assistant_tokens_schedule": "constant"})


def hf_prompt_lookup(model, tokenizer, K: int = 6, **old) -> HFBaseline:
    """transformers' prompt lookup decoding: drafts K tokens by n-gram match on the prompt."""
    reject_renamed(old, "hf_prompt_lookup")
    return HFBaseline({"prompt_lookup_num_tokens": K})
