"""dvi_lite: speculative decoding from speculative sampling to DVI, one loop and a drafter per paper.

    model, tok = dvi_lite.load_model()                  # the committed course model (or any local HF Llama)
    out = dvi_lite.generate(model, tok, "def f(x):", method="sps", max_new_tokens=64)
    out.text, out.token_ids, out.stats.tau

The public API is this module's `__all__`; it imports only the core dependencies (torch, transformers).
"""
from dvi_lite.core.engine import Drafter, Outcome, Proposal, Stats, decode
from dvi_lite.core.generate import GenerationResult, generate
from dvi_lite.core.registry import METHODS, Method, Option, get_method
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler
from dvi_lite.models.loading import load_draft_model, load_model

__version__ = "0.1.0"
__all__ = ["METHODS", "Drafter", "GenerationResult", "Method", "Option", "Outcome", "Proposal", "Runner", "Sampler",
           "Stats", "decode", "generate", "get_method", "load_draft_model", "load_model"]
