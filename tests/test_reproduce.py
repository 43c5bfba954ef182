"""`make reproduce` puts a run's notebooks, results and figures in place together, only after every notebook ran and
every prose tag resolves; a failed step changes nothing, and a stopped run resumes (a torn progress file is redone)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dvi_lite.study import reproduce


def _notebook(markdown: str, code: str = "x = 1") -> dict:
    return {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [markdown]},
                      {"cell_type": "code", "metadata": {}, "source": [code], "outputs": [], "execution_count": 1}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository in miniature: one notebook with a tag, its executed copy, a stage with the run's results."""
    for name, value in (("ROOT", tmp_path), ("NOTEBOOKS_DIR", tmp_path / "notebooks"),
                        ("OUT_DIR", tmp_path / "build" / "notebooks"), ("RUN_DIR", tmp_path / "build" / "reproduce"),
                        ("PROGRESS", tmp_path / "build" / "reproduce" / "progress.json"),
                        ("STAGE", tmp_path / "build" / "reproduce" / "stage")):
        monkeypatch.setattr(reproduce, name, value)
    monkeypatch.setattr("dvi_lite.study.report.update_readme", lambda: None)
    for d in ("notebooks", "build/notebooks", "results", "figures", "build/reproduce/stage/results",
              "build/reproduce/stage/figures"):
        (tmp_path / d).mkdir(parents=True)
    nb = _notebook("gains 1.00×<!--r 01_x:speedup-->\n")
    (tmp_path / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (tmp_path / "build" / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (tmp_path / "results" / "01_x.json").write_text(json.dumps({"speedup": 1.0}))
    (tmp_path / "build" / "reproduce" / "stage" / "figures" / "01_x.html").write_text("<html>new</html>")
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for d in ("notebooks", "results", "figures")
            for p in sorted((root / d).rglob("*")) if p.is_file()}


def test_a_tag_that_does_not_resolve_changes_nothing(fake_root: Path, capsys: pytest.CaptureFixture):
    stage = fake_root / "build" / "reproduce" / "stage"
    (stage / "results" / "01_x.json").write_text(json.dumps({"renamed": 1.25}))
    before = _tree(fake_root)
    nbs = [fake_root / "notebooks" / "01_x.ipynb"]
    assert reproduce.finish_full_run(nbs, {"01_x.ipynb": 5.0}) == 1
    out = capsys.readouterr().out
    assert "01_x.ipynb markdown cell 0: <!--r 01_x:speedup-->" in out and "nearest keys: renamed" in out
    assert "make reproduce" in out and _tree(fake_root) == before


def test_a_run_whose_tags_resolve_is_put_in_place_together(fake_root: Path):
    stage = fake_root / "build" / "reproduce" / "stage"
    (stage / "results" / "01_x.json").write_text(json.dumps({"speedup": 1.25}))
    nbs = [fake_root / "notebooks" / "01_x.ipynb"]
    assert reproduce.finish_full_run(nbs, {"01_x.ipynb": 5.0}) == 0
    assert json.loads((fake_root / "results" / "01_x.json").read_text()) == {"speedup": 1.25}
    assert (fake_root / "figures" / "01_x.html").read_text() == "<html>new</html>"
    back = json.loads((fake_root / "notebooks" / "01_x.ipynb").read_text())
    assert "".join(back["cells"][0]["source"]).startswith("gains 1.25×")
    assert back["metadata"]["dvi_lite"]["mode"] == "full"
    assert not list(stage.rglob("*.json")), "the stage is emptied into place"


def test_progress_resumes_the_same_run_and_redoes_a_torn_or_foreign_file(fake_root: Path,
                                                                        capsys: pytest.CaptureFixture):
    done = {"01_x.ipynb": {"seconds": 5.0, "source_sha256": "abc"}}
    reproduce.write_progress("full", "key", done)
    assert reproduce.read_progress("full", "key") == done
    assert reproduce.read_progress("full", "other package") == {}
    assert reproduce.read_progress("smoke", "key") == {}
    reproduce.PROGRESS.write_text('{"mode": "full", "run_key": "key", "noteb')  # a write cut by a kill
    assert reproduce.read_progress("full", "key") == {}
    assert "unreadable" in capsys.readouterr().out


def test_atomic_writes_keep_the_files_mode_and_leave_no_temporary(tmp_path: Path):
    """A rename-into-place write must not leave a committed file readable by its owner only (mkstemp's 0600)."""
    import os
    import stat

    from dvi_lite.paths import atomic_write_text

    new = atomic_write_text(tmp_path / "new.json", "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
    old = tmp_path / "old.json"
    old.write_text("[]")
    old.chmod(0o640)
    atomic_write_text(old, "[1]")
    assert stat.S_IMODE(old.stat().st_mode) == 0o640 and old.read_text() == "[1]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "old.json"]
