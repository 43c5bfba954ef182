"""The method registry: one table, options declared alike, validated in one place, in sync with the factories."""
import inspect

import pytest

from dvi_lite.core.registry import KINDS, METHODS, Method, Option, get_method


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_factory_takes_exactly_its_declared_options(name):
    m = METHODS[name]
    fn = m.load()
    assert callable(fn)
    if name == "ar":
        return  # the empty drafter's class is its own factory
    params = {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[2:]  # after (model, tok)
              if p.kind is not p.VAR_KEYWORD}  # **old: the old names, rejected by name (test_notation)
    assert set(params) == {o.name for o in m.options}, name
    for o in m.options:  # the registry calls factories with keywords only: names and defaults must agree
        assert params[o.name] == o.default, (name, o.name, params[o.name], o.default)
        assert o.kind in KINDS


def test_draft_length_has_one_name():
    for m in METHODS.values():
        names = {o.name for o in m.options}
        assert not names & {"k", "max_steps", "num_heads", "max_draft", "top_k", "gamma_steps"}, m.name


def test_resolve_fills_defaults_and_checks_values():
    sps = get_method("sps")
    assert sps.resolve() == {"draft_model": None, "K": None}  # None: the model's sized K (defaults.json), else 4
    assert sps.resolve(K=7)["K"] == 7
    with pytest.raises(ValueError, match=r"sps option 'K' .* must be an int >= 1, got 0"):
        sps.resolve(K=0)
    with pytest.raises(ValueError, match=r"method 'sps' has no option 'branch'; its options: draft_model, K"):
        sps.resolve(branch=2)
    kg = get_method("kangaroo")
    assert kg.resolve(threshold=None)["threshold"] is None
    with pytest.raises(ValueError, match=r"kangaroo option 'threshold' .* must be a number in \(0.0, 1.0\]"):
        kg.resolve(threshold=1.5)
    with pytest.raises(ValueError, match=r"medusa option 'prune' must be one of \['confidence', 'path', 'entropy'\]"):
        get_method("medusa").resolve(prune="bogus")
    with pytest.raises(ValueError, match=r"draft_verify option 'adaptive' .* must be True or False"):
        get_method("draft_verify").resolve(adaptive=1)


def test_unknown_method_lists_every_name():
    with pytest.raises(ValueError, match=r"method must be one of \[.*'ar'.*'dvi'.*'sps'.*\], got 'nope'"):
        get_method("nope")


def test_option_kinds_check_what_they_say():
    o = Option("n", 1, "a count", "int", low=1, high=3)
    assert o.check("m", 3) == 3
    for bad in (0, 4, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"m option 'n' \(a count\) must be an int in \[1, 3\]"):
            o.check("m", bad)
    assert Option("x", None, "anything").check("m", object) is object


def test_the_table_is_built_without_importing_any_method():
    import subprocess
    import sys
    code = ("import sys, dvi_lite.core.registry as r; r.METHODS['medusa'].resolve(K=2);"
            "print(sorted(m for m in sys.modules if m.startswith('dvi_lite.methods')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_method_is_a_frozen_record():
    m = METHODS["ar"]
    assert isinstance(m, Method)
    with pytest.raises(AttributeError):
        m.name = "x"  # type: ignore[misc]
