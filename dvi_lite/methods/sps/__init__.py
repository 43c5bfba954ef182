"""Classic speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a small draft model drafts.

drafter.py: the drafter for the one verify loop; draft.py: the draft of a model (the course draft model, or a
few-layer Llama sharing the target's embedding and head, as for SmolLM2) and how it is found; train.py: its
distillation from the teacher's outputs (`prepare_smollm2`).
"""
from dvi_lite.methods.sps.draft import resolve_draft
from dvi_lite.methods.sps.drafter import DraftModelDrafter, make_drafter

__all__ = ["DraftModelDrafter", "make_drafter", "resolve_draft"]
