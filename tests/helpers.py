"""Shared test helpers: tiny random models, stub tokenizers, statistics, and the two checks every method
must pass -- the losslessness of sampling (`assert_lossless_sampling`) and caches that equal a fresh
prefill (`assert_cache_equals_fresh`). Fixtures live in conftest.py; everything importable lives here.

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

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
EOS = 63  # the stub tokenizer's eos: an id the tests control (the models' config eos/bos/pad is 0)
DEEP_PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [5] * 9, [7, 3, 9, 11, 40, 2]]
PROMPT8 = [3, 4, 3]  # the prompt of every exact-law test (vocabulary-8 models)


# ---------------------------------------------------------------- tiny models and tokenizers

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


def make_deep_model() -> LlamaForCausalLM:
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


class StubTokenizer:
    """Just what dvi_lite.generate needs: eos_token_id, decode(ids), __call__(text)."""

    def __init__(self, vocab=VOCAB, eos_token_id=EOS):
        self.vocab = vocab
        self.eos_token_id = eos_token_id

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % self.vocab for c in text]}


class IdTokenizer:
    """For prompts given as id lists: generate() only needs decode and eos_token_id (None: no stop)."""
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids):
        return " ".join(map(str, ids))


# ---------------------------------------------------------------- statistics

def random_dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """A random (V,) distribution (Dirichlet(1) via normalised exponentials), `zeros` random entries set to 0."""
    x = -torch.rand(v, generator=gen, dtype=torch.float64).log()
    if zeros:
        x[torch.randperm(v, generator=gen)[:zeros]] = 0
    return (x / x.sum()).float()


def _pool(obs: np.ndarray, exp: np.ndarray, min_expected: float) -> tuple[list[float], list[float]]:
    """Cells expected below `min_expected` pooled into one (merged into the smallest other cell if the pool
    is still too small): the usual validity condition of the chi-square approximation."""
    small = exp < min_expected
    o, e = list(obs[~small]), list(exp[~small])
    pool_o, pool_e = obs[small].sum(), exp[small].sum()
    if pool_e > 0:
        if pool_e < min_expected and e:
            i = int(np.argmin(e))
            o[i] += pool_o
            e[i] += pool_e
        else:
            o.append(pool_o)
            e.append(pool_e)
    return o, e


def conditional_chi2(counts, probs, min_expected: float = 5.0) -> tuple[float, int, int]:
    """Pearson's test of the conditional law of a token given its context: counts and probs (C, V), row c =
    context c. Given each row's total n_c, row c is multinomial(n_c, probs[c]) under the null, so the rows'
    statistics add up: returns (statistic, degrees of freedom, observations in cells of probability 0).
    Each row pools its small cells (_pool); rows left with one cell add nothing."""
    obs = np.asarray(torch.as_tensor(counts, dtype=torch.float64), dtype=np.float64)
    p = np.asarray(torch.as_tensor(probs, dtype=torch.float64).cpu(), dtype=np.float64)
    assert obs.shape == p.shape and obs.ndim == 2 and (p >= 0).all()
    stat, df, impossible = 0.0, 0, 0
    for o_row, p_row in zip(obs, p, strict=True):
        n = o_row.sum()
        if n == 0:
            continue
        zero = p_row == 0
        impossible += int(o_row[zero].sum())
        o, e = _pool(o_row[~zero], p_row[~zero] / p_row.sum() * n, min_expected)
        if len(e) >= 2:
            stat += float(sum((a - b) ** 2 / b for a, b in zip(o, e, strict=True)))
            df += len(e) - 1
    return stat, df, impossible


def chi2_sf(stat: float, df: int) -> float:
    from scipy.stats import chi2

    return float(chi2.sf(stat, df)) if df > 0 else 1.0  # no testable cell: nothing contradicts the law


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed `counts` to the law `probs` (same shape, any dims).

    Cells with probability exactly 0 must never be observed (asserted); small cells are pooled (_pool).
    """
    stat, df, impossible = conditional_chi2(torch.as_tensor(counts, dtype=torch.float64).reshape(1, -1),
                                            torch.as_tensor(probs, dtype=torch.float64).reshape(1, -1), min_expected)
    assert impossible == 0, f"{impossible} tokens of probability 0 were emitted"
    return chi2_sf(stat, df)


