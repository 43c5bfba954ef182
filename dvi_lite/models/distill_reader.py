"""Reading the self-distillation set (models/distill_data.py builds it): its finished shards, per split, and
the whole split as one `TeacherData`, so that every recipe that distils from the teacher's outputs reads it
unchanged."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dvi_lite.core.checks import check_int
from dvi_lite.models.distill_record import shard_metas


def done_shards(folder: Path) -> list[dict]:
    """Metas of the finished prompt shards, in order (a shard is finished when its JSON exists)."""
    return shard_metas(folder)


def is_state_set(folder: str | Path) -> bool:
    """Whether `folder` holds states (a distill-data folder under build/), not only the committed token record."""
    folder = Path(folder)
    return (folder / "corpus.json").is_file() or any(folder.glob("shard_*.safetensors"))


def shard_files(folder: str | Path, split: str = "train", corpus: bool = True) -> list[Path]:
    """The finished shards of a split ("train" or "val"), in order; the corpus shard counts as train."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    folder = Path(folder)
    if not (folder / "card.json").is_file():
        raise FileNotFoundError(f"no self-distillation set in {folder}: build it with "
                                "`python -m dvi_lite distill-data --model ...`")
    names = [f"shard_{m['shard']:05d}" for m in done_shards(folder) if m["split"] == split]
    if split == "train" and corpus and (folder / "corpus.json").is_file():
        names.insert(0, "corpus")
    return [folder / f"{n}.safetensors" for n in names]


def load_as_teacher(folder: str | Path, split: str = "train", layers: tuple[int, ...] = (),
                    max_tokens: int | None = None, corpus: bool = True, width: int | None = 256,
                    final: bool = True):
    """Shards of a split as one `TeacherData`, so every recipe that distils from the teacher's outputs reads
    the set unchanged.

    Each sequence is cut into windows of `width` positions (None = whole sequences): rows are right-padded to
    the longest row, and sequences run from 60 to over 1000 positions, so whole rows would be mostly padding.
    Only the states after `layers` are loaded, and the final state when `final`. `max_tokens` stops after the
    shard that reaches that many positions (a data-scaling budget).
    """
    from safetensors import safe_open

    from dvi_lite.models.teacher import TeacherData

    if width is not None:
        check_int("width", width, 2)
    rows: list[dict[str, torch.Tensor]] = []
    answer_from: list[int] = []  # per row: its first own-answer position (0 for corpus windows and mid-answer ones)
    n_pos, final_key = 0, None
    for path in shard_files(folder, split, corpus):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            final_key = final_key or max((k for k in keys if k.startswith("h")), key=lambda k: int(k[1:]))
            missing = [k for k in layers if f"h{k}" not in keys]
            if missing:
                kept = sorted(int(k[1:]) for k in keys if k.startswith("h"))
                raise ValueError(f"the set keeps the states after layers {kept}, not {missing}; rebuild it with "
                                 "--layers including them")
            names = ["ids", "top_ids", "top_logp"] + [f"h{k}" for k in layers] + ([final_key] if final else [])
            t = {k: f.get_tensor(k) for k in names}
            off = f.get_tensor("offsets").tolist()
        prompts = _prompt_lengths(path, len(off) - 1)
        for j, (a, b) in enumerate(zip(off[:-1], off[1:], strict=True)):
            step = (b - a) if width is None else width
            for s in range(a, b, step):
                e = min(b, s + step)
                if e - s >= 2:
                    rows.append({k: v[s:e] for k, v in t.items()})
                    answer_from.append(max(0, prompts[j] - (s - a)))
        n_pos += off[-1]
        if max_tokens is not None and n_pos >= max_tokens:
            break
    if not rows:
        raise ValueError(f"the {split!r} split of {folder} has no finished shard yet")
    n, w = len(rows), max(len(r["ids"]) for r in rows)
    k_top = rows[0]["top_ids"].shape[-1]
    d = next((v.shape[-1] for key, v in rows[0].items() if key.startswith("h")), 0)  # hidden size
    tokens = torch.zeros(n, w, dtype=torch.long)
    mask = torch.zeros(n, w, dtype=torch.bool)
    states = {k: torch.zeros(n, w, d, dtype=torch.bfloat16) for k in layers}
    last = torch.zeros(n, w, d, dtype=torch.bfloat16) if final else torch.zeros(0)
    top_ids = torch.zeros(n, w, k_top, dtype=torch.long)
    top_logp = torch.zeros(n, w, k_top, dtype=torch.float16)
    for i, r in enumerate(rows):
        m = len(r["ids"])
        tokens[i, :m], mask[i, :m] = r["ids"].long(), True
        for k in layers:
            states[k][i, :m] = r[f"h{k}"]
        if final:
            last[i, :m] = r[final_key]
        top_ids[i, :m], top_logp[i, :m] = r["top_ids"].long(), r["top_logp"]
    card = json.loads((Path(folder) / "card.json").read_text())
    card = {"model": card["model"], "source": str(folder), "split": split, "width": width, "n_rows": n,
            "n_tokens": int(mask.sum()), "config": card["config"], "provenance": card["provenance"],
            "set": {k: card[k] for k in ("shards", "answer_tokens", "positions", "corpus_positions")},
            "answer_from": answer_from}
    return TeacherData(tokens, mask, states, last, top_ids, top_logp, card)


def _prompt_lengths(shard: Path, n: int) -> list[int]:
    """Each sequence's prompt length in a shard, from its JSON beside it (0 for a corpus shard, none written)."""
    meta = Path(shard).with_suffix(".json")
    if not meta.is_file():
        return [0] * n
    rows = json.loads(meta.read_text()).get("rows")  # a list of sequences (the corpus shard keeps a count)
    ok = isinstance(rows, list) and len(rows) == n
    return [int(r.get("prompt_tokens", 0)) for r in rows] if ok else [0] * n


def load_distill(model, folder: str | Path, split: str = "train", layers: tuple[int, ...] = (), final: bool = False,
                 max_tokens: int | None = None, width: int = 256, corpus: bool = True, missing_ok: bool = False):
    """A split of the self-distillation set as `TeacherData`, from whichever form `folder` holds: a set with states
    (build/distill/<fingerprint>/: soft top-k targets, `load_as_teacher`) or the committed token record alone
    (data/smollm2/distill/: hard labels, `distill_record.record_as_teacher`), whose states after `layers` (and
    the final state when `final`) are computed from the ids here (`teacher.fill_states`). missing_ok: None when the
    split has no shard yet (the first held-out shard is the 20th), so a recipe can hold out rows of its own."""
    if missing_ok:
        try:
            return load_distill(model, folder, split, layers, final, max_tokens, width, corpus)
        except ValueError as e:
            if "no finished shard yet" in str(e) or "no answer token yet" in str(e):
                return None
            raise
    if is_state_set(folder):
        return load_as_teacher(folder, split, layers, max_tokens, corpus, width, final)
    from dvi_lite.models.distill_record import record_as_teacher
    from dvi_lite.models.teacher import fill_states

    n_layers = model.config.num_hidden_layers
    data = fill_states(model, record_as_teacher(folder, split, width, max_tokens),
                       tuple(layers) + ((n_layers,) if final else ()), cache=True)  # recipes' arms share the pass
    if final:
        data.final = data.states.pop(n_layers)
    return data
