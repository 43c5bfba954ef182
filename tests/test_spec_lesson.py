"""dvi_lite.course.ch01_speculative_sampling (notebook 01): exact and simulated losslessness, formulas, K sweeps.

Uses the tiny random Llamas of conftest.py (target, draft, tok, prompts); never the course model.
"""
from __future__ import annotations

import pytest
import torch
from helpers import ALPHA

from dvi_lite.core.registry import METHODS
from dvi_lite.course import ch01_speculative_sampling as sl


def test_exact_law_is_p():
    for seed in range(5):
        p, q = sl.toy_pair(v=8, seed=seed)
        assert torch.allclose(sl.exact_output_law(p, q), p, atol=1e-6, rtol=0)


def test_alpha_is_one_minus_tv():
    p, q = sl.toy_pair(v=16, seed=3)
    assert sl.alpha_of(p, q) == pytest.approx(1 - sl.tv(p, q), abs=1e-12)
    assert 0.2 < sl.alpha_of(p, q) < 0.95  # the toy pair is neither trivial nor disjoint
    assert sl.alpha_of(p, p) == pytest.approx(1.0)


def test_simulated_law_matches_p():
    p, q = sl.toy_pair(v=8, seed=0)
    counts = sl.first_emitted_counts(p, q, 20000, seed=0)
    assert int(counts.sum()) == 20000
    assert sl.chi_square(counts, p)["pvalue"] > ALPHA
    assert torch.allclose(sl.simulate_output_law(p, q, 2000, seed=1).sum(), torch.tensor(1.0, dtype=torch.float64))


def test_chi_square_catches_the_draft_law():
    """Control: emitting the draft x without verification follows q, and the test must see it."""
    p, q = sl.toy_pair(v=8, seed=0)
    gen = torch.Generator().manual_seed(0)
    biased = torch.multinomial(q, 20000, replacement=True, generator=gen).bincount(minlength=8)
    assert sl.chi_square(biased, p)["pvalue"] < 1e-6


