"""Train an EAGLE head from the target's stored outputs: `python -m dvi_lite eagle-train --model smollm2`.

(The course model and any other checkpoint without a self-distillation set: `--model course` trains on the
teacher set by recipe.py's `prepare_model`, the recipe `prepare` runs too.)

Input: a `TeacherData` (models/teacher.py), e.g. the self-distillation set read by
`models.distill_reader.load_as_teacher(folder, split, layers=(2, 15, 27))`: per position the tokens, the states
after the fused layers, and the target's top-k next tokens with their log-probs. Target: that top-k,
renormalised on the head's draft vocabulary (soft_ce; a position with no target on the map is skipped). Loss:
EAGLE-3's training-time test (ttt.py), `ttt_steps` unrolled steps weighted decay**s. The target stays frozen
(its embedding is only read); the head trains fc, the projection, its layer and norms, and its LM head too when
HeadConfig.train_lm_head (EAGLE-3; else the target's rows stay frozen and shared, as in EAGLE-1/2). On a set,
the default is one pass over its rows.

AdamW, warm-up + cosine, gradient clipping, fp32 (bf16 autocast as an option, for GPUs). Checkpoints are atomic (a
temporary file renamed) every `ckpt_every` steps and every `ckpt_every_s` seconds, and hold the head, the
optimiser and the data order's generator, so a killed run resumed from its checkpoint ends bit-exact with an
uninterrupted one. The held-out numbers are the top-1 agreement of each draft step with the teacher (step 0:
the first draft token's teacher-forced acceptance) and the loss, before training, every `eval_every` steps
(the learning curve, against tokens seen) and at the end. Each curve point keeps an fp16 snapshot of the head
(`out/curve/tokens_<n>.pt`, save_head's file) for measuring tau later (`python -m dvi_lite curve-tau`);
`max_minutes` stops a run at a curve point with a checkpoint, and the same call resumes it.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int, check_real
from dvi_lite.measure.provenance import provenance
from dvi_lite.methods.eagle.head import EagleHead, HeadConfig, save_head
from dvi_lite.methods.eagle.ttt import ttt_loss
from dvi_lite.models.artifacts import ckpt_path, fingerprint
from dvi_lite.models.teacher import TeacherData, one_pass_steps
from dvi_lite.models.training import lr_at
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import check_output, load_torch


@dataclass
class EagleTrainConfig:
    head: HeadConfig = field(default_factory=HeadConfig)  # fused layers, init layer, draft vocabulary N
    ttt_steps: int = 4  # unrolled draft steps per position (EAGLE-3: 3-5 here)
    decay: float = 0.8  # step s weighs decay**s
    steps: int = 2000  # optimiser steps
    batch_rows: int = 4  # rows per step, cropped to the batch's longest real row
    lr: float = 5e-4  # peak learning rate
    min_lr_frac: float = 0.1  # cosine floor
    warmup: int = 50  # linear warm-up steps
    grad_clip: float = 0.5  # global norm clip
    val_frac: float = 0.05  # rows held out when no separate held-out data is given
    val_rows: int = 64  # held-out rows evaluated at most (every eval_every steps)
    eval_every: int = 200  # steps between learning-curve points (0 = only before and after)
    bf16: bool = False  # autocast the forward in bf16 (fp32 master weights); slower on an AVX2-only CPU, for GPUs
    ckpt_every: int = 0  # steps between checkpoints (0 = by time only)
    ckpt_every_s: float = 120.0  # seconds between checkpoints
    seed: int = 0  # row split and data order
    max_minutes: float | None = None  # stop (checkpointed, resumable) once training has taken this long in all

    def check(self) -> None:
        check_int("ttt_steps", self.ttt_steps, 1, 8, what="unrolled draft steps per position")
        check_real("decay", self.decay, 0.0, 1.0)
        check_int("steps", self.steps, 1)
        check_int("batch_rows", self.batch_rows, 1)
        check_real("lr", self.lr, 0.0)
        check_real("val_frac", self.val_frac, 0.0, 0.9)
        check_int("eval_every", self.eval_every, 0)
        check_int("ckpt_every", self.ckpt_every, 0)


def fused_states(data: TeacherData, layers: tuple[int, ...], n_layers: int) -> list[torch.Tensor]:
    """The stored states after each fused layer (N, T, D); after the last layer that is `data.final`."""
    return [data.final if k == n_layers else data.state(k) for k in layers]


def batch(data: TeacherData, states: list[torch.Tensor], rows: torch.Tensor, device) -> dict:
    """Rows of the data cropped to their longest real row, on `device`: states fp32 (B, T, D), tokens, mask, top-k."""
    t = data.width(rows)
    return {"states": [s[rows, :t].to(device, torch.float32) for s in states],
            "tokens": data.tokens[rows, :t].to(device), "mask": data.mask[rows, :t].to(device),
            "top_ids": data.top_ids[rows, :t].to(device), "top_logp": data.top_logp[rows, :t].to(device)}


def _loss(head: EagleHead, b: dict, cfg: EagleTrainConfig) -> tuple[torch.Tensor, list[dict]]:
    dev = head.fc.weight.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        return ttt_loss(head, b["states"], b["tokens"], b["mask"], b["top_ids"], b["top_logp"], cfg.ttt_steps,
                        cfg.decay)


@torch.no_grad()
def evaluate(head: EagleHead, data: TeacherData, states: list[torch.Tensor], rows: torch.Tensor,
             cfg: EagleTrainConfig) -> dict:
    """Held-out loss and top-1 agreement with the teacher per draft step (step 0 = the first draft token)."""
    was = head.training
    head.eval()
    loss, n_rows = 0.0, 0
    agree = [0] * cfg.ttt_steps
    n = [0] * cfg.ttt_steps
    for i in range(0, len(rows), cfg.batch_rows):
        r = rows[i:i + cfg.batch_rows]
        total, stats = _loss(head, batch(data, states, r, head.fc.weight.device), cfg)
        loss, n_rows = loss + float(total) * len(r), n_rows + len(r)
        for s, st in enumerate(stats):
            agree[s], n[s] = agree[s] + st["agree"], n[s] + st["n"]
    head.train(was)
    per_step = [round(a / m, 4) if m else None for a, m in zip(agree, n, strict=True)]
    return {"val_loss": round(loss / max(1, n_rows), 4), "val_agreement": per_step[0],
            "val_agreement_steps": per_step, "val_positions": n[0]}


def split_rows(n: int, cfg: EagleTrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows): a seeded permutation whose last val_frac is held out (>= 1 row when n >= 2)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    n_val = min(n - 1, max(1, round(cfg.val_frac * n))) if cfg.val_frac > 0 and n > 1 else 0
    return perm[: n - n_val], perm[n - n_val:]


def _save_ckpt(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(body, tmp)
    tmp.replace(path)  # atomic: a kill leaves the previous checkpoint or the new one, never half of one


def train_eagle(model, data: TeacherData, cfg: EagleTrainConfig, out_dir: str | Path, resume: bool = True,
                val_data: TeacherData | None = None, vocab_ids: torch.Tensor | None = None,
                ckpt: str | Path | None = None, on_step: Callable[[int], None] | None = None,
                progress: bool = True, command: str = "") -> tuple[EagleHead, dict]:
    """Train a head on `data` (held out: `val_data`, or val_frac of its rows); save head.pt + card.json in out_dir.

    vocab_ids: the draft vocabulary (N,) (None: the full vocabulary, or cfg.head.vocab's committed map when it
    exists). ckpt: the checkpoint file (default out_dir/ckpt.pt); resume=True continues from it. on_step(step):
    called after every step and its checkpoint (tests interrupt a run there). Returns (head, card).
    """
    cfg.check()
    n_layers = model.config.num_hidden_layers
    hcfg = cfg.head.resolved(n_layers)
    if data.card.get("model") not in (None, fingerprint(model)):
        raise ValueError(f"the data is for model {data.card['model']}, not this one ({fingerprint(model)})")
    states = fused_states(data, hcfg.layers, n_layers)  # a clear error when a fused layer was not stored
    if vocab_ids is None:
        vocab_ids = committed_vocab(model, hcfg.vocab)
    out_dir = Path(out_dir)
    ckpt = Path(ckpt) if ckpt is not None else ckpt_path(  # under build/, keyed by model, recipe and output
        "eagle", model, {**asdict(cfg), "out": str(out_dir.resolve())})
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    head = EagleHead(model, hcfg, vocab_ids).float().train()
    dev = head.fc.weight.device
    if val_data is None:
        train_rows, val_rows = split_rows(len(data.tokens), cfg)
        val, val_states = data, states
    else:
        train_rows, val_rows = torch.arange(len(data.tokens)), torch.arange(len(val_data.tokens))
        val, val_states = val_data, fused_states(val_data, hcfg.layers, n_layers)
    val_rows = val_rows[: cfg.val_rows]
    opt = torch.optim.AdamW(head.trainable(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    step, tokens, elapsed, log, curve, init = 0, 0, 0.0, [], [], None
    if resume and ckpt.is_file():
        ck = load_torch(ckpt, "EAGLE training checkpoint", keys=("cfg", "head", "opt", "gen"))
        if _recipe(ck["cfg"]) != _recipe(asdict(cfg)):
            raise ValueError(f"checkpoint {ckpt} was written with another config; delete it or pass resume=False")
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, tokens, elapsed, log, curve, init = (ck[k] for k in ("step", "tokens", "elapsed", "log", "curve", "init"))
    init = init or evaluate(head, val, val_states, val_rows, cfg)
    t0, last = time.time() - elapsed, time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="eagle head", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)  # reads lr, warmup, steps, min_lr_frac: warm-up, then cosine to a floor
        rows = train_rows[torch.randint(len(train_rows), (cfg.batch_rows,), generator=gen)]
        b = batch(data, states, rows, dev)
        loss, stats = _loss(head, b, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.trainable(), cfg.grad_clip)
        opt.step()
        tokens += int(b["mask"].sum())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        log.append({"step": step + 1, "loss": round(loss.item(), 5), "tokens": tokens,
                    "agree0": stats[0]["agree"] / max(1, stats[0]["n"])})
        out_of_time = cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or out_of_time:  # a curve point and its snapshot
            curve.append({"step": step + 1, "tokens_seen": tokens, **evaluate(head, val, val_states, val_rows, cfg)})
            save_head(head, out_dir / "curve" / f"tokens_{tokens}.pt")
        done = step + 1 == cfg.steps
        if done or out_of_time or (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) \
                or time.time() - last > cfg.ckpt_every_s:
            _save_ckpt(ckpt, {"cfg": asdict(cfg), "head": head.state_dict(), "opt": opt.state_dict(),
                              "gen": gen.get_state(), "step": step + 1, "tokens": tokens, "log": log, "curve": curve,
                              "init": init, "elapsed": time.time() - t0})
            last = time.time()
        if on_step is not None:
            on_step(step + 1)
        if out_of_time and not done:
            bar.close()
            print(f"stopped after {cfg.max_minutes} min at step {step + 1} ({tokens} tokens seen): run the same "
                  "command again to resume")
            return head, {"stopped": True, "step": step + 1, "steps": cfg.steps, "train_tokens_seen": tokens,
                          "init": init, "final": curve[-1], "curve": curve, "wall_time_s": round(time.time() - t0, 1)}
    head.eval()
    final = evaluate(head, val, val_states, val_rows, cfg)
    path = save_head(head, out_dir / "head.pt")
    lm = "trained" if hcfg.train_lm_head else "the target's rows, frozen and shared (not stored)"
    card = {"what": f"EAGLE-3-style head: fc over the fused layers, one decoder layer, trimmed draft LM head ({lm})",
            "target": fingerprint(model), "config": asdict(cfg), "head": asdict(hcfg), "vocab_n": len(head.ids),
            "params": head.extra_params(), "bytes_fp16": path.stat().st_size, "steps": cfg.steps,
            "train_tokens_seen": tokens, "train_rows": len(train_rows), "val_rows": len(val_rows),
            "data": {k: data.card.get(k) for k in ("source", "split", "n_rows", "n_tokens", "model")},
            "init": init, "final": final, "curve": curve, "log": log[:: max(1, len(log) // 100)],
            "wall_time_s": round(time.time() - t0, 1), "command": command,
            "provenance": provenance(command, dev)}
    card.update(commit=card["provenance"]["commit"], device=card["provenance"]["device"])
    atomic_write_text(out_dir / "card.json", json.dumps(card, indent=1, default=str) + "\n")
    return head, card


def _recipe(cfg: dict) -> dict:
    """What a checkpoint must match to be resumed: the config without the time budget."""
    return {k: v for k, v in cfg.items() if k != "max_minutes"}


def committed_vocab(model, n: int | None, tokenizer=None) -> torch.Tensor | None:
    """This model's top-n map ids (None: the full vocabulary, also when n covers it); counted (with `tokenizer`)
    and saved when it does not exist yet."""
    v = model.get_output_embeddings().weight.shape[0]
    if n is None or n >= v:
        return None
    from dvi_lite.models.vocab import build_vocab_map, load_vocab_ids, vocab_map_path

    path = vocab_map_path(model, n)
    if not path.is_file():
        if tokenizer is None:
            raise ValueError(f"vocab={n}: no committed map at {path}; pass vocab_ids or build it with "
                             "models.vocab.build_vocab_map(model, tokenizer, n)")
        build_vocab_map(model, tokenizer, n, path=path)
    return load_vocab_ids(model, path)


def train_from_set(model_path, data: str | Path | None, cfg: EagleTrainConfig, out: str | Path | None = None,
                   resume: bool = True, max_tokens: int | None = None, command: str = "", force: bool = True) -> dict:
    """Train the head on the self-distillation set `data` (its states set or its token record; None: the model's
    set under build/): the train split trains, the val split is held out. Returns the card. model_path: a name, a
    folder, or a models.loading.Loaded handed down (loaded once). force=False: a committed head is kept."""
    from dvi_lite.models.artifacts import artifacts_dir
    from dvi_lite.models.distill_data import distill_dir
    from dvi_lite.models.distill_reader import load_distill
    from dvi_lite.models.loading import load_once

    model, tok = load_once(model_path, dtype="float32")
    out = Path(out) if out else artifacts_dir(model) / "eagle"
    check_output(out, kind="dir", force=force)  # before any work: a committed head needs --force
    n = model.config.num_hidden_layers
    layers = tuple(k for k in cfg.head.resolved(n).layers if k < n)  # the last layer's state is `final`
    folder = Path(data) if data else distill_dir(model)
    train = load_distill(model, folder, "train", layers=layers, final=True, max_tokens=max_tokens)
    val = load_distill(model, folder, "val", layers=layers, final=True, missing_ok=True)  # None: rows held out
    ids = committed_vocab(model, cfg.head.vocab, tok)
    if cfg.steps == EagleTrainConfig.steps:  # the set recipe: one pass over its rows unless steps were chosen
        cfg = replace(cfg, steps=one_pass_steps(train, cfg.batch_rows))
    return train_eagle(model, train, cfg, out, resume, val, ids, command=command)[1]


def prepare_smollm2(model_path, out_dir: Path, command: str, smoke: bool = False, data: str | Path | None = None,
                    max_minutes: float | None = None) -> dict:
    """`prepare`'s recipe for the EAGLE head: the default config on the set `data`, into out_dir (head.pt + card;
    curve snapshots in out_dir/curve/, ignored by git). smoke: 3 steps on the first 2k positions."""
    cfg = EagleTrainConfig(max_minutes=max_minutes)
    if smoke:
        cfg = EagleTrainConfig(steps=3, warmup=1, eval_every=0, val_rows=4)
    return train_from_set(model_path, data, cfg, out_dir, True, 2000 if smoke else None, command)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("eagle-train"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'course', 'smollm2' or a local HF checkpoint folder")
    ap.add_argument("--data", default=None, help="the self-distillation set's folder (smollm2's default: "
                    "build/distill/<fp>); without it any other model trains on its teacher set (eagle/recipe.py)")
    ap.add_argument("--layers", type=int, nargs=3, default=None, help="fused layers (default: 2, L // 2, L - 3)")
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary N (0 = the full vocabulary)")
    ap.add_argument("--ttt-steps", type=int, default=EagleTrainConfig.ttt_steps)
    ap.add_argument("--steps", type=int, default=EagleTrainConfig.steps)
    ap.add_argument("--batch-rows", type=int, default=EagleTrainConfig.batch_rows)
    ap.add_argument("--lr", type=float, default=EagleTrainConfig.lr)
    ap.add_argument("--max-tokens", type=int, default=None, help="read shards until this many positions")
    ap.add_argument("--eval-every", type=int, default=EagleTrainConfig.eval_every,
                    help="steps between learning-curve points, each with a snapshot in OUT/curve/")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (a GPU; on an AVX2-only CPU fp32 is faster)")
    ap.add_argument("--no-resume", action="store_true", help="start afresh even if a checkpoint exists")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (resumable) after this much training")
    ap.add_argument("--out", default=None, help="folder (default: artifacts_dir(model)/eagle; a committed one "
                    "needs --force)")
    add_force(ap)
    args = ap.parse_args(argv)

    def run() -> dict:
        if args.data is None and args.model != "smollm2":  # no self-distillation set: the teacher-set recipe
            fixed = [f"--{k.replace('_', '-')}" for k in ("layers", "vocab", "ttt_steps", "batch_rows", "lr",
                                                        "max_tokens", "eval_every", "bf16")
                     if getattr(args, k) != ap.get_default(k)]
            if fixed:
                raise ValueError(f"{', '.join(fixed)}: set by the teacher-set recipe (methods/eagle/recipe.py) "
                                 "on this model; they apply with --data (a self-distillation set)")
            import importlib

            from dvi_lite.models.artifacts import artifacts_dir
            from dvi_lite.models.loading import Loaded, load_model

            model, tok = load_model(args.model, dtype="float32")
            out = args.out or artifacts_dir(model) / "eagle"
            # recipe.py builds on this module: the command reaches it by name, as the table of commands does
            prepare_model = importlib.import_module("dvi_lite.methods.eagle.recipe").prepare_model
            return prepare_model(Loaded(model, tok, args.model), out, command_line("eagle-train", argv),
                                 max_minutes=args.max_minutes, resume=not args.no_resume,
                                 steps=None if args.steps == EagleTrainConfig.steps else args.steps)
        cfg = EagleTrainConfig(head=HeadConfig(tuple(args.layers) if args.layers else None, None, args.vocab or None),
                               ttt_steps=args.ttt_steps, steps=args.steps, batch_rows=args.batch_rows, lr=args.lr,
                               bf16=args.bf16, max_minutes=args.max_minutes, eval_every=args.eval_every)
        return train_from_set(args.model, args.data, cfg, args.out, not args.no_resume, args.max_tokens,
                              command_line("eagle-train", argv), force=args.force)

    card = run_or_usage_error(ap, run)
    print(json.dumps({k: card[k] for k in ("init", "final", "wall_time_s", "train_tokens_seen")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
