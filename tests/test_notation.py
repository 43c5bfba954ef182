"""The course's notation in the package's names: K = draft tokens per step (k is the exit layer), t_lambda = DVI's
time constant T_λ (τ is tokens per target forward). An old name fails with a message that names the new one."""
import pytest

from dvi_lite.core.checks import RenamedError
from dvi_lite.core.registry import METHODS

K_MSG = r"k is now K \(draft tokens per step; k means the exit layer\)"


@pytest.fixture(scope="module")
def course():
    from dvi_lite.models.loading import load_model

    return load_model("course", dtype="float32", device="cpu")


@pytest.mark.parametrize("name", sorted(n for n, m in METHODS.items() if "K" in {o.name for o in m.options}))
def test_every_make_drafter_rejects_k_naming_K(course, name):
    model, tok = course
    factory = METHODS[name].load()
    with pytest.raises(TypeError, match=K_MSG):
        factory(model, tok, k=4)  # the factory itself, before anything is loaded
    with pytest.raises(ValueError, match=K_MSG):  # and through the registry (generate, the bench)
        METHODS[name].resolve(k=4)


def test_bench_method_strings_reject_k_naming_K():
    from dvi_lite.measure.timing import parse_spec

    assert parse_spec("sps:K=4") == ("sps", {"K": 4})
    with pytest.raises(ValueError, match=K_MSG):
        parse_spec("sps:k=4")
    with pytest.raises(ValueError, match="K"):
        parse_spec("kangaroo:threshold=none:k=2:label=fixed")


def test_dvi_config_rejects_tau_naming_t_lambda():
    from dvi_lite.methods.dvi.config import DVIConfig
    from dvi_lite.methods.dvi.paper import PaperRecipe

    assert DVIConfig(t_lambda=5.0).t_lambda == 5.0
    with pytest.raises(TypeError, match=r"DVIConfig: tau is now t_lambda \(DVI's time constant T_λ"):
        DVIConfig(tau=5.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        DVIConfig(bogus=1)  # any other keyword: Python's own error
    with pytest.raises(TypeError, match=K_MSG):
        PaperRecipe(k=3)
    assert issubclass(RenamedError, TypeError) and issubclass(RenamedError, ValueError)


@pytest.mark.parametrize("old,new", [("--tau", "--t-lambda"), ("--k", "--K")])
def test_dvi_cli_rejects_old_flags_naming_new(capsys, old, new):
    from dvi_lite.methods.dvi.cli import parser

    args = parser().parse_args(["--K", "3", "--t-lambda", "7"])
    assert (args.K, args.t_lambda) == (3, 7.0)
    with pytest.raises(SystemExit) as e:
        parser().parse_args([old, "3"])
    assert e.value.code == 2 and f"{old} is now {new}" in capsys.readouterr().err


def test_other_clis_reject_old_flags():
    from dvi_lite.methods.dvi.ablation import parser as ablation_parser
    from dvi_lite.study.bench import parser as bench_parser

    for ap, old in ((bench_parser(), "--k"), (ablation_parser(), "--tau")):
        with pytest.raises(SystemExit):
            ap.parse_args([old, "3"])


def test_saved_old_names_still_read():
    """Files written before the rename (a DVI checkpoint's config, a recipe) are read under the new names."""
    from dvi_lite.core.checks import new_names

    assert new_names({"tau": 50.0, "k": 6, "split": 4}) == {"t_lambda": 50.0, "K": 6, "split": 4}