def noncentrality_for_power(df: int, alpha: float, power: float) -> float:
    """The noncentrality lambda at which a chi-square test with `df` degrees of freedom at level `alpha`
    rejects with probability `power` (P(chi2'(df, lambda) > chi2 critical value) = power)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(alpha, df)
    return float(brentq(lambda lam: ncx2.sf(crit, df, lam) - power, 1e-6, 1e6))


# ---------------------------------------------------------------- the power calculation behind the draw count
#
# The check tests the law of t2 given t1 (the first token a verifier decides) with Pearson's statistic,
# V rows x V cells: at most DF = V (V - 1) = 56 degrees of freedom for V = 8 (pooling only lowers them,
# which raises the power). A deviation of the conditional law q_a(b) from p_a(b) has Cohen's effect size
#     w^2 = sum_a p(t1 = a) sum_b (q_a(b) - p_a(b))^2 / p_a(b),
# and with N draws the statistic is noncentral chi-square with lambda = N w^2. So N draws reject every
# deviation of size >= W_DESIGN with probability >= POWER at level ALPHA when N >= lambda*(DF) / W_DESIGN^2.
# W_DESIGN is set below the smallest exact w of the negative controls, chains and trees (0.27 for "resample
# from p"; tests/test_negative_controls.py computes each control's w from the models' exact laws and asserts
# it is >= W_DESIGN), so the draw count is the one that detects those controls with 99 % power.
ALPHA = 1e-3  # every p-value of the check must exceed it (seeds are fixed, so each case is deterministic)
POWER = 0.99
W_DESIGN = 0.25
DF_T2 = 8 * 7


@functools.cache
def lossless_draws(w: float = W_DESIGN, df: int = DF_T2, alpha: float = ALPHA, power: float = POWER) -> int:
    """Draws N for which the t2|t1 test detects an effect of size w with the given power (see above)."""
    return math.ceil(noncentrality_for_power(df, alpha, power) / w ** 2)


# ---------------------------------------------------------------- exact laws and the losslessness check

@torch.no_grad()
def exact_conditionals(model, sampler, prompt=PROMPT8, depth: int = 3) -> list[torch.Tensor]:
    """The target law of tokens 1..depth after `prompt`, by full forwards of every continuation:
    out[j] (V**j, V) = P(t_{j+1} | t_1..t_j) under `sampler`, row = (t_1..t_j) read in base V."""
    v = model.config.vocab_size
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(v), repeat=depth - 1)])  # (V^(d-1), T+d-1)
    probs = sampler.probs(model(seqs).logits.double()).double()  # (V^(d-1), T+d-1, V)
    return [probs[:: v ** (depth - 1 - j), len(prompt) - 1 + j] for j in range(depth)]


def exact_law_3(model, sampler, prompt=PROMPT8) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under `sampler`, by enumeration with the HF model itself: (V, V, V)."""
    v = model.config.vocab_size
    p1, p2, p3 = exact_conditionals(model, sampler, prompt, 3)
    return p1[0][:, None, None] * p2.reshape(v, v)[:, :, None] * p3.reshape(v, v, v)


TESTS = ("t1", "t2|t1", "t3|t1,t2", "t4|t1..t3")


@dataclass
class LosslessReport:
    """What the check measured: p-values per test, tokens of probability 0, how far the drafts got."""
    what: str
    n: int
    pvalues: dict[str, float] = field(default_factory=dict)
    impossible: dict[str, int] = field(default_factory=dict)
    accepting_steps: int = 0  # steps that accepted >= 1 draft token
    rejecting_steps: int = 0  # steps that drafted and accepted nothing: a tested draft was rejected
    max_accepted: int = 0  # the longest accepted run in one step
    max_depth: int = 0  # the deepest proposal verified
    problems: list[str] = field(default_factory=list)

    @property
    def law_failed(self) -> bool:
        return any(p <= ALPHA for p in self.pvalues.values())

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        ps = ", ".join(f"p({k})={v:.3g}" for k, v in self.pvalues.items())
        fails = "".join(f"\n  FAIL: {p}" for p in self.problems)
        return (f"{self.what}, {self.n} draws (seeds 0..{self.n - 1}): {ps}; probability-0 tokens {self.impossible}; "
                f"steps accepting {self.accepting_steps}, rejecting {self.rejecting_steps}, longest accepted run "
                f"{self.max_accepted}, deepest proposal {self.max_depth}{fails}")


