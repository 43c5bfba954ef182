"""The fidelity table (study.fidelity): statuses computed by each claim's rule on small hand-made results, and the
table over the committed results/*.json. JSON only: no model, no timing (the fake numbers are given, and every
check is an equality)."""
from pathlib import Path

import pytest

from dvi_lite.study import fidelity
from dvi_lite.study.fidelity import NO, NOT_MEASURED, PARTIAL, STATUSES, YES

ROOT = Path(__file__).resolve().parent.parent


def _claim(method: str, words: str) -> fidelity.Claim:
    (c,) = [c for c in fidelity.CLAIMS if c.method == method and words in c.claim]
    return c


def _status(claim: fidelity.Claim, results: dict) -> tuple[str, str]:
    (row,) = fidelity.fidelity_table(results, [claim])
    return row["status"], row["ours"]


def _ci(mean: float, lo: float, hi: float, n: int = 3) -> dict:
    return {"n": n, "mean": mean, "sd": 0.01, "ci95": [lo, hi]}


def test_lookup_walks_dotted_keys_lists_and_names_what_is_missing():
    res = {"f": {"hist": {"T=1.0, top_p=1.0": {"alpha": 0.7}}, "rows": [{"a": 1}, {"a": 2}],
                 "sweep": {"kangaroo:threshold=0.6": {"tau": 1.5}}, "none": None}}
    assert fidelity.lookup(res, "f:hist.T=1.0, top_p=1.0.alpha") == 0.7
    assert fidelity.lookup(res, "f:rows.1.a") == 2
    assert fidelity.lookup(res, "f:sweep.kangaroo:threshold=0.6.tau") == 1.5
    for ref, msg in [("g:x", "results/g.json missing"), ("f:rows.5.a", "has no rows.5.a"),
                     ("f:hist.T=2.0", "has no hist.T=2.0"), ("f:none", "is null")]:
        with pytest.raises(fidelity.NotMeasured, match=msg):
            fidelity.lookup(res, ref)


def test_combine_mixes_sources_and_skips_the_unmeasured():
    assert fidelity.combine([(YES, "a"), (YES, "b")])[0] == YES
    assert fidelity.combine([(NO, "a"), (NOT_MEASURED, "b")]) == (NO, "a; b")
    assert fidelity.combine([(YES, "a"), (NO, "b")])[0] == PARTIAL
    assert fidelity.combine([(NOT_MEASURED, "a")])[0] == NOT_MEASURED


def test_kangaroo_adapter_against_plain_early_exit():
    claim = _claim("Kangaroo", "adapter")

    def res(adapter: float) -> dict:
        rows = [{"k": 1, "naive": 0.1, "adapter": 0.9}, {"k": 2, "naive": 0.3, "adapter": adapter},
                {"k": 3, "naive": 0.4}]
        return {"02_kangaroo": {"settings": {"split": 2}, "agreement": rows}}
    assert _status(claim, res(0.4))[0] == YES
    assert _status(claim, res(0.2))[0] == NO  # the exit layer's row decides, not k=1's
    status, ours = _status(claim, {})
    assert status == NOT_MEASURED and "results/02_kangaroo.json missing" in ours


def test_draft_verify_bo_against_random_over_seeds():
    claim = _claim("Draft & Verify", "Bayesian")

    def seeds(d: dict) -> dict:
        return {"41_draft_verify_seeds": {"summary": {"heldout_speedup": {"bo_minus_random": d}},
                                          "bo_separates_from_random_heldout": d["ci95"][0] > 0}}
    assert _status(claim, seeds(_ci(0.05, 0.01, 0.09)))[0] == YES
    assert _status(claim, seeds(_ci(-0.05, -0.09, -0.01)))[0] == NO
    assert _status(claim, seeds(_ci(0.02, -0.01, 0.05)))[0] == PARTIAL  # the interval straddles 0
    assert _status(claim, seeds(_ci(-0.02, -0.05, 0.01)))[0] == NO

    assert _status(claim, {})[0] == NOT_MEASURED


def test_draft_verify_gamma_tracks_its_targets():
    claim = _claim("Draft & Verify", "γ")

    def res(accs: dict[float, list[float | None]]) -> dict:
        return {"41_draft_verify_gamma": {"runs": [
            {"target_alpha": t, "windows": [{"step": 50 + 100 * i, "acceptance": a, "gamma": 0.8}
                                            for i, a in enumerate(xs)]} for t, xs in accs.items()]}}
    # the mean of the last 3 windows: 0.52, 0.68, 0.88 (a window without drafts is skipped)
    tracking = {0.9: [0.2, 0.9, 0.86, 0.88], 0.5: [0.9, 0.5, 0.54, None], 0.7: [0.1, 0.7, 0.66, 0.68]}
    assert _status(claim, res(tracking))[0] == YES
    assert _status(claim, res({0.5: [0.30, 0.30], 0.7: [0.40, 0.40], 0.9: [0.50, 0.50]}))[0] == PARTIAL  # ordered only
    assert _status(claim, res({0.5: [0.49, 0.49], 0.7: [0.49, 0.49], 0.9: [0.49, 0.49]}))[0] == NO  # no movement
    status, ours = _status(claim, {"03_draft_verify": {}})
    assert status == NOT_MEASURED and "41_draft_verify_gamma.json missing" in ours


