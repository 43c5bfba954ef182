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


def _pool_cells(exp: np.ndarray, min_expected: float) -> list[np.ndarray]:
    """The cells of one row, as index arrays, from its expected counts alone: each entry expected >=
    `min_expected` is a cell, the smaller ones are pooled into one (merged into the smallest other cell if
    the pool is still too small), the usual validity condition of the chi-square approximation. Entries of
    probability 0 belong to no cell (a token there contradicts the law outright)."""
    idx = np.flatnonzero(exp > 0)
    cells = [np.array([i]) for i in idx if exp[i] >= min_expected]
    small = idx[exp[idx] < min_expected]
    if small.size:
        if exp[small].sum() >= min_expected or not cells:
            cells.append(small)
        else:
            k = int(np.argmin([exp[c].sum() for c in cells]))
            cells[k] = np.concatenate([cells[k], small])
    return cells


class NoTestableCell(AssertionError):
    """A chi-square test whose cells all pooled into one: it can contradict nothing, so it must not pass."""


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2(df) > stat). df = 0 (no testable cell) raises NoTestableCell: a test that cannot reject the
    null is a failed test, not a passed one (it used to return p = 1, so such tests could hardly fail)."""
    from scipy.stats import chi2

    if df <= 0:
        raise NoTestableCell("no testable cell: every cell was pooled into one (too few draws or a point-mass "
                             "law), so the test cannot contradict the law; use more draws or coarser cells")
    return float(chi2.sf(stat, df))


def chi2_power(df: int, n: int, w: float | None = None, alpha: float | None = None) -> float:
    """Power of Pearson's test with `df` degrees of freedom at level `alpha` against every deviation of
    Cohen's effect size w (measured on the tested cells), with n draws in the tested rows: under such a
    deviation the statistic is noncentral chi-square with lambda = n w^2. 0.0 when df = 0."""
    from scipy.stats import chi2, ncx2

    w = W_DESIGN if w is None else w
    alpha = ALPHA if alpha is None else alpha
    return float(ncx2.sf(chi2.isf(alpha, df), df, n * w * w)) if df > 0 else 0.0


@dataclass(frozen=True)
class LawTest:
    """One Pearson test of a (conditional) law: its statistic, the degrees of freedom and draws left after
    pooling (rows whose cells pooled into one are not tested: their draws are lost to the test), and the
    tokens of probability 0 that were emitted (any one of them contradicts the law outright)."""
    name: str
    stat: float
    df: int
    n: int
    impossible: int
    decided: bool = field(default=False, repr=False, compare=False)  # its p-value was read (counted once)

    @property
    def testable(self) -> bool:
        return self.df > 0

    @property
    def pvalue(self) -> float:
        """0 when a token of probability 0 was emitted; NoTestableCell when nothing could be tested. Reading it
        makes the test a decision, counted once against LAW_TEST_BUDGET (design-only tests read the power)."""
        if not self.decided:
            object.__setattr__(self, "decided", True)  # frozen: the flag is bookkeeping, not data
            LAW_TESTS_RUN[0] += 1
        return 0.0 if self.impossible else chi2_sf(self.stat, self.df)

    @property
    def power(self) -> float:
        """Achieved power at W_DESIGN and ALPHA, for the cells and draws this test actually used."""
        return chi2_power(self.df, self.n)


def law_test(counts, joint, n_design: float | None = None, name: str = "", min_expected: float = 5.0) -> LawTest:
    """Pearson's test of the law of a token given its context: counts (R, V) of (context, token) and their
    exact joint law joint (R, V) = P(context, token) (one row: a plain goodness of fit).

    The cells are fixed before looking at the draws, from the expected counts n_design * joint (n_design:
    the planned draws, default the observed total): each row pools its small cells (_pool_cells); rows left
    with one cell (a nearly deterministic next token, or a rare context) are merged into one group of rows,
    whose law is their mixture P(token | context in the group), and pooled again. Given each group's total
    n_g, its counts are multinomial(n_g, P(cell | group)) under the null (the draws are i.i.d.), so the
    groups' statistics and degrees of freedom add up; under a deviation of effect size w the statistic is
    noncentral with lambda = n w^2, n = the draws in tested groups. Merging rows tests less than each row
    alone, but it keeps draws that a row-by-row test would throw away (the coarser cells of the power
    calculation above)."""
    obs = np.asarray(torch.as_tensor(counts, dtype=torch.float64), dtype=np.float64)
    p = np.asarray(torch.as_tensor(joint, dtype=torch.float64).cpu(), dtype=np.float64)
    assert obs.shape == p.shape and obs.ndim == 2 and (p >= 0).all() and p.sum() > 0
    p = p / p.sum()
    impossible = int(obs[p == 0].sum())
    exp = (obs.sum() if n_design is None else n_design) * p
    groups, rest = [], []
    for a in range(p.shape[0]):
        cells = _pool_cells(exp[a], min_expected)
        if len(cells) >= 2:
            groups.append(([a], cells))
        elif exp[a].sum() > 0:
            rest.append(a)
    if rest:
        cells = _pool_cells(exp[rest].sum(0), min_expected)
        if len(cells) >= 2:
            groups.append((rest, cells))
    stat, df, n_tested = 0.0, 0, 0
    for rows, cells in groups:
        o = np.array([obs[rows][:, c].sum() for c in cells])
        pi = np.array([p[rows][:, c].sum() for c in cells])
        n = o.sum()
        if n == 0:
            continue
        e = n * pi / pi.sum()
        stat += float(((o - e) ** 2 / e).sum())
        df += len(cells) - 1
        n_tested += int(n)
    return LawTest(name, stat, df, n_tested, impossible)


def binom_pvalue(successes: int, trials: int, p: float) -> float:
    """The two-sided binomial test's p-value (scipy), counted against LAW_TEST_BUDGET like law_test."""
    from scipy.stats import binomtest

    LAW_TESTS_RUN[0] += 1
    return float(binomtest(successes, trials, p).pvalue)


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed `counts` to the law `probs` (same shape, any dims).

    Cells with probability exactly 0 must never be observed (asserted); small cells are pooled (_pool);
    a test left with no testable cell fails (NoTestableCell).
    """
    t = law_test(torch.as_tensor(counts, dtype=torch.float64).reshape(1, -1),
                 torch.as_tensor(probs, dtype=torch.float64).reshape(1, -1), min_expected=min_expected)
    assert t.impossible == 0, f"{t.impossible} tokens of probability 0 were emitted"
    return t.pvalue


def noncentrality_for_power(df: int, alpha: float, power: float) -> float:
    """The noncentrality lambda at which a chi-square test with `df` degrees of freedom at level `alpha`
    rejects with probability `power` (P(chi2'(df, lambda) > chi2 critical value) = power)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(alpha, df)
    return float(brentq(lambda lam: ncx2.sf(crit, df, lam) - power, 1e-6, 1e6))


# ---------------------------------------------------------------- false alarms, power and the draw count
#
# Level. Every law test of the suite is a fixed-seed chi-square test that must pass on a correct method.
# Over a full run the chance that some correct method fails one (a false alarm) is at most the number of
# such tests times the per-test level (Bonferroni). LAW_TEST_BUDGET bounds that number, and the run counts it
# itself (below): about 300 law tests in a full run when this was written: 197 before the depth tests
# (lossless_report makes up to TESTED_TOKENS = 5 per call; test_verify.py's chi-square and binomial tests, the
# SmolLM2 t2 test and the negative controls' tests count too), 36 depth tests (lossless_report(depths=True),
# 4 per case of tests/test_lossless.py), 15 of the drafter controls (tests/test_drafter_controls.py) and 54
# chi-square tests of the course and the exercise checks (the course's chi_square, counted per call by
# conftest.py, which also makes ALPHA the level the exercise checks' correct samplers must beat). A change that
# passes the budget fails the run: raise LAW_TEST_BUDGET then (ALPHA shrinks and planned_draws grows with
# log(1/ALPHA)).
# So ALPHA = 1 % / 400 = 2.5e-5 keeps the suite-wide false-alarm rate <= SUITE_FALSE_ALARM = 1 % per full run.
#
# Cells. Verification touches t2 (depth 1), t3 (depth 2), t4 (depth 3) and the bonus token after an
# all-accepted chain (t5 in tests/test_lossless.py). Conditioning t_j on the whole prefix t1..t_{j-1}
# (V^(j-1) rows) leaves t3 with 64 rows and t4 with 512 rows of 8 cells: with ~1,300 draws most rows pool
# into one cell, so those tests had about 33 % power at w = 0.25 and t4's often had no testable cell at
# all. Each token t_j (j >= 2) is therefore tested given the token before it, t_{j-1}: V rows x V cells,
# at most DF_DESIGN = V (V - 1) = 56 degrees of freedom at every depth. The law of t_j given t_{j-1} is
# exact too (a marginal of the enumerated joint law), and under the null the pairs (t_{j-1}, t_j) of
# independent draws are i.i.d., so the test is valid at every depth.
#
# Power. A deviation of the conditional law q_a(b) from p_a(b) has Cohen's effect size
#     w^2 = sum_a P(t_{j-1} = a) sum_b (q_a(b) - p_a(b))^2 / p_a(b),
# and with N draws the statistic is noncentral chi-square with lambda = N w^2; its power at level ALPHA
# falls as the degrees of freedom grow. Pooling is not free: it lowers the degrees of freedom (which alone
# would raise the power) but it also hides every deviation inside a pooled cell and drops the draws of rows
# left with one cell (which lowers it), so the power must be computed on the cells actually tested.
# law_test fixes its cells from the exact law and the planned N before any draw (rows left with one cell
# are merged into one group rather than dropped), and planned_draws picks the fewest N (a multiple of 25)
# at which every test of the case has design power >= POWER at W_DESIGN: 850-1,225 draws for the cases of
# tests/test_lossless.py, where the worst case (all 56 degrees of freedom, lossless_draws()) needs 1,641;
# planned_depth_draws adds the depth tests, given the share of draws reaching each depth (1,250-6,175 draws).
# Each test also reports its achieved power, chi2_power(df after pooling, draws in tested groups), and
# lossless_report fails a test whose achieved power is below POWER_MIN or that has no testable cell.
# W_DESIGN is below the smallest exact w of the negative controls (tests/test_negative_controls.py computes
# each control's w from the models' exact laws and asserts it is >= W_DESIGN).
# The budget is enforced: every p-value read from a LawTest and every binom_pvalue counts as one test
# (LAW_TESTS_RUN; negative controls included, so the count bounds the tests that must pass from above), and
# conftest.py fails the run when the count over all xdist workers passes LAW_TEST_BUDGET.
LAW_TESTS_RUN = [0]  # fixed-seed law tests made in this process so far
SUITE_FALSE_ALARM = 0.01  # the most a full run may fail a correct method by chance
LAW_TEST_BUDGET = 400  # an upper bound on the fixed-seed law tests one full run makes (counted above)
ALPHA = SUITE_FALSE_ALARM / LAW_TEST_BUDGET  # 2.5e-5 per test (Bonferroni): a p-value must exceed it
W_DESIGN = 0.25  # the effect size (Cohen's w) every tested depth must detect
POWER = 0.99  # the design power of every test at W_DESIGN (planned_draws)
POWER_MIN = 0.95  # the achieved power every test of lossless_report must reach (else the report fails)
DF_DESIGN = 8 * 7  # V rows x (V - 1) for the vocabulary-8 models: t_j given t_{j-1}, before any pooling
TESTED_TOKENS = 5  # t1 (prefill), t2, t3, t4 (depths 1-3) and t5 (the bonus of a 3-token chain)
DRAW_STEP = 25  # planned_draws' granularity


@functools.cache
def lossless_draws(w: float = W_DESIGN, df: int = DF_DESIGN, alpha: float = ALPHA, power: float = POWER) -> int:
    """Draws N for which a t_j | t_{j-1} test with all DF_DESIGN degrees of freedom and no draw lost detects
    an effect of size w with the given power: the worst case, and planned_draws' cap (1,641 draws)."""
    return math.ceil(noncentrality_for_power(df, alpha, power) / w ** 2)


def planned_draws(laws: list[torch.Tensor], w: float = W_DESIGN, alpha: float = ALPHA, power: float = POWER) -> int:
    """The fewest draws (a multiple of DRAW_STEP, at most lossless_draws()) at which every law test of `laws`
    (pair_laws: the joint laws of (context, token)) has design power >= `power` at effect size w.

    The design power of a test is chi2_power(df, n) for the cells law_test fixes from the expected counts
    N * law and the draws n expected in its tested groups: the same cells the test will use, chosen before
    any draw. Nearly deterministic rows pool into few cells, so most cases need far fewer draws than the
    worst case (56 degrees of freedom) would."""
    cap = lossless_draws(w, DF_DESIGN, alpha, power)
    start = max(DRAW_STEP, math.floor(noncentrality_for_power(1, alpha, power) / w ** 2 / DRAW_STEP) * DRAW_STEP)
    for n in range(start, cap, DRAW_STEP):
        tests = [law_test(n * law, law, n) for law in laws]
        if all(chi2_power(t.df, t.n, w, alpha) >= power for t in tests):
            return n
    return cap


def depth_design(laws: list[torch.Tensor], reach: dict[str, float], n: int, w: float = W_DESIGN,
                 alpha: float = ALPHA) -> dict[str, tuple[int, float, float]]:
    """Design of the depth tests (lossless_report(depths=True)) at n draws: name -> (df, expected draws that
    reach it, power at w and alpha). Depth j decides t_{j+1}, so its test is given the cells law_test fixes for
    n * reach[name] draws of laws[j] (pair_laws: t_{j+1} given t_j), the bonus after a full 3-chain those of
    t5 | t4 (laws[4]). The draws that reach a depth are what powers its test: a mistake confined to one depth
    shows in its output position's test only in the share `reach` of the draws, as an effect about reach * w."""
    out = {}
    for name, r in reach.items():
        law = laws[4 if name == "bonus" else int(name.removeprefix("depth"))]
        m = n * r
        t = law_test(m * law, law, m)
        out[name] = (t.df, m, chi2_power(t.df, t.n, w, alpha))
    return out


def planned_depth_draws(laws: list[torch.Tensor], reach: dict[str, float], w: float = W_DESIGN,
                        alpha: float = ALPHA, power: float = POWER) -> int:
    """The fewest draws (a multiple of DRAW_STEP, at least planned_draws(laws)) at which every depth test has
    design power >= `power` at w, given the share of draws `reach` that reaches each depth (depth_design)."""
    n = planned_draws(laws, w, alpha, power)
    while min(p for _, _, p in depth_design(laws, reach, n, w, alpha).values()) < power:
        n += DRAW_STEP
    return n


# ---------------------------------------------------------------- exact laws and the losslessness check

@torch.no_grad()
def _logits(model, seqs: torch.Tensor) -> torch.Tensor:
    """The logits of the target being served: the HF model's own, or its lean / int8 runtime's
    (core.lean.use_runtime), whose law is the one a lossless method must reproduce."""
    from dvi_lite.core.lean import runtime_of
    from dvi_lite.core.runner import Runner

    if runtime_of(model) == "hf":
        return model(seqs).logits
    return Runner.for_model(model).forward(seqs, None)[0]


def exact_conditionals(model, sampler, prompt=PROMPT8, depth: int = 3) -> list[torch.Tensor]:
    """The target law of tokens 1..depth after `prompt`, by full forwards of every continuation:
    out[j] (V**j, V) = P(t_{j+1} | t_1..t_j) under `sampler`, row = (t_1..t_j) read in base V."""
    v = model.config.vocab_size
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(v), repeat=depth - 1)])  # (V^(d-1), T+d-1)
    probs = sampler.probs(_logits(model, seqs).double()).double()  # (V^(d-1), T+d-1, V)
    return [probs[:: v ** (depth - 1 - j), len(prompt) - 1 + j] for j in range(depth)]


