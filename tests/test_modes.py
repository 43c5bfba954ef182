"""course.modes: the notebooks' MODE parameter (learner = Run All, smoke = CI, full = make reproduce)."""
import pytest

from dvi_lite.course.modes import MODES, check_mode


def test_each_mode_maps_to_smoke_and_full():
    assert [check_mode(m) for m in MODES] == [(False, False), (True, False), (False, True)]


@pytest.mark.parametrize("bad", ["Full", "SMOKE", "", "fast"])
def test_unknown_mode_names_the_parameter_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"MODE = .*allowed are 'learner', 'smoke', 'full'"):
        check_mode(bad)
