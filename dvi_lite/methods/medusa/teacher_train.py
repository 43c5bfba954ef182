"""Medusa heads for a real model, distilled from the teacher's stored outputs (models/teacher.py).

The course recipe (train.py) runs the frozen model inside every step; on a 30-layer model on a CPU that
forward is most of the cost, so here the teacher's outputs are computed once and the heads learn from them:

    input:  teacher.final[n, t], the last layer's pre-norm state h_t (the heads apply the model's norm);
    head i on h_t predicts x_{t+2+i} (heads.py's convention), so its target is the teacher's top-k at
            position t+1+i (the teacher's own prediction of that token); a position whose target t+1+i
            falls outside the row's mask is skipped for that head.
    loss:   soft cross-entropy to the teacher's renormalised top-k (models.teacher.soft_ce), head i weighted
            0.8^i (Medusa-1's lambda). Medusa-1 trains with CE on the model's outputs; ours is Medusa-2's
            self-distillation, with soft targets.

Heads: the frozen norm + a trainable ResBlock each + the model's shared, frozen LM head (only the ResBlocks
train, so the committed file is small). The loss reads the LM head trimmed to the N most frequent tokens
(models.vocab): the teacher's top-k ids outside the map are dropped and the rest renormalised. Decoding
keeps the full head. Steps draw random (row, position) pairs from the training rows.

Accuracy: on held-out rows (chosen by a seed), head i's rank-r token against the teacher's argmax at
t+1+i: what greedy verification accepts at depth i when the path before it was right. The table is saved
in the heads (MedusaHeads.accuracies) and is what sparse trees are built from.

The learning curve: on a self-distillation set (`--data FOLDER`, models/distill_data.py) all of its train
shards train and its val shards are held out. At every milestone of positions seen (`milestones`), at the end
and when the time budget (`max_minutes`) stops a run, head 0's held-out top-1 agreement (and every head's) is
measured on up to `eval_positions` positions, appended to the curve, and an fp16 snapshot of the heads
(load_heads' format, with that point's rank accuracies) is written under out_dir/curve/: tau can be measured
from each point later. A stopped run leaves its checkpoint; the same command resumes it to the same final
weights as an uninterrupted run.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.methods.medusa.heads import MedusaHeads
from dvi_lite.methods.medusa.train import head_weights, load_checkpoint
from dvi_lite.models.teacher import TeacherData, soft_ce
from dvi_lite.models.training import TrainConfig, lr_at
from dvi_lite.models.vocab import TrimmedHead
from dvi_lite.safety import load_torch

PAPER_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)  # Medusa-1 (Cai et al. 2024, Vicuna-7B): heads' top-1 accuracy
MILESTONES = (100_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000)


@dataclass
class DistillConfig:
    heads: int = 4  # number of heads H
    steps: int = 600  # optimiser steps
    batch_size: int = 512  # (row, position) pairs per step
    lr: float = 2e-3  # peak learning rate (zero-init ResBlocks, few steps: twice Medusa-1's 1e-3)
    min_lr_frac: float = 0.1  # cosine floor: never decay to zero
    warmup: int = 20  # linear warm-up steps
    grad_clip: float = 1.0  # global norm clip
    head_decay: float = 0.8  # head i's loss weight is head_decay**i
    vocab: int | None = 8192  # the loss's trimmed head size N (loss_vocab); None = every id the teacher names
    val_frac: float = 0.1  # held-out rows (accuracy; never trained on)
    branch: int = 8  # ranks measured per head (sparse trees read up to this many)
    eval_positions: int = 4096  # held-out positions the accuracy is measured on (at most; also per curve point)
    ckpt_every_s: float = 60.0  # seconds between checkpoints
    milestones: tuple[int, ...] = MILESTONES
    # positions seen (steps x batch_size) at which the held-out accuracy is measured and a snapshot kept
    max_minutes: float | None = None  # stop (checkpointed, resumable) once training has taken this long in all
    seed: int = 0  # row split, position order, evaluation sample


def check_distill(cfg: DistillConfig) -> DistillConfig:
    for name in ("heads", "steps", "batch_size", "branch", "eval_positions"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not 0.0 < cfg.val_frac < 1.0:
        raise ValueError(f"val_frac must lie in (0, 1), got {cfg.val_frac}")
    if cfg.max_minutes is not None and not cfg.max_minutes >= 0.0:
        raise ValueError(f"max_minutes must be >= 0 or None, got {cfg.max_minutes}")
    if any(not isinstance(m, int) or m < 1 for m in cfg.milestones):
        raise ValueError(f"milestones must be position counts >= 1, got {cfg.milestones}")
    return cfg


def split_rows(n_rows: int, val_frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows), sorted: a seeded permutation, so both keep answers and corpus windows."""
    if n_rows < 2:
        raise ValueError(f"the teacher data has {n_rows} row(s); a train / held-out split needs >= 2")
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))
    n_val = min(n_rows - 1, max(1, round(n_rows * val_frac)))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def positions(mask: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, t) pairs (P,), (P,) of `rows` where t and t+1 are real tokens (head 0 has a target)."""
    ok = torch.zeros_like(mask)
    ok[rows, :-1] = mask[rows, :-1] & mask[rows, 1:]
    n, t = ok.nonzero(as_tuple=True)
    return n, t


def head_targets(data: TeacherData, n: torch.Tensor, t: torch.Tensor, i: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head i at (n, t) predicts x_{t+2+i}: the teacher's top ids (B, k) and log-probs (B, k) at t+1+i, and
    whether that position is a real token of the row (B,) (targets of skipped positions are arbitrary)."""
    s = t + 1 + i
    inside = s < data.mask.shape[1]
    s = s.clamp(max=data.mask.shape[1] - 1)
    return data.top_ids[n, s], data.top_logp[n, s], inside & data.mask[n, s]


