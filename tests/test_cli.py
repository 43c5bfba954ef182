"""dvi_lite.cli: the one command line; bad flags and bad inputs end in a one-line usage error naming the parameter."""
import argparse

import pytest

from dvi_lite.commands import command_line, require_positive, run_or_usage_error


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


def assert_dispatches(main_fn, monkeypatch) -> None:
    """main_fn(["env-check", *args]) calls env-check's main with the args and returns its exit status (None: 0)."""
    import dvi_lite.study.envcheck as envcheck

    calls = []
    for status, want in ((0, 0), (1, 1), (3, 3), (None, 0)):
        monkeypatch.setattr(envcheck, "main", lambda argv, s=status: calls.append(list(argv)) or s)
        got = main_fn(["env-check", "--flag"])
        assert got == want, f"env-check returned {status!r}, the command line {got!r} (expected {want})"
    assert calls == [["--flag"]] * 4, calls


def test_the_one_cli_dispatches_to_the_command(monkeypatch):
    from dvi_lite.cli import main

    assert_dispatches(main, monkeypatch)


def test_the_dispatch_check_rejects_a_cli_that_drops_the_exit_status(monkeypatch):
    """Negative control: a command line that runs the command but always exits 0 fails the check above."""
    from dvi_lite.cli import load

    def always_zero(argv: list[str]) -> int:
        load(argv[0])(argv[1:])
        return 0

    with pytest.raises(AssertionError, match="expected 1"):
        assert_dispatches(always_zero, monkeypatch)


def test_env_check_exits_1_exactly_when_a_check_fails(capsys):
    """The real command through the one command line: its exit status is 1 iff it printed a FAIL line."""
    from dvi_lite.cli import main

    status = main(["env-check"])
    out = capsys.readouterr().out
    assert "torch" in out
    assert status == (1 if any(line.startswith("FAIL") for line in out.splitlines()) else 0), out


def test_an_unknown_command_is_a_usage_error(capsys):
    from dvi_lite.cli import main

    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2 and "invalid choice: 'no-such-command'" in capsys.readouterr().err
