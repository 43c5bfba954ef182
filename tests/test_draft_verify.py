"""Draft & Verify: lossless greedy and sampling, cache discipline, skip-set resolution, clear errors."""
import json

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer, assert_lossless_sampling

import dvi_lite
from dvi_lite.core.engine import start, step
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.course.ch03_draft_verify import skip_sensitivity
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.draft_verify.drafter import DraftVerifyDrafter
from dvi_lite.methods.draft_verify.search import SearchResult, save_search
from dvi_lite.methods.draft_verify.skipset import load_skip, resolve_skip


@pytest.fixture(scope="module")
def model(deep_model):
    return deep_model


SKIPS = [Skip(attn=frozenset({2}), mlp=frozenset({1, 2})), Skip(attn=frozenset({1, 2, 3})),
         [0, 0, 1, 1, 0, 0, 0, 1], Skip(mlp=frozenset({1, 2}))]  # the last one runs every attention layer


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("adaptive,threshold", [(True, 0.6), (False, None), (False, 0.5)])
def test_greedy_equals_ar(model, skip, adaptive, threshold):
    tok = IdTokenizer()
    alphas = []
    for p in DEEP_PROMPTS:
        ar = dvi_lite.generate(model, tok, p, max_new_tokens=40, stop_at_eos=False)
        dv = dvi_lite.generate(model, tok, p, method="draft_verify", skip=skip, adaptive=adaptive, threshold=threshold,
                               target_alpha=0.7, max_new_tokens=40, stop_at_eos=False)
        assert dv.token_ids == ar.token_ids
        alphas.append(dv.stats.alpha)
    assert any(a is not None and a < 1 for a in alphas)


def test_cache_holds_only_full_model_kv_after_each_step(model):
    """Draft KV (from skipped-layer states) never survives into the committed cache."""
    runner = Runner(model)
    drafter = DraftVerifyDrafter(runner, SKIPS[0], K=4, threshold=None)
    state = start(runner, drafter, DEEP_PROMPTS[0], 30, Sampler(), make_generator(0))
    for _ in range(6):
        step(state, drafter)
        committed = state.tokens[:-1]
        fresh = runner.new_cache(64)
        runner.forward(torch.tensor([committed]), fresh)
        n = len(state.cache)
        assert n == len(committed)
        for i in range(runner.n_layers):
            k_live, v_live = state.cache.layer(i)
            k_ref, v_ref = fresh.layer(i)
            torch.testing.assert_close(k_live[:, :, :n], k_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v_live[:, :, :n], v_ref, atol=1e-4, rtol=1e-4)


def test_sampling_is_lossless_end_to_end(target8, tok8):
    assert_lossless_sampling(target8, tok8, "draft_verify", skip=Skip(mlp=frozenset({1})), threshold=0.3,
                             adaptive=False, K=3)


def test_adaptive_gamma_moves_towards_target(model):
    runner = Runner(model)
    ctl = AdaptiveThreshold(target_alpha=0.95, gamma0=0.5)
    drafter = DraftVerifyDrafter(runner, SKIPS[1], K=6, threshold=0.5, adaptive=ctl)
    dvi_lite.decode(runner, drafter, DEEP_PROMPTS[0], 60, Sampler(), make_generator(0))
    assert len(ctl.trace_gamma) > 3 and ctl.trace_gamma[-1] > 0.5  # acceptance below 0.95: gamma rises


