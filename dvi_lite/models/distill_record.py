"""The committed token record of the self-distillation set: every shard's token ids, compressed, with its JSON.

On a CPU the answers are the costly part of the set (the model writes them a token at a time); the states and
top-k log-probs are one teacher forward away from the ids. So `distill-data` keeps each shard's ids here, in a
committed folder (data/smollm2/distill/ for SmolLM2: about 4 MB per million answer tokens), and a later run
on any machine continues from it: it never regenerates a recorded shard and rebuilds states only when asked.
Drafts that learn from the target's own tokens (hard labels: a sampled answer is a draw from p) read the
record directly (`token_rows`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch


def record_dir(model) -> Path:
    """The committed token record of the model's set (data/smollm2/distill/ for SmolLM2)."""
    from dvi_lite.models.artifacts import artifacts_dir

    return artifacts_dir(model) / "distill"


def save_record(record: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """A shard's ids (uint16 when the vocabulary fits, compressed), then its JSON, each written atomically:
    the JSON marks the shard as recorded."""
    record.mkdir(parents=True, exist_ok=True)
    ids = tensors["ids"].numpy()
    tmp = record / f"{name}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, ids=ids.astype(np.uint16) if ids.max(initial=0) < 2**16 else ids,
                            offsets=tensors["offsets"].numpy(), prompt_len=tensors["prompt_len"].numpy())
    os.replace(tmp, record / f"{name}.npz")
    tmp = record / f"{name}.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, record / f"{name}.json")


def read_record(record: Path, name: str) -> tuple[list[list[int]], torch.Tensor]:
    """A recorded shard's rows (prompt + answer ids, without the last token, as in the states) and prompt_len (R,)."""
    with np.load(record / f"{name}.npz") as z:
        ids, off, plen = z["ids"].astype(np.int64), z["offsets"].tolist(), torch.from_numpy(z["prompt_len"])
    return [ids[a:b].tolist() for a, b in zip(off[:-1], off[1:], strict=True)], plen


def token_rows(record: str | Path, split: str = "train") -> list[tuple[list[int], int]]:
    """Every recorded row of a split as (ids, prompt_len): what a draft trained on the target's own tokens reads."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    record = Path(record)
    metas = [json.loads(p.read_text()) for p in sorted(record.glob("shard_*.json"))]
    if not metas:
        raise FileNotFoundError(f"no recorded shard in {record}: build it with `python -m dvi_lite distill-data`")
    out = []
    for m in metas:
        if m["split"] == split:
            rows, plen = read_record(record, f"shard_{m['shard']:05d}")
            out += list(zip(rows, plen.tolist(), strict=True))
    return out
