"""The study's GPU column: what a lent GPU measured (results/gpu/43_study_<device>.json, by scripts/gpu_study.sh).

No GPU number is typed anywhere: the study notebook and the README read this file, name its GPU, and say how
small the run was (questions, rounds, tokens), since a lease of 15 minutes fits only a pilot.

    load()         the newest GPU study file's body, or None (the column then says there is none)
    column(body, runtime)  {method: {speedup, interval, pooled, tau, c, tokens_per_s}} on the HF or lean runtime
    format_table   the columns as text, with the run's size, the GPU's name and the fp32 checks
    format_kernel  chapter 04's view: the Triton tree kernel against sdpa, Medusa through each
    format_dvi     chapter 05's view: the online run, DVI beside Kangaroo, the law test on CUDA
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


def _num(x: float | None, p: int = 2) -> str:
    """A number to p decimals, or – where there is none."""
    return "–" if x is None else f"{x:.{p}f}"


RUNTIME_BENCH = {"hf": "study_hf", "lean": "study_lean"}  # the runtime -> the bench that measured it


def _bench(body: dict, runtime: str = "hf") -> dict:
    """The run's bench on `runtime`: its named one if it has it, else (for "hf": a run from before the runtimes
    were split) the largest bench that came back."""
    benches = {k: v for k, v in body.get("bench", {}).items() if k != "dvi_bench"}
    if RUNTIME_BENCH.get(runtime) in benches:
        return benches[RUNTIME_BENCH[runtime]]
    if runtime != "hf" or not benches:
        return {}
    return max(benches.values(), key=lambda b: len(b["methods"]))


def column(body: dict | None, runtime: str = "hf") -> dict[str, dict]:
    """Per method on `runtime`: × its own AR on the GPU (decode phase, median of per-question ratios), its
    interval, the pooled ratio, τ, c, tok/s."""
    if not body:
        return {}
    return {m: {"speedup": r.get("speedup_vs_ar"), "interval": r.get("speedup_interval"),
                "pooled": r.get("speedup_pooled"), "tau": r.get("tau"), "c": r.get("c"),
                "tokens_per_s": r.get("decode_tokens_per_s")}
            for m, r in _bench(body, runtime).get("methods", {}).items()}


def size(body: dict, runtime: str = "hf") -> str:
    """How big the GPU run was, in words (a bench its cap cut says how many questions it finished)."""
    s = _bench(body, runtime).get("settings", {})
    part = s.get("partial")
    n = f"{part['prompts_done']} of {part['of']}" if part else f"{s.get('n_prompts_used')}"
    return (f"{n} held-out questions × {s.get('repeats')} round × {s.get('max_new_tokens')} tokens, SmolLM2 in "
            f"{s.get('dtype')} on one {body['device']['gpu']}, {s.get('runtime') or 'hf'} runtime")


def format_table(body: dict | None) -> str:
    """The GPU columns as text (a notebook prints them under the CPU table): each runtime the run measured."""
    if not body:
        return "No GPU run is recorded (results/gpu/ has no study file)."
    lines = []
    for rt in ("hf", "lean"):
        col = column(body, rt)
        if not col:
            continue
        w = max(12, *(len(m) + 2 for m in col))
        lines += ["" if lines else None, f"GPU, {size(body, rt)}",
                  f"{'method':<{w}}{'× AR':>7}{'90% interval':>16}{'pooled':>8}{'τ':>6}{'c':>7}{'tok/s':>8}"]
        for m, r in col.items():
            ci = r["interval"]
            ci_text = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "–"
            lines.append(f"{m:<{w}}{_num(r['speedup']):>7}{ci_text:>16}{_num(r['pooled']):>8}{_num(r['tau']):>6}"
                         f"{_num(r['c'], 3):>7}{_num(r['tokens_per_s'], 1):>8}")
    lossless = body.get("lossless")
    if lossless:
        lines += ["", lossless_line(lossless)]
    return "\n".join(x for x in lines if x is not None)


def lossless_line(res: dict) -> str:
    """The GPU's fp32 checks in one sentence: greedy equality per method, and the law test."""
    rows = res.get("greedy_fp32", {})
    same = sum(all(r.get("equal") for r in v) for v in rows.values())
    law = res.get("law", {})
    text = (f"fp32 on the GPU: {same} of {len(rows)} methods gave AR's greedy tokens on all "
            f"{len(res.get('questions', []))} questions ({res.get('tokens')} tokens each).")
    if "depth1_pvalue" in law:
        d2 = law.get("depth2_pvalue")
        text += (f" DVI sampled at T = 1, {law['samples']} draws: law test p = {law['depth1_pvalue']:.2f} at depth 1"
                 + (f", {d2:.2f} at depth 2" if d2 is not None else "") + f"; the wrong-law control p = "
                 f"{law['control_pvalue']:.1e} (power {law['power_vs_control_at_0.01']:.2f} at 0.01).")
    return text


def online_line(body: dict) -> str:
    """The GPU online run in one line: prompts served, tokens, fast updates, time against its budget."""
    on = body["dvi_online"]
    return (f"online on the GPU{_when(body, 'dvi_online')}: {on['stream']['prompts_served']} prompts served, "
            f"{on['tokens_generated']} tokens, {on['fast_steps'] - on['start_fast_step']} fast updates in "
            f"{on['train_wall_s']:.0f} s (a budget of {on['budget_s']:.0f} s)")


