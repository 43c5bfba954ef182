"""No stale number in the notebooks' prose: each measured number is tagged with its results file and agrees."""
import json
from pathlib import Path

import pytest

from dvi_lite.study import prose
from dvi_lite.study.reproduce import notebooks

NBS = notebooks()


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_no_stale_or_untagged_number_in_prose(nb: Path):
    problems = prose.check_notebook(nb)
    assert not problems, f"{nb.name}:\n" + "\n".join(map(str, problems))


def test_the_checker_catches_stale_untagged_and_misquoted_numbers(tmp_path: Path):
    (tmp_path / "x.json").write_text(json.dumps({"study": {"pld": {"speedup": 1.3349}}, "rows": [0.5, 0.25]}))
    ok = "PLD gains 1.33×<!--r x:study.pld.speedup--> and 25%<!--r x:rows.1--> of `0.7×` in code; K = 4."
    assert prose.check_markdown(ok, results_dir=tmp_path) == []
    stale = prose.check_markdown("PLD gains 1.40×<!--r x:study.pld.speedup-->", results_dir=tmp_path)
    assert len(stale) == 1 and "results say 1.33" in stale[0].why
    text = "a draft costs $c \\approx 0.3$ and runs 1.6× slower, about 7 ms"
    untagged = prose.check_markdown(text, results_dir=tmp_path)
    assert [p.text.split()[0] for p in untagged] == ["\\approx", "1.6×", "about"]
    assert prose.check_markdown("**1.68×**<!--paper kangaroo-->") == []
    assert len(prose.check_markdown("**1.70×**<!--paper kangaroo-->")) == 1
    (tmp_path / "y.json").write_text(json.dumps({"v": {"SmolLM2 · bfloat16": {"9": 1.2134}}}))
    assert prose.check_markdown("v(9) = 1.21<!--r y:v.SmolLM2 · bfloat16.9-->", results_dir=tmp_path) == []  # spaces
    assert len(prose.check_markdown("v(9) = 1.25<!--r y:v.SmolLM2 · bfloat16.9-->", results_dir=tmp_path)) == 1
    missing = prose.check_markdown("1.0×<!--r nope:a.b-->", results_dir=tmp_path)
    assert len(missing) == 1 and "FILE:KEY.PATH" in missing[0].why


def test_refresh_rewrites_tagged_numbers_from_results_at_the_decimals_written(tmp_path: Path):
    """make reproduce calls refresh_notebook after a full run, so the prose follows the new results."""
    (tmp_path / "x.json").write_text(json.dumps({"a": 1.2871, "rows": [0.5, 0.25]}))
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [
        "gains 1.33×<!--r x:a--> and 50%<!--r x:rows.1-->; the paper 1.68×<!--paper kangaroo-->, `2.0×`\n"]},
        {"cell_type": "code", "metadata": {}, "source": ["x = 1.33"], "outputs": [], "execution_count": None}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    changed = prose.refresh_notebook(path, results_dir=tmp_path)
    assert [new.split("<")[0] for _, new in changed] == ["1.29×", "25%"]
    src = "".join(json.loads(path.read_text())["cells"][0]["source"])
    assert src.startswith("gains 1.29×<!--r x:a--> and 25%<!--r x:rows.1-->; the paper 1.68×<!--paper kangaroo-->")
    assert prose.check_markdown(src, results_dir=tmp_path) == []
    assert prose.refresh_notebook(path, results_dir=tmp_path) == []  # idempotent


def test_a_stale_tag_planted_in_a_copy_of_a_notebook_fails_and_the_refresh_changes_nothing(tmp_path: Path):
    """The failure `make reproduce` once hit after an hour: a tag whose key the notebook no longer writes. The check
    names the notebook, the tag and the nearest keys; the refresh checks every tag first and writes no file."""
    src = next(nb for nb in NBS if nb.name.startswith("04_"))
    copy, other = tmp_path / src.name, tmp_path / "00_other.ipynb"
    nb = json.loads(src.read_text())
    stale = "<!--r 04_medusa:methods.medusa:tree=cartesian:branch=9:K=9.speedup_vs_ar-->"
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": [f"The best tree ran at 0.98×{stale}.\n"]})
    copy.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x.json").write_text(json.dumps({"a": 1.2871}))
    written = json.loads((prose.RESULTS / "04_medusa.json").read_text())
    written.setdefault("best_tree", {"speedup_vs_ar": 1.0})  # what the current code writes (the committed run may not)
    (tmp_path / "r" / "04_medusa.json").write_text(json.dumps(written))
    good = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["gains 1.33×<!--r x:a-->\n"]}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    other.write_text(json.dumps(good))
    before = {p: p.read_bytes() for p in (copy, other)}
    bad = prose.unresolved_tags([copy, other], [tmp_path / "r", prose.RESULTS])
    assert len(bad) == 1 and bad[0].startswith(f"{src.name} markdown cell {len(nb['cells']) - 1}:"), bad
    assert stale in bad[0] and "nearest keys: " in bad[0] and "medusa:tree=cartesian" in bad[0], bad[0]
    with pytest.raises(prose.StaleTags, match="branch=9"):
        prose.refresh_notebooks([other, copy], [tmp_path / "r", prose.RESULTS])
    assert {p: p.read_bytes() for p in (copy, other)} == before, "a failed refresh must not touch any notebook"


