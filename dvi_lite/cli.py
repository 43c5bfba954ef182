"""What every `python -m dvi_lite.<module>` command line shares: the provenance string and clear errors.

A bad flag or a bad input file must end in argparse's one-line usage error naming the parameter, never a
traceback from deep inside torch, so the training CLIs route their checks and exceptions through here.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command as typed, for the provenance of what it writes."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def require_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """`--name must be >= 1` for each integer flag that counts something (steps, heads, ...)."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def run_or_usage_error(ap: argparse.ArgumentParser, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a ValueError or FileNotFoundError (bad config, missing checkpoint) becomes a usage error."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
