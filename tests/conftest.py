"""Shared fixtures: tiny random Llama models (never the course model), a stub tokenizer.

Random-init Llamas are bad stand-ins for a language model: with the default init (std 0.02) the
residual stream is dominated by the token's own embedding, and since the LM head is tied to the
embeddings, every model just repeats its last input token (greedy acceptance is then always 1).
The recipe below gives peaked, varied, next-token distributions and a draft that agrees with the
target only partly (alpha around 0.3-0.6), which is what the speculative tests need:
  * target: init std 0.3, final-norm weight x3 (sharper logits), layers >= 1 damped x0.4 so the
    model is "layer 0 plus a correction";
  * draft: a 1-layer model (seed 1) that copies the target's embeddings, final norm and layer 0
    (an early-exit draft), with 10 % Gaussian noise (seed 1) on its layer weights.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)  # 2 cores and a background job: one thread is fastest for these tiny models

VOCAB = 64
EOS = 63  # the stub tokenizer's eos: an id the tests control (the models' config eos/bos/pad is 0)


def tiny_cfg(vocab=VOCAB, layers=2, d=32, heads=4, kv_heads=2, ffn=64, max_pos=128, init=0.3) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=max_pos,
                       tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=0,
                       initializer_range=init, attn_implementation="sdpa")


def make_target(vocab=VOCAB, layers=3, seed=0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_cfg(vocab=vocab, layers=layers, **kw)).float().eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.4)
            layer.mlp.down_proj.weight.mul_(0.4)
    return model


def make_draft(target: LlamaForCausalLM, seed=1, noise=0.1) -> LlamaForCausalLM:
    cfg = target.config
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(tiny_cfg(vocab=cfg.vocab_size, layers=1, d=cfg.hidden_size,
                                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                                      ffn=cfg.intermediate_size, max_pos=cfg.max_position_embeddings)).float().eval()
    keep = {k: v for k, v in target.state_dict().items()
            if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    draft.load_state_dict(keep, strict=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "layers." in name:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return draft


class StubTokenizer:
    """Just what dvi_lite.generate needs: eos_token_id, decode(ids), __call__(text)."""

    def __init__(self, vocab=VOCAB, eos_token_id=EOS):
        self.vocab = vocab
        self.eos_token_id = eos_token_id

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % self.vocab for c in text]}


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return make_target()


@pytest.fixture(scope="session")
def draft(target) -> LlamaForCausalLM:
    return make_draft(target)


@pytest.fixture(scope="session")
def tok() -> StubTokenizer:
    return StubTokenizer()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """10 random prompts of 2..7 ids in [1, 62] (no eos, no pad)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(10):
        n = int(torch.randint(2, 8, (1,), generator=g))
        out.append(torch.randint(1, EOS, (n,), generator=g).tolist())
    return out


@pytest.fixture(scope="session")
def target8() -> LlamaForCausalLM:
    """Vocabulary-8 target for exact-law tests (enumerating 8**3 continuations is cheap)."""
    return make_target(vocab=8, layers=2, seed=2)


@pytest.fixture(scope="session")
def draft8(target8) -> LlamaForCausalLM:
    return make_draft(target8, seed=3, noise=0.3)


@pytest.fixture(scope="session")
def tok8() -> StubTokenizer:
    return StubTokenizer(vocab=8, eos_token_id=None)


# ---------------------------------------------------------------- statistics helpers (imported by tests)

