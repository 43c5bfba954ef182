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
