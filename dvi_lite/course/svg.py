"""A tiny SVG writer for the course's hand-built diagrams: text, boxes, lines and arrows on a fixed canvas.

Deterministic output (fixed sizes, no timestamps), so the committed SVGs can be compared with what the code draws.
Colours: draft blue, target / verify orange, accepted green, rejected red, learning purple.
"""
from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

FONT = "DejaVu Sans, Verdana, Arial, Helvetica, sans-serif"  # wide sans fonts: layouts are sized for these
BLUE, ORANGE, GREEN, RED, PURPLE = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"
GREY, INK = "#7f7f7f", "#222222"
TINT = {BLUE: "#dbe9f6", ORANGE: "#ffe6cc", GREEN: "#d9f0d9", RED: "#f8d7d7", PURPLE: "#ebe1f4", GREY: "#f0f0f0"}
Point = tuple[float, float]


def _n(v: float) -> str:
    """A coordinate as short, stable text."""
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Canvas:
    """A fixed-size SVG drawing with a white background and a heading; `render` returns the document."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width, self.height, self.title = width, height, title
        self.items: list[str] = []
        self.markers: set[str] = set()  # the colours of the arrow heads used
        self.text(30, 28, title, 19, anchor="start", bold=True)

    def text(self, x: float, y: float, s: str, size: int = 15, color: str = INK, anchor: str = "middle",
             bold: bool = False, italic: bool = False) -> None:
        """One line of text; y is the vertical centre of the line (not the baseline)."""
        style = (' font-weight="bold"' if bold else "") + (' font-style="italic"' if italic else "")
        self.items.append(f'<text x="{_n(x)}" y="{_n(y + 0.35 * size)}" font-size="{size}" fill="{color}" '
                          f'text-anchor="{anchor}"{style}>{escape(s)}</text>')

    def lines(self, x: float, y: float, rows: Sequence[str], size: int = 15, color: str = INK,
              anchor: str = "middle", bold_first: bool = False, italic: bool = False) -> None:
        """Several lines centred vertically on y."""
        step = 1.35 * size
        for i, row in enumerate(rows):
            self.text(x, y + (i - (len(rows) - 1) / 2) * step, row, size, color, anchor, bold_first and i == 0,
                      italic)

    def box(self, x: float, y: float, w: float, h: float, rows: Sequence[str] = (), color: str = GREY,
            size: int = 15, bold_first: bool = False, dashed: bool = False, fill: str | None = None,
            extra: str = "") -> None:
        """A rounded box (top-left x, y) in a colour's tint with its rows of text centred inside."""
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        fill = fill or TINT.get(color, "white")
        self.items.append(f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" rx="7" fill="{fill}" '
                          f'stroke="{color}" stroke-width="1.8"{dash}{extra}/>')
        self.lines(x + w / 2, y + h / 2, rows, size, INK, bold_first=bold_first)

    def line(self, pts: Sequence[Point], color: str = GREY, width: float = 1.8, dashed: bool = False,
             arrow: bool = False, curved: bool = False) -> None:
        """A polyline (orthogonal when the points are), or a quadratic curve through 3 points; `arrow` adds a head."""
        cmd = "Q" if curved else "L"
        d = f"M {_n(pts[0][0])} {_n(pts[0][1])} {cmd} " + " ".join(f"{_n(x)} {_n(y)}" for x, y in pts[1:])
        head = f' marker-end="url(#head-{color[1:]})"' if arrow else ""
        if arrow:
            self.markers.add(color)
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        self.items.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}"{dash}{head}/>')

    def arrow(self, pts: Sequence[Point], color: str = GREY, width: float = 1.8, dashed: bool = False,
              curved: bool = False) -> None:
        """`line` with an arrow head at its last point."""
        self.line(pts, color, width, dashed, arrow=True, curved=curved)

    def raw(self, item: str) -> None:
        """Any other SVG element, as written."""
        self.items.append(item)

    def render(self) -> str:
        heads = "".join(f'<marker id="head-{c[1:]}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                        f'markerHeight="7" orient="auto"><path d="M 0 0 L 10 5 L 0 10 z" fill="{c}"/>'
                        f"</marker>" for c in sorted(self.markers))
        w, h = self.width, self.height
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
                f'font-family="{FONT}">', f"<title>{escape(self.title)}</title>", f"<defs>{heads}</defs>",
                f'<rect width="{w}" height="{h}" fill="white"/>')
        return "\n".join([*head, *self.items, "</svg>"]) + "\n"
