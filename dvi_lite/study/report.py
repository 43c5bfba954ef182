"""The README's results section, generated from results/*.json (never hand-edited).

`python -m dvi_lite report` rewrites the block between the two markers in README.md; a test checks
that the committed README equals what this module renders from the committed JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dvi_lite.commands import prog
from dvi_lite.measure.provenance import RESULTS_DIR
from dvi_lite.paths import ROOT, atomic_write_text

START, END = "<!-- results:start -->", "<!-- results:end -->"
README = ROOT / "README.md"


def _f(x, p: int = 2) -> str:
    return "–" if x is None else f"{x:.{p}f}"


def _range(xs: list[float] | None) -> str:
    """min–max over the timed rounds: how much of a difference between two rows is noise."""
    return "–" if not xs else f"{min(xs):.1f}–{max(xs):.1f}"


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def _held_mb(m: dict | None) -> float | None:
    return None if not m else _mb(m["target_bytes"] + m["extra_bytes"] + m["kv_bytes"])


def _x(r: dict, key: str = "speedup_vs_ar") -> str:
    """A speedup with its paired 90% interval where the bench gave one: "1.23 [1.10–1.35]"."""
    iv = r.get("speedup_interval" if key == "speedup_vs_ar" else "speedup_interval_e2e")
    if r.get(key) is None or not iv or None in iv:
        return _f(r.get(key))
    return f"{r[key]:.2f} [{iv[0]:.2f}–{iv[1]:.2f}]"


def render_study(body: dict) -> list[str]:
    """The study's table (notebook 08): every method, greedy and sampling, x AR per task group, the papers
    beside ours, SpS's best K and the course model's contrast."""
    study, mem = body["study"], body.get("memory", {})
    # held = weights + extra parameters + KV cache (an accounting, comparable on CPU); peak = measured (CUDA)
    peak = int(any(r.get("peak_mem_bytes") is not None for r in study["greedy"].values()))
    names = [n for n in study if n != "greedy"]
    prov = body.get("provenance", {})
    s = body.get("settings", {})
    g = study["greedy"]
    pairs = any(r.get("speedup_interval") for r in g.values())  # a run of the paired bench (older runs: round medians)
    groups = list(g.get("ar", {}).get("groups" if pairs else "domains", {}))
    how = "paired per prompt and interleaved" if pairs else "median of interleaved rounds (end to end)"
    cols = ["method", "decode tok/s" if pairs else "tok/s", "rounds",
            "× AR greedy (90% CI)" if pairs else "× AR greedy",
            *(["× AR end to end"] if pairs else []), *(f"× AR {n}" for n in names), "τ", "α", "c", "predicted",
            "meas/pred", "distinct", "extra params", "held MB", *(["peak MB"] if peak else [])]
    out = [f"**The study (08_results)** · {body.get('model', 'course model')} · {prov.get('device', '?')} · commit "
           f"`{str(prov.get('commit', '?'))[:10]}` · {prov.get('date', '?')} · {s.get('n_prompts', '?')} held-out "
           f"prompts × {s.get('max_new_tokens', '?')} tokens, {how}\n",
           "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    rate = "decode_tokens_per_s" if pairs else "tokens_per_s"
    for m, r in g.items():
        cells = [m, _f(r.get(rate), 1), _range(r.get(rate + "_rounds")), _x(r),
                 *([_x(r, "speedup_vs_ar_e2e")] if pairs else []), *(_x(study[n].get(m, {})) for n in names),
                 _f(r.get("tau")), _f(r.get("alpha")), _f(r.get("c")), _f(r.get("predicted_speedup")),
                 _f(r.get("measured_over_predicted")), _f(r.get("distinct_token_fraction")),
                 f"{mem.get(m, {}).get('extra_params', 0):,}", _f(_held_mb(mem.get(m)), 1),
                 *([_f(_mb(r.get("peak_mem_bytes")), 1)] if peak else [])]
        out.append("| " + " | ".join(cells) + " |")
    speed = ("× AR: the median over prompts of each prompt's decode-phase rate over AR's on the same prompt in the "
             "same round, with a 90% bootstrap interval over prompts · end to end: the same, prefill included · "
             if pairs else "× AR: ratios of median tok/s over rounds, prefill included (a run from before the paired "
             "bench: no interval, no decode-phase split) · ")
    out += ["", speed + "rounds: tok/s of the slowest and fastest timed round · "
            "c: draft cost per draft token in target forwards · predicted: the cost model τ / (v(K+1) + K·c) with "
            "the measured τ, K, c and v(n) · distinct: distinct-token fraction of the outputs (a looping model "
            "inflates acceptance) · held MB: weights + extra parameters + a 512-position KV cache"
            + (" · peak MB: CUDA allocator peak" if peak else ""), ""]
    if groups:
        out += ["× AR per task group (greedy)\n", "| method | " + " | ".join(groups) + " |",
                "|---|" + "---:|" * len(groups)]
        ar_dom = g.get("ar", {}).get("domains", {})
        for m, r in g.items():
            dom = r.get("domains", {})
            out.append(f"| {m} | " + " | ".join(_f(r.get("groups", {}).get(d, {}).get("speedup_vs_ar") if pairs else
                                                   dom[d] / ar_dom[d] if d in dom and ar_dom.get(d) else None)
                                                for d in groups) + " |")
        out.append("")
    out += ["| method | paper's claim | setting | ours (CPU, greedy) | GPU | why they differ |",
            "|---|---|---|---:|---|---|"]
    for p in body.get("papers", []):
        gpu = f"{p['gpu'][0]:.2f}× ({p['gpu'][1]})" if p.get("gpu") else "–"
        out.append(f"| {p['method']} | {p['claim']} ({p['paper']}) | {p['setting']} | {_f(p.get('ours_cpu'))}× | "
                   f"{gpu} | {p['why']} |")
    out.append("")
    fast = body.get("fast_target")
    if fast:  # the same greedy study with the target on a faster runtime, each method against that runtime's AR
        rt, fm = fast["runtime"], fast["methods"]
        out += [f"The same questions with the target on the {rt} runtime (AR: {_f(g.get('ar', {}).get(rate), 1)} tok/s "
                f"on hf, {_f(fm.get('ar', {}).get(rate), 1)} on {rt}), each method paired against AR on its own "
                "runtime\n",
                f"| method | × AR on hf (90% CI) | predicted | c | × AR on {rt} (90% CI) | predicted | c |",
                "|---|" + "---:|" * 6]
        out += [f"| {m} | {_x(g[m])} | {_f(g[m].get('predicted_speedup'))} | {_f(g[m].get('c'))} | {_x(r)} | "
                f"{_f(r.get('predicted_speedup'))} | {_f(r.get('c'))} |" for m, r in fm.items() if m in g]
        out.append("")
    for key, title in (("sps_k", "SpS's draft length K (one round)"),
                       ("course_contrast", "The contrast: the course model, fp32, greedy")):
        part = body.get(key)
        if part:
            out += [f"{title}\n", "| method | tok/s | × AR | τ | α | c | predicted |", "|---|" + "---:|" * 6]
            out += [f"| {m} | {_f(r.get('tokens_per_s'), 1)} | {_f(r.get('speedup_vs_ar'))} | {_f(r.get('tau'))} | "
                    f"{_f(r.get('alpha'))} | {_f(r.get('c'))} | {_f(r.get('predicted_speedup'))} |"
                    for m, r in part["methods"].items()]
            out.append("")
    return out


def render_runtimes(body: dict) -> list[str]:
    """Where a token's time goes on each runtime (notebook 00's runtime_split): AR per runtime, its streamed share,
    and the fitted t(n) = a + b n."""
    split, prov = body["runtime_split"], body.get("provenance", {})
    out = [f"**Where a token's time goes on each runtime (00_foundations)** · {prov.get('device', '?')} · commit "
           f"`{str(prov.get('commit', '?'))[:10]}` · {prov.get('date', '?')} · SmolLM2 bf16, AR paired per question\n",
           "| runtime | ms per token | weights streamed (ms) | the rest (ms) | × hf AR (90% CI) | a (ms) | b (ms) |",
           "|---|" + "---:|" * 6]
    for name, r in split.items():
        iv = r.get("interval")
        x = _f(r.get("speedup")) + (f" [{iv[0]:.2f}–{iv[1]:.2f}]" if iv and None not in iv else "")
        out.append(f"| {name} | {_f(r['ms_per_token'], 1)} | {_f(r['stream_ms'], 1)} | {_f(r['other_ms'], 1)} | {x} | "
                   f"{_f(r['a_ms'], 1)} | {_f(r['b_ms'])} |")
    return out + ["", "(weights streamed: their bytes at the measured read bandwidth; t(n) = a + b·n: a forward "
                  "over n new tokens, fitted)", ""]


def render_timings(body: dict) -> list[str]:
    """One table: how long `make reproduce` took, per notebook and in all (results/reproduce.json)."""
    prov, nbs = body.get("provenance", {}), body["notebooks_s"]
    setup = body.get("setup_s")
    out = [f"**`{prov.get('command', 'make reproduce')}` wall time** · {prov.get('device', '?')} · commit "
           f"`{str(prov.get('commit', '?'))[:10]}` · {prov.get('date', '?')}\n",
           "| " + " | ".join(["setup", *(n.split(".")[0] for n in nbs), "total"]) + " |",
           "|" + "---:|" * (len(nbs) + 2),
           "| " + " | ".join([_f(None if setup is None else setup / 60, 1), *(_f(v / 60, 1) for v in nbs.values()),
                             _f(body["total_s"] / 60, 1)]) + " |",
           "", "(minutes; setup = creating `.venv` and installing, as a fresh clone pays it)", ""]
    return out


def render(results_dir: Path = RESULTS_DIR) -> str:
    """Markdown tables, one per results file that has a "methods" block (the study gets its full table)."""
    study, timings, runtimes, parts = [], [], [], []
    for f in sorted(results_dir.glob("*.json")):
        body = json.loads(f.read_text())
        if "notebooks_s" in body:
            timings = render_timings(body)
            continue
        if "runtime_split" in body:
            runtimes = render_runtimes(body)
        methods = body.get("methods")
        if not methods:
            continue
        if "study" in body:
            study = render_study(body)  # the headline table goes first, then how long the run took
            continue
        prov = body.get("provenance", {})
        s = body.get("settings", {})
        runtime = f" · target on the {s['runtime']} runtime, each method against AR on it" if "runtime" in s else ""
        parts.append(f"**{f.stem}** · {prov.get('device', '?')} · commit `{str(prov.get('commit', '?'))[:10]}` · "
                     f"{prov.get('date', '?')} · {s.get('n_prompts', '?')} prompts × "
                     f"{s.get('max_new_tokens', '?')} tokens{runtime}\n")
        ci = " (90% CI)" if any(r.get("speedup_interval") for r in methods.values()) else ""
        parts.append(f"| method | tokens/s | speedup vs AR{ci} | τ | α |\n|---|---:|---:|---:|---:|")
        for m, r in methods.items():
            parts.append(f"| {m} | {_f(r.get('tokens_per_s'), 1)} | {_x(r)} | "
                         f"{_f(r.get('tau'))} | {_f(r.get('alpha'))} |")
        parts.append("")
    from dvi_lite.study import gpu

    gpu_part = gpu.render(gpu.load(results_dir / "gpu"))
    if not (study or timings or runtimes or parts or gpu_part):
        return "_No full-run results yet: run `make reproduce`._\n"
    return "\n".join(study + runtimes + gpu_part + timings + parts)


def section(text: str) -> str:
    """The current results block of a README text."""
    if START not in text or END not in text:
        raise ValueError(f"README has no results markers {START} ... {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def update_readme(readme: Path = README, results_dir: Path = RESULTS_DIR) -> None:
    text = readme.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    atomic_write_text(readme, f"{head}{START}\n{render(results_dir)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog=prog("report"), description=__doc__.splitlines()[0]).parse_args(argv)
    update_readme()
    print(f"updated the results section of {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
