"""What more data would buy: a draft's learning curve, fitted and extrapolated, beside what the cost model needs.

Over the range a CPU reaches, a draft's held-out agreement (and its α in decoding) grows about linearly in the
logarithm of the tokens it has seen: each doubling of the data buys about the same few points, until the draft's
capacity caps it. `fit` draws that line through a curve's points; `tokens_for` reads off how many tokens would
reach a target on it. That is an extrapolation and says so: it assumes the line goes on, which a capped draft
will not do, so it is a lower bound on what is needed, never a promise.

The target itself comes from the cost model: `alpha_for` is the least per-token acceptance at which a draft of
cost c, with the measured v(n), predicts a given speedup at its best K (methods.draft_verify.objective).

    fit(tokens, values) -> Fit(a, b, r2)        value ≈ a + b ln(tokens)
    Fit.tokens_for(target)                      tokens at which the line reaches the target (None: never)
    alpha_for(speedup, c, v)                    the acceptance the cost model asks for
    needed(rows, key, speedup, c, v)            the two together, for a results row set
    curves_figure({method: rows}, key)          the curves on a log axis, fits dotted beyond the data
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    """value ≈ a + b ln(tokens), least squares over n points (r2: the share of variance the line explains)."""
    a: float
    b: float
    r2: float | None
    n: int

    def at(self, tokens: float) -> float:
        return self.a + self.b * math.log(tokens)

    def tokens_for(self, target: float) -> float | None:
        """Tokens at which the line reaches `target`; None when it does not rise (b <= 0)."""
        if self.b <= 0:
            return None
        return math.exp((target - self.a) / self.b)


def fit(tokens: Sequence[float], values: Sequence[float]) -> Fit:
    """The log-linear fit of a learning curve; points with a missing value or tokens <= 0 are left out."""
    pts = [(math.log(t), float(v)) for t, v in zip(tokens, values, strict=True) if v is not None and t and t > 0]
    if len(pts) < 2:
        raise ValueError(f"a learning curve needs at least 2 points with tokens > 0 to fit, got {len(pts)}")
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    b, a = np.polyfit(x, y, 1)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - (a + b * x)) ** 2).sum()) / ss if ss > 0 else None
    return Fit(float(a), float(b), r2, len(pts))


def alpha_for(speedup: float, c: float, v: Mapping, k_max: int = 8) -> float | None:
    """The least per-token acceptance α at which the cost model predicts `speedup` (best K <= k_max, τ geometric in
    α) for a draft of cost c; None when even α = 1 falls short."""
    from dvi_lite.measure.cost import alpha_needed

    return alpha_needed(speedup, c, v, k_max)


def needed(rows: Sequence[Mapping], key: str, speedup: float, c: float, v: Mapping) -> dict:
    """For one draft's curve (rows with "tokens" and `key`): the fit, the α the cost model needs for `speedup`, and
    the tokens the line would need to reach it (an extrapolation; None if the line does not rise or no α does)."""
    f = fit([r["tokens"] for r in rows], [r.get(key) for r in rows])
    alpha = alpha_for(speedup, c, v)
    tokens = f.tokens_for(alpha) if alpha is not None else None
    last = max(r["tokens"] for r in rows)
    return {"key": key, "fit": {"a": f.a, "b_per_doubling": f.b * math.log(2), "r2": f.r2, "points": f.n},
            "speedup": speedup, "c": c, "alpha_needed": alpha, "tokens_needed": tokens,
            "times_the_data": tokens / last if tokens else None,
            "note": "log-linear extrapolation of the held-out curve: a lower bound, since a draft's capacity caps it"}


AXIS_TITLES = {"val_agreement": "held-out top-1 agreement with the target"}  # a curve key -> what the axis says


def curves_figure(curves: Mapping[str, Sequence[Mapping]], key: str = "val_agreement", target: float | None = None,
                  title: str = "held-out agreement against tokens seen"):
    """Each method's curve (markers), its log-linear fit (solid over the data, dotted beyond it, up to 30× the data),
    and, when given, the target the cost model asks for (a dashed line)."""
    import plotly.graph_objects as go

    from dvi_lite.measure.figures import method_color

    fig = go.Figure()
    for m, rows in curves.items():
        pts = [(r["tokens"], r[key]) for r in rows if r.get(key) is not None and r["tokens"] > 0]
        if not pts:
            continue
        col = method_color(m)
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="markers+lines", name=m,
                        marker=dict(color=col, size=8), line=dict(color=col, width=1))
        if len(pts) >= 2:
            f = fit([p[0] for p in pts], [p[1] for p in pts])
            lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
            xs = np.geomspace(hi, 30 * hi, 20)
            fig.add_scatter(x=xs, y=[f.at(x) for x in xs], mode="lines", line=dict(color=col, dash="dot"),
                            name=f"{m}: fit, +{f.b * math.log(2):.3f} per doubling", showlegend=True)
            fig.add_scatter(x=[lo, hi], y=[f.at(lo), f.at(hi)], mode="lines", line=dict(color=col, width=0.5),
                            showlegend=False)
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", annotation_text=f"needed: {target:.2f}")
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="tokens seen (log scale)",
                      yaxis_title=AXIS_TITLES.get(key, key), legend_title_text="draft")
    return fig


# piece card (under the model's artifacts folder) and the bench row whose c is the piece's cost per draft token
PIECES = {"eagle": ("eagle/card.json", "eagle:tree=chain"), "sps": ("sps/card.json", "sps"),
          "medusa": ("medusa/heads.json", "medusa"), "kangaroo": ("kangaroo/adapter_k2.json", "kangaroo")}


def card_curve(card: Mapping) -> list[dict]:
    """A card's learning curve as rows {"tokens", "val_agreement"} (EAGLE's cards say tokens_seen)."""
    rows = card.get("curve") or card.get("val", {}).get("curve") or []
    return [{"tokens": r.get("tokens", r.get("tokens_seen")), "val_agreement": r["val_agreement"]}
            for r in rows if r.get("val_agreement") is not None and (r.get("tokens") or r.get("tokens_seen"))]


def scaling_report(folder, bench: Mapping, speedups: Sequence[float] = (1.3, 2.0)) -> dict:
    """Per committed piece: its curve's fit and, for each target speedup, the α the cost model needs at the piece's
    measured c (the bench's row) and the bench's v, with the tokens the fitted line would need to reach it."""
    import json
    from pathlib import Path

    v = {int(n): x for n, x in bench["verify_cost"].items()}
    out = {}
    for name, (rel, row) in PIECES.items():
        path = Path(folder) / rel
        m = bench["methods"].get(row)
        if not path.is_file() or m is None:
            continue
        card = json.loads(path.read_text())
        rows = card_curve(card)
        if len(rows) < 2:
            continue
        out[name] = {"card": str(rel), "bench_row": row, "measured": {k: m.get(k) for k in ("speedup_vs_ar", "tau",
                                                                                        "alpha", "c")},
                     "curve": rows, "targets": [needed(rows, "val_agreement", s, m["c"], v) for s in speedups]}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    from dvi_lite.commands import check_outputs, command_line, prog
    from dvi_lite.paths import atomic_write_text

    ap = argparse.ArgumentParser(prog=prog("scaling"), description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, help="a bench results file with the pieces' rows (their c) and v(n)")
    ap.add_argument("--pieces", default="data/smollm2", help="the folder holding the pieces' cards")
    ap.add_argument("--speedups", type=float, nargs="+", default=[1.3, 2.0])
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"))  # before any work
    bench = json.loads(Path(args.bench).read_text())
    rep = scaling_report(args.pieces, bench, tuple(args.speedups))
    if not rep:
        ap.error(f"no piece in {args.pieces} has both a learning curve and a row in {args.bench}")
    for name, r in rep.items():
        last = r["curve"][-1]
        for t in r["targets"]:
            need = "unreachable" if t["alpha_needed"] is None else f"alpha {t['alpha_needed']:.2f}"
            more = f"{t['times_the_data']:.1f}x the tokens" if t["times_the_data"] else "-"
            print(f"{name:9s} at {last['tokens']:>9,} tokens agreement {last['val_agreement']:.3f} "
                  f"(+{t['fit']['b_per_doubling']:.3f}/doubling); {t['speedup']}x needs {need}: {more}")
    if args.json:
        from dvi_lite.measure.provenance import provenance

        res = {"pieces": rep, "bench": args.bench, "provenance": provenance(command_line("scaling", argv))}
        atomic_write_text(Path(args.json), json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
