"""The committed schematic diagrams (figures/diagrams/*.svg) are what dvi_lite.course.diagrams draws now,
parse as SVG, keep every text inside the picture and apart from the other texts, and Medusa's mask is the
ancestor relation of the tree's parent list."""
from __future__ import annotations

import itertools
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dvi_lite.course.diagrams import DIAGRAMS, MEDUSA_PARENTS, write_all

ROOT = Path(__file__).resolve().parent.parent
FIG_DIR = ROOT / "figures" / "diagrams"
SVG = "{http://www.w3.org/2000/svg}"
REGENERATE = "regenerate with `python -m dvi_lite.course.diagrams` and commit figures/diagrams/"


def parse(name: str) -> ET.Element:
    return ET.fromstring((FIG_DIR / f"{name}.svg").read_text(encoding="utf-8"))


def text_boxes(root: ET.Element) -> list[tuple[str, float, float, float, float]]:
    """(text, left, top, right, bottom) of every <text>, from its anchor and font size: DejaVu Sans is about
    0.6 em wide per character (0.66 bold); the ascent is about 0.75 em above the baseline, the descent 0.25 below."""
    out = []
    for t in root.iter(f"{SVG}text"):
        s, size = "".join(t.itertext()), float(t.get("font-size", "16"))
        x, y = float(t.get("x", "0")), float(t.get("y", "0"))
        w = len(s) * size * (0.66 if t.get("font-weight") == "bold" else 0.6)
        left = {"start": x, "middle": x - w / 2, "end": x - w}[t.get("text-anchor", "start")]
        out.append((s, left, y - 0.75 * size, left + w, y + 0.25 * size))
    return out


def outside(boxes: list, width: float, height: float) -> list[str]:
    return [b[0] for b in boxes if b[1] < 0 or b[2] < 0 or b[3] > width or b[4] > height]


def overlapping(boxes: list) -> list[tuple[str, str]]:
    return [(a[0], b[0]) for a, b in itertools.combinations(boxes, 2)
            if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]]


def test_one_committed_svg_per_diagram():
    assert sorted(p.stem for p in FIG_DIR.glob("*.svg")) == sorted(DIAGRAMS), REGENERATE


@pytest.mark.parametrize("name", list(DIAGRAMS))
def test_committed_svg_is_what_the_code_draws(name):
    path = FIG_DIR / f"{name}.svg"
    assert path.exists(), f"{path} is missing: {REGENERATE}"
    assert path.read_text(encoding="utf-8") == DIAGRAMS[name](), f"{path} is stale: {REGENERATE}"


def test_drawing_is_deterministic_and_write_all_writes_every_diagram(tmp_path):
    paths = write_all(tmp_path)
    assert [p.name for p in paths] == [f"{name}.svg" for name in DIAGRAMS]
    assert all(p.read_text(encoding="utf-8") == DIAGRAMS[p.stem]() for p in paths)


@pytest.mark.parametrize("name", list(DIAGRAMS))
def test_svg_parses_and_keeps_its_text_inside_and_apart(name):
    root = parse(name)
    assert root.tag == f"{SVG}svg"
    x0, y0, width, height = map(float, root.get("viewBox", "").split())
    assert (x0, y0) == (0, 0) and width > 0 and height > 0
    assert root.find(f"{SVG}title") is not None, "a <title> for screen readers"
    boxes = text_boxes(root)
    assert boxes, "no text"
    assert all(float(t.get("font-size")) >= 13 for t in root.iter(f"{SVG}text")), "text smaller than 13px"
    assert not outside(boxes, width, height), f"text outside the viewBox: {outside(boxes, width, height)}"
    assert not overlapping(boxes), f"texts overlap: {overlapping(boxes)}"


def test_the_estimated_text_boxes_catch_an_overlap_and_a_clipped_text():
    """The checks above are not vacuous: two texts at one place overlap, a text past the edge is outside."""
    texts = [(10, 20, "hello"), (30, 22, "world"), (70, 45, "clipped"), (10, 45, "apart")]
    root = ET.fromstring('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 100 50">'
                         + "".join(f'<text x="{x}" y="{y}" font-size="14">{s}</text>' for x, y, s in texts) + "</svg>")
    boxes = text_boxes(root)
    assert overlapping(boxes) == [("hello", "world")]
    assert outside(boxes, 100, 50) == ["clipped"]


def ancestors_or_self(parents: tuple[int, ...], i: int) -> set[int]:
    """Written here again, independently of the module: walk up the parent list."""
    seen = [i]
    while parents[seen[-1]] != -1:
        seen.append(parents[seen[-1]])
    return set(seen)


def test_medusa_mask_is_the_ancestor_relation_of_the_parent_list():
    root = parse("medusa_tree")
    n = len(MEDUSA_PARENTS)
    assert sum(1 for r in root.iter(f"{SVG}rect") if r.get("class") == "tree-node") == n
    cells = {(int(r.get("data-i")), int(r.get("data-j"))): r.get("class") for r in root.iter(f"{SVG}rect")
             if r.get("data-i") is not None}
    assert set(cells) == {(i, j) for i in range(n) for j in range(n)}, "an n x n grid of cells"
    for (i, j), cls in cells.items():
        want = j in ancestors_or_self(MEDUSA_PARENTS, i)
        assert cls == f"mask-cell {'on' if want else 'off'}", (i, j, cls)
    on = {c for c, cls in cells.items() if cls.endswith(" on")}
    assert len(on) == sum(len(ancestors_or_self(MEDUSA_PARENTS, i)) for i in range(n))
    assert all(j <= i for i, j in on), "parents come first: the mask is lower-triangular"
