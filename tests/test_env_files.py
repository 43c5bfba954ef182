"""pyproject.toml is the single source of dependencies: environment.yml, the Makefile and CI must agree.

The core dependencies are what `import dvi_lite` needs; the notebooks' packages are the `course` extra and
`make setup` installs `.[course,dev]`, so the two commands (make setup, make test) still set up everything.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = "torch==2.13.0"
EXTRAS = ("course", "dev")  # what `make setup` installs besides the core
CORE = {"torch", "transformers", "tokenizers", "safetensors", "peft", "numpy", "tqdm", "triton", "gguf"}
COURSE = {"jupyterlab", "ipykernel", "ipywidgets", "anywidget", "plotly", "kaleido", "papermill", "nbformat",
          "optuna", "scipy", "pillow", "django-static-mathjax"}  # the last: MathJax 3 files for `make book`, offline


def project() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()


def pyproject_requirements() -> list[str]:
    p = project()
    return list(p["dependencies"]) + [r for extra in EXTRAS for r in p["optional-dependencies"][extra]]


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
        item = line.strip()[2:].strip()
        if len(item) > 1 and item[0] == item[-1] and item[0] in "'\"":  # a quoted item (a marker has spaces)
            item = item[1:-1]
        reqs.append(item)
    assert pip_indent is not None, "environment.yml has no `- pip:` list"
    return reqs


def test_environment_yml_matches_pyproject() -> None:
    py, env = pyproject_requirements(), environment_pip_requirements()
    assert len(env) == len(set(env)), "duplicate entries in environment.yml"
    assert set(env) == set(py), (f"only in pyproject: {set(py) - set(env)}; "
                                 f"only in environment.yml: {set(env) - set(py)}")


def test_torch_pinned_exactly_and_first() -> None:
    py, env = pyproject_requirements(), environment_pip_requirements()
    assert py[0] == TORCH_PIN
    assert env[0] == TORCH_PIN
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_core_is_light_and_the_notebook_side_is_the_course_extra() -> None:
    p = project()
    core = {name_of(r) for r in p["dependencies"]}
    assert core == CORE, f"core dependencies: {sorted(core)}"
    assert {name_of(r) for r in p["optional-dependencies"]["course"]} == COURSE
    triton = [r for r in p["dependencies"] if name_of(r) == "triton"]
    assert triton and triton[0].replace('"', "'").endswith("; platform_system == 'Linux'"), triton
    assert "ruff" in {name_of(r) for r in p["optional-dependencies"]["dev"]}, "ruff is a dev dependency"
    assert p["scripts"]["dvi-lite"] == "dvi_lite.cli:main"


def test_makefile_targets() -> None:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, flags=re.MULTILINE))
    wanted = {"help", "setup", "lint", "test", "reproduce", "lab", "model", "clean", "env-check", "test-browser"}
    assert wanted <= targets, f"missing Makefile targets: {wanted - targets}"
    assert "install -q --no-compile $(TORCH_PIP_ARGS)torch==2.13.0" in text, "setup must install the torch pin first"
    assert "install -q --no-compile -e '.[course,dev]'" in text, "setup must install the course and dev extras"
    assert re.search(r"^test:[^#\n]*\blint\b", text, flags=re.MULTILINE), "make test must lint first"
    assert re.search(r"^\t.*ruff check dvi_lite tests", text, flags=re.MULTILINE), "make lint runs ruff"
    assert "dvi_lite.study." not in text and "dvi_lite.course_model." not in text, "use `python -m dvi_lite <cmd>`"


def _torch_install_line(*args: str) -> str:
    """The torch install command `make setup` would run (a dry run, the install stamp taken as stale)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", ".venv/.installed", *args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if TORCH_PIN in line)


def test_torch_index_selects_the_cpu_wheel_index_only_when_asked() -> None:
    """Without TORCH_INDEX the torch install is the plain pin (pip's own index); TORCH_INDEX=cpu points that one
    install at PyTorch's CPU wheel index, PyPI kept as an extra index; another value is an index URL."""
    plain = _torch_install_line()
    assert plain.startswith(f".venv/bin/pip install -q --no-compile {TORCH_PIN} 2>&1"), plain
    cpu = _torch_install_line("TORCH_INDEX=cpu")
    assert cpu == plain.replace(TORCH_PIN, "--index-url https://download.pytorch.org/whl/cpu "
                                          f"--extra-index-url https://pypi.org/simple {TORCH_PIN}"), cpu
    url = _torch_install_line("TORCH_INDEX=https://mirror.example/simple")
    assert "--index-url https://mirror.example/simple --extra-index-url" in url, url
    assert "--index-url" not in _torch_install_line("TORCH_INDEX=").replace(TORCH_PIN, ""), "empty = unchanged"


def test_ci_runs_make_test() -> None:
    script = ROOT / ".ci" / "run"
    text = script.read_text()
    assert re.search(r"^\s*make test\b", text, flags=re.MULTILINE)
    assert "set -euo pipefail" in text
