"""Distil an SpS draft (draft.py) from the teacher's outputs: `python -m dvi_lite.methods.sps.train --model smollm2`.

Input: the teacher's rows (models/teacher.py: the model's own greedy answers + corpus windows). Target: the
teacher's top-k next tokens at every position (`soft_ce`), through the trimmed head when the draft has one
(the targets off its map are dropped and the rest renormalised): the full 49152-row head would cost most
of each step. Only the draft's own layers and final norm train; the shared embedding and head stay frozen.
bf16 autocast, AdamW, linear warm-up + cosine to a floor, gradient clipping, a checkpoint every few minutes
and resume. Held-out rows (chosen by the seed) measure the draft's top-1 agreement with the teacher, the
teacher-forced estimate of greedy SpS's acceptance rate alpha.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, prog
from dvi_lite.core.checks import check_int
from dvi_lite.methods.sps.draft import TrimmedLMHead, build_draft, save_draft
from dvi_lite.models.artifacts import ckpt_path, fingerprint
from dvi_lite.models.teacher import TeacherConfig, TeacherData, soft_ce, teacher_for, teacher_outputs
from dvi_lite.safety import check_output, load_torch, smoke_dir


@dataclass
class TrainConfig:
    layers: tuple[int, ...] = (0,)  # target layers copied as the draft's init (their count = the draft's depth)
    vocab: int | None = 8192  # trimmed head: this model's top-N map (models/vocab.py); None = the full head
    steps: int = 300  # optimiser steps
    batch_rows: int = 4  # teacher rows per step (each cropped to the batch's longest real row)
    lr: float = 5e-4  # peak learning rate
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac
    warmup: int = 20  # linear warm-up steps
    weight_decay: float = 0.0  # the init is the target's own layers: no pull towards zero
    grad_clip: float = 1.0  # global norm clip
    val_frac: float = 0.1  # rows held out for the agreement estimate (chosen by the seed)
    autocast: bool = True  # bf16 autocast (CPU or CUDA); False = fp32
    ckpt_every_s: float = 120.0  # seconds between checkpoints
    milestones: tuple[int, ...] = (100_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000)
    # tokens seen at which the held-out agreement is measured and a snapshot kept (the learning curve)
    max_minutes: float | None = None  # stop (checkpointed, resumable) once training has taken this long in all
    val_max_tokens: int = 40_000  # held-out positions scored at each milestone
    seed: int = 0  # one seed for the split, the row order and nothing else (the init is the target's)
    extra: dict = field(default_factory=dict)


def split_rows(n: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows): a seeded permutation, the last val_frac of it held out (>= 1 row each)."""
    if n < 2:
        raise ValueError(f"the teacher data has {n} row(s); distilling needs >= 2 (one held out)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    n_val = min(n - 1, max(1, round(n * cfg.val_frac)))
    return perm[: n - n_val], perm[n - n_val:]


def _map_targets(head, ids: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher top-k (..., k) -> indices into the draft head's outputs and log-probs (-inf where dropped)."""
    if not isinstance(head, TrimmedLMHead):
        return ids, logp.float()
    where = torch.full((head.vocab_size,), -1, dtype=torch.long, device=ids.device)
    where[head.ids] = torch.arange(len(head.ids), device=ids.device)
    small = where[ids]  # (..., k)
    return small.clamp(min=0), logp.float().masked_fill(small < 0, float("-inf"))


def batch_loss(draft, teacher: TeacherData, rows: torch.Tensor, cfg: TrainConfig) -> tuple[torch.Tensor, dict]:
    """Mean soft CE over the real positions of `rows`, and the top-1 agreement counts."""
    mask, t = teacher.mask[rows], teacher.width(rows)  # (B, T) the positions scored; t: through the last one
    dev = draft.lm_head.weight.device
    x, mask = teacher.tokens[rows, :t].to(dev), mask[:, :t].to(dev)  # (B, T)
    ids, logp = _map_targets(draft.lm_head, teacher.top_ids[rows, :t].to(dev), teacher.top_logp[rows, :t].to(dev))
    ctx = torch.autocast(dev.type, torch.bfloat16) if cfg.autocast else torch.autocast(dev.type, enabled=False)
    with ctx:
        h = draft.model(input_ids=x).last_hidden_state  # (B, T, D), after the final norm
        head = draft.lm_head
        logits = head.small(h) if isinstance(head, TrimmedLMHead) else head(h)  # (B, T, N)
    logq = logits.float().log_softmax(-1)
    ok = mask & torch.isfinite(logp).any(-1)  # positions with some teacher target on the map
    loss = soft_ce(logq, ids, logp.masked_fill(~ok[..., None], 0.0))[ok].mean()
    agree = (logq.argmax(-1) == ids[..., 0]) & torch.isfinite(logp[..., 0]) & mask
    return loss, {"agree": int(agree.sum()), "n": int(mask.sum())}


@torch.no_grad()
def evaluate(draft, teacher: TeacherData, rows: torch.Tensor, cfg: TrainConfig) -> dict:
    """Held-out soft CE and top-1 agreement with the teacher (greedy alpha, teacher-forced)."""
    tot, agree, n = 0.0, 0, 0
    for b in range(0, len(rows), cfg.batch_rows):
        loss, c = batch_loss(draft, teacher, rows[b:b + cfg.batch_rows], cfg)
        tot, agree, n = tot + float(loss) * c["n"], agree + c["agree"], n + c["n"]
    return {"val_soft_ce": round(tot / n, 4), "val_agreement": round(agree / n, 4), "val_tokens": n}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))


