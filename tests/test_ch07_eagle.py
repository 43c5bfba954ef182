"""Chapter 07's helpers (course/ch07_eagle.py): the draft table and the curve read the committed cards, and the
tree view records the one loop's own steps (their tokens are AR's: greedy, fp32, lossless)."""
from __future__ import annotations

import json

import pytest

import dvi_lite
from dvi_lite.course import ch07_eagle as ch
from dvi_lite.methods.eagle.head import EagleHead, HeadConfig
from dvi_lite.paths import DATA_DIR


def test_draft_sources_read_every_committed_card():
    rows = ch.draft_sources()
    assert [r["method"] for r in rows] == list(ch.SOURCES)
    for r in rows:
        assert 0.0 < r["first-token agreement"] < 1.0 and r["tokens seen"] > 0 and r["trained on"]


def test_the_curve_joins_tau_where_it_was_decoded():
    card = json.loads((DATA_DIR / "smollm2" / "eagle" / "card.json").read_text())
    first = card["curve"][0]["tokens_seen"]
    rows = ch.curve_rows(card, {"rows": [{"tokens": first, "tau": 1.5, "alpha": 0.3, "first_acceptance": 0.4}]})
    assert len(rows) == len(card["curve"]) and rows[0]["tau"] == 1.5 and rows[-1]["tau"] is None
    assert all(len(r["steps"]) >= 1 for r in rows)
    fig = ch.curve_figure(rows)
    assert len(fig.data) == len(rows[0]["steps"]) + 1


def test_headline_rows_come_from_the_bench_file():
    bench = {"methods": {"ar": {}, "eagle": {"speedup_vs_ar": 1.4, "speedup_interval": [1.2, 1.6], "tau": 2.3}}}
    (row,) = ch.headline(bench)
    assert row["method"] == "eagle" and row["90% interval"] == [1.2, 1.6] and row["τ"] == 2.3


def test_ablation_rows_name_each_arm_and_its_reference():
    from dvi_lite.measure.provenance import RESULTS_DIR

    res = json.loads((RESULTS_DIR / f"{ch.ABLATION}.json").read_text())
    rows = ch.ablation_rows(res)
    assert [r["arm"] for r in rows] == list(res["arms"])
    by = {r["arm"]: r for r in rows}
    assert by["static_tree"]["against"] == "full" and by["no_ttt"]["against"] == "full_small"
    assert all(len(r["interval"]) == 2 and r["tau"] >= 1 for r in rows)
    fig = ch.ablation_figure(rows)
    assert [t.type for t in fig.data] == ["bar", "scatter"] and list(fig.data[0].x) == list(res["arms"])


@pytest.mark.slow
def test_tree_steps_rebuild_the_ar_answer_and_render():
    model, tok = dvi_lite.load_model("course", dtype="float32")
    head = EagleHead(model, HeadConfig(vocab=None)).eval()  # initialised from the target: lossless anyway
    prompt = "def fibonacci(n):"
    steps = ch.tree_steps(model, tok, prompt, max_new_tokens=20, head=head, tree="dynamic")
    ref = dvi_lite.generate(model, tok, prompt, method="ar", max_new_tokens=20).token_ids
    first = ref[0]  # the prefill's token; every step then adds its accepted path and the target's token
    got = [first] + [t for s in steps for t in [s["tokens"][i] for i in s["path"]] + [s["next_token"]]]
    assert got[: len(ref)] == ref
    assert any(s["parents"].count(-1) > 1 for s in steps)  # a tree: several children of the pending token
    page = ch.tree_html(tok, steps[0])
    assert page.count("<li>") == len(steps[0]["tokens"]) + 1 and "(target)" in page


def test_tree_stats_and_rebuilt_read_the_recorded_steps():
    steps = [{"tokens": [5, 6, 7], "parents": [-1, 0, -1], "path": [0, 1], "next_token": 8},
             {"tokens": [9], "parents": [-1], "path": [], "next_token": 4}]
    st = ch.tree_stats(steps)
    assert st["tau"] == (2 + 2) / 2 and st["mean_nodes"] == 2 and st["busiest"] == 0
    assert ch.rebuilt(steps, 3) == [3, 5, 6, 8, 4]


def test_ttt_on_text_with_the_course_models_committed_head():
    model, tok = dvi_lite.load_model("course", dtype="float32")
    head, what = ch.head_for(model)
    assert what == "committed head (eagle/head.pt)" and isinstance(head, EagleHead)
    out = ch.ttt_on_text(model, head, list(range(1, 25)), steps=3)
    assert out["loss"] > 0 and [s["step"] for s in out["steps"]] == [0, 1, 2]
    assert [s["n"] for s in out["steps"]] == [23, 22, 21] and all(0 <= s["agreement"] <= 1 for s in out["steps"])


def test_a_model_without_a_head_gets_an_untrained_one(target, tmp_path, monkeypatch):
    monkeypatch.setenv("DVI_MODELS_DIR", str(tmp_path))  # no head prepared for the tiny target
    head, what = ch.head_for(target)
    assert "untrained" in what and isinstance(head, EagleHead) and not head.training


def test_check_invariants_stops_on_a_path_that_leaves_its_tree():
    from types import SimpleNamespace

    steps = [{"tokens": [5, 6], "parents": [-1, -1], "path": [0, 1], "next_token": 8}]  # 1 is not 0's child
    result = SimpleNamespace(token_ids=[3, 5, 6, 8])
    with pytest.raises(AssertionError, match="does not follow the parent links"):
        ch.check_invariants(steps, result, [3, 5, 6, 8], True, 3, 1, {"loss": 1.0, "steps": []}, {}, [], {})