def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed `counts` to the law `probs` (same shape, any dims).

    Cells with probability exactly 0 must never be observed (asserted). Cells whose expected count is
    below `min_expected` are pooled into one cell (merged with the smallest other cell if the pool is
    still too small), the usual validity condition of the chi-square approximation.
    """
    import numpy as np
    from scipy.stats import chisquare

    obs = np.asarray(counts, dtype=np.float64).ravel()
    p = np.asarray(torch.as_tensor(probs, dtype=torch.float64).cpu(), dtype=np.float64).ravel()
    assert obs.shape == p.shape
    assert (p >= 0).all()
    impossible = p == 0
    assert obs[impossible].sum() == 0, f"tokens of probability 0 were emitted: {np.nonzero(impossible & (obs > 0))}"
    n = obs.sum()
    exp = p / p.sum() * n
    small = exp < min_expected
    o, e = list(obs[~small & ~impossible]), list(exp[~small & ~impossible])
    pool_o, pool_e = obs[small & ~impossible].sum(), exp[small & ~impossible].sum()
    if pool_e > 0:
        if pool_e < min_expected and e:
            i = int(np.argmin(e))
            o[i] += pool_o
            e[i] += pool_e
        else:
            o.append(pool_o)
            e.append(pool_e)
    if len(e) < 2:  # a (near) point mass: nothing to test beyond "impossible cells never observed"
        return 1.0
    return float(chisquare(o, e).pvalue)


def random_dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """A random (V,) distribution (Dirichlet(1) via normalised exponentials), `zeros` random entries set to 0."""
    x = -torch.rand(v, generator=gen, dtype=torch.float64).log()
    if zeros:
        x[torch.randperm(v, generator=gen)[:zeros]] = 0
    return (x / x.sum()).float()


class IdTokenizer:
    """For prompts given as id lists: generate() only needs decode and eos_token_id (None: no stop)."""
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def deep_model() -> LlamaForCausalLM:
    """4 layers, peaked logits and deep layers that matter, so shallow (self-speculative) drafts get rejected."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(6)
            layer.self_attn.o_proj.weight.mul_(6)
    return m


DEEP_PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [5] * 9, [7, 3, 9, 11, 40, 2]]


# ---------------------------------------------------------------- exact output law (sampling tests)

PROMPT8 = [3, 4, 3]

# N = 2000 samples per case (each generate call is ~5-8 ms here: 3000 would cost 20+ s per case on this
# shared 2-core machine). Threshold 1e-3: seeds are fixed (seed=i), so each case is deterministic; a
# lossy rule (e.g. accepting drafts without the ratio test) gives p-values below 1e-10 at this N.
N_E2E = 2000


@torch.no_grad()
def exact_law_3(model, sampler, prompt=PROMPT8) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under `sampler`, by enumeration with the HF model itself: (V, V, V)."""
    v = model.config.vocab_size
    seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])  # (V*V, T+2)
    probs = sampler.probs(model(seqs).logits.double()).double()  # (V*V, T+2, V)
    p1 = probs[0, len(prompt) - 1]  # (V,)
    p2 = probs[::v, len(prompt)]  # (V, V): row a = P(t2 | t1 = a)
    p3 = probs[:, len(prompt) + 1].reshape(v, v, v)  # P(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


def assert_lossless_sampling(model, tok, method: str, temperature: float = 1.0, top_p: float = 1.0,
                             max_new_tokens: int = 4, n: int = N_E2E, **method_kwargs) -> None:
    """The engine's distribution test: n seeded generations of `method` from PROMPT8; the first three
    tokens' empirical law must match the exact law of the target (chi-square, p > 1e-3, jointly and
    for the first token), and both acceptances and rejections must have happened."""
    from dvi_lite import generate
    from dvi_lite.core.sampling import Sampler

    law = exact_law_3(model, Sampler(temperature=temperature, top_p=top_p))
    v = model.config.vocab_size
    counts = torch.zeros(v, v, v)
    accepted = drafted = 0
    for i in range(n):
        out = generate(model, tok, PROMPT8, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, stop_at_eos=False, seed=i, **method_kwargs)
        assert len(out.token_ids) == max_new_tokens
        a, b, c = out.token_ids[:3]
        counts[a, b, c] += 1
        accepted += sum(s.accepted for s in out.stats.steps)
        drafted += sum(s.drafted for s in out.stats.steps)
    assert 0 < accepted < drafted  # acceptances and rejections both happened
    assert chi2_pvalue(counts, law) > 1e-3
    assert chi2_pvalue(counts.sum((1, 2)), law.sum((1, 2))) > 1e-3  # the first token alone (no pooling)
