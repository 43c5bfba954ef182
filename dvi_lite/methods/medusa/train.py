"""Train Medusa heads by distillation from the frozen model: `python -m dvi_lite medusa-train --heads 4`.

Recipe: windows of the corpus' train split; the frozen model gives the final pre-norm states h_t and
its own next-token distributions p_t at every position. Head i on h_t predicts x_{t+2+i} (heads.py's
convention), so it is trained towards p_{t+1+i}, the model's own prediction of that token. Loss:
KL(p_{t+1+i} || q_i) over all positions: dense soft targets teach the whole distribution, and the heads
learn to agree with *this* model, which is what verification rewards. (The course model was trained on
this corpus, so the corpus is its own distribution and Medusa-2's self-distillation on generated text
is not needed.) `--loss ce` trains on the model's argmax instead. Head i's loss is weighted 0.8^i
(Medusa-1's lambda).

AdamW, warm-up + cosine decay to a non-zero floor (Project Gorgon's scheduler reached zero, so a resumed
run learned nothing), gradient clipping, checkpoints every few minutes and `--resume`. The trained heads
are saved with their measured per-rank accuracies (the sparse tree is built from them) and a JSON card.

`sanity_check` is Gorgon's missing 100-step check: fresh heads trained briefly, head 0's top-1 accuracy
before and after beside the model's own next-token accuracy. With the frozen norm every untrained head
copies the model's own prediction exactly; without it (`--no-norm`) the logits start far too sharp and
training has to undo that first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, command_line, prog, require_positive, run_or_usage_error
from dvi_lite.core.runner import Runner
from dvi_lite.measure.provenance import provenance
from dvi_lite.methods.medusa.heads import HEADS_DIR, HEADS_PATH, MedusaHeads, heads_path, save_heads
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.models.loading import load_model
from dvi_lite.models.training import TrainConfig, batch, encode_split, lr_at
from dvi_lite.paths import ROOT
from dvi_lite.safety import check_output, load_torch

LOSSES = ("kl", "ce")
COMMAND = "medusa-train"  # python -m dvi_lite <COMMAND>


@dataclass
class MedusaTrainConfig:
    heads: int = 4  # number of heads H (Medusa-1 used 5 on Vicuna-7B; 4 here)
    steps: int = 400  # optimiser steps
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # window length
    lr: float = 1e-3  # peak learning rate (Medusa-1's)
    min_lr_frac: float = 0.1  # cosine floor: never decay to zero
    warmup: int = 20  # linear warm-up steps
    grad_clip: float = 1.0  # global norm clip
    head_decay: float = 0.8  # head i's loss weight is head_decay**i (Medusa-1's lambda_k = 0.8^k)
    loss: str = "kl"  # "kl": KL(p || q) on the model's shifted distribution; "ce": CE on its argmax
    norm: bool = True  # frozen copy of the final RMSNorm before each head (False: Gorgon's bug)
    shared_lm_head: bool = False  # reuse the model's frozen LM head instead of a trainable copy per head
    ckpt_every_s: float = 120.0  # seconds between checkpoints
    seed: int = 0  # data order
    eval_prefixes: int = 256  # prefixes for head_accuracy after training
    eval_ctx: int = 64  # their length (tokens of context before the pending token)


def check_config(cfg: MedusaTrainConfig) -> MedusaTrainConfig:
    if not isinstance(cfg.heads, int) or cfg.heads < 1:
        raise ValueError(f"heads must be an int >= 1, got {cfg.heads!r}")
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    if cfg.heads + 2 > cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} leaves no training position for {cfg.heads} heads")
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
    return cfg


@torch.no_grad()
def teacher(runner: Runner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen model on windows x (B, T): final pre-norm states (B, T, D) and log p (B, T, V) fp32."""
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    h = runner.layers_forward(runner.embed(x), None, pos)
    return h, runner.logits(h).float().log_softmax(-1)


