"""No test and no smoke-mode invariant asserts anything about time (issue 30, item 1).

A timing claim (one method or model faster than another, a speedup above a bar, a run within a time window)
depends on the machine's load: `make test` runs pytest-xdist workers side by side, and notebook 00's smoke
invariant once failed the suite that way ("SmolLM2 (1.31) is not below course (1.12)"). Timing claims belong
in full mode (`make reproduce`) and in benchmarks; tests and smoke runs check correctness, shapes, finiteness
and signs only.

The scanner reads the sources with `ast` and flags every order comparison (<, <=, >, >=) inside an `assert`
statement or a `require(...)` call (the notebooks' invariant checks) that involves a measured time:
  * an operand whose source names a timing (tokens/s, speedup, elapsed, wall time, seconds, v(n) tables, the
    clock functions, ...), except predicted or formula values (arithmetic on given numbers, not a timing);
  * or a local name assigned, directly or through other names, from such an expression (a small taint pass
    per function, so `mm = mean(vs[a]); require(mm < mc)` is caught).
Allowed: a sign check against the constant 0 (`tokens_per_s > 0`), a comparison under `if ... full ...:` (a
full-mode-only claim), and a function that scripts the clock (monkeypatch of `time`), whose "times" are exact.
Scanned: tests/*.py, and dvi_lite/course/**/*.py with dvi_lite/study/table.py (every `require` and `assert`
of the invariant functions and the exercise checks the notebooks call in smoke mode).
"""
from __future__ import annotations

import ast
import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMED = re.compile(r"tokens_per_s|speedup|per_s\b|elapsed|wall|seconds|latency|_ms\b|(?<![a-z])(total|prefill|draft"
                   r"|verify|run|setup|trim)_s\b|perf_counter|monotonic|time\.time|process_time|timeit|\bvs\b|"
                   r"\bv_of\b|verify_cost|forward_times|GBps|GFLOPs|bandwidth|\btps\b|measure_sublayer_costs")
# arithmetic on given numbers, not timings (exercises/checks.py's `_speedup` is the package's formula)
COMPUTED = re.compile(r"predicted|formula|expected|leviathan|best_speedup|expected_tau|\b_speedup\(")
SCRIPTED_CLOCK = re.compile(r"setattr\([^)]*\btime\b")  # monkeypatch.setattr(time, "perf_counter", ...) and the like
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class Finding:
    """One time-based assertion: where, and the comparison's source."""
    path: str
    line: int
    source: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source}"


class _Given(ast.NodeTransformer):
    """Blanks what names a timing without holding one: keyword names (`f(tokens_per_s=100.0)` passes a given number)
    and local names bound only to literals (`vs = {"course": {1: 1.0, 5: 2.0}}`: a hand-written table)."""

    def __init__(self, given: frozenset[str]):
        self.given = given

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Name("_given_", node.ctx) if node.id in self.given else node

    def visit_keyword(self, node: ast.keyword) -> ast.AST:
        self.generic_visit(node)
        node.arg = None
        return node


def _text(node: ast.AST, given: frozenset[str] = frozenset()) -> str:
    """The node's code (ast.unparse: quotes normalised, which the patterns allow for), `_Given` applied."""
    if not any(isinstance(n, ast.keyword) or isinstance(n, ast.Name) and n.id in given for n in ast.walk(node)):
        return ast.unparse(node)
    return ast.unparse(_Given(given).visit(copy.deepcopy(node)))


