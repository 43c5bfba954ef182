"""Checks for the exercises: `check_<name>(fn)` tests ANY implementation of `stubs.<name>`, yours or the solution.

Each compares `fn` with the package's own code on seeded cases, says what differs, returns "ok: ..." (a stub's
NotImplementedError passes through); the training and new-chapter checks live in checks_training / checks_chapters.
χ² tests: a correct sampler passes each at p > P_PASS = 1e-4 (a check runs up to seven); the broken rule fails at 1e-3.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import product
from types import SimpleNamespace

import torch
from scipy.optimize import brentq

from dvi_lite.core.runner import tree_mask
from dvi_lite.core.sampling import make_generator
from dvi_lite.core.verify import verify_greedy_chain
from dvi_lite.core.verify import verify_sampling_chain as reference_verify
from dvi_lite.course.ch01_speculative_sampling import P_MIN, alpha_of, chi_square, toy_pair, tv
from dvi_lite.course.ch01_speculative_sampling import expected_tokens as reference_tokens
from dvi_lite.course.exercises.checks_chapters import (  # noqa: F401 - re-exported: every check_<name> lives here
    check_lookup_tau,
    check_prompt_lookup,
    check_ttt_mask,
    check_ttt_step_loss,
)
from dvi_lite.course.exercises.checks_training import (  # noqa: F401 - re-exported: every check_<name> lives here
    _call,
    check_head_targets,
    check_reinforce_loss,
    check_roofline_time,
    check_skip_cost,
    check_soft_ce,
    check_trim_targets,
)
from dvi_lite.measure.cost import predicted_speedup, v_of
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.dvi.losses import lambda_curve, lambda_schedule
from dvi_lite.methods.early_exit import EarlyExitDrafter

P_PASS = P_MIN / 10  # the p-value a correct sampler must beat in each χ² test of a check
# made-up v(n) tables: memory-, overhead-, compute-bound, a step, flat (free), sparse (v_of extrapolates past 3)
V_TABLES: dict[str, dict[int, float]] = {
    "memory": {1: 1.0, 2: 1.01, 3: 1.02, 5: 1.04, 9: 1.1, 17: 1.3},
    "step": {1: 1.0, 2: 1.5, 9: 1.6, 17: 2.0},
    "overhead": {1: 1.0, 2: 1.6, 3: 2.1, 5: 3.2, 9: 5.5, 17: 10.0},
    "compute": {1: 1.0, 2: 1.9, 3: 2.85, 5: 4.7, 9: 8.5, 17: 16.0},
    "flat": {1: 1.0, 17: 1.0},
    "sparse": {1: 1.0, 3: 1.5},
}


def _close(got, want: float, label: str, tol: float = 1e-9, hint: str = "") -> None:
    try:
        ok = math.isclose(float(got), want, rel_tol=tol, abs_tol=tol)
    except (TypeError, ValueError):
        ok = False
    assert ok, f"{label} = {got!r}, expected {want!r}{hint}"


def _speedup(alpha: float, k: int, c: float, v: Mapping) -> float:
    """The package's prediction: τ(K) (ch01) over v(K+1) + K·c (measure.cost)."""
    return predicted_speedup(reference_tokens(alpha, k), k, c, v)


# --------------------------------------------------------------------------- 00 foundations

def check_break_even_alpha(fn: Callable) -> str:
    """Against a root of the package's predicted_speedup(α) − 1 (brentq), for K in 1..8 on every v table."""
    n = 0
    for (name, v), k, c in product(V_TABLES.items(), (1, 2, 4, 8), (0.0, 0.05, 0.3)):
        label = f"break_even_alpha(K={k}, c={c}, v_table={name} {v})"
        got = _call(fn, label, k, c, v)
        cost = v_of(v, k + 1) + k * c
        if cost > k + 1:
            assert got is None, f"{label} = {got!r}, expected None: v(K+1) + K·c = {cost:.3f} > K + 1, so even " \
                                "α = 1 (τ = K + 1) does not pay"
            continue
        want = 0.0 if cost <= 1 else brentq(lambda a, k=k, c=c, v=v: _speedup(a, k, c, v) - 1, 0, 1, xtol=1e-12)
        assert got is not None, f"{label} is None, but α = {want:.6f} breaks even"
        _close(got, want, label, 1e-6, f" (speedup there: {_speedup(float(got), k, c, v):.6f}, should be 1; cost "
                                        "of a step = v(K+1) + K·c, with v(K+1) from v_of)")
        n += 1
    return f"ok: break-even α matches the package's predicted speedup on {n} cases (and None where nothing pays)"


