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
    from dvi_lite.measure.paired import ci95
    from dvi_lite.methods.draft_verify.compare import compare

    res = compare(Deeper(8), Deeper(8, shift=0.01), 8, 0.25, trials=12, seeds=[0, 1, 2], progress=False)
    assert list(res["runs"]) == ["0", "1", "2"] and set(res["uniform"]) == {"uniform_layers", "uniform_sublayers"}
    a = res["summary"]["heldout_alpha_hat"]  # the objective's acceptance: a count, no clock involved
    assert a["bo"]["n"] == 3 and a["bo"]["ci95"][0] <= a["bo"]["mean"] <= a["bo"]["ci95"][1]
    for r in res["runs"].values():  # held out = calibration + the shift, for every arm
        assert r["bo"]["heldout"]["alpha_hat"] == pytest.approx(r["bo"]["calibration"]["alpha_hat"] + 0.01)
    assert a["bo_minus_random"]["mean"] == pytest.approx(a["bo"]["mean"] - a["random"]["mean"])
    assert ci95([2.0])["ci95"] is None and ci95([1.0, 3.0])["mean"] == 2.0


def test_gamma_stream_carries_one_threshold_over_the_prompts(target, prompts):
    """draft_verify.tracking: one threshold per target across every prompt; per-step counts and windows."""
    from dvi_lite.methods.draft_verify.skipset import uniform_skip
    from dvi_lite.methods.draft_verify.tracking import stream, summarise, windows
    from tests.helpers import IdTokenizer

    run = stream(target, IdTokenizer(), prompts[:3], uniform_skip(target.config.num_hidden_layers, 0.25), 0.7, 12,
                 K=3, progress=False)
    assert len(run["prompt_starts"]) == 3 and run["steps"] == len(run["drafted"]) == len(run["accepted"])
    assert all(0 <= a <= d for a, d in zip(run["accepted"], run["drafted"], strict=True))
    assert len(run["gamma"]) >= 1 and all(0 <= g <= 1 for g in run["gamma"])
    w = windows(run, size=4)
    assert sum(1 for _ in w) == -(-run["steps"] // 4)
    small = summarise(run, size=4)  # the results file keeps windows and halves, not the per-step lists
    assert small["windows"] == w and "drafted" not in small and 0 <= small["acceptance_second_half"] <= 1
