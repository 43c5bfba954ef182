"""Check that this machine can run the course: `python -m dvi_lite env-check` (or `make env-check`).

Why: the notebooks fail late and obscurely on a wrong torch build, a missing pin, no
browser for plotly PNG export, or a missing course model. This prints one line per
requirement (OK / WARN / FAIL) up front and exits 1 if anything is a FAIL.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import re
import shutil
import tomllib

from dvi_lite.commands import prog
from dvi_lite.paths import DATA_DIR, ROOT

PYPROJECT = ROOT / "pyproject.toml"
MODEL_CONFIG = DATA_DIR / "course_model" / "config.json"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
EXTRAS = ("course",)  # the course needs its extra too (dev is for tests only)


def requirements() -> list[str]:
    """The requirement strings of [project].dependencies and the course extra in pyproject.toml."""
    with PYPROJECT.open("rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"]) + [r for e in EXTRAS for r in project["optional-dependencies"][e]]


def check_requirement(spec: str) -> tuple[str, str]:
    """(status, message) for one requirement string such as 'torch==2.13.0' or "triton==3.9.0; platform...".

    A requirement whose environment marker does not hold here (triton off Linux) is not needed: OK.
    """
    spec, _, marker = spec.partition(";")
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(==|>=|<=|~=|!=|<|>)?\s*(\S*)", spec.strip())
    if m is None:
        return "FAIL", f"{spec} (unparseable requirement in pyproject.toml)"
    name, op, want = m.groups()
    if marker.strip() and not _marker_holds(marker):
        return "OK", f"{name} (not needed here: {marker.strip()})"
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "FAIL", f"{name} (not installed; want {spec}; run `make setup`)"
    if op == "==" and have.split("+")[0] != want:  # '2.13.0+cpu' satisfies '==2.13.0'
        return "FAIL", f"{name} (installed {have}, pinned {want}; run `make setup`)"
    return "OK", f"{name} {have}"


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker  # a dependency of transformers

    return Marker(marker.strip()).evaluate()


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
    """triton has Linux wheels only: elsewhere Medusa's tree attention uses its torch reference (a WARN)."""
    try:
        triton = importlib.import_module("triton")
    except Exception as e:  # noqa: BLE001
        status = "FAIL" if platform.system() == "Linux" else "WARN"
        return status, f"triton-import ({type(e).__name__}: {e})"
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


def main(argv: list[str] | None = None) -> int:
    """Print one line per check; return 1 if any check failed, else 0."""
    argparse.ArgumentParser(prog=prog("env-check"), description=__doc__.splitlines()[0]).parse_args(argv)
    results = [check_requirement(s) for s in requirements()]
    results += [check_torch_build(), check_triton(), check_browser(), check_model()]
    for status, message in results:
        print(f"{status:<4} {message}")
    return 1 if any(status == "FAIL" for status, _ in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