def test_dvi_against_kl_only_by_the_paired_interval():
    claim = _claim("DVI", "KL-only")

    def res(d: dict) -> dict:
        return {"41_dvi_ablation": {"metric": "agree", "paired_vs_dvi": {"kl": {"agree": d}},
                                    "ranking": ["dvi", "kl", "rl"], "runs": {"dvi": {}, "kl": {}, "rl": {}}}}
    assert _status(claim, res(_ci(-0.05, -0.08, -0.02)))[0] == YES  # KL-only minus DVI below 0: DVI ahead
    status, ours = _status(claim, res(_ci(0.07, 0.03, 0.12)))
    assert status == NO and "+0.070" in ours
    assert _status(claim, res(_ci(-0.01, -0.04, 0.02)))[0] == PARTIAL
    assert _status(claim, {"41_dvi_ablation": {"metric": "agree", "runs": {}}})[0] == NOT_MEASURED


def test_eagle_ablation_claims_are_not_measured_until_their_file_exists():
    claim = _claim("EAGLE", "training-time test")
    status, ours = _status(claim, {"08_results": {}})
    assert status == NOT_MEASURED and "results/41_eagle_ablation.json missing" in ours
    assert "41_eagle_ablation:arms.no_ttt.tau" in claim.keys
    # the training arms compare with a head trained on the same tokens (full_small), the tree arm with the committed
    arms = {"full": {"tau": 2.0}, "full_small": {"tau": 2.5}, "no_ttt": {"tau": 2.1}, "top_layer": {"tau": 2.6}}
    assert _status(claim, {"41_eagle_ablation": {"arms": arms}})[0] == YES
    assert _status(_claim("EAGLE", "fusing"), {"41_eagle_ablation": {"arms": arms}})[0] == NO
    status, ours = _status(_claim("EAGLE", "static tree"), {"41_eagle_ablation": {"arms": arms}})
    assert status == NOT_MEASURED and "arms.static_tree.tau" in ours
    arms = {"full": {"tau": 2.5}, "static_tree": {"tau": 2.2}}  # the tree arm alone: the others stay unmeasured
    assert _status(_claim("EAGLE", "static tree"), {"41_eagle_ablation": {"arms": arms}})[0] == YES
    assert _status(claim, {"41_eagle_ablation": {"arms": arms}})[0] == NOT_MEASURED


def test_a_source_missing_leaves_the_others_to_decide():
    claim = _claim("EAGLE", "Medusa")
    res = {"08_results": {"methods": {"eagle": {"tau": 2.4}, "medusa": {"tau": 1.6}}}}
    status, ours = _status(claim, res)
    assert status == YES and "27_drafts: not measured" in ours


def test_format_table_is_markdown_with_a_row_per_claim():
    rows = fidelity.fidelity_table({})
    text = fidelity.format_table(rows).splitlines()
    assert len(text) == 2 + len(rows) and text[0].startswith("| method | claim |")
    assert all(r["status"] == NOT_MEASURED for r in rows)
    assert fidelity.format_table([{**rows[0], "ours": "a | b"}]).count("a \\| b") == 1


def test_fidelity_table_on_the_committed_results():
    rows = fidelity.fidelity_table(fidelity.load_results(ROOT / "results"))
    assert len(rows) >= 14
    for r in rows:
        assert r["status"] in STATUSES, r
        assert r["keys"] and all(":" in k for k in r["keys"]), r
        assert r["paper"] and r["rule"] and r["ours"], r
        assert "unreadable" not in r["ours"], r  # every key path the rules read matches the committed files' shape


def test_every_key_of_a_committed_file_resolves():
    results = fidelity.load_results(ROOT / "results")
    for c in fidelity.CLAIMS:
        for key in c.keys:
            if key.partition(":")[0] in results:
                try:
                    fidelity.lookup(results, key)  # raises NotMeasured, naming the key, if the file lacks it
                except fidelity.NotMeasured as e:  # a planned arm not run yet is written as null; a missing key is not
                    assert "is null" in str(e), e


def test_dvi_against_kl_only_reads_the_reference_arm_when_it_was_run():
    """With 41_dvi_ablation's reference arm (the reference trainer's default objective), KL-only is compared with it,
    paired by seed; the older file is not read."""
    claim = _claim("DVI", "KL-only")

    def run(agree: float) -> dict:
        return {"final": {"agree": agree}}
    res = {"41_dvi_ablation": {"metric": "agree", "ranking": ["reference", "kl", "dvi"],
                               "runs": {"reference": {"0": run(0.20), "1": run(0.22), "2": run(0.21)},
                                        "kl": {"0": run(0.15), "1": run(0.16), "2": run(0.155)}}}}
    status, ours = _status(claim, res)
    assert status == YES and "reference's default objective" in ours and "3 seeds" in ours
    res["41_dvi_ablation"]["runs"]["kl"] = {"0": run(0.25), "1": run(0.27), "2": run(0.26)}
    assert _status(claim, res)[0] == NO
    # agreement favours the reference arm, held-out τ favours KL-only: partial, both named
    for s, (ref_tau, kl_tau) in {"0": (1.16, 1.20), "1": (1.17, 1.19), "2": (1.165, 1.21)}.items():
        res["41_dvi_ablation"]["runs"]["reference"][s]["heldout_bench"] = {"tau": ref_tau}
        res["41_dvi_ablation"]["runs"]["kl"][s] = {**run(0.15), "heldout_bench": {"tau": kl_tau}}
    status, ours = _status(claim, res)
    assert status == PARTIAL and "held-out τ" in ours and "held-out agree" in ours
