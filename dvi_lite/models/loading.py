"""Loading a model by name ("course", "smollm2") or from any local Llama-family HF checkpoint, with clear errors.

Named models: "course" is the small model committed in data/ (the default: fast, for the lessons and the
tests); "smollm2" is SmolLM2-135M-Instruct, converted by `make setup` into an ignored build folder (see
models/smollm2.py): the real pretrained model, memory bound like the papers' GPUs.

Everything in dvi_lite drives the model layer by layer (see runner.py), so we accept exactly the
architectures whose decoder layer is `x + attn(norm(x))`, `x + mlp(norm(x))` with rotary position
embeddings: Llama, Mistral, Qwen2, Qwen3 (and the course model, which is a Llama).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dvi_lite.models.smollm2 import SETUP_HINT, SMOLLM2_DIR, is_converted
from dvi_lite.paths import DATA_DIR

COURSE_MODEL = DATA_DIR / "course_model"
DRAFT_MODEL = DATA_DIR / "draft_model"  # the course draft; a real model's is found by methods.sps.draft
# SMOLLM2_DIR (the converted SmolLM2 folder) is defined by models.smollm2, which writes it; imported above
# so that `from dvi_lite.models.loading import SMOLLM2_DIR` keeps working.
MODELS = {"course": COURSE_MODEL, "smollm2": SMOLLM2_DIR}  # name -> checkpoint folder
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_is_fast(device: str | torch.device) -> bool:
    """Whether bf16 matmuls run at speed here: on CUDA, and on a CPU with AVX-512 (its bf16 kernels). On an
    AVX2-only CPU, bf16 GEMMs fall back to a slow path (measured: 2.5 vs 21 GFLOPS for fp32), so train in fp32."""
    if torch.device(device).type == "cuda":
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


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
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available on this machine; "
                         "use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    return str(dev)


def resolve_model(model: str | Path | None) -> Path:
    """The checkpoint folder of a model name ("course", "smollm2"; None = "course") or of a folder path.

    A plain name that is neither a known model nor an existing folder is an error listing the names;
    a path (a Path, or a string with a separator) is a folder, checked by `check_checkpoint`.
    """
    if model is None:
        return COURSE_MODEL
    if isinstance(model, str) and model in MODELS:
        if model == "smollm2" and not is_converted(MODELS[model]):
            raise FileNotFoundError(f"model 'smollm2' is not converted yet (no complete {MODELS[model]}); "
                                    f"{SETUP_HINT}")
        return MODELS[model]
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a name ({', '.join(MODELS)}) or a checkpoint folder, "
                        f"got {type(model).__name__}")
    path = Path(model)
    if isinstance(model, str) and not path.exists() and "/" not in model and os.sep not in model:
        raise ValueError(f"unknown model {model!r}: the named models are {', '.join(MODELS)}; "
                         f"or give a local checkpoint folder")
    return path


def dtype_works(dt: torch.dtype, device: str) -> bool:
    """Whether this device runs the matmuls of a model in `dt` (a tiny probe; bf16 on CUDA needs sm_80+)."""
    if dt == torch.float32:
        return True
    if device.startswith("cuda"):
        if dt == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            return False
    elif dt == torch.bfloat16 and not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.ones(4, 4, dtype=dt, device=device)
        return bool(torch.isfinite(torch.nn.functional.linear(x, x).float()).all())
    except (RuntimeError, TypeError):
        return False


def check_dtype(dt: torch.dtype, device: str) -> None:
    """A clear error for a dtype the device cannot run (instead of a failure deep inside the first forward)."""
    if not dtype_works(dt, device):
        name = str(dt).removeprefix("torch.")
        raise ValueError(f"dtype {name} is not supported on device {device!r} here; use float32"
                         + (" or bfloat16" if dt == torch.float16 and dtype_works(torch.bfloat16, device) else ""))


def check_checkpoint(path: Path) -> dict:
    """Validate a checkpoint folder before transformers sees it; return its config.json."""
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} must be a folder with config.json and weights (an HF checkpoint)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(cfg_file)!r} is not valid JSON ({e}); a checkpoint's config.json must be") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(cfg_file)!r} must hold a JSON object (the model's config), got {type(cfg).__name__}")
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


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the float dtypes a model's weights may have


def check_weight_files(path: Path) -> None:
    """Every *.safetensors file of a checkpoint folder opens (a complete header that covers the file) and holds
    float tensors only: integer weights would be cast to floats silently and decode garbage."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                dtypes = {k: st.get_slice(k).get_dtype() for k in st.keys()}
        except Exception as e:  # safetensors' own errors (truncated, bad header) are not one exception type
            raise ValueError(f"weights file {str(f)!r} is not a readable safetensors file ({e}); "
                             "it may be truncated or corrupt: copy or convert the checkpoint again") from None
        bad = {k: d for k, d in dtypes.items() if d not in FLOAT_DTYPES}
        if bad:
            k, d = next(iter(bad.items()))
            raise ValueError(f"weights file {str(f)!r} holds {len(bad)} non-float tensors (e.g. {k!r} is {d}); "
                             f"a model's weights must be one of {', '.join(FLOAT_DTYPES)}")