def test_tags_search_a_run_stage_before_the_committed_results(tmp_path: Path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(json.dumps({"a": 1.0, "b": 2.0}))
    (tmp_path / "stage" / "x.json").write_text(json.dumps({"a": 3.0}))
    dirs = [tmp_path / "stage", tmp_path / "results"]
    assert prose.lookup("x:a", dirs) == 3.0
    with pytest.raises(KeyError, match="nearest keys: a"):  # the staged file replaces the committed one whole
        prose.lookup("x:b", dirs)


def test_claim_tags_are_checked_against_results_and_a_false_or_undecided_one_fails(tmp_path: Path):
    """A comparison in prose carries a `c` tag; a false one fails, and "A beats B" written against the intervals
    fails when they overlap (undecided)."""
    (tmp_path / "x.json").write_text(json.dumps({"a": {"ci": [1.10, 1.30], "x": 1.2}, "b": {"ci": [0.95, 1.15],
                                                                                         "x": 1.05, "c": 0.5}}))
    ok = "A is faster<!--c x:a.x > x:b.x-->, B holds 1<!--c x:b.ci.0 <= 1 <= x:b.ci.1 and x:a.ci.0 > 1-->."
    assert prose.check_markdown(ok, results_dir=tmp_path) == []
    assert prose.check_markdown("twice<!--c x:a.x > 2 * x:b.c-->", results_dir=tmp_path) == []
    assert prose.check_markdown("<!--c x:a.x > 3 * x:b.c-->", results_dir=tmp_path)[0].why.startswith("claim false")
    undecided = prose.check_markdown("A beats B<!--c x:a.ci.0 > x:b.ci.1-->", results_dir=tmp_path)
    assert len(undecided) == 1 and "1.1 > x:b.ci.1 = 1.15" in undecided[0].why
    assert "FILE:KEY.PATH" in prose.check_markdown("<!--c nope:a > 1-->", results_dir=tmp_path)[0].why
    assert "expected A < B" in prose.check_markdown("<!--c x:a.x-->", results_dir=tmp_path)[0].why


def test_comparison_sentences_without_a_claim_tag_are_listed():
    text = ("## Faster targets\n\nPLD is faster than AR<!--c idea-->. EAGLE beats Medusa here. "
            "The draft costs `faster` nothing.")
    assert prose.untagged_claims(text) == ["EAGLE beats Medusa here."]


@pytest.mark.parametrize("stem", prose.CLAIMED)
def test_every_comparison_in_a_claimed_notebook_is_tagged(stem: str):
    nb = json.loads((Path("notebooks") / f"{stem}.ipynb").read_text())
    loose = [(i, s) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
             for s in prose.untagged_claims("".join(c["source"]))]
    assert not loose, "\n".join(f"cell {i}: {s}" for i, s in loose)


def test_a_key_holding_dots_is_found_by_the_longest_match(tmp_path: Path):
    (tmp_path / "x.json").write_text(json.dumps({"study": {"T=1.0": {"sps": [1.0, 1.25]}, "T": {"x": 2.0}}}))
    assert prose.lookup("x:study.T=1.0.sps.1", tmp_path) == 1.25
    assert prose.lookup("x:study.T.x", tmp_path) == 2.0


def test_an_output_with_no_discussion_after_it_is_found(tmp_path: Path):
    fig = {"cell_type": "code", "source": "fig.show()", "outputs": [{"output_type": "display_data",
                                                                       "data": {"image/png": "..."}}]}
    quiet = {"cell_type": "code", "source": "x = 1", "outputs": []}
    md = {"cell_type": "markdown", "source": "**What the output shows.** ..."}
    head = {"cell_type": "markdown", "source": "## Next section"}
    (tmp_path / "n.ipynb").write_text(json.dumps({"cells": [fig, md, fig, head, quiet, fig]}))
    assert prose.undiscussed(tmp_path / "n.ipynb") == [2, 5]


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_every_figure_table_and_token_view_is_discussed(nb: Path):
    assert prose.undiscussed(nb) == [], f"{nb.name}: code cells with output and no discussion cell after them"


def test_a_claim_can_name_its_file_once(tmp_path: Path):
    (tmp_path / "x.json").write_text(json.dumps({"a": 2.0, "b": 1.0}))
    (tmp_path / "y.json").write_text(json.dumps({"c": 3.0}))
    assert prose.check_claim("x: a > b and a >= 2 * b and a < y:c", tmp_path) is None
    assert "claim false" in prose.check_claim("x: b > a", tmp_path)
