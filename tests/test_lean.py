"""The lean runtime (core/lean.py): our own forward over the HF checkpoint's packed weights, and its int8 variant.

What must hold: in fp32 the lean forward computes what the HF modules compute (here, bit for bit on the course
model: the fused matmuls and torch's RMSNorm happen to round the same), so the lean AR equals HF generate, every
method on the lean runtime equals the lean AR, and every drafter plugs in unchanged. int8 serves another target
(its weights rounded): losslessness is against that target, its own AR and its own law.
"""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import PROMPT8, assert_lossless_sampling, exact_joint, pair_laws, planned_draws

import dvi_lite
from dvi_lite.core.lean import Int8Weight, LeanRunner, UnsupportedModel, runtime_of, use_runtime
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.core.sampling import Sampler
from dvi_lite.measure.cost import weight_bytes
from dvi_lite.models.corpus import load_prompts
from dvi_lite.study.bench import spread


def served(model, runtime: str):
    """A copy of `model` served on `runtime` (the fixtures are shared: the runtime is a property of the model)."""
    m = copy.deepcopy(model)
    use_runtime(m, runtime)
    return m


@pytest.mark.parametrize("quant", [None, "int8"])
def test_every_runner_argument_means_what_it_means_on_the_hf_runner(target, quant):
    """Chains, trees, start/end, skips, explicit masks and captures: the lean forward's logits against the HF
    runner's (bit for bit in fp32; int8 within its rounding), over one cache each, step by step."""
    hf, lean = Runner(target), LeanRunner(target, quant=quant)
    ca, cb = hf.new_cache(40), lean.new_cache(40)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 60, (1, 12), generator=g)
    parents = torch.tensor([-1, 0, 0, 1])
    tol = 0.0 if quant is None else 0.5

    def both(f):
        a, b = f(hf, ca), f(lean, cb)
        assert a.shape == b.shape and (a - b).abs().max().item() <= tol, f
        return a, b

    both(lambda r, c: r.forward(ids[:, :6], c)[0])  # prefill (causal, no mask)
    both(lambda r, c: r.forward(ids[:, 6:9], c)[0])  # a chain over a cache
    both(lambda r, c: r.forward(ids[:, 9:10], c)[0])  # one token
    both(lambda r, c: r.forward(ids[:, 8:12], c, parents=parents)[0])  # a tree
    for c in (ca, cb):
        c.crop(10)
    skip = Skip(attn=frozenset({1}), mlp=frozenset({0}))
    both(lambda r, c: r.forward(ids[:, 10:12], c, skip=skip)[0])
    for c in (ca, cb):
        c.crop(10)
    caps = []

    def split(r, c):
        cap = {0: None, 1: None, 2: None}
        pos = r.positions(c, 2)
        h = r.layers_forward(r.embed(ids[:, 10:12]), c, pos, 0, 1, capture=cap)
        h = r.layers_forward(h, c, pos, 1, capture=cap)
        caps.append(cap)
        return r.logits(h)

    both(split)
    for k in (0, 1, 2):
        assert (caps[0][k] - caps[1][k]).abs().max().item() <= tol
    assert ca.lens == cb.lens


def test_the_lean_forward_runs_a_batch_without_a_cache(target):
    ids = torch.randint(1, 60, (3, 7), generator=torch.Generator().manual_seed(1))
    want = target(ids).logits
    got = LeanRunner(target).forward(ids, None)[0]
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="batch 1"):
        r = LeanRunner(target)
        r.forward(ids, r.new_cache(20))


def test_int8_rounds_each_row_to_within_half_a_step():
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (24,)
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()


def test_int4_is_the_grouped_rounding_it_says():
    """The kernel's product with an Int4Weight equals x @ ((q - 8) * scale + zero).T, with q the rounding of each
    group of 32 inputs onto 16 levels from its min to its max: every weight within half a step."""
    from dvi_lite.core.lean import Int4Weight, linear

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    g = w.view(64, 3, 32)
    lo, step = g.amin(-1, keepdim=True), (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    deq = (torch.round((g - lo) / step) * step + lo).view(64, 96)
    assert ((deq - w).abs() <= step.repeat_interleave(32, -1).view(64, 96) / 2 + 1e-6).all()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(linear(x, Int4Weight.quantize(w)), x @ deq.T, atol=1e-4)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Weight.quantize(torch.randn(8, 40))


def test_unsupported_checkpoints_and_runtimes_get_a_clear_error(target):
    m = copy.deepcopy(target)
    m.config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModel, match="supports a Llama-family.*hidden_act 'gelu'.*runtime 'hf'"):
        use_runtime(m, "lean")
    assert runtime_of(m) == "hf"  # nothing changed
    odd = copy.deepcopy(target)
    odd.model.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(UnsupportedModel, match="layer 1's weights cannot be packed.*runtime 'hf'"):
        use_runtime(odd, "int8")
    with pytest.raises(ValueError, match=r"runtime must be one of \['hf', 'lean', 'int8', 'int4'\], got 'fast'"):
        use_runtime(copy.deepcopy(target), "fast")


