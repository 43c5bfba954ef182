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
