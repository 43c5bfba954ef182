"""Train a Kangaroo adapter by distillation from the frozen model: `python -m dvi_lite kangaroo-train`.

Two recipes. With `--teacher FILE` or `--data FOLDER` (what SmolLM2 uses, `train_from_teacher`, `prepare_smollm2`):
from the teacher's stored outputs through a trimmed head, see `distill.py`; FILE is the small teacher set
(models.teacher), FOLDER a self-distillation set (models.distill_data: its train shards train, its val shards
are held out for the learning curve; `--max-minutes` stops resumably, the same command resumes). Without (the
course model's):
windows of the corpus' train split; the frozen target gives the exit-layer states h_s and its
own next-token distribution p at every position; the adapter is trained so that
q = softmax(lm_head(adapter(h_s))) matches p, with loss KL(p || q) averaged over all positions
(dense, soft targets: every position teaches the whole distribution, not only the argmax).
AdamW, warm-up + cosine to a floor, gradient clipping, checkpoints every few minutes, `--resume`.
Only the adapter's parameters train; the LM head is shared and frozen.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, check_outputs, command_line, prog, require_positive, run_or_usage_error
from dvi_lite.core.checks import check_split, default_split
from dvi_lite.core.runner import Runner
from dvi_lite.measure.provenance import provenance
from dvi_lite.methods.kangaroo.distill import TeacherFitConfig, fit_adapter
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter, adapter_path, save_adapter
from dvi_lite.models.artifacts import artifacts_dir, ckpt_path, fingerprint
from dvi_lite.models.loading import Loaded, bf16_is_fast, load_model, load_once
from dvi_lite.models.teacher import TeacherConfig, TeacherData, load_teacher, one_pass_steps, teacher_for, teacher_path
from dvi_lite.models.training import TrainConfig, batch, encode_split, lr_at
from dvi_lite.paths import BUILD_DIR, DATA_DIR
from dvi_lite.safety import load_torch


@dataclass
class AdapterConfig:
    split: int | None = None  # exit layer; None = core.checks.default_split (2 for the course model's 12 layers)
    steps: int = 300  # optimiser steps
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # window length
    lr: float = 1e-3  # peak learning rate
    min_lr_frac: float = 0.1  # cosine floor (never decay to zero)
    warmup: int = 20  # linear warm-up steps
    grad_clip: float = 1.0  # global norm clip
    ckpt_every_s: float = 120.0  # seconds between checkpoints
    seed: int = 0  # data order and init


def distill_loss(adapter: KangarooAdapter, runner: Runner, x: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, averaged: p from the frozen full model, q from the exit layer + adapter."""
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    with torch.no_grad():
        hk = runner.layers_forward(runner.embed(x), None, pos, 0, adapter.split)
        logp = runner.logits(runner.layers_forward(hk, None, pos, adapter.split)).float().log_softmax(-1)
    logq = runner.lm_head(adapter(hk, runner.rotary(hk, pos))).float().log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def train_adapter(cfg: AdapterConfig, model_path: str | None = None, out: Path | None = None,
                  resume: bool = False, command: str = "", ckpt_name: str | None = None) -> dict:
    torch.manual_seed(cfg.seed)
    model, tok = load_once(model_path, dtype="float32")
    for p in model.parameters():
        p.requires_grad_(False)
    runner = Runner(model)
    if cfg.split is None:
        cfg = replace(cfg, split=default_split(runner.n_layers))
    check_split(cfg.split, runner.n_layers)
    adapter = KangarooAdapter(model, cfg.split).train()
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    tcfg = TrainConfig(seq_len=cfg.seq_len, batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr,
                       min_lr_frac=cfg.min_lr_frac, warmup=cfg.warmup)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = Path(out) if out is not None else adapter_path(cfg.split, artifacts_dir(model) / "kangaroo")
    ckpt = (BUILD_DIR / "ckpt" / f"{ckpt_name}.pt" if ckpt_name  # else keyed by the model and the recipe
            else BUILD_DIR / "ckpt" / ckpt_path(f"kangaroo_k{cfg.split}", model, asdict(cfg)).name)
    step, log, elapsed = 0, [], 0.0
    if resume and ckpt.is_file():
        ck = load_torch(ckpt, "Kangaroo training checkpoint", keys=("adapter", "opt", "gen"))
        adapter.load_state_dict(ck["adapter"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, log, elapsed = ck["step"], ck["log"], ck["elapsed"]
    data, val = encode_split(tok, "train"), encode_split(tok, "val")  # after the checkpoint: a bad one fails fast
    t0, last = time.time() - elapsed, time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=f"adapter k={cfg.split}")
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tcfg)
        x = batch(data, tcfg, gen)[0].to(runner.device)
        loss = distill_loss(adapter, runner, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), cfg.grad_clip)
        opt.step()
        bar.set_postfix(kl=f"{loss.item():.3f}")
        log.append({"step": step + 1, "kl": loss.item()})
        if time.time() - last > cfg.ckpt_every_s or step + 1 == cfg.steps:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"adapter": adapter.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step + 1, "log": log, "elapsed": time.time() - t0}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
            last = time.time()
    adapter.eval()
    with torch.no_grad():
        vx = batch(val, tcfg, torch.Generator().manual_seed(1))[0].to(runner.device)
        val_kl = distill_loss(adapter, runner, vx).item()
    card = {"split": cfg.split, "params": sum(p.numel() for p in adapter.parameters()), "val_kl": val_kl,
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len, "wall_time_s": time.time() - t0,
            "config": asdict(cfg), "provenance": provenance(command), "log": log[:: max(1, len(log) // 50)]}
    save_adapter(adapter, model, out, card)
    print(json.dumps({k: card[k] for k in ("split", "params", "val_kl", "tokens_seen", "wall_time_s")}))
    return card


# SmolLM2's exit layer (the committed adapter's; DVI's head exits there too, methods/dvi/cli.py) and its final
# recipe. The exit is the one the sweep on the token record ranks first (sweep.py; results/15_kangaroo_smollm2.json).
SMOLLM2_SPLIT = 2
SMOLLM2_RECIPE = TeacherFitConfig(split=SMOLLM2_SPLIT, steps=300)


def teacher_card(data: TeacherData, path: str | Path | None) -> dict:
    """What the teacher data was (its card without the question list), for the adapter's card."""
    return {"file": str(path) if path is not None else None,
            **{k: v for k, v in data.card.items() if k != "questions"},
            "n_questions": len(data.card.get("questions", []))}


def train_from_teacher(model, tok, data: TeacherData, cfg: TeacherFitConfig, out: Path, resume: bool = False,
                       command: str = "", teacher_file: str | Path | None = None, ckpt: Path | None = None,
                       val: TeacherData | None = None) -> dict:
    """Train the adapter for exit layer cfg.split from the teacher data (distill.fit_adapter), save it in half
    precision at `out` with its card (data, steps, command, commit, device, wall time, val numbers, learning
    curve); the curve's snapshots go to out's folder/curve/<out's stem>/tokens_<n>.pt.

    val: held-out data (a self-distillation set's val shards; None = rows of `data` held out). A run stopped
    by cfg.max_minutes saves no adapter: its card says "stopped", and the same call with resume=True goes on.
    """
    out = Path(out)
    adapter, card = fit_adapter(model, tok, data, cfg, resume, ckpt, val=val, curve_dir=curve_dir(out))
    if card.get("stopped"):
        return card
    dev = next(model.parameters()).device
    card = {**card, "data": teacher_card(data, teacher_file), "command": command,
            "provenance": provenance(command, dev)}
    card.update(commit=card["provenance"].get("commit"), device=card["provenance"]["device"])
    save_adapter(adapter, model, out, card)
    print(json.dumps({"split": card["split"], "val": card["val"], "init_alpha": card["init"]["alpha"],
                      "tokens_seen": card["tokens_seen"], "wall_time_s": card["wall_time_s"]}))
    return card


def curve_dir(out: Path) -> Path:
    """Where the learning curve's snapshots of the adapter file `out` go: <its folder>/curve/<its stem>/."""
    return Path(out).parent / "curve" / Path(out).stem


def load_set(model, folder: str | Path, split: int, val_max_tokens: int) -> tuple[TeacherData, TeacherData | None]:
    """(train, held-out) of a self-distillation set (models/distill_data.py) with the states after exit layer
    `split`, cut into 256-position windows; the held-out part stops at the shard that reaches val_max_tokens.
    From the committed token record alone (data/smollm2/distill/), the targets are the target's own answer
    tokens and the states are computed here (the first `split` layers only). Held-out None: no val shard yet (the
    fit holds out rows of the training split instead)."""
    from dvi_lite.models.distill_reader import load_distill

    train = load_distill(model, folder, "train", layers=(split,))
    val = load_distill(model, folder, "val", layers=(split,), max_tokens=val_max_tokens, missing_ok=True)
    return train, val


def set_ckpt(model, split: int, folder: str | Path, out: Path) -> Path:
    """The checkpoint of a run on a self-distillation set: one per model, exit layer, set and output file."""
    tag = hashlib.sha1(f"{Path(folder).resolve()}|{Path(out).resolve()}".encode()).hexdigest()[:8]
    return BUILD_DIR / "ckpt" / f"kangaroo_set_k{split}_{fingerprint(model)}_{tag}.pt"


def prepare_smollm2(model_path: str, out_dir: Path, command: str, smoke: bool = False,
                    data: str | Path | None = None, max_minutes: float | None = None, steps: int | None = None,
                    split: int | None = None) -> dict:
    """SmolLM2's Kangaroo adapter by the recipe: SMOLLM2_RECIPE at SMOLLM2_SPLIT from the model's teacher data
    (built first when missing), saved to out_dir/kangaroo/adapter_k<split>.pt (out_dir: the artifacts folder,
    data/smollm2/). smoke: a tiny teacher (built under out_dir) and a few steps, for CI on the course model.

    data: a self-distillation set folder (models/distill_data.py): trains on its train shards (by default one
    pass: `one_pass_steps`), holds its val shards out for the learning curve, resumes from its checkpoint.
    max_minutes: the training-time budget (stop resumably); steps, split: override the recipe's.
    """
    model, tok = load_once(model_path, dtype="float32")
    out_dir = Path(out_dir)
    cfg = replace(SMOLLM2_RECIPE, bf16=SMOLLM2_RECIPE.bf16 and bf16_is_fast(next(model.parameters()).device),
                  max_minutes=max_minutes)
    if split is not None:
        cfg = replace(cfg, split=split)
    if steps is not None:
        cfg = replace(cfg, steps=steps)
    val = None
    if smoke:  # a tiny teacher over a few prompts, a map counted on them: seconds
        from dvi_lite.models.specbench import read_prompts
        from dvi_lite.models.teacher import teacher_outputs
        from dvi_lite.models.vocab import build_vocab_map, head_vocab_size

        texts = [r["prompt"] for r in read_prompts(DATA_DIR / "prompts" / "heldout.jsonl.xz")[:6]]
        tcfg = TeacherConfig(answers=0, corpus_windows=len(texts), layers=(cfg.split,))
        data = teacher_outputs(model, [tok(t)["input_ids"][:48] for t in texts], tcfg)
        data.card = {"config": asdict(tcfg), "smoke": "heldout prompts, no answers", "n_rows": len(texts)}
        tfile = None
        vocab = build_vocab_map(model, tok, min(256, head_vocab_size(model)), texts=texts,
                                path=out_dir / "vocab" / "smoke.pt", command=command)
        cfg = replace(cfg, steps=3, warmup=1, batch_rows=2, vocab=str(vocab), val_frac=0.34)
        ckpt = out_dir / "kangaroo" / "ckpt_smoke.pt"
    elif data is not None:
        tfile = Path(data)
        data, val = load_set(model, tfile, cfg.split, cfg.val_max_tokens)
        cfg = cfg if steps is not None else replace(cfg, steps=one_pass_steps(data, cfg.batch_rows))
        ckpt = set_ckpt(model, cfg.split, tfile, adapter_path(cfg.split, out_dir / "kangaroo"))
    else:
        tfile = teacher_path(model)
        data = teacher_for(model, tok)
        ckpt = BUILD_DIR / "ckpt" / f"kangaroo_teacher_k{cfg.split}_{fingerprint(model)}.pt"
    out = adapter_path(cfg.split, out_dir / "kangaroo")
    card = train_from_teacher(model, tok, data, cfg, out, resume=not smoke, command=command,
                              teacher_file=tfile, ckpt=ckpt, val=val)
    if card.get("stopped"):
        return {"stopped": True, "split": cfg.split, "step": card["step"], "steps": card["steps"],
                "tokens_seen": card["tokens_seen"], "checkpoint": card["checkpoint"]}
    return {"kangaroo adapter": str(out), "split": cfg.split, "val": card["val"], "curve": card["curve"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("kangaroo-train"), description=__doc__.splitlines()[0])
    ap.add_argument("--split", type=int, default=None, help="exit layer (default: core.checks.default_split)")
    ap.add_argument("--steps", type=int, default=None, help=f"optimiser steps (default: {AdapterConfig.steps}; "
                    "with --data, one pass over the set's train shards)")
    ap.add_argument("--model", default=None, help="local HF checkpoint or 'smollm2' (default: the course model)")
    ap.add_argument("--out", default=None, help="adapter file (default: in the model's pieces folder, "
                    "artifacts_dir(model)/kangaroo)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint (always so with --data or "
                    "--max-minutes)")
    ap.add_argument("--teacher", default=None, help="teacher data file (models.teacher): train from it through a "
                    "trimmed head (the real-model recipe); 'auto' = the model's build/teacher/<fingerprint>/ file")
    ap.add_argument("--data", default=None, help="a self-distillation set folder (python -m dvi_lite distill-data): "
                    "train on its train shards, hold its val shards out for the learning curve; resumes")
    ap.add_argument("--max-minutes", type=float, default=None, help="with --teacher or --data: stop (resumable) "
                    "after this much training in all")
    ap.add_argument("--vocab", default="8192", help="with --teacher or --data: trimmed head size N or a saved "
                    "map's path")
    add_force(ap)
    args = ap.parse_args(argv)
    if args.steps is not None:
        require_positive(ap, args, "steps")
    if args.teacher is not None and args.data is not None:
        ap.error("--teacher and --data are two data sets: give one")
    if args.teacher is not None or args.data is not None:
        return _teacher_main(ap, args, command_line("kangaroo-train", argv))
    if args.max_minutes is not None:
        ap.error("--max-minutes needs --teacher or --data (the corpus recipe has no time budget)")
    cfg = AdapterConfig(split=args.split, steps=AdapterConfig.steps if args.steps is None else args.steps)
    model, tok = run_or_usage_error(ap, load_model, args.model, dtype="float32")
    split = default_split(model.config.num_hidden_layers) if args.split is None else args.split
    out = Path(args.out) if args.out else adapter_path(split, artifacts_dir(model) / "kangaroo")
    check_outputs(ap, (out, "file", "--out"), force=args.force)
    run_or_usage_error(ap, train_adapter, cfg, Loaded(model, tok, str(args.model)), out, args.resume,
                       command_line("kangaroo-train", argv))
    return 0


def _teacher_main(ap: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> int:
    def run() -> dict:
        model, tok = load_model(args.model or "course", dtype="float32")
        split = default_split(model.config.num_hidden_layers) if args.split is None else args.split
        check_split(split, model.config.num_hidden_layers)
        vocab = int(args.vocab) if args.vocab.isdigit() else args.vocab
        cfg = TeacherFitConfig(split=split, vocab=vocab, max_minutes=args.max_minutes,
                               bf16=bf16_is_fast(next(model.parameters()).device))
        out = Path(args.out) if args.out else adapter_path(split, artifacts_dir(model) / "kangaroo")
        check_outputs(ap, (out, "file", "--out"), force=args.force)
        if args.data is not None:
            data, val = load_set(model, args.data, split, cfg.val_max_tokens)
            cfg = replace(cfg, steps=args.steps or one_pass_steps(data, cfg.batch_rows))
            return train_from_teacher(model, tok, data, cfg, out, True, command, args.data,
                                      set_ckpt(model, split, args.data, out), val=val)
        tfile = teacher_path(model) if args.teacher == "auto" else Path(args.teacher)
        cfg = replace(cfg, steps=args.steps or AdapterConfig.steps)
        resume = args.resume or args.max_minutes is not None  # a time budget's stop is resumed by the same command
        return train_from_teacher(model, tok, load_teacher(tfile), cfg, out, resume, command, tfile)

    run_or_usage_error(ap, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
