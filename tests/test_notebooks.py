"""Every notebook runs top to bottom under papermill in smoke mode (the CI defaults)."""
import re
from pathlib import Path

import nbformat
import pytest

from dvi_lite.study.reproduce import MAX_NOTEBOOK_BYTES, NOTEBOOKS_DIR, notebooks, source_hash

NBS = notebooks()


def test_there_are_notebooks():
    assert [nb.name[:2] for nb in NBS][:2] == ["00", "01"]


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_notebook_source(nb: Path):
    """A papermill parameters cell whose MODE is the learner default, no algorithm defined inline, and the
    reproducibility machinery in one labelled cell: it writes the results and asserts the invariants."""
    doc = nbformat.read(nb, as_version=4)
    code = [c for c in doc.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'MODE = "learner"' in params[0].source.splitlines()
    after = [c for c in code[code.index(params[0]) + 1:] if "injected-parameters" not in c.metadata.get("tags", [])]
    assert "SMOKE, FULL = check_mode(MODE)" in after[0].source, "the cell after the parameters checks MODE"
    assert not any(line.lstrip().startswith(("def ", "class ")) for c in code for line in c.source.splitlines())
    repro = [i for i, c in enumerate(doc.cells) if c.cell_type == "code" and "check_invariants(" in c.source]
    assert len(repro) == 1, "one cell asserts the notebook's invariants"
    assert "write_result(" in doc.cells[repro[0]].source, "the same cell writes the run's results"
    assert doc.cells[repro[0] - 1].cell_type == "markdown" and "Reproducibility" in doc.cells[repro[0] - 1].source


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_committed_outputs_come_from_a_full_run_of_this_source(nb: Path):
    """The committed outputs are `make reproduce`'s: papermill ran it with MODE="full", every code cell ran,
    and the code it ran (hash stamped by reproduce.write_back) is the notebook's code now. The injected
    parameters are kept as comments, so Run All in JupyterLab uses the learner default."""
    raw = nb.read_bytes()
    assert len(raw) <= MAX_NOTEBOOK_BYTES, f"{nb.name}: {len(raw) / 2**20:.1f} MiB with outputs"
    doc = nbformat.reads(raw.decode(), as_version=4)
    stamp = doc.metadata.get("dvi_lite", {})
    assert stamp.get("mode") == "full", f"{nb.name} has no full run's outputs: run `make reproduce`"
    assert doc.metadata["papermill"]["parameters"].get("MODE") == "full"
    injected = [c for c in doc.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert all(line.startswith("#") for c in injected for line in c.source.splitlines()), "injected MODE is live"
    assert stamp["source_sha256"] == source_hash(doc), f"{nb.name}: code changed since its full run"
    code = [c for c in doc.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{nb.name}: a code cell did not run"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))
    shows = [o for c in code for o in c.get("outputs", []) if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert shows and all("image/png" in o["data"] for o in shows), "plotly outputs need their PNG fallback"


def test_check_bench_rejects_what_a_table_must_not_hold():
    """The notebooks' reproducibility cells stop a run on a missing method or a meaningless number."""
    from dvi_lite.study.table import check_bench

    row = {"tokens_per_s": 50.0, "speedup_vs_ar": 1.0, "tau": None, "alpha": None}
    ok = {"ar": row, "sps": {**row, "tau": 2.5, "alpha": 0.7, "c": 0.2}}
    assert "2 methods" in check_bench(ok, ["ar", "sps"])
    bad = [({"ar": row}, "no row for ['sps']"), ({**ok, "sps": {**ok["sps"], "tau": 0.5}}, "tau = 0.5"),
           ({**ok, "ar": {**row, "tokens_per_s": float("nan")}}, "not finite"),
           ({**ok, "sps": {**ok["sps"], "alpha": 1.5}}, "alpha = 1.5 > 1"),
           ({**ok, "ar": {**row, "tokens_per_s": 0.0}}, "is not > 0")]
    for res, msg in bad:
        with pytest.raises(AssertionError, match=re.escape(msg)):
            check_bench(res, ["ar", "sps"])


@pytest.mark.slow
@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_notebook_runs_in_smoke_mode(nb: Path, tmp_path: Path):
    import papermill as pm

    out = Path(__file__).resolve().parent.parent / "build" / "notebooks_smoke" / nb.name
    out.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(str(nb), str(out), parameters={"MODE": "smoke"}, kernel_name="python3",
                        cwd=str(NOTEBOOKS_DIR), progress_bar=False)
    done = nbformat.read(out, as_version=4)
    errors = [o for c in done.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # smoke runs write the same keys as full runs: every prose tag, in any notebook, into a file this notebook
    # writes resolves against what it just wrote (a full run's prose refresh would otherwise stop on it)
    from dvi_lite.paths import BUILD_DIR
    from dvi_lite.study.prose import unresolved_tags

    bad = unresolved_tags(NBS, BUILD_DIR / "results", files=written_results(nb))
    assert not bad, "prose tags that the smoke run's results do not resolve:\n" + "\n".join(bad)


def written_results(nb: Path) -> set[str]:
    """The results files a notebook writes: write_result("NAME", ...) in its code."""
    code = "\n".join(c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code")
    return set(re.findall(r'write_result\(\s*"([^"]+)"', code))


def test_every_notebook_writes_a_results_file_its_prose_can_tag():
    assert all(written_results(nb) for nb in NBS)


def test_source_hash_ignores_injected_parameters_and_sees_code_changes(tmp_path: Path):
    """reproduce.write_back stamps the hash of the code a run executed; papermill's injected cell is not code."""
    import json

    from dvi_lite.study.reproduce import write_back

    cells = [nbformat.v4.new_code_cell('MODE = "learner"'), nbformat.v4.new_code_cell("x = 1"),
             nbformat.v4.new_markdown_cell("prose")]
    nb = nbformat.v4.new_notebook(cells=cells)
    src = json.loads(nbformat.writes(nb))
    ran = json.loads(nbformat.writes(nb))
    injected = nbformat.v4.new_code_cell('# Parameters\nMODE = "full"\n')
    injected.metadata["tags"] = ["injected-parameters"]
    ran["cells"].insert(1, json.loads(nbformat.writes(nbformat.v4.new_notebook(cells=[injected])))["cells"][0])
    assert source_hash(ran) == source_hash(src)
    (tmp_path / "ran.ipynb").write_text(json.dumps(ran))
    write_back(tmp_path / "ran.ipynb", tmp_path / "nb.ipynb", 12.3)
    back = json.loads((tmp_path / "nb.ipynb").read_text())
    stamp = back["metadata"]["dvi_lite"]
    assert stamp == {"source_sha256": source_hash(src), "mode": "full", "seconds": 12.3}
    inert = "".join(back["cells"][1]["source"])  # still shown, but Run All no longer switches to full mode
    assert inert.endswith('# MODE = "full"\n') and all(line.startswith("#") for line in inert.splitlines())
    src["cells"][1]["source"] = "x = 2"
    assert source_hash(src) != stamp["source_sha256"]


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_markdown_images_and_notebook_links_resolve(nb: Path):
    """Every image (the schematic diagrams) and every link to another notebook points at a committed file."""
    doc = nbformat.read(nb, as_version=4)
    targets = [t for c in doc.cells if c.cell_type == "markdown"
               for t in re.findall(r"\]\(([^)\s#]+?\.(?:svg|png|ipynb))(?:#[^)]*)?\)", c.source)]
    missing = [t for t in targets if not t.startswith("http") and not (nb.parent / t).is_file()]
    assert not missing, f"{nb.name} links to missing files: {missing}"


MAX_TITLE_CHARS = 110  # a figure title at plotly's default size fits the 900-px PNG (figures.PNG_SIZE) up to this:
# the 106-character title of figures/08_position_acceptance.png ends about 60 px short of the edge


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_figure_titles_fit_the_png(nb: Path):
    """A title longer than the PNG is wide is clipped on a code host, which shows only the PNG."""
    doc = nbformat.read(nb, as_version=4)
    figs = [o["data"]["application/vnd.plotly.v1+json"] for c in doc.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if "application/vnd.plotly.v1+json" in o.get("data", {})]
    titles = [(f.get("layout", {}).get("title") or {}).get("text", "") for f in figs]
    long = [t for t in titles if len(t) > MAX_TITLE_CHARS]
    assert not long, f"{nb.name}: titles over {MAX_TITLE_CHARS} characters: {long}"


def test_every_committed_figure_comes_from_a_notebook():
    """figures/NAME.{html,png} is written by some notebook's save_figure: a figure nothing makes any more is stale."""
    code = "\n".join(c.source for nb in NBS for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code")
    made = set(re.findall(r'save_figure\(\s*\w+\s*,\s*"([^"]+)"', code))
    figures = NOTEBOOKS_DIR.parent / "figures"
    orphans = sorted(p.name for p in figures.glob("*.*") if p.suffix in (".html", ".png") and p.stem not in made)
    assert not orphans, f"figures no notebook writes: {orphans}"
