"""Whether the study's verdict survives a second look: two estimators, head-to-head intervals, repetition.

A bench row carries each method's speedup over AR two ways (measure.paired): the median of per-question ratios
(every question weighs the same) and the pooled ratio (total tokens over total time: each question weighs by its
time). A ranking that flips between them rests on a few questions. `head_to_head` pairs two methods on the same
questions (each over the same AR run), so "A beats B" gets its own interval instead of two overlapping ones.
`repetition` sets τ against each answer's distinct-token fraction: a looping answer is easy to guess, and a
headline carried by loops would not survive on other text.
"""
from __future__ import annotations

import statistics

from dvi_lite.measure import paired

LOOPING = 0.3  # an answer whose distinct-token fraction is below this repeats itself


def estimators(res: dict, methods: list[str]) -> list[dict]:
    """Per method: the median of per-question ratios and the pooled ratio, each with its interval, best first by
    the median; `rank_median` and `rank_pooled` say where each estimator puts it."""
    rows = [{"method": m, "median": res[m].get("speedup_vs_ar"), "median_interval": res[m].get("speedup_interval"),
             "pooled": res[m].get("speedup_pooled"), "pooled_interval": res[m].get("speedup_pooled_interval")}
            for m in methods if m in res and m != "ar" and res[m].get("speedup_vs_ar") is not None]
    for key in ("median", "pooled"):
        order = sorted(rows, key=lambda r: -(r[key] or 0.0))
        for i, r in enumerate(order):
            r[f"rank_{key}"] = i + 1
    return sorted(rows, key=lambda r: r["rank_median"])


def headline_holds(rows: list[dict]) -> bool:
    """The best method by the median is the best by the pooled ratio too."""
    return bool(rows) and rows[0]["rank_pooled"] == 1


def head_to_head(res: dict, pairs: list[tuple[str, str]]) -> dict[str, dict]:
    """{"A vs B": {"median", "lo", "hi", "n"}}: A's speedup over B's, question by question (measure.paired.versus)."""
    return {f"{a} vs {b}": paired.versus(res[a]["speedup_per_prompt"], res[b]["speedup_per_prompt"])
            for a, b in pairs if a in res and b in res}


def repetition(res: dict, methods: list[str], looping: float = LOOPING) -> dict[str, dict]:
    """Per method: the questions' (distinct-token fraction, τ, speedup) points, how many answers loop, the
    rank correlation of τ with the distinct fraction, and the median speedup over the questions that do not loop."""
    out = {}
    for m in methods:
        r = res.get(m, {})
        taus, dist, sp = r.get("tau_per_prompt"), r.get("distinct_per_prompt"), r.get("speedup_per_prompt")
        if not taus or not dist or not sp:
            continue
        pts = [(d, t, s) for d, t, s in zip(dist, taus, sp, strict=True) if None not in (d, t, s)]
        kept = [s for d, _, s in pts if d >= looping]
        out[m] = {"points": pts, "looping": sum(d < looping for d, _, _ in pts), "n": len(pts),
                  "tau_distinct_spearman": _spearman([d for d, _, _ in pts], [t for _, t, _ in pts]),
                  "speedup_without_looping": statistics.median(kept) if kept else None}
    return out


def _spearman(x: list[float], y: list[float]) -> float | None:
    """Rank correlation (average ranks for ties); None with fewer than 3 points or a constant side."""
    if len(x) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) == 1 or len(set(ry)) == 1:
        return None
    return statistics.correlation(rx, ry)
