"""Naive early-exit self-speculation: lossless, and the shallow layers are never recomputed."""
import pytest
from helpers import DEEP_PROMPTS, IdTokenizer

import dvi_lite


@pytest.fixture(scope="module")
def model(deep_model):
    return deep_model


PROMPTS = DEEP_PROMPTS
CONFIGS = [dict(split=1), dict(split=2, threshold=0.3), dict(split=3, K=3), dict(split=2, threshold=0.9),
           dict(split=1, branch=3), dict(split=2, threshold=0.3, branch=2)]


@pytest.mark.parametrize("kw", CONFIGS)
def test_greedy_equals_ar(model, kw):
    tok = IdTokenizer()
    alphas = []
    for p in PROMPTS:
        ar = dvi_lite.generate(model, tok, p, max_new_tokens=40, stop_at_eos=False)
        ee = dvi_lite.generate(model, tok, p, method="early_exit", max_new_tokens=40, stop_at_eos=False, **kw)
        assert ee.token_ids == ar.token_ids
        alphas.append(ee.stats.alpha)
    assert any(a < 1 for a in alphas)  # rejections happened: the rollback path is exercised


@pytest.mark.parametrize("branch", [1, 3])
def test_shallow_layers_are_not_recomputed(model, branch):
    """Every position passes through every layer exactly once: drafting's shallow work is reused
    (for a tree: the chain's shallow states are reused, only the leaves run the shallow layers)."""
    seen = [0] * model.config.num_hidden_layers
    def count(mod, args, kw, out, i):
        seen[i] += kw["hidden_states"].shape[1]

    hooks = [layer.self_attn.register_forward_hook(lambda *a, i=i: count(*a, i), with_kwargs=True)
             for i, layer in enumerate(model.model.layers)]
    try:
        out = dvi_lite.generate(model, IdTokenizer(), PROMPTS[0], method="early_exit", split=2, max_new_tokens=30,
                                stop_at_eos=False, threshold=0.5, branch=branch)
    finally:
        for h in hooks:
            h.remove()
    assert seen[0] == seen[1] and seen[2] == seen[3]
    # shallow layers also see the draft inputs that were later rejected, but never a second time:
    drafted_inputs = sum(s.drafted for s in out.stats.steps)
    assert seen[0] == seen[3], (seen, drafted_inputs)


@pytest.mark.parametrize("kw,msg", [(dict(split=0), "split"), (dict(split=4), "split"),
                                    (dict(split=2, threshold=0.0), "threshold"),
                                    (dict(split=2, threshold=1.5), "threshold"), (dict(split=2, K=0), "'K'"),
                                    (dict(split=2, branch=0), "branch")])
def test_bad_inputs(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(model, IdTokenizer(), [1, 2], method="early_exit", **kw)


def test_default_split_and_direct_checks(model):
    """split=None is the one default exit layer; the drafter itself names a bad k / branch / threshold."""
    from dvi_lite.core.checks import default_split
    from dvi_lite.core.runner import Runner
    from dvi_lite.methods.early_exit import EarlyExitDrafter, make_drafter

    d = make_drafter(model, IdTokenizer())
    assert (d.split, d.K, d.threshold, d.branch, d.max_draft) == (default_split(4), 6, None, 1, 6)
    for kw, msg in ((dict(K=0), r"K \(draft tokens per step\)"), (dict(branch=0), "branch"),
                    (dict(threshold=2.0), "threshold")):
        with pytest.raises(ValueError, match=msg):
            EarlyExitDrafter(Runner.for_model(model), 2, **kw)


def test_greedy_exit_rule_and_tree_read_the_draft_confidence(model):
    """Greedy sampling's probs() is one-hot: the threshold and the tree must read softmax(logits) instead."""
    kw = dict(method="early_exit", split=2, max_new_tokens=40, stop_at_eos=False, K=6)
    strict = dvi_lite.generate(model, IdTokenizer(), PROMPTS[0], threshold=0.999, **kw)
    assert max(s.drafted for s in strict.stats.steps) < 6  # drafting stopped early at least once... always
    tree = dvi_lite.generate(model, IdTokenizer(), PROMPTS[0], branch=3, **kw)
    assert any(s.drafted > s.depth for s in tree.stats.steps)  # leaves were proposed


class ScriptedExit:
    """Exit logits with a scripted top-1 (token, confidence) per draft step: softmax gives `conf` to `token`."""

    def __init__(self, script: list[tuple[int, float]], vocab: int = 64):
        self.script, self.vocab, self.calls = script, vocab, 0

    def __call__(self, h):
        import math

        import torch

        tok, conf = self.script[self.calls]
        self.calls += 1
        logits = torch.zeros(1, h.shape[1], self.vocab)
        logits[..., tok] = math.log(conf * (self.vocab - 1) / (1 - conf))  # softmax(logits)[tok] == conf
        return logits


@pytest.mark.parametrize("threshold,want", [(0.6, 3), (0.2, 5), (None, 5)])
def test_low_confidence_token_is_still_proposed(model, threshold, want):
    """Fix a: drafting stops *after* the first token whose confidence is below eta (Kangaroo, D&V, DVI's
    spec_decode): that token is proposed, the next is never drafted; verification takes the proposal."""
    import torch

    from dvi_lite.core.engine import start, verify_step
    from dvi_lite.core.runner import Runner
    from dvi_lite.core.sampling import Sampler, make_generator
    from dvi_lite.methods.early_exit import EarlyExitDrafter

    script = [(5, 0.99), (9, 0.95), (13, 0.3), (17, 0.99), (21, 0.99)]
    r = Runner.for_model(model)
    d = EarlyExitDrafter(r, 2, K=5, threshold=threshold)
    d.exit_scores = ScriptedExit(script)
    state = start(r, d, PROMPTS[0], 20, Sampler(), make_generator(0))
    prop = d.propose(state)
    assert prop.tokens.tolist() == [t for t, _ in script[:want]]  # token 13 (conf 0.3 < 0.6) is proposed
    assert d.exit_scores.calls == want  # and nothing after it was drafted
    assert prop.hidden.shape[1] == want  # shallow states of [pending, d1, ..., d_{n-1}]
    out = verify_step(state, prop)
    assert out.p_logits.shape[0] == want + 1 and torch.isfinite(out.p_logits).all()


def test_low_confidence_first_token_is_proposed_alone(model):
    from dvi_lite.core.engine import start
    from dvi_lite.core.runner import Runner
    from dvi_lite.core.sampling import Sampler, make_generator
    from dvi_lite.methods.early_exit import EarlyExitDrafter

    r = Runner.for_model(model)
    d = EarlyExitDrafter(r, 2, K=4, threshold=0.6)
    d.exit_scores = ScriptedExit([(7, 0.1), (8, 0.99)])
    prop = d.propose(start(r, d, PROMPTS[0], 20, Sampler(), make_generator(0)))
    assert prop.tokens.tolist() == [7] and d.exit_scores.calls == 1
