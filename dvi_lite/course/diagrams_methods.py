"""Three more of the course's diagrams: Draft & Verify's skip mask, prompt lookup's copy, EAGLE's feature drafting.

Drawn with course.svg's Canvas and registered in course.diagrams (which writes every diagram). Notation as in the
course: p = target, q = draft, K = drafts per step, k = an exit layer, c = the draft's cost per token.
"""
from __future__ import annotations

from dvi_lite.course.svg import BLUE, GREEN, GREY, ORANGE, PURPLE, RED, TINT, Canvas

N_LAYERS = 30  # SmolLM2-135M's layers
SKIP_ATTN = (7, 11, 15, 19, 23)  # an example skip set (10 of 60 sub-layers, 1/6), not a searched one
SKIP_MLP = (9, 13, 17, 21, 25)
PLD_TOKENS = ("The", "report", "says", "sales", "rose", "12", "%", "in", "May", ".", "So", "sales", "rose")
PLD_MATCH = (3, 5)  # the earlier occurrence of the text's last two tokens ("sales rose")


def skip_mask() -> str:
    """Draft & Verify: the draft is the target itself with some sub-layers skipped; the skip set is the mask."""
    c = Canvas(1000, 400, "Draft & Verify: the draft is the target with sub-layers skipped")
    x0, cw, ch = 150, 26, 34  # the grid: one column per layer, a row for attention and one for the MLP
    c.lines(130, 128, ["attention"], 15, ORANGE, anchor="end")
    c.lines(130, 170, ["MLP"], 15, ORANGE, anchor="end")
    for i in range(N_LAYERS):
        for row, (y, skipped) in enumerate(((111, SKIP_ATTN), (153, SKIP_MLP))):
            off = i in skipped
            extra = f' class="skip-cell {"off" if off else "on"}" data-layer="{i}" data-row="{row}"'
            c.box(x0 + i * cw, y, cw - 4, ch, (), RED if off else ORANGE, dashed=off, fill="white" if off else None,
                  extra=extra)
        if i % 5 == 0 or i == N_LAYERS - 1:
            c.text(x0 + i * cw + (cw - 4) / 2, 206, str(i), 13, GREY)
    c.text(x0 + N_LAYERS * cw / 2, 82, f"layer 0 … {N_LAYERS - 1}: orange runs in the draft, dashed red is skipped",
           14, GREY)
    c.box(60, 240, 270, 70, ["draft: the same weights,", "fewer sub-layers, K tokens"], BLUE, size=14)
    c.box(365, 240, 270, 70, ["verify: every sub-layer,", "one forward over K + 1 tokens"], ORANGE, size=14)
    c.box(670, 240, 270, 70, ["no second model,", "no training: search the set"], PURPLE, size=14)
    c.text(500, 345, "c = (embedding + head + kept sub-layers) / the whole forward: the head and the overhead stay",
           15, GREY, italic=True)
    c.text(500, 375, f"this example skips {len(SKIP_ATTN) + len(SKIP_MLP)} of {2 * N_LAYERS} sub-layers; "
           "more skipped = cheaper drafts that agree less", 15, GREY, italic=True)
    return c.render()


def prompt_lookup_copy() -> str:
    """Prompt lookup: the last n tokens match earlier text, and what followed there is proposed as the draft."""
    c = Canvas(1000, 400, "Prompt lookup: draft by copying what followed an earlier match")
    x, w, y = 30, 70, 110
    for i, tok in enumerate(PLD_TOKENS):
        match = PLD_MATCH[0] <= i < PLD_MATCH[1] or i >= len(PLD_TOKENS) - 2
        copied = PLD_MATCH[1] <= i < PLD_MATCH[1] + 4
        color = BLUE if match else GREEN if copied else GREY
        c.box(x + i * (w + 4), y, w, 36, [tok], color, size=14)
    last = x + (len(PLD_TOKENS) - 1) * (w + 4) + w / 2
    c.text(x + 2 * (w + 4), 80, "the prompt (or the answer so far)", 14, GREY)
    c.text(last - w / 2, 80, "the text now", 14, BLUE)
    src = x + PLD_MATCH[1] * (w + 4)
    c.line([(src, 150), (src, 170), (src + 4 * (w + 4) - 4, 170), (src + 4 * (w + 4) - 4, 150)], GREEN, 2)
    c.arrow([(src + 2 * (w + 4), 172), (src + 2 * (w + 4), 208)], GREEN)
    for j, tok in enumerate(PLD_TOKENS[PLD_MATCH[1]:PLD_MATCH[1] + 4]):
        c.box(src + j * (w + 4), 210, w, 36, [tok], GREEN, size=14, dashed=True)
    c.lines(src + 4 * (w + 4) + 10, 228, ["K = 4 draft tokens:", "one forward checks them"], 14, GREEN, "start")
    c.box(60, 280, 270, 62, ["match the last n tokens", "(n = 3, 2, then 1)"], BLUE, size=14)
    c.box(365, 280, 270, 62, ["copy what followed the", "most recent match"], GREEN, size=14)
    c.box(670, 280, 270, 62, ["no draft model: c ≈ 0;", "no match: an AR step"], PURPLE, size=14)
    c.text(500, 375, "it pays where answers repeat their prompt: summaries, retrieval answers, translations, code",
           15, GREY, italic=True)
    return c.render()


def eagle_features() -> str:
    """EAGLE: the target's own features from three layers, fused, drive one small decoder layer that drafts."""
    c = Canvas(1000, 520, "EAGLE: drafting from the target's own features")
    c.box(40, 70, 250, 300, (), ORANGE)
    c.text(165, 92, "the target (verify forward)", 14, ORANGE, bold=True)
    for i, (label, y) in enumerate((("layer 27 (high)", 135), ("layer 15 (middle)", 215), ("layer 2 (low)", 295))):
        c.box(70, y, 190, 40, [label], ORANGE, size=14, extra=f' class="fused-layer" data-rank="{i}"')
        c.arrow([(260, y + 20), (372, 230)], ORANGE)
    c.box(375, 200, 170, 60, ["fuse: concat", "+ linear → D"], PURPLE, size=14)
    c.box(620, 340, 170, 44, ["embed(next token)"], GREY, size=14)
    c.arrow([(545, 230), (600, 230)], PURPLE)
    c.arrow([(735, 340), (735, 272)], GREY)
    c.box(602, 200, 170, 70, ["one decoder layer", "(its own KV cache)"], BLUE, size=14, bold_first=True)
    c.arrow([(772, 235), (820, 235)], BLUE)
    c.box(822, 205, 150, 60, ["trimmed head", "(8k tokens)"], BLUE, size=14)
    c.arrow([(897, 205), (897, 140)], BLUE)
    c.box(822, 95, 150, 44, ["draft token, q"], BLUE, size=14)
    c.arrow([(640, 270), (640, 310), (460, 310), (460, 262)], BLUE, dashed=True)
    c.lines(350, 345, ["its output g replaces the fused", "feature at the next draft step"], 14, BLUE, "start")
    c.box(40, 400, 250, 50, ["fused features come free", "with every verify forward"], ORANGE, size=14,
          fill=TINT[ORANGE])
    c.text(500, 490, "training-time test: trained on its own g for steps 2…K, as it drafts, so errors do not compound",
           14, GREEN, italic=True)
    c.text(560, 155, "features, not tokens: the next token is already in them", 14, PURPLE, italic=True)
    return c.render()
