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


def save_record(record: Path, name: str, tensors: dict[str, torch.Tensor], last: torch.Tensor, meta: dict) -> None:
    """A shard's whole rows, prompt + answer (the state-aligned `ids` plus each row's `last` token), as uint16 ids
    when the vocabulary fits, compressed; then its JSON. Each file is written atomically, the JSON last: it marks
    the shard as recorded."""
    record.mkdir(parents=True, exist_ok=True)
    off = tensors["offsets"].tolist()
    parts = [tensors["ids"][a:b] for a, b in zip(off[:-1], off[1:], strict=True)]
    ids = torch.cat([torch.cat([p, t.view(1).to(p.dtype)]) for p, t in zip(parts, last, strict=True)]).numpy()
    tmp = record / f"{name}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, ids=ids.astype(np.uint16) if ids.max(initial=0) < 2**16 else ids,
                            lengths=np.diff(off) + 1, prompt_len=tensors["prompt_len"].numpy())
    os.replace(tmp, record / f"{name}.npz")
    tmp = record / f"{name}.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, record / f"{name}.json")


def read_record(record: Path, name: str, whole: bool = True) -> tuple[list[list[int]], torch.Tensor]:
    """A recorded shard's rows and prompt_len (R,). whole: prompt + answer; else without each row's last token,
    the positions whose states the set keeps (every token but the last has a forward)."""
    with np.load(record / f"{name}.npz") as z:
        ids, lengths, plen = z["ids"].astype(np.int64), z["lengths"], torch.from_numpy(z["prompt_len"])
    ends = np.cumsum(lengths).tolist()
    rows = [ids[e - n:e].tolist() for e, n in zip(ends, lengths.tolist(), strict=True)]
    return (rows if whole else [r[:-1] for r in rows]), plen


def token_rows(record: str | Path, split: str = "train") -> list[tuple[list[int], int]]:
    """Every recorded row of a split as (prompt + answer ids, prompt_len): what a draft that learns from the
    target's own tokens reads (the answer tokens are the target's: greedy, or a draw from p)."""
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