# --------------------------------------------------------------------------- 01 speculative sampling

def check_expected_tokens(fn: Callable) -> str:
    """Against ch01.expected_tokens and the geometric sum 1 + α + ... + α^K, K = 0..8, α in [0, 1]."""
    for alpha in (0.0, 0.1, 0.35, 0.5, 0.8, 0.95, 0.999, 1.0):
        for k in range(9):
            want = reference_tokens(alpha, k)
            assert math.isclose(want, sum(alpha ** i for i in range(k + 1)), rel_tol=1e-9)
            label = f"expected_tokens({alpha}, {k})"
            got = _call(fn, label, alpha, k)
            one_short = (1 - alpha ** k) / (1 - alpha) if alpha < 1 else math.nan  # the classic off-by-one
            short = isinstance(got, (int, float)) and math.isclose(float(got), one_short)
            _close(got, want, label, hint=" = 1 + α + ... + α^K" + (
                ": yours is (1 − α^K)/(1 − α), but the step also emits the correction or bonus token" if short else ""))
    return "ok: τ(K) = (1 − α^{K+1}) / (1 − α) for α in [0, 1], K = 0..8"


def _pairs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, p, q): toy pairs, sparse ones (top-p target, top-k draft), equal and disjoint ones."""
    out = [(f"toy_pair({v}, seed={s})", *toy_pair(v, s)) for v, s in ((8, 0), (8, 1), (16, 2), (5, 3))]
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.0, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    return out + [("sparse", p, q), ("equal", p, p.clone()), ("disjoint", p, torch.roll(p, 4))]


def check_acceptance_from_tv(fn: Callable) -> str:
    """Against ch01.alpha_of (Σ min(p, q)) and 1 − ch01.tv on 7 pairs, and a simulated acceptance rate."""
    for name, p, q in _pairs():
        label = f"acceptance_from_tv(p, q) on {name}"
        got = _call(fn, label, p, q)
        _close(got, alpha_of(p, q), label, hint=f" = Σ min(p, q) (TV = {tv(p, q):.4f}; TV has a factor ½)")
    p, q = toy_pair(8, 0)
    gen, n = make_generator(0), 4000
    accepted = sum(reference_verify(torch.multinomial(q, 1, generator=gen), q[None], torch.stack([p, p]), gen)[0]
                   for _ in range(n))
    rate, alpha = accepted / n, float(_call(fn, "acceptance_from_tv(p, q)", p, q))
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / n), f"simulated {rate:.4f} vs {alpha:.4f}"
    return f"ok: 1 − TV(p, q) = Σ min(p, q) on {len(_pairs())} pairs; simulated acceptance {rate:.3f} vs α {alpha:.3f}"


def _greedy_cases(gen: torch.Generator, n: int = 40, v: int = 6) -> list[tuple[torch.Tensor, ...]]:
    """(draft, q, p): one-hot targets, drafts matching a random prefix; q one-hot (greedy) or soft."""
    cases = []
    for i in range(n):
        k = i % 5  # K = 0..4, also the empty draft
        target = torch.randint(0, v, (k + 1,), generator=gen)  # (K+1,)
        draft = torch.where(torch.rand(k, generator=gen) < 0.7, target[:k], (target[:k] + 1) % v)  # (K,)
        p = torch.nn.functional.one_hot(target, v).double()  # (K+1, V)
        if i % 2:
            q = torch.nn.functional.one_hot(draft, v).double()  # (K, V)
        else:
            q = torch.rand(k, v, generator=gen, dtype=torch.float64) + 0.05
            q = q / q.sum(-1, keepdim=True)  # (K, V), q > 0 everywhere
        cases.append((draft, q, p))
    return cases


def _ret(out, k: int, v: int, label: str) -> tuple[int, int]:
    """(n, next) as ints, checked against the contract 0 <= n <= K, 0 <= next < V."""
    assert isinstance(out, tuple) and len(out) == 2, f"{label} returned {out!r}, expected (n accepted, next token)"
    n, nxt = int(out[0]), int(out[1])
    assert 0 <= n <= k and 0 <= nxt < v, f"{label} returned {out!r}: need 0 <= n <= K = {k} and 0 <= next < V = {v}"
    return n, nxt


def _law_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, q (K, V), p (K+1, V)): distinct rows (so an off-by-one row shows), then sparse rows."""
    rows = [toy_pair(6, s) for s in range(3)]
    q = torch.stack([rows[0][1], rows[1][1]])  # (2, 6)
    p = torch.stack([r[0] for r in rows])  # (3, 6)
    sp_q = torch.tensor([[0.1, 0.0, 0.3, 0.2, 0.25, 0.15]], dtype=torch.float64)  # (1, 6): a top-k draft
    sp_p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0, 0.2, 0.3]], dtype=torch.float64)
    return [("K=2, toy rows", q, p), ("K=1, sparse p and q", sp_q, sp_p)]


