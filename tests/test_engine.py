"""dvi_lite.core.engine (+ methods, sps): greedy equality with HF, SpS acceptance, cache invariants, and the
end-to-end losslessness of speculative sampling against the exactly enumerated target law."""
from __future__ import annotations

import collections

import pytest
import torch
from helpers import StubTokenizer, assert_cache_equals_fresh, assert_lossless_sampling, tiny_cfg

from dvi_lite import generate
from dvi_lite.core.engine import Drafter, Proposal, Stats, StepStats, start, step
from dvi_lite.core.registry import METHODS
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.sps import DraftModelDrafter

NEW = 24


@pytest.fixture(scope="module")
def ar_out(target, tok, prompts):
    return [generate(target, tok, p, method="ar", max_new_tokens=NEW, stop_at_eos=False).token_ids for p in prompts]


@pytest.fixture(scope="module")
def frequent_tok(ar_out):
    """A stub tokenizer whose eos is the most frequent greedy token, so that eos handling really triggers."""
    eos = collections.Counter(t for out in ar_out for t in out).most_common(1)[0][0]
    return StubTokenizer(eos_token_id=eos)


def test_fixture_models_are_realistic(ar_out):
    assert all(len(o) == NEW for o in ar_out)
    assert len({tuple(o) for o in ar_out}) == len(ar_out)  # greedy outputs differ across prompts
    assert len({t for o in ar_out for t in o}) > 15  # ... and do not just repeat one token


@torch.no_grad()
def test_ar_equals_hf_and_model_generate(target, tok, frequent_tok, prompts, ar_out):
    for tk in (tok, frequent_tok):
        stopped = 0
        for p, full in zip(prompts, ar_out, strict=True):
            ar = generate(target, tk, p, method="ar", max_new_tokens=NEW, stop_at_eos=True)
            hf = generate(target, tk, p, method="hf", max_new_tokens=NEW, stop_at_eos=True)
            x = torch.tensor([p])
            ref = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=tk.eos_token_id, pad_token_id=0)[0, len(p):].tolist()
            assert ar.token_ids == hf.token_ids == ref, p
            if tk.eos_token_id in full:  # stops right after the first eos, which is kept
                stopped += 1
                assert ar.token_ids == full[: full.index(tk.eos_token_id) + 1]
            else:
                assert ar.token_ids == full
            assert ar.text == tk.decode(ar.token_ids)
            assert ar.stats.new_tokens == len(ar.token_ids) and ar.stats.alpha is None
        if tk is frequent_tok:
            assert stopped >= 3


def test_hf_without_eos_ignores_the_model_eos(target, tok, prompts, ar_out, frequent_tok):
    """stop_at_eos=False must also override the eos of the model's own generation_config."""
    old = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = frequent_tok.eos_token_id
    try:
        for p, full in zip(prompts[:4], ar_out[:4], strict=True):
            assert generate(target, tok, p, method="hf", max_new_tokens=NEW, stop_at_eos=False).token_ids == full
    finally:
        target.generation_config.eos_token_id = old


def test_string_prompts_go_through_the_tokenizer(target, tok):
    a = generate(target, tok, "def f", method="ar", max_new_tokens=5, stop_at_eos=False)
    b = generate(target, tok, tok("def f")["input_ids"], method="ar", max_new_tokens=5, stop_at_eos=False)
    assert a.token_ids == b.token_ids and a.stats.prompt_tokens == 5


def test_sps_greedy_equals_ar(target, draft, tok, frequent_tok, prompts, ar_out):
    alphas = {}
    for k in range(1, 6):
        acc = []
        for p, ref in zip(prompts, ar_out, strict=True):
            out = generate(target, tok, p, method="sps", draft_model=draft, K=k, max_new_tokens=NEW, stop_at_eos=False)
            assert out.token_ids == ref, (k, p)
            assert all(s.drafted <= k for s in out.stats.steps)
            acc.append(out.stats.alpha)
        alphas[k] = sum(acc) / len(acc)
    assert any(0 < a < 1 for a in alphas.values()), alphas
    for p in prompts:  # with eos stopping too
        ar = generate(target, frequent_tok, p, method="ar", max_new_tokens=NEW)
        sps = generate(target, frequent_tok, p, method="sps", draft_model=draft, K=4, max_new_tokens=NEW)
        assert sps.token_ids == ar.token_ids


def test_sps_self_draft_accepts_everything(target, tok, prompts, ar_out):
    for p, ref in zip(prompts[:5], ar_out[:5], strict=True):
        out = generate(target, tok, p, method="sps", draft_model=target, K=3, max_new_tokens=NEW, stop_at_eos=False)
        assert out.token_ids == ref
        assert out.stats.alpha == 1.0
        assert out.stats.tau > 2.5  # 4 tokens per target forward except the (clamped) last step


