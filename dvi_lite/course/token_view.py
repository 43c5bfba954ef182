"""See the speculation happen: the generated text with each token coloured by where it came from.

Every decoding step of the one loop ends with the target's forward over [pending token, draft...]. What that step
adds to the text is the accepted draft tokens, then one token of the target's own: a *bonus* when the whole draft
branch was accepted (nothing left to test), a *correction* when a draft token was rejected. The first new token comes
from the prefill, and a step with nothing drafted (AR) adds only the target's token. τ is the mean number of tokens a
step adds, so a text that is mostly green was cheap.

`origins` reads that story from a run's step records; `html` renders it for a notebook (`show` wraps it for display,
`side_by_side` puts several methods in columns) and `ansi` for a terminal (`python -m dvi_lite generate --show`).
"""
from __future__ import annotations

import html as _html

from dvi_lite.core.engine import Stats

# origin -> (what it is, HTML background, ANSI background)
ORIGINS: dict[str, tuple[str, str, str]] = {
    "first": ("first token, from the prefill", "#e0e0e0", "47"),
    "draft": ("draft token, accepted", "#b7e4b0", "42"),
    "correction": ("target's token after a rejection (correction)", "#f9c49a", "43"),
    "bonus": ("target's token after a fully accepted draft (bonus)", "#a9cdf5", "44"),
    "target": ("target's token, nothing drafted", "#ffffff", "49"),
    "unrecorded": ("a loop that records no steps (HF's generate)", "#ffffff", "49"),
}


def origins(stats: Stats) -> list[str]:
    """One origin (a key of ORIGINS) per new token, from the run's step records, in order."""
    if stats.new_tokens and not stats.steps:
        return ["first"] + ["unrecorded" if stats.new_tokens > 1 else "first"] * (stats.new_tokens - 1)
    out = ["first"]
    for s in stats.steps:
        out += ["draft"] * s.accepted
        out.append("target" if s.drafted == 0 else "bonus" if s.bonus else "correction")
    return out[: stats.new_tokens]  # an EOS or the token budget may cut the last step short


def pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds, decoded in context (a token alone may be half of a character)."""
    out, prev = [], ""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1], skip_special_tokens=True)
        out.append(text[len(prev):])
        prev = text
    return out


def _counts(kinds: list[str]) -> str:
    return ", ".join(f"{k} {kinds.count(k)}" for k in ORIGINS if kinds.count(k))


def summary(result) -> str:
    """'τ 1.84 · 128 tokens: first 1, draft 60, correction 30, bonus 7 ...' for a GenerationResult."""
    tau = result.stats.tau
    return (f"{result.method}: τ {tau:.2f}" if tau is not None else f"{result.method}: τ –") + \
        f" · {result.stats.new_tokens} tokens: {_counts(origins(result.stats))}"


def html(tok, result, title: str | None = None) -> str:
    """The coloured text of one GenerationResult as an HTML fragment, with its legend and τ."""
    spans = []
    for piece, kind in zip(pieces(tok, result.token_ids), origins(result.stats), strict=True):
        text = _html.escape(piece).replace("\n", "↵<br>")
        spans.append(f'<span title="{ORIGINS[kind][0]}" style="background:{ORIGINS[kind][1]}">{text}</span>')
    used = set(origins(result.stats))
    legend = " ".join(f'<span style="background:{c};padding:0 4px">{what}</span>'
                      for k, (what, c, _) in ORIGINS.items() if k in used)
    head = f"<b>{_html.escape(title)}</b> · " if title else ""
    return (f'<div style="font-family:monospace;line-height:1.6;white-space:pre-wrap">{head}'
            f"{_html.escape(summary(result))}<br>{legend}<hr style='margin:4px 0'>{''.join(spans)}</div>")


def side_by_side(tok, results: dict[str, object]) -> str:
    """Several methods' coloured texts in columns (label -> GenerationResult), for the study."""
    cols = "".join(f'<div style="flex:1;min-width:260px;padding:0 8px">{html(tok, r, label)}</div>'
                   for label, r in results.items())
    return f'<div style="display:flex;flex-wrap:wrap;align-items:flex-start">{cols}</div>'


def show(tok, result, title: str | None = None):
    """The HTML view as a displayable object (the last line of a notebook cell)."""
    from IPython.display import HTML

    return HTML(html(tok, result, title))


def ansi(tok, result) -> str:
    """The coloured text for a terminal (ANSI background colours), then a legend line and the summary."""
    out = [f"\x1b[{ORIGINS[k][2]}m{p}\x1b[0m" for p, k in zip(pieces(tok, result.token_ids), origins(result.stats),
                                                               strict=True)]
    used = set(origins(result.stats))
    legend = " ".join(f"\x1b[{a}m {what} \x1b[0m" for k, (what, _, a) in ORIGINS.items() if k in used)
    return "".join(out) + "\n\n" + legend + "\n" + summary(result)