def exact_joint(model, sampler, prompt=PROMPT8, depth: int = 3) -> torch.Tensor:
    """P(t1..t_depth | prompt) under `sampler`, by enumeration with the HF model itself: (V,) * depth."""
    v = model.config.vocab_size
    cond = exact_conditionals(model, sampler, prompt, depth)
    joint = cond[0][0]  # (V,)
    for j in range(1, depth):
        joint = (joint.reshape(-1, 1) * cond[j]).reshape(-1)  # row-major: (t1..t_j) then t_{j+1}
    return joint.reshape((v,) * depth)


def exact_law_3(model, sampler, prompt=PROMPT8) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under `sampler`, by enumeration with the HF model itself: (V, V, V)."""
    return exact_joint(model, sampler, prompt, 3)


def pair_laws(joint: torch.Tensor) -> list[torch.Tensor]:
    """The laws lossless_report tests, from the joint law (V,) * d: [P(t1) as (1, V)] + [P(t_{j-1}, t_j) as
    (V, V), row = t_{j-1}] for j = 2..d: each token given the one before it (law_test conditions on rows)."""
    d = joint.ndim
    def keep(*dims: int) -> torch.Tensor:  # the marginal on `dims` (torch's sum(()) would sum everything)
        rest = tuple(m for m in range(d) if m not in dims)
        return joint.sum(rest) if rest else joint

    return [keep(0).reshape(1, -1)] + [keep(j - 1, j) for j in range(1, d)]  # (1, V), then (V, V) each


def law_test_names(depth: int) -> list[str]:
    """["t1", "t2|t1", "t3|t2", ...]: the tests of lossless_report for `depth` tested tokens."""
    return ["t1"] + [f"t{j + 1}|t{j}" for j in range(1, depth)]


@dataclass
class LosslessReport:
    """What the check measured: p-value and achieved power per test, tokens of probability 0, how far the
    drafts got."""
    what: str
    n: int
    pvalues: dict[str, float] = field(default_factory=dict)
    power: dict[str, float] = field(default_factory=dict)  # achieved power at W_DESIGN, ALPHA
    impossible: dict[str, int] = field(default_factory=dict)
    accepting_steps: int = 0  # steps that accepted >= 1 draft token
    rejecting_steps: int = 0  # steps that drafted and accepted nothing: a tested draft was rejected
    max_accepted: int = 0  # the longest accepted run in one step
    max_depth: int = 0  # the deepest proposal verified
    reach: dict[str, float] = field(default_factory=dict)  # depth tests: the share of draws reaching each depth
    problems: list[str] = field(default_factory=list)

    @property
    def law_failed(self) -> bool:
        return any(p <= ALPHA for p in self.pvalues.values())

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        ps = ", ".join(f"p({k})={v:.3g} (power {self.power.get(k, 0):.3f})" for k, v in self.pvalues.items())
        fails = "".join(f"\n  FAIL: {p}" for p in self.problems)
        if self.reach:
            ps += "; reach of step 1 " + ", ".join(f"{k} {v:.3f}" for k, v in self.reach.items())
        return (f"{self.what}, {self.n} draws (seeds 0..{self.n - 1}), alpha {ALPHA:g}, power at w={W_DESIGN}: "
                f"{ps}; probability-0 tokens {self.impossible}; steps accepting {self.accepting_steps}, "
                f"rejecting {self.rejecting_steps}, longest accepted run {self.max_accepted}, deepest proposal "
                f"{self.max_depth}{fails}")


def lossless_report(model, tok, method: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    max_new_tokens: int = 4, n: int | None = None, min_run: int = 0, min_depth: int = 0,
                    drafts: bool = True, prompt: list[int] = PROMPT8, min_power: float = POWER_MIN,
                    depths: bool = False, **method_kwargs) -> LosslessReport:
    """n seeded generate() calls of `method` from `prompt` (seed = draw index), tested against the target's law.

    The first token comes from the prefill, which no verifier touches; the first *verified* token is the
    second. t1 is tested on its own and each later token t_j (j <= min(max_new_tokens, TESTED_TOKENS)) given
    the token before it (law_test against pair_laws of the exact joint law): every depth a verifier
    decides, the bonus token included, with the cells and power of the calculation above. A test fails the
    report when its p-value is <= ALPHA, when it has no testable cell, or when its achieved power at W_DESIGN
    is below min_power. drafts: require steps that accepted and steps that rejected; min_run: a step accepted
    >= min_run drafts; min_depth: a proposal min_depth deep was verified.

    depths: also test each verifier depth on its own (depth_tests: DEPTH_TESTS, from step 1's decisions), each
    with the same level and power requirement: a mistake confined to one depth is then tested on the draws
    that reach it, not diluted among the draws of its output position that other depths decided.
    """
    from dvi_lite import generate
    from dvi_lite.core.sampling import Sampler

    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    depth = min(max_new_tokens, TESTED_TOKENS)
    laws = pair_laws(exact_joint(model, sampler, prompt, depth))
    n = planned_draws(laws) if n is None else n
    v = model.config.vocab_size
    counts = [torch.zeros(law.shape, dtype=torch.float64) for law in laws]
    decided: dict[str, dict[tuple[int, ...], torch.Tensor]] = {name: {} for name in DEPTH_TESTS}
    opts = ", ".join(f"{k}={x if isinstance(x, (int, float, str, list, type(None))) else type(x).__name__}"
                     for k, x in method_kwargs.items())
    rep = LosslessReport(f"{method}({opts}) T={temperature} top_k={top_k} top_p={top_p} new={max_new_tokens}", n)
    for i in range(n):
        out = generate(model, tok, prompt, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_at_eos=False, seed=i, **method_kwargs)
        if len(out.token_ids) != max_new_tokens:
            rep.problems.append(f"seed {i}: {len(out.token_ids)} tokens, not {max_new_tokens}")
            return rep
        t = out.token_ids
        assert all(0 <= x < v for x in t[:depth]), t
        counts[0][0, t[0]] += 1
        for j in range(1, depth):
            counts[j][t[j - 1], t[j]] += 1
        if depths:
            step_one_decisions(out.stats.steps, t, decided, v)
        for s in out.stats.steps:
            rep.accepting_steps += s.accepted > 0
            rep.rejecting_steps += s.drafted > 0 and s.accepted == 0
            rep.max_accepted = max(rep.max_accepted, s.accepted)
            rep.max_depth = max(rep.max_depth, s.depth)
    for name, c, law in zip(law_test_names(depth), counts, laws, strict=True):
        test = law_test(c, law, n, name)
        rep.impossible[name] = test.impossible
        rep.power[name] = test.power
        if not test.testable and not test.impossible:
            rep.problems.append(f"{name}: no testable cell (every row pooled into one cell), so the test could "
                                "not contradict the law: more draws or coarser cells")
            continue
        rep.pvalues[name] = test.pvalue
        if test.power < min_power:
            rep.problems.append(f"{name}: achieved power {test.power:.3f} < {min_power} at w={W_DESIGN}, "
                                f"alpha={ALPHA:g} (df {test.df}, {test.n} draws in tested rows)")
    if depths:
        conds = exact_conditionals(model, sampler, prompt, depth)
        for name, by_prefix in decided.items():
            reached = sum(float(c.sum()) for c in by_prefix.values())
            rep.reach[name] = reached / n
            test = depth_test(name, by_prefix, conds)
            rep.impossible[name] = test.impossible
            rep.power[name] = test.power
            if not test.testable and not test.impossible:
                rep.problems.append(f"{name}: no testable cell in the {reached:.0f} draws that reached it")
                continue
            rep.pvalues[name] = test.pvalue
            if test.power < min_power:
                rep.problems.append(f"{name}: achieved power {test.power:.3f} < {min_power} at w={W_DESIGN}, "
                                    f"alpha={ALPHA:g} ({test.n} of {n} draws reached it, df {test.df})")
    if rep.law_failed:
        rep.problems.append(f"the output law differs from the target's (a p-value <= {ALPHA:g})")
    if drafts and not (rep.accepting_steps and rep.rejecting_steps):
        rep.problems.append("drafts were not both accepted and rejected")
    if rep.max_accepted < min_run:
        rep.problems.append(f"no step accepted {min_run} drafts in a row (longest {rep.max_accepted})")
    if rep.max_depth < min_depth:
        rep.problems.append(f"no proposal {min_depth} deep was verified (deepest {rep.max_depth})")
    return rep


DEPTH_TESTS = ("depth1", "depth2", "depth3", "bonus")  # step 1's decisions, K = 3: depth j decides t_{j+1}


def step_one_decisions(steps, t: list[int], decided: dict, v: int) -> None:
    """Add one draw's step-1 decisions to `decided` (test name -> {prefix: (V,) counts}): with a accepted drafts,
    depth j = 1..a decided t_{j+1} (an accepted draft) after the prefix t_1..t_j, then depth a + 1 decided
    t_{a+2} (a correction), or, when the whole branch was accepted, the bonus token did. Given its prefix and that
    it was reached, each decision of a lossless verifier follows the target's p(. | prefix) (whatever the drafter
    proposed), so every depth is tested on the draws that reached it."""
    if not steps or steps[0].drafted == 0:
        return
    s = steps[0]
    names = [f"depth{j}" for j in range(1, s.accepted + 1)] + ["bonus" if s.bonus else f"depth{s.accepted + 1}"]
    for j, name in enumerate(names, start=1):
        if name in decided and j < len(t):
            row = decided[name].setdefault(tuple(t[:j]), torch.zeros(v, dtype=torch.float64))
            row[t[j]] += 1


def depth_test(name: str, by_prefix: dict[tuple[int, ...], torch.Tensor], conds: list[torch.Tensor]) -> LawTest:
    """law_test of the tokens one depth decided, given the token before each (V rows), against the target's law
    given the whole prefix: row a's expected counts are sum over the prefixes ending in a of n_prefix p(. | prefix)
    (conds = exact_conditionals). Given the prefixes' counts, the tokens are independent draws of those laws,
    so a row of one prefix is an exact multinomial test and a row mixing prefixes (or law_test's group of rows)
    is conservative: the sum of multinomials of different laws varies less than one of their mixture."""
    v = conds[0].shape[-1]
    obs = torch.zeros(v, v, dtype=torch.float64)
    exp = torch.zeros(v, v, dtype=torch.float64)
    for prefix, c in by_prefix.items():
        idx = sum(x * v ** (len(prefix) - 1 - i) for i, x in enumerate(prefix))
        obs[prefix[-1]] += c
        exp[prefix[-1]] += c.sum() * conds[len(prefix)][idx].double()
    if not by_prefix:
        return LawTest(name, 0.0, 0, 0, 0)
    return law_test(obs, exp, None, name)


def assert_lossless_sampling(model, tok, method: str, **kw) -> LosslessReport:
    """The engine's distribution test (lossless_report) as an assertion; the report in the message."""
    rep = lossless_report(model, tok, method, **kw)
    assert rep.ok, str(rep)
    return rep


# ---------------------------------------------------------------- caches against a fresh prefill

@torch.no_grad()
def assert_cache_equals_fresh(model, cache, tokens: list[int], atol: float = 1e-5, where: str = "",
                              length: int | None = None, strict: bool = True) -> None:
    """`cache` holds, in every layer, the keys and values a fresh prefill of `tokens` computes (fp32 tolerance).

    strict (where the engine or drafter promises a crop): every layer holds exactly `length` positions
    (default len(tokens)), no layer keeps a stale draft position, and all len(tokens) are compared.
    Not strict: a layer may hold more positions than len(tokens) (draft positions a drafter wrote and has
    not rolled back yet), never fewer; the first len(tokens) are compared."""
    from dvi_lite.core.runner import Runner

    r = Runner(model)
    fresh = r.new_cache(len(tokens) + 1)
    r.forward(torch.tensor([tokens], device=r.device), fresh)
    n = len(tokens)
    length = n if length is None else length
    assert length >= n, f"{where}: length {length} < {n} tokens"
    lens = [cache.layer(i)[0].shape[2] for i in range(r.n_layers)]
    if strict:
        assert lens == [length] * r.n_layers, f"{where}: layer lengths {lens}, expected {length} in every layer"
    for i in range(r.n_layers):
        k, v = cache.layer(i)
        fk, fv = fresh.layer(i)
        assert k.shape[2] >= n, f"{where}: layer {i} holds {k.shape[2]} positions, {n} committed"
        for name, live, ref in (("K", k, fk), ("V", v, fv)):
            torch.testing.assert_close(live[:, :, :n], ref, atol=atol, rtol=1e-5,
                                       msg=lambda m, name=name, i=i: f"{where} {name} layer {i}: {m}")


def dvi_on_target8(target8, k: int):
    """A copy of the vocabulary-8 target with a DVI policy trained for 4 fast steps on it (the trainer leaves
    the model as is): (model, policy), for the law tests that drive DVI."""
    import copy

    from dvi_lite.methods.dvi.config import DVIConfig
    from dvi_lite.methods.dvi.learner import OnlineTrainer

    model = copy.deepcopy(target8)
    prompts = [PROMPT8, [1, 2, 3], [7, 6, 5, 4], [2, 2, 5, 0, 1]]
    cfg = DVIConfig(split=1, fast_every=8, batch_size=16, buffer_size=256, t_lambda=10.0, seed=0)
    tr = OnlineTrainer(model, prompts, cfg, max_new_tokens=24, K=k, temperature=1.0, progress=False)
    tr.train(4)
    assert tr.fast_step == 4
    return model, tr.policy


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

SMOLLM2_QUESTIONS = 6  # Spec-Bench dev questions in the real-model lossless tests: the shortest of each task group
SMOLLM2_NEW = 24  # greedy tokens per question


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
    from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread
    from dvi_lite.paths import BUILD_DIR

    model, tok = smollm2("float32")
    # the bench's questions: the shortest of each task group, then the shortest of the rest. Every group is in
    # (summarization and RAG bring prompts of 370 and 660 tokens, what prompt lookup copies from), and the
    # other questions are the cheapest: in fp32 on 2 cores a long prompt's prefill costs more than its new tokens
    sized = sorted((len(prompt_ids(tok, q["prompt"])), i, q) for i, q in
                   enumerate(spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)))
    firsts: dict[str, int] = {}
    for _, i, q in sized:
        firsts.setdefault(q["group"], i)
    rest = [i for _, i, _ in sized if i not in firsts.values()]
    picked = set(firsts.values()) | set(rest[: max(0, SMOLLM2_QUESTIONS - len(firsts))])
    prompts = [q["prompt"] for _, i, q in sized if i in picked]  # shortest first
    key = f"{fingerprint(model)}-{torch.__version__}-{SMOLLM2_QUESTIONS}x{SMOLLM2_NEW}-groups-then-shortest"
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
