"""Check that this machine can run the course: `python -m dvi_lite.study.envcheck` (or `make env-check`).

Why: the notebooks fail late and obscurely on a wrong torch build, a missing pin, no
browser for plotly PNG export, or a missing course model. This prints one line per
requirement (OK / WARN / FAIL) up front and exits 1 if anything is a FAIL.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shutil
import tomllib
from pathlib import Path

from dvi_lite.paths import ROOT
PYPROJECT = ROOT / "pyproject.toml"
MODEL_CONFIG = ROOT / "data" / "course_model" / "config.json"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def requirements() -> list[str]:
    """The requirement strings of [project].dependencies in pyproject.toml."""
    with PYPROJECT.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def check_requirement(spec: str) -> tuple[str, str]:
    """(status, message) for one requirement string such as 'torch==2.13.0'."""
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(==|>=|<=|~=|!=|<|>)?\s*(\S*)", spec)
    if m is None:
        return "FAIL", f"{spec} (unparseable requirement in pyproject.toml)"
    name, op, want = m.groups()
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "FAIL", f"{name} (not installed; want {spec}; run `make setup`)"
    if op == "==" and have.split("+")[0] != want:  # '2.13.0+cpu' satisfies '==2.13.0'
        return "FAIL", f"{name} (installed {have}, pinned {want}; run `make setup`)"
    return "OK", f"{name} {have}"


def check_torch_build() -> tuple[str, str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - report any import failure
        return "FAIL", f"torch build ({type(e).__name__}: {e})"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    cuda = torch.cuda.is_available()
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if cuda else ""
    return "OK", f"torch-build {build}, cuda.is_available()={cuda}{gpu}"


def check_triton() -> tuple[str, str]:
    try:
        triton = importlib.import_module("triton")
    except Exception as e:  # noqa: BLE001
        return "FAIL", f"triton-import ({type(e).__name__}: {e})"
    return "OK", f"triton-import {getattr(triton, '__version__', '?')}"


def check_browser() -> tuple[str, str]:
    for exe in BROWSERS:
        path = shutil.which(exe)
        if path:
            return "OK", f"browser {path}"
    return "WARN", "browser (no chromium/chrome found: figures will be HTML only; `apt-get install chromium` fixes it)"


def check_model() -> tuple[str, str]:
    if MODEL_CONFIG.is_file():
        return "OK", f"course-model {MODEL_CONFIG.relative_to(ROOT)}"
    return "FAIL", f"course-model ({MODEL_CONFIG.relative_to(ROOT)} missing; run `make model`)"


def main() -> int:
    """Print one line per check; return 1 if any check failed, else 0."""
    results = [check_requirement(s) for s in requirements()]
    results += [check_torch_build(), check_triton(), check_browser(), check_model()]
    for status, message in results:
        print(f"{status:<4} {message}")
    return 1 if any(status == "FAIL" for status, _ in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
