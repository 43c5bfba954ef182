"""pyproject.toml is the single source of dependencies: environment.yml, the Makefile and CI must agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = "torch==2.13.0"


def pyproject_requirements() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])


def environment_pip_requirements() -> list[str]:
    """The items of the `- pip:` list in environment.yml (tiny parser, no yaml dependency)."""
    reqs: list[str] = []
    pip_indent: int | None = None
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split(" #")[0].rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if pip_indent is None:
            if line.strip() == "- pip:":
                pip_indent = indent
            continue
        if indent <= pip_indent:
            break
        assert line.strip().startswith("- "), f"unexpected line in pip list: {raw!r}"
        reqs.append(line.strip()[2:].strip().strip("'\""))
    assert pip_indent is not None, "environment.yml has no `- pip:` list"
    return reqs


def test_environment_yml_matches_pyproject() -> None:
    py, env = pyproject_requirements(), environment_pip_requirements()
    assert len(env) == len(set(env)), "duplicate entries in environment.yml"
    assert set(env) == set(py), f"only in pyproject: {set(py) - set(env)}; only in environment.yml: {set(env) - set(py)}"


def test_torch_pinned_exactly_and_first() -> None:
    py, env = pyproject_requirements(), environment_pip_requirements()
    assert py[0] == TORCH_PIN
    assert env[0] == TORCH_PIN
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_makefile_targets() -> None:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, flags=re.MULTILINE))
    wanted = {"help", "setup", "test", "reproduce", "lab", "model", "clean", "env-check", "test-browser"}
    assert wanted <= targets, f"missing Makefile targets: {wanted - targets}"
    assert "install -q torch==2.13.0" in text, "setup must install the torch pin first"


def test_ci_runs_make_test() -> None:
    script = ROOT / ".ci" / "run"
    text = script.read_text()
    assert re.search(r"^\s*make test\b", text, flags=re.MULTILINE)
    assert "set -euo pipefail" in text
