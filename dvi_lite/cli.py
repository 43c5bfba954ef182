"""The one command line, `python -m dvi_lite <command> ...` (or `dvi-lite <command> ...`).

The table of commands and the helpers the commands share live in `dvi_lite.commands`, at the bottom of the
package's layers; this module sits on top: it imports a command's module only when that command runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable

from dvi_lite.commands import COMMANDS, PROG, prog


def load(command: str) -> Callable[[list[str]], Any]:
    """The main function of a command (imports its module now)."""
    module, fn = COMMANDS[command][0].split(":")
    return getattr(importlib.import_module(module), fn)


def parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{summary}" for name, (_, summary) in COMMANDS.items())
    ap = argparse.ArgumentParser(prog=PROG, usage=f"{PROG} [-h] command [args ...]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Speculative decoding course and study: one command line.",
                                 epilog=f"commands:\n{listing}\n\n`{PROG} <command> --help` shows a command's options.")
    ap.add_argument("command", choices=list(COMMANDS), metavar="command", help="one of the commands below, "
                    "followed by its own arguments")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Dispatch `<command> args...` to the command's main(args); its return value is the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # the command parses its own flags, --help included
        command, rest = argv[0], argv[1:]
    else:  # --help, no command, or an unknown one: argparse says so and exits
        command, rest = parser().parse_args(argv[:1]).command, argv[1:]
    try:
        result = load(command)(rest)
    except KeyboardInterrupt:
        print(f"{prog(command)}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last guard: a user of the command line never sees a traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{prog(command)}: error: {unexpected(e)}\n(set {TRACEBACK_ENV}=1 to see where it came from)",
              file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


TRACEBACK_ENV = "DVI_TRACEBACK"


def unexpected(e: BaseException) -> str:
    """One line for an error that no check caught: what kind, and its message's first line."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = {MemoryError: "out of memory", PermissionError: "permission denied",
            IsADirectoryError: "a folder where a file is needed", NotADirectoryError: "a file where a folder is needed",
            FileNotFoundError: "no such file", UnicodeDecodeError: "a file that is not UTF-8 text"}
    what = next((v for k, v in kind.items() if isinstance(e, k)), type(e).__name__)
    return f"{what}: {msg[:400]}" if msg else what
