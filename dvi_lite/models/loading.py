"""Loading the course model (or any local Llama-family HF checkpoint) with clear errors.

Everything in dvi_lite drives the model layer by layer (see runner.py), so we accept exactly the
architectures whose decoder layer is `x + attn(norm(x))`, `x + mlp(norm(x))` with rotary position
embeddings: Llama, Mistral, Qwen2, Qwen3 (and the course model, which is a Llama).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dvi_lite.paths import DATA_DIR

COURSE_MODEL = DATA_DIR / "course_model"
DRAFT_MODEL = DATA_DIR / "draft_model"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """None = fp32 on CPU (exact tests, and bf16 is not faster there), bf16 on CUDA."""
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(set(DTYPES))}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> str:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available on this machine; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    return str(dev)


def check_checkpoint(path: Path) -> dict:
    """Validate a checkpoint folder before transformers sees it; return its config.json."""
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} must be a folder with config.json and weights (an HF checkpoint)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json: not a Hugging Face checkpoint folder")
    cfg = json.loads(cfg_file.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} at {str(path)!r} is not supported; supported Llama-family types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    archs = cfg.get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"model at {str(path)!r} is not a causal LM (architectures={archs}); need *ForCausalLM")
    return cfg


def load_model(path: str | Path | None = None, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) in eval mode. No path = the committed course model in data/course_model.

    Loads with `local_files_only=True`: nothing is ever downloaded.
    """
    device = resolve_device(device)
    dt = resolve_dtype(dtype, device)
    path = Path(path) if path is not None else COURSE_MODEL
    check_checkpoint(path)
    if dt == torch.bfloat16 and device == "cpu" and not torch.backends.mkldnn.is_available():
        raise ValueError("dtype bfloat16 is not available on this CPU build; use float32")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, local_files_only=True,
                                                 attn_implementation="sdpa")
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_draft_model(path: str | Path | None = None, dtype: str | torch.dtype | None = None,
                     device: str | torch.device | None = None) -> PreTrainedModel:
    """The small draft model for speculative sampling (same tokenizer as the course model)."""
    model, _ = load_model(path if path is not None else DRAFT_MODEL, dtype=dtype, device=device)
    return model


def vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]
