"""Train a Kangaroo adapter from the teacher's stored outputs (models.teacher): the recipe for a real model.

Why not `train.train_adapter`'s recipe: it runs the whole frozen model inside every step to get p; on a
CPU with a 30-layer model that forward is most of the time. The teacher data holds, once computed, the
exit-layer states h_k (the adapter's input) and the full model's top-32 next tokens with their log-probs
(the target). A step is then only the adapter (one attention layer) and the draft head.

The head is trimmed (models.vocab.TrimmedHead, the N most frequent tokens): the draft's q lives on the
map, so it is trained there: the teacher's top-32 ids outside the map are dropped and the rest
renormalised (models.teacher.soft_ce); a position whose top-32 lies wholly outside the map is skipped.
The adapter starts as a copy of layer k's attention + the final norm (KangarooAdapter); the card records
its validation numbers before training ("init") and after.

Rows are split once by `seed`: a `val_frac` share is held out for validation and the exit-layer sweep
(`sweep.py`). AdamW, warm-up + cosine to a floor, gradient clipping, bf16 autocast (fp32 master weights;
the CLI turns it on only where bf16 is fast: `models.loading.bf16_is_fast`), checkpoints every `ckpt_every_s`
and `resume`.

The learning curve: given `val` (the self-distillation set's held-out shards, models/distill_data.py), all of
`data` trains and `val` is held out. At every milestone of tokens seen (`milestones`), at the end and when
the time budget (`max_minutes`) stops a run, the held-out agreement is measured on up to `val_max_tokens`
positions, appended to the curve, and an fp16 snapshot of the adapter (load_adapter's format) is written
under `curve_dir`: tau can be measured from each point later. A run stopped by the time budget leaves a
checkpoint; the same call again resumes it to the same final weights as an uninterrupted run.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.core.checks import check_int, check_real, check_split
from dvi_lite.core.runner import Runner
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter
from dvi_lite.models.artifacts import ckpt_path, fingerprint
from dvi_lite.models.teacher import TeacherData, soft_ce
from dvi_lite.models.training import TrainConfig, lr_at
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab
from dvi_lite.safety import load_torch

MILESTONES = (100_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000)


@dataclass
class TeacherFitConfig:
    split: int = 2  # exit layer k: the adapter reads teacher.state(k)
    steps: int = 300  # optimiser steps
    batch_rows: int = 4  # teacher rows per step (whole rows, cropped to the longest in the batch)
    lr: float = 1e-3  # peak learning rate
    min_lr_frac: float = 0.1  # cosine floor
    warmup: int = 20  # linear warm-up steps
    grad_clip: float = 1.0  # global norm clip
    vocab: int | str = 8192  # the trimmed draft head: N (this model's top-N map) or a saved map's path
    val_frac: float = 0.1  # rows held out (chosen by seed) for validation and the sweep
    bf16: bool = True  # bf16 autocast (fp32 master weights): fast only where models.loading.bf16_is_fast
    ckpt_every_s: float = 120.0  # seconds between checkpoints
    milestones: tuple[int, ...] = MILESTONES
    # tokens seen at which the held-out agreement is measured and a snapshot kept (the learning curve)
    max_minutes: float | None = None  # stop (checkpointed, resumable) once training has taken this long in all
    val_max_tokens: int = 40_000  # held-out positions scored at each curve point
    seed: int = 0  # row split, data order

    def check(self, n_layers: int) -> None:
        check_split(self.split, n_layers)
        check_int("steps", self.steps, 1)
        check_int("batch_rows", self.batch_rows, 1)
        check_int("val_max_tokens", self.val_max_tokens, 1)
        check_real("lr", self.lr, 0.0)
        check_real("val_frac", self.val_frac, 0.0, 0.9)
        if self.max_minutes is not None:
            check_real("max_minutes", self.max_minutes, 0.0)
        if any(not isinstance(m, int) or m < 1 for m in self.milestones):
            raise ValueError(f"milestones must be token counts >= 1, got {self.milestones}")


# What a checkpoint need not share with the run that resumes it: the time budget, the checkpoint interval, the
# curve's milestones, and the step count (a run may be extended; the schedule then follows the new count).
_RESUMABLE_CHANGES = ("max_minutes", "ckpt_every_s", "milestones", "steps")


def _recipe(cfg: dict) -> dict:
    """What a checkpoint must match to be resumed: the config less _RESUMABLE_CHANGES."""
    return {k: v for k, v in cfg.items() if k not in _RESUMABLE_CHANGES}


def _data_id(data: TeacherData) -> dict:
    """Enough of the data's identity to refuse resuming on another set (e.g. one that has grown since); the
    checkpoint's name already tells sets apart, and a path may be typed relative or absolute."""
    return {"n_rows": int(data.tokens.shape[0]), "n_tokens": data.n_tokens}