def _timed_text(text: str) -> bool:
    return bool(TIMED.search(text)) and not COMPUTED.search(text)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _flows(func: ast.AST) -> list[tuple[set[str], ast.AST]]:
    """(names bound, the expression they are bound from) for every binding in a function."""
    flows: list[tuple[set[str], ast.AST]] = []
    for node in ast.walk(func):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            tgts = node.targets if isinstance(node, ast.Assign) else [node.target]
            flows.append((set().union(*(_targets(t) for t in tgts)), node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            flows.append((_targets(node.target), node.iter))
        elif isinstance(node, ast.NamedExpr):
            flows.append(({node.target.id}, node.value))
    return flows


def _literal(node: ast.AST) -> bool:
    return not any(isinstance(n, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)) for n in ast.walk(node))


def _given_names(func: ast.AST) -> frozenset[str]:
    """Names every binding of which (in this function) is a literal: hand-written numbers, never a measurement."""
    bound: dict[str, bool] = {}
    for targets, value in _flows(func):
        for t in targets:
            bound[t] = bound.get(t, True) and _literal(value)
    return frozenset(t for t, lit in bound.items() if lit)


def _tainted(func: ast.AST, given: frozenset[str]) -> set[str]:
    """Local names that hold a timing: bound (also by for-loops and comprehensions) to a timed expression or to
    one that reads another tainted name, to a fixed point."""
    flows = [(targets, value, _text(value, given)) for targets, value in _flows(func)]
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for targets, value, text in flows:
            if (_timed_text(text) or _names(value) & tainted) and not targets <= tainted:
                tainted |= targets
                changed = True
    return tainted - given


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and node.value == 0


def _call_name(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    fn = node.func
    return fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""


def _operand_timed(node: ast.AST, tainted: set[str], given: frozenset[str]) -> bool:
    if _call_name(node) == "len":  # a count, not a time
        return False
    text = _text(node, given)
    if COMPUTED.search(text):
        return False
    return _timed_text(text) or bool(_names(node) & tainted)


def _timed_comparisons(expr: ast.AST, tainted: set[str], given: frozenset[str]) -> list[ast.Compare]:
    out = []
    for node in ast.walk(expr):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, ORDER) for op in node.ops):
            continue
        operands = [node.left, *node.comparators]
        if any(isinstance(o, (ast.Set, ast.SetComp)) or _call_name(o) in ("set", "frozenset", "keys")
               for o in operands):  # a subset test of key names
            continue
        timed = [o for o in operands if _operand_timed(o, tainted, given)]
        others = [o for o in operands if all(o is not t for t in timed)]
        if timed and not (others and all(_is_zero(o) for o in others)):  # x > 0: a sign check, allowed
            out.append(node)
    return out


class _Scanner(ast.NodeVisitor):
    """Walks one module; per function: taint, then every assert / require(...) outside full-mode branches."""

    def __init__(self, src: str, path: str):
        self.lines, self.path = src.splitlines(), path
        self.found: list[Finding] = []
        self.tainted: list[set[str]] = [set()]
        self.given: list[frozenset[str]] = [frozenset()]
        self.exempt: list[bool] = [False]

    def _function(self, node: ast.AST) -> None:
        given = self.given[-1] | _given_names(node)
        self.given.append(given)
        self.tainted.append((self.tainted[-1] | _tainted(node, given)) - given)
        body = "\n".join(self.lines[node.lineno - 1: node.end_lineno])
        self.exempt.append(self.exempt[-1] or bool(SCRIPTED_CLOCK.search(body)))
        self.generic_visit(node)
        for stack in (self.given, self.tainted, self.exempt):
            stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> None:
        test = _text(node.test)
        if re.search(r"\bfull\b|\bFULL\b|\"full\"|'full'", test):
            for child in node.orelse:  # the body is a full-mode-only claim; an else branch is not
                self.visit(child)
            return
        self.generic_visit(node)

    def _check(self, expr: ast.AST) -> None:
        if self.exempt[-1]:
            return
        for cmp in _timed_comparisons(expr, self.tainted[-1], self.given[-1]):
            self.found.append(Finding(self.path, cmp.lineno, _text(cmp)))

    def visit_Assert(self, node: ast.Assert) -> None:
        self._check(node.test)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        if name == "require" and node.args:
            self._check(node.args[0])
        self.generic_visit(node)


@functools.lru_cache(maxsize=None)
def scan_source(src: str, path: str = "<source>") -> list[Finding]:
    """Every time-based assertion in a module's source (see the module docstring for the rules)."""
    scanner = _Scanner(src, path)
    scanner.visit(ast.parse(src))
    return list(scanner.found)


