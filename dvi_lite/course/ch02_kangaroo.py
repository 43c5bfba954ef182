"""Chapter 02 helpers (Kangaroo): what the notebook calls, so the notebook holds no algorithm.

- `exit_agreement`: how often the layer-k prediction already equals the final argmax, per k, with
  the target's own head (naive early exit) and with a trained adapter.
- `train_sweep_adapters`: short adapter trainings for an exit-layer sweep (the committed recipe,
  fewer steps), written to build/ so the committed adapter is never overwritten.
- `kangaroo_variants`: bench labels for the exit-layer, threshold, fixed-length and tree sweeps.
- `check_lossless`: greedy tokens of kangaroo (chain and tree) vs AR on held-out prompts.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dvi_lite.core.generate import generate
from dvi_lite.core.runner import Runner
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter, adapter_path, load_adapter
from dvi_lite.methods.kangaroo.train import AdapterConfig, train_adapter
from dvi_lite.models.training import TrainConfig, batch, encode_split
from dvi_lite.paths import BUILD_DIR
from dvi_lite.study.table import check_bench, require

SWEEP_DIR = BUILD_DIR / "kangaroo"


@torch.no_grad()
def exit_agreement(model, tok, adapters: dict[int, KangarooAdapter] | None = None, n_windows: int = 8,
                   seq_len: int = 256, seed: int = 1) -> list[dict]:
    """Per exit layer k: P(argmax of the layer-k draft == argmax of the full model) on val windows.

    naive = lm_head(norm(h_k)), the target's own head on an intermediate state; adapter = Kangaroo's
    lm_head(adapter(h_k)). Greedy acceptance of a one-token draft is exactly this agreement.
    """
    runner = Runner.for_model(model)
    cfg = TrainConfig(seq_len=seq_len, batch_size=n_windows)
    x, _ = batch(encode_split(tok, "val"), cfg, torch.Generator().manual_seed(seed))
    x = x.to(runner.device)  # (B, T)
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    h, states = runner.embed(x), []
    for k in range(runner.n_layers):
        h = runner.layers_forward(h, None, pos, k, k + 1)
        states.append(h)  # states[k-1] = after k layers
    final = runner.logits(states[-1]).argmax(-1)  # (B, T)
    rows = []
    for k in range(1, runner.n_layers):
        hk = states[k - 1]
        row = {"k": k, "layers_frac": k / runner.n_layers,
               "naive": float((runner.logits(hk).argmax(-1) == final).float().mean())}
        if adapters and k in adapters:
            a = adapters[k]
            q = runner.lm_head(a(hk, runner.rotary(hk, pos))).argmax(-1)
            row["adapter"] = float((q == final).float().mean())
        rows.append(row)
    return rows


def train_sweep_adapters(splits: list[int], steps: int, model_path: str | None = None,
                         out_dir: Path = SWEEP_DIR) -> dict[int, dict]:
    """Train one adapter per exit layer with the committed recipe but `steps` steps; returns cards."""
    cards = {}
    for k in splits:
        cfg = AdapterConfig(split=k, steps=steps, warmup=min(AdapterConfig.warmup, max(1, steps // 5)))
        cards[k] = train_adapter(cfg, model_path, adapter_path(k, out_dir), resume=False,
                                 command=f"dvi_lite.course.ch02_kangaroo.train_sweep_adapters(steps={steps})",
                                 ckpt_name=f"kangaroo_sweep_k{k}")
    return cards


def load_sweep_adapters(model, splits: list[int], out_dir: Path = SWEEP_DIR) -> dict[int, KangarooAdapter]:
    return {k: load_adapter(model, k, adapter_path(k, out_dir)) for k in splits}


def kangaroo_variants(splits: list[int], thresholds: list[float], fixed_lengths: list[int], branches: list[int],
                      sweep_dir: Path = SWEEP_DIR) -> dict[str, dict]:
    """Bench labels -> options. Exit-layer sweep uses the sweep adapters (all trained alike)."""
    v: dict[str, dict] = {}
    for k in splits:
        v[f"kangaroo:split={k}"] = {"split": k, "adapter": str(adapter_path(k, sweep_dir))}
    for eta in thresholds:
        v[f"kangaroo:threshold={eta}"] = {"threshold": eta}
    for n in fixed_lengths:
        v[fixed_label(n)] = {"threshold": None, "K": n}
    for b in branches:
        v[f"kangaroo:branch={b}"] = {"branch": b}
    return v


def check_lossless(model, tok, prompts: list[dict], max_new_tokens: int, variants: dict[str, dict]) -> dict:
    """Greedy tokens of each variant vs AR on every prompt: {label: {"equal": n, "of": N, "alpha": a}}."""
    ar = {p["id"]: generate(model, tok, p["prompt"], "ar", max_new_tokens).token_ids for p in prompts}
    out = {}
    for label, opts in variants.items():
        equal, acc, tested = 0, 0, 0
        for p in prompts:
            res = generate(model, tok, p["prompt"], "kangaroo", max_new_tokens, **opts)
            equal += res.token_ids == ar[p["id"]]
            acc += sum(s.accepted for s in res.stats.steps)
            tested += sum(s.accepted + (s.accepted < s.depth) for s in res.stats.steps)
        out[label] = {"equal": equal, "of": len(prompts), "alpha": acc / max(tested, 1)}
    return out


def fixed_label(n: int) -> str:
    """Bench label of a fixed-length draft (no threshold exit)."""
    return f"kangaroo:threshold=none:K={n}"


def check_invariants(lossless: dict, agreement: list[dict], sweep: dict, sweep_methods: list[str], main: dict,
                     main_methods: list[str]) -> list[str]:
    """Notebook 02's claims: greedy Kangaroo equals AR on every checked prompt, agreements are rates, and both
    benchmarks have every method with meaningful numbers."""
    for label, r in lossless.items():
        require(r["equal"] == r["of"], f"{label}: greedy tokens differ from AR on {r['of'] - r['equal']} prompts")
    for r in agreement:
        for key in ("naive", "adapter"):
            if key in r:
                require(0 <= r[key] <= 1, f"agreement at k={r['k']} ({key}) = {r[key]} is not a rate")
    return [f"lossless: {len(lossless)} variants equal greedy AR on every prompt",
            f"agreement: {len(agreement)} exit layers, every value in [0, 1]",
            check_bench(sweep, sweep_methods, "sweep"), check_bench(main, main_methods, "main comparison")]
