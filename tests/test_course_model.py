"""Integration tests on the committed course model and draft model (fp32, CPU, no network).

The losslessness tests here are the most important ones in the project: in fp32 greedy mode every
method's tokens must equal plain greedy decoding and HF `generate`, token for token.
"""
import os

import pytest
import torch
from helpers import ALPHA

import dvi_lite
from dvi_lite.models.corpus import load_prompts, verify_snapshot
from dvi_lite.models.loading import COURSE_MODEL, DRAFT_MODEL
from dvi_lite.study.bench import spread

pytestmark = pytest.mark.slow
NEW = 64


@pytest.fixture(scope="module")
def course():
    os.environ["HF_HUB_OFFLINE"] = "1"  # any attempt to reach a hub would fail loudly
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return dvi_lite.load_model()


# Held-out prompts per greedy-equality test, spread over both domains (code, prose): 12 x NEW tokens per method
# (the suite must stay within 15 minutes on 2 cores; 12 spread prompts cover both domains and their lengths).
N_PROMPTS = 12


@pytest.fixture(scope="module")
def draft():
    return dvi_lite.load_draft_model()


@pytest.fixture(scope="module")
def ar_outputs(course):
    model, tok = course
    return {p["id"]: dvi_lite.generate(model, tok, p["prompt"], method="ar", max_new_tokens=NEW).token_ids
            for p in spread(load_prompts(), N_PROMPTS)}


def test_corpus_snapshot_matches_manifest():
    verify_snapshot()


def test_model_and_tokenizer_load_from_data(course):
    model, tok = course
    assert model.config.num_hidden_layers >= 8 and model.dtype == torch.float32 and not model.training
    assert (COURSE_MODEL / "MODEL_CARD.md").is_file() and (DRAFT_MODEL / "MODEL_CARD.md").is_file()


def test_tokenizer_round_trip_on_all_prompts(course):
    _, tok = course
    for p in load_prompts():
        assert tok.decode(tok(p["prompt"], add_special_tokens=False)["input_ids"]) == p["prompt"]


def test_prompt_sets():
    prompts = load_prompts()
    assert len(prompts) >= 200 and {p["domain"] for p in prompts} == {"code", "prose"}
    assert len({p["id"] for p in prompts}) == len(prompts)


def test_ar_equals_hf_generate_on_the_prompts(course, ar_outputs):
    model, tok = course
    for p in spread(load_prompts(), N_PROMPTS):
        ids = tok(p["prompt"], return_tensors="pt")["input_ids"]
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert ar_outputs[p["id"]] == hf, p["id"]


@pytest.mark.parametrize("k", [4])
def test_sps_greedy_equals_ar_on_the_prompts(course, draft, ar_outputs, k):
    model, tok = course
    accepted = drafted = 0
    for p in spread(load_prompts(), N_PROMPTS):
        out = dvi_lite.generate(model, tok, p["prompt"], method="sps", draft_model=draft, K=k, max_new_tokens=NEW)
        assert out.token_ids == ar_outputs[p["id"]], p["id"]
        accepted += sum(s.accepted for s in out.stats.steps)
        drafted += sum(s.depth for s in out.stats.steps)
    assert 0 < accepted < drafted  # a real draft: some accepted, some rejected


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sps_sampling_matches_target_law_on_course_model(course, draft, temperature, top_p):
    """The first verified token's law equals the processed target p (chi-square, 20k draws, p > 1e-3)."""
    from dvi_lite.course.ch01_speculative_sampling import token_histograms

    model, tok = course
    res = token_histograms(model, tok, "def read_config(path):\n    ", n_samples=20_000, temperature=temperature,
                           top_p=top_p, draft_model=draft, seed=0)
    assert res["spec_vs_p"]["pvalue"] > ALPHA, res["spec_vs_p"]


def test_generate_bad_inputs_course(course):
    model, tok = course
    with pytest.raises(ValueError, match="max_new_tokens"):
        dvi_lite.generate(model, tok, "x" * 3000, max_new_tokens=10)
    with pytest.raises(ValueError, match="vocabulary"):
        from transformers import LlamaConfig, LlamaForCausalLM
        other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32))
        dvi_lite.generate(model, tok, "def f", method="sps", draft_model=other)


SELF_SPEC = {
    "kangaroo (chain)": ("kangaroo", {"split": 2}),
    "kangaroo (tree)": ("kangaroo", {"split": 2, "branch": 3}),
    "draft_verify": ("draft_verify", {"skip": {"attn": [3, 5, 7, 9], "mlp": [2, 4, 6, 8, 10]}}),
    "medusa": ("medusa", {}),
    "dvi": ("dvi", {"split": 2}),  # the trained head of notebook 05 (data/dvi/policy.pt)
    # the committed head (data/eagle/head.pt, eagle/recipe.py): a chain and EAGLE-2's dynamic tree
    "eagle (chain)": ("eagle", {"tree": "chain"}),
    "eagle (dynamic)": ("eagle", {}),
}


@pytest.mark.parametrize("label", list(SELF_SPEC))
def test_self_speculative_greedy_equals_ar_on_the_prompts(course, ar_outputs, label):
    """Kangaroo (committed adapter; chain and tree drafts), Draft & Verify, Medusa, DVI and EAGLE (committed head;
    chain and dynamic tree): first 32 tokens equal AR's (and so HF generate's)."""
    model, tok = course
    method, opts = SELF_SPEC[label]
    accepted = tested = 0
    for p in spread(load_prompts(), N_PROMPTS):
        out = dvi_lite.generate(model, tok, p["prompt"], method=method, max_new_tokens=32, **opts)
        assert out.token_ids == ar_outputs[p["id"]][: len(out.token_ids)], (label, p["id"])
        assert len(out.token_ids) == 32 or out.token_ids[-1] == tok.eos_token_id
        accepted += sum(s.accepted for s in out.stats.steps)
        tested += sum(s.accepted + (s.accepted < s.depth) for s in out.stats.steps)
    assert 0 < accepted < tested
