"""Train the course model (and its small draft model) on the corpus: `python -m dvi_lite train`.

nanoGPT-style: one dataclass config (a comment per default), a token stream from the train split, AdamW with
warm-up + cosine decay to a floor (the config, schedule and batching are models.training's, which the methods'
recipes share), fp32 (bf16 autocast's backward is far slower on a CPU), tqdm progress, checkpoints every few
minutes and `--resume`. The result is an HF `LlamaForCausalLM` folder (fp16 safetensors + tokenizer +
MODEL_CARD.md + card.json), so everything downstream loads it like any HF checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dvi_lite.commands import add_force, check_outputs, command_line, prog
from dvi_lite.measure.provenance import provenance
from dvi_lite.models.corpus import DOMAINS, load_prompts
from dvi_lite.models.tokenizer import EOS, train_tokenizer
from dvi_lite.models.training import TrainConfig, batch, encode_split, lr_at
from dvi_lite.paths import BUILD_DIR, DATA_DIR, atomic_write_text
from dvi_lite.safety import load_torch

TOKENIZER_DIR = DATA_DIR / "tokenizer"

PRESETS = {
    "course": TrainConfig(),
    "draft": TrainConfig(out_dir=str(DATA_DIR / "draft_model"), n_layer=2, steps=700),
    "tiny": TrainConfig(out_dir=str(BUILD_DIR / "tiny_model"), n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128,
                        steps=20, batch_size=4, seq_len=64, eval_every=10, eval_batches=2),
}


def get_tokenizer(vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """The committed tokenizer; trained once (3 s) if data/tokenizer is missing."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        train_tokenizer(vocab_size, TOKENIZER_DIR)
    return PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))


def model_config(cfg: TrainConfig, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    eos = tok.convert_tokens_to_ids(EOS)
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, intermediate_size=cfg.d_ff,
        max_position_embeddings=cfg.max_pos, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, data: np.ndarray, cfg: TrainConfig, n_batches: int, seed: int = 0) -> float:
    """Mean next-token cross-entropy over fixed random windows (same windows every call)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n_batches):
        x, y = batch(data, cfg, gen)
        logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return float(np.mean(losses))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def distinct_fraction(ids: list[int]) -> float:
    """Distinct tokens / tokens of an output: a looping model scores low (and inflates acceptance)."""
    return len(set(ids)) / max(1, len(ids))


@torch.no_grad()
def greedy_distinct(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, n: int = 40, new: int = 64) -> float:
    fracs = []
    for rec in load_prompts(n=None)[:: max(1, 300 // n)][:n]:
        ids = tok(rec["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        fracs.append(distinct_fraction(out[0, ids.shape[1] :].tolist()))
    return float(np.mean(fracs))


def train(cfg: TrainConfig, resume: bool = False, command: str = "") -> dict:
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    ckpt_path = BUILD_DIR / "ckpt" / (out.name + ".pt")
    tok = get_tokenizer(cfg.vocab_size)
    train_data = encode_split(tok, "train")
    val_data = {d: encode_split(tok, "val", d) for d in DOMAINS}
    model = LlamaForCausalLM(model_config(cfg, tok))
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, elapsed, log = 0, 0.0, []
    if resume and ckpt_path.is_file():
        ck = load_torch(ckpt_path, "course model training checkpoint", keys=("model", "opt", "gen"))
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        torch.set_rng_state(ck["rng"])
        step, elapsed, log = ck["step"], ck["elapsed"], ck["log"]
        print(f"resumed from {ckpt_path} at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M params, {len(train_data) / 1e6:.2f}M train tokens")
    t0, last_ckpt = time.time() - elapsed, time.time()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=out.name)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = batch(train_data, cfg, gen)
        logits = model(input_ids=x).logits  # (B, T, V); fp32: bf16 autocast's backward is far slower on a CPU
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tok_s = (step + 1) * cfg.batch_size * cfg.seq_len / (time.time() - t0)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:.0f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            v = {d: eval_loss(model, val_data[d], cfg, cfg.eval_batches) for d in DOMAINS}
            log.append({"step": step + 1, "train_loss": loss.item(), "val_loss": v, "time_s": time.time() - t0})
            tqdm.write(json.dumps(log[-1]))
        if time.time() - last_ckpt > cfg.ckpt_every_s:
            _checkpoint(ckpt_path, model, opt, gen, step + 1, time.time() - t0, log)
            last_ckpt = time.time()
    wall = time.time() - t0
    _checkpoint(ckpt_path, model, opt, gen, cfg.steps, wall, log)
    return _save(model, tok, cfg, val_data, n_params, wall, log, command)


def _checkpoint(path: Path, model, opt, gen, step: int, elapsed: float, log: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "rng": torch.get_rng_state(), "step": step, "elapsed": elapsed, "log": log}, tmp)
    tmp.replace(path)  # atomic: an interrupted save never corrupts the last good checkpoint


def _save(model, tok, cfg, val_data, n_params, wall, log, command) -> dict:
    out = Path(cfg.out_dir)
    val = {d: eval_loss(model, val_data[d], cfg, 4 * cfg.eval_batches, seed=1) for d in DOMAINS}
    distinct = greedy_distinct(model.float(), tok)
    model.half().save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    prov = provenance(command)
    card = {
        "params": n_params,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "val_loss": val,
        "val_perplexity": {d: math.exp(v) for d, v in val.items()},
        "greedy_distinct_token_fraction": distinct,
        "wall_time_s": wall,
        "config": asdict(cfg),
        "provenance": prov,
        "log": log,
    }
    atomic_write_text(out / "card.json", json.dumps(card, indent=2) + "\n")
    atomic_write_text(out / "MODEL_CARD.md", _card_md(out.name, card))
    keys = ("params", "tokens_seen", "val_perplexity", "greedy_distinct_token_fraction", "wall_time_s")
    print(json.dumps({k: card[k] for k in keys}, indent=2))
    return card


def _card_md(name: str, c: dict) -> str:
    cfg, p = c["config"], c["provenance"]
    ppl = ", ".join(f"{d} {v:.1f}" for d, v in c["val_perplexity"].items())
    vl = ", ".join(f"{d} {v:.3f}" for d, v in c["val_loss"].items())
    shape = (f"{cfg['n_layer']} layers, d={cfg['d_model']}, heads {cfg['n_head']}/{cfg['n_kv_head']} kv, "
             f"ffn {cfg['d_ff']}, vocab {cfg['vocab_size']}, tied embeddings")
    return f"""# {name}

