"""The three run modes of every notebook, read from its papermill `MODE` parameter.

- "learner" (the committed default, what Run All gets): about 2 min per notebook on 2 CPU cores. It uses
  the committed trained pieces and the real model where full mode does, on fewer prompts and tokens, and
  writes its results and figures only to build/.
- "smoke": the CI run (`make test`), toy sizes on the course model, also only into build/.
- "full": `make reproduce`, the sizes in the parameters cell; it writes results/ and figures/ and is the
  run whose outputs the committed notebooks show.
"""
from __future__ import annotations

MODES = ("learner", "smoke", "full")
_current: str | None = None  # the MODE the running notebook checked last (None: no notebook checked one)


def check_mode(mode: str) -> tuple[bool, bool]:
    """(smoke, full) for a MODE value; anything else is an error that lists the allowed modes.

    The mode is also recorded for `current_mode`: every notebook calls this right after its parameters, so
    the invariant checks its last cell calls can tell full mode from smoke without a change to that cell.
    """
    global _current
    if mode not in MODES:
        raise ValueError(f"MODE = {mode!r}: allowed are {', '.join(repr(m) for m in MODES)} "
                         "(learner = Run All in about 2 min, smoke = CI, full = make reproduce)")
    _current = mode
    return mode == "smoke", mode == "full"


def current_mode() -> str | None:
    """The MODE the last `check_mode` call accepted in this process (a notebook's kernel), None before any.

    Why: timing claims (one machine's v(n) against another's, speedups) are checked in full mode only, where
    `make reproduce` measures with its repeats on a quiet machine; smoke and learner runs share the machine
    (pytest-xdist workers, a learner's laptop), so there they check only correctness, shapes and signs.
    """
    return _current
