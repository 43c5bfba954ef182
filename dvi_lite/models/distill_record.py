"""The committed token record of the self-distillation set: every shard's token ids and its JSON, compressed.

On a CPU the answers are the costly part of the set (the model writes them a token at a time); the states and
top-k log-probs are one teacher forward away from the ids. So `distill-data` keeps each shard's ids here, in a
committed folder (data/smollm2/distill/ for SmolLM2: about 3 MB per million answer tokens), and a later run
on any machine continues from it: it never regenerates a recorded shard and rebuilds states only when asked.
Drafts that learn from the target's own tokens (hard labels: the target's greedy or sampled answers) read the
record directly (`token_rows`).
"""
from __future__ import annotations

import gzip
import json
import lzma
import os
import zipfile
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
    save_npz_xz(tmp, ids=ids.astype(np.uint16) if ids.max(initial=0) < 2**16 else ids, lengths=np.diff(off) + 1,
                prompt_len=tensors["prompt_len"].numpy())
    os.replace(tmp, record / f"{name}.npz")
    tmp = record / f"{name}.json.xz.tmp"
    tmp.write_bytes(lzma.compress(json.dumps(meta, indent=1).encode(), preset=9 | lzma.PRESET_EXTREME))
    os.replace(tmp, record / f"{name}.json.xz")


def save_npz_xz(path: Path, **arrays: np.ndarray) -> None:
    """An .npz whose members are xz-compressed (zip's LZMA method), which np.load reads like any .npz: about a
    tenth smaller than np.savez_compressed's deflate on token ids, and the record is committed."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as z:
        for key, a in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))  # fixed: the same bytes each time
            info.compress_type = zipfile.ZIP_LZMA
            with z.open(info, "w") as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)


def read_meta(folder: Path, name: str) -> dict:
    """A shard's JSON: xz-compressed in the committed record (the prompts' text is most of its bytes; gzip in records
    written before), plain in a states set under build/."""
    for suffix, unpack in ((".json.xz", lzma.decompress), (".json.gz", gzip.decompress)):
        f = Path(folder) / f"{name}{suffix}"
        if f.is_file():
            return json.loads(unpack(f.read_bytes()))
    return json.loads((Path(folder) / f"{name}.json").read_text())


def shard_metas(folder: str | Path) -> list[dict]:
    """Every finished shard's JSON in a record or a states set, in shard order (a shard is finished when its JSON
    exists; an interrupted write leaves only a .tmp)."""
    names = sorted({p.name.split(".")[0] for p in Path(folder).glob("shard_*.json*") if p.suffix != ".tmp"})
    return [read_meta(Path(folder), n) for n in names]


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
    target's own tokens reads (the answer tokens are the target's: greedy, or drawn at T = 0.7 or 1)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    record = Path(record)
    metas = shard_metas(record)
    if not metas:
        raise FileNotFoundError(f"no recorded shard in {record}: build it with `python -m dvi_lite distill-data`")
    out = []
    for m in metas:
        if m["split"] == split:
            rows, plen = read_record(record, f"shard_{m['shard']:05d}")
            out += list(zip(rows, plen.tolist(), strict=True))
    return out


def record_as_teacher(record: str | Path, split: str = "train", width: int = 256, max_tokens: int | None = None):
    """The record's rows as a hard-label `TeacherData`: at every position whose next token is an answer token,
    the target is that token with probability 1 (`top_ids` (N, W, 1), `top_logp` 0); elsewhere (prompt positions,
    padding) `mask` is False. A recipe that distils soft top-k targets reads this unchanged and minimises the
    cross-entropy of the target's own tokens. A greedy answer is p's argmax; an answer sampled at T = 1 is a draw
    from p, so there the expected loss is the soft one; at T = 0.7 it is a draw from p sharpened towards its
    argmax. Either way the labels point at what a greedy verifier accepts, with more noise than top-k targets.
    No states: a recipe that needs them computes them from `tokens`.

    Rows are cut into windows of `width` tokens (each keeps its own context only); windows with no answer
    position are dropped. max_tokens stops once that many answer positions are in (a data-scaling budget).
    """
    from dvi_lite.core.checks import check_int
    from dvi_lite.models.teacher import TeacherData

    check_int("width", width, 2)
    windows: list[tuple[list[int], int]] = []  # (ids, first target position in the window)
    n_targets = 0
    for ids, plen in token_rows(record, split):
        for s in range(0, len(ids) - 1, width - 1):  # windows overlap by one token: every next token is a target
            w = ids[s:s + width]
            first = max(plen - 1 - s, 0)  # position in w whose next token is the first answer token
            if first < len(w) - 1:
                windows.append((w, first))
                n_targets += len(w) - 1 - first
        if max_tokens is not None and n_targets >= max_tokens:
            break
    if not windows:
        raise ValueError(f"the {split!r} split of the record {record} has no answer token yet")
    n, t = len(windows), max(len(w) for w, _ in windows)
    tokens = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.bool)
    top_ids = torch.zeros(n, t, 1, dtype=torch.long)
    for i, (w, first) in enumerate(windows):
        tokens[i, :len(w)] = torch.tensor(w)
        mask[i, first:len(w) - 1] = True
        top_ids[i, :len(w) - 1, 0] = tokens[i, 1:len(w)]
    card = json.loads((Path(record) / "card.json").read_text())
    card = {"model": card["model"], "source": str(record), "split": split, "width": width, "n_rows": n,
            "n_tokens": int(mask.sum()), "labels": "hard (the target's own next token)", "config": card["config"],
            "provenance": card["provenance"],
            "set": {k: card[k] for k in ("shards", "answer_tokens", "positions")}}
    return TeacherData(tokens, mask, {}, torch.zeros(0), top_ids, torch.zeros(n, t, 1, dtype=torch.float16), card)