def test_hf_assisted_greedy_equals_ar(target, draft, tok, prompts, ar_out):
    for p, ref in zip(prompts[:3], ar_out[:3], strict=True):
        out = generate(target, tok, p, method="hf_assisted", draft_model=draft, K=3, max_new_tokens=NEW,
                       stop_at_eos=False)
        assert out.token_ids == ref


@pytest.mark.parametrize("method", ["ar", "sps"])
def test_single_new_token_needs_no_decode_step(target, draft, tok, prompts, ar_out, method):
    kw = {"draft_model": draft} if method == "sps" else {}
    out = generate(target, tok, prompts[0], method=method, max_new_tokens=1, stop_at_eos=False, **kw)
    assert out.token_ids == ar_out[0][:1]
    assert out.stats.steps == [] and out.stats.tau is None and out.stats.new_tokens == 1


# ---------------------------------------------------------------- cache invariants

def _assert_cache_equals_fresh(model, cache, tokens: list[int]):
    """Strict: every layer holds exactly len(tokens) positions (the engine's crop), equal to a fresh prefill."""
    assert_cache_equals_fresh(model, cache, tokens, strict=True, where="engine")


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "T1"])
def test_target_and_draft_caches_equal_a_fresh_prefill(target, draft, prompts, sampler):
    drafter = DraftModelDrafter(draft, K=3)
    state = start(Runner(target), drafter, prompts[0], 40, sampler, make_generator(0), max_draft=3)
    accepted = []
    for _ in range(8):
        out, _ = step(state, drafter)
        accepted.append(out.n_accepted)
        assert out.committed == len(state.cache) == len(state.tokens) - 1
    assert min(accepted) < 3 and max(accepted) > 0, accepted  # both rejections and acceptances happened
    _assert_cache_equals_fresh(target, state.cache, state.tokens[:-1])
    _assert_cache_equals_fresh(draft, drafter.cache, state.tokens[: -len(drafter.todo)])


class TopTreeDrafter(Drafter):
    """A test drafter proposing a tree: the draft model's top-2 tokens, each with its top-1 child
    (parents [-1, -1, 0, 1]); deterministic candidates, so q=None (point masses)."""
    name = "test_tree"
    max_draft = 4  # nodes per proposal: the cache room the engine reserves

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, state):
        ctx = torch.tensor([state.tokens])
        a, b = self.model(ctx).logits[0, -1].topk(2).indices.tolist()
        kids = [int(self.model(torch.tensor([state.tokens + [t]])).logits[0, -1].argmax()) for t in (a, b)]
        return Proposal(tokens=torch.tensor([a, b] + kids), parents=torch.tensor([-1, -1, 0, 1]))


def test_tree_drafter_greedy_equals_ar_and_cache_is_gathered(target, draft, prompts, ar_out):
    drafter = TopTreeDrafter(draft)
    paths = []
    for p, ref in zip(prompts[:4], ar_out[:4], strict=True):
        state = start(Runner(target), drafter, p, NEW, Sampler(), make_generator(0))
        while state.remaining > 0:
            out, st = step(state, drafter)
            paths.append(out.path)
            assert st.depth == 2 and st.drafted == 4
        assert state.tokens[len(p):] == ref
    assert [1, 3] in paths or [1] in paths  # the second branch was taken at least once: a real gather
    # cache after a run with gathers equals a fresh prefill of the committed tokens
    state = start(Runner(target), drafter, prompts[1], NEW, Sampler(), make_generator(0))
    for _ in range(5):
        step(state, drafter)
    _assert_cache_equals_fresh(target, state.cache, state.tokens[:-1])


# ---------------------------------------------------------------- end-to-end losslessness



@pytest.mark.parametrize("temperature, top_p, max_new", [
    (1.0, 1.0, 3),
    # max_new_tokens=4: with 3, the drafter clamps k to remaining-1 = 1 and K=2 is never verified;
    # with 4 the first verification checks a 2-token chain (t2, t3), whose law we test.
    (0.7, 1.0, 4),
    (1.0, 0.9, 3),
])
def test_sps_sampling_is_lossless_end_to_end(target8, draft8, tok8, temperature, top_p, max_new):
    assert_lossless_sampling(target8, tok8, "sps", temperature=temperature, top_p=top_p, max_new_tokens=max_new,
                             draft_model=draft8, K=2)


