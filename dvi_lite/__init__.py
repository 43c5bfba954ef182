"""dvi_lite: speculative decoding from speculative sampling to DVI, on a small course model.

    model, tok = dvi_lite.load_model()                  # the committed course model (or any local HF Llama)
    out = dvi_lite.generate(model, tok, "def f(x):", method="sps", max_new_tokens=64)
    out.text, out.token_ids, out.stats.tau
"""
from dvi_lite.engine import Drafter, Outcome, Proposal, Stats, decode
from dvi_lite.methods import METHODS, GenerationResult, generate, register
from dvi_lite.models import load_draft_model, load_model
from dvi_lite.sampling import Sampler

from dvi_lite import draft_verify, dvi, early_exit, kangaroo, medusa, sps  # noqa: F401,E402  (register their methods)

__version__ = "0.1.0"
__all__ = ["METHODS", "Drafter", "GenerationResult", "Outcome", "Proposal", "Sampler", "Stats", "decode",
           "generate", "load_draft_model", "load_model", "register"]
