"""The study's second look (study.verdict) on fixed rows: no timing."""
import pytest

from dvi_lite.study import verdict


def _row(median, pooled, per_prompt=None, taus=None, distinct=None):
    return {"speedup_vs_ar": median, "speedup_interval": [median - 0.1, median + 0.1], "speedup_pooled": pooled,
            "speedup_pooled_interval": [pooled - 0.1, pooled + 0.1], "speedup_per_prompt": per_prompt,
            "tau_per_prompt": taus, "distinct_per_prompt": distinct}


def test_estimators_rank_both_ways_and_say_whether_the_headline_holds():
    res = {"ar": _row(1.0, 1.0), "a": _row(1.6, 1.2), "b": _row(1.4, 1.5), "c": _row(0.9, 0.9)}
    rows = verdict.estimators(res, ["ar", "a", "b", "c"])
    assert [r["method"] for r in rows] == ["a", "b", "c"]
    assert [(r["rank_median"], r["rank_pooled"]) for r in rows] == [(1, 2), (2, 1), (3, 3)]
    assert not verdict.headline_holds(rows)
    assert verdict.headline_holds(verdict.estimators(res, ["b", "c"]))


def test_head_to_head_and_repetition():
    res = {"a": _row(1.5, 1.5, [2.0, 1.5, 1.0], [3.0, 2.0, 1.5], [0.1, 0.5, 0.8]),
           "b": _row(1.0, 1.0, [1.0, 1.0, 1.0], [1.2, 1.2, 1.2], [0.1, 0.5, 0.8])}
    h = verdict.head_to_head(res, [("a", "b"), ("a", "missing")])
    assert list(h) == ["a vs b"] and h["a vs b"]["median"] == pytest.approx(1.5)
    rep = verdict.repetition(res, ["a", "b"])
    assert rep["a"]["looping"] == 1 and rep["a"]["speedup_without_looping"] == pytest.approx(1.25)
    assert rep["a"]["tau_distinct_spearman"] == pytest.approx(-1.0)  # the looping answer carries the highest tau
    assert rep["b"]["tau_distinct_spearman"] is None  # a constant tau: no correlation to speak of
