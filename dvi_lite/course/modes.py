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


def check_mode(mode: str) -> tuple[bool, bool]:
    """(smoke, full) for a MODE value; anything else is an error that lists the allowed modes."""
    if mode not in MODES:
        raise ValueError(f"MODE = {mode!r}: allowed are {', '.join(repr(m) for m in MODES)} "
                         "(learner = Run All in about 2 min, smoke = CI, full = make reproduce)")
    return mode == "smoke", mode == "full"
