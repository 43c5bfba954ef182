"""course.experiment: the chapters' predict-run-check experiments (τ against K from α at K = 1, a band check)."""
from __future__ import annotations

import pytest

from dvi_lite.course import experiment
from dvi_lite.measure.cost import expected_tau


def test_the_band_check_says_inside_above_and_below():
    assert experiment.check(2.0, 2.2, 0.15)["inside"] and not experiment.check(2.0, 2.4, 0.15)["inside"]
    c = experiment.check(2.0, 1.5, 0.15)
    assert (c["low"], c["high"], round(c["off"], 6)) == (1.7, 2.3, -0.25)
    assert "below the band (-25%)" in experiment.verdict("K = 4", c)
    assert "above the band" in experiment.verdict("n", experiment.check(1.0, 2.0, 0.1), "v(33)")
    with pytest.raises(ValueError, match="band must be a fraction"):
        experiment.check(1.0, 1.0, 15)


def test_the_prediction_is_the_cost_models_tau():
    assert experiment.predict(0.5, [1, 2, 4]) == {k: expected_tau(0.5, k) for k in (1, 2, 4)}


def test_a_run_pools_tau_and_alpha_over_every_step(target, tok, prompts, capsys):
    """Prompt lookup on the tiny model: τ = tokens per target forward over all steps, α per tested token, and the
    experiment checks one row per K against τ(α, K)."""
    base = experiment.run_at(target, tok, prompts[:2], "pld", 12, K=1)
    assert base["steps"] > 0 and 1.0 <= base["tau"] <= 2.0 and 0.0 <= base["alpha"] <= 1.0
    rows = experiment.k_experiment(target, tok, prompts[:2], "pld", [2, 3], 12, 0.2, base["alpha"])
    assert [r["K"] for r in rows] == [2, 3] and all(r["predicted"] == expected_tau(base["alpha"], r["K"]) for r in rows)
    assert capsys.readouterr().out.count("predicted τ") == 2
    with pytest.raises(ValueError, match="no decoding step ran"):
        experiment.run_at(target, tok, [], "pld", 12, K=1)
