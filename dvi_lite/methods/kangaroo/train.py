"""Train a Kangaroo adapter by distillation from the frozen model: `python -m dvi_lite kangaroo-train`.

Recipe: windows of the corpus' train split; the frozen target gives the exit-layer states h_s and its
own next-token distribution p at every position; the adapter is trained so that
q = softmax(lm_head(adapter(h_s))) matches p, with loss KL(p || q) averaged over all positions
(dense, soft targets: every position teaches the whole distribution, not only the argmax).
AdamW, warm-up + cosine to a floor, gradient clipping, checkpoints every few minutes, `--resume`.
Only the adapter's parameters train; the LM head is shared and frozen.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.cli import command_line, prog, require_positive, run_or_usage_error
from dvi_lite.core.checks import check_split, default_split
from dvi_lite.core.runner import Runner
from dvi_lite.course_model.train import TrainConfig, batch, encode_split, lr_at
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter, adapter_path, save_adapter
from dvi_lite.models.artifacts import artifacts_dir
from dvi_lite.models.loading import load_model
from dvi_lite.paths import BUILD_DIR
from dvi_lite.study.provenance import provenance


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
    model, tok = load_model(model_path, dtype="float32")
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
    data, val = encode_split(tok, "train"), encode_split(tok, "val")
    gen = torch.Generator().manual_seed(cfg.seed)
    out = Path(out) if out is not None else adapter_path(cfg.split, artifacts_dir(model) / "kangaroo")
    ckpt = BUILD_DIR / "ckpt" / f"{ckpt_name or f'kangaroo_k{cfg.split}'}.pt"
    step, log, elapsed = 0, [], 0.0
    if resume and ckpt.is_file():
        ck = torch.load(ckpt, weights_only=False)
        adapter.load_state_dict(ck["adapter"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, log, elapsed = ck["step"], ck["log"], ck["elapsed"]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("kangaroo-train"), description=__doc__.splitlines()[0])
    ap.add_argument("--split", type=int, default=None, help="exit layer (default: core.checks.default_split)")
    ap.add_argument("--steps", type=int, default=AdapterConfig.steps)
    ap.add_argument("--model", default=None, help="local HF checkpoint (default: the course model)")
    ap.add_argument("--out", default=None, help="adapter file (default: data/kangaroo/adapter_k<split>.pt for the "
                    "course model, build/models/<fingerprint>/kangaroo/ for another)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    require_positive(ap, args, "steps")
    cfg = AdapterConfig(split=args.split, steps=args.steps)
    run_or_usage_error(ap, train_adapter, cfg, args.model, args.out, args.resume,
                       command_line("kangaroo-train", argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
