"""No import circles inside dvi_lite: the intra-package import graph, built statically, is acyclic.

Why: an import circle works only while every import in it happens late enough (inside a function, or after the
names it needs are defined); one innocent top-level import later turns it into an ImportError or a partly
initialised module, and it always means two modules each own a piece of the other. So the test counts every
import the source names, wherever it stands: top level, inside functions, under `if TYPE_CHECKING`, relative
or absolute. Each module is parsed with `ast` (nothing is imported or run), and the graph has an edge
A -> B when A imports module B of the package (`from pkg.mod import name` -> pkg.mod; `from pkg import mod`
-> pkg.mod when mod is a module, else pkg). Importing a submodule also runs its parent packages' __init__, but
those edges are left out: a package's __init__ re-exporting its submodules is the usual layout, not a circle.
A planted circle (function-local on one side, relative on the other) shows the check catches what it must.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dvi_lite

PACKAGE_DIR = Path(dvi_lite.__file__).resolve().parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under the package (a package is named by its __init__)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that one import statement (in `module`) names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = (module if is_package else module.rpartition(".")[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for a in node.names:
        sub = f"{source}.{a.name}"
        if sub in modules:
            out.add(sub)  # `from pkg import mod`: the submodule itself
        elif source in modules:
            out.add(source)  # `from pkg.mod import name`
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source (self-imports dropped)."""
    files = module_files(package_dir)
    names = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):  # every statement, function bodies included
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _imported(node, module, path.name == "__init__.py", names)
        graph[module] = deps - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles, each as a closed path [a, b, ..., a] that shows who imports whom: the strongly
    connected components with more than one module (Tarjan's algorithm, iterative), and in each one the
    shortest circle through every module, written from its smallest name, duplicates dropped, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    cycles = set()
    for comp in components:
        for start in comp:
            path = _closed_path(graph, set(comp), start)[:-1]
            i = path.index(min(path))
            cycles.add(tuple(path[i:] + path[:i] + [path[i]]))
    return [list(c) for c in sorted(cycles)]


def _closed_path(graph: dict[str, set[str]], inside: set[str], start: str) -> list[str]:
    """A shortest closed path through `start` within the component `inside`, [start, ..., start]."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:  # back at the start: walk the parents from `node` to `start`
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if child in inside and child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(inside)} is not a strongly connected component of the graph")


def test_dvi_lite_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 200  # the whole package was read
    # function-local imports are edges too (e.g. the recipe imports models.loading inside prepare_smollm2)
    assert "dvi_lite.models.loading" in graph["dvi_lite.methods.draft_verify.recipe"]
    cycles = find_cycles(graph)
    assert not cycles, "import circles in dvi_lite:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root / "pkg"


def test_a_planted_cycle_is_caught(tmp_path):
    """pkg.a imports pkg.sub.b inside a function only; pkg.sub.b imports pkg.a back with a relative import;
    pkg.c and pkg.sub (imported by both) close no circle."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg import c\n",
        "pkg/a.py": "import os\n\ndef f():\n    from pkg.sub.b import g\n    return g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from .. import a\nfrom ..c import h\n\ndef g():\n    return a\n",
        "pkg/c.py": "import pkg.sub\n\ndef h():\n    return 1\n",
    })
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a", "pkg.c"}
    assert graph["pkg"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.sub"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    (pkg / "a.py").write_text("import os\n")  # cut it: no circle left
    assert find_cycles(import_graph(pkg)) == []


@pytest.mark.parametrize("graph,want", [
    ({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}, [["x", "y", "z", "x"]]),  # a 3-circle, w only feeds it
    ({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}, [["p", "q", "p"], ["x", "y", "x"]]),  # two circles
    ({"x": {"y", "z"}, "y": {"z"}, "z": set()}, []),  # a diamond is no circle
    # one component, two circles through its hub (the shape loading <-> sps.draft, loading <-> smollm2 had)
    ({"hub": {"a", "b"}, "a": {"hub"}, "b": {"hub"}}, [["a", "hub", "a"], ["b", "hub", "b"]]),
])
def test_find_cycles_on_small_graphs(graph, want):
    assert find_cycles(graph) == want


def test_moved_names_stay_importable_from_their_old_modules():
    """Cutting the circles moved shared pieces to the module they belong in; the names notebooks, tests and
    `study.prepare` import from the old places are the very same objects."""
    from dvi_lite.methods.draft_verify import bo, recipe, search
    from dvi_lite.models import loading, smollm2

    assert loading.SMOLLM2_DIR is smollm2.SMOLLM2_DIR and loading.MODELS["smollm2"] is smollm2.SMOLLM2_DIR
    assert (search.SearchConfig, search.SearchResult, search.search_skip) == (bo.SearchConfig, bo.SearchResult,
                                                                              bo.search_skip)
    assert search.prepare_smollm2 is recipe.prepare_smollm2  # study.prepare names "...search:prepare_smollm2"
