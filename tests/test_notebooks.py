"""Every notebook runs top to bottom under papermill in smoke mode (the CI defaults)."""
import re
from pathlib import Path

import nbformat
import pytest

from dvi_lite.study.reproduce import NOTEBOOKS_DIR, notebooks

NBS = notebooks()


def test_there_are_notebooks():
    assert [nb.name[:2] for nb in NBS][:2] == ["00", "01"]


@pytest.mark.parametrize("nb", NBS, ids=[nb.stem for nb in NBS])
def test_notebook_is_committed_clean(nb: Path):
    """Outputs stripped, a papermill parameters cell with SMOKE, and no algorithm defined inline."""
    doc = nbformat.read(nb, as_version=4)
    code = [c for c in doc.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "strip outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SMOKE = True" in params[0].source
    assert not any(line.lstrip().startswith(("def ", "class ")) for c in code for line in c.source.splitlines())
    assert "check_invariants(" in doc.cells[-1].source, "the last cell asserts the notebook's invariants"


def test_check_bench_rejects_what_a_table_must_not_hold():
    """The notebooks' last cells stop a run on a missing method or a meaningless number."""
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
    pm.execute_notebook(str(nb), str(out), parameters={"SMOKE": True}, kernel_name="python3",
                        cwd=str(NOTEBOOKS_DIR), progress_bar=False)
    done = nbformat.read(out, as_version=4)
    errors = [o for c in done.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