def check_finite(model: PreTrainedModel, path: Path) -> None:
    """No NaN or Inf in any weight: such a model decodes end-of-text or garbage without any error."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            n = int((~torch.isfinite(p)).sum())
            raise ValueError(f"weights at {str(path)!r}: tensor {name!r} has {n} NaN or Inf values; "
                             "a model's weights must be finite (was the checkpoint saved after a diverged step?)")


def load_model(path: str | Path | None = None, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) in eval mode. `path`: a model name ("course" = the default, "smollm2") or a
    local checkpoint folder. dtype: "float32" | "bfloat16" | "float16" (None = fp32 on CPU, bf16 on CUDA).

    Loads with `local_files_only=True`: nothing is ever downloaded.
    """
    device = resolve_device(device)
    dt = resolve_dtype(dtype, device)
    path = resolve_model(path)
    check_checkpoint(path)
    check_dtype(dt, device)
    check_weight_files(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, local_files_only=True,
                                                     attn_implementation="sdpa")
    except (OSError, RuntimeError, KeyError) as e:  # missing/unreadable weights, shapes that do not fit the config
        raise ValueError(f"model at {str(path)!r} could not be loaded: {str(e).splitlines()[0][:300]}") from None
    check_finite(model, path)
    model.to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"model at {str(path)!r} has no usable tokenizer "
                         f"(tokenizer.json / tokenizer_config.json): {str(e).splitlines()[0][:300]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_draft_model(path: str | Path | None = None, dtype: str | torch.dtype | None = None,
                     device: str | torch.device | None = None) -> PreTrainedModel:
    """The small draft model for speculative sampling, a complete HF checkpoint: the course draft
    (data/draft_model) by default, or the checkpoint folder `path`.

    A target's own draft (e.g. data/smollm2/sps/ for SmolLM2, which shares the target's embedding and head,
    so it is built on the loaded target) is found by `dvi_lite.methods.sps.resolve_draft(target, path)`:
    that is a method's piece, and this low-level loader imports no method module (no import circle).
    """
    model, _ = load_model(path if path is not None else DRAFT_MODEL, dtype=dtype, device=device)
    return model


def vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


@dataclass(frozen=True)
class Loaded:
    """A model loaded once by a command and handed down to what it runs (`prepare` gives one to every recipe), so
    no recipe loads the weights again. `name` is how cards name it ("smollm2", a folder)."""
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str


def load_once(model: Loaded | str | Path | None, dtype: str | torch.dtype | None = None,
              device: str | torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer): the ones handed down (a `Loaded`, whatever its dtype), or loaded here from a name/folder."""
    if isinstance(model, Loaded):
        return model.model, model.tokenizer
    return load_model(model, dtype=dtype, device=device)


def model_name(model: Loaded | str | Path | None) -> str:
    """The name a card gives the model: a `Loaded`'s own, else the name or folder as given."""
    return model.name if isinstance(model, Loaded) else str(model)