def test_use_runtime_switches_what_every_method_runs_on(target):
    m = served(target, "int8")
    assert isinstance(Runner.for_model(m), LeanRunner) and Runner.for_model(m).quant == "int8"
    assert weight_bytes(m) < weight_bytes(target) / 3  # fp32 -> int8 + one scale per row
    use_runtime(m, "hf")
    assert not isinstance(Runner.for_model(m), LeanRunner) and weight_bytes(m) == weight_bytes(target)


# ---------------------------------------------------------------- the course model, greedy (fp32)

N_PROMPTS, NEW = 3, 20
METHODS = {
    "sps": ("sps", {"K": 4}),
    "pld": ("pld", {}),
    "kangaroo": ("kangaroo", {"split": 2, "branch": 3}),
    "draft_verify": ("draft_verify", {"skip": {"attn": [3, 5, 7, 9], "mlp": [2, 4, 6, 8, 10]}}),
    "medusa": ("medusa", {}),
    "dvi": ("dvi", {"split": 2}),
    "eagle": ("eagle", {}),
}


@pytest.fixture(scope="module")
def course():
    model, tok = dvi_lite.load_model()
    return model, tok, dvi_lite.load_draft_model()


# The quantized runtimes run in fp32 activations (their most exact precision), where torch's int8 / int4 kernels are
# slow: one method of each kind (a draft model's chain, a self-speculative tree, heads' tree, features' tree) there.
QUANTIZED_METHODS = ("sps", "kangaroo", "medusa", "eagle")


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["lean", "int8", "int4"])
def test_every_method_on_a_runtime_equals_that_runtimes_ar(course, runtime):
    """fp32 greedy on the course model: lean AR == HF generate; on each runtime, each method == its AR."""
    base, tok, draft = course
    model = served(base, runtime)
    methods = METHODS if runtime == "lean" else {k: METHODS[k] for k in QUANTIZED_METHODS}
    flips = 0
    n_prompts, new = (N_PROMPTS, NEW) if runtime == "lean" else (2, 12)
    for p in spread(load_prompts(), n_prompts):
        ar = dvi_lite.generate(model, tok, p["prompt"], method="ar", max_new_tokens=new).token_ids
        if runtime == "lean":
            hf = dvi_lite.generate(base, tok, p["prompt"], method="hf", max_new_tokens=new).token_ids
            assert ar == hf, p["id"]
        else:
            flips += ar != dvi_lite.generate(base, tok, p["prompt"], method="ar", max_new_tokens=new).token_ids
        for label, (method, opts) in methods.items():
            kw = {"draft_model": draft} if method == "sps" else {}
            out = dvi_lite.generate(model, tok, p["prompt"], method=method, max_new_tokens=new, **opts, **kw)
            assert out.token_ids == ar, (runtime, label, p["id"])
    if runtime != "lean":
        print(f"{runtime}: {flips} of 2 prompts decode differently from the fp32 weights' AR")


# ---------------------------------------------------------------- sampling law, on the runtime being served

@pytest.mark.parametrize("runtime", ["lean", "int8", "int4"])
def test_a_trained_drafter_is_lossless_on_the_runtime(target8, tok8, runtime):
    """Medusa heads (perturbed off the identity) on a 3-deep tree: the output law equals the law of the target
    being served, whose conditionals the enumeration takes from that runtime's own forward."""
    from helpers import perturbed_heads

    model = served(target8, runtime)
    sampler = dict(temperature=1.0)
    if runtime != "lean":  # a quantized target is another law: the test would be meaningless if they were equal
        a = pair_laws(exact_joint(target8, Sampler(**sampler), PROMPT8, 5))[0]
        b = pair_laws(exact_joint(model, Sampler(**sampler), PROMPT8, 5))[0]
        assert not torch.equal(a, b)
    n = planned_draws(pair_laws(exact_joint(model, Sampler(**sampler), PROMPT8, 5)))
    rep = assert_lossless_sampling(model, tok8, "medusa", max_new_tokens=5, n=n, heads=perturbed_heads(target8),
                                   K=3, branch=2, tree="cartesian", min_run=2, **sampler)
    print(rep)


@pytest.mark.slow
def test_the_lean_ar_equals_hf_generate_on_spec_bench_questions():
    """SmolLM2 in fp32 on the lean runtime: AR's tokens are the real-model reference's, which test_smollm2 checks
    against HF generate (Spec-Bench dev questions, chat template; every other one of the reference's, shortest
    first: four task groups)."""
    from helpers import smollm2_reference
    from test_smollm2 import smollm2

    base, tok = smollm2("float32")
    model = served(base, "lean")  # a copy: the cached model stays on the HF runtime for the other tests
    for i, (prompt, ref) in enumerate(smollm2_reference()[::2]):
        out = dvi_lite.generate(model, tok, prompt, method="ar", max_new_tokens=len(ref))
        assert out.token_ids == ref, f"question {i}"
