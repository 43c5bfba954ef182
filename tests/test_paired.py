"""Paired speedups and the steady v(n) table, on fixed numbers (no timing)."""
import statistics

import pytest

from dvi_lite.measure import cost, paired


def test_rates_split_the_prefill_off():
    r = paired.rates(new_tokens=11, total_s=2.0, prefill_s=1.0)
    assert r == {"decode": 10.0, "end_to_end": 5.5}
    assert paired.rates(1, 1.0, 0.5)["decode"] is None  # one token: no decode phase
    assert paired.rates(0, 0.0, 0.0) == {"decode": None, "end_to_end": None}


def test_interval_brackets_the_median_and_is_seeded():
    xs = [0.9, 1.0, 1.1, 1.2, 1.3, 1.25, 1.05]
    lo, hi = paired.interval(xs)
    assert lo <= statistics.median(xs) <= hi and lo >= min(xs) and hi <= max(xs)
    assert paired.interval(xs) == (lo, hi)  # the same seed, the same interval
    assert paired.interval([1.4]) == (1.4, 1.4)
    assert paired.interval([2.0] * 5) == (2.0, 2.0)
    with pytest.raises(ValueError, match="values"):
        paired.interval([])
    with pytest.raises(ValueError, match="confidence"):
        paired.interval(xs, confidence=1.5)


def _round(*decode):
    return [{"decode": d, "end_to_end": d / 2 if d else None} for d in decode]


def test_speedup_divides_within_each_pair_before_taking_medians():
    """AR drifts from 20 to 10 tokens/s between rounds; the method stays 1.5x AR on prompt 0 and 2x on prompt 1
    within each round. Paired ratios see 1.5 and 2 exactly; whole-round medians would not."""
    ar = [_round(20, 20), _round(10, 10)]
    m = [_round(30, 40), _round(15, 20)]
    s = paired.speedup(m, ar, "decode", groups=["qa", "rag"])
    assert s["per_prompt"] == [1.5, 2.0] and s["median"] == pytest.approx(1.75) and s["n"] == 2
    assert (s["lo"], s["hi"]) == paired.interval([1.5, 2.0])
    assert s["groups"]["qa"]["median"] == 1.5 and s["groups"]["rag"]["n"] == 1
    assert paired.speedup(m, ar, "end_to_end")["per_prompt"] == [1.5, 2.0]


def test_speedup_drops_a_prompt_without_a_decode_phase():
    s = paired.speedup([_round(None, 30)], [_round(20, 20)])
    assert s["per_prompt"] == [None, 1.5] and s["median"] == 1.5 and s["n"] == 1
    assert paired.speedup([_round(None)], [_round(20)])["median"] is None


def test_steady_takes_the_median_and_never_prices_more_tokens_below_fewer():
    tables = [{1: 1.0, 2: 0.97, 5: 1.10, 9: 1.08}, {1: 1.0, 2: 0.95, 5: 1.2, 9: 1.3},
              {"1": 1.0, "2": 1.02, "5": 1.15, "9": 1.05}]  # string keys, as read back from JSON
    v, below = cost.steady(tables)
    assert below == [2]  # the median v(2) = 0.97 < 1: flagged
    assert v == {1: 1.0, 2: 1.0, 5: 1.15, 9: 1.15}  # non-decreasing envelope of the medians
    with pytest.raises(ValueError, match="tables"):
        cost.steady([])


def _timed(*pairs):
    """One round: (decode tokens, decode seconds) per prompt."""
    return [{"decode_tokens": t, "decode_s": s, "new_tokens": t + 1, "total_s": s + 0.5} for t, s in pairs]


def test_pooled_weighs_each_prompt_by_its_time_and_the_median_does_not():
    """Two short prompts where the method is 2x AR and one long prompt where it is 1x AR: the median of per-prompt
    ratios says 2, the pooled ratio (total tokens over total time) is pulled toward the long prompt's 1."""
    ar = [_timed((10, 1.0), (10, 1.0), (100, 10.0))]
    m = [_timed((10, 0.5), (10, 0.5), (100, 10.0))]
    p = paired.pooled(m, ar)
    assert p["pooled"] == pytest.approx((120 / 11.0) / (120 / 12.0)) and p["n"] == 3
    assert p["lo"] <= p["pooled"] <= p["hi"] and paired.pooled(m, ar) == p  # seeded
    assert paired.pooled([_timed((5, 1.0))], [_timed((5, 2.0))]) == {"pooled": 2.0, "lo": 2.0, "hi": 2.0, "n": 1}
    assert paired.pooled([_timed((0, 0.0))], [_timed((5, 2.0))])["pooled"] is None  # no decode phase: no rate


def test_versus_divides_two_methods_within_each_prompt():
    v = paired.versus([2.0, 1.5, None, 1.2], [1.0, 1.5, 1.1, 0.0])
    assert v["n"] == 2 and v["median"] == pytest.approx(1.5)  # prompts 0 and 1 only (None, and B without a rate)