def _when(body: dict, section: str) -> str:
    """' (the run of DATE)' when `section` came from an earlier lease than the file's own run, else ''."""
    date = str(body.get(section, {}).get("provenance", {}).get("date", ""))[:10]
    return f" (the run of {date})" if date and date != body["device"]["started"][:10] else ""


def render(body: dict | None) -> list[str]:
    """The README's GPU section: the pilot's column, the tree kernel on real trees, the online run, what did not
    fit."""
    if not body:
        return []
    prov = body["provenance"]
    out = [f"**GPU** · {body['device']['gpu']} · torch {body['device']['torch']} · commit "
           f"`{str(prov.get('commit', '?'))[:10]}` · {body['device']['started']}\n"]
    for rt in ("hf", "lean"):
        col = column(body, rt)
        if not col:
            continue
        out += [f"{size(body, rt)}:\n", "| method | decode tok/s | × AR (90% CI) | pooled | τ | c |",
                "|---|---:|---:|---:|---:|---:|"]
        for m, r in col.items():
            ci = r["interval"]
            out.append(f"| {m} | {_num(r['tokens_per_s'], 1)} | {_num(r['speedup'])}"
                       f"{f' [{ci[0]:.2f}, {ci[1]:.2f}]' if ci and m != 'ar' else ''} | {_num(r['pooled'])} | "
                       f"{_num(r['tau'])} | {_num(r['c'], 3)} |")
        out.append("")
    if body.get("lossless"):
        out += [lossless_line(body["lossless"]), ""]
    rows = body.get("tree_real", {}).get("rows", [])
    if rows:
        head = "Tree verify on SmolLM2's own context (512 positions), sdpa vs the Triton tree kernel"
        out += ["", f"{head}{_when(body, 'tree_real')}:", "",
                "| dtype | nodes | max logit diff | argmax agrees | sdpa ms | Triton ms |",
                "|---|---:|---:|---|---:|---:|"]
        out += [f"| {r['dtype']} | {r['nodes']} | {r['max_abs_logit_diff']:.2g} | "
                f"{'yes' if r['argmax_agree'] else 'no'} | {_num(r['sdpa_ms'], 1)} | {_num(r['triton_ms'], 1)} |"
                for r in rows]
    if body.get("dvi_online"):
        out += ["", f"DVI {online_line(body)}, from the committed head."]
    if body.get("not_fitted"):
        out += ["", f"Did not fit in the lease: {body['not_fitted']}"]
    return out + [""]


def _rows(body: dict, labels: tuple[str, ...]) -> list[str]:
    """Each label's line from each runtime's bench: × its AR [interval], τ, c, decode tok/s."""
    out = []
    for rt in ("hf", "lean"):
        col = column(body, rt)
        for m in labels:
            if m in col:
                r, ci = col[m], col[m]["interval"]
                out.append(f"  {rt:<5}{m:<26}{_num(r['speedup']):>6}×  [{_num(ci[0]) if ci else '–'}, "
                           f"{_num(ci[1]) if ci else '–'}]  τ {_num(r['tau'])}  c {_num(r['c'], 3)}  "
                           f"{_num(r['tokens_per_s'], 1)} tok/s")
    return out


def format_kernel(body: dict | None) -> str:
    """Chapter 04's GPU view: the Triton tree kernel against sdpa on SmolLM2's real trees (logits, time per tree
    size), Medusa through each in the GPU bench, and the kernel's fp32 greedy tokens against AR's."""
    if not body or not body.get("tree_real"):
        return "No GPU run of the tree kernel is recorded (results/gpu/ has none)."
    lines = [f"The tree kernel compiled on one {body['device']['gpu']}, one verify forward over "
             f"{body['tree_real']['rows'][0]['context']} positions of context:",
             f"  {'dtype':<10}{'nodes':>6}{'max |Δ logit|':>15}{'argmax agrees':>15}{'sdpa ms':>9}{'Triton ms':>11}"]
    for r in body["tree_real"]["rows"]:
        lines.append(f"  {r['dtype']:<10}{r['nodes']:>6}{r['max_abs_logit_diff']:>15.2g}"
                     f"{'yes' if r['argmax_agree'] else 'no':>15}{r['sdpa_ms']:>9.1f}{r['triton_ms']:>11.1f}")
    lines += ["", f"Medusa in the GPU bench ({size(body)}):", *_rows(body, ("medusa", "medusa:attention=triton"))]
    eq = body.get("lossless", {}).get("greedy_fp32", {}).get("medusa_triton")
    if eq:
        same = sum(bool(r.get("equal")) for r in eq)
        lines.append(f"fp32: Medusa through the kernel gave AR's greedy tokens on {same} of {len(eq)} questions")
    return "\n".join(lines)


def format_dvi(body: dict | None) -> str:
    """Chapter 05's GPU view: the online run on the GPU, DVI beside Kangaroo in each runtime's bench, and the law
    test of DVI's sampled tokens on CUDA."""
    if not body:
        return "No GPU run is recorded (results/gpu/ has no study file)."
    lines = []
    if body.get("dvi_online"):
        lines.append(online_line(body))
    lines += ["", f"DVI beside Kangaroo in the GPU bench ({size(body)}):", *_rows(body, ("dvi", "kangaroo"))]
    if body.get("lossless"):
        lines += ["", lossless_line(body["lossless"])]
    return "\n".join(lines)
