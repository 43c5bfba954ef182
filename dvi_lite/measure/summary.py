"""One bench's numbers from its rounds: rates, paired speedups with intervals, tau, alpha, c and the prediction.

`bench.bench` gathers each method's round sums (tokens, times, engine counters, each prompt's own rates) and hands
them here. The speedups are paired per prompt (measure.paired); c and v(n) are taken against AR in the same round.
"""
from __future__ import annotations

import statistics
from typing import Mapping

from dvi_lite.core.engine import acceptance_rate, position_acceptance, position_counts
from dvi_lite.measure import cost, paired


def _tau(agg: dict) -> float | None:
    """Tokens per target forward: (accepted + one bonus/correction token per step) / steps; None without drafts."""
    return (agg["accepted"] + agg["steps"]) / agg["steps"] if agg["steps"] and agg["drafted"] else None


def agreement(outputs: list[list[int]], ar_outputs: list[list[int]]) -> dict:
    """How far a method's tokens agree with AR's, prompt by prompt: the fraction of prompts with the very same
    tokens, and the mean length of the common prefix as a fraction of AR's output (1.0 = all identical)."""
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    pairs = list(zip(outputs, ar_outputs, strict=True))
    return {"same_tokens_as_ar": sum(a == b for a, b in pairs) / len(pairs),
            "common_prefix_with_ar": statistics.mean(prefix(a, b) / max(1, len(b)) for a, b in pairs)}


def _median(xs: list) -> float | None:
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


def _rates(rs: list[dict]) -> tuple[list[float], list[float | None]]:
    """End-to-end and decode-phase tokens/s of each round."""
    return ([r["new_tokens"] / r["time_s"] if r["time_s"] > 0 else 0.0 for r in rs],
            [r["decode_tokens"] / r["decode_s"] if r["decode_s"] > 0 else None for r in rs])


def summarise(rounds: dict[str, list[dict]], n_prompts: int, v: Mapping | None = None,
              groups: list[str] | None = None) -> dict:
    """Per method: tokens/s (end to end and decode phase, medians over rounds), the paired speedups over our AR
    with their intervals (measure.paired; decode phase = `speedup_vs_ar`, the headline), tau, alpha, the draft cost
    ratio c, per task group too, and the speedup that the verify-cost table `v` ({n: v(n)}) predicts."""
    out: dict[str, dict] = {}
    for m, rs in rounds.items():
        last = rs[-1]
        tps, dtps = _rates(rs)
        steps = last["steps"]
        gtps = {d: statistics.median(r["domains"][d]["new_tokens"] / r["domains"][d]["time_s"] for r in rs)
                for d in last["domains"]}
        out[m] = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_rounds": tps,
            "decode_tokens_per_s": _median(dtps),
            "decode_tokens_per_s_rounds": dtps,
            "tau": _tau(last),
            "alpha": acceptance_rate(last["log"]),  # per tested draft token, as in Stats.alpha
            "n_prompts": n_prompts,
            "new_tokens": last["new_tokens"],
            "distinct_token_fraction": statistics.mean(len(set(o)) / max(1, len(o)) for o in last["outputs"]),
            "domains": gtps,  # {group: tokens/s end to end}, the old key; "groups" has the rest
            "groups": {d: {"tokens_per_s": gtps[d], "tau": _tau(g), "n_prompts": g["n"], "new_tokens": g["new_tokens"]}
                       for d, g in last["domains"].items()},
            # per question (the last round): tau and the distinct-token fraction, so a looping answer, which
            # is easy to guess, shows up beside the speedup it would carry
            "tau_per_prompt": [(p["accepted"] + p["steps"]) / p["steps"] if p.get("steps") and p.get("drafted")
                               else None for p in last["prompts"]],
            "distinct_per_prompt": [p.get("distinct") for p in last["prompts"]],
            "position_acceptance": position_acceptance(last["log"]),
            "position_reached": [n for n, _ in position_counts(last["log"])],  # events behind each rate
            "draft_s_per_step": last["draft_s"] / steps if steps else None,
            "verify_s_per_step": last["verify_s"] / steps if steps else None,
            "peak_mem_bytes": max((r["peak_mem_bytes"] for r in rs if r.get("peak_mem_bytes") is not None),
                                  default=None),
        }
    if "ar" in rounds:
        for m, r in out.items():
            _paired(r, rounds[m], rounds["ar"], groups)
            r.update(agreement(rounds[m][-1]["outputs"], rounds["ar"][-1]["outputs"]))
            if r["tau"] is not None and r["draft_s_per_step"] is not None:
                _costs(r, rounds[m], rounds["ar"], v)
    return out


def _paired(r: dict, rs: list[dict], ar: list[dict], groups: list[str] | None) -> None:
    """The paired speedups (measure.paired) of one method's rounds `rs` over AR's rounds `ar`, into its row `r`."""
    mine, ref = [x["prompts"] for x in rs], [x["prompts"] for x in ar]
    dec = paired.speedup(mine, ref, "decode", groups)
    e2e = paired.speedup(mine, ref, "end_to_end", groups)
    r.update(speedup_vs_ar=dec["median"], speedup_interval=[dec["lo"], dec["hi"]],
             speedup_vs_ar_e2e=e2e["median"], speedup_interval_e2e=[e2e["lo"], e2e["hi"]],
             speedup_per_prompt=dec["per_prompt"], speedup_confidence=paired.CONFIDENCE)
    pd, pe = paired.pooled(mine, ref, "decode"), paired.pooled(mine, ref, "end_to_end")
    r.update(speedup_pooled=pd["pooled"], speedup_pooled_interval=[pd["lo"], pd["hi"]],
             speedup_pooled_e2e=pe["pooled"], speedup_pooled_interval_e2e=[pe["lo"], pe["hi"]])
    for d, g in r["groups"].items():
        gd, ge = dec.get("groups", {}).get(d, {}), e2e.get("groups", {}).get(d, {})
        g.update(speedup_vs_ar=gd.get("median"), speedup_interval=[gd.get("lo"), gd.get("hi")],
                 speedup_vs_ar_e2e=ge.get("median"))


def _costs(r: dict, rs: list[dict], ar: list[dict], v: Mapping | None) -> None:
    """c, K and the prediction of one method's row `r`. c = draft time per draft forward / AR's time per decoded
    token, both from the same round (the median over rounds); K = the draft's depth per step (= drafted tokens for
    a chain; a tree's extra leaves cost no draft forward, but the verify forward sees every node: v(nodes + 1))."""
    last = rs[-1]
    k = sum(d for d, _ in last["log"]) / max(1, len(last["log"]))
    cs = [x["draft_s"] / max(1, x["steps"]) / max(k, 1e-9) / (a["decode_s"] / a["decode_tokens"])
          for x, a in zip(rs, ar, strict=True) if a["decode_tokens"] and a["decode_s"] > 0]
    if not cs:
        return
    nodes = last["drafted"] / max(1, last["steps"])
    r.update(c=statistics.median(cs), c_rounds=cs, draft_depth_per_step=k, drafted_per_step=nodes)
    if v and r["speedup_vs_ar"] is not None:
        r["verify_cost_per_step"] = cost.v_of(v, nodes + 1)  # v(nodes + 1), in 1-token forwards
        r["predicted_speedup"] = cost.predicted_speedup(r["tau"], k, r["c"], v, nodes=nodes)
        r["measured_over_predicted"] = r["speedup_vs_ar"] / r["predicted_speedup"]
