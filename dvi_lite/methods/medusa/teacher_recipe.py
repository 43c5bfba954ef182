"""The Medusa-heads recipe for a real model (SmolLM2): which data, how many steps, where the pieces go.

`python -m dvi_lite.methods.medusa.teacher_recipe --model smollm2 [--data FOLDER]` distils the heads from the
teacher's stored outputs (teacher_train.py holds the loss, the loop and the learning curve) and writes heads.pt
(fp16) and heads.json, the card, into the model's medusa folder.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dvi_lite.methods.medusa.heads import MedusaHeads, save_heads
from dvi_lite.methods.medusa.teacher_train import (
    PAPER_TOP1,
    DistillConfig,
    distill_with_curve,
    loss_vocab,
    positions,
    split_rows,
    teacher_accuracy,
)
from dvi_lite.models.artifacts import ckpt_path, fingerprint
from dvi_lite.models.teacher import TeacherConfig, TeacherData, load_teacher, teacher_outputs, teacher_path
from dvi_lite.models.vocab import resolve_vocab
from dvi_lite.paths import BUILD_DIR


def beside_paper(top1: list[float]) -> list[dict]:
    """Per head: our measured top-1 next to Medusa-1's (None past the paper's five heads)."""
    return [{"head": i, "ours": a, "paper": PAPER_TOP1[i] if i < len(PAPER_TOP1) else None}
            for i, a in enumerate(top1)]


def smoke_teacher(model, tok) -> TeacherData:
    """A tiny teacher (8 windows of 48 tokens of the course corpus' first documents), in seconds: CI's data."""
    from dvi_lite.models.corpus import load_docs

    cfg = TeacherConfig(layers=(1,), answers=0, corpus_windows=8, seq_len=48, top_k=8)
    rows = [tok(d.text, add_special_tokens=False)["input_ids"][: cfg.seq_len] for d in load_docs("train")[:8]]
    data = teacher_outputs(model, [r for r in rows if len(r) > 8], cfg)
    data.card = {"config": asdict(cfg), "smoke": True}
    return data


def _short_commit() -> str:
    import subprocess

    from dvi_lite.paths import ROOT

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def prepare_smollm2(model_path: str, out_dir: Path, command: str, smoke: bool = False,
                    data: str | Path | None = None, max_minutes: float | None = None,
                    steps: int | None = None) -> dict:
    """The recipe: distil Medusa heads from the teacher data; save heads.pt (fp16) + heads.json in out_dir.

    Reads build/teacher/<fingerprint>/teacher.pt (`python -m dvi_lite teacher --model smollm2` builds it) and
    the model's trimmed-vocabulary map (models.vocab, top `vocab` tokens). Resumes from its checkpoint when
    run again. smoke: a tiny teacher built here, 2 heads, 3 steps (seconds, for CI). Returns the card.

    data: a self-distillation set folder (models/distill_data.py) instead: its train shards train (by default
    one pass over their positions), its val shards are held out. Either way the card has the learning curve
    (snapshots in out_dir/curve/). max_minutes: the training-time budget; a run that reaches it saves no heads
    and returns {"stopped": True, ...}: the same call resumes it. steps: override the recipe's.
    """
    from dvi_lite.measure.provenance import device_name, provenance
    from dvi_lite.models.loading import load_once

    out_dir = Path(out_dir)
    model, tok = load_once(model_path, dtype="float32")
    for p in model.parameters():
        p.requires_grad_(False)
    val = None
    if smoke:
        cfg = DistillConfig(heads=2, steps=3, batch_size=32, warmup=1, vocab=None, val_frac=0.25, branch=4,
                            eval_positions=64, ckpt_every_s=1e9)
        tpath = "(smoke: built in memory)"
        data = smoke_teacher(model, tok)
        ckpt = ckpt_path("medusa_distill_smoke", model, {"cfg": asdict(cfg), "out": str(out_dir.resolve())})
    elif data is not None:
        from dvi_lite.models.distill_reader import load_distill

        cfg = DistillConfig()
        tpath = str(data)
        val = load_distill(model, data, "val", final=True, max_tokens=4 * cfg.eval_positions)
        data = load_distill(model, data, "train", final=True)
        n_pos = int(positions(data.mask, torch.arange(data.tokens.shape[0]))[0].numel())
        cfg = DistillConfig(steps=max(1, math.ceil(n_pos / cfg.batch_size)))  # one pass over the positions
        tag = hashlib.sha1(f"{Path(tpath).resolve()}|{out_dir.resolve()}".encode()).hexdigest()[:8]
        ckpt = BUILD_DIR / "ckpt" / f"medusa_distill_set_{fingerprint(model)}_{tag}.pt"
    else:
        cfg = DistillConfig()
        tpath = teacher_path(model)
        data = load_teacher(tpath)
        tag = hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:8]
        ckpt = BUILD_DIR / "ckpt" / f"medusa_distill_{fingerprint(model)}_{tag}.pt"
    cfg = DistillConfig(**{**asdict(cfg), "max_minutes": max_minutes, **({"steps": steps} if steps else {})})
    torch.manual_seed(cfg.seed)
    if val is None:
        train_rows, val_rows = split_rows(data.tokens.shape[0], cfg.val_frac, cfg.seed)
        val = data
    else:  # every training row trains; the set's val shards are held out
        train_rows, val_rows = torch.arange(data.tokens.shape[0]), torch.arange(val.tokens.shape[0])
    if cfg.vocab is None:  # smoke: the teacher's own ids
        trimmed = resolve_vocab(model, tok, torch.unique(data.top_ids).tolist())
    else:
        base = resolve_vocab(model, tok, cfg.vocab).ids.cpu()  # data/<model>/vocab/top<N>.pt (corpus counts)
        trimmed = resolve_vocab(model, tok, loss_vocab(data, train_rows, base, cfg.vocab))
    heads = MedusaHeads(model, cfg.heads, norm=True, shared_lm_head=True)
    run = distill_with_curve(heads, data, trimmed, cfg, train_rows, ckpt, resume=True, progress=not smoke, val=val,
                             val_rows=val_rows, curve_dir=out_dir / "curve")
    log = run["log"]
    if run["stopped"]:
        print(f"stopped after {cfg.max_minutes} min at step {run['step']} ({run['tokens_seen']} positions seen); "
              f"checkpoint {ckpt}: run the same command again to resume")
        return {"stopped": True, "step": run["step"], "steps": cfg.steps, "tokens_seen": run["tokens_seen"],
                "curve": run["curve"], "checkpoint": str(ckpt)}
    t_eval = time.time()
    answer_rows = len(data.card.get("questions", [])) if val is data else 0
    acc = teacher_accuracy(heads, val, val_rows, cfg.branch, cfg.eval_positions, cfg.seed, answer_rows=answer_rows)
    train_s = log[-1]["time_s"] if log else 0.0  # includes the time of resumed runs
    heads.accuracies = acc["rank_accuracy"]
    held_out = {"heldout_rows": val_rows.tolist()} if val is data else {
        "val_data": {k: val.card.get(k) for k in ("split", "n_rows", "n_tokens")}}
    card = {"method": "medusa", "num_heads": cfg.heads, "norm": True, "shared_lm_head": True,
            "trainable_params": sum(p.numel() for p in heads.trainable_parameters()), "dtype": "float16",
            "recipe": "self-distillation from the teacher's top-k (soft CE, 0.8^i head weights), trimmed-vocab loss",
            "data": {"teacher": str(tpath), "teacher_card": data.card, "train_rows": len(train_rows), **held_out,
                     "train_positions": int(positions(data.mask, train_rows)[0].numel())},
            "steps": cfg.steps, "positions_seen": run["tokens_seen"], "tokens_seen": run["tokens_seen"],
            "loss_vocab": len(trimmed),
            "loss_vocab_recipe": "teacher argmax ids on the training rows by frequency, then the corpus map top<N>",
            "final_loss_per_head": log[-1]["per_head"] if log else None,
            "accuracy": acc, "top1_vs_paper": beside_paper(acc["top1"]), "curve": run["curve"],
            "wall_time_s": round(train_s + time.time() - t_eval, 1), "train_time_s": round(train_s, 1),
            "config": asdict(cfg), "device": device_name(next(heads.parameters()).device),
            "smoke": smoke, "command": command,
            "provenance": provenance(command, next(heads.parameters()).device), "log": log[:: max(1, len(log) // 40)]}
    card["commit"] = _short_commit()
    save_heads(heads, model, out_dir / "heads.pt", card)
    if not smoke:  # keep the heads and the tree the cost model picks (`medusa-sizing --apply` also checks it)
        from dvi_lite.methods.medusa import sizing

        pick = sizing.committed_pick(card)
        sizing.apply(pick, out_dir / "heads.pt", out_dir.parent / "defaults.json", sizing.RESULT)
    return card


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    from dvi_lite.commands import add_force, check_outputs
    from dvi_lite.models.artifacts import artifacts_dir
    from dvi_lite.models.loading import Loaded, load_model
    from dvi_lite.safety import smoke_dir

    prog = "python -m dvi_lite.methods.medusa.teacher_recipe"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (default), 'course' or a local HF checkpoint folder")
    ap.add_argument("--out", default=None, help="folder for heads.pt + heads.json (default: "
                    "artifacts_dir(model)/medusa; with --smoke, build/smoke/)")
    ap.add_argument("--data", default=None, help="a self-distillation set folder (python -m dvi_lite distill-data): "
                    "train on its train shards, hold its val shards out (default: the small teacher set)")
    ap.add_argument("--steps", type=int, default=None, help=f"optimiser steps (default: {DistillConfig.steps}; "
                    "with --data, one pass over the set's training positions)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (resumable: run the same command again) "
                    "after this much training in all")
    ap.add_argument("--smoke", action="store_true", help="a tiny teacher, 2 heads, 3 steps (seconds)")
    add_force(ap)
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    try:
        model, tok = load_model(args.model, dtype="float32")
        out = Path(args.out) if args.out else smoke_dir("medusa-teacher-recipe") if args.smoke else \
            artifacts_dir(model) / "medusa"
        check_outputs(ap, (out, "dir", "--out"), force=args.force, smoke=args.smoke)
        card = prepare_smollm2(Loaded(model, tok, args.model), out, command, args.smoke, args.data,
                               args.max_minutes, args.steps)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    keys = ("stopped", "step", "steps", "tokens_seen", "checkpoint") if card.get("stopped") else (
        "top1_vs_paper", "final_loss_per_head", "tokens_seen", "wall_time_s")
    print(json.dumps({k: card[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