def rows_capped(data: TeacherData, rows: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The first of `rows` holding about max_tokens real positions (a curve point's evaluation budget)."""
    n = data.mask[rows].sum(1).cumsum(0)
    return rows[: max(1, int((n < max_tokens).sum()) + 1)]


def curve_point(tokens: int, step: int, ev: dict) -> dict:
    """One learning-curve point from `evaluate`'s numbers (the keys every recipe's curve shares)."""
    return {"tokens": tokens, "step": step, "val_agreement": round(ev["alpha"], 4),
            "val_soft_ce": round(ev["loss"], 4), "val_tokens": ev["positions"]}


def snapshot(adapter: KangarooAdapter, model_fingerprint: str, path: Path) -> None:
    """The adapter in fp16 in load_adapter's format (a learning-curve point, for measuring tau later), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16) for k, v in adapter.state_dict().items()}
    torch.save({"split": adapter.split, "fingerprint": model_fingerprint, "state": state}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def split_rows(n: int, val_frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train row ids, held-out row ids): a seeded permutation, the last ceil(val_frac * n) held out (>= 1)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(n - 1, max(1, round(val_frac * n))) if val_frac > 0 and n > 1 else 0
    return perm[: n - n_val].sort().values, perm[n - n_val:].sort().values


def map_targets(head: TrimmedHead, top_ids: torch.Tensor, top_logp: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher top-k in the trimmed head's index space: (ids (..., k) in [0, N), logp with -inf off the map,
    keep (...) bool: the position has at least one target on the map)."""
    inv = torch.full((head.vocab_size,), -1, dtype=torch.long, device=top_ids.device)
    inv[head.ids.to(top_ids.device)] = torch.arange(len(head), device=top_ids.device)
    small = inv[top_ids]  # (..., k)
    on = small >= 0
    keep = on.any(-1)
    logp = top_logp.float().masked_fill(~on, float("-inf"))
    logp[~keep] = 0.0  # wholly off the map: any finite values, the position is weighted 0
    return small.clamp(min=0), logp, keep


def teacher_batch(data: TeacherData, split: int, rows: torch.Tensor, device=None) -> dict[str, torch.Tensor]:
    """Rows `rows` of the teacher data, cropped to their longest valid length, on `device` (the data stays on the
    CPU): h (B, T, D) fp32, mask, top-k."""
    t = data.width(rows)
    b = {"h": data.state(split)[rows, :t].float(), "mask": data.mask[rows, :t],
         "top_ids": data.top_ids[rows, :t], "top_logp": data.top_logp[rows, :t], "tokens": data.tokens[rows, :t]}
    return {k: v.to(device) for k, v in b.items()} if device is not None else b


def draft_logits(adapter: KangarooAdapter, runner: Runner, head: TrimmedHead, h: torch.Tensor,
                 bf16: bool = False) -> torch.Tensor:
    """Exit states (B, T, D) -> the trimmed head's logits (B, T, N), whole rows at once (causal)."""
    pos = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and h.device.type == "cpu"):
        out = adapter(h, runner.rotary(h, pos))  # (B, T, D)
        return torch.nn.functional.linear(out, head.weight.to(out.dtype), head.bias)  # (B, T, N)


def teacher_loss(adapter: KangarooAdapter, runner: Runner, head: TrimmedHead, b: dict, bf16: bool = False
                 ) -> torch.Tensor:
    """soft_ce of the draft (trimmed head) against the teacher's top-k on the map, mean over kept positions."""
    logq = draft_logits(adapter, runner, head, b["h"], bf16).float().log_softmax(-1)  # (B, T, N)
    ids, logp, keep = map_targets(head, b["top_ids"], b["top_logp"])
    w = (b["mask"] & keep).float()  # (B, T)
    return (soft_ce(logq, ids, logp) * w).sum() / w.sum().clamp(min=1.0)


@torch.no_grad()
def evaluate(adapter: KangarooAdapter, runner: Runner, head: TrimmedHead, data: TeacherData, rows: torch.Tensor,
             batch_rows: int = 8) -> dict:
    """Held-out numbers: loss, top-1 agreement with the teacher (alpha per token) on every row and on the answer
    rows (the model's own answers come first in the teacher data), and per-row draft top-1 / confidence."""
    was = adapter.training
    adapter.eval()
    n_ans = len(data.card.get("questions", []))
    loss_sum = w_sum = 0.0
    hits = {"all": [0, 0], "answers": [0, 0]}
    per_row = []
    for i in range(0, len(rows), batch_rows):
        r = rows[i:i + batch_rows]
        b = teacher_batch(data, adapter.split, r, next(adapter.parameters()).device)
        logits = draft_logits(adapter, runner, head, b["h"]).float()  # (B, T, N)
        logq = logits.log_softmax(-1)
        ids, logp, keep = map_targets(head, b["top_ids"], b["top_logp"])
        w = (b["mask"] & keep).float()
        loss_sum += float((soft_ce(logq, ids, logp) * w).sum())
        w_sum += float(w.sum())
        conf, top = logq.exp().max(-1)  # (B, T)
        b = {k: v.cpu() for k, v in b.items()}  # the per-row detail is kept on the CPU
        conf, top = conf.cpu(), head.ids.cpu()[top.cpu()]  # back to vocabulary ids
        match = (top == b["top_ids"][..., 0]) & b["mask"]
        for j, row in enumerate(r.tolist()):
            m = b["mask"][j]  # (T,) the scored positions: a prefix of a teacher row, a record window's answer part
            for key in ("all",) + (("answers",) if row < n_ans else ()):
                hits[key][0] += int(match[j].sum())
                hits[key][1] += int(m.sum())
            per_row.append({"row": row, "answer": row < n_ans, "draft": top[j][m], "conf": conf[j][m],
                            "teacher": b["top_ids"][j, :, 0][m], "tokens": b["tokens"][j][m]})
    adapter.train(was)
    return {"loss": loss_sum / max(w_sum, 1.0), "alpha": hits["all"][0] / max(1, hits["all"][1]),
            "alpha_answers": hits["answers"][0] / hits["answers"][1] if hits["answers"][1] else None,
            "positions": hits["all"][1], "per_row": per_row}


def fit_adapter(model, tok, data: TeacherData, cfg: TeacherFitConfig, resume: bool = False,
                ckpt: Path | None = None, progress: bool = True, val: TeacherData | None = None,
                curve_dir: Path | None = None) -> tuple[KangarooAdapter, dict]:
    """Train an adapter for exit layer cfg.split on the teacher rows; returns (adapter, card without provenance).

    val: held-out data (the distillation set's val shards): all of `data` trains; None = hold out cfg.val_frac
    of `data`'s rows. The card's `curve` holds the held-out agreement at 0 tokens and at every milestone
    passed, at the end and at a time stop; curve_dir (optional) receives a snapshot per point after 0.
    A run stopped by cfg.max_minutes returns card["stopped"] = True (the adapter is unfinished): call again
    with resume=True to continue from the checkpoint.
    """
    runner = Runner.for_model(model)
    cfg.check(runner.n_layers)
    if val is None and data.tokens.shape[0] < 2 and cfg.val_frac > 0:
        raise ValueError(f"the teacher data has {data.tokens.shape[0]} row(s): need >= 2 to hold some out")
    data.state(cfg.split)  # a clear error if the teacher did not keep this layer
    if val is not None:
        val.state(cfg.split)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    adapter = KangarooAdapter(model, cfg.split).float().train()
    head = resolve_vocab(model, tok, cfg.vocab)
    if head is None:
        raise ValueError("vocab: the teacher-based recipe trains through a trimmed head; give N or a map's path")
    head = TrimmedHead(model.get_output_embeddings(), head.ids.cpu())
    head.weight = head.weight.float()
    head.bias = None if head.bias is None else head.bias.float()
    if val is None:
        train_rows, val_rows = split_rows(data.tokens.shape[0], cfg.val_frac, cfg.seed)
        val = data
    else:
        train_rows, val_rows = torch.arange(data.tokens.shape[0]), torch.arange(val.tokens.shape[0])
    val_rows = rows_capped(val, val_rows, cfg.val_max_tokens)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    tcfg = TrainConfig(steps=cfg.steps, lr=cfg.lr, min_lr_frac=cfg.min_lr_frac, warmup=cfg.warmup)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ckpt = ckpt or ckpt_path(f"kangaroo_teacher_k{cfg.split}", model, asdict(cfg))  # keyed by model and recipe
    ids = {"train": _data_id(data), "val": _data_id(val)}
    step, log, elapsed, tokens, init, curve = 0, [], 0.0, 0, None, []
    if resume and ckpt.is_file():
        ck = load_torch(ckpt, "Kangaroo training checkpoint", keys=("adapter", "opt", "gen"))
        if "cfg" in ck and (_recipe(ck["cfg"]) != _recipe(asdict(cfg)) or ck["data"] != ids):
            raise ValueError(f"checkpoint {ckpt} was made with another recipe or data set ({ck['data']}); "
                             "delete it to start over, or drop resume")
        adapter.load_state_dict(ck["adapter"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, log, elapsed, tokens = ck["step"], ck["log"], ck["elapsed"], ck["tokens"]
        init, curve = ck.get("init"), ck.get("curve", [])
    if init is None:  # the copied attention layer before any step
        init = {k: v for k, v in evaluate(adapter, runner, head, val, val_rows).items() if k != "per_row"}
    curve = curve or [curve_point(0, 0, init)]
    fp = fingerprint(model)
    t0, last = time.time() - elapsed, time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=f"adapter k={cfg.split}",
               disable=not progress)
    final = None  # the held-out numbers (with per-row detail) when the last step's curve point measured them
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tcfg)
        rows = train_rows[torch.randint(len(train_rows), (cfg.batch_rows,), generator=gen)]
        b = teacher_batch(data, cfg.split, rows, next(adapter.parameters()).device)
        loss = teacher_loss(adapter, runner, head, b, cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), cfg.grad_clip)
        opt.step()
        tokens += int(b["mask"].sum())
        bar.set_postfix(ce=f"{loss.item():.3f}", tokens=f"{tokens / 1e6:.2f}M")
        log.append({"step": step + 1, "ce": round(loss.item(), 4), "tokens": tokens})
        passed = [m for m in cfg.milestones if tokens >= m and all(p["tokens"] < m for p in curve[1:])]
        out_of_time = cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes
        done = step + 1 == cfg.steps
        if passed or done or out_of_time:  # a learning-curve point
            ev = evaluate(adapter, runner, head, val, val_rows)
            curve.append(curve_point(tokens, step + 1, ev))
            if curve_dir is not None:
                snapshot(adapter, fp, Path(curve_dir) / f"tokens_{tokens}.pt")
            final = ev if done else None
        if time.time() - last > cfg.ckpt_every_s or done or passed or out_of_time:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"adapter": adapter.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step + 1, "log": log, "elapsed": time.time() - t0, "tokens": tokens,
                        "init": init, "curve": curve, "cfg": asdict(cfg), "data": ids},
                       ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
            last = time.time()
        if out_of_time and not done:
            bar.close()
            print(f"stopped after {cfg.max_minutes} min at step {step + 1} ({tokens} tokens seen); checkpoint "
                  f"{ckpt}: run the same command again to resume")
            adapter.eval()
            return adapter, {"stopped": True, "split": cfg.split, "step": step + 1, "steps": cfg.steps,
                             "tokens_seen": tokens, "init": init, "curve": curve, "final": curve[-1],
                             "wall_time_s": round(time.time() - t0, 1), "checkpoint": str(ckpt)}
    wall = time.time() - t0
    val_numbers = final or evaluate(adapter, runner, head, val, val_rows)
    card = {"split": cfg.split, "params": adapter.extra_params(), "steps": cfg.steps, "train_tokens_seen": tokens,
            "tokens_seen": tokens, "train_rows": len(train_rows), "val_rows": len(val_rows), "vocab_n": len(head),
            "init": init, "val": {k: v for k, v in val_numbers.items() if k != "per_row"}, "curve": curve,
            "val_data": {k: val.card.get(k) for k in ("split", "n_rows", "n_tokens")} if val is not data else None,
            "wall_time_s": round(wall, 1), "config": asdict(cfg),
            "log": log[:: max(1, len(log) // 50)]}
    adapter.eval()
    adapter.val_rows = val_numbers["per_row"]  # for the sweep's simulation (not saved)
    return adapter, card
