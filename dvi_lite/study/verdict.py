"""Whether the study's verdict survives a second look: two estimators, head-to-head intervals, repetition.

A bench row carries each method's speedup over AR two ways (measure.paired): the median of per-question ratios
(every question weighs the same) and the pooled ratio (total tokens over total time: each question weighs by its
time). A ranking that flips between them rests on a few questions. `head_to_head` pairs two methods on the same
questions (each over the same AR run), so "A beats B" gets its own interval instead of two overlapping ones.
`repetition` sets τ against each answer's distinct-token fraction: a looping answer is easy to guess, and a
headline carried by loops would not survive on other text.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

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
        if not pts:  # AR, HF's loops: no τ per question to set against anything
            continue
        kept = [s for d, _, s in pts if d >= looping]
        out[m] = {"points": pts, "looping": sum(d < looping for d, _, _ in pts), "n": len(pts),
                  "tau_distinct_spearman": _spearman([d for d, _, _ in pts], [t for _, t, _ in pts]),
                  "speedup_without_looping": statistics.median(kept) if kept else None}
    return out


def pairs_for(rows: list[dict]) -> list[tuple[str, str]]:
    """The study's head-to-head pairs: EAGLE (and its tree with a lookup branch, where benched) vs prompt lookup,
    DVI vs Kangaroo, prompt lookup (the study's best) vs HF assisted (the same draft as SpS in Hugging Face's loop),
    and the best by the median vs HF assisted where another method is best. A pair whose methods were not benched is
    left out by `head_to_head`; the fixed pairs keep their keys whatever the ranking (the prose tags them)."""
    best = rows[0]["method"] if rows else None
    extra = [(best, "hf_assisted")] if best not in (None, "pld", "hf_assisted") else []
    return [("eagle", "pld"), ("eagle:lookup=true", "pld"), ("dvi", "kangaroo"), ("pld", "hf_assisted"), *extra]


def second_look(res: dict, methods: list[str]) -> dict:
    """The three checks on one bench's rows, as a results entry: {"ranking": methods best first by the median,
    "estimators": {method: row}, "headline_holds", "head_to_head", "repetition": {method: summary (no points)},
    "groups": {method: {task group: x AR}}}. Keyed by method, so a rerun that reorders the methods keeps each key."""
    from dvi_lite.study.table import group_speedups  # (torch-heavy: imported when a second look is taken)

    rows = estimators(res, methods)
    rep = repetition(res, methods)
    return {"ranking": [r["method"] for r in rows],
            "estimators": {r["method"]: {k: v for k, v in r.items() if k != "method"} for r in rows},
            "headline_holds": headline_holds(rows),
            "head_to_head": head_to_head(res, pairs_for(rows)),
            "repetition": {m: {k: v for k, v in r.items() if k != "points"} for m, r in rep.items()},
            "groups": group_speedups({m: res[m] for m in methods if m in res})}


def load_bench(path: str | Path) -> dict:
    """A committed `bench --json` file: {"settings", "provenance", "methods": {method: row}} (a clear error if it is
    missing or is not a bench file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no bench results at {path} (write it with python -m dvi_lite bench ... --json)")
    body = json.loads(path.read_text())
    if not isinstance(body.get("methods"), dict) or "ar" not in body["methods"]:
        raise ValueError(f"{path} is not a bench results file (no 'methods' with an 'ar' row)")
    return body


def format_second_look(look: dict, groups: bool = True) -> str:
    """The three checks as printed tables: the estimators with their intervals and ranks, the head-to-head
    intervals, the repetition check, and (groups=True) x AR per task group."""
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    iv = lambda r, k: "–" if not r.get(k) or None in r[k] else f"[{r[k][0]:.2f}, {r[k][1]:.2f}]"  # noqa: E731
    out = [f"{'method':<18}{'median':>8}{'interval':>15}{'pooled':>8}{'interval':>15}{'rank by median':>16}"
           f"{'by pooled':>11}"]
    for m in look["ranking"]:
        r = look["estimators"][m]
        out.append(f"{m:<18}{f(r['median']):>8}{iv(r, 'median_interval'):>15}{f(r['pooled']):>8}"
                   f"{iv(r, 'pooled_interval'):>15}{r['rank_median']:>16}{r['rank_pooled']:>11}")
    out.append(f"the best method by the median is the best by the pooled ratio too: {look['headline_holds']}")
    out.append("\nhead to head, paired per question (A over B: above 1 means A is faster)")
    for name, d in look["head_to_head"].items():
        out.append(f"{name:<26}{f(d.get('median')):>6} [{f(d.get('lo'))}, {f(d.get('hi'))}] over {d.get('n')} "
                   "questions")
    out.append(f"\nrepetition: answers whose distinct-token share is below {LOOPING} count as looping")
    for m, r in look["repetition"].items():
        out.append(f"{m:<18} looping {r['looping']}/{r['n']}, rank correlation of τ with the distinct share "
                   f"{f(r['tau_distinct_spearman'])}, × AR over the answers that do not loop "
                   f"{f(r['speedup_without_looping'])}")
    groups = look["groups"] if groups else {}
    if any(groups.values()):
        cols = list(next(g for g in groups.values() if g))
        out.append("\n× AR per task group")
        out.append(f"{'method':<18}" + "".join(f"{d[:12]:>13}" for d in cols))
        for m, row in groups.items():
            out.append(f"{m:<18}" + "".join(f"{f(row.get(d)):>13}" for d in cols))
    return "\n".join(out)


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