def test_sampling_is_reproducible_with_a_seed(target, draft, tok, prompts):
    kw = dict(method="sps", draft_model=draft, K=3, max_new_tokens=12, temperature=1.0, stop_at_eos=False)
    first = generate(target, tok, prompts[0], seed=5, **kw).token_ids
    assert first == generate(target, tok, prompts[0], seed=5, **kw).token_ids


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("kw, exc, match", [
    ({"method": "nope"}, ValueError, r"method must be one of \[.*'ar'.*'sps'"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, ValueError, "max_new_tokens"),
    ({"temperature": -1}, ValueError, "temperature"),
    ({"top_p": 0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"prompt": []}, ValueError, "prompt is empty"),
    ({"prompt": ""}, ValueError, "prompt is empty"),
    ({"prompt": [1, 64]}, ValueError, r"prompt token ids must be in \[0, 64\)"),
    ({"prompt": [1, -1]}, ValueError, "prompt token ids"),
    ({"prompt": (1, 2)}, TypeError, "prompt must be"),
    ({"prompt": [1, "a"]}, TypeError, "prompt must be"),
    ({"prompt": [1] * 100, "max_new_tokens": 29}, ValueError, r"max_new_tokens \(29\) exceeds .* context of 128"),
    ({"method": "sps", "K": 0}, ValueError, r"sps option 'K' \(draft tokens per step\) must be an int >= 1, got 0"),
    ({"method": "sps", "K": True}, ValueError, r"sps option 'K' .* must be an int >= 1, got True"),
    ({"method": "sps", "kk": 3}, ValueError, r"method 'sps' has no option 'kk'; its options: draft_model, K"),
    ({"method": "ar", "K": 3}, ValueError, r"method 'ar' has no option 'K'; its options: none"),
])
def test_generate_bad_inputs(target, draft, tok, kw, exc, match):
    kw = {"prompt": [1, 2, 3], **kw}
    if kw.get("method") == "sps":
        kw["draft_model"] = draft
    with pytest.raises(exc, match=match):
        generate(target, tok, **kw)


def test_generate_context_limit_is_inclusive(target, tok):
    out = generate(target, tok, [1] * 100, max_new_tokens=28, stop_at_eos=False)  # 128 = the context
    assert len(out.token_ids) == 28


def test_sps_draft_with_other_vocabulary(target, tok):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    other = LlamaForCausalLM(tiny_cfg(vocab=32, layers=1)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, tok, [1, 2, 3], method="sps", draft_model=other)


def test_stats_aggregates_hand_example():
    st = Stats(prompt_tokens=3, new_tokens=10, total_s=2.0)
    for drafted, accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        st.steps.append(StepStats(drafted, drafted, accepted, 0.1, 0.2, 0.0))
    assert st.tau == (4 + 2 + 1 + 3) / 4
    assert st.alpha == 6 / 8  # accepted / tested: a step stops testing at its first rejection
    assert st.position_acceptance() == [3 / 4, 2 / 3, 1 / 1]  # conditional on reaching position i
    from dvi_lite.core.engine import position_counts

    assert position_counts([(s.depth, s.accepted) for s in st.steps]) == [(4, 3), (3, 2), (1, 1)]  # the events
    assert st.accepted_histogram() == [1, 1, 1, 1]
    assert st.tokens_per_s == 5.0
    d = st.to_dict()
    assert d["target_forwards"] == 4 and d["drafted"] == 11 and d["accepted"] == 6
    assert Stats().tau is None and Stats().alpha is None and Stats().position_acceptance() == []



def test_stats_pool_weighs_steps_not_answers():
    """Pooling two answers adds their steps, tokens and times: tau is over all steps, not a mean of two taus."""
    a = Stats(prompt_tokens=3, new_tokens=4, total_s=1.0, prefill_s=0.5,
              steps=[StepStats(3, 3, 3, 0.1, 0.2, 0.0)])  # one step, tau 4
    b = Stats(prompt_tokens=2, new_tokens=3, total_s=2.0, prefill_s=0.25,
              steps=[StepStats(3, 3, 0, 0.1, 0.2, 0.0)] * 3)  # three steps, tau 1
    p = Stats.pool([a, b])
    assert (p.prompt_tokens, p.new_tokens, p.total_s, p.prefill_s, len(p.steps)) == (5, 7, 3.0, 0.75, 4)
    assert p.tau == (4 + 1 + 1 + 1) / 4 and p.alpha == 3 / 6
    assert len(a.steps) == 1 and Stats.pool([]).tau is None  # the inputs are left as they were

def test_registry_lists_the_methods():
    assert {"ar", "hf", "hf_assisted", "sps"} <= set(METHODS)


@pytest.mark.parametrize("learns", [False, True])
def test_the_loop_runs_in_inference_mode_unless_the_drafter_learns(target, prompts, learns):
    """A drafter that keeps the decode's tensors to train on (DVI's online learner) gets a no_grad loop, whose
    tensors can enter autograd; every other drafter an inference-mode loop (less per-op bookkeeping)."""
    from dvi_lite.core.engine import decode

    class Probe(Drafter):
        seen: list[bool] = []

        def propose(self, state):
            self.seen.append(torch.is_inference_mode_enabled())
            return super().propose(state)

    probe = Probe()
    probe.learns = learns
    decode(Runner.for_model(target), probe, list(range(5, 13)), 4, Sampler(), make_generator(0))
    assert probe.seen and all(s is (not learns) for s in probe.seen)
    assert not torch.is_inference_mode_enabled()  # and nothing leaks out of it
