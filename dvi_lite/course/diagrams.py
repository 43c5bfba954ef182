"""The course's schematic diagrams, hand-built as SVG: `python -m dvi_lite.course.diagrams` writes them.

A tiny `Canvas` (course/svg.py) writes SVG strings (text, box, line, arrow with a marker) and every diagram uses
it (three live in course/diagrams_methods.py); the
output is deterministic (fixed sizes, no timestamps), so tests/test_diagrams.py checks the committed files
equal what this code draws now. Notation as in the course: p = target, q = draft, K = drafts per step,
τ = tokens per target forward, k = the exit layer. Colours: draft blue, target / verify orange,
accepted green, rejected red, learning purple.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dvi_lite.course.diagrams_methods import eagle_features, prompt_lookup_copy, skip_mask
from dvi_lite.course.svg import BLUE, GREEN, GREY, INK, ORANGE, PURPLE, RED, TINT, Canvas, _n
from dvi_lite.paths import ROOT, atomic_write_text

MEDUSA_PARENTS = (-1, 0, 0, 1, 1, 3)  # the candidate tree: node 0 (the next token) is the root
MEDUSA_TOKENS = ("the", "cat", "dog", "sat", "ran", "on")


def draft_verify_loop() -> str:
    """One speculative step: K = 4 drafts, one target forward over K + 1 positions, accept / reject, emit."""
    c = Canvas(1000, 540, "One speculative sampling step (K = 4)")
    col = [200 + 78 * i for i in range(8)]  # token columns: 3 context tokens, x1..x4, the bonus position
    bw, mid = 66, [x + 33 for x in col]
    for y, rows, color in ((100, ["① Draft", "drafter, q"], BLUE), (200, ["② Verify", "target, p"], ORANGE),
                           (318, ["③ Accept?", "min(1, p(x)/q(x))"], GREEN), (428, ["④ Emit"], INK)):
        c.lines(30, y, rows, 15, color, anchor="start", bold_first=True)
    c.text(mid[1], 62, "context", 14, GREY)
    c.text((mid[3] + mid[6]) / 2, 56, "K = 4 drafts, one cheap forward each: xᵢ ~ q", 14, BLUE)
    for i, tok in enumerate(["The", "cat", "sat", "x₁", "x₂", "x₃", "x₄"]):
        c.box(col[i], 82, bw, 36, [tok], GREY if i < 3 else BLUE)
        if i >= 3:
            c.arrow([(mid[i - 1] + 8, 82), (col[i] - 0.5 * (col[i] - col[i - 1] - bw) + 4, 68), (mid[i] - 8, 81)],
                    BLUE, curved=True)
    c.box(col[0], 150, col[7] + bw - col[0], 36, ["target: ONE forward over the context + x₁ … x₄"], ORANGE)
    for i in range(3, 8):
        c.arrow([(mid[i], 186), (mid[i], 212)], ORANGE)
        c.box(col[i], 214, bw, 34, [f"p{'₁₂₃₄₅'[i - 3]}"], ORANGE)
    c.lines(col[0] + 100, 231, ["K + 1 = 5 positions scored:", "pᵢ = p(· | prefix before xᵢ)"], 14, ORANGE)
    verdicts = [("x₁ ✓", GREEN, False), ("x₂ ✓", GREEN, False), ("x₃ ✗", RED, False), ("x₄", GREY, True)]
    for i, (label, color, dashed) in enumerate(verdicts):
        c.arrow([(mid[i + 3], 248), (mid[i + 3], 298)], GREY)
        c.box(col[i + 3], 300, bw, 36, [label], color, dashed=dashed)
    c.text(mid[6], 352, "discarded", 14, GREY, italic=True)
    c.lines(col[7] - 2, 318, ["p₅ unused: a bonus", "token only when", "all K are accepted"], 14, GREY, "start",
            italic=True)
    c.lines(col[0] + 100, 318, ["left to right;", "stop at the first ✗"], 14, GREY)
    for i, (label, color) in enumerate([("x₁", GREEN), ("x₂", GREEN), ("x₃′", ORANGE)]):
        c.arrow([(mid[i + 3], 336), (mid[i + 3], 408)], color if i < 2 else RED)
        c.box(col[i + 3], 410, bw, 36, [label], color)
    c.lines(col[6] - 4, 428, ["x₃ ✗ → x₃′ ~ norm(max(0, p₃ − q₃)):", "the residual, target mass q lacks"], 14,
            RED, anchor="start")
    c.text(mid[4], 468, "the step emits 3 tokens: τ = accepted + 1 = 2 + 1", 15, INK, bold=True)
    c.text(500, 514, "one target forward verifies K drafts; greedy: accept while the draft equals the target's argmax",
           15, GREY, italic=True)
    return c.render()


def kangaroo_split() -> str:
    """Kangaroo: the shallow layers + an adapter draft; the deep layers verify; double early exit."""
    c = Canvas(1080, 640, "Kangaroo: self-drafting from a shallow exit at layer k (no separate draft model)")
    x0, w = 320, 210
    stack = [("embedding", GREY), ("layer 1", BLUE), ("layer 2", BLUE), ("⋮", None), ("layer k", BLUE),
             ("layer k+1", ORANGE), ("⋮", None), ("layer L", ORANGE), ("LM head", ORANGE)]
    ys, y, mid = [], 540.0, x0 + w / 2
    for label, color in stack:  # bottom to top, an arrow into each box
        h = 34 if color else 22
        if ys:
            c.arrow([(mid, y), (mid, y - 14)], GREY, width=1.4)
        y -= h + 14
        ys.append(y + h / 2)
        if color:
            c.box(x0, y, w, h, [label], color)
        else:
            c.text(mid, y + h / 2, label, 16)
    c.box(x0, 566, w, 34, ["input tokens"], GREY)
    c.arrow([(mid, 566), (mid, ys[0] + 17)], GREY)
    for (lo, hi), color, rows in (((1, 4), BLUE, ["shallow sub-network", "layers 1..k: shared by", "draft and target"]),
                                  ((5, 8), ORANGE, ["deep layers k+1..L + LM head", "= the target: once per step,",
                                                    "on all K+1 tokens"])):
        top, bot = ys[hi] - 17, ys[lo] + 17
        c.line([(x0 - 12, top), (x0 - 20, top), (x0 - 20, bot), (x0 - 12, bot)], color, 2)
        c.lines(x0 - 30, (top + bot) / 2, rows, 14, color, anchor="end")
    c.arrow([(mid, ys[8] - 17), (mid, 98)], ORANGE)
    c.box(x0 - 20, 60, w + 40, 38, ["target p at all K+1 positions"], ORANGE, size=14)
    ax, aw, dx = 660, 200, 895  # the draft column, its width, the confidence test's column
    c.arrow([(x0 + w, ys[4]), (ax, ys[4])], BLUE)
    c.text((x0 + w + ax) / 2, ys[4] - 14, "exit ①", 14, BLUE, bold=True)
    c.box(ax, ys[4] - 24, aw, 48, ["adapter", "1 small block + norm"], PURPLE, size=14, bold_first=True)
    c.lines(ax + aw / 2, ys[4] + 46, ["trained; the base", "model is frozen"], 14, PURPLE, italic=True)
    c.arrow([(ax + aw / 2, ys[4] - 24), (ax + aw / 2, ys[8] + 17)], BLUE)
    c.box(ax, ys[8] - 17, aw, 34, ["LM head (shared)"], ORANGE, fill=TINT[BLUE])
    c.line([(x0 + w, ys[8]), (ax, ys[8])], GREY, 1.5, dashed=True)
    c.text((x0 + w + ax) / 2, ys[8] - 14, "same weights", 13, GREY)
    c.arrow([(ax + aw / 2, ys[8] - 17), (ax + aw / 2, 98)], BLUE)
    c.box(ax, 60, aw, 38, ["draft token xᵢ ~ q"], BLUE, size=14)
    c.box(dx, 150, 130, 56, ["top-1 conf", "< η ?"], BLUE, size=14, fill="white")
    c.arrow([(ax + aw, 79), (dx + 65, 79), (dx + 65, 148)], BLUE)
    c.arrow([(dx + 65, 206), (dx + 65, 258)], BLUE)
    c.text(dx + 55, 232, "yes: exit ②", 14, BLUE, anchor="end", bold=True)
    c.box(dx, 260, 130, 86, ["stop drafting", "(this token is", "still kept)", "→ verify"], BLUE, size=14)
    c.arrow([(dx + 130, 178), (1062, 178), (1062, 583), (x0 + w + 2, 583)], BLUE, dashed=True)
    c.text(1044, 164, "no", 14, BLUE, bold=True)
    c.lines(860, 553, ["no, and fewer than K drafts:", "draft the next token"], 14, BLUE)
    c.text(540, 622, "double early exit: in depth at layer k, in length when the draft's top-1 confidence < η", 15,
           GREY, italic=True)
    return c.render()


def ancestors(parents: Sequence[int], i: int) -> set[int]:
    """Node i and every node above it in the tree given by its parent list (-1 = the root)."""
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def medusa_tree() -> str:
    """Medusa: heads on the last hidden state, the candidate tree, the tree-attention mask (from the parents)."""
    c = Canvas(1120, 520, "Medusa: extra heads propose a tree; one forward verifies it")
    par, n = MEDUSA_PARENTS, len(MEDUSA_PARENTS)
    depth = [len(ancestors(par, i)) - 1 for i in range(n)]
    row_y = [130 + 90 * d for d in range(max(depth) + 1)]
    c.box(20, row_y[1] + 10, 110, 70, ["last", "hidden", "state h"], GREY, size=14)
    heads = [("LM head", "token t+1")] + [(f"Medusa head {d}", f"token t+{d + 1}") for d in range(1, len(row_y))]
    for d, (y, rows) in enumerate(zip(row_y, heads, strict=True)):
        c.arrow([(130, row_y[1] + 45), (150, row_y[1] + 45), (150, y), (168, y)], GREY)
        c.box(170, y - 24, 150, 48, rows, ORANGE if d == 0 else BLUE, size=14, bold_first=True)
        for k, i in enumerate(j for j in range(n) if depth[j] == d):
            c.box(340 + 58 * k, y - 16, 52, 32, [MEDUSA_TOKENS[i]], ORANGE if d == 0 else BLUE, size=14)
    c.text(395, 74, "top-s candidates", 14, GREY)
    slot: dict[int, float] = {}  # tree layout: leaves take slots depth-first, a parent sits over its children
    leaves: list[int] = []
    kids = [[j for j in range(n) if par[j] == i] for i in range(n)]

    def place(i: int) -> float:
        slot[i] = sum(place(k) for k in kids[i]) / len(kids[i]) if kids[i] else float(len(leaves))
        if not kids[i]:
            leaves.append(i)
        return slot[i]

    place(0)
    cx = {i: 570 + 95 * s for i, s in slot.items()}
    c.text(665, 74, "candidate tree", 14, GREY)
    for i in range(1, n):
        c.line([(cx[par[i]], row_y[depth[par[i]]] + 17), (cx[i], row_y[depth[i]] - 17)], GREY, 1.8)
    for i in range(n):
        c.box(cx[i] - 32, row_y[depth[i]] - 17, 64, 34, [MEDUSA_TOKENS[i]], ORANGE if i == 0 else BLUE, size=14,
              extra=' class="tree-node"')
        c.raw(f'<circle cx="{_n(cx[i] - 32)}" cy="{_n(row_y[depth[i]])}" r="10" fill="{INK}"/>')
        c.text(cx[i] - 32, row_y[depth[i]], str(i), 13, "white", bold=True)
    gx, gy, cell = 870, 120, 36
    c.text(gx + 3 * cell, 74, "tree-attention mask", 14, GREY)
    c.text(gx + 3 * cell, 92, "key j", 13, GREY)
    for i in range(n):
        c.text(gx + (i + 0.5) * cell, gy - 10, str(i), 13, GREY)
        c.text(gx - 8, gy + (i + 0.5) * cell, f"{i} {MEDUSA_TOKENS[i]}", 13, GREY, anchor="end")
        anc = ancestors(par, i)
        for j in range(n):
            on = j in anc
            c.raw(f'<rect x="{gx + j * cell}" y="{gy + i * cell}" width="{cell}" height="{cell}" '
                  f'fill="{ORANGE if on else "white"}" stroke="#bbbbbb" class="mask-cell {"on" if on else "off"}" '
                  f'data-i="{i}" data-j="{j}"/>')
    c.text(gx - 8, gy - 10, "query i", 13, GREY, anchor="end")
    c.raw(f'<rect x="{gx}" y="{gy + n * cell + 18}" width="16" height="16" fill="{ORANGE}" stroke="#bbbbbb"/>')
    c.text(gx + 24, gy + n * cell + 26, "= j is i or an ancestor of i", 13, GREY, anchor="start")
    c.text(560, 495, "all tree nodes are verified in one forward; each node attends only to its ancestors", 15,
           GREY, italic=True)
    return c.render()


def dvi_loop() -> str:
    """DVI: Draft (shallow exit + LoRA) -> Verify (the full model) -> replay buffer -> Improve -> Draft."""
    c = Canvas(1000, 560, "DVI: Draft → Verify → Improve, learning while serving")
    c.box(40, 70, 360, 140, ["Draft", "shallow exit head (layer k) + LoRA", "proposes K tokens xᵢ ~ q",
                             "the LoRA is draft-only: the target", "stays exact, so decoding is lossless"],
          BLUE, size=14, bold_first=True)
    c.box(600, 70, 360, 140, ["Verify", "the full model (layers 1..L, no LoRA)", "checks the K drafts in one forward",
                              "→ accept/reject bits + target's p", "emits τ = accepted + 1 tokens"],
          ORANGE, size=14, bold_first=True)
    c.box(210, 360, 520, 150, ["Improve", "online update of the draft head's LoRA:",
                               "reward r = accept bit;  KL(p ‖ q) pulls q toward p",
                               "loss = (1 − λₜ)·RL(r) + λₜ·KL(p ‖ q)",
                               "λₜ = max(floor, exp(−t / T_λ)),  T_λ = its time constant"],
          PURPLE, size=14, bold_first=True)
    c.box(790, 395, 170, 80, ["replay buffer", "(state at k, token,", "r, p) per draft"], GREY, size=14,
          bold_first=True)
    c.arrow([(400, 140), (598, 140)], BLUE)
    c.text(499, 124, "K drafts", 14, BLUE, bold=True)
    c.arrow([(875, 210), (875, 393)], ORANGE)
    c.lines(865, 300, ["accept/reject bits", "and p, per draft"], 14, ORANGE, anchor="end")
    c.arrow([(790, 435), (732, 435)], GREY)
    c.arrow([(210, 435), (130, 435), (130, 212)], PURPLE)
    c.lines(142, 300, ["updated LoRA:", "back to Draft"], 14, PURPLE, anchor="start")
    c.text(500, 540, "the target never changes: only the draft head learns, so τ rises while the output stays exact",
           15, GREY, italic=True)
    return c.render()


DIAGRAMS: dict[str, Callable[[], str]] = {"draft_verify_loop": draft_verify_loop, "kangaroo_split": kangaroo_split,
                                          "skip_mask": skip_mask, "medusa_tree": medusa_tree, "dvi_loop": dvi_loop,
                                          "prompt_lookup_copy": prompt_lookup_copy, "eagle_features": eagle_features}


def write_all(out_dir: Path = ROOT / "figures" / "diagrams") -> list[Path]:
    """Write every diagram as <name>.svg under out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in DIAGRAMS.items():
        path = out_dir / f"{name}.svg"
        atomic_write_text(path, draw())
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p)