def _emitted_counts(fn: Callable, q: torch.Tensor, p: torch.Tensor, runs: int, gen: torch.Generator,
                    label: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run fn on `runs` drafts x_i ~ q[i]: counts of the token emitted at each position j (among runs that
    reached j), (K+1, V) as a list, and counts of n accepted, (K+1,)."""
    k, v = q.shape
    at = [torch.zeros(v, dtype=torch.long) for _ in range(k + 1)]
    n_counts = torch.zeros(k + 1, dtype=torch.long)
    for _ in range(runs):
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]  # (K,)
        n, nxt = _ret(_call(fn, label, draft, q, p, gen), k, v, label)
        for j, tok in enumerate(draft[:n].tolist() + [nxt]):
            at[j][tok] += 1
        n_counts[n] += 1
    return at, n_counts


def _rounded(x: torch.Tensor) -> list[float]:
    return [round(v, 3) for v in x.tolist()]


def _n_law(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Exact P(n accepted = m), m = 0..K: α_0 ... α_{m-1} (1 − α_m), the last one α_0 ... α_{K-1}."""
    alphas = [alpha_of(p[i], q[i]) for i in range(q.shape[0])]
    reach = torch.tensor([math.prod(alphas[:m]) for m in range(len(alphas) + 1)], dtype=torch.float64)
    return reach * torch.tensor([1 - a for a in alphas] + [1.0], dtype=torch.float64)


def check_verify_sampling_chain(fn: Callable, runs: int = 5000, seed: int = 0) -> str:
    """Greedy-degenerate cases against core.verify.verify_greedy_chain, then the law of the emitted tokens
    (position by position, χ² against p[j]) and of n accepted (χ² against its exact law)."""
    gen = make_generator(seed)
    for i, (draft, q, p) in enumerate(_greedy_cases(gen)):
        label = f"greedy case {i}: verify_sampling_chain(draft={draft.tolist()}, q, p one-hot at " \
                f"{p.argmax(-1).tolist()})"
        got = _ret(_call(fn, label, draft, q, p, gen), draft.numel(), p.shape[1], label)
        want = verify_greedy_chain(draft, p)
        assert got == want, f"{label} = {got}, expected {want} as greedy verification gives: a one-hot p accepts " \
                            "exactly the drafts equal to its argmax, and the residual is that argmax"
    for name, q, p in _law_cases():
        label = f"verify_sampling_chain on {name}"
        at, n_counts = _emitted_counts(fn, q, p, runs, gen, label)
        for j, counts in enumerate(at):
            chi = chi_square(counts, p[j])
            what = ("the first token's law is min(p, q) + (1 − α)·residual: is the residual norm(max(0, p − q))?"
                    if j == 0 else "the bonus token (all K accepted) must be a sample of p[K]"
                    if j == q.shape[0] else "position j follows p[j] once j drafts were accepted")
            freq = _rounded(counts.double() / max(int(counts.sum()), 1))
            assert chi["pvalue"] > P_PASS, f"{label}: tokens emitted at position {j} do not follow p[{j}] " \
                f"(χ² p-value {chi['pvalue']:.1e}); observed {freq}, p[{j}] = {_rounded(p[j])}. Hint: {what}"
        chi = chi_square(n_counts, _n_law(q, p))
        assert chi["pvalue"] > P_PASS, f"{label}: n accepted {n_counts.tolist()} does not follow its exact law " \
            f"{_rounded(_n_law(q, p))} (χ² p-value {chi['pvalue']:.1e}): accept draft i " \
            "with probability min(1, p[i,x]/q[i,x]) and stop at the first rejection"
    return f"ok: greedy-degenerate cases equal verify_greedy_chain; emitted tokens follow p at every position " \
           f"and n accepted its exact law (χ², {runs} runs per case, p-values > {P_PASS:g})"


def check_broken_threshold_verify(fn: Callable, threshold: float = 0.2, runs: int = 4000, seed: int = 0) -> str:
    """The rule (n = leading drafts with p >= threshold, next ~ p[n]), then a χ² test that must FAIL."""
    gen = make_generator(seed)
    for i in range(30):
        k = 1 + i % 4
        p = torch.stack([toy_pair(6, 10 * i + j)[0] for j in range(k + 1)])  # (K+1, 6)
        q = torch.stack([toy_pair(6, 10 * i + j)[1] for j in range(k)])  # (K, 6)
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]  # (K,)
        label = f"broken_threshold_verify(draft={draft.tolist()}, q, p, threshold={threshold})"
        n, _ = _ret(_call(fn, label, draft, q, p, threshold, gen), k, 6, label)
        want = next((j for j in range(k) if p[j, draft[j]] < threshold), k)
        assert n == want, f"{label}: n = {n}, expected {want}: p[i, draft[i]] = " \
                          f"{[round(float(p[j, draft[j]]), 3) for j in range(k)]}, accept while >= {threshold}"
    p, q = toy_pair(8, 0)
    with_threshold = lambda d, q1, p2, g: fn(d, q1, p2, threshold, g)  # noqa: E731
    counts = _emitted_counts(with_threshold, q[None], torch.stack([p, p]), runs, gen, "broken_threshold_verify")[0][0]
    keep = (p >= threshold).double()  # tokens the rule accepts
    law = q * keep + (1 - float((q * keep).sum())) * p  # (V,) the rule's exact first-token law
    chi = chi_square(counts, p)
    assert chi["pvalue"] < P_MIN, f"the χ² test did not reject 'output ~ p' (p-value {chi['pvalue']:.2e}); the " \
        f"threshold rule's exact law is {tv(law, p):.3f} from p in TV, so it should: is the rule as stated?"
    return f"ok: the threshold rule as stated; χ² rejects 'output ~ p' (p-value {chi['pvalue']:.1e} < {P_MIN}): " \
           f"its output law q·1[p >= {threshold}] + (1 − q(accepted set))·p is {tv(law, p):.3f} from p in TV. " \
           "Not lossless."


