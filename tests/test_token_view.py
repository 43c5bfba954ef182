"""The token view: every new token gets the origin the step records imply, and the views carry it."""
import io

import pytest

from dvi_lite.core.engine import Stats, StepStats
from dvi_lite.course import token_view as tv


def _step(drafted, accepted, bonus):
    return StepStats(drafted, drafted, accepted, 0.0, 0.0, 0.0, bonus)


def test_origins_follow_the_steps():
    st = Stats(new_tokens=9, steps=[_step(3, 3, True), _step(3, 1, False), _step(0, 0, False), _step(2, 2, True)])
    assert tv.origins(st) == ["first", "draft", "draft", "draft", "bonus", "draft", "correction", "target", "draft"]
    assert tv.origins(Stats(new_tokens=3)) == ["first", "unrecorded", "unrecorded"]  # HF's loop records no steps
    assert tv.origins(Stats(new_tokens=1)) == ["first"]


@pytest.fixture(scope="module")
def course():
    from dvi_lite.models.loading import load_model

    return load_model("course", dtype="float32", device="cpu")


@pytest.mark.parametrize("method", ["ar", "pld", "medusa"])
def test_a_real_run_explains_every_token(course, method):
    """The origins cover each new token once; draft + target tokens per step reproduce tau; the pieces rebuild
    the text; the HTML and ANSI views hold every piece."""
    from dvi_lite.core.generate import generate

    model, tok = course
    res = generate(model, tok, "the cat sat on the mat. the cat sat on the", method=method, max_new_tokens=24)
    kinds = tv.origins(res.stats)
    assert len(kinds) == res.stats.new_tokens and kinds[0] == "first"
    if method == "ar":
        assert set(kinds[1:]) <= {"target"}
    n = len(res.stats.steps)  # one target token per step; a last step cut by the budget may lose its own
    assert sum(k != "draft" for k in kinds[1:]) in (n, n - 1)
    assert "".join(tv.pieces(tok, res.token_ids)) == tok.decode(res.token_ids, skip_special_tokens=True)
    page = tv.html(tok, res, method)
    assert page.count("<span title=") == res.stats.new_tokens and "τ" in page
    assert tv.ansi(tok, res).count("\x1b[0m") >= res.stats.new_tokens


def test_generate_command_plain_when_not_a_terminal(capsys):
    from dvi_lite.course import generate_cmd

    args = generate_cmd.parser().parse_args(["--prompt", "the cat", "--method", "pld", "--max-new-tokens", "8",
                                             "--show", "--dtype", "float32"])
    out = generate_cmd.run(args, out=io.StringIO())
    assert "\x1b[" not in out and "pld: τ" in out


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", "x", "--method", "nope"], "unknown method 'nope'"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--method", "sps:k"], "key=value"),
])
def test_generate_command_errors(argv, needle, capsys):
    from dvi_lite.course import generate_cmd

    with pytest.raises(SystemExit) as e:
        generate_cmd.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err
