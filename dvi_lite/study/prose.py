"""Numbers in the notebooks' prose: a measured number is tied to the results file it comes from, so none goes stale.

A markdown cell states a measured number only with a tag right after it (invisible once rendered):

    Prompt lookup gains 1.33×<!--r 08_results:study.greedy.pld.speedup_vs_ar--> over AR.

`r FILE:KEY.PATH` names `results/FILE.json` and a dotted key path (list items by index; a key may hold spaces, as
"SmolLM2 · bfloat16" does, or dots, as "T=1.0" does: the longest matching key wins); the number must equal
the JSON value rounded to the decimals written (a `%` multiplies the value by 100 first). A paper's claim is
tagged `<!--paper METHOD-->` and must appear in `study.table.PAPERS[METHOD]["claim"]`.
An untagged number that reads as a measurement fails: a speedup (`1.2×`), an approximation (`≈ 0.3`,
`\\approx 0.3`, `about 7`), a percentage, a time or a rate. Code spans and fenced blocks are not prose.
Most prose needs no number at all: the code cell above it prints the measured one.

A comparison in prose is a claim, tagged right after it and checked the same way:

    SpS's interval lies above HF assisted's<!--c 08_results:methods.sps.speedup_interval.0 >
    08_results:methods.hf_assisted.speedup_interval.1-->, and Medusa's holds 1<!--c
    08_results:methods.medusa.speedup_interval.0 <= 1 <= 08_results:methods.medusa.speedup_interval.1-->.

`c EXPR`: comparisons (`<`, `<=`, `>`, `>=`, chained) between `FILE:KEY.PATH` values, numbers and products
(`2 * FILE:KEY.PATH`), joined by `and`; `<!--c FILE: a.b > c.d-->` names the file once for every operand
without one. The build fails when one is false. "A beats B" is written against the
intervals (A's lower end above B's upper end), so a claim an interval leaves undecided fails too. `<!--c idea-->`
marks a sentence about a method or the lesson rather than this run's numbers. `untagged_claims` lists the sentences
that use a comparison word ("faster", "beats", "above 1", ...) with no `c` tag, for the notebooks held to that
(CLAIMED).

After a full run, `refresh` (called by `make reproduce`, or `python -m dvi_lite.study.prose --refresh`) rewrites
every `r`-tagged number from its results file at the decimals written; qualitative words around it ("beats",
"the fastest") are the author's to re-read, which is why `check_notebook` is a test and `refresh` is not automatic
in it.
"""
from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dvi_lite.paths import ROOT, atomic_write_text

RESULTS = ROOT / "results"
Dirs = Path | Sequence[Path]  # one results folder, or several searched in order (a run's stage, then results/)
NUM = r"[-−]?\d+(?:\.\d+)?"
TAG = re.compile(rf"(?P<num>{NUM})(?P<unit>\s*(?:×|%)?)[*_]*\s*<!--\s*(?P<kind>r|paper)\s+(?P<ref>[^>]*?)\s*-->")
# what reads as a measured number when it stands untagged
MEASURED = re.compile(
    rf"(?P<speedup>{NUM}\s*×)"
    rf"|(?P<approx>(?:≈|~|\\approx|\babout|\baround|\broughly)\s*\$?\s*{NUM})"
    rf"|(?P<unit>{NUM}\s*(?:%|ms\b|tok/s|tokens/s|min\b|s\b))")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
CLAIM = re.compile(r"<!--\s*c\s+(?P<expr>.*?)\s*-->", re.S)
COMPARE = re.compile(r"\s*(<=|>=|<|>)\s*")
# words that state a comparison or an ordering: a sentence using one carries a `c` tag (in the notebooks of CLAIMED)
COMPARISON_WORDS = re.compile(
    r"\b(?:faster|slower|beats?|highest|lowest|best|worst|gains? most|outperforms?|above 1|below 1|"
    r"holds? 1|level with|overlaps?|does not overlap|more than|less than|higher|lower)\b", re.I)
