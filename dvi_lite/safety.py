"""Safe by default: reading a file runs no code from it (`load_torch`), and a command checks where it writes before
any work, never replacing a committed file under data/ without --force (`check_output`)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

from dvi_lite.paths import BUILD_DIR, DATA_DIR, ROOT


class BadFileError(ValueError):
    """Not the torch file of the kind expected (or one that holds objects, not tensors)."""


class OutputError(ValueError):
    """An output that cannot be written, or a committed file replaced without --force."""


def _safe_globals() -> list:
    """torch.__version__ (a str in a card), numpy scalars, arrays, dtypes (an RNG state): data, no code."""
    import numpy as np
    from torch.torch_version import TorchVersion

    core = getattr(np, "_core", None) or np.core
    out: list = [TorchVersion, core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype]
    out += [getattr(np.dtypes, n) for n in dir(getattr(np, "dtypes", object())) if n.endswith("DType")]
    return out


def load_torch(path: str | Path, what: str, keys: Iterable[str] = (), map_location: Any = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain containers, never an object, so a crafted pickle runs
    nothing. Errors name the file and `what` it should be; keys: the top-level keys a file of that kind has."""
    import pickle

    import torch

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no file at {p}")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            body = torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        found = [ln.strip() for ln in text.splitlines() if "GLOBAL" in ln or "global" in ln.split(" ")[:3]]
        if found:
            raise BadFileError(f"{p} is not a {what}: it holds Python objects that a file of tensors never does, "
                               f"and loading them could run code, so it was not loaded ({found[0][:160]})") from None
        raise BadFileError(f"{p} is not a readable {what} (not a torch file of tensors, or a damaged one)") from None
    except Exception as e:  # zip errors, truncation, garbage bytes: torch raises several kinds
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadFileError(f"{p} is not a readable {what} (not a torch file, or truncated): "
                           f"{type(e).__name__}: {msg[:200]}") from None
    missing = [k for k in keys if not isinstance(body, dict) or k not in body]
    if missing:
        found = sorted(map(str, body))[:8] if isinstance(body, dict) else type(body).__name__
        raise BadFileError(f"{p} is not a {what}: it lacks {missing} (it holds {found}); is it another kind of "
                           "file?")
    return body


def tracked_files(path: str | Path) -> list[Path]:
    """The git-tracked files at or under `path` in data/ (without git: every file there)."""
    p = Path(path).resolve()
    data = DATA_DIR.resolve()
    if p != data and data not in p.parents:
        return []
    if not p.exists():
        return []
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", "--", str(p)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        res = None
    if res is None or (res.returncode != 0 and "not a git repository" in res.stderr.lower()):
        return [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    if res.returncode != 0:
        return []
    return [ROOT / line for line in res.stdout.splitlines() if line]


def _writable_folder(folder: Path, flag: str, p: Path) -> None:
    """Make `folder` (and its parents) and check that a file can be created in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputError(f"{flag} {p}: cannot write there ({e.strerror or e}); pass a path in a writable folder"
                          ) from None


def check_output(path: str | Path | None, *, kind: str = "file", force: bool = False, flag: str = "--out",
                 smoke: bool = False) -> Path | None:
    """Check, before any work, that a command can write `path` (kind "file" or "dir"); returns it (None: no output).

    Refuses a folder for a file (or a file for a folder), a place that cannot be made or written, a smoke run
    writing under data/, and without force, replacing committed (git-tracked) files under data/."""
    if path is None:
        return None
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be 'file' or 'dir', got {kind!r}")
    p = Path(path)
    if kind == "file" and p.is_dir():
        raise OutputError(f"{flag} {p} is a folder; give the path of a file")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {p} is a file; give the path of a folder")
    folder = p if kind == "dir" else p.parent
    blocker = next((a for a in [folder, *folder.parents] if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise OutputError(f"{flag} {p}: {blocker} is a file, so no folder can be made there")
    resolved = p.resolve()
    if smoke and (resolved == DATA_DIR.resolve() or DATA_DIR.resolve() in resolved.parents):
        raise OutputError(f"{flag} {p}: a smoke run never writes under data/; drop {flag} (it writes under "
                          f"{BUILD_DIR}/) or give a path outside data/")
    tracked = tracked_files(p)
    if tracked and not force:
        names = ", ".join(str(t.relative_to(ROOT)) for t in tracked[:4]) + (" ..." if len(tracked) > 4 else "")
        how = f"pass {flag} PATH to write elsewhere, or --force" if flag.startswith("--") and flag != "--apply" \
            else "pass --force"
        raise OutputError(f"{flag} {p} would overwrite committed files ({names}); {how} to replace them")
    _writable_folder(folder, flag, p)
    return p


def smoke_dir(command: str) -> Path:
    """Where a smoke run of `command` writes by default: build/smoke/<command>/."""
    return BUILD_DIR / "smoke" / command

