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


def test_second_look_is_keyed_by_method_and_prints(tmp_path):
    res = {"ar": _row(1.0, 1.0), "pld": _row(1.6, 1.5, [1.6, 1.7, 1.5], [2.0, 2.2, 1.9], [0.2, 0.6, 0.7]),
           "eagle": _row(1.3, 1.4, [1.3, 1.2, 1.4], [2.4, 2.3, 2.5], [0.2, 0.6, 0.7]),
           "hf_assisted": _row(1.05, 1.0, [1.0, 1.1, 1.05], [1.3, 1.3, 1.3], [0.2, 0.6, 0.7])}
    res["pld"]["groups"] = {"qa": {"speedup_vs_ar": 1.6}, "rag": {"speedup_vs_ar": 1.5}}
    look = verdict.second_look(res, ["ar", "pld", "eagle", "hf_assisted"])
    assert look["ranking"] == ["pld", "eagle", "hf_assisted"]
    assert look["estimators"]["eagle"]["rank_pooled"] == 2 and look["headline_holds"]
    assert list(look["head_to_head"]) == ["eagle vs pld", "pld vs hf_assisted"]  # dvi / kangaroo absent: left out
    assert "points" not in look["repetition"]["pld"] and look["repetition"]["pld"]["looping"] == 1
    assert look["groups"]["pld"] == {"qa": 1.6, "rag": 1.5} and look["groups"]["eagle"] == {}
    text = verdict.format_second_look(look)
    assert "pld vs hf_assisted" in text and "× AR per task group" in text
    assert "× AR per task group" not in verdict.format_second_look(look, groups=False)


def test_load_bench_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no bench results"):
        verdict.load_bench(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"methods": {"pld": {}}}')
    with pytest.raises(ValueError, match="not a bench results file"):
        verdict.load_bench(tmp_path / "x.json")


def test_configurations_name_each_method_and_its_options(target):
    from dvi_lite.study.table import configurations

    c = configurations(target, ["ar", "sps", "pld", "kangaroo", "eagle", "eagle:lookup=true", "unknown"])
    assert c["pld"].startswith("K = 6") and "n-grams up to 3" in c["pld"]  # read from pld's factory defaults
    assert c["eagle:lookup=true"] == c["eagle"] + ", lookup=true"
    assert "exit layer" in c["kangaroo"] and c["unknown"] == "its defaults"