def lossless_report(model, tok, method: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    max_new_tokens: int = 4, n: int | None = None, min_run: int = 0, min_depth: int = 0,
                    drafts: bool = True, prompt: list[int] = PROMPT8, **method_kwargs) -> LosslessReport:
    """n seeded generate() calls of `method` from `prompt` (seed = draw index), tested against the target's law.

    The first token comes from the prefill, which no verifier touches; the first *verified* token is the
    second. So each token t_j (j <= min(max_new_tokens, 4)) is tested given the tokens before it
    (conditional_chi2 against exact_conditionals), and t1 and the joint law of (t1, t2, t3) as before.
    drafts: require steps that accepted and steps that rejected; min_run: a step accepted >= min_run drafts;
    min_depth: a proposal min_depth deep was verified.
    """
    from dvi_lite import generate
    from dvi_lite.core.sampling import Sampler

    n = lossless_draws() if n is None else n
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    depth = min(max_new_tokens, len(TESTS))
    cond = exact_conditionals(model, sampler, prompt, depth)
    v = model.config.vocab_size
    counts = [torch.zeros(v ** j, v, dtype=torch.float64) for j in range(depth)]
    opts = ", ".join(f"{k}={x if isinstance(x, (int, float, str, list, type(None))) else type(x).__name__}"
                     for k, x in method_kwargs.items())
    rep = LosslessReport(f"{method}({opts}) T={temperature} top_k={top_k} top_p={top_p} new={max_new_tokens}", n)
    for i in range(n):
        out = generate(model, tok, prompt, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_at_eos=False, seed=i, **method_kwargs)
        if len(out.token_ids) != max_new_tokens:
            rep.problems.append(f"seed {i}: {len(out.token_ids)} tokens, not {max_new_tokens}")
            return rep
        for j in range(depth):
            row = sum(t * v ** (j - 1 - m) for m, t in enumerate(out.token_ids[:j]))
            counts[j][row, out.token_ids[j]] += 1
        for s in out.stats.steps:
            rep.accepting_steps += s.accepted > 0
            rep.rejecting_steps += s.drafted > 0 and s.accepted == 0
            rep.max_accepted = max(rep.max_accepted, s.accepted)
            rep.max_depth = max(rep.max_depth, s.depth)
    tests = [(TESTS[j], counts[j], cond[j]) for j in range(depth)]  # (rows, V) each
    if depth >= 3:  # the old joint test, kept: rows of the t3 table are (t1, t2), so it reshapes to (t1, t2, t3)
        joint = cond[0][0][:, None, None] * cond[1].reshape(v, v)[:, :, None] * cond[2].reshape(v, v, v)
        tests.append(("joint t1,t2,t3", counts[2].reshape(1, -1), joint.reshape(1, -1)))
    for name, c, p in tests:
        stat, df, bad = conditional_chi2(c, p)
        rep.pvalues[name] = 0.0 if bad else chi2_sf(stat, df)
        rep.impossible[name] = bad
    if rep.law_failed:
        rep.problems.append(f"the output law differs from the target's (a p-value <= {ALPHA})")
    if drafts and not (rep.accepting_steps and rep.rejecting_steps):
        rep.problems.append("drafts were not both accepted and rejected")
    if rep.max_accepted < min_run:
        rep.problems.append(f"no step accepted {min_run} drafts in a row (longest {rep.max_accepted})")
    if rep.max_depth < min_depth:
        rep.problems.append(f"no proposal {min_depth} deep was verified (deepest {rep.max_depth})")
    return rep


def assert_lossless_sampling(model, tok, method: str, **kw) -> LosslessReport:
    """The engine's distribution test (lossless_report) as an assertion; the report in the message."""
    rep = lossless_report(model, tok, method, **kw)
    assert rep.ok, str(rep)
    return rep


# ---------------------------------------------------------------- caches against a fresh prefill

