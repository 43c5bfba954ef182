"""Where the trained pieces of each method live for a given base model.

The course model's adapter, heads, skip set and DVI head are committed under data/, SmolLM2's under
data/smollm2/ (same layout). Any other model (a
local HF checkpoint on a GPU) gets its own folder, build/models/<fingerprint>/, with the same layout,
so the loaders' defaults find the right files, the trainers never overwrite the course model's, and
`python -m dvi_lite.study.prepare --model <folder>` can fill it before the notebooks run on that model.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
import zipfile
from pathlib import Path
from typing import Any, Callable, Hashable

import torch

from dvi_lite.paths import BUILD_DIR, DATA_DIR
from dvi_lite.safety import load_torch

# fingerprint() of data/course_model (tests/test_artifacts.py checks it): retraining the course model
# changes it, and then every committed artifact must be retrained too.
COURSE_FINGERPRINT = "142d785a58430018"
# fingerprint() of the converted SmolLM2-135M-Instruct: its trained pieces are committed in data/smollm2/.
SMOLLM2_FINGERPRINT = "6694028984caa6c8"
COMMITTED = {COURSE_FINGERPRINT: DATA_DIR, SMOLLM2_FINGERPRINT: DATA_DIR / "smollm2"}  # fingerprint -> committed folder
MODELS_DIR = DATA_DIR.parent / "build" / "models"  # DVI_MODELS_DIR overrides it (tests, shared caches)
# weights_hash() of each committed model -> the id its pieces record (the first fingerprint: config + 64 embedding
# rows, which a fine-tune with frozen embeddings shares); only a model whose every weight matches gets it.
KNOWN = {"7a9ef37d3bd069ac": COURSE_FINGERPRINT, "13f33c35715bd594": SMOLLM2_FINGERPRINT,
         "f2b11d7312ed78b2": SMOLLM2_FINGERPRINT}  # SmolLM2 loaded in fp16 (fp32 -> fp16 -> bf16 rounds twice)
_CACHE = "_dvi_weights_hash"  # the attribute a model caches its weights_hash in


def embedding_probe_id(model) -> str:
    """The first fingerprint (config + 64 embedding rows): a family of weights. Explains KNOWN; finds nothing."""
    c = model.config
    w = model.get_input_embeddings().weight
    probe = w[:: max(1, w.shape[0] // 64)].detach().to("cpu", torch.bfloat16).double().sum().item()
    key = f"{c.model_type}-{c.num_hidden_layers}-{c.hidden_size}-{w.shape[0]}-{probe:.6e}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def model_facts(name: str | None, model) -> dict:
    """Which model a result is about: the name it was asked for ("course", "smollm2" or a folder), its
    fingerprint (the same weights give the same one in any dtype) and the dtype it ran in."""
    return {"model": str(name) if name is not None else "course", "fingerprint": fingerprint(model),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def weights_hash(model) -> str:
    """sha256 of every tensor of the state dict (names, shapes, values rounded to bf16: fp32 and bf16 loads agree).

    Cached on the model; recomputed when a tensor was replaced or changed in place (storage or version counter).
    LoRA injected in place (peft's `lora_*`: DVI's verifier lora_D) is a piece, not the model: left out."""
    tensors = model.state_dict(keep_vars=True)
    stamp = tuple((k, t.data_ptr(), t._version) for k, t in tensors.items())
    hit = model.__dict__.get(_CACHE)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    c = model.config
    h = hashlib.sha256(f"{c.model_type}-{c.num_hidden_layers}-{c.hidden_size}".encode())
    for name, t in tensors.items():
        if "lora_" in name:  # an adapter injected in place (DVI's lora_D) is a trained piece, not the base model
            continue
        name, t = name.replace(".base_layer.", "."), t.detach()
        h.update(f"{name}:{tuple(t.shape)}:{'f' if t.is_floating_point() else t.dtype};".encode())
        t = t.to("cpu", torch.bfloat16).view(torch.int16) if t.is_floating_point() else t.to("cpu")
        h.update(t.contiguous().numpy().tobytes())
    value = h.hexdigest()[:16]
    object.__setattr__(model, _CACHE, (stamp, value))
    return value


def fingerprint(model) -> str:
    """The base model a trained piece belongs to: weights_hash (the same in fp32 and bf16), or for a committed model
    the id its pieces record (KNOWN)."""
    full = weights_hash(model)
    return KNOWN.get(full, full)


def artifacts_dir(model) -> Path:
    """data/ for the course model, data/smollm2/ for SmolLM2 (both committed), build/models/<fingerprint>/ else."""
    fp = fingerprint(model)
    return COMMITTED[fp] if fp in COMMITTED else Path(os.environ.get("DVI_MODELS_DIR", MODELS_DIR)) / fp


def ckpt_path(kind: str, model, config: Any = None, suffix: str = ".pt") -> Path:
    """build/ckpt/<kind>_<fingerprint>_<config hash>.pt: a --resume for another model or recipe never finds it (steps
    and time budget are left out of the config: a longer run resumes a shorter one)."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in ("steps", "max_minutes")}
    tag = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return BUILD_DIR / "ckpt" / f"{kind}_{fingerprint(model)}_{tag}{suffix}"


