"""Chapter 00: why token-by-token decoding is memory/overhead bound, and the course model itself.

The whole of speculative decoding rests on one measurement: a forward pass over n new tokens costs
far less than n forward passes over one token, because at batch 1 the time goes into reading the
weights (GPU) or into per-op framework overhead (small models on a CPU), not into arithmetic.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from dvi_lite.core.runner import Runner
from dvi_lite.models.loading import COURSE_MODEL
from dvi_lite.study.table import check_bench, finite, require


@torch.no_grad()
def forward_cost(model, n_new: list[int] = (1, 2, 4, 8, 16), context: int = 128, repeats: int = 20,
                 warmup: int = 3, seed: int = 0) -> list[dict]:
    """Median wall time of one forward over n new tokens after `context` cached ones.

    The cache is rolled back after each call, so every measurement sees the same context length.
    """
    if context < 1 or repeats < 1 or not n_new:
        raise ValueError("context and repeats must be >= 1 and n_new non-empty")
    runner = Runner(model)
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    cache = runner.new_cache(context + max(n_new) + 1)
    runner.forward(torch.randint(vocab, (1, context), generator=g).to(runner.device), cache)
    rows = []
    for n in n_new:
        ids = torch.randint(vocab, (1, n), generator=g).to(runner.device)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            runner.forward(ids, cache)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            cache.crop(context)
        rows.append({"n_new": n, "ms": 1e3 * statistics.median(times)})
    base = rows[0]["ms"]
    for r in rows:
        r["ratio_vs_first"] = r["ms"] / base
        r["ms_per_token"] = r["ms"] / r["n_new"]
    return rows


def model_card(path: str | Path | None = None) -> dict:
    """The training card (card.json) of the course model, or {} for a checkpoint without one."""
    f = Path(path or COURSE_MODEL) / "card.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def param_count(model) -> dict:
    emb = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embedding": emb, "non_embedding": total - emb,
            "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size}


def check_invariants(cost: list[dict], ar_equal: int, n_prompts: int, res: dict, exact: bool) -> list[str]:
    """Notebook 00's claims: forward costs are positive, AR equals HF generate on every prompt (when `exact`:
    an fp32 model), and both baselines were benched."""
    for r in cost:
        finite(r["ms"], f"forward over {r['n_new']} tokens (ms)", 0, strict=True)
    out = [f"forward cost: {len(cost)} positive timings"]
    require(0 <= ar_equal <= n_prompts, f"AR == HF count {ar_equal} out of range 0..{n_prompts}")
    if exact:
        require(ar_equal == n_prompts, f"fp32 AR differs from HF generate on {n_prompts - ar_equal} prompts")
        out.append(f"AR == HF generate on all {n_prompts} prompts (fp32)")
    return out + [check_bench(res, ["ar", "hf"])]