def trim_targets(ids: torch.Tensor, logp: torch.Tensor, index_of: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher top-k (B, k) -> (indices in the trimmed head (B, k), log-probs with -inf where the token is off
    the map (soft_ce renormalises over the rest), whether any token is kept (B,))."""
    j = index_of[ids]  # (B, k), -1 = not in the map
    kept = j >= 0
    return j.clamp(min=0), logp.float().masked_fill(~kept, float("-inf")), kept.any(-1)


def loss_vocab(data: TeacherData, rows: torch.Tensor, base: torch.Tensor, n: int) -> torch.Tensor:
    """The loss's trimmed-head ids (n,): the teacher's argmax tokens on the training rows, most frequent first,
    then `base` (the corpus-counted map) to fill up to n. A map counted on the course corpus alone misses many
    of the chat answers' tokens, and a head never learns a token that is off the map."""
    m = data.mask[rows]
    counts = torch.bincount(data.top_ids[rows][..., 0][m].reshape(-1), minlength=int(base.max()) + 1)
    seen = counts.nonzero().squeeze(1)
    own = seen[counts[seen].argsort(descending=True, stable=True)]
    extra = base[~torch.isin(base, own)]
    return torch.cat([own, extra])[:n]


def distill_step(heads: MedusaHeads, trimmed: TrimmedHead, index_of: torch.Tensor, data: TeacherData,
                 n: torch.Tensor, t: torch.Tensor, cfg: DistillConfig) -> list[float]:
    """Forward + backward of one batch of positions, one head at a time; returns the per-head losses."""
    dev = next(heads.parameters()).device  # the data stays on the CPU; each batch goes to the heads' device
    h = data.final[n, t].to(dev, torch.float32)  # (B, D)
    losses = []
    for i, w in enumerate(head_weights(cfg)):
        ids, logp, ok = head_targets(data, n, t, i)
        j, lp, kept = trim_targets(ids, logp, index_of)
        sel = ok & kept
        if not bool(sel.any()):
            losses.append(float("nan"))
            continue
        logq = trimmed.small(heads.features(i, h[sel.to(dev)])).float().log_softmax(-1)  # (b, N)
        loss = soft_ce(logq, j[sel].to(dev), lp[sel].to(dev)).mean()
        (w * loss).backward()
        losses.append(loss.item())
    return losses


_SHAPE_KEYS = ("heads", "batch_size", "lr", "vocab", "val_frac", "seed", "head_decay")


def distill(heads: MedusaHeads, data: TeacherData, trimmed: TrimmedHead, cfg: DistillConfig, rows: torch.Tensor,
            ckpt: Path | None = None, resume: bool = False, stop_after: int | None = None,
            progress: bool = True) -> list[dict]:
    """AdamW on the ResBlocks; returns the log [{step, loss, per_head, lr, time_s}].

    ckpt: checkpoint file (every cfg.ckpt_every_s and at the end); resume: continue from it (heads, optimiser,
    position order, log). stop_after: leave after this many steps of this call (run again with resume=True).
    No learning curve: `distill_with_curve` is the same loop with one.
    """
    return distill_with_curve(heads, data, trimmed, cfg, rows, ckpt, resume, stop_after, progress)["log"]


def curve_point(tokens: int, step: int, acc: dict) -> dict:
    """One learning-curve point from `teacher_accuracy` (head 0's top-1 is the curve's `val_agreement`)."""
    return {"tokens": tokens, "step": step, "val_agreement": round(acc["top1"][0], 4),
            "top1": [round(a, 4) for a in acc["top1"]], "val_tokens": acc["n"][0]}


def snapshot(heads: MedusaHeads, accuracies: list[list[float]], path: Path) -> None:
    """The heads in fp16 in load_heads' format, with this point's rank accuracies (the sparse tree's input), so
    tau can be measured from a learning-curve point later; written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16) for k, v in heads.state_dict().items()}
    torch.save({"num_heads": heads.num_heads, "norm": heads.use_norm, "shared_lm_head": heads.shared_lm_head,
                "fingerprint": heads.model_fingerprint, "accuracies": accuracies, "state": state},
               path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def distill_with_curve(heads: MedusaHeads, data: TeacherData, trimmed: TrimmedHead, cfg: DistillConfig,
                       rows: torch.Tensor, ckpt: Path | None = None, resume: bool = False,
                       stop_after: int | None = None, progress: bool = True, val: TeacherData | None = None,
                       val_rows: torch.Tensor | None = None, curve_dir: Path | None = None) -> dict:
    """`distill`'s loop (medusa/train.py's `fit`, checkpoint format included) with the learning curve and the
    time budget. Returns {log, curve, tokens_seen, step, stopped}.

    val_rows: held-out rows of `val` (default `data`) to measure the curve on; None = no curve. At 0 positions
    seen, at every cfg.milestones passed, at the end and at a time stop (cfg.max_minutes) a point is added and,
    with curve_dir, a snapshot written. The checkpoint keeps the curve and the positions seen.
    """
    check_distill(cfg)
    index_of = torch.full((trimmed.vocab_size,), -1, dtype=torch.long)
    index_of[trimmed.ids.cpu()] = torch.arange(len(trimmed))
    pos_n, pos_t = positions(data.mask, rows)
    if pos_n.numel() == 0:
        raise ValueError("the training rows have no position with a next token to learn from")
    val = data if val is None else val
    tcfg = TrainConfig(steps=cfg.steps, lr=cfg.lr, min_lr_frac=cfg.min_lr_frac, warmup=cfg.warmup)
    params = heads.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, log, elapsed = load_checkpoint(ckpt, heads, opt, gen, cfg, _SHAPE_KEYS) if resume else (0, [], 0.0)
    seen, curve = 0, []
    if step:
        ck = load_torch(ckpt, "Medusa training checkpoint")
        seen, curve = ck.get("seen", step * cfg.batch_size), ck.get("curve", [])

    def measure(tokens: int, at: int) -> dict:
        acc = teacher_accuracy(heads, val, val_rows, cfg.branch, cfg.eval_positions, cfg.seed)
        if curve_dir is not None and tokens > 0:
            snapshot(heads, acc["rank_accuracy"], Path(curve_dir) / f"tokens_{tokens}.pt")
        return curve_point(tokens, at, acc)

    if val_rows is not None and not curve:
        curve = [measure(0, 0)]  # the zero-initialised ResBlocks: the model's own head on h_t
    at = step  # steps done
    heads.train()
    t0, last = time.time() - elapsed, time.time()
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    bar = tqdm(range(step, end), initial=step, total=cfg.steps, desc=f"medusa {cfg.heads} heads (teacher)",
               disable=not progress)
    for step in bar:
        lr = lr_at(step, tcfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        pick = torch.randint(pos_n.numel(), (cfg.batch_size,), generator=gen)
        per_head = distill_step(heads, trimmed, index_of, data, pos_n[pick], pos_t[pick], cfg)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        seen, at = seen + cfg.batch_size, step + 1
        loss = sum(w * v for w, v in zip(head_weights(cfg), per_head, strict=True) if v == v)
        log.append({"step": step + 1, "loss": loss, "per_head": per_head, "lr": lr, "time_s": time.time() - t0})
        bar.set_postfix(loss=f"{loss:.3f}", head0=f"{per_head[0]:.3f}", tokens=f"{seen / 1e6:.2f}M")
        passed = [m for m in cfg.milestones if seen >= m and all(p["tokens"] < m for p in curve[1:])]
        out_of_time = cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes
        done = step + 1 == cfg.steps
        if val_rows is not None and (passed or done or out_of_time):  # a learning-curve point
            curve.append(measure(seen, step + 1))
            heads.train()
        if ckpt is not None and (time.time() - last > cfg.ckpt_every_s or step + 1 == end or passed or out_of_time):
            _save_checkpoint(ckpt, heads, opt, gen, step + 1, log, time.time() - t0, cfg, seen, curve)
            last = time.time()
        if out_of_time and not done:
            bar.close()
            heads.eval()
            return {"log": log, "curve": curve, "tokens_seen": seen, "step": at, "stopped": True}
    heads.eval()
    return {"log": log, "curve": curve, "tokens_seen": seen, "step": at, "stopped": False}


def _save_checkpoint(ckpt: Path, heads: MedusaHeads, opt: torch.optim.Optimizer, gen: torch.Generator, step: int,
                     log: list[dict], elapsed: float, cfg: DistillConfig, seen: int, curve: list[dict]) -> None:
    """medusa/train.py's checkpoint (load_checkpoint reads it) plus the positions seen and the curve; atomic."""
    Path(ckpt).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(ckpt).with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                "log": log, "elapsed": elapsed, "config": asdict(cfg), "seen": seen, "curve": curve}, tmp)
    tmp.replace(ckpt)