def test_chi_square_with_nothing_testable_fails_instead_of_passing():
    """One bin left after pooling (a point-mass law, or too few draws): the result says nothing was testable and
    its NaN p-value fails both readings ("consistent with p" and "rejected"); it used to be p = 1, a pass.
    Notebook 01's check_invariants stops on it."""
    import math

    for counts, probs in ((torch.tensor([0, 40, 0, 0]), torch.tensor([0.0, 1.0, 0.0, 0.0])),
                          (torch.tensor([2, 1, 0, 1]), torch.full((4,), 0.25))):
        res = sl.chi_square(counts, probs)
        assert res["testable"] is False and "nothing testable" in res["note"] and math.isnan(res["pvalue"]), res
        assert not res["pvalue"] > sl.P_MIN and not res["pvalue"] < sl.P_MIN
    ok = sl.chi_square(torch.tensor([500, 500, 0, 0]), torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert ok["testable"] is True
    hists = {"T=1": {"spec_vs_p": res, "target_vs_p": ok, "alpha": 0.5}}
    with pytest.raises(AssertionError, match="nothing to test"):
        sl.check_invariants(0.0, ok, {**ok, "pvalue": 0.0}, hists, [], [], [], {}, {"rows": []})


def test_chi_square_pools_rare_bins_and_flags_impossible_tokens():
    probs = torch.tensor([0.5, 0.4999, 0.0001, 0.0])
    ok = sl.chi_square(torch.tensor([500, 500, 0, 0]), probs)
    assert ok["bins"] == 2 and ok["pvalue"] > 0.9
    bad = sl.chi_square(torch.tensor([500, 499, 0, 1]), probs)  # a token with p = 0 was emitted
    assert bad["pvalue"] == 0.0


def test_expected_tokens_hand_values():
    assert sl.expected_tokens(0.0, 4) == 1.0
    assert sl.expected_tokens(1.0, 4) == 5.0
    assert sl.expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert sl.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert sl.expected_tokens(0.8, 2) == pytest.approx(1 + 0.8 + 0.64)
    curve = sl.formula_curve(0.8, 0.2, [1, 2, 3])
    assert curve["speedup"][0] == pytest.approx(1.8 / 1.2)
    priced = sl.formula_curve(0.8, 0.2, [1, 2, 3], v={1: 1.0, 2: 1.1, 3: 1.2, 5: 1.3})  # the measured v(K+1)
    assert priced["speedup"][0] == pytest.approx(1.8 / (1.1 + 0.2))
    assert priced["speedup"][1] == pytest.approx((1 + 0.8 + 0.64) / (1.2 + 0.4))


def test_position_stats():
    log = [(3, 0), (3, 3), (3, 1), (2, 2)]  # (drafted, accepted)
    pos = sl.position_stats(log, 3)
    assert pos["alpha_hat"] == pytest.approx(6 / (6 + 2))
    assert pos["survival"] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert pos["conditional"] == pytest.approx([3 / 4, 2 / 3, 1 / 1])


def test_token_histograms_lossless(target, draft, tok, prompts):
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        h = sl.token_histograms(target, tok, prompts[0], n_samples=20000, temperature=temperature, top_p=top_p,
                                draft_model=draft, seed=0, n_show=10)
        assert h["spec_vs_p"]["pvalue"] > ALPHA, h["spec_vs_p"]
        assert h["target_vs_p"]["pvalue"] > ALPHA
        assert 0.0 < h["alpha"] < 1.0
        shown = min(10, h["support_p"])  # top-p can leave fewer than 10 tokens with p > 0
        assert len(h["rows"]) == shown + 1 and h["rows"][-1]["token"] == -1
        assert sum(r["spec"] for r in h["rows"]) == pytest.approx(1.0)
        if top_p < 1.0:  # the nucleus is smaller than the vocabulary; tokens outside it never come out
            assert h["support_p"] < 64


def test_measure_alpha_greedy_and_sampled(target, draft, tok, prompts):
    g = sl.measure_alpha(target, draft, tok, prompts[:3], temperature=0.0, max_new_tokens=6)
    assert g["positions"] == 18 and 0.0 <= g["alpha"] <= 1.0
    s = sl.measure_alpha(target, draft, tok, prompts[:3], temperature=1.0, max_new_tokens=6)
    assert 0.0 < s["alpha"] < 1.0
    assert sl.measure_alpha(target, target, tok, prompts[:2], temperature=1.0, max_new_tokens=4)["alpha"] == \
        pytest.approx(1.0, abs=1e-5)


def test_k_sweep_rows(target, draft, tok, prompts):
    before = set(METHODS)
    rows = sl.k_sweep(target, tok, prompts[:2], [1, 3], max_new_tokens=8, repeats=1, temperature=1.0,
                      draft_model=draft)
    assert set(METHODS) == before  # the sweep's variants are bench labels ("sps:K=3"), never new methods
    assert [r["K"] for r in rows] == [1, 3]
    keys = {"K", "alpha", "alpha_hat", "tau", "expected_tokens", "tokens_per_s", "speedup_vs_ar", "c",
            "predicted_speedup", "measured_over_predicted", "position_acceptance", "position_survival", "v"}
    for r in rows:
        assert keys <= set(r)
        assert len(r["position_acceptance"]) == r["K"]
        assert 1.0 <= r["tau"] <= r["K"] + 1
    assert rows[0]["alpha"] == pytest.approx(rows[0]["alpha_hat"])  # K = 1: the two estimates agree
    assert rows[0]["v"] == rows[1]["v"] and rows[0]["v"][1] == pytest.approx(1.0)  # one table, v(1) = 1


def test_parity_table_fp32_exact(target, tok, prompts):
    t = sl.parity_table(target, tok, prompts[:2], new_tokens=6, K=2, dtypes=("float32",))
    assert t["rows"][0]["dtype"] == "float32" and t["rows"][0]["positions"] == 12
    assert t["rows"][0]["mismatches"] == 0


def test_parity_study_reports_near_ties(target, tok, prompts):
    """Counts, near-ties in bf16 steps and the invariants; prompts may be records, ids or raw text."""
    from dvi_lite.course import ch01_parity as cp

    recs = [{"prompt": prompts[0]}, prompts[1], "abc"]
    st = cp.parity_study(target, tok, recs, dtypes=("float32", "bfloat16"), new_tokens=5, K=2, max_examples=3)
    assert [r["dtype"] for r in st["rows"]] == ["float32", "bfloat16"]
    for r in st["rows"]:
        name = r["dtype"]
        assert r["positions"] == 15 and len(st["gap_steps"][name]) == 15
        assert len(st["flip_steps"][name]) == r["mismatches"]
        assert r["nearest_gap_steps"] == min(st["gap_steps"][name])
        assert [t["below_steps"] for t in st["ties"][name]] == list(cp.TIE_STEPS)
    assert st["rows"][0]["mismatches"] == 0
    near = [e for e in st["nearest"] if e["dtype"] == "float32"]
    assert len(near) == 3 and near == sorted(near, key=lambda e: e["gap"])
    e = near[0]
    assert e["decode_gap"] == pytest.approx(e["gap"]) and e["gap_steps"] == pytest.approx(e["gap"] / e["bf16_step"])
    assert len(e["tokens"]) == 2
    assert "0 flips in fp32" in cp.check_invariants(st)[0]
    bad = {**st, "rows": [{**st["rows"][0], "mismatches": 1}, st["rows"][1]],
           "flip_steps": {**st["flip_steps"], "float32": [0.1]}}
    with pytest.raises(AssertionError, match="fp32 verify flipped 1"):
        cp.check_invariants(bad)


def test_bf16_step_and_tie_profile():
    from dvi_lite.course import ch01_parity as cp

    assert cp.bf16_step(1.0) == 2 ** -7 and cp.bf16_step(-3.0) == 2 ** -6 and cp.bf16_step(0.0) == 0.0
    rep = cp.ParityReport("bfloat16", positions=4, mismatches=1, gap_steps=[0.2, 1.5, 3.0, 40.0], flip_steps=[1.5])
    prof = cp.tie_profile(rep, steps=(1, 2, 100))
    assert prof == [{"below_steps": 1, "positions": 1, "flips": 0}, {"below_steps": 2, "positions": 2, "flips": 1},
                    {"below_steps": 100, "positions": 4, "flips": 1}]
