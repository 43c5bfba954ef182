"""course.source shows the package's own code, whole or in part, with where it lives."""
import pytest

from dvi_lite.course import source as src
from dvi_lite.methods.pld import PromptLookupDrafter


def test_source_is_the_code_that_runs():
    text = src.source(PromptLookupDrafter.lookup)
    assert text.startswith("def lookup(self, tokens") and "self.index[n - 1].get" in text
    assert not src.source(PromptLookupDrafter.lookup, docstring=False).count('"""')
    assert src.source(PromptLookupDrafter.lookup, lines=(1, 2)).count("\n") == 1
    assert src.where(PromptLookupDrafter.lookup).startswith("dvi_lite/methods/pld.py, line ")


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="lines must be"):
        src.source(PromptLookupDrafter.lookup, lines=(3, 1))
    with pytest.raises(ValueError, match="obj: no Python source"):
        src.source(len)


def test_show_returns_a_code_block():
    code = src.show(PromptLookupDrafter.lookup)
    assert "def lookup" in code.data
