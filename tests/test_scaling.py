"""The learning-curve fit and extrapolation, on made-up curves (no timing)."""
import math

import pytest

from dvi_lite.study import scaling


def test_fit_recovers_a_log_linear_curve_and_inverts_it():
    tokens = [1e5, 2.5e5, 5e5, 1e6]
    f = scaling.fit(tokens, [0.1 + 0.05 * math.log(t) for t in tokens])
    assert f.a == pytest.approx(0.1) and f.b == pytest.approx(0.05) and f.r2 == pytest.approx(1.0) and f.n == 4
    assert f.tokens_for(0.1 + 0.05 * math.log(4e6)) == pytest.approx(4e6)
    assert scaling.fit([1e5, 1e6], [0.3, 0.2]).tokens_for(0.5) is None  # a falling curve never gets there
    assert scaling.fit([1e5, 1e6, 2e6], [0.3, None, 0.4]).n == 2  # a missing value is left out
    with pytest.raises(ValueError, match="at least 2 points"):
        scaling.fit([1e5, 0], [0.3, 0.4])


def test_needed_joins_the_cost_model_and_the_curve():
    v = {1: 1.0, 2: 1.02, 5: 1.05, 9: 1.1}
    rows = [{"tokens": t, "val_agreement": 0.05 * math.log(t) - 0.3} for t in (1e5, 3e5, 1e6)]
    out = scaling.needed(rows, "val_agreement", 1.3, 0.05, v)
    alpha = scaling.alpha_for(1.3, 0.05, v)
    assert out["alpha_needed"] == alpha and 0 < alpha < 1
    assert out["tokens_needed"] == pytest.approx(math.exp((alpha + 0.3) / 0.05))
    assert out["times_the_data"] == pytest.approx(out["tokens_needed"] / 1e6)
    assert scaling.alpha_for(50.0, 0.05, v) is None  # more than K + 1 tokens per step: no acceptance suffices


def test_curves_figure_has_a_trace_per_curve_and_its_fit():
    rows = [{"tokens": t, "val_agreement": a} for t, a in ((1e5, 0.2), (5e5, 0.3), (1e6, 0.33))]
    fig = scaling.curves_figure({"sps": rows, "kangaroo": rows[:1]}, target=0.5)
    names = [t.name for t in fig.data]
    assert "sps" in names and "kangaroo" in names and any(n and n.startswith("sps: fit") for n in names)


def test_scaling_report_reads_every_card_format_and_the_bench(tmp_path, capsys):
    import json

    (tmp_path / "eagle").mkdir()
    (tmp_path / "sps").mkdir()
    (tmp_path / "eagle" / "card.json").write_text(json.dumps({"curve": [
        {"tokens_seen": t, "val_agreement": 0.1 + 0.05 * math.log2(t / 1e5)} for t in (1e5, 2e5, 4e5)]}))
    (tmp_path / "sps" / "card.json").write_text(json.dumps({"curve": [{"tokens": 1e5, "val_agreement": 0.2}]}))
    bench = {"verify_cost": {"1": 1.0, "2": 1.05, "5": 1.1, "9": 1.2},
             "methods": {"eagle:tree=chain": {"c": 0.05, "tau": 1.5, "alpha": 0.3, "speedup_vs_ar": 1.1}}}
    rep = scaling.scaling_report(tmp_path, bench, (1.3,))
    assert set(rep) == {"eagle"}  # sps: one curve point and no bench row
    t = rep["eagle"]["targets"][0]
    assert t["fit"]["b_per_doubling"] == pytest.approx(0.05) and t["alpha_needed"] is not None
    assert t["tokens_needed"] == pytest.approx(1e5 * 2 ** ((t["alpha_needed"] - 0.1) / 0.05), rel=1e-6)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench))
    with pytest.raises(SystemExit):  # no piece with a curve and a bench row: a clear usage error
        scaling.main(["--bench", str(path), "--pieces", str(tmp_path / "sps")])
    assert "no piece in" in capsys.readouterr().err
