"""Paired speed statistics: each method's speedup over AR, prompt by prompt, with a bootstrap interval.

Why paired. A CPU's speed drifts: AR's decode rate here moved from 24 to 19 tokens/s between two rounds minutes
apart. A ratio of two whole-round medians taken at different times carries that drift (about +-0.2). The bench
therefore runs every method on a prompt right next to AR on the same prompt (in an order that rotates from prompt
to prompt and round to round) and divides within that pair. Per prompt we take the median ratio over rounds; the
headline is the median over prompts, with a percentile-bootstrap 90% interval over prompts (the prompts are the
sample; rounds only steady each prompt's own ratio).

Two rates per generation:
- decode phase: (new tokens - 1) / (time after the first new token). The prefill and the first token are out, so
  a long prompt does not dilute the comparison. This is the headline, as in the papers.
- end to end: new tokens / all the time, prefill included. It stands beside the headline.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import numpy as np

CONFIDENCE = 0.90
RESAMPLES = 2000


def rates(new_tokens: int, total_s: float, prefill_s: float) -> dict[str, float | None]:
    """{"decode": tokens/s after the first new token, "end_to_end": tokens/s over everything}; None where a
    generation has no time or no token to measure (a run that stopped at its first token has no decode phase)."""
    decode_s = total_s - prefill_s
    return {"decode": (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None,
            "end_to_end": new_tokens / total_s if new_tokens > 0 and total_s > 0 else None}


def interval(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
             seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `values` (resampled with replacement, seeded).

    One value gives a zero-width interval: there is nothing to resample, and the table says n beside it.
    """
    x = np.asarray([v for v in values if v is not None], dtype=float)
    if x.size == 0:
        raise ValueError("values: give at least one number to take an interval of")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if x.size == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)  # (resamples,)
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(meds, [tail, 1 - tail])
    return float(lo), float(hi)


def per_prompt_ratios(method_rounds: list[list[dict]], ar_rounds: list[list[dict]], key: str) -> list[float | None]:
    """Per prompt, the median over rounds of method rate / AR rate in the same round ([round][prompt] -> rates).

    A prompt where either side has no rate in a round (no decode phase) drops that round; with none left it is None.
    """
    n = len(ar_rounds[0]) if ar_rounds else 0
    out: list[float | None] = []
    for i in range(n):
        pairs = [(m[i][key], a[i][key]) for m, a in zip(method_rounds, ar_rounds, strict=True)]
        ratios = [x / y for x, y in pairs if x is not None and y]
        out.append(statistics.median(ratios) if ratios else None)
    return out


def speedup(method_rounds: list[list[dict]], ar_rounds: list[list[dict]], key: str = "decode",
            groups: Sequence[str] | None = None, seed: int = 0) -> dict:
    """{"median", "lo", "hi", "n", "per_prompt", "groups": {group: {"median", "lo", "hi", "n"}}}: the paired
    speedup over AR of one rate (`key`: "decode" or "end_to_end"); `groups` names each prompt's task group."""
    ratios = per_prompt_ratios(method_rounds, ar_rounds, key)
    out = _summary(ratios, seed) | {"per_prompt": ratios}
    if groups is not None:
        by: dict[str, list[float | None]] = {}
        for g, r in zip(groups, ratios, strict=True):
            by.setdefault(g, []).append(r)
        out["groups"] = {g: _summary(rs, seed) for g, rs in by.items()}
    return out


def _summary(ratios: Sequence[float | None], seed: int) -> dict:
    kept = [r for r in ratios if r is not None]
    if not kept:
        return {"median": None, "lo": None, "hi": None, "n": 0}
    lo, hi = interval(kept, seed=seed)
    return {"median": statistics.median(kept), "lo": lo, "hi": hi, "n": len(kept)}


def _sums(rounds: list[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt, tokens and seconds summed over rounds: (n,) each. key "decode": the decode phase's tokens
    (new - 1) and time; "end_to_end": every new token and all the time."""
    tk, sk = ("decode_tokens", "decode_s") if key == "decode" else ("new_tokens", "total_s")
    n = len(rounds[0])
    tokens = np.array([sum(r[i].get(tk) or 0 for r in rounds) for i in range(n)], dtype=float)
    secs = np.array([sum(r[i].get(sk) or 0.0 for r in rounds) for i in range(n)], dtype=float)
    return tokens, secs


def pooled(method_rounds: list[list[dict]], ar_rounds: list[list[dict]], key: str = "decode",
           confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """{"pooled", "lo", "hi", "n"}: the pooled speedup, total tokens over total time of the method divided by the
    same for AR, over every prompt and round; the interval bootstraps the prompts (each keeps its rounds).

    Why beside the median of per-prompt ratios: the median weighs every question alike, the pooled ratio weighs
    each by its time, which is what a user serving these questions waits. When they disagree, the speedup rests
    on a few questions, and the table shows both."""
    tm, sm = _sums(method_rounds, key)
    ta, sa = _sums(ar_rounds, key)
    ok = (sm > 0) & (sa > 0) & (tm > 0) & (ta > 0)  # prompts with a rate on both sides
    tm, sm, ta, sa = tm[ok], sm[ok], ta[ok], sa[ok]
    if not ok.any():
        return {"pooled": None, "lo": None, "hi": None, "n": 0}
    point = float((tm.sum() / sm.sum()) / (ta.sum() / sa.sum()))
    if tm.size == 1:
        return {"pooled": point, "lo": point, "hi": point, "n": 1}
    idx = np.random.default_rng(seed).integers(0, tm.size, size=(resamples, tm.size))  # (resamples, n)
    boot = (tm[idx].sum(1) / sm[idx].sum(1)) / (ta[idx].sum(1) / sa[idx].sum(1))
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return {"pooled": point, "lo": float(lo), "hi": float(hi), "n": int(tm.size)}


def versus(ratios_a: Sequence[float | None], ratios_b: Sequence[float | None], seed: int = 0) -> dict:
    """{"median", "lo", "hi", "n"}: method A over method B, paired per prompt. Both ratios are over the same AR
    run on the same prompt, so (A / AR) / (B / AR) is A / B on that prompt; the median over prompts with its
    bootstrap interval. An interval that holds 1 does not rank the two."""
    both = [a / b for a, b in zip(ratios_a, ratios_b, strict=True) if a is not None and b]
    return _summary(both, seed)


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t_{0.975, df}


def ci95(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample sd and a 95% t-interval over seeds, runs or any few independent values (None for one)."""
    x = [float(v) for v in values]
    n = len(x)
    m = sum(x) / n
    if n < 2:
        return {"n": n, "mean": m, "sd": None, "ci95": None}
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    h = T975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "sd": sd, "ci95": [m - h, m + h]}
