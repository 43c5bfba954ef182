"""`python -m dvi_lite.study.envcheck` reports the installed torch pin."""

from __future__ import annotations

import pytest

from dvi_lite.study import envcheck


def test_envcheck_reports_torch(capsys: pytest.CaptureFixture[str]) -> None:
    code = envcheck.main()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert code in (0, 1)
    torch_lines = [l for l in lines if l.split()[1:2] == ["torch"]]
    assert torch_lines, out
    assert torch_lines[0].startswith("OK") and "2.13.0" in torch_lines[0], out
    assert all(l.split()[0] in {"OK", "WARN", "FAIL"} for l in lines), out
    # The course-model line is not asserted: the model may not be trained yet.
