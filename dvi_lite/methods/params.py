"""How many values a method adds to the target model: what its parameter and memory columns must count.

Counted from the modules a method really holds besides the target, trainable or not: a frozen copy costs
memory like a trained one. So DVI counts its whole exit block (the copy of layer k's MLP, 3 * D * I, besides
the LoRA), Medusa its heads (blocks, own LM-head copies, the norm copy), Kangaroo its adapter, SpS its draft
model, and a trimmed draft head (option `vocab`) its selected rows. Early exit, Draft & Verify, prompt lookup,
AR and the HF baselines add nothing. The model's own shared modules (its LM head) are never counted.
"""
from __future__ import annotations

from typing import Any

from dvi_lite.core.registry import get_method


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def added_parameters(model, method: str, tokenizer: Any = None, **options: Any) -> int:
    """Values `method` (with these registry options) adds on top of `model`; builds its drafter to count them."""
    m = get_method(method)
    if method == "hf_assisted":
        from dvi_lite.methods.sps import resolve_draft
        from dvi_lite.methods.sps.draft import added_values

        return added_values(model, resolve_draft(model, options.get("draft_model")))  # shared embedding: not counted
    if not m.engine or method == "ar":
        return 0
    drafter = m.build(model, tokenizer, **options)
    if hasattr(drafter, "extra_params"):  # early_exit, kangaroo, draft_verify, dvi
        return int(drafter.extra_params())
    if method == "sps":
        return _count(drafter.runner.model)
    if method == "medusa":
        return _count(drafter.heads)
    return 0  # pld: a lookup, no weights
