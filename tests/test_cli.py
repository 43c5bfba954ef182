"""dvi_lite.cli: the one command line; bad flags and bad inputs end in a one-line usage error naming the parameter."""
import argparse

import pytest

from dvi_lite.cli import command_line, require_positive, run_or_usage_error


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="x")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1)
    return ap


def test_require_positive_names_the_flag(capsys):
    ap = parser()
    with pytest.raises(SystemExit) as e:
        require_positive(ap, ap.parse_args(["--batch-size", "0"]), "steps", "batch_size")
    assert e.value.code == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err


def test_value_and_file_errors_become_usage_errors(capsys):
    ap = parser()

    def bad(path):
        raise FileNotFoundError(f"no adapter at {path}")

    with pytest.raises(SystemExit) as e:
        run_or_usage_error(ap, bad, "a.pt")
    assert e.value.code == 2 and "no adapter at a.pt" in capsys.readouterr().err
    assert run_or_usage_error(ap, lambda x: x + 1, 1) == 2


def test_command_line_records_the_arguments():
    assert command_line("train", ["--steps", "3"]) == "python -m dvi_lite train --steps 3"
    assert command_line("dvi_lite kangaroo-train", []) == "python -m dvi_lite kangaroo-train"


def test_command_line_only_records_commands_that_exist():
    with pytest.raises(ValueError, match="unknown command 'dvi_lite.course_model.train'"):
        command_line("dvi_lite.course_model.train", [])


def test_the_one_cli_dispatches_to_the_command(capsys):
    from dvi_lite.cli import main

    assert main(["env-check"]) in (0, 1)
    assert "torch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2 and "invalid choice: 'no-such-command'" in capsys.readouterr().err
