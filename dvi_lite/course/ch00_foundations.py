"""Chapter 00: why token-by-token decoding is slow, in two regimes, and the course model itself.

The whole of speculative decoding rests on one measurement: v(n), the cost of a forward over n new
tokens in units of a 1-token forward (`measure.cost.verify_cost`). Two regimes decide it at batch 1:
- memory bound (a real model in bf16, or any model on a GPU): every forward streams all the weights
  from memory once, whatever n, so v(n) stays close to 1 for small n and verification is nearly free;
- overhead / compute bound (the small fp32 course model on a CPU): per-operator framework cost and the
  arithmetic itself dominate, v(n) grows with n, and the same acceptance buys much less speedup.
The roofline places decoding between them: bytes one AR token moves (weights + the KV cache it reads)
divided by the time per token, against the machine's measured memory bandwidth (`measure.cost`).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.kvcache import kv_bytes, kv_shape
from dvi_lite.course.ch01_speculative_sampling import expected_tokens
from dvi_lite.course.modes import current_mode
from dvi_lite.measure.cost import predicted_speedup, v_of, weight_bytes
from dvi_lite.models.loading import COURSE_MODEL
from dvi_lite.study.table import check_bench, finite, require

VERIFY_NS_MAX = 9  # n = K + 1 for the draft lengths the invariant compares (K <= 8)


def model_card(path: str | Path | None = None) -> dict:
    """The training card (card.json) of the course model, or {} for a checkpoint without one."""
    f = Path(path if path not in (None, "course") else COURSE_MODEL) / "card.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def param_count(model) -> dict:
    emb = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embedding": emb, "non_embedding": total - emb,
            "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size}


def decode_context(tok, prompts: list[dict], max_new_tokens: int) -> int:
    """Mean cached positions while decoding the prompts: mean prompt length (chat template applied) + half the
    new tokens. The KV cache one AR token reads has this many positions on average."""
    lens = [len(prompt_ids(tok, r["prompt"])) for r in prompts]
    return round(statistics.mean(lens)) + max_new_tokens // 2 if lens else max_new_tokens // 2


def decode_roofline(model, tokens_per_s: float, context: int, bandwidth: dict) -> dict:
    """Where AR decoding sits against the memory roof, from a measured AR speed.

    Per token a forward reads every weight once (`cost.weight_bytes`) and the K/V of `context` cached positions
    in every layer, and does about 2 FLOPs per weight it reads plus the attention over the cache (QK^T and AV,
    4 * layers * heads * head_dim * context). achieved_GBps = bytes per token * tokens per s; `bandwidth` is
    `cost.memory_bandwidth(...)`; of_copy / of_read are the fractions of its copy and read figures reached.
    """
    finite(tokens_per_s, "AR tokens/s", 0, strict=True)
    cfg = model.config
    p = next(model.parameters())
    w = weight_bytes(model)
    kv = kv_bytes(cfg, context, p.element_size())
    _, head_dim = kv_shape(cfg)
    flops = 2 * w / p.element_size() + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    achieved = (w + kv) * tokens_per_s / 1e9
    return {"dtype": str(p.dtype).removeprefix("torch."), "weight_bytes": w, "kv_bytes": kv, "context": context,
            "bytes_per_token": w + kv, "flops_per_token": flops, "intensity_flops_per_byte": flops / (w + kv),
            "tokens_per_s": tokens_per_s, "ms_per_token": 1e3 / tokens_per_s, "achieved_GBps": achieved,
            "achieved_GFLOPs": flops * tokens_per_s / 1e9, "of_copy": achieved / bandwidth["copy_GBps"],
            "of_read": achieved / bandwidth["read_GBps"]}


def regime_table(vs: dict[str, dict], alpha: float, c: float, ks: list[int]) -> list[dict]:
    """What each model's measured v(n) does to the same drafter: for every model and K, v(K + 1), the tau of a
    drafter with acceptance `alpha` (i.i.d., `expected_tokens`), and the speedup tau / (v(K + 1) + K c)
    (`cost.predicted_speedup`); `free` is the speedup if verification cost nothing extra (v = 1), the bound
    a memory-bound model approaches."""
    finite(alpha, "alpha", 0)
    require(alpha <= 1, f"alpha = {alpha} > 1")
    finite(c, "c (draft cost per token)", 0)
    rows = []
    for name, v in vs.items():
        for k in ks:
            tau = expected_tokens(alpha, k)
            rows.append({"model": name, "K": k, "v": v_of(v, k + 1), "tau": tau,
                         "predicted_speedup": predicted_speedup(tau, k, c, v),
                         "free": predicted_speedup(tau, k, c, lambda n: 1.0)})
    return rows


def check_invariants(vs: dict[str, dict], roofline: dict[str, dict], bandwidth: dict, ar_equal: int,
                     n_prompts: int, benches: dict[str, dict], exact: bool, memory_bound: str | None = None,
                     compute_bound: str | None = None, mode: str | None = None) -> list[str]:
    """Notebook 00's claims: every v(n) table starts at v(1) = 1 with positive entries, the bandwidth and every
    roofline figure are positive, AR equals HF generate on every prompt (when `exact`: an fp32 model), both
    baselines were benched on every model ({name: bench result}), and (given the two names) the two tables
    share verification sizes n in 2..9 (K = 1..8).

    The one timing claim, that the memory-bound model's mean v(n) over those n is below the compute-bound
    one's (its verification is the cheaper one), is asserted in full mode only (`mode`, default: the mode the
    notebook checked, `modes.current_mode`): it compares two measured timings, and in smoke mode (CI, with
    pytest-xdist workers loading the same cores) and learner mode it is printed, never asserted. A mean over
    several n, so that one noisy timing of a full run does not decide it."""
    for name, v in vs.items():
        v = {int(n): x for n, x in v.items()}
        require(v.get(1) == 1.0, f"{name}: v(1) = {v.get(1)} (must be exactly 1)")
        for n, x in v.items():
            finite(x, f"{name}: v({n})", 0, strict=True)
    out = [f"v(n): {len(vs)} tables, v(1) = 1, every v(n) > 0"]
    for key in ("copy_GBps", "read_GBps"):
        finite(bandwidth[key], f"measured bandwidth {key}", 0, strict=True)
    for name, r in roofline.items():
        for key in ("bytes_per_token", "tokens_per_s", "achieved_GBps", "intensity_flops_per_byte"):
            finite(r[key], f"{name}: roofline {key}", 0, strict=True)
    out.append(f"roofline: bandwidth and {len(roofline)} models' bytes/token, tokens/s and GB/s all > 0")
    if memory_bound and compute_bound:
        vm, vc = ({int(n): x for n, x in vs[m].items()} for m in (memory_bound, compute_bound))
        ns = sorted(n for n in set(vm) & set(vc) if 2 <= n <= VERIFY_NS_MAX)
        require(bool(ns), f"no shared n in 2..{VERIFY_NS_MAX} to compare {memory_bound} and {compute_bound}")
        mm, mc = (statistics.mean(v[n] for n in ns) for v in (vm, vc))
        if (current_mode() if mode is None else mode) == "full":  # a timing claim: full mode only
            require(mm < mc,
                    f"mean v(n) over n = {ns}: {memory_bound} ({mm:.2f}) is not below {compute_bound} ({mc:.2f})")
            out.append(f"mean v(n), n = {ns}: {memory_bound} {mm:.2f} < {compute_bound} {mc:.2f}")
        else:
            out.append(f"mean v(n), n = {ns}: {memory_bound} {mm:.2f}, {compute_bound} {mc:.2f} (a timing: "
                       "compared in full mode only)")
    require(0 <= ar_equal <= n_prompts, f"AR == HF count {ar_equal} out of range 0..{n_prompts}")
    if exact:
        require(ar_equal == n_prompts, f"fp32 AR differs from HF generate on {n_prompts - ar_equal} prompts")
        out.append(f"AR == HF generate on all {n_prompts} prompts (fp32)")
    return out + [check_bench(res, ["ar", "hf"], name) for name, res in benches.items()]


RUNTIME_NAMES = {"ar": "hf", "ar@lean": "lean", "ar@int8": "int8", "ar@int4": "int4"}  # study.runtimes.LABELS


def runtime_split(res: dict) -> list[dict]:
    """Per runtime (study.runtimes.measure's result): ms per AR token, split into the time its weights take to
    stream at the measured read bandwidth and everything else; and the fitted t(n) = a + b n in ms."""
    rows = []
    for label, rt in RUNTIME_NAMES.items():
        r, fit = res["ar"][label], res["forward"][rt]["fit"]
        ms = 1e3 / r["decode_tokens_per_s"]
        stream = 1e3 * r["weight_bytes"] / (res["machine"]["read_GBps"] * 1e9)
        rows.append({"runtime": rt, "ms_per_token": ms, "stream_ms": stream, "other_ms": ms - stream,
                     "a_ms": 1e3 * fit["a_s"], "b_ms": 1e3 * fit["b_s"],
                     "speedup": r.get("speedup_vs_ar") or 1.0, "interval": r.get("speedup_interval")})
    return rows


def runtime_figure(res: dict):
    """Left: each runtime's AR token, weights streamed vs everything else (ms). Right: t(n) measured, and its fit."""
    from plotly.subplots import make_subplots

    from dvi_lite.course.plots import series_color

    rows = runtime_split(res)
    fig = make_subplots(1, 2, subplot_titles=("one AR token: weights streamed vs everything else",
                                              "a forward over n new tokens: t(n) and its fit a + b·n"))
    names = [r["runtime"] for r in rows]
    fig.add_bar(x=names, y=[r["stream_ms"] for r in rows], name="weights streamed (at the read bandwidth)",
                row=1, col=1)
    fig.add_bar(x=names, y=[r["other_ms"] for r in rows], name="everything else (ops, attention, norms)",
                row=1, col=1)
    fig.update_layout(barmode="stack")
    for i, r in enumerate(rows):
        t = res["forward"][r["runtime"]]["t_s"]
        t = {int(n): x for n, x in t.items()}  # int keys, or str keys read back from JSON
        ns, color = sorted(t), series_color(i + 2)
        fig.add_scatter(x=ns, y=[1e3 * t[n] for n in ns], mode="markers",
                        name=f"{r['runtime']}: measured", marker_color=color, row=1, col=2)
        fig.add_scatter(x=ns, y=[r["a_ms"] + r["b_ms"] * n for n in ns], mode="lines", line_dash="dot",
                        name=f"{r['runtime']}: {r['a_ms']:.1f} + {r['b_ms']:.2f}·n ms", marker_color=color,
                        row=1, col=2)
    fig.update_yaxes(title_text="ms per token", row=1, col=1)
    fig.update_yaxes(title_text="ms per forward", rangemode="tozero", row=1, col=2)
    fig.update_xaxes(title_text="runtime", row=1, col=1)
    fig.update_xaxes(title_text="n (new tokens in one forward)", row=1, col=2)
    fig.update_layout(title="SmolLM2 · bf16: where a decoded token's time goes on each runtime")
    return fig