def _recipe(cfg: dict) -> dict:
    """What a checkpoint must match to be resumed: the config without the time budget."""
    return {k: v for k, v in cfg.items() if k != "max_minutes"}


def val_rows_capped(teacher: TeacherData, rows: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The first held-out rows holding about max_tokens real positions (a milestone's evaluation budget)."""
    n = teacher.mask[rows].sum(1).cumsum(0)
    return rows[: max(1, int((n < max_tokens).sum()) + 1)]


def snapshot(draft, target, path: Path) -> None:
    """The draft as draft.pt holds it (own weights in fp16, source layers, vocabulary map, target fingerprint): a
    learning-curve point that `load_draft(target, path)` loads, for measuring tau later. Written atomically."""
    from dvi_lite.methods.sps.draft import draft_body

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(draft_body(draft, target), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def distil(target, teacher: TeacherData, cfg: TrainConfig, out_dir: str | Path, command: str = "",
           resume: bool = True, ckpt: str | Path | None = None, vocab_ids: torch.Tensor | None = None,
           val: TeacherData | None = None) -> dict:
    """Build the draft from the target's `cfg.layers`, distil it, save it (draft.pt + card.json) in out_dir.

    val: held-out data (the distillation set's val shards); None = hold out cfg.val_frac of `teacher`'s rows.
    At every milestone of tokens seen, the held-out agreement is measured and a snapshot kept under
    out_dir/curve/: the learning curve goes into the card.
    """
    from dvi_lite.measure.provenance import provenance

    check_int("steps", cfg.steps, 1)
    check_int("batch_rows", cfg.batch_rows, 1)
    if teacher.card.get("model") not in (None, fingerprint(target)):
        raise ValueError(f"the teacher data is for model {teacher.card['model']}, not {fingerprint(target)}")
    torch.manual_seed(cfg.seed)
    draft = build_draft(target, cfg.layers, vocab_ids)
    for p in target.parameters():
        p.requires_grad_(False)
    own = [p for n, p in draft.model.named_parameters() if n.startswith(("layers.", "norm."))]
    for p in own:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(own, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if val is None:
        train_rows, val_rows = split_rows(len(teacher.tokens), cfg)
        val = teacher
    else:
        train_rows, val_rows = torch.arange(len(teacher.tokens)), torch.arange(len(val.tokens))
    val_rows = val_rows_capped(val, val_rows, cfg.val_max_tokens)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([train_rows[torch.randperm(len(train_rows), generator=gen)]
                       for _ in range(cfg.steps * cfg.batch_rows // len(train_rows) + 1)])
    ckpt = Path(ckpt) if ckpt is not None else ckpt_path("sps", target, asdict(cfg))  # keyed by model and recipe
    step, log, elapsed, init, seen, curve = 0, [], 0.0, None, 0, []
    if resume and ckpt.is_file():
        ck = load_torch(ckpt, "SpS training checkpoint", keys=("cfg",))
        if _recipe(ck["cfg"]) == _recipe(asdict(cfg)):
            draft.model.load_state_dict(ck["own"], strict=False)
            opt.load_state_dict(ck["opt"])
            step, log, elapsed, init = ck["step"], ck["log"], ck["elapsed"], ck["init"]
            seen, curve = ck.get("seen", 0), ck.get("curve", [])
    init = init or evaluate(draft.eval(), val, val_rows, cfg)  # the copied layers before any step
    curve = curve or [{"tokens": 0, "step": 0, **init}]
    t0, last = time.time() - elapsed, time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=f"sps draft ({len(cfg.layers)} layers)")
    draft.train()
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_at(step, cfg)
        loss, c = batch_loss(draft, teacher, order[step * cfg.batch_rows:(step + 1) * cfg.batch_rows], cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(own, cfg.grad_clip)
        opt.step()
        seen += c["n"]
        bar.set_postfix(loss=f"{loss.item():.3f}", tokens=f"{seen / 1e6:.2f}M")
        if step % 20 == 0 or step + 1 == cfg.steps:
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "tokens": seen})
        passed = [m for m in cfg.milestones if seen >= m and all(p["tokens"] < m for p in curve[1:])]
        out_of_time = cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes
        if passed or step + 1 == cfg.steps or out_of_time:  # a learning-curve point
            draft.eval()
            curve.append({"tokens": seen, "step": step + 1, **evaluate(draft, val, val_rows, cfg)})
            snapshot(draft, target, Path(out_dir) / "curve" / f"tokens_{seen}.pt")
            draft.train()
        if time.time() - last > cfg.ckpt_every_s or step + 1 == cfg.steps or passed or out_of_time:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"cfg": asdict(cfg), "own": {k: v for k, v in draft.model.state_dict().items()
                                                    if k.startswith(("layers.", "norm."))},
                        "opt": opt.state_dict(), "step": step + 1, "log": log, "init": init,
                        "elapsed": time.time() - t0, "seen": seen, "curve": curve},
                       ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
            last = time.time()
        if out_of_time and step + 1 < cfg.steps:
            bar.close()
            print(f"stopped after {cfg.max_minutes} min at step {step + 1} ({seen} tokens seen): run the same "
                  "command again to resume")
            return {"stopped": True, "step": step + 1, "steps": cfg.steps, "tokens_seen": seen, "curve": curve,
                    "init": init, "final": curve[-1], "wall_time_s": round(time.time() - t0, 1)}
    wall = time.time() - t0
    draft.eval()
    for p in own:
        p.requires_grad_(False)
    final = curve[-1] if curve[-1]["step"] == cfg.steps else evaluate(draft, val, val_rows, cfg)
    prov = provenance(command or None)
    card = {"what": "SpS draft: the target's layers " + ",".join(map(str, cfg.layers)) + " + final norm, "
            "distilled; embedding and LM head shared with the target (not stored)",
            "target": fingerprint(target), "config": asdict(cfg),
            "vocab": None if vocab_ids is None else int(len(vocab_ids)),
            "data": {k: teacher.card.get(k) for k in ("config", "model", "n_rows", "n_tokens", "provenance")},
            "val_data": {k: val.card.get(k) for k in ("split", "n_rows", "n_tokens")} if val is not teacher else None,
            "train_rows": len(train_rows), "val_rows": len(val_rows), "steps": cfg.steps, "tokens_seen": seen,
            "init": init, "final": final, "curve": curve, "log": log, "wall_time_s": round(wall, 1),
            "own_values": sum(p.numel() for p in own),
            "command": prov["command"], "commit": prov["commit"], "device": prov["device"],
            "provenance": prov}
    save_draft(draft, target, out_dir, card)
    return card


def _vocab_ids(model, tok, n: int | None) -> torch.Tensor | None:
    if n is None or n >= model.get_output_embeddings().weight.shape[0]:
        return None
    from dvi_lite.models.vocab import build_vocab_map, load_vocab_ids, vocab_map_path

    path = vocab_map_path(model, n)
    if not path.is_file():
        build_vocab_map(model, tok, n, path=path)
    return load_vocab_ids(model, path)


SMOKE_TEACHER = TeacherConfig(answers=0, corpus_windows=0, layers=(2,))
SMOKE_TEXTS = ("def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 3,
               "Speculative decoding drafts tokens cheaply and verifies them at once.", "1, 2, 3, 4, 5, 6, 7, 8")


def prepare_smollm2(model_path: str, out_dir: Path, command: str, smoke: bool = False,
                    cfg: TrainConfig | None = None, data: str | Path | None = None,
                    max_minutes: float | None = None) -> dict:
    """Regenerate the SpS draft of the model at `model_path` (SmolLM2) by the recipe into `out_dir`; its card.

    The teacher data is the model's (built first if missing: models/teacher.py); smoke = a tiny teacher built
    in a temporary folder and a few steps, for CI.
    """
    import tempfile

    from dvi_lite.models.loading import load_once

    model, tok = load_once(model_path, dtype="float32")
    cfg = cfg or TrainConfig()
    if max_minutes is not None:
        cfg = TrainConfig(**{**asdict(cfg), "max_minutes": max_minutes})
    if smoke:  # a tiny teacher on a few fixed texts (no generation, no corpus encoding) and 3 steps
        cfg = TrainConfig(**{**asdict(cfg), "steps": 3, "batch_rows": 2, "warmup": 1})
        rows = [tok(t, add_special_tokens=False)["input_ids"][:32] for t in SMOKE_TEXTS]
        teacher = teacher_outputs(model, rows, SMOKE_TEACHER)
        teacher.card = {"model": fingerprint(model), "n_rows": len(rows), "n_tokens": teacher.n_tokens,
                        "config": asdict(SMOKE_TEACHER), "smoke": True}
        with tempfile.TemporaryDirectory() as tmp:
            return distil(model, teacher, cfg, out_dir, command, resume=False, ckpt=Path(tmp) / "ckpt.pt",
                          vocab_ids=_vocab_ids(model, tok, cfg.vocab))
    if data is not None:  # the self-distillation set (models/distill_data.py): its val shards are held out
        from dvi_lite.models.distill_reader import load_distill
        from dvi_lite.models.teacher import one_pass_steps

        train, val = load_distill(model, data, "train"), load_distill(model, data, "val", missing_ok=True)
        if cfg.steps == TrainConfig.steps:  # the set recipe: one pass over its rows unless steps were chosen
            cfg = TrainConfig(**{**asdict(cfg), "steps": one_pass_steps(train, cfg.batch_rows)})
        return distil(model, train, cfg, out_dir, command, vocab_ids=_vocab_ids(model, tok, cfg.vocab), val=val)
    teacher = teacher_for(model, tok)
    return distil(model, teacher, cfg, out_dir, command, vocab_ids=_vocab_ids(model, tok, cfg.vocab))


def main(argv: list[str] | None = None) -> int:
    import sys

    from dvi_lite.commands import run_or_usage_error
    from dvi_lite.models.artifacts import artifacts_dir
    from dvi_lite.models.loading import load_model, resolve_model

    ap = argparse.ArgumentParser(prog=prog("sps-train"),
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (or a local Llama checkpoint folder)")
    ap.add_argument("--layers", type=int, nargs="+", default=list(TrainConfig.layers))
    ap.add_argument("--vocab", type=int, default=TrainConfig.vocab, help="trimmed head size N (0 = full head)")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch-rows", type=int, default=TrainConfig.batch_rows)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--no-autocast", action="store_true", help="train in fp32 (the default where bf16 is slow: "
                    "a CPU without AVX-512)")
    ap.add_argument("--data", default=None, help="a self-distillation set folder (python -m dvi_lite distill-data), "
                    "or its token record (data/smollm2/distill: hard labels); default: the small teacher set")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (resumable) after this much training")
    ap.add_argument("--out", default=None, help="folder (default: artifacts_dir(model)/sps, a committed one needs "
                    "--force; with --smoke, build/smoke/sps-train)")
    ap.add_argument("--smoke", action="store_true", help="a tiny teacher and 3 steps (CI)")
    add_force(ap)
    args = ap.parse_args(argv)
    command = " ".join(["python -m dvi_lite.methods.sps.train", *(sys.argv[1:] if argv is None else argv)])
    from dvi_lite.models.loading import bf16_is_fast

    cfg = TrainConfig(layers=tuple(args.layers), vocab=args.vocab or None, steps=args.steps,
                      batch_rows=args.batch_rows, lr=args.lr, autocast=not args.no_autocast and bf16_is_fast("cpu"),
                      max_minutes=args.max_minutes)

    def run() -> dict:
        out = args.out
        if out is None:
            out = smoke_dir("sps-train") if args.smoke else artifacts_dir(load_model(args.model)[0]) / "sps"
        check_output(out, kind="dir", force=args.force, smoke=args.smoke)  # before any work
        return prepare_smollm2(str(resolve_model(args.model)), Path(out), command, args.smoke, cfg, args.data)

    card = run_or_usage_error(ap, run)
    print(json.dumps({k: card[k] for k in ("init", "final", "wall_time_s", "steps") if k in card}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
