"""Guards on the package's layout: no import circles, short modules, lint clean, one CLI, a light import, no
repeated logic. Each guard is one test, so a failure names what broke."""
from __future__ import annotations

import ast
import json
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dvi_lite.cli import COMMANDS, PROG
from dvi_lite.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dvi_lite"
MAX_LINES = 400
# Optional dependencies (the `course` extra, and triton, which has no macOS wheel): a core import never needs them.
HEAVY = ("jupyter", "jupyterlab", "jupyter_client", "jupyter_core", "jupyter_server", "plotly", "papermill",
         "anywidget", "ipywidgets", "optuna", "kaleido", "nbformat", "scipy", "triton", "IPython", "ipykernel")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- (a) no import circles

ALONE = """
import importlib, json, sys, traceback
failed = {}
for name in json.loads(%r):
    for m in [m for m in sys.modules if m == "dvi_lite" or m.startswith("dvi_lite.")]:
        del sys.modules[m]  # each module is imported as if it were the first: only third-party ones stay cached
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_module_imports_alone():
    """Importing any one module first works: no circle that only some import orders survive."""
    res = run_python(ALONE % json.dumps(sorted(MODULES)))
    assert res.returncode == 0, res.stderr[-3000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def module_level_imports(name: str, path: Path) -> set[str]:
    """The dvi_lite modules `name` imports when it is imported (not inside functions, not TYPE_CHECKING)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from .y import z
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text(), str(path)).body)
    return {m for m in out if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path a -> ... -> a, or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_import_graph_has_no_cycles():
    graph = {name: module_level_imports(name, path) for name, path in MODULES.items()}
    assert graph["dvi_lite"], "the parser found no imports in dvi_lite/__init__.py"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (defs, classes, assignments, imports), also under if/try."""
    names: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).partition(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def test_every_import_of_a_package_name_resolves():
    """Also the imports inside functions (lazy ones), which importing a module does not run."""
    defined = {name: defined_names(path) for name, path in MODULES.items()}
    broken = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                broken += [f"{name}:{node.lineno} import {a.name}" for a in node.names
                           if a.name.startswith("dvi_lite") and a.name not in MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dvi_lite") and not node.level:
                if node.module not in MODULES:
                    broken.append(f"{name}:{node.lineno} from {node.module} (no such module)")
                    continue
                broken += [f"{name}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                           if f"{node.module}.{a.name}" not in MODULES and a.name not in defined[node.module]]
    assert not broken, "imports that do not resolve:\n" + "\n".join(broken)


def test_core_imports_nothing_outside_core():
    """The loop knows no method, course or study module (the registry names factories as strings)."""
    outside = []
    for name, path in MODULES.items():
        if not name.startswith("dvi_lite.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [f"{name}:{node.lineno} {t}" for t in targets
                        if t.startswith("dvi_lite") and not t.startswith("dvi_lite.core") and t != "dvi_lite.paths"]
    assert not outside, outside


# ----------------------------------------------------------------------------- (b) short modules

def test_no_module_is_too_long():
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# ----------------------------------------------------------------------------- (c) lint

def test_ruff_is_clean():
    """`make lint`: ruff is a dev dependency, so its absence is a failure, not a skip."""
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "dvi_lite", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in res.stderr, "ruff is not installed: `make setup` installs the dev extra"
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


# ----------------------------------------------------------------------------- (d) the one CLI

def test_help_lists_every_command():
    res = subprocess.run([sys.executable, "-m", "dvi_lite", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for command, (_, summary) in COMMANDS.items():
        assert re.search(rf"^\s+{re.escape(command)}\s+{re.escape(summary)}$", res.stdout, re.MULTILINE), command


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert out.startswith(f"usage: {PROG} {command}"), f"argparse prog must be '{PROG} {command}':\n{out[:300]}"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_module_runs_as_a_thin_alias(command, capsys, monkeypatch):
    """`python -m <the command's module> --help` runs the same main()."""
    module = COMMANDS[command][0].split(":")[0]
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert e.value.code == 0 and f"usage: {PROG} {command}" in capsys.readouterr().out


def test_readme_and_makefile_use_the_one_cli():
    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    missing = [c for c in COMMANDS if f"| `{c}` |" not in readme]
    assert not missing, f"README's table of commands lacks {missing}"
    old = sorted(set(re.findall(r"python -m (dvi_lite\.[\w.]+)", readme + makefile)))
    assert not old, f"use `python -m dvi_lite <command>` instead of {old}"


def test_console_script_is_the_one_cli():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"dvi-lite": "dvi_lite.cli:main"}


# ----------------------------------------------------------------------------- (e) light import

BLOCK = f"""
import importlib.abc, sys
HEAVY = {HEAVY!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY or top.startswith("jupyter"):
            raise ModuleNotFoundError(f"blocked optional dependency: {{name}}", name=name)
        return None
sys.meta_path.insert(0, Block())
for name in HEAVY:  # as if not installed: importlib.util.find_spec says None (transformers probes some of them)
    sys.modules[name] = None
"""
LOADED = "print(sorted(m for m in sys.modules if sys.modules[m] is not None and m.partition('.')[0] in HEAVY))"


def test_import_needs_only_the_core_dependencies():
    code = BLOCK + "import dvi_lite, dvi_lite.core.registry\nassert dvi_lite.METHODS['ar']\n" + LOADED
    res = run_python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def test_core_methods_and_models_import_without_the_course_extra():
    names = sorted(m for m in MODULES if m.split(".")[1:2] in (["core"], ["methods"], ["models"]))
    code = BLOCK + ALONE % json.dumps(names)
    res = run_python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())


# ----------------------------------------------------------------------------- (f) no repeated logic

@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the `duplicates` tool is not on this machine")
def test_no_repeated_logic():
    """`duplicates` pairs places that share six or more lines; only boilerplate (thin, common shapes) may pair."""
    res = subprocess.run(["duplicates", "--repo", str(PKG), "--most", "200", "--seconds", "120"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert "incomplete:" not in out, out
    rows = [line for line in out.splitlines() if re.match(r"D\d+ ", line)]
    logic = [row for row in rows if not row.rstrip().endswith("boilerplate")]
    assert not logic, "repeated logic:\n" + "\n".join(logic)


# ----------------------------------------------------------------------------- (h) a tree the GPU machine accepts

# The device machine copies the working tree and refuses it above 64 MiB. A run that carries SmolLM2's GGUF (98 MB)
# empties the large course files for the call (scripts/gpu_prepare.sh says how), so a quarter MiB of headroom is
# enough for a plain copy; the next piece committed has to replace bytes, not add them.
TREE_BUDGET_MIB = 63.75


def test_the_tracked_tree_fits_the_device_copy():
    """Every tracked file together stays under TREE_BUDGET_MIB, so a GPU session can copy the tree. Large generated
    files (plotly.min.js, build outputs, learning-curve snapshots) stay out of git."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in out.decode().split("\0") if f]
    sizes = [(f.lstat().st_size, f.relative_to(ROOT)) for f in files if f.is_file()]  # a symlink travels as a link
    total = sum(s for s, _ in sizes)
    biggest = sorted(sizes, reverse=True)[:5]
    assert total <= TREE_BUDGET_MIB * 2**20, f"tracked files: {total / 2**20:.1f} MiB > {TREE_BUDGET_MIB} MiB; " \
        f"largest: {[(str(p), round(s / 2**20, 1)) for s, p in biggest]}"


def test_committed_torch_pieces_are_deflated():
    """torch.save stores its records uncompressed; every tracked .pt is rewritten deflated (the same records, read
    by torch.load as they are, about 8 % smaller): the bytes that let the course model's EAGLE head in under
    TREE_BUDGET_MIB. A piece retrained by a saver that writes plain torch.save fails here, not at the budget."""
    import zipfile

    try:
        out = subprocess.run(["git", "ls-files", "-z", "*.pt"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    stored = []
    for f in [ROOT / f for f in out.decode().split("\0") if f]:
        with zipfile.ZipFile(f) as z:
            if any(i.compress_type == zipfile.ZIP_STORED and i.file_size > 4096 for i in z.infolist()):
                stored.append(str(f.relative_to(ROOT)))
    assert not stored, f"stored, not deflated: {stored}; run dvi_lite.models.artifacts.deflate_piece(path) on each"