def smoke_paths() -> list[Path]:
    """The files whose assertions run in `make test`: the tests, the invariant checks and the exercise checks."""
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "dvi_lite" / "course").rglob("*.py"))
    return files + [ROOT / "dvi_lite" / "study" / "table.py"]


def find_timing_assertions(paths: list[Path]) -> list[Finding]:
    """scan_source over files, each named relative to the repository when it lies inside it."""
    return [f for p in paths for f in scan_source(p.read_text(), str(p.relative_to(ROOT) if p.is_relative_to(ROOT)
                                                                    else p))]


def test_no_time_based_assertion_in_tests_or_smoke_invariants():
    paths = smoke_paths()
    assert len(paths) > 40 and ROOT / "dvi_lite" / "course" / "ch00_foundations.py" in paths
    found = find_timing_assertions(paths)
    assert not found, "time-based assertions (timing claims belong in full mode and benchmarks):\n" + \
        "\n".join(map(str, found))


# ------------------------------------------------------------------ the scanner catches what it must

PLANTED = {
    # the invariant that flaked (notebook 00, before issue 30): a mean of measured v(n) against another
    "v(n) through locals": '''
def check_invariants(vs, memory_bound, compute_bound):
    vm, vc = ({int(n): x for n, x in vs[m].items()} for m in (memory_bound, compute_bound))
    ns = sorted(set(vm) & set(vc))
    mm, mc = (statistics.mean(v[n] for n in ns) for v in (vm, vc))
    require(mm < mc, "not below")
''',
    "speedup bar in a test": '''
def test_sps_is_faster(res):
    assert res["sps"]["speedup_vs_ar"] > 1.0
''',
    "tokens/s of two methods": '''
def test_order(res):
    assert res["sps"]["tokens_per_s"] >= res["ar"]["tokens_per_s"], res
''',
    "a wall-clock window": '''
def test_quick():
    t0 = time.perf_counter()
    run()
    took = time.perf_counter() - t0
    assert took < 2.0
''',
    "setup time within bounds": '''
def test_setup(body):
    assert 9.0 <= body["setup_s"] <= 12.0
''',
    "full-mode guard on the wrong branch": '''
def check(vs, mode):
    if mode == "full":
        pass
    else:
        require(vs["a"][5] < vs["b"][5], "x")
''',
}

ALLOWED = {
    "a sign check": '''
def check(r):
    require(r["tokens_per_s"] > 0, "positive")
    assert r["wall_time_s"] > 0 and 0 < r["speedup_vs_ar"]
''',
    "a full-mode-only claim": '''
def check(vs, mode):
    mm, mc = vs["a"][5], vs["b"][5]
    if mode == "full":
        require(mm < mc, "x")
''',
    "a scripted clock": '''
def test_budget(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: clock["t"])
    assert r.trials[-2]["elapsed_s"] < 0.25
''',
    "a predicted (arithmetic) speedup": '''
def test_formula(rows):
    assert rows[2]["predicted_speedup"] < rows[0]["predicted_speedup"] <= rows[0]["free"]
''',
    "an equality of timings computed from given numbers": '''
def test_rate(st):
    assert st.tokens_per_s == 5.0 and r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar_tps)
''',
    "no timing at all": '''
def test_alpha(r):
    assert 0 <= r["alpha"] <= 1 and r["tau"] >= 1
''',
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_the_scanner_catches_a_planted_timing_assertion(case):
    found = scan_source(PLANTED[case], case)
    assert found, f"the scanner missed a time-based assertion: {case}"


@pytest.mark.parametrize("case", list(ALLOWED))
def test_the_scanner_allows_what_is_not_a_timing_claim(case):
    assert scan_source(ALLOWED[case], case) == []


def test_a_planted_timing_assertion_in_a_scanned_file_fails_the_suite(tmp_path):
    """The suite-level check (find_timing_assertions over the smoke paths) reports a planted file and only it."""
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED["tokens/s of two methods"])
    found = find_timing_assertions([*smoke_paths(), planted])
    assert [f.path for f in found] == [str(planted)] and "tokens_per_s" in found[0].source
