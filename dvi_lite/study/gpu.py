"""The study's GPU column: what a lent GPU measured (results/gpu/43_study_<device>.json, by scripts/gpu_study.sh).

No GPU number is typed anywhere: the study notebook and the README read this file, name its GPU, and say how
small the run was (questions, rounds, tokens), since a lease of 15 minutes fits only a pilot.

    load()         the newest GPU study file's body, or None (the column then says there is none)
    column(body)   {method: {speedup, interval, tau, c, tokens_per_s}} from its bench
    format_table   the column as text, with the run's size and the GPU's name
    render(body)   the README's GPU section (markdown)
"""
from __future__ import annotations

import json
from pathlib import Path

from dvi_lite.measure.provenance import RESULTS_DIR

GPU_DIR = RESULTS_DIR / "gpu"
PATTERN = "43_study_*.json"


def load(folder: Path = GPU_DIR) -> dict | None:
    """The GPU study's body (the newest file by its start date), or None when no GPU run is recorded."""
    files = sorted(folder.glob(PATTERN))
    bodies = [json.loads(f.read_text()) for f in files]
    return max(bodies, key=lambda b: b["device"]["started"]) if bodies else None


def _bench(body: dict) -> dict:
    """The study bench of the run (the largest one that came back)."""
    benches = {k: v for k, v in body.get("bench", {}).items() if k != "dvi_bench"}
    if not benches:
        return {}
    return max(benches.values(), key=lambda b: len(b["methods"]))


def column(body: dict | None) -> dict[str, dict]:
    """Per method: × AR on the GPU (decode phase, median of per-question ratios), its interval, τ, c, tok/s."""
    if not body:
        return {}
    return {m: {"speedup": r.get("speedup_vs_ar"), "interval": r.get("speedup_interval"), "tau": r.get("tau"),
                "c": r.get("c"), "tokens_per_s": r.get("decode_tokens_per_s")}
            for m, r in _bench(body).get("methods", {}).items()}


def size(body: dict) -> str:
    """How big the GPU run was, in words."""
    s = _bench(body).get("settings", {})
    return (f"{s.get('n_prompts_used')} held-out questions × {s.get('repeats')} round × {s.get('max_new_tokens')} "
            f"tokens, SmolLM2 in {s.get('dtype')} on one {body['device']['gpu']}")


def format_table(body: dict | None) -> str:
    """The GPU column as text (a notebook prints it under the CPU table)."""
    if not body:
        return "No GPU run is recorded (results/gpu/ has no study file)."
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [f"GPU pilot: {size(body)}", f"{'method':<12}{'× AR':>7}{'90% interval':>16}{'τ':>6}{'c':>7}{'tok/s':>8}"]
    for m, r in column(body).items():
        ci = r["interval"]
        lines.append(f"{m:<12}{f(r['speedup']):>7}{(f'[{ci[0]:.2f}, {ci[1]:.2f}]' if ci else '–'):>16}"
                     f"{f(r['tau']):>6}{f(r['c'], 3):>7}{f(r['tokens_per_s'], 1):>8}")
    return "\n".join(lines)


def render(body: dict | None) -> list[str]:
    """The README's GPU section: the pilot's column, the tree kernel on real trees, the online run, what did not
    fit."""
    if not body:
        return []
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    prov = body["provenance"]
    out = [f"**GPU pilot** · {body['device']['gpu']} · torch {body['device']['torch']} · commit "
           f"`{str(prov.get('commit', '?'))[:10]}` · {body['device']['started']} · {size(body)}\n",
           "| method | decode tok/s | × AR (90% CI) | τ | c |", "|---|---:|---:|---:|---:|"]
    for m, r in column(body).items():
        ci = r["interval"]
        out.append(f"| {m} | {f(r['tokens_per_s'], 1)} | {f(r['speedup'])}"
                   f"{f' [{ci[0]:.2f}, {ci[1]:.2f}]' if ci and m != 'ar' else ''} | {f(r['tau'])} | {f(r['c'], 3)} |")
    rows = body.get("tree_real", {}).get("rows", [])
    if rows:
        out += ["", "Tree verify on SmolLM2's own context (512 positions), sdpa vs the Triton tree kernel:", "",
                "| dtype | nodes | max logit diff | argmax agrees | sdpa ms | Triton ms |",
                "|---|---:|---:|---|---:|---:|"]
        out += [f"| {r['dtype']} | {r['nodes']} | {r['max_abs_logit_diff']:.2g} | "
                f"{'yes' if r['argmax_agree'] else 'no'} | {f(r['sdpa_ms'], 1)} | {f(r['triton_ms'], 1)} |"
                for r in rows]
    on = body.get("dvi_online")
    if on:
        st = on["stream"]
        out += ["", f"DVI online on the GPU: {st['prompts_served']} prompts served ({on['tokens_generated']} tokens, "
                f"{on['fast_steps'] - on['start_fast_step']} fast updates) in {on['train_wall_s']:.0f} s, from the "
                "committed head."]
    if body.get("not_fitted"):
        out += ["", f"Did not fit in the lease: {body['not_fitted']}"]
    return out + [""]
