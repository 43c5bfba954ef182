"""Provenance for every number we write: commit, device, versions, command, date."""
from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from dvi_lite.paths import ROOT, atomic_write_text, output_dir

RESULTS_DIR = ROOT / "results"
RUN_OUTPUTS = (":!results", ":!figures", ":!README.md", ":!data/draft_verify/skip.json", ":!data/dvi")


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        # outputs a full run rewrites itself (results, figures, the README table, notebook 03's skip set,
        # notebook 05's trained head) do not make the code dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *RUN_OUTPUTS],
                               cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str | torch.device | None = None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def provenance(command: str | None = None, device: str | torch.device | None = None, **extra) -> dict:
    import transformers

    return {
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": command if command is not None else " ".join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


SIGNIFICANT = 6  # digits a results file keeps of a float: far finer than any timing's or rate's noise


def _rounded(x: Any) -> Any:
    """x with every float kept to SIGNIFICANT digits (ints, strings, None as they are)."""
    if isinstance(x, float):
        return float(f"{x:.{SIGNIFICANT}g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def results_json(body: dict) -> str:
    """A results file's text: one top-level key per line, each value compact, floats to SIGNIFICANT digits. Half
    the size of an indented file with 17-digit floats (the tracked tree has a size budget: the device copies it),
    still diffable key by key, and `json.loads` reads it as before."""
    body = json.loads(json.dumps(body, default=float))  # numpy / torch scalars -> plain numbers first
    items = [f"{json.dumps(k)}: {json.dumps(_rounded(v), separators=(',', ':'), ensure_ascii=False)}"
             for k, v in body.items()]
    return "{\n" + ",\n".join(items) + "\n}\n"


def write_result(name: str, payload: dict, command: str | None = None, smoke: bool = False,
                 out_dir: Path | None = None) -> Path:
    """Write results/<name>.json with provenance, atomically. Smoke runs go to build/results (never committed);
    a full run of `make reproduce` writes into its stage (paths.output_dir) until the whole run has succeeded."""
    out_dir = out_dir or (ROOT / "build" / "results" if smoke else output_dir("results"))
    path = out_dir / f"{name}.json"
    body = {"provenance": provenance(command, smoke=smoke), **payload}
    return atomic_write_text(path, results_json(body))
