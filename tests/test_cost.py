"""The verify-cost model: v(n) calibration (shapes and sanity only, never speed) and the predicted speedup."""
from __future__ import annotations

import math

import pytest

from dvi_lite.study.cost import forward_times, predicted_speedup, v_of, verify_cost


def test_calibration_on_a_tiny_model(target):
    v = verify_cost(target, ns=(2, 5, 9), context=20, repeats=3)
    assert list(v) == [1, 2, 5, 9] and v[1] == 1.0
    assert all(math.isfinite(x) and x > 0 for x in v.values())
    t = forward_times(target, ns=(1, 3), context=0, repeats=2)
    assert set(t) == {1, 3} and all(x > 0 for x in t.values())


def test_calibration_leaves_no_trace(target):
    """The same model decodes the same tokens after a calibration (the cache is its own, cropped back)."""
    from conftest import IdTokenizer

    import dvi_lite

    before = dvi_lite.generate(target, IdTokenizer(), [1, 2, 3], max_new_tokens=8).token_ids
    verify_cost(target, ns=(4,), context=10, repeats=1)
    assert dvi_lite.generate(target, IdTokenizer(), [1, 2, 3], max_new_tokens=8).token_ids == before


def test_calibration_bad_input(target):
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        verify_cost(target, ns=(17,), context=120)
    with pytest.raises(ValueError, match="n \\(new tokens per forward\\)"):
        verify_cost(target, ns=(0,))
    with pytest.raises(ValueError, match="repeats"):
        verify_cost(target, repeats=0)


def test_v_of_interpolates():
    table = {1: 1.0, 5: 1.4, 9: 2.2}
    assert v_of(table, 1) == 1.0 and v_of(table, 5) == pytest.approx(1.4)
    assert v_of(table, 3) == pytest.approx(1.2) and v_of(table, 7) == pytest.approx(1.8)
    assert v_of(table, 13) == pytest.approx(3.0)  # extended along the last segment
    assert v_of({"1": 1.0, "9": 1.08}, 5) == pytest.approx(1.04)  # keys read back from JSON
    assert v_of({1: 1.0}, 4) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="empty"):
        v_of({}, 2)
    with pytest.raises(ValueError, match="n \\(tokens per forward\\)"):
        v_of(table, 0)


def test_predicted_speedup_formula():
    v = {1: 1.0, 5: 1.2, 9: 1.08 * 1.5}
    assert predicted_speedup(3.0, 4, 0.1, v) == pytest.approx(3.0 / (1.2 + 0.4))
    assert predicted_speedup(1.0, 0, 0.0, v) == 1.0  # AR: one token per 1-token forward
    assert predicted_speedup(2.0, 4, 0.0, lambda n: n) == pytest.approx(2.0 / 5)  # compute bound: no gain
    assert predicted_speedup(5.0, 8, 0.0, v) == pytest.approx(5.0 / (1.08 * 1.5))  # memory bound
    with pytest.raises(ValueError, match="tau"):
        predicted_speedup(0.5, 4, 0.1, v)
    with pytest.raises(ValueError, match="c \\(draft cost"):
        predicted_speedup(2.0, 4, -1, v)