# --------------------------------------------------------------------------- 02 Kangaroo

class _ScriptedDrafter(EarlyExitDrafter):
    """The real early-exit drafting loop, fed scripted logits whose max is the confidence we choose."""

    def __init__(self, confidences: list[float], eta: float | None, k_max: int):
        runner = SimpleNamespace(n_layers=4, device=torch.device("cpu"),
                                 embed=lambda ids: torch.zeros(1, ids.shape[1], 1),
                                 layers_forward=lambda h, cache, pos, start, stop: h)
        super().__init__(runner, split=1, K=k_max, threshold=eta)
        self.script = [torch.tensor([[[c, 0.0]]]) for c in confidences]  # (1, 1, 2) each

    def exit_scores(self, h: torch.Tensor) -> torch.Tensor:
        return self.script.pop(0)


def _drafter_length(confidences: list[float], eta: float | None, k_max: int) -> int:
    identity = lambda x: x  # noqa: E731 - the scripted "logits" are the confidences themselves
    # the sampled path reads the sampler's confidence (the greedy path computes its own softmax)
    sampler = SimpleNamespace(greedy=False, probs=identity, confidence=identity)
    state = SimpleNamespace(cache=SimpleNamespace(crop=lambda *a: None), committed=5, remaining=10 ** 6, pending=0,
                            device=torch.device("cpu"), sampler=sampler, gen=None)
    return len(_ScriptedDrafter(confidences, eta, k_max).propose(state))