@torch.no_grad()
def assert_cache_equals_fresh(model, cache, tokens: list[int], atol: float = 1e-5, where: str = "") -> None:
    """Every layer of `cache` holds, for positions [0, len(tokens)), the keys and values a fresh prefill
    of `tokens` computes (fp32 tolerance); a layer may hold more (draft positions), never fewer."""
    from dvi_lite.core.runner import Runner

    r = Runner(model)
    fresh = r.new_cache(len(tokens) + 1)
    r.forward(torch.tensor([tokens], device=r.device), fresh)
    n = len(tokens)
    for i in range(r.n_layers):
        k, v = cache.layer(i)
        fk, fv = fresh.layer(i)
        assert k.shape[2] >= n, f"{where}: layer {i} holds {k.shape[2]} positions, {n} committed"
        for name, live, ref in (("K", k, fk), ("V", v, fv)):
            torch.testing.assert_close(live[:, :, :n], ref, atol=atol, rtol=1e-5,
                                       msg=lambda m, name=name, i=i: f"{where} {name} layer {i}: {m}")


def perturbed_heads(model, num_heads: int = 3, seed: int = 0, scale: float = 0.3):
    """Medusa heads between the model's next-token head (their identity start) and noise: each drafts
    something between the model's next token and a random guess, so trees get partly accepted."""
    from dvi_lite.methods.medusa.heads import MedusaHeads

    heads = MedusaHeads(model, num_heads).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.linear.weight.copy_(scale * torch.randn(blk.linear.weight.shape, generator=g))
    return heads


# ---------------------------------------------------------------- SmolLM2 greedy reference (fp32)

SMOLLM2_QUESTIONS = 16  # Spec-Bench dev questions in the real-model lossless tests (the issue asks >= 16)
SMOLLM2_NEW = 32  # greedy tokens per question


def smollm2_reference() -> list[tuple[list[dict], list[int]]]:
    """[(chat prompt, AR greedy tokens)] for SMOLLM2_QUESTIONS Spec-Bench dev questions, SmolLM2 in fp32.

    Computed once per machine and shared by the test files (an xdist worker each) through a locked cache
    file under build/, keyed by the model's fingerprint and torch's version: a recomputed reference is
    what a rerun would produce, a stale one is never read.
    """
    import fcntl
    import json

    from test_smollm2 import smollm2

    import dvi_lite
    from dvi_lite.core.generate import prompt_ids
    from dvi_lite.models.artifacts import fingerprint
    from dvi_lite.paths import BUILD_DIR
    from dvi_lite.study.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread

    model, tok = smollm2("float32")
    # the bench's questions, the shortest of each task group first (round robin over the groups): a 700-token
    # RAG prompt's fp32 prefill costs more than the 32 tokens the test is about, on CI's 2 cores
    by_group: dict[str, list] = {}
    for q in spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS):
        by_group.setdefault(q["group"], []).append((len(prompt_ids(tok, q["prompt"])), q["prompt"]))
    ranked = [[p for _, p in sorted(v, key=lambda x: x[0])] for v in by_group.values()]
    prompts = [r[i] for i in range(max(map(len, ranked))) for r in ranked if i < len(r)][:SMOLLM2_QUESTIONS]
    key = f"{fingerprint(model)}-{torch.__version__}-{SMOLLM2_QUESTIONS}x{SMOLLM2_NEW}-shortest"
    path = BUILD_DIR / "test_cache" / f"smollm2_ar_{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            ref = [dvi_lite.generate(model, tok, p, method="ar", max_new_tokens=SMOLLM2_NEW).token_ids
                   for p in prompts]
            path.write_text(json.dumps(ref))
        ref = json.loads(path.read_text())
    return list(zip(prompts, ref, strict=True))


def assert_smollm2_greedy_equals_ar(method: str, **options) -> None:
    """`method` on SmolLM2 in fp32 gives AR's tokens on every reference question, and some draft is accepted
    (else a drafter that proposes nothing would pass)."""
    from test_smollm2 import smollm2

    import dvi_lite

    model, tok = smollm2("float32")
    accepted = steps = 0
    for i, (prompt, ref) in enumerate(smollm2_reference()):
        out = dvi_lite.generate(model, tok, prompt, method=method, max_new_tokens=len(ref), **options)
        assert out.token_ids == ref, f"{method}: question {i} differs from AR"
        accepted += sum(s.accepted for s in out.stats.steps)
        steps += len(out.stats.steps)
    assert accepted > 0, f"{method}: no draft was ever accepted in {steps} steps"
