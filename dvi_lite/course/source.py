"""Show the mechanism: a function's or a method's source, as it runs in the package, inside a notebook.

The best courses build the mechanism in view. The chapters call `show(obj)` on the few functions a lesson is
about (the verify chain, the adapter's forward, the DVI loss, the prompt-lookup proposer, the training-time test):
the learner reads the very code the measurements came from, not a copy that could drift from it.

    from dvi_lite.course.source import show
    from dvi_lite.core.verify import verify_sampling_chain
    show(verify_sampling_chain)                    # highlighted, with where it lives
    show(PromptLookupDrafter.lookup, lines=(1, 12))  # only part of it
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path


def source(obj, lines: tuple[int, int] | None = None, docstring: bool = True) -> str:
    """The source of a function, method or class, dedented; `lines` = (first, last), 1-based and inclusive, keeps
    part of it; docstring=False drops the docstring (the notebook's prose says it)."""
    try:
        text = inspect.getsource(obj)
    except (TypeError, OSError) as e:
        raise ValueError(f"obj: no Python source for {obj!r} ({e}); give a function, method or class") from e
    rows = textwrap.dedent(text).rstrip("\n").splitlines()
    if not docstring and getattr(obj, "__doc__", None):
        rows = _without_docstring(rows)
    if lines is not None:
        first, last = lines
        if not (1 <= first <= last <= len(rows)):
            raise ValueError(f"lines must be (first, last) with 1 <= first <= last <= {len(rows)}, got {lines}")
        rows = rows[first - 1:last]
    return "\n".join(rows)


def _without_docstring(rows: list[str]) -> list[str]:
    """The rows with the first triple-quoted block after the signature removed."""
    for i, row in enumerate(rows):
        s = row.strip()
        if s.startswith(('"""', "'''")):
            quote = s[:3]
            end = i if s.count(quote) >= 2 and len(s) > 3 else next(
                (j for j in range(i + 1, len(rows)) if quote in rows[j]), i)
            return rows[:i] + rows[end + 1:]
    return rows


def where(obj) -> str:
    """'dvi_lite/core/verify.py, line 42': where the code lives in the package."""
    f = Path(inspect.getsourcefile(obj) or "?")
    parts = f.parts
    rel = Path(*parts[parts.index("dvi_lite"):]) if "dvi_lite" in parts else f.name
    return f"{rel}, line {inspect.getsourcelines(obj)[1]}"


def show(obj, lines: tuple[int, int] | None = None, docstring: bool = True):
    """The source as a highlighted code block for a notebook (IPython's Code), headed by where it lives."""
    from IPython.display import Code, Markdown, display

    display(Markdown(f"`{getattr(obj, '__qualname__', obj)}` — {where(obj)}"))
    return Code(source(obj, lines, docstring), language="python")