@torch.no_grad()
def teacher_accuracy(heads: MedusaHeads, data: TeacherData, rows: torch.Tensor, branch: int = 8,
                     max_positions: int = 4096, seed: int = 0, chunk: int = 256, answer_rows: int = 0) -> dict:
    """Each head's rank-r token vs the teacher's argmax at t+1+i, on (up to max_positions) positions of `rows`.

    Returns top1 [H] (= rank_accuracy[i][0]), rank_accuracy (H, branch) (the input of trees.sparse_tree), n [H]
    (positions with a target for head i), and top1_answers / top1_corpus: the same on rows < answer_rows (the
    model's own answers, which come first in the teacher data) and on the rest.
    """
    n_all, t_all = positions(data.mask, rows)
    if n_all.numel() == 0:
        raise ValueError("the held-out rows have no position with a target")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_all.numel(), generator=g)[:max_positions].sort().values
    n_all, t_all = n_all[pick], t_all[pick]
    H = heads.num_heads
    was_training = heads.training
    heads.eval()
    hits = torch.zeros(3, H, branch)  # all / answers / corpus
    counts = torch.zeros(3, H)
    for c in range(0, n_all.numel(), chunk):
        n, t = n_all[c: c + chunk], t_all[c: c + chunk]
        p = next(heads.parameters())
        top = heads(data.final[n, t].to(p.device, p.dtype)).topk(branch, -1).indices.cpu()  # (H, b, branch)
        groups = (torch.ones_like(n, dtype=torch.bool), n < answer_rows, n >= answer_rows)
        for i in range(H):
            ids, _, ok = head_targets(data, n, t, i)
            hit = (top[i] == ids[:, :1]).float()  # (b, branch): the teacher's argmax = the greedy token
            for gi, grp in enumerate(groups):
                sel = ok & grp
                hits[gi, i] += hit[sel].sum(0)
                counts[gi, i] += sel.sum()
    heads.train(was_training)
    acc = hits / counts.clamp(min=1)[..., None]  # (3, H, branch)
    return {"top1": acc[0, :, 0].tolist(), "rank_accuracy": acc[0].tolist(), "n": counts[0].long().tolist(),
            "top1_answers": acc[1, :, 0].tolist() if counts[1].sum() else None,
            "top1_corpus": acc[2, :, 0].tolist() if counts[2].sum() else None}
