"""Where things live: the repository root, the committed data, the ignored build folder (written once)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (an editable install runs from here)
DATA_DIR = ROOT / "data"  # committed: course model, tokenizer, corpus snapshot, trained pieces, prompts
BUILD_DIR = ROOT / "build"  # ignored: smoke outputs, other models' trained pieces, converted checkpoints

# A full run of `make reproduce` writes its results and figures here first (dvi_lite.study.reproduce), and puts
# them in place only once every notebook has run and every prose tag resolves.
STAGE_ENV = "DVI_STAGE_DIR"
# "1": a learner-sized run of the notebooks fills each exercise's worked solution in, instead of stopping at the first
# one left to write (`make learner` times Run All's sizes end to end; course.exercises.yours reads it)
FILL_EXERCISES_ENV = "DVI_LITE_FILL_EXERCISES"


def output_dir(kind: str) -> Path:
    """The folder a full run writes `kind` ("results" or "figures") into: the committed folder, or the stage of a
    `make reproduce` in progress when DVI_STAGE_DIR is set."""
    stage = os.environ.get(STAGE_ENV)
    return Path(stage) / kind if stage else ROOT / kind


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file beside it and a rename: a reader (or a kill) sees the old
    file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> Path:
    """atomic_write_bytes for UTF-8 text."""
    return atomic_write_bytes(path, text.encode())
