"""`python -m dvi_lite <command> ...`: the one command line (the table of commands is dvi_lite.commands.COMMANDS)."""
import sys

from dvi_lite.cli import main

if __name__ == "__main__":
    sys.exit(main())