def check_drafted_length(fn: Callable, seed: int = 0) -> str:
    """Against methods.early_exit.EarlyExitDrafter.propose (Kangaroo's loop), confidences j/64 (exact ties)."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(120):
        k_max = 1 + i % 8
        eta = (None, 0.25, 0.5, 0.75, 52 / 64)[i % 5]
        confs = (torch.randint(8, 65, (k_max + 2,), generator=gen) / 64).tolist()  # exact in float32 too
        label = f"drafted_length({confs}, eta={eta}, k_max={k_max})"
        got, want = _call(fn, label, confs, eta, k_max), _drafter_length(confs, eta, k_max)
        assert got == want, f"{label} = {got!r}, expected {want} (the early-exit drafter's count): the token " \
                            "drafted at confidence < η is proposed, then drafting stops; confidence = η goes on"
    return "ok: drafted lengths match the early-exit drafter on 120 cases (η, ties and the K_max cap)"


# --------------------------------------------------------------------------- 03 Draft & Verify

def check_adaptive_gamma_step(fn: Callable, seed: int = 0) -> str:
    """Against methods.draft_verify.adaptive.AdaptiveThreshold.update along random verification sequences."""
    gen = torch.Generator().manual_seed(seed)
    configs = [{}, {"target_alpha": 0.6, "beta1": 0.8, "beta2": 0.5, "eps": 0.05},
               {"gamma0": 1.0, "ar0": 0.0}, {"gamma0": 0.02, "ar0": 1.0, "eps": 0.1, "target_alpha": 0.3}]
    for cfg in configs:
        ref = AdaptiveThreshold(**cfg)
        rule = {key: val for key, val in cfg.items() if key not in ("gamma0", "ar0")}
        gamma, ar = ref.gamma, ref.ar
        for step in range(150):
            drafted = int(torch.randint(0, 7, (), generator=gen))
            accepted = int(torch.randint(0, drafted + 1, (), generator=gen))
            reached_max = bool(torch.rand((), generator=gen) < 0.3)
            label = f"{cfg or 'defaults'}, step {step}: adaptive_gamma_step({gamma}, {ar}, accepted={accepted}, " \
                    f"drafted={drafted}, reached_max={reached_max}, **{rule})"
            got = _call(fn, label, gamma, ar, accepted, drafted, reached_max, **rule)
            ref.update(accepted, drafted, reached_max)
            assert isinstance(got, tuple) and len(got) == 2, f"{label} returned {got!r}, expected (gamma, ar)"
            _close(got[1], ref.ar, f"{label}: AR", 1e-12, " (AR <- beta1·AR + (1 − beta1)·accepted/drafted)")
            _close(got[0], ref.gamma, f"{label}: gamma", 1e-12,
                   " (up by eps when AR < target, down otherwise, held when reached_max; EMA with beta2; clamp [0, 1])")
            gamma, ar = ref.gamma, ref.ar  # continue from the reference state: one error is reported once
    return f"ok: (γ, AR) match AdaptiveThreshold.update over {len(configs)} × 150 steps"


# --------------------------------------------------------------------------- 04 Medusa

def check_tree_attention_mask(fn: Callable, seed: int = 0) -> str:
    """Against core.runner.tree_mask (the mask the sdpa tree-attention path uses) on chains, stars, random trees."""
    gen = torch.Generator().manual_seed(seed)
    trees = [[-1], [-1, 0, 1, 2], [-1, -1, -1], [-1, -1, 0, 0, 1, 2, 4]]
    trees += [[int(torch.randint(-1, i, (), generator=gen)) for i in range(n)] for n in range(2, 14)]
    for parents in trees:
        for past in (0, 3, 7):
            label = f"tree_attention_mask({parents}, past={past})"
            got = _call(fn, label, parents, past)
            want = tree_mask(torch.tensor(parents), past)  # (1, 1, N, past + N)
            assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == torch.bool, \
                f"{label}: expected a bool tensor of shape {tuple(want.shape)}, got {getattr(got, 'shape', got)!r} " \
                f"{getattr(got, 'dtype', '')}"
            if not torch.equal(got, want):
                i, j = (got != want)[0, 0].nonzero()[0].tolist()
                who = "cached position" if j < past else f"node {j - past}"
                raise AssertionError(f"{label}: node {i} -> {who} is {bool(got[0, 0, i, j])}, expected "
                                     f"{bool(want[0, 0, i, j])}. A node sees the cache, itself and all its ancestors")
    return f"ok: masks equal core.runner.tree_mask on {len(trees)} trees × 3 cache lengths"


# --------------------------------------------------------------------------- 05 DVI

def check_kl_weight(fn: Callable) -> str:
    """Against methods.dvi.losses.lambda_schedule (whose time constant is named tau)."""
    for t, T, floor in product((0, 1, 5, 39.5, 40, 100, 1000), (1.0, 7.5, 40.0), (0.0, 0.05, 0.5, 1.0)):
        label = f"kl_weight(t={t}, T={T}, floor={floor})"
        _close(_call(fn, label, t, T, floor), lambda_schedule(t, T, floor), label, 1e-12, " = max(floor, exp(−t/T))")
    return "ok: λ_t = max(floor, exp(−t/T)) matches lambda_schedule"


def check_floor_step(fn: Callable) -> str:
    """Against the first step of methods.dvi.losses.lambda_curve that sits at the floor."""
    for T, floor in product((1.0, 3.3, 7.5, 40.0, 200.0), (0.0, 0.01, 0.05, 0.1, 0.37, 0.5, 0.9, 1.0)):
        label = f"floor_step(T={T}, floor={floor})"
        got = _call(fn, label, T, floor)
        if floor == 0:
            assert got is None, f"{label} = {got!r}, expected None: exp(−t/T) > 0 never reaches a zero floor"
            continue
        curve = lambda_curve(int(10 * T) + 2, T, floor)  # floor >= 0.01 is reached by t = 4.7 T
        want = next(t for t, lam in enumerate(curve) if lam <= floor)
        assert got == want and not isinstance(got, bool), f"{label} = {got!r}, expected {want}: λ_{want - 1} = " \
            f"{curve[want - 1] if want else None}, λ_{want} = {curve[want]} (the smallest integer t with " \
            "exp(−t/T) <= floor)"
    return "ok: the floor step matches lambda_curve for 5 time constants × 8 floors"


# --------------------------------------------------------------------------- 08 the study

def check_paired_speedup(fn: Callable) -> str:
    """Against the bench's own pairing (measure.paired.per_prompt_ratios, then the median over prompts), on seeded
    rounds with a drifting machine and missing decode phases."""
    import random
    import statistics

    from dvi_lite.measure.paired import per_prompt_ratios

    rng = random.Random(0)
    for case in range(60):
        n_rounds, n_prompts = rng.randint(1, 4), rng.randint(1, 9)
        drift = [rng.uniform(0.7, 1.3) for _ in range(n_rounds)]  # the machine's speed in each round
        base = [rng.uniform(10, 40) for _ in range(n_prompts)]
        gain = [rng.uniform(0.6, 2.5) for _ in range(n_prompts)]
        ar = [[base[i] * drift[r] * rng.uniform(0.97, 1.03) for i in range(n_prompts)] for r in range(n_rounds)]
        me = [[base[i] * gain[i] * drift[r] * rng.uniform(0.97, 1.03) for i in range(n_prompts)]
              for r in range(n_rounds)]
        if case % 3 == 0 and n_prompts > 1:  # a run with no decode phase: that round of that prompt drops out
            me[rng.randrange(n_rounds)][rng.randrange(n_prompts)] = None
        wrap = lambda rounds: [[{"decode": x} for x in row] for row in rounds]  # noqa: E731
        want = statistics.median([x for x in per_prompt_ratios(wrap(me), wrap(ar), "decode") if x is not None])
        label = f"paired_speedup(case {case}: {n_rounds} rounds x {n_prompts} prompts)"
        got = _call(fn, label, me, ar)
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9), \
            f"{label} = {got!r}, expected {want:.6f}: per prompt the median over rounds of method / AR in the same " \
            "round, then the median over prompts"
    return "ok: matches the bench's paired speedup on 60 seeded cases (drifting rounds, missing decode phases)"