CLAIMED: tuple[str, ...] = ("00_foundations", "01_speculative_sampling", "02_kangaroo_early_exit",
                            "03_draft_and_verify", "04_medusa_trees", "05_dvi", "06_prompt_lookup", "07_eagle",
                            "08_results")  # notebooks whose comparison sentences all carry `c` tags


@dataclass
class Problem:
    """One number in a markdown cell that is stale or untied to any result."""
    cell: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"markdown cell {self.cell}: {self.text!r}: {self.why}"


def _dirs(results_dir: Dirs) -> list[Path]:
    return [Path(results_dir)] if isinstance(results_dir, (str, Path)) else [Path(d) for d in results_dir]


def numeric_keys(node, prefix: str = "") -> list[str]:
    """Every dotted key path to a number in a results file (list items by index)."""
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [prefix]
    items = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else []
    return [k for key, v in items for k in numeric_keys(v, f"{prefix}.{key}" if prefix else str(key))]


def nearest_keys(name: str, path: str, results_dir: Dirs = RESULTS, n: int = 3) -> list[str]:
    """The results file's numeric key paths closest to `path`: what a stale tag most likely meant."""
    for d in _dirs(results_dir):
        f = d / f"{name}.json"
        if f.is_file():
            return difflib.get_close_matches(path, numeric_keys(json.loads(f.read_text())), n=n, cutoff=0.0)
    return []


def lookup(ref: str, results_dir: Dirs = RESULTS) -> float:
    """The value at `FILE:KEY.PATH` in FILE.json, from the first of `results_dir` that holds the file."""
    name, _, path = ref.partition(":")
    f = next((d / f"{name}.json" for d in _dirs(results_dir) if (d / f"{name}.json").is_file()), None)
    if f is None or not path:
        raise KeyError(f"tag 'r {ref}': expected FILE:KEY.PATH with results/FILE.json present")
    node = json.loads(f.read_text())
    parts = path.split(".")
    while parts:  # a key may hold dots ("T=1.0", "threshold=0.4"): the longest run of parts that is a key wins
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if isinstance(node, dict) and key in node:
                node, parts = node[key], parts[n:]
                break
            if isinstance(node, list) and n == 1 and key.isdigit() and int(key) < len(node):
                node, parts = node[int(key)], parts[1:]
                break
        else:
            near = ", ".join(nearest_keys(name, path, results_dir)) or "none"
            raise KeyError(f"tag 'r {ref}': {f.name} has no key {parts[0]!r} on that path; nearest keys: {near}")
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise KeyError(f"tag 'r {ref}': {path} is {type(node).__name__}, not a number")
    return float(node)


def _check_tag(m: re.Match, results_dir: Dirs) -> str | None:
    """None when the tagged number agrees with its source, else why not."""
    text, unit = m["num"].replace("−", "-"), m["unit"].strip()
    shown = float(text)
    if m["kind"] == "paper":
        from dvi_lite.study.table import PAPERS

        claim = PAPERS.get(m["ref"], {}).get("claim", "")
        return None if text in claim else f"not in PAPERS[{m['ref']!r}]['claim'] = {claim!r}"
    try:
        value = lookup(m["ref"], results_dir) * (100 if unit == "%" else 1)
    except KeyError as e:
        return e.args[0]
    decimals = len(text.partition(".")[2])
    return None if round(value, decimals) == shown else f"results say {value:.{decimals + 2}f}"


def _is_number(text: str) -> bool:
    try:
        float(text.replace("−", "-"))
    except ValueError:
        return False
    return True


def _operand(text: str, results_dir: Dirs, default: str | None = None) -> float:
    if "*" in text:  # a product: "2 * FILE:KEY" (twice a value)
        a, _, b = (x.strip() for x in text.partition("*"))
        return _operand(a, results_dir, default) * _operand(b, results_dir, default)
    if _is_number(text):
        return float(text.replace("−", "-"))
    named = any((d / f"{text.partition(':')[0]}.json").is_file() for d in _dirs(results_dir))
    return lookup(text if named or default is None else f"{default}:{text}", results_dir)  # keys may hold ":"


