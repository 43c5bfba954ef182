"""dvi_lite.methods.medusa.tree_attention: parent validation, the sdpa reference, the mask-free Triton kernel
and its check (tree_attention_check).

Without a GPU the Triton kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set below before
anything imports triton). On a GPU machine, `TRITON_INTERPRET=0 pytest tests/test_tree_attention.py`
runs the same tests on the compiled kernel with CUDA tensors.

Tolerances:
  * reference vs a naive per-node loop (explicit float64 softmax over cache + ancestors): fp32 inputs,
    atol=rtol=1e-5 (well above float32 reassociation inside sdpa);
  * Triton vs reference, fp32: atol=rtol=1e-4 (the kernel uses IEEE fp32 dots, no TF32);
  * Triton fp16 vs the fp32 reference on the same (fp16-rounded) inputs: atol=rtol=5e-3 (fp16 output
    rounding alone is up to ~1e-3 for outputs of magnitude ~2, plus fp16 probabilities in the P @ V dot).
A wrong mask, GQA mapping or softmax changes outputs by O(0.1-1), far above all of these.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import: the only way to run kernels on CPU

import pytest
import torch
import torch.nn.functional as F

import dvi_lite.core.runner as runner
import dvi_lite.methods.medusa.tree_attention as ta
import dvi_lite.methods.medusa.tree_attention_check as tac
from dvi_lite.methods.medusa.tree_attention import (
    available_backends,
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
    validate_parents,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
HAS_TRITON = "triton" in available_backends() and (INTERPRET or DEVICE == "cuda")
# Triton is a dependency on Linux: there a missing or broken triton FAILS these tests (the module sets
# TRITON_INTERPRET=1 on CPU, so it always can run). They are skipped only off Linux (no triton wheel).
needs_triton = pytest.mark.skipif(
    not HAS_TRITON and sys.platform != "linux", reason="no triton on this platform (Linux always has it)")


def _inputs(B, H, Hkv, N, P, D, gen, dtype=torch.float32, device=DEVICE):
    """q (B,H,N,D), k_cache/v_cache (B,Hkv,P,D), k_new/v_new (B,Hkv,N,D), standard normal."""
    shapes = ((B, H, N, D), (B, Hkv, P, D), (B, Hkv, P, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def _random_parents(n, gen) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]


def _naive(q, k_cache, v_cache, k_new, v_new, parents, scale=None):
    """One node at a time: walk the parent chain, softmax (float64) over cache + ancestors + self."""
    B, H, N, D = q.shape
    group = H // k_cache.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, H, N, D, dtype=torch.float64)
    for i in range(N):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = parents[j]
        for b in range(B):
            for h in range(H):
                kv = h // group
                k = torch.cat([k_cache[b, kv], k_new[b, kv, chain]]).double()  # (P + depth + 1, D)
                v = torch.cat([v_cache[b, kv], v_new[b, kv, chain]]).double()
                w = torch.softmax(k @ q[b, h, i].double() * scale, dim=0)
                out[b, h, i] = w @ v
    return out


# ---------------------------------------------------------------------------------------- validate_parents

@pytest.mark.parametrize("bad, why", [
    ([-1, 2, 0], "cycle or forward reference"),        # forward reference (node 1 -> node 2)
    ([-1, 0, 3, 2], "cycle or forward reference"),     # 2 <-> 3: a cycle is always a forward reference somewhere
    ([-1, 1], "self reference"),                        # self reference
    ([-1, 0, 7], "outside the tree"),                   # index past the end
    ([-1, -2], ">= -1"),                                # below -1
    (torch.tensor([[-1, 0]]), "1-D"),                   # 2-D
    (torch.tensor(-1), "1-D"),                          # 0-D
    (torch.tensor([-1.0, 0.0]), "integer dtype"),       # float dtype
    (torch.tensor([True, False]), "integer dtype"),     # bool dtype
])
def test_validate_parents_rejects(bad, why):
    with pytest.raises(ValueError, match="parents") as e:
        validate_parents(bad)
    assert why in str(e.value)


def test_validate_parents_names_offending_index():
    with pytest.raises(ValueError, match=r"parents\[2\].*index 2"):
        validate_parents([-1, 0, 2, 1])


def test_validate_parents_single_root_option():
    siblings = [-1, -1, 0, 1]  # two children of the committed token: fine by default
    assert validate_parents(siblings).tolist() == siblings
    with pytest.raises(ValueError, match="parents has several roots"):
        validate_parents(siblings, require_single_root=True)
    assert validate_parents([-1, 0, 0, 1], require_single_root=True).tolist() == [-1, 0, 0, 1]


def test_validate_parents_accepts_and_normalises():
    out = validate_parents(torch.tensor([-1, 0, 0, 2], dtype=torch.int32))
    assert out.dtype == torch.long and out.tolist() == [-1, 0, 0, 2]
    assert validate_parents([]).dtype == torch.long and validate_parents([]).numel() == 0
    assert validate_parents((-1,)).tolist() == [-1]


# ---------------------------------------------------------------------------------------- reference

TREES = {
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [-1] * 6,
    "medusa": [-1, -1, 0, 0, 1, 2, 2, 4, 5],
    "random": _random_parents(12, torch.Generator().manual_seed(5)),
}


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("H, Hkv, P", [(4, 2, 7), (2, 2, 0), (6, 1, 3)])
def test_reference_equals_naive_loop(name, H, Hkv, P):
    par = TREES[name]
    x = _inputs(2, H, Hkv, len(par), P, 16, torch.Generator().manual_seed(1), device="cpu")
    got = tree_attention_reference(*x, par)
    torch.testing.assert_close(got.double(), _naive(*x, par), atol=1e-5, rtol=1e-5)
    got_s = tree_attention_reference(*x, torch.tensor(par), scale=0.3)
    torch.testing.assert_close(got_s.double(), _naive(*x, par, scale=0.3), atol=1e-5, rtol=1e-5)


def test_chain_is_causal_attention_and_star_sees_only_itself():
    B, H, Hkv, N, P, D = 1, 4, 2, 6, 5, 16
    q, kc, vc, kn, vn = _inputs(B, H, Hkv, N, P, D, torch.Generator().manual_seed(2), device="cpu")
    k = torch.cat([kc, kn], 2).repeat_interleave(2, 1)
    v = torch.cat([vc, vn], 2).repeat_interleave(2, 1)
    causal = torch.arange(P + N)[None, :] <= P + torch.arange(N)[:, None]  # (N, P + N)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(tree_attention_reference(q, kc, vc, kn, vn, TREES["chain"]), want)
    star = torch.cat([torch.ones(N, P, dtype=torch.bool), torch.eye(N, dtype=torch.bool)], 1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=star)
    torch.testing.assert_close(tree_attention_reference(q, kc, vc, kn, vn, TREES["star"]), want)


# ---------------------------------------------------------------------------------------- triton

@needs_triton
def test_triton_matches_reference_fuzz():
    """>= 200 random trees (chains and stars included) and shapes, fp32, atol=rtol=1e-4."""
    gen = torch.Generator().manual_seed(1234)
    heads = [(2, 1), (4, 2), (2, 2)]
    worst = 0.0
    for t in range(210):
        N = int(torch.randint(1, 25, (1,), generator=gen))
        P = int(torch.randint(0, 41, (1,), generator=gen))
        D = [16, 32][int(torch.randint(0, 2, (1,), generator=gen))]
        H, Hkv = heads[int(torch.randint(0, 3, (1,), generator=gen))]
        B = int(torch.randint(1, 3, (1,), generator=gen))
        par = [i - 1 for i in range(N)] if t % 10 == 0 else [-1] * N if t % 10 == 1 else _random_parents(N, gen)
        x = _inputs(B, H, Hkv, N, P, D, gen)
        ref = tree_attention_reference(*x, par)
        got = tree_attention_triton(*x, par)
        assert got.shape == (B, H, N, D) and got.dtype == torch.float32
        where = f"tree {t}: B={B} H={H} Hkv={Hkv} N={N} P={P} D={D} parents={par}"
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda m, where=where: f"{where}\n{m}")
        worst = max(worst, (got - ref).abs().max().item())
    assert worst < 1e-4


@needs_triton
def test_triton_never_builds_a_mask(monkeypatch):
    """The kernel decides ancestry in-kernel: the dense-mask helpers must not be called at all."""
    def boom(*a, **k):
        raise AssertionError("dense tree mask built")
    monkeypatch.setattr(ta, "tree_mask", boom)
    monkeypatch.setattr(runner, "ancestor_matrix", boom)
    par = TREES["medusa"]
    x = _inputs(1, 4, 2, len(par), 9, 16, torch.Generator().manual_seed(3))
    got = tree_attention_triton(*x, par)
    torch.testing.assert_close(got.cpu().double(), _naive(*[t.cpu() for t in x], par), atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_edge_cases_and_strided_inputs():
    gen = torch.Generator().manual_seed(4)
    # no past, a single node, an empty tree, a head_dim that is not a power of two, a wide block (N > 64)
    for B, H, Hkv, N, P, D in [(1, 2, 1, 5, 0, 16), (2, 2, 2, 1, 3, 16), (1, 2, 1, 0, 4, 16),
                               (1, 2, 1, 7, 5, 20), (1, 2, 1, 70, 3, 16)]:
        par = _random_parents(N, gen)
        x = _inputs(B, H, Hkv, N, P, D, gen)
        torch.testing.assert_close(tree_attention_triton(*x, par), tree_attention_reference(*x, par),
                                   atol=1e-4, rtol=1e-4)
    # the engine's layout: the past is a slice of a preallocated cache, q comes from a transpose
    B, H, Hkv, N, P, D = 2, 4, 2, 9, 11, 32
    buf_k = torch.randn(B, Hkv, 64, D, generator=gen).to(DEVICE)
    buf_v = torch.randn(B, Hkv, 64, D, generator=gen).to(DEVICE)
    q = torch.randn(B, N, H, D, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, N, D), non-contiguous
    kn, vn = (torch.randn(B, Hkv, N, D, generator=gen).to(DEVICE) for _ in range(2))
    par = TREES["medusa"]
    args = (q, buf_k[:, :, :P], buf_v[:, :, :P], kn, vn, par)
    torch.testing.assert_close(tree_attention_triton(*args, scale=0.2), tree_attention_reference(*args, scale=0.2),
                               atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_fp16():
    """fp16 inputs vs the fp32 reference on the same rounded inputs: atol=rtol=5e-3."""
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        N, P = int(torch.randint(1, 25, (1,), generator=gen)), int(torch.randint(0, 41, (1,), generator=gen))
        par = _random_parents(N, gen)
        x = _inputs(2, 4, 2, N, P, 32, gen, dtype=torch.float16)
        got = tree_attention_triton(*x, par)  # an interpreter without fp16 dots is a failure, not a skip
        assert got.dtype == torch.float16
        ref = tree_attention_reference(*[t.float() for t in x], par)
        torch.testing.assert_close(got.float(), ref, atol=5e-3, rtol=5e-3)


# ---------------------------------------------------------------------------------------- dispatch and errors

def test_backend_dispatch(monkeypatch):
    x = _inputs(1, 2, 1, 3, 2, 16, torch.Generator().manual_seed(7), device="cpu")
    with pytest.raises(ValueError, match="backend.*'auto', 'torch', 'triton'"):
        tree_attention(*x, [-1, 0, 0], backend="bogus")
    assert "torch" in available_backends()

    def no_triton(*a, **k):
        raise AssertionError("auto picked triton for CPU tensors")
    monkeypatch.setattr(ta, "tree_attention_triton", no_triton)
    torch.testing.assert_close(tree_attention(*x, [-1, 0, 0]), tree_attention_reference(*x, [-1, 0, 0]))
    torch.testing.assert_close(tree_attention(*x, [-1, 0, 0], backend="torch"),
                               tree_attention_reference(*x, [-1, 0, 0]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shape_errors_name_the_argument(backend):
    if backend == "triton":
        kernel_runs_here()
    gen = torch.Generator().manual_seed(8)
    q, kc, vc, kn, vn = _inputs(1, 4, 2, 3, 5, 16, gen)
    par = [-1, 0, 1]
    cases = [
        ((q[0], kc, vc, kn, vn, par), "q must be a 4-D"),
        ((q, kc[..., :8], vc, kn, vn, par), "k_cache must have shape"),
        ((q, kc, vc[:, :, :4], kn, vn, par), "v_cache must have shape"),
        ((q, kc, vc, kn[:, :, :2], vn, par), "k_new must have shape"),
        ((q, kc, vc, kn, vn[:, :1], par), "v_new must have shape"),
        ((q[:, :3], kc, vc, kn, vn, par), "k_cache has 2 kv heads"),
        ((q, kc, vc, kn, vn, [-1, 0]), "parents has 2 entries"),
        ((q, kc, vc, kn, vn, [-1, 0, 5]), "parents"),
        ((q.double(), kc, vc, kn, vn, par), "share one dtype"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            tree_attention(*args, backend=backend)


@needs_triton
def test_cli_check_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert tac.main(["--check", "--n", "2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["trees"] == 2


def test_cli_rejects_bad_n(capsys):
    with pytest.raises(SystemExit) as e:
        tac.main(["--check", "--n", "0"])
    assert e.value.code == 2
    assert "--n must be >= 1, got 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- on the decode path
#
# Runner(model, attention="triton") verifies the engine's trees with the kernel (through transformers'
# AttentionInterface). Against the dense-mask sdpa reference, through the engine, on a tiny GQA model (4 query,
# 2 kv heads), fp32: the target's logits at every node agree to atol=rtol=1e-4 (the kernel's fp32 tolerance
# above: |logits| reach ~20 here, and a wrong mask or position moves them by O(1)), and the accepted paths,
# next tokens and generated tokens are equal. Few nodes and steps: the interpreter is slow.

from helpers import IdTokenizer, make_target  # noqa: E402

import dvi_lite  # noqa: E402
from dvi_lite.core.engine import start, step  # noqa: E402
from dvi_lite.core.runner import Runner  # noqa: E402
from dvi_lite.core.sampling import Sampler, make_generator  # noqa: E402
from dvi_lite.methods.medusa.drafter import make_drafter  # noqa: E402
from dvi_lite.methods.medusa.heads import MedusaHeads  # noqa: E402

DECODE_TREES = {  # one per tree builder
    "cartesian": dict(tree="cartesian", branch=2, K=2),
    "pruned": dict(tree="pruned", branch=3, max_nodes=6),
    "sparse": dict(tree="sparse", branch=3, max_nodes=6,
                   accuracies=[[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]),
    "custom": dict(tree=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)], branch=2),
}
PROMPT = [7, 3, 9, 11, 40, 2]


def kernel_runs_here() -> None:
    """Triton is a dependency on Linux: there its absence FAILS these tests (no skip). Elsewhere (macOS has no
    triton wheel) they are skipped."""
    import sys

    if not HAS_TRITON:
        assert sys.platform != "linux", "triton must run here (Linux): install it, or set TRITON_INTERPRET=1 on CPU"
        pytest.skip("triton cannot run on this platform")


@pytest.fixture(scope="module")
def gqa_model():
    return make_target().to(DEVICE)


def perturbed_heads(model, num_heads=3, seed=1, scale=0.3) -> MedusaHeads:
    """Heads between the model's next token and noise, so trees are partly accepted (as in test_medusa)."""
    heads = MedusaHeads(model, num_heads).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.linear.weight.copy_(scale * torch.randn(blk.linear.weight.shape, generator=g).to(DEVICE))
    return heads


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", list(DECODE_TREES))
def test_kernel_on_the_decode_path_equals_sdpa(gqa_model, monkeypatch, name, temperature, steps=4):
    """Two engines in lockstep, sdpa vs kernel: equal proposals, logits (allclose), accepted paths and tokens."""
    kernel_runs_here()
    model = gqa_model
    heads = perturbed_heads(model)
    triton_runner = Runner.for_model(model, "triton")
    calls = []
    prepare = triton_runner.tree_kernel
    monkeypatch.setattr(triton_runner, "tree_kernel", lambda parents: calls.append(len(parents)) or prepare(parents))
    sampler = Sampler(temperature)
    engine_runner = Runner.for_model(model)  # what generate() uses: the proposals name the kernel's runner
    runs = []
    for attention in ("sdpa", "triton"):
        drafter = make_drafter(model, None, heads=heads, attention=attention, **DECODE_TREES[name])
        runs.append((drafter, start(engine_runner, drafter, PROMPT, 40, sampler, make_generator(0, DEVICE))))
    assert runs[0][0].runner is engine_runner and runs[1][0].runner is triton_runner
    accepted = 0
    for i in range(steps):
        (ref, _), (got, _) = (step(state, drafter) for drafter, state in runs)
        assert torch.equal(got.proposal.tokens, ref.proposal.tokens) and len(ref.proposal) > 0
        assert got.proposal.runner is triton_runner and ref.proposal.runner is None
        torch.testing.assert_close(got.p_logits, ref.p_logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"{name}, T={temperature}, step {i}: {m}")
        assert (got.path, got.next_token) == (ref.path, ref.next_token)
        accepted += len(ref.path)
    assert runs[0][1].tokens == runs[1][1].tokens
    assert len(calls) == steps and all(n > 1 for n in calls)  # every verification went through the kernel once
    if temperature == 0.0:
        assert accepted > 0  # the accepted path's cache gather ran on kernel-written keys and values


