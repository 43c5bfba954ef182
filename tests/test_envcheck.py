"""`python -m dvi_lite env-check` reports the installed torch pin."""

from __future__ import annotations

import pytest

from dvi_lite.study import envcheck


def test_envcheck_reports_torch(capsys: pytest.CaptureFixture[str]) -> None:
    code = envcheck.main([])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert code == (1 if any(line.split()[0] == "FAIL" for line in lines) else 0), out  # 1 exactly when a check failed
    torch_lines = [line for line in lines if line.split()[1:2] == ["torch"]]
    assert torch_lines, out
    assert torch_lines[0].startswith("OK") and "2.13.0" in torch_lines[0], out
    assert all(line.split()[0] in {"OK", "WARN", "FAIL"} for line in lines), out
    # The course-model line is not asserted: the model may not be trained yet.


def test_a_requirement_whose_marker_does_not_hold_is_not_needed() -> None:
    status, message = envcheck.check_requirement("nosuchpkg==1.0; platform_system == 'NoSuchOS'")
    assert status == "OK" and "not needed here" in message
    status, message = envcheck.check_requirement("nosuchpkg==1.0")
    assert status == "FAIL" and "not installed" in message