def check_claim(expr: str, results_dir: Dirs = RESULTS) -> str | None:
    """None when every comparison in a `c` tag's expression holds, else which one fails and with what values."""
    if expr.strip() == "idea":  # a statement about a method or the lesson, not about this run's numbers
        return None
    expr = " ".join(expr.split())
    m = re.match(r"^(?P<file>[\w./-]+):\s+(?P<rest>.*)$", expr)
    default = m["file"] if m else None  # "FILE: a.b > c.d": operands without a FILE are keys into FILE
    for term in re.split(r"\s+and\s+", m["rest"] if m else expr):
        parts = COMPARE.split(term)  # [operand, op, operand, op, operand ...]
        if len(parts) < 3 or len(parts) % 2 == 0:
            return f"claim {term!r}: expected A < B (chains and 'and' allowed)"
        try:
            vals = [_operand(x, results_dir, default) for x in parts[::2]]
        except KeyError as e:
            return e.args[0]
        for i in range(len(vals) - 1):
            (a, op, b), (x, y) = parts[2 * i: 2 * i + 3], vals[i: i + 2]
            if not {"<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]:
                return f"claim false: {a} = {x:.4g} {op} {b} = {y:.4g} does not hold"
    return None


def untagged_claims(source: str) -> list[str]:
    """The sentences of a markdown cell that state a comparison (COMPARISON_WORDS) with no `c` tag in them."""
    prose = CODE.sub(lambda m: " " * len(m.group()), source)
    prose = re.sub(r"<!--\s*(?:r|paper)\s[^>]*?-->", "", prose)
    prose = re.sub(r"(?m)^#.*$", "", prose)  # headings name a topic; they claim nothing
    out = []
    for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z*(])|\n\s*\n|\n-\s", prose):
        if COMPARISON_WORDS.search(CLAIM.sub("", sentence)) and not CLAIM.search(sentence):
            out.append(" ".join(sentence.split())[:160])
    return out


def check_markdown(source: str, cell: int = 0, results_dir: Dirs = RESULTS) -> list[Problem]:
    """The problems of one markdown cell: tags that disagree with results, untagged measured numbers, and claim
    tags whose comparison does not hold."""
    prose = CODE.sub(lambda m: " " * len(m.group()), source)
    problems, tagged = [], []
    for m in CLAIM.finditer(prose):
        why = check_claim(m["expr"], results_dir)
        if why:
            problems.append(Problem(cell, m.group()[:120], why))
    for m in TAG.finditer(prose):
        tagged.append(m.span())
        why = _check_tag(m, results_dir)
        if why:
            problems.append(Problem(cell, m.group(), why))
    for m in MEASURED.finditer(prose):
        if not any(a <= m.start() < b for a, b in tagged):
            problems.append(Problem(cell, m.group(), "a measured-looking number with no <!--r FILE:KEY--> tag"))
    return problems


def shows_something(cell: dict) -> bool:
    """A code cell whose outputs a learner reads: a figure, an HTML or markdown view (a table, a token view), or a
    printed table (a stream of four lines or more)."""
    for o in cell.get("outputs", []):
        if set(o.get("data", {})) & {"image/png", "image/svg+xml", "text/html", "text/markdown",
                                      "application/vnd.plotly.v1+json"}:
            return True
        if o.get("output_type") == "stream" and "".join(o.get("text", "")).count("\n") >= 4:
            return True
    return False


def undiscussed(path: Path) -> list[int]:
    """Code cells that show something (shows_something) with no discussion right after them: the next cell is not
    a markdown cell, or it opens with a heading (a new section)."""
    cells = json.loads(Path(path).read_text())["cells"]
    out = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "code" or not shows_something(c):
            continue
        nxt = cells[i + 1] if i + 1 < len(cells) else None
        if nxt is None or nxt["cell_type"] != "markdown" or _markdown(nxt).lstrip().startswith("#"):
            out.append(i)
    return out


def check_notebook(path: Path, results_dir: Dirs = RESULTS) -> list[Problem]:
    """Every markdown cell of a notebook (reference cells included)."""
    nb = json.loads(Path(path).read_text())
    out: list[Problem] = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == "markdown":
            src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            out += check_markdown(src, i, results_dir)
    return out


