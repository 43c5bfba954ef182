"""Numbers in the notebooks' prose: a measured number is tied to the results file it comes from, so none goes stale.

A markdown cell states a measured number only with a tag right after it (invisible once rendered):

    Prompt lookup gains 1.33×<!--r 08_results:study.greedy.pld.speedup_vs_ar--> over AR.

`r FILE:KEY.PATH` names `results/FILE.json` and a dotted key path (list items by index; a key may hold spaces, as
"SmolLM2 · bfloat16" does); the number must equal
the JSON value rounded to the decimals written (a `%` multiplies the value by 100 first). A paper's claim is
tagged `<!--paper METHOD-->` and must appear in `study.table.PAPERS[METHOD]["claim"]`.
An untagged number that reads as a measurement fails: a speedup (`1.2×`), an approximation (`≈ 0.3`,
`\\approx 0.3`, `about 7`), a percentage, a time or a rate. Code spans and fenced blocks are not prose.
Most prose needs no number at all: the code cell above it prints the measured one.

After a full run, `refresh` (called by `make reproduce`, or `python -m dvi_lite.study.prose --refresh`) rewrites
every `r`-tagged number from its results file at the decimals written; qualitative words around it ("beats",
"the fastest") are the author's to re-read, which is why `check_notebook` is a test and `refresh` is not automatic
in it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dvi_lite.paths import ROOT

RESULTS = ROOT / "results"
NUM = r"[-−]?\d+(?:\.\d+)?"
TAG = re.compile(rf"(?P<num>{NUM})(?P<unit>\s*(?:×|%)?)[*_]*\s*<!--\s*(?P<kind>r|paper)\s+(?P<ref>[^>]*?)\s*-->")
# what reads as a measured number when it stands untagged
MEASURED = re.compile(
    rf"(?P<speedup>{NUM}\s*×)"
    rf"|(?P<approx>(?:≈|~|\\approx|\babout|\baround|\broughly)\s*\$?\s*{NUM})"
    rf"|(?P<unit>{NUM}\s*(?:%|ms\b|tok/s|tokens/s|min\b|s\b))")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


@dataclass
class Problem:
    """One number in a markdown cell that is stale or untied to any result."""
    cell: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"markdown cell {self.cell}: {self.text!r}: {self.why}"


def lookup(ref: str, results_dir: Path = RESULTS) -> float:
    """The value at `FILE:KEY.PATH` in results/FILE.json."""
    name, _, path = ref.partition(":")
    f = results_dir / f"{name}.json"
    if not f.is_file() or not path:
        raise KeyError(f"tag 'r {ref}': expected FILE:KEY.PATH with results/FILE.json present")
    node = json.loads(f.read_text())
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    if not isinstance(node, (int, float)):
        raise KeyError(f"tag 'r {ref}': {path} is {type(node).__name__}, not a number")
    return float(node)


def _check_tag(m: re.Match, results_dir: Path) -> str | None:
    """None when the tagged number agrees with its source, else why not."""
    text, unit = m["num"].replace("−", "-"), m["unit"].strip()
    shown = float(text)
    if m["kind"] == "paper":
        from dvi_lite.study.table import PAPERS

        claim = PAPERS.get(m["ref"], {}).get("claim", "")
        return None if text in claim else f"not in PAPERS[{m['ref']!r}]['claim'] = {claim!r}"
    try:
        value = lookup(m["ref"], results_dir) * (100 if unit == "%" else 1)
    except (KeyError, IndexError, ValueError) as e:
        return str(e)
    decimals = len(text.partition(".")[2])
    return None if round(value, decimals) == shown else f"results say {value:.{decimals + 2}f}"


def check_markdown(source: str, cell: int = 0, results_dir: Path = RESULTS) -> list[Problem]:
    """The problems of one markdown cell: tags that disagree with results, and untagged measured numbers."""
    prose = CODE.sub(lambda m: " " * len(m.group()), source)
    problems, tagged = [], []
    for m in TAG.finditer(prose):
        tagged.append(m.span())
        why = _check_tag(m, results_dir)
        if why:
            problems.append(Problem(cell, m.group(), why))
    for m in MEASURED.finditer(prose):
        if not any(a <= m.start() < b for a, b in tagged):
            problems.append(Problem(cell, m.group(), "a measured-looking number with no <!--r FILE:KEY--> tag"))
    return problems


def check_notebook(path: Path, results_dir: Path = RESULTS) -> list[Problem]:
    """Every markdown cell of a notebook (reference cells included)."""
    nb = json.loads(Path(path).read_text())
    out: list[Problem] = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == "markdown":
            src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            out += check_markdown(src, i, results_dir)
    return out


def _refreshed(m: re.Match, results_dir: Path) -> str:
    """The tag with its number rewritten from results (same decimals, same unit); paper tags unchanged."""
    if m["kind"] != "r":
        return m.group()
    text, unit = m["num"], m["unit"].strip()
    decimals = len(text.partition(".")[2])
    value = lookup(m["ref"], results_dir) * (100 if unit == "%" else 1)
    new = f"{value:.{decimals}f}"
    return new + m.group()[len(text):]


def refresh_notebook(path: Path, results_dir: Path = RESULTS) -> list[tuple[str, str]]:
    """Rewrite every r-tagged number in the notebook's markdown from its results file; returns (old, new) pairs
    that changed. Code spans are left alone (a tag never sits in one)."""
    path = Path(path)
    nb = json.loads(path.read_text())
    changed: list[tuple[str, str]] = []
    for c in nb["cells"]:
        if c["cell_type"] != "markdown":
            continue
        src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])

        def sub(m: re.Match) -> str:
            new = _refreshed(m, results_dir)
            if new != m.group():
                changed.append((m.group(), new))
            return new

        new_src = TAG.sub(sub, src)
        if new_src != src:
            c["source"] = new_src.splitlines(keepends=True)
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dvi_lite.study.prose", description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true", help="rewrite the tagged numbers from results/ first")
    args = ap.parse_args(argv)
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bad = 0
    for nb in notebooks:
        for old, new in refresh_notebook(nb) if args.refresh else []:
            print(f"{nb.name}: {old} -> {new}")
        for problem in check_notebook(nb):
            bad += 1
            print(f"{nb.name}: {problem}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