def head_loss(heads: MedusaHeads, i: int, h: torch.Tensor, logp: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Head i on h_t vs the model at t+1+i (which predicts x_{t+2+i}), mean over all B * (T-1-i) positions."""
    s = i + 1
    logq = heads.head(i, h[:, :-s]).float().log_softmax(-1)  # (B, T-s, V): q_i at t = 0 .. T-1-s
    tgt = logp[:, s:]  # (B, T-s, V): p at t+s
    if kind == "ce":
        return torch.nn.functional.nll_loss(logq.flatten(0, 1), tgt.argmax(-1).flatten())
    return (tgt.exp() * (tgt - logq)).sum(-1).mean()


def head_weights(cfg: MedusaTrainConfig) -> list[float]:
    w = [cfg.head_decay ** i for i in range(cfg.heads)]
    return [x / sum(w) for x in w]


def train_step(heads: MedusaHeads, runner: Runner, x: torch.Tensor, cfg: MedusaTrainConfig) -> list[float]:
    """Forward + backward of one batch, one head at a time (keeps only one (B, T, V) graph alive)."""
    h, logp = teacher(runner, x)
    losses = []
    for i, w in enumerate(head_weights(cfg)):
        loss = head_loss(heads, i, h, logp, cfg.loss)
        (w * loss).backward()
        losses.append(loss.item())
    return losses


def _tcfg(cfg: MedusaTrainConfig) -> TrainConfig:
    return TrainConfig(seq_len=cfg.seq_len, batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr,
                       min_lr_frac=cfg.min_lr_frac, warmup=cfg.warmup)


def sample_batch(data: np.ndarray, tcfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """(B, T) windows: random windows of a token stream (1-D data), or whole random rows of a set of
    sequences (2-D data, e.g. the model's own generations, each starting at its true beginning)."""
    if data.ndim == 1:
        return batch(data, tcfg, gen)[0]
    rows = torch.randint(data.shape[0], (tcfg.batch_size,), generator=gen)
    return torch.from_numpy(data[rows.numpy()].astype(np.int64))


_SHAPE_KEYS = ("heads", "norm", "shared_lm_head", "loss", "batch_size", "seq_len", "lr", "seed")


def train_loop(heads: MedusaHeads, runner: Runner, data: np.ndarray, cfg: MedusaTrainConfig,
               ckpt: Path | None = None, resume: bool = False, stop_after: int | None = None,
               progress: bool = True) -> list[dict]:
    """AdamW on the heads' trainable parameters; returns the log [{step, loss, per_head, lr, time_s}].

    ckpt: where to checkpoint (every cfg.ckpt_every_s and at the end); resume: continue from it (the
    heads, optimiser, data order and log; the LR schedule picks up at the saved step). data: a token
    stream (1-D) or aligned sequences (2-D, see sample_batch); cfg.seq_len is ignored for 2-D. stop_after:
    leave after this many steps of this call (a time-boxed session: run again with resume=True).
    """
    check_config(cfg)
    if data.ndim == 2 and data.shape[1] < cfg.heads + 2:
        raise ValueError(f"sequences of {data.shape[1]} tokens leave no training position for {cfg.heads} heads")
    tcfg = _tcfg(cfg)
    return fit(heads, cfg, tcfg, lambda gen: train_step(heads, runner, sample_batch(data, tcfg, gen).to(runner.device),
                                                         cfg), ckpt, resume, stop_after, progress,
               f"medusa {cfg.heads} heads", _SHAPE_KEYS)


def fit(heads: MedusaHeads, cfg, tcfg: TrainConfig, step_fn: Callable[[torch.Generator], list[float]],
        ckpt: str | Path | None, resume: bool, stop_after: int | None, progress: bool, desc: str,
        keys: tuple[str, ...]) -> list[dict]:
    """THE training loop of both Medusa recipes: AdamW on the heads' trainable parameters, warm-up + cosine,
    clipping, atomic checkpoints every cfg.ckpt_every_s and at the end, resume; returns the log.

    step_fn(gen) draws a batch with `gen`, computes the per-head losses and their backward; returns them (a
    head with no target in the batch reports nan and is left out of the total)."""
    params = heads.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, log, elapsed = load_checkpoint(ckpt, heads, opt, gen, cfg, keys) if resume else (0, [], 0.0)
    heads.train()
    t0, last = time.time() - elapsed, time.time()
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    bar = tqdm(range(step, end), initial=step, total=cfg.steps, desc=desc, disable=not progress)
    for step in bar:
        lr = lr_at(step, tcfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        per_head = step_fn(gen)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        loss = sum(w * v for w, v in zip(head_weights(cfg), per_head, strict=True) if v == v)
        log.append({"step": step + 1, "loss": loss, "per_head": per_head, "lr": lr, "time_s": time.time() - t0})
        bar.set_postfix(loss=f"{loss:.3f}", head0=f"{per_head[0]:.3f}")
        if ckpt is not None and (time.time() - last > cfg.ckpt_every_s or step + 1 == end):
            save_checkpoint(ckpt, heads, opt, gen, step + 1, log, time.time() - t0, cfg)
            last = time.time()
    heads.eval()
    return log


def load_checkpoint(ckpt: str | Path | None, heads: MedusaHeads, opt: torch.optim.Optimizer, gen: torch.Generator,
                    cfg, keys: tuple[str, ...] = _SHAPE_KEYS) -> tuple[int, list[dict], float]:
    """Restore what save_checkpoint wrote (if the file exists): returns (step, log, elapsed s); (0, [], 0) if not.

    Refuses a checkpoint made with another recipe (the config's `keys` differ)."""
    if ckpt is None or not Path(ckpt).is_file():
        return 0, [], 0.0
    ck = load_torch(ckpt, "Medusa training checkpoint", keys=("config", "heads", "opt", "gen"))  # on the CPU
    made, want = {k: ck["config"].get(k) for k in keys}, {k: asdict(cfg)[k] for k in keys}
    if made != want:
        raise ValueError(f"checkpoint {ckpt} was made with {made}, not {want}; delete it or drop --resume")
    heads.load_state_dict(ck["heads"])
    opt.load_state_dict(ck["opt"])
    gen.set_state(ck["gen"])
    return ck["step"], ck["log"], ck["elapsed"]


def save_checkpoint(ckpt: str | Path, heads: MedusaHeads, opt: torch.optim.Optimizer, gen: torch.Generator,
                    step: int, log: list[dict], elapsed: float, cfg) -> None:
    """Heads, optimiser, data order and log after `step` steps, written atomically (a kill never leaves half a file)."""
    Path(ckpt).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(ckpt).with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "log": log, "elapsed": elapsed, "config": asdict(cfg)}, tmp)
    tmp.replace(ckpt)


class _BatchCache:
    """A minimal batched KV cache (HF's `update` protocol + per-layer `lens`, as runner expects)."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.lens = [0] * n_layers

    def update(self, k, v, layer_idx, *args, **kwargs):
        if self.k[layer_idx] is not None:
            k, v = torch.cat([self.k[layer_idx], k], 2), torch.cat([self.v[layer_idx], v], 2)
        self.k[layer_idx], self.v[layer_idx], self.lens[layer_idx] = k, v, k.shape[2]
        return k, v


@torch.no_grad()
def greedy_rollout(runner: Runner, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefixes x (B, C) -> (h at the last prefix position (B, D), the model's next n greedy tokens (B, n))."""
    cache = _BatchCache(runner.n_layers)
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    h = runner.layers_forward(runner.embed(x), cache, pos)
    h_t = h[:, -1]
    out = []
    for j in range(n):
        nxt = runner.logits(h[:, -1:]).argmax(-1)  # (B, 1)
        out.append(nxt)
        if j + 1 < n:
            p = torch.full_like(nxt, x.shape[1] + j)
            h = runner.layers_forward(runner.embed(nxt), cache, p)
    return h_t, torch.cat(out, 1)


@torch.no_grad()
def head_accuracy(model, tok, heads: MedusaHeads, n_windows: int = 256, ctx: int = 64, split: str = "val",
                  branch: int = 4, seed: int = 0, data: np.ndarray | None = None, chunk: int = 64) -> dict:
    """How often each head's candidates are what the model itself would emit, beside the model's accuracy.

    n_windows random prefixes of ctx tokens from the corpus split (or `data`, a token stream; tok is
    then unused and may be None). At each prefix's last position t: the model's greedy continuation g_0
    (its next token: the pending one), g_1, ..., g_H; head i's top-branch tokens for x_{t+2+i} are
    compared with g_{1+i}, the token greedy decoding accepts at tree depth i (given the heads were right
    before it). Returns
      model_next:     P(g_0 = the corpus token x_{t+1})   (the model's own next-token accuracy)
      heads_greedy:   [P(head i top-1 = g_{1+i})]           (what acceptance needs; compare head 0 to model_next)
      heads_corpus:   [P(head i top-1 = corpus x_{t+2+i})]
      heads_vs_next:  [P(head i top-1 = g_0)]                (1.0 for untrained heads with the frozen norm)
      rank_accuracy:  (H, branch) P(head i rank-r token = g_{1+i})  (the input of trees.sparse_tree)
      n:              prefixes used
    """
    runner = Runner.for_model(model)
    if data is None:
        data = encode_split(tok, split)
    H = heads.num_heads
    gen = torch.Generator().manual_seed(seed)
    if len(data) < ctx + H + 2:
        raise ValueError(f"the token stream ({len(data)}) is shorter than ctx + heads + 2 = {ctx + H + 2}")
    starts = torch.randint(len(data) - ctx - H - 1, (n_windows,), generator=gen).tolist()
    win = torch.from_numpy(np.stack([data[s: s + ctx + H + 1].astype(np.int64) for s in starts]))  # (n, ctx+H+1)
    was_training = heads.training
    heads.eval()
    model_next, greedy, corpus, vs_next = 0, torch.zeros(H), torch.zeros(H), torch.zeros(H)
    ranks = torch.zeros(H, branch)
    for c in range(0, n_windows, chunk):
        w = win[c: c + chunk].to(runner.device)
        h_t, g = greedy_rollout(runner, w[:, :ctx], H + 1)  # (b, D), (b, H+1)
        fut = w[:, ctx:]  # (b, H+1): corpus x_{t+1} .. x_{t+1+H}
        top = heads(h_t).topk(branch, -1).indices  # (H, b, branch)
        model_next += int((g[:, 0] == fut[:, 0]).sum())
        for i in range(H):
            hit = top[i] == g[:, 1 + i, None]  # (b, branch)
            ranks[i] += hit.sum(0).float().cpu()
            greedy[i] += float(hit[:, 0].sum())
            corpus[i] += float((top[i, :, 0] == fut[:, 1 + i]).sum())
            vs_next[i] += float((top[i, :, 0] == g[:, 0]).sum())
    heads.train(was_training)
    n = n_windows
    return {"model_next": model_next / n, "heads_greedy": (greedy / n).tolist(), "heads_corpus": (corpus / n).tolist(),
            "heads_vs_next": (vs_next / n).tolist(), "rank_accuracy": (ranks / n).tolist(), "n": n}


def sanity_check(model, tok, steps: int = 100, num_heads: int = 4, norm: bool = True, data: np.ndarray | None = None,
                 cfg: MedusaTrainConfig | None = None, **eval_kw) -> dict:
    """Gorgon's missing 100-step check: train fresh heads briefly; accuracies before and after.

    With the frozen norm, head 0 should approach the model's own next-token accuracy quickly
    (it predicts one token further, so it stays below); without it, it starts far lower.
    Returns {"before": head_accuracy, "after": head_accuracy, "log": training log, "heads": the heads}.
    """
    cfg = cfg or MedusaTrainConfig(heads=num_heads, steps=steps, norm=norm, warmup=min(20, max(1, steps // 5)))
    heads = MedusaHeads(model, cfg.heads, norm=cfg.norm, shared_lm_head=cfg.shared_lm_head)
    data_train = data if data is not None else encode_split(tok, "train")
    before = head_accuracy(model, tok, heads, data=data, **eval_kw)
    log = train_loop(heads, Runner.for_model(model), data_train, cfg)
    after = head_accuracy(model, tok, heads, data=data, **eval_kw)
    return {"before": before, "after": after, "log": log, "heads": heads}


def default_out(cfg: MedusaTrainConfig, model=None) -> Path:
    """data/medusa/heads.pt for the course recipe (frozen norm + the model's shared LM head: at course
    scale a trainable vocabulary projection per head is most of a head's parameters and of its drafting
    cost); variants get their own file (never overwrite it). Another model's heads go to
    build/models/<fingerprint>/medusa/."""
    d = HEADS_DIR if model is None else heads_path(model).parent
    if cfg.norm and cfg.shared_lm_head:
        return d / HEADS_PATH.name
    return d / ("heads" + ("" if cfg.norm else "_nonorm") + ("" if cfg.shared_lm_head else "_ownhead") + ".pt")


@torch.no_grad()
def val_losses(heads: MedusaHeads, runner: Runner, val: np.ndarray, cfg: MedusaTrainConfig,
               n_batches: int = 2) -> list[float]:
    """Per-head loss on fixed validation windows."""
    gen = torch.Generator().manual_seed(1)
    tot = [0.0] * cfg.heads
    for _ in range(n_batches):
        x, _ = batch(val, _tcfg(cfg), gen)
        h, logp = teacher(runner, x.to(runner.device))
        for i in range(cfg.heads):
            tot[i] += head_loss(heads, i, h, logp, cfg.loss).item() / n_batches
    return tot


def train_heads(cfg: MedusaTrainConfig, model_path: str | None = None, out: str | Path | None = None,
                resume: bool = False, command: str = "", force: bool = True) -> dict:
    """The CLI's job: load the model, train, evaluate, save heads + card. Returns the card. force=False: a committed
    heads file is kept (refused before training)."""
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    model, tok = load_model(model_path, dtype="float32")
    for p in model.parameters():
        p.requires_grad_(False)
    runner = Runner.for_model(model)
    heads = MedusaHeads(model, cfg.heads, norm=cfg.norm, shared_lm_head=cfg.shared_lm_head)
    data, val = encode_split(tok, "train"), encode_split(tok, "val")
    out = Path(out) if out is not None else default_out(cfg, model)
    check_output(out, kind="file", force=force)
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:8]  # one checkpoint per model and output file
    ckpt = ROOT / "build" / "ckpt" / f"medusa_{out.stem}_{fingerprint(model)}_{tag}.pt"
    log = train_loop(heads, runner, data, cfg, ckpt, resume)
    acc = head_accuracy(model, tok, heads, cfg.eval_prefixes, cfg.eval_ctx)
    heads.accuracies = acc["rank_accuracy"]
    card = {"num_heads": cfg.heads, "norm": cfg.norm, "shared_lm_head": cfg.shared_lm_head,
            "trainable_params": sum(p.numel() for p in heads.trainable_parameters()),
            "val_loss_per_head": val_losses(heads, runner, val, cfg), "loss": cfg.loss, "accuracy": acc,
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len, "wall_time_s": log[-1]["time_s"] if log else 0.0,
            "config": asdict(cfg), "provenance": provenance(command, runner.device),
            "log": log[:: max(1, len(log) // 50)]}
    save_heads(heads, model, out, card)
    print(json.dumps({k: card[k] for k in ("num_heads", "trainable_params", "val_loss_per_head", "tokens_seen")}
                     | {"model_next": acc["model_next"], "heads_greedy": acc["heads_greedy"], "out": str(out)}))
    return card


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog(COMMAND), description=__doc__.splitlines()[0])
    d = MedusaTrainConfig()
    ap.add_argument("--heads", type=int, default=d.heads, help="number of heads")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--loss", choices=LOSSES, default=d.loss, help="kl: soft targets (default); ce: the model's argmax")
    ap.add_argument("--no-norm", action="store_true", help="no frozen RMSNorm before the heads (the Gorgon bug)")
    ap.add_argument("--shared-lm-head", action="store_true", help="reuse the model's frozen LM head")
    ap.add_argument("--model", default=None, help="local HF checkpoint (default: the course model)")
    ap.add_argument("--out", default=None, help="heads file (default: artifacts_dir(model)/medusa/heads.pt, "
                    "variants beside it)")
    ap.add_argument("--resume", action="store_true")
    add_force(ap)
    args = ap.parse_args(argv)
    require_positive(ap, args, "steps", "heads")
    cfg = MedusaTrainConfig(heads=args.heads, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                            lr=args.lr, loss=args.loss, norm=not args.no_norm, shared_lm_head=args.shared_lm_head)
    run_or_usage_error(ap, train_heads, cfg, args.model, args.out, args.resume,
                       command_line(COMMAND, argv), args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