def test_kernel_option_through_generate(gqa_model):
    """The medusa option attention="triton" through generate(): the greedy tokens are AR's."""
    kernel_runs_here()
    heads = perturbed_heads(gqa_model)
    ar = dvi_lite.generate(gqa_model, IdTokenizer(), PROMPT, max_new_tokens=8, stop_at_eos=False)
    md = dvi_lite.generate(gqa_model, IdTokenizer(), PROMPT, method="medusa", heads=heads, attention="triton",
                           tree="cartesian", branch=2, K=2, max_new_tokens=8, stop_at_eos=False)
    assert md.token_ids == ar.token_ids and sum(s.accepted for s in md.stats.steps) > 0


def test_kernel_runner_keeps_chains_on_sdpa_and_restores_the_config(gqa_model, monkeypatch):
    """Chains (prefill, draft chains) never reach the kernel; the attention implementation is swapped only
    for the duration of a tree forward."""
    kernel_runs_here()
    r = Runner.for_model(gqa_model, "triton")
    calls = []
    monkeypatch.setattr(r, "tree_kernel", lambda parents: calls.append(parents) or None)
    cache = r.new_cache(16)
    ref = Runner.for_model(gqa_model)
    ref_cache = ref.new_cache(16)
    for ids in ([PROMPT], [[5, 6, 7]]):  # a prefill, then a chain after a cached prefix
        got, _ = r.forward(torch.tensor(ids, device=DEVICE), cache)
        want, _ = ref.forward(torch.tensor(ids, device=DEVICE), ref_cache)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert calls == [] and gqa_model.config._attn_implementation == "sdpa"
    assert Runner.for_model(gqa_model, "triton") is r is not Runner.for_model(gqa_model)
    monkeypatch.undo()
    from transformers import AttentionInterface

    seen = []

    def spy(module, *args, **kw):
        seen.append(module.config._attn_implementation)
        return runner.hf_tree_attention(module, *args, **kw)
    monkeypatch.setitem(AttentionInterface._global_mapping, runner.HF_TREE_ATTENTION, spy)
    r.forward(torch.tensor([[1, 2, 3]], device=DEVICE), cache, parents=torch.tensor([-1, 0, 0], device=DEVICE))
    assert seen == [runner.HF_TREE_ATTENTION] * r.n_layers and gqa_model.config._attn_implementation == "sdpa"


def test_kernel_backend_reports_why_it_cannot_run(monkeypatch):
    """Runner(attention="triton") fails when built, with the reason, not mid-decoding."""
    monkeypatch.setattr(ta, "_TRITON", {"error": "ImportError: No module named 'triton'"})
    with pytest.raises(RuntimeError, match="needs triton, which does not import here"):
        ta.triton_kernel_for("cpu")
    monkeypatch.setattr(ta, "_TRITON", {"triton": None, "kernel": None, "interpret": False})
    with pytest.raises(RuntimeError, match="needs a CUDA model.*TRITON_INTERPRET=1"):
        ta.triton_kernel_for("cpu")
