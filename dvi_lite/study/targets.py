"""The study on two targets: does speculation still pay when the target itself is fast?

The same checkpoint served two ways (`core.lean`): through Hugging Face's modules (the "hf" runtime, where about
half of a forward is per-operator overhead) and through our lean forward, which removes most of that overhead.
Every method runs on each, paired per question against that runtime's own AR, with v(n) calibrated on that
runtime, so each row says what speculation buys over the fastest AR the same runtime can do.

Why the answer can change: a verify of n tokens pays the fixed cost of a forward once, so a target whose fixed
cost shrinks (lean) leaves less for a draft to amortise, and a draft that runs the target's own layers (Kangaroo,
DVI, Draft & Verify) gets cheaper with it, while a draft with its own modules (SpS's model, EAGLE's and Medusa's
heads) does not.
"""
from __future__ import annotations

from dvi_lite.core.lean import serving
from dvi_lite.measure.timing import bench


def run_on(model, tok, prompts: list[dict], methods: list[str], runtime: str, max_new_tokens: int, repeats: int,
           seed: int = 0, options: dict | None = None) -> dict:
    """The greedy study with the target served on `runtime`: bench's paired, interleaved table, v(n) calibrated
    on that runtime inside each round; the model is served as before afterwards."""
    with serving(model, runtime):
        return bench(model, tok, prompts, methods, max_new_tokens, repeats, seed=seed, options=options)


def compare(tables: dict[str, dict], methods: list[str]) -> list[dict]:
    """One row per method in every table: {runtime: {speedup, interval, predicted, tau, c}} and AR's tok/s."""
    rows = []
    for m in methods:
        if not all(m in t for t in tables.values()):
            continue
        row = {"method": m}
        for rt, t in tables.items():
            r = t[m]
            row[rt] = {"speedup": r.get("speedup_vs_ar"), "interval": r.get("speedup_interval"),
                       "predicted": r.get("predicted_speedup"), "tau": r.get("tau"), "c": r.get("c"),
                       "tokens_per_s": r.get("decode_tokens_per_s")}
        rows.append(row)
    return rows


def format_compare(rows: list[dict], runtimes: list[str]) -> str:
    """The comparison as text: per runtime, × its own AR [interval] and the cost model's prediction, τ and c."""
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    head = f"{'method':<18}" + "".join(f"{'× AR on ' + rt:>24}{'pred':>6}{'τ':>6}{'c':>6}" for rt in runtimes)
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = ""
        for rt in runtimes:
            r = row[rt]
            ci = r["interval"]
            cells += f"{f(r['speedup']) + (f' [{ci[0]:.2f}, {ci[1]:.2f}]' if ci else ''):>24}" \
                     f"{f(r['predicted']):>6}{f(r['tau']):>6}{f(r['c'], 3):>6}"
        lines.append(f"{row['method']:<18}{cells}")
    return "\n".join(lines)


def figure(rows: list[dict], runtimes: list[str], labels: dict[str, str] | None = None):
    """× own AR per method on each runtime, with the paired interval as an error bar, and 1× as a line."""
    import plotly.graph_objects as go

    labels = labels or {}
    fig = go.Figure()
    methods = [r["method"] for r in rows if r["method"] != "ar"]
    for rt in runtimes:
        ys = [next(r for r in rows if r["method"] == m)[rt] for m in methods]
        lo = [y["speedup"] - y["interval"][0] if y["interval"] else 0 for y in ys]
        hi = [y["interval"][1] - y["speedup"] if y["interval"] else 0 for y in ys]
        fig.add_bar(x=methods, y=[y["speedup"] for y in ys], name=labels.get(rt, rt),
                    error_y=dict(type="data", array=hi, arrayminus=lo, visible=True))
    fig.add_hline(y=1.0, line_dash="dash", line_color="#555", annotation_text="as fast as that runtime's AR")
    fig.update_layout(barmode="group", yaxis_title="× AR on the same runtime (decode phase, paired)",
                      xaxis_title="method", title="Does speculation still pay when the target is fast?")
    return fig
