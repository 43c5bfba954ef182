"""Where things live: the repository root, the committed data, the ignored build folder (written once)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (an editable install runs from here)
DATA_DIR = ROOT / "data"  # committed: course model, tokenizer, corpus snapshot, trained pieces, prompts
BUILD_DIR = ROOT / "build"  # ignored: smoke outputs, other models' trained pieces, converted checkpoints
