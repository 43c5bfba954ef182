"""The chapters' experiments: a prediction from the cost model, written down before the run, then the run, then a check
of the measurement against the prediction within a stated band.

The knob is the draft length K. The cost model's τ(α, K) = (1 − α^{K+1}) / (1 − α) predicts the tokens per target
forward at every K from one number, the acceptance rate α measured at K = 1. The run decodes the same questions at
each K, and the check says whether the measured τ falls inside the band around the prediction. The model assumes each
draft position is accepted with the same α, independently of the others: where a run leaves the band, that
assumption is what failed (a draft whose acceptance falls along the chain lands below; one whose accepted tokens come
in easy runs, above).
"""
from __future__ import annotations

from dvi_lite.core.engine import Stats
from dvi_lite.core.generate import generate
from dvi_lite.measure.cost import expected_tau


def run_at(model, tok, prompts: list, method: str, max_new_tokens: int, **options) -> dict:
    """τ and α pooled over every step of greedy answers to `prompts` (records with "prompt", or prompts) for one
    configuration of `method`: {"tau", "alpha", "steps"}."""
    pooled = Stats.pool(generate(model, tok, p["prompt"] if isinstance(p, dict) else p, method=method,
                                 max_new_tokens=max_new_tokens, **options).stats for p in prompts)
    if not pooled.steps:
        raise ValueError("no decoding step ran: give prompts and max_new_tokens >= 2")
    return {"tau": pooled.tau, "alpha": pooled.alpha, "steps": len(pooled.steps)}


def predict(alpha: float, ks: list[int]) -> dict[int, float]:
    """{K: τ(α, K)}: the cost model's tokens per target forward at each draft length."""
    return {k: expected_tau(alpha, k) for k in ks}


def check(predicted: float, measured: float, band: float) -> dict:
    """Whether `measured` lies within ±band (a fraction) of `predicted`: {"predicted", "measured", "low", "high",
    "inside", "off"} (off: measured / predicted − 1)."""
    if not 0 < band < 1:
        raise ValueError(f"band must be a fraction in (0, 1), got {band!r}")
    low, high = predicted * (1 - band), predicted * (1 + band)
    return {"predicted": predicted, "measured": measured, "low": low, "high": high,
            "inside": low <= measured <= high, "off": measured / predicted - 1}


def verdict(label: str, c: dict, quantity: str = "τ") -> str:
    """One line: the prediction of `quantity`, its band, the measurement, and inside / above / below."""
    where = "inside" if c["inside"] else "above" if c["measured"] > c["high"] else "below"
    return (f"{label}: predicted {quantity} {c['predicted']:.2f} (band {c['low']:.2f} to {c['high']:.2f}), measured "
            f"{c['measured']:.2f}: {where} the band ({c['off']:+.0%})")


def k_experiment(model, tok, prompts: list, method: str, ks: list[int], max_new_tokens: int, band: float,
                 alpha: float, **options) -> list[dict]:
    """The run and the check: for each K, τ measured with `method` at draft length K (options: the fixed-length
    configuration) against τ(alpha, K); prints one verdict per K and returns the checks (with "K")."""
    out = []
    for k in ks:
        got = run_at(model, tok, prompts, method, max_new_tokens, K=k, **options)
        c = {"K": k, **check(expected_tau(alpha, k), got["tau"], band)}
        print(verdict(f"K = {k}", c))
        out.append(c)
    return out