def _refreshed(m: re.Match, results_dir: Dirs) -> str:
    """The tag with its number rewritten from results (same decimals, same unit); paper tags unchanged."""
    if m["kind"] != "r":
        return m.group()
    text, unit = m["num"], m["unit"].strip()
    decimals = len(text.partition(".")[2])
    value = lookup(m["ref"], results_dir) * (100 if unit == "%" else 1)
    new = f"{value:.{decimals}f}"
    return new + m.group()[len(text):]


def _markdown(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def tag_refs(path: Path) -> list[tuple[int, str]]:
    """(markdown cell, FILE:KEY.PATH) of every `r` tag in a notebook's prose."""
    nb = json.loads(Path(path).read_text())
    return [(i, m["ref"]) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
            for m in TAG.finditer(CODE.sub(lambda x: " " * len(x.group()), _markdown(c))) if m["kind"] == "r"]


def unresolved_tags(paths: Sequence[Path], results_dir: Dirs = RESULTS,
                    files: set[str] | None = None) -> list[str]:
    """Every `r` tag of these notebooks whose key is not a number in its results file (only tags into `files`
    when given), as 'NOTEBOOK cell N: <!--r REF-->: why, nearest keys'. Empty when all resolve."""
    out = []
    for path in paths:
        for cell, ref in tag_refs(path):
            if files is not None and ref.partition(":")[0] not in files:
                continue
            try:
                lookup(ref, results_dir)
            except KeyError as e:
                out.append(f"{Path(path).name} markdown cell {cell}: <!--r {ref}-->: {e.args[0]}")
    return out


class StaleTags(RuntimeError):
    """Prose tags that do not resolve: the refresh changed nothing."""


def _refreshed_notebook(path: Path, results_dir: Dirs) -> tuple[dict, list[tuple[str, str]]]:
    nb = json.loads(Path(path).read_text())
    changed: list[tuple[str, str]] = []
    for c in nb["cells"]:
        if c["cell_type"] != "markdown":
            continue
        src = _markdown(c)

        def sub(m: re.Match) -> str:
            new = _refreshed(m, results_dir)
            if new != m.group():
                changed.append((m.group(), new))
            return new

        new_src = TAG.sub(sub, src)
        if new_src != src:
            c["source"] = new_src.splitlines(keepends=True)
    return nb, changed


def refresh_notebook(path: Path, results_dir: Dirs = RESULTS) -> list[tuple[str, str]]:
    """Rewrite every r-tagged number in the notebook's markdown from its results file; returns (old, new) pairs
    that changed. Code spans are left alone (a tag never sits in one). A tag that does not resolve raises
    StaleTags before the file is touched."""
    return refresh_notebooks([path], results_dir)[Path(path)]


def refresh_notebooks(paths: Sequence[Path], results_dir: Dirs = RESULTS) -> dict[Path, list[tuple[str, str]]]:
    """refresh_notebook for several notebooks, all or nothing: every tag of every notebook is checked first;
    if any fails, StaleTags lists them all and no file changes. Each rewritten notebook is replaced atomically."""
    bad = unresolved_tags(paths, results_dir)
    if bad:
        raise StaleTags("prose tags that do not resolve (no notebook was changed):\n  " + "\n  ".join(bad))
    done = {Path(p): _refreshed_notebook(Path(p), results_dir) for p in paths}
    for path, (nb, changed) in done.items():
        if changed:
            atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return {path: changed for path, (_, changed) in done.items()}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dvi_lite.study.prose", description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true", help="rewrite the tagged numbers from results/ first")
    args = ap.parse_args(argv)
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bad = 0
    if args.refresh:
        try:
            for nb, changed in refresh_notebooks(notebooks).items():
                for old, new in changed:
                    print(f"{nb.name}: {old} -> {new}")
        except StaleTags as e:
            print(e)
            return 1
    for nb in notebooks:
        for problem in check_notebook(nb):
            bad += 1
            print(f"{nb.name}: {problem}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
