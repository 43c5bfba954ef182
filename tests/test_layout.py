"""Guards on the package's layout: no import circles, imports that run one way (the layers), short modules, lint
clean, one CLI, a light import, no repeated logic. Each guard is one test, so a failure names what broke."""
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

from dvi_lite.cli import main as cli_main
from dvi_lite.commands import COMMANDS, PROG

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



# ----------------------------------------------------------------------------- (a') layers: imports run one way

# The package's layers, bottom first: a module may import its own layer and the layers below it, never one above.
# A folder is a layer; the top-level modules are placed one by one: paths and the table of commands at the bottom;
# the package's API (dvi_lite/__init__.py: core's loop and models' loaders) under the course, which teaches with it
# (the modules below import from where a name lives, never from the API); `python -m dvi_lite` and its dispatcher
# on top. The notebooks and scripts/ stand above all of it.
LAYERS = ("base", "core", "measure", "models", "course_model", "methods", "study", "api", "course", "top")
TOP_LEVEL = {"paths": "base", "commands": "base", "safety": "base", "": "api", "cli": "top", "__main__": "top"}


def layer_of(module: str) -> str:
    """The layer of a module of the package: its folder under the package, or TOP_LEVEL's word for a top-level
    module. A new folder or top-level module has no layer until it is placed here (a KeyError says so)."""
    parts = module.split(".")[1:]
    if len(parts) <= 1 and (parts[0] if parts else "") in TOP_LEVEL:
        return TOP_LEVEL[parts[0] if parts else ""]
    if parts[0] not in LAYERS:
        raise KeyError(f"{module}: place its folder in LAYERS, or the module in TOP_LEVEL")
    return parts[0]


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file for every .py under package_dir (a package is named by its __init__)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> list[str]:
    """The package's modules one import statement names: `from pkg import mod` names pkg.mod when it is a module,
    `from pkg.mod import name` names pkg.mod; relative imports are resolved from `module`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    source = node.module or ""
    if node.level:
        base = (module if is_package else module.rpartition(".")[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([source] if source else []))
    out = []
    for a in node.names:
        if f"{source}.{a.name}" in modules:
            out.append(f"{source}.{a.name}")
        elif source in modules and source not in out:
            out.append(source)
    return out


def upward_imports(package_dir: Path) -> list[str]:
    """Every import, anywhere in a module (top level, inside functions, under TYPE_CHECKING), that reaches a
    layer above the importing module's: "file:line: the import (layer -> the layer above it reaches)"."""
    modules = package_modules(package_dir)
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = []
    for module, path in modules.items():
        mine = layer_of(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported_modules(node, module, path.name == "__init__.py", modules):
                theirs = layer_of(target)
                if rank[theirs] > rank[mine]:
                    where = path.relative_to(package_dir.parent)
                    found.append(f"{where}:{node.lineno}: `{ast.unparse(node)}` reaches up from {mine} to "
                                 f"{theirs} ({target})")
    return found


def test_imports_run_one_way():
    """base < core < measure < models < course_model < methods < study < api < course < top: none reaches up."""
    assert {layer_of(m) for m in MODULES} == set(LAYERS), "every layer has modules, and every module a layer"
    up = upward_imports(PKG)
    assert not up, f"imports that reach up a layer (order: {' < '.join(LAYERS)}):\n" + "\n".join(up)


SYNTHETIC = {  # one module per layer, each importing downwards only
    "dvi_lite/__init__.py": "from dvi_lite.core.loop import decode\n",
    "dvi_lite/paths.py": "ROOT = None\n",
    "dvi_lite/commands.py": "PROG = 'x'\n",
    "dvi_lite/cli.py": "from dvi_lite.commands import PROG\n",
    "dvi_lite/core/__init__.py": "",
    "dvi_lite/core/loop.py": "from dvi_lite.paths import ROOT\n\ndef decode():\n    return ROOT\n",
    "dvi_lite/measure/__init__.py": "",
    "dvi_lite/measure/cost.py": "from ..core import loop\n",
    "dvi_lite/models/__init__.py": "",
    "dvi_lite/models/data.py": "from dvi_lite.measure.cost import loop\n",
    "dvi_lite/course_model/__init__.py": "",
    "dvi_lite/course_model/train.py": "from dvi_lite.models import data\n",
    "dvi_lite/methods/__init__.py": "",
    "dvi_lite/methods/recipe.py": "def run():\n    from dvi_lite.models.data import loop\n    return loop\n",
    "dvi_lite/study/__init__.py": "",
    "dvi_lite/study/bench.py": "from dvi_lite.methods import recipe\n\ndef bench():\n    return recipe\n",
    "dvi_lite/course/__init__.py": "",
    "dvi_lite/course/ch.py": "from dvi_lite.study.bench import bench\nfrom dvi_lite import decode\n",
    "dvi_lite/__main__.py": "from dvi_lite.cli import PROG\n",
}


def test_a_planted_upward_import_is_caught(tmp_path):
    """A clean synthetic package passes; an import inside a function, a relative one and one of the package's API
    that reach up each fail, named by file, line, the import and the layers."""
    pkg = tmp_path / "dvi_lite"
    for rel, text in SYNTHETIC.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert upward_imports(pkg) == []
    (pkg / "methods" / "recipe.py").write_text("import os\n\ndef run():\n    from dvi_lite.study.bench import bench\n"
                                              "    return bench\n")
    (pkg / "models" / "data.py").write_text("from ..course_model import train\n")
    (pkg / "core" / "loop.py").write_text("def decode():\n    import dvi_lite\n    return dvi_lite\n")
    assert upward_imports(pkg) == [
        "dvi_lite/core/loop.py:2: `import dvi_lite` reaches up from core to api (dvi_lite)",
        "dvi_lite/methods/recipe.py:4: `from dvi_lite.study.bench import bench` reaches up from methods to study "
        "(dvi_lite.study.bench)",
        "dvi_lite/models/data.py:1: `from ..course_model import train` reaches up from models to course_model "
        "(dvi_lite.course_model.train)",
    ]


def test_a_planted_upward_import_in_a_copy_of_the_package_is_caught(tmp_path):
    """The same check on a copy of the real package: a recipe's lazy import of the study's bench (the shape
    issue 44 removed) fails it, named."""
    copy = tmp_path / "dvi_lite"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert upward_imports(copy) == []
    sizing = copy / "methods" / "sps" / "sizing.py"
    lines = sizing.read_text().splitlines(keepends=True)
    lines.append("\n\ndef planted():\n    from dvi_lite.study.bench import format_table\n\n    return format_table\n")
    sizing.write_text("".join(lines))
    up = upward_imports(copy)
    assert up == [f"dvi_lite/methods/sps/sizing.py:{len(lines) + 3}: `from dvi_lite.study.bench import format_table` "
                  "reaches up from methods to study (dvi_lite.study.bench)"]


def test_every_top_level_module_and_folder_has_a_layer():
    """A new folder or top-level module fails here until LAYERS or TOP_LEVEL places it."""
    with pytest.raises(KeyError, match="place its folder"):
        layer_of("dvi_lite.newfolder.mod")
    with pytest.raises(KeyError):
        layer_of("dvi_lite.helpers")
    assert layer_of("dvi_lite") == "api" and layer_of("dvi_lite.cli") == "top" and layer_of("dvi_lite.paths") == "base"
    assert layer_of("dvi_lite.methods.sps.sizing") == "methods"


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


def test_make_keeps_pythons_bytecode():
    """A machine that sets PYTHONDONTWRITEBYTECODE (this one does) would make every test worker, notebook kernel and
    subprocess compile torch and transformers again, with `pip --no-compile`: the Makefile unexports it."""
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-compile" in makefile
    assert re.search(r"^unexport PYTHONDONTWRITEBYTECODE$", makefile, re.MULTILINE)


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
LOADED = "print('LOADED', json.dumps(sorted(m for m in sys.modules if sys.modules[m] is not None and "\
         "m.partition('.')[0] in HEAVY)))"


@pytest.fixture(scope="module")
def without_the_course_extra() -> tuple[list[str], dict[str, str]]:
    """One interpreter with the course extra blocked (each interpreter pays torch's and transformers' import):
    first `import dvi_lite` alone, and which blocked packages it loaded; then every module below the study, each
    imported as if first (ALONE), and the ones that failed."""
    names = sorted(m for m in MODULES if m.split(".")[1:2] in (["core"], ["measure"], ["models"], ["course_model"],
                                                                 ["methods"]))
    code = BLOCK + "import json\nimport dvi_lite, dvi_lite.core.registry\nassert dvi_lite.METHODS['ar']\n" + LOADED
    res = run_python(code + ALONE % json.dumps(names))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    loaded = next(json.loads(line.removeprefix("LOADED ")) for line in lines if line.startswith("LOADED "))
    return loaded, json.loads(lines[-1])


def test_import_needs_only_the_core_dependencies(without_the_course_extra):
    loaded, _ = without_the_course_extra
    assert loaded == [], loaded


def test_layers_below_the_study_import_without_the_course_extra(without_the_course_extra):
    _, failed = without_the_course_extra
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
# sends a lean tree (scripts/gpu_carry.sh lean: about 4 MiB tracked), so a tenth of a MiB of headroom is enough for a
# plain copy; the next piece committed has to replace bytes, not add them.
TREE_BUDGET_MIB = 63.9


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