@pytest.mark.parametrize("kw,msg", [
    (dict(skip=[0, 1, 1]), "skip mask"),  # wrong length
    (dict(skip=[1] * 8), "nothing left"),  # skipping everything
    (dict(skip=Skip(attn=frozenset(range(4)), mlp=frozenset(range(4)))), "nothing left"),
    (dict(skip=Skip(attn=frozenset({7}))), "out of range"),
    (dict(skip=SKIPS[0], target_alpha=1.0), "target.alpha"),
    (dict(skip=SKIPS[0], target_alpha=0.0), "target.alpha"),
    (dict(skip=SKIPS[0], threshold=1.5), "threshold"),
    (dict(skip=SKIPS[0], K=0), "'K'"),
])
def test_bad_inputs(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(model, IdTokenizer(), [1, 2], method="draft_verify", **kw)


def test_saved_skip_round_trip_and_model_check(model, tmp_path):
    from transformers import LlamaForCausalLM

    best = SKIPS[0]
    res = SearchResult(n_layers=4, best_skip=best, best_value=0.01)
    path = save_search(model, res, tmp_path / "skip.json")
    assert load_skip(model, path) == best and resolve_skip(model, str(path)) == best
    assert json.loads(path.read_text())["n_skipped"] == 3
    torch.manual_seed(3)
    other = LlamaForCausalLM(model.config).eval()
    with pytest.raises(ValueError, match="another model"):
        load_skip(other, path)
    with pytest.raises(FileNotFoundError, match="no Draft & Verify skip set"):
        load_skip(model, tmp_path / "none.json")


def test_skip_sensitivity_rows(model):
    class Tok:  # encode_split needs a tokenizer: use the course one only for ids < 64? no: fake the stream
        pass
    import numpy as np

    import dvi_lite.course.ch03_draft_verify as dv

    orig = dv.encode_split
    dv.encode_split = lambda tok, split: np.arange(2000, dtype=np.uint16) % 64
    try:
        rows = skip_sensitivity(model, Tok(), n_windows=2, seq_len=16)
    finally:
        dv.encode_split = orig
    assert len(rows) == 8 and all(0 <= r["agreement"] <= 1 for r in rows)


def test_greedy_threshold_shortens_drafts(model):
    kw = dict(method="draft_verify", skip=SKIPS[0], adaptive=False, K=6, max_new_tokens=40, stop_at_eos=False)
    loose = dvi_lite.generate(model, IdTokenizer(), DEEP_PROMPTS[0], threshold=None, **kw)
    strict = dvi_lite.generate(model, IdTokenizer(), DEEP_PROMPTS[0], threshold=0.999, **kw)
    mean = lambda r: sum(s.drafted for s in r.stats.steps) / len(r.stats.steps)  # noqa: E731
    assert mean(strict) < mean(loose)


class ScriptedRunner(Runner):
    """The model's runner whose draft logits follow a script of (top-1 token, confidence) per call."""

    def __init__(self, model, script):
        super().__init__(model)
        self.script, self.calls = script, 0

    def logits(self, h):
        import math

        tok, conf = self.script[self.calls]
        self.calls += 1
        v = self.lm_head.weight.shape[0]
        out = torch.zeros(1, h.shape[1], v)
        out[..., tok] = math.log(conf * (v - 1) / (1 - conf))  # softmax(out)[tok] == conf
        return out


@pytest.mark.parametrize("threshold,want", [(0.6, 3), (0.2, 5)])
def test_low_confidence_token_is_still_proposed(model, threshold, want):
    """Fix a: like the authors' decoding (drafted_n_tokens = step_draft + 1), the token whose confidence is
    below gamma is proposed and drafting stops after it."""
    script = [(5, 0.99), (9, 0.95), (13, 0.3), (17, 0.99), (21, 0.99)]
    runner = Runner.for_model(model)
    drafter = DraftVerifyDrafter(ScriptedRunner(model, script), SKIPS[0], K=5, threshold=threshold)
    state = start(runner, drafter, DEEP_PROMPTS[0], 20, Sampler(), make_generator(0))
    prop = drafter.propose(state)
    assert prop.tokens.tolist() == [t for t, _ in script[:want]] and drafter.runner.calls == want


def test_adaptive_gamma_trace_follows_the_authors_update(model):
    """Fix b: after each verification, with the authors' defaults (beta1 0.5, alpha 0.9, eps 0.01, beta2 0.9,
    gamma0 0.8, matchness 0) and their matchness (max_matched - 1) / drafted_n_tokens = accepted / drafted:
        m <- 0.5 m + 0.5 a / n;  g~ = g + 0.01 if m < 0.9, else g (n == k) or g - 0.01;  g <- 0.9 g + 0.1 g~
    Step by step, by hand (k = 8):
      (n=4, a=1): m = 0.125          < 0.9 -> g = 0.801
      (n=8, a=8): m = 0.5625         < 0.9 -> g = 0.802
      (n=2, a=2): m = 0.78125        < 0.9 -> g = 0.803
      (n=8, a=8): m = 0.890625       < 0.9 -> g = 0.804
      (n=3, a=3): m = 0.9453125     >= 0.9, n < k  -> g = 0.803
      (n=8, a=8): m = 0.97265625    >= 0.9, n == k -> g = 0.803 (held)
      (n=7, a=5): m = 0.84347098... < 0.9 -> g = 0.804   (accepted / tested = 5/6 would give m = 0.903: down)
    """
    from types import SimpleNamespace

    from dvi_lite.core.engine import Proposal
    from dvi_lite.methods.draft_verify.drafter import make_drafter

    d = make_drafter(model, IdTokenizer(), skip=SKIPS[0])  # the registered defaults: adaptive, gamma0 = 0.8
    d.reset()  # gamma is carried across drafters of this model and settings: start from gamma0 here
    assert d.adaptive is not None and d.gamma == 0.8 and d.K == 8
    for n, a in [(4, 1), (8, 8), (2, 2), (8, 8), (3, 3), (8, 8), (7, 5)]:
        d.feedback(None, SimpleNamespace(proposal=Proposal(torch.zeros(n, dtype=torch.long)), n_accepted=a))
    m = [0.125, 0.5625, 0.78125, 0.890625, 0.9453125, 0.97265625, 0.97265625 / 2 + 5 / 14]
    assert d.adaptive.trace_ar == pytest.approx(m)
    assert d.adaptive.trace_gamma == pytest.approx([0.801, 0.802, 0.803, 0.804, 0.803, 0.803, 0.804])


# ----------------------------------------------------------------------------- the search's low-noise objective

ROWS = [[5, 9, 2, 33, 17, 8, 40, 41, 3, 12, 60, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 40, 30, 20, 10, 11, 12]]


def _calibration(model, spans, **kw):
    from dvi_lite.methods.draft_verify.objective import Calibration

    with torch.no_grad():
        targets = [model(torch.tensor([r])).logits[0].argmax(-1).tolist() for r in ROWS]  # the full model's argmax
    return Calibration(model, ROWS, spans, targets, **kw)


def test_objective_scores_each_position_as_the_drafters_first_step(model):
    cal = _calibration(model, [(3, 11), (0, 8), (2, 6)], batch_size=2)
    assert cal.n_positions == 8 + 8 + 4 and len(cal.batches) == 2
    assert cal.agreement(Skip()) == 1.0  # no skipping: the full model agrees with itself
    skip = SKIPS[0]
    r = Runner.for_model(model)
    for bi, (b, pred) in enumerate(zip(cal.batches, cal.predictions(skip), strict=True)):
        for j in range(b.pos.shape[0]):
            row = ROWS[2 * bi + j]
            for t, p in zip(b.pos[j][b.target[j] >= 0].tolist(), pred[j].tolist(), strict=False):
                cache = r.new_cache(t + 1)  # the committed prefix's KV comes from the full model
                if t:
                    r.layers_forward(r.embed(torch.tensor([row[:t]])), cache, torch.arange(t)[None])
                h = r.layers_forward(r.embed(torch.tensor([[row[t]]])), cache, torch.tensor([[t]]), skip=skip)
                assert int(r.logits(h)[0, -1].argmax()) == p
    assert cal.agreement(skip) < 1.0


def test_objective_positions_cap_and_value(model):
    from dvi_lite.measure.cost import best_speedup
    from dvi_lite.methods.draft_verify.objective import SkipObjective, SublayerCosts, measure_sublayer_costs

    cal = _calibration(model, [(0, 11), (0, 8), (0, 6)], max_positions=3)
    assert cal.batches[0].pos[0].tolist() == [0, 5, 10] and cal.n_positions == 9
    measured = measure_sublayer_costs(model, context=8, repeats=2)  # timings: only their form is checked
    assert measured.attn >= 0 and measured.mlp >= 0 and measured.full > 0
    assert measured.c(Skip()) == pytest.approx(1.0)  # by construction; c's arithmetic: the test below
    costs = SublayerCosts(n_layers=4, attn=1.0, mlp=2.0, head=1.5, full=16.0)  # the objective on given costs
    v = {1: 1.0, 9: 1.1}
    f = SkipObjective(cal, costs, v, k_max=4)
    assert f(Skip()) == -best_speedup(1.0, costs.c(Skip()), v, 4)[0]
    got = f.evaluate(SKIPS[0])
    assert got is f.evaluate(SKIPS[0]) and 0 <= got["alpha_hat"] < 1 and 1 <= got["K"] <= 4


def test_draft_cost_from_given_sublayer_costs():
    """c from fixed numbers (no timing): skipping nothing costs 1, each skipped sub-layer saves its share, and
    sub-layers that add up to more than the timed whole (timing noise) still give c(no skip) = 1."""
    from dvi_lite.methods.draft_verify.objective import SublayerCosts

    costs = SublayerCosts(n_layers=4, attn=1.0, mlp=2.0, head=1.5, full=16.0, trimmed_head=0.5)  # fixed = 4
    assert costs.c(Skip()) == 1.0
    assert costs.c(Skip(attn=frozenset({1, 2, 3}))) == pytest.approx(13 / 16)
    assert costs.c(Skip(mlp=frozenset({1})), trimmed=True) == pytest.approx((4 - 1 + 4 * 1 + 3 * 2) / 16)
    noisy = SublayerCosts(n_layers=4, attn=1.0, mlp=2.0, head=1.5, full=10.0)  # parts sum to 12 > 10
    assert noisy.c(Skip()) == 1.0 and noisy.c(Skip(mlp=frozenset({1}))) == pytest.approx(10 / 12)


def test_prepare_smollm2_smoke_on_the_course_model(tmp_path):
    from dvi_lite.methods.draft_verify.search import prepare_smollm2
    from dvi_lite.models.loading import load_model

    out = prepare_smollm2("course", tmp_path / "dv", "python -m dvi_lite prepare --smoke", smoke=True,
                          dtype="float32", v={1: 1.0, 9: 1.1}, summary_path=tmp_path / "summary.json")
    model, _ = load_model("course")
    body = json.loads((tmp_path / "dv" / "skip.json").read_text())
    assert load_skip(model, tmp_path / "dv" / "skip.json") == resolve_skip(model, body["best_skip"])
    card = body["card"]
    assert card["trials"] == 2 and card["device"].startswith("cpu") and card["command"].startswith("python -m")
    assert {"data", "commit", "calibration", "heldout"} <= set(card)
    arms = out["sweep"][0]["arms"]
    assert set(arms) == {"uniform_layers", "uniform_sublayers", "random", "bo"}
    assert len(set(out["sweep"][0]["n_skipped"].values())) == 1  # an equal skip ratio in every arm
    no_skip = out["no_skip"]["calibration"]
    assert no_skip["alpha_hat"] == 1.0 and no_skip["c"] == pytest.approx(1.0)
    # the search evidence is kept, in the skip file and the summary: every BO trial with its objective's parts
    for search in (body["search"], out["sweep"][0]["arms"]["bo"]["search"]):
        assert len(search["trials"]) == 2 and search["config"]["skip_ratio"] == 0.25
        for t in search["trials"]:
            assert {"attn", "mlp", "alpha_hat", "c", "K", "speedup"} <= set(t) and t["value"] == -t["speedup"]
    assert len(arms["random"]["trials"]) == 2 and "alpha_hat" in arms["random"]["trials"][0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sweep"][0]["arms"]["bo"]["search"]["trials"] == out["sweep"][0]["arms"]["bo"]["search"]["trials"]
    # the results file: each arm says what acceptance it would need at its cost to pay, and keeps the search
    from dvi_lite.methods.draft_verify.recipe import write_results

    res = write_results(tmp_path / "summary.json", [], tmp_path / "results.json", "pytest")
    row = res["comparison"]["0.25"]["bo"]
    assert {"alpha_needed_for_1x_at_c", "alpha_needed_for_target_at_c", "pays_heldout"} <= set(row)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["search"]["sweep"][0]["arms"]["bo"]["search"]["trials"]


def test_adaptive_gamma_is_carried_across_prompts_and_stays_lossless(model):
    """As the authors' harness: each generate call builds a new drafter, but the adaptive gamma continues
    from the previous prompt (same model and settings); carry=False restarts it at gamma0 every prompt.
    Greedy output equals AR either way: gamma only decides how long the drafts are."""
    from dvi_lite.methods.draft_verify.drafter import carried_thresholds, make_drafter, reset_gamma

    tok = IdTokenizer()
    kw = dict(method="draft_verify", skip=SKIPS[1], adaptive=True, threshold=0.5, target_alpha=0.97, K=6,
              max_new_tokens=40, stop_at_eos=False)
    d = make_drafter(model, tok, skip=SKIPS[1], threshold=0.5, target_alpha=0.97, K=6)
    d.reset()
    ctl = d.adaptive
    ends = []
    for p in DEEP_PROMPTS[:2]:
        out = dvi_lite.generate(model, tok, p, **kw)
        assert out.token_ids == dvi_lite.generate(model, tok, p, max_new_tokens=40, stop_at_eos=False).token_ids
        ends.append(ctl.gamma)
    assert ctl.n_prompts == 2 and ctl in carried_thresholds(model).values()  # both calls used this one state
    second = ctl.prompt_starts[1]
    assert ends[0] != 0.5 and ctl.trace_gamma[second - 1] == ends[0]  # prompt 2 started where prompt 1 ended
    assert make_drafter(model, tok, skip=SKIPS[1], threshold=0.5, target_alpha=0.97, K=6).adaptive is ctl
    assert make_drafter(model, tok, skip=SKIPS[0], threshold=0.5, target_alpha=0.97, K=6).adaptive is not ctl
    assert make_drafter(model, tok, skip=SKIPS[1], threshold=0.5, target_alpha=0.97, K=5).adaptive is not ctl
    fresh = make_drafter(model, tok, skip=SKIPS[1], threshold=0.5, target_alpha=0.97, K=6, carry=False)
    assert fresh.adaptive is not ctl and not fresh.adaptive.carry
    assert reset_gamma(model) >= 1 and ctl.gamma == 0.5 and ctl.n_prompts == 0  # the explicit reset
    with pytest.raises(ValueError, match="carry"):
        make_drafter(model, tok, skip=SKIPS[1], carry="yes")


def test_recipe_results_keep_the_search_evidence():
    """`_jsonable` keeps every key (the BO trials with their objective values) in JSON-safe form."""
    import math

    import numpy as np

    from dvi_lite.methods.draft_verify.recipe import _jsonable

    res = SearchResult(n_layers=4, best_skip=SKIPS[0], best_value=-1.2,
                       trials=[{"number": 0, "value": math.inf, "attn": [1], "mlp": [], "n_skipped": 1},
                               {"number": 1, "value": -1.2, "attn": [2], "mlp": [1, 2], "n_skipped": 3}])
    body = {"search": res, "arms": {"bo": {"skip": SKIPS[0], "search": res.to_dict(), "alpha": np.float64(0.5),
                                           "k": np.int64(3), "set": frozenset({2, 1}), "nan": float("nan")}}}
    out = json.loads(json.dumps(_jsonable(body), allow_nan=False))
    assert out["search"]["trials"][0]["value"] is None and out["search"]["trials"][1]["value"] == -1.2
    assert out["arms"]["bo"]["search"] == out["search"] and out["arms"]["bo"]["skip"] == {"attn": [2], "mlp": [1, 2]}
    assert out["arms"]["bo"]["alpha"] == 0.5 and out["arms"]["bo"]["k"] == 3 and out["arms"]["bo"]["set"] == [1, 2]
    assert out["arms"]["bo"]["nan"] is None


def test_objective_labels_default_to_the_full_models_own_argmax(model):
    """Without labels the calibration scores against the full model's own argmax on the same rows: the labels are
    those a full forward gives, and skipping nothing scores exactly 1 (the record's labels, from a longer
    context, scored 0.83 / 0.74 there)."""
    from dvi_lite.methods.draft_verify.objective import Calibration

    spans = [(3, 11), (0, 8), (2, 6)]
    own = Calibration(model, ROWS, spans, batch_size=2)
    given = _calibration(model, spans, batch_size=2)
    assert all(torch.equal(a.target, b.target) for a, b in zip(own.batches, given.batches, strict=True))
    assert own.agreement(Skip()) == 1.0 and own.agreement(SKIPS[0]) == given.agreement(SKIPS[0])
