"""The verify-cost model: v(n) calibration (shapes and sanity only, never speed) and the predicted speedup."""
from __future__ import annotations

import math

import pytest
import torch

from dvi_lite.measure.cost import (
    calibrate,
    forward_times,
    interleaved_times,
    memory_bandwidth,
    predicted_speedup,
    v_of,
    verify_cost,
    weight_bytes,
)


def test_calibration_on_a_tiny_model(target):
    v = verify_cost(target, ns=(2, 5, 9), context=20, repeats=3)
    assert list(v) == [1, 2, 5, 9] and v[1] == 1.0
    assert all(math.isfinite(x) and x > 0 for x in v.values())
    t = forward_times(target, ns=(1, 3), context=0, repeats=2)
    assert set(t) == {1, 3} and all(x > 0 for x in t.values())


def test_interleaved_times_rotates_and_resets():
    """Every case is called once per round, the first case of a round moves by one, and reset follows each call;
    the warm-up rounds are called but not kept."""
    calls: list[str] = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = interleaved_times(cases, repeats=3, device=torch.device("cpu"), reset=lambda: calls.append("|"), warmup=1)
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert "".join(calls).replace("|", "") == "abc" "bca" "cab" "abc"
    assert calls[1::2] == ["|"] * 12


def test_grad_mode_times_shape(target):
    from dvi_lite.study.runtimes import grad_mode_times

    out = grad_mode_times(target, context=8, repeats=2)
    for row in out.values():
        assert set(row) == {"no_grad_ms", "inference_mode_ms", "saved_ms", "context", "repeats"}
        assert math.isfinite(row["saved_ms"])


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


def test_predicted_speedup_for_a_tree():
    """A tree verifies all its nodes in one forward (v(nodes + 1)) but drafts only its depth (K c)."""
    v = {1: 1.0, 5: 1.2, 9: 1.6}
    assert predicted_speedup(3.0, 4, 0.1, v, nodes=8) == pytest.approx(3.0 / (1.6 + 0.4))
    assert predicted_speedup(3.0, 4, 0.1, v, nodes=4) == predicted_speedup(3.0, 4, 0.1, v)
    with pytest.raises(ValueError, match="nodes"):
        predicted_speedup(3.0, 4, 0.1, v, nodes=-1)


def test_calibrate_at_the_prompts_length(target):
    """The bench's calibration: v(1) == 1, at the prompts' mean length + half the new tokens, within positions."""
    from conftest import IdTokenizer

    v, ctx = calibrate(target, IdTokenizer(), [{"prompt": [1] * 10}, {"prompt": [2] * 20}], 8, repeats=1)
    assert ctx == 15 + 4 and v[1] == 1.0 and len(v) > 1
    _, ctx = calibrate(target, IdTokenizer(), [{"prompt": [1] * 120}], 64, repeats=1)
    assert ctx == 128 - 17  # clamped: the largest n still fits the model's 128 positions


def test_weight_bytes(target):
    """Every parameter once; tied embeddings are the LM head (read every forward), an untied input embedding
    is only looked up (a few rows), so it does not count."""
    from conftest import tiny_cfg
    from transformers import LlamaForCausalLM

    assert weight_bytes(target) == sum(p.numel() * p.element_size() for p in target.parameters())
    cfg = tiny_cfg()
    cfg.tie_word_embeddings = False
    untied = LlamaForCausalLM(cfg)
    assert untied.get_input_embeddings().weight is not untied.get_output_embeddings().weight
    emb = untied.get_input_embeddings().weight
    fp32 = weight_bytes(untied)
    assert fp32 == sum(p.numel() * 4 for p in untied.parameters()) - emb.numel() * 4
    assert weight_bytes(untied.to(torch.bfloat16)) == fp32 // 2  # (.to is in place)


def test_memory_bandwidth():
    bw = memory_bandwidth(mb=8, repeats=2)
    assert bw["copy_GBps"] > 0 and bw["read_GBps"] > 0 and bw["buffer_mib"] == 8
    with pytest.raises(ValueError, match="mb"):
        memory_bandwidth(mb=0)


def test_gemv_rates_and_compute_peak_measure_something():
    """Shapes and signs only (the numbers are the machine's): a rate per size, all positive; bad sizes refused."""
    from dvi_lite.measure.cost import compute_peak, gemv_rates

    rates = gemv_rates((0.25, 1), repeats=2)
    assert set(rates) == {0.25, 1} and all(r > 0 for r in rates.values())
    assert compute_peak(64, repeats=2) > 0
    with pytest.raises(ValueError, match="matrix size"):
        gemv_rates((0,))
