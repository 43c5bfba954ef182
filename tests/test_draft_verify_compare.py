"""BO vs random vs uniform over seeds (draft_verify.compare) on a stand-in objective: no model, no timing."""
import pytest

from dvi_lite.core.runner import Skip


class Deeper:
    """A stand-in for SkipObjective: skipping deeper sub-layers scores higher (a smooth landscape BO can climb)."""

    def __init__(self, n_layers: int, shift: float = 0.0):
        self.n, self.shift = n_layers, shift

    def evaluate(self, skip: Skip) -> dict:
        depth = sum(skip.attn) + sum(skip.mlp)
        score = depth / (2 * self.n * self.n) + self.shift
        return {"speedup": score, "alpha_hat": min(1.0, score), "c": 0.5, "K": 2, "tau": 1.5}

    def __call__(self, skip: Skip) -> float:
        return -self.evaluate(skip)["speedup"]


def test_compare_reports_every_arm_per_seed_with_intervals():
    from dvi_lite.methods.draft_verify.compare import compare, mean_ci

    res = compare(Deeper(8), Deeper(8, shift=0.01), 8, 0.25, trials=12, seeds=[0, 1, 2], progress=False)
    assert list(res["runs"]) == ["0", "1", "2"] and set(res["uniform"]) == {"uniform_layers", "uniform_sublayers"}
    a = res["summary"]["heldout_alpha_hat"]  # the objective's acceptance: a count, no clock involved
    assert a["bo"]["n"] == 3 and a["bo"]["ci95"][0] <= a["bo"]["mean"] <= a["bo"]["ci95"][1]
    for r in res["runs"].values():  # held out = calibration + the shift, for every arm
        assert r["bo"]["heldout"]["alpha_hat"] == pytest.approx(r["bo"]["calibration"]["alpha_hat"] + 0.01)
    assert a["bo_minus_random"]["mean"] == pytest.approx(a["bo"]["mean"] - a["random"]["mean"])
    assert mean_ci([2.0])["ci95"] is None and mean_ci([1.0, 3.0])["mean"] == 2.0