A LlamaForCausalLM trained from scratch by `python -m dvi_lite train` on the course corpus (CPython stdlib code
+ Python docs prose, PSF licence; see data/corpus/manifest.json). Generated by the training run; do not edit.

| field | value |
|---|---|
| parameters | {c['params']:,} ({shape}) |
| tokens seen | {c['tokens_seen']:,} ({cfg['steps']} steps x {cfg['batch_size']} x {cfg['seq_len']}) |
| val loss per domain | {vl} |
| val perplexity per domain | {ppl} |
| greedy distinct-token fraction (40 held-out prompts x 64 tokens) | {c['greedy_distinct_token_fraction']:.3f} |
| wall time | {c['wall_time_s'] / 60:.1f} min |
| device | {p['device']} |
| command | `{p['command']}` |
| commit | {p['commit']} |
| date | {p['date']} |
| weights | fp16 safetensors (trained in fp32) |
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("train"), description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="course", help="model size and recipe")
    ap.add_argument("--steps", type=int, help="override the number of optimiser steps")
    ap.add_argument("--out", help="override the output folder")
    ap.add_argument("--resume", action="store_true", help="continue from build/ckpt/<name>.pt")
    add_force(ap)  # the presets write the committed course and draft models: retraining them needs --force
    args = ap.parse_args(argv)
    cfg = replace(PRESETS[args.preset])  # a copy: the presets stay as declared
    if args.steps is not None:
        if args.steps < 1:
            ap.error(f"--steps must be >= 1, got {args.steps}")
        cfg.steps = args.steps
    if args.out:
        cfg.out_dir = args.out
    check_outputs(ap, (cfg.out_dir, "dir", "--out"), force=args.force)
    train(cfg, resume=args.resume, command=command_line("train", argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