def model_defaults(model) -> dict:
    """The committed per-model defaults (artifacts_dir(model)/defaults.json; {} when there is none).

    A model's trained pieces fix some options: SmolLM2's Kangaroo adapter and DVI head were trained at the exit
    layer its sweep picked, so the self-speculative methods default to that layer on it.
    """
    path = artifacts_dir(model) / "defaults.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def default_split_for(model) -> int:
    """THE default exit layer of early_exit, kangaroo and dvi on `model`: its committed default, else
    core.checks.default_split(L)."""
    from dvi_lite.core.checks import check_split, default_split

    n = model.config.num_hidden_layers
    split = model_defaults(model).get("split")
    return default_split(n) if split is None else check_split(split, n)


def read_piece(path: str | Path, model, what: str, how: str) -> dict:
    """A saved piece's body (torch file, tensors only), checked to belong to `model` by its fingerprint.

    what: the option or piece named in errors; how: the command or function that makes one."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no file at {p}; make one with {how}")
    body = load_torch(p, what, keys=("fingerprint",))
    if body.get("fingerprint") != fingerprint(model):
        raise ValueError(f"{what} {p} was trained for the model {body.get('fingerprint')}, not this one "
                         f"({fingerprint(model)}); make one for it with {how}")
    return body


def deflate_piece(path: str | Path) -> Path:
    """Rewrite torch.save's zip at `path` with its records deflated (atomic): the same records, byte for byte, read
    back by torch.load as they are, in about 8 % fewer bytes for fp16 weights (torch.save stores them uncompressed).
    What keeps the committed pieces inside the tracked tree's budget (tests/test_layout.py)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".deflate")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    tmp.replace(path)
    return path


def save_piece(body: dict, path: str | Path) -> Path:
    """torch.save(body) to `path`, deflated (deflate_piece) and atomic: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(body, tmp)
    deflate_piece(tmp).replace(path)
    return path


_PIECES: dict[tuple, tuple[weakref.ref, Any]] = {}  # (kind, fingerprint, file, mtime, dtype, device, extra)


def load_cached(kind: str, model, path: str | Path, loader: Callable[[], Any], extra: Hashable = None) -> Any:
    """A trained piece (adapter, heads, policy, draft model) for `model`, loaded from `path` once.

    The one cache for every method's trained pieces. Keyed by the model's fingerprint, the file (and its
    modification time, so a retrained file is reloaded), the model's dtype and device, and `extra`; an
    entry also holds a weak reference to the model it was loaded for, so a new model that reuses a dead
    one's id() never receives a piece built against the other's tensors.
    """
    p = Path(path).resolve()
    w = next(model.parameters())
    key = (kind, fingerprint(model), str(p), p.stat().st_mtime_ns if p.exists() else None, w.dtype, str(w.device),
           extra)
    hit = _PIECES.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    piece = loader()
    _PIECES[key] = (weakref.ref(model), piece)
    return piece

