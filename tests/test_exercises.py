"""The exercises (dvi_lite/course/exercises): every check passes its solution and the package's own code, every stub
raises NotImplementedError, and every check rejects deliberately wrong implementations (the classic mistakes)."""
from __future__ import annotations

import inspect
import math
import statistics

import pytest
import torch

from dvi_lite.core.runner import tree_mask
from dvi_lite.core.sampling import sample
from dvi_lite.core.verify import residual, verify_sampling_chain
from dvi_lite.course.ch01_speculative_sampling import expected_tokens
from dvi_lite.course.exercises import EXERCISES, checks, names, solutions, stubs
from dvi_lite.measure.cost import v_of
from dvi_lite.methods.dvi.losses import lambda_schedule

NAMES = names()
P, Q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
STUB_ARGS = {  # one valid call per stub
    "break_even_alpha": (2, 0.1, {1: 1.0, 3: 1.2}),
    "expected_tokens": (0.5, 3),
    "acceptance_from_tv": (P, Q),
    "verify_sampling_chain": (torch.tensor([1]), Q[None], torch.stack([P, P])),
    "broken_threshold_verify": (torch.tensor([1]), Q[None], torch.stack([P, P]), 0.2),
    "drafted_length": ([0.9, 0.4, 0.8], 0.5, 3),
    "adaptive_gamma_step": (0.8, 0.0, 1, 2),
    "tree_attention_mask": ([-1, 0, 0], 2),
    "kl_weight": (3, 40.0, 0.05),
    "floor_step": (40.0, 0.05),
    "paired_speedup": ([[20.0, 30.0]], [[10.0, 20.0]]),
    "roofline_time": (269e6, 270e6, 11.5, 100.0),
    "soft_ce": (torch.zeros(2, 3), torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2)),
    "trim_targets": (torch.tensor([[0, 2]]), torch.zeros(1, 2), torch.tensor([0, -1, 1])),
    "skip_cost": (4, 1.0, 2.0, 3.0, [0], [1, 2]),
    "head_targets": (torch.zeros(1, 3, 2, dtype=torch.long), torch.zeros(1, 3, 2), torch.ones(1, 3, dtype=torch.bool),
                     torch.tensor([0]), 0),
    "reinforce_loss": (torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([1.0, 0.0]), 0.5),
    "prompt_lookup": ([1, 2, 1], 2),
    "lookup_tau": ([1, 2], [1, 2, 1], 2),
    "ttt_mask": (3, 1),
    "ttt_step_loss": ([torch.zeros(1, 3, 4)], torch.zeros(1, 3, 2, dtype=torch.long), torch.zeros(1, 3, 2),
                      torch.ones(1, 3, dtype=torch.bool)),
}


def test_every_chapter_has_exercises_and_every_exercise_has_its_three_parts():
    assert sorted(EXERCISES) == [f"{i:02d}" for i in range(9)]  # 06 prompt lookup, 07 EAGLE, 08 the study
    assert all(EXERCISES.values()) and len(NAMES) == len(set(NAMES)) == len(STUB_ARGS)
    for name in NAMES:
        stub, sol = getattr(stubs, name), getattr(solutions, name)
        assert inspect.signature(stub) == inspect.signature(sol), name
        assert callable(getattr(checks, f"check_{name}")), name


@pytest.mark.parametrize("name", NAMES)
def test_stub_raises_not_implemented(name):
    with pytest.raises(NotImplementedError, match="exercise"):
        getattr(stubs, name)(*STUB_ARGS[name])
    with pytest.raises(NotImplementedError):  # the check lets it through: "not written yet", not "wrong"
        getattr(checks, f"check_{name}")(getattr(stubs, name))


@pytest.mark.parametrize("name", NAMES)
def test_check_passes_the_solution(name):
    assert getattr(checks, f"check_{name}")(getattr(solutions, name)).startswith("ok: ")


@pytest.mark.parametrize("name, reference", [
    ("expected_tokens", expected_tokens),  # the check also asserts its reference against the geometric sum
    ("verify_sampling_chain", verify_sampling_chain),  # the check tests laws (χ²) and greedy cases, not equality
], ids=lambda x: x if isinstance(x, str) else "")
def test_check_passes_the_package_code(name, reference):
    assert getattr(checks, f"check_{name}")(reference).startswith("ok: ")


# The checks of tree_attention_mask and kl_weight compare with the package's tree_mask and lambda_schedule, so
# passing the package's own function to them compares it with itself and cannot fail. The package code is
# checked here against independent oracles instead (an ancestor walk; values of exp(-t/T) known by hand), and
# each oracle must reject the wrong implementations of WRONG.

ORACLE_TREES = [[-1], [-1, 0, 1, 2], [-1, -1, -1], [-1, -1, 0, 0, 1, 2, 4], [-1, 0, 0, 1, 1, 3, 5, 2]]


def _ancestors(parents: list[int], i: int) -> set[int]:
    """Node i and every node on its path to the root, by walking up the parent links."""
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


def assert_mask_sees_exactly_the_ancestors(mask_fn) -> None:
    """mask_fn(parents, past) -> (1, 1, N, past + N) bool: node i sees every cached position, itself and its
    ancestors, and no other node."""
    for parents in ORACLE_TREES:
        for past in (0, 3):
            m = mask_fn(parents, past)
            n = len(parents)
            assert m.shape == (1, 1, n, past + n) and m.dtype == torch.bool, (parents, past, m.shape)
            for i in range(n):
                assert bool(m[0, 0, i, :past].all()), f"{parents}, past={past}: node {i} does not see the cache"
                sees = set(m[0, 0, i, past:].nonzero().flatten().tolist())
                assert sees == _ancestors(parents, i), f"{parents}: node {i} sees {sees}, not its ancestors"


def assert_schedule_is_exp_decay_with_a_floor(fn) -> None:
    """fn(t, T, floor) = max(floor, exp(-t/T)), by values known by hand: 1 at t = 0, 1/e at t = T, 1/e^2 at
    t = 2T, the floor once exp(-t/T) is below it, and a decay by exp(-1/T) per step above the floor."""
    for T in (1.0, 7.5, 40.0):
        assert math.isclose(fn(0, T, 0.05), 1.0), f"λ_0 = {fn(0, T, 0.05)}, not 1 (T={T})"
        assert math.isclose(fn(T, T, 0.0), 1 / math.e), f"λ_T = {fn(T, T, 0.0)}, not 1/e (T={T})"
        assert math.isclose(fn(2 * T, T, 0.1), math.e ** -2), f"λ_2T = {fn(2 * T, T, 0.1)}, not 1/e² (T={T})"
        assert math.isclose(fn(30 * T, T, 0.05), 0.05), f"λ_30T = {fn(30 * T, T, 0.05)}, not the floor 0.05"
        assert math.isclose(fn(4, T, 0.0) / fn(3, T, 0.0), math.exp(-1 / T)), f"the decay per step is not e^(-1/{T})"


@pytest.mark.parametrize("fn", [lambda par, past: tree_mask(torch.tensor(par), past), solutions.tree_attention_mask],
                         ids=["core.runner.tree_mask", "solution"])
def test_the_tree_mask_sees_exactly_the_ancestors(fn):
    assert_mask_sees_exactly_the_ancestors(fn)


@pytest.mark.parametrize("fn", [lambda_schedule, solutions.kl_weight], ids=["losses.lambda_schedule", "solution"])
def test_the_kl_weight_is_an_exponential_decay_with_a_floor(fn):
    assert_schedule_is_exp_decay_with_a_floor(fn)


@pytest.mark.parametrize("seed", [1, 2])
def test_sampling_check_is_not_seed_luck(seed):
    assert checks.check_verify_sampling_chain(solutions.verify_sampling_chain, runs=3000, seed=seed).startswith("ok")
    assert checks.check_broken_threshold_verify(solutions.broken_threshold_verify, seed=seed).startswith("ok")


# --------------------------------------------------------------------------- wrong implementations

def _cost(v, k, c):
    return v_of(v, k + 1) + k * c


def _verify_variant(draft, q, p, gen=None, *, on_reject="residual", bonus_row=0, ratio="p/q", prefix=True):
    """verify_sampling_chain with one classic mistake switched on."""
    k = draft.numel()
    idx = torch.arange(k)
    r = p[idx, draft] / q[idx, draft] if ratio == "p/q" else q[idx, draft] / p[idx, draft]  # (K,)
    ok = (torch.rand(k, generator=gen, dtype=torch.float64) < r).int()
    n = int(ok.cumprod(0).sum()) if prefix else int(ok.sum())
    if n < k:
        law = {"residual": residual(p[n], q[n]), "p": p[n], "q-p": residual(q[n], p[n])}[on_reject]
        return n, sample(law, gen)
    return n, sample(p[k + bonus_row], gen)


def _mask_parent_only(parents, past):
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            m[i, par] = True
    return torch.cat([torch.ones(n, past, dtype=torch.bool), m], 1)[None, None]


def _gamma_variant(gamma, ar, accepted, drafted, reached_max=False, target_alpha=0.9, beta1=0.5, beta2=0.9, eps=0.01,
                   *, sign=1, hold=True, clamp=True):
    if drafted == 0:
        return gamma, ar
    ar = beta1 * ar + (1 - beta1) * accepted / drafted
    goal = gamma + sign * eps if ar < target_alpha else gamma if (reached_max and hold) else gamma - sign * eps
    g = beta2 * gamma + (1 - beta2) * goal
    return (min(1.0, max(0.0, g)) if clamp else g), ar


def _bisect_tokens(k, cost):
    """The α with τ(α) = cost (0.0 if cost <= 1, None if cost > K + 1), by bisection."""
    if cost <= 1 or cost > k + 1:
        return 0.0 if cost <= 1 else None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost else (lo, mid)
    return hi


def _drafted(confidences, eta, k_max, keep_last=True, strict=True):
    """drafted_length with the low-confidence token dropped (keep_last=False) or a stop at equality."""
    for i, conf in enumerate(confidences[:k_max]):
        if eta is not None and (conf < eta if strict else conf <= eta):
            return i + 1 if keep_last else i
    return k_max


def _threshold_on_q(draft, q, p, threshold, gen=None):
    """The threshold read on the draft's probability q(x) instead of the target's p(x)."""
    n = 0
    while n < draft.numel() and float(q[n, int(draft[n])]) >= threshold:
        n += 1
    return n, sample(p[n], gen)


def _lookup(tokens, k, max_ngram, latest: bool = True, longest: bool = True, include_tail: bool = False):
    """The prompt-lookup proposer with a bug: the first occurrence, the shortest n first, or the tail matching
    itself."""
    tokens = list(tokens)
    ns = range(min(max_ngram, len(tokens) - 1), 0, -1)
    for n in (ns if longest else reversed(ns)):
        last = len(tokens) if include_tail else len(tokens) - 1
        ends = range(last, n - 1, -1) if latest else range(n, last + 1)
        for end in ends:
            if tokens[end - n:end] == tokens[-n:]:
                return tokens[end:end + k]
    return []


def _lookup_tau_any_match(prompt, answer, k):
    """lookup_tau counting every draft token equal to the answer's, not only the prefix before the first miss."""
    i, steps = 1, 0
    while i < len(answer):
        room = min(k, len(answer) - i - 1)
        draft = solutions.prompt_lookup(list(prompt) + list(answer[:i]), room) if room > 0 else []
        i, steps = i + sum(d == x for d, x in zip(draft, answer[i:], strict=False)) + 1, steps + 1
    return (len(answer) - 1) / steps if steps else 1.0


def _back(x):
    """x shifted right by one along T: undoes the first step's shift, so the loss reads unshifted targets."""
    out = torch.zeros_like(x)
    out[:, 1:] = x[:, :-1]
    return out


def _head_targets(ids, lp, mask, t, i, shift: int = 1, end_check: bool = True):
    """Medusa's head targets with a bug: the wrong offset, or no check that t + 1 + i is inside the row."""
    s = t + shift + i
    inside = s < mask.shape[1]
    s = s.clamp(max=mask.shape[1] - 1)
    n = torch.arange(len(t))
    return ids[n, s], lp[n, s], (inside if end_check else True) & mask[n, s]


WRONG = {
    "break_even_alpha": {
        "ignores c": lambda k, c, v: solutions.break_even_alpha(k, 0.0, v),
        "v(K) not v(K+1)": lambda k, c, v: _bisect_tokens(k, v_of(v, k) + k * c),
    },
    "expected_tokens": {
        "off by one": lambda a, k: k if a == 1 else (1 - a ** k) / (1 - a),
        "alpha=1 divides by zero": lambda a, k: (1 - a ** (k + 1)) / (1 - a),
    },
    "acceptance_from_tv": {
        "forgets the 1/2": lambda p, q: 1 - float((p - q).abs().sum()),
        "sum of max": lambda p, q: float(torch.maximum(p, q).sum()) - 1,
    },
    "verify_sampling_chain": {
        "resamples p, not the residual": lambda d, q, p, g=None: _verify_variant(d, q, p, g, on_reject="p"),
        "residual max(0, q - p)": lambda d, q, p, g=None: _verify_variant(d, q, p, g, on_reject="q-p"),
        "bonus from p[K-1]": lambda d, q, p, g=None: _verify_variant(d, q, p, g, bonus_row=-1),
        "accepts with q/p": lambda d, q, p, g=None: _verify_variant(d, q, p, g, ratio="q/p"),
        "counts accepts after a rejection": lambda d, q, p, g=None: _verify_variant(d, q, p, g, prefix=False),
    },
    "broken_threshold_verify": {
        "the lossless rule": lambda d, q, p, t, g=None: verify_sampling_chain(d, q, p, g),
        "threshold on q": lambda d, q, p, t, g=None: _threshold_on_q(d, q, p, t, g),
    },
    "drafted_length": {
        "drops the low-confidence token": lambda cs, eta, k: _drafted(cs, eta, k, keep_last=False),
        "stops at confidence == eta": lambda cs, eta, k: _drafted(cs, eta, k, strict=False),
        "no K_max cap": lambda cs, eta, k: solutions.drafted_length(cs, eta, len(cs)),
    },
    "adaptive_gamma_step": {
        "wrong direction": lambda *a, **kw: _gamma_variant(*a, **kw, sign=-1),
        "ignores reached_max": lambda *a, **kw: _gamma_variant(*a, **kw, hold=False),
        "no clamp": lambda *a, **kw: _gamma_variant(*a, **kw, clamp=False),
    },
    "tree_attention_mask": {
        "parent only, not all ancestors": _mask_parent_only,
        "causal, not a tree": lambda par, past: torch.ones(len(par), past + len(par), dtype=torch.bool).tril(past)[
            None, None],
        "forgets the cache": lambda par, past: solutions.tree_attention_mask(par, past) & torch.cat(
            [torch.zeros(len(par), past, dtype=torch.bool), torch.ones(len(par), len(par), dtype=torch.bool)], 1),
    },
    "kl_weight": {
        "min not max": lambda t, T, floor: min(floor, math.exp(-t / T)),
        "exp(-t*T)": lambda t, T, floor: max(floor, math.exp(-t * T)),
    },
    "floor_step": {
        "floor not ceiling": lambda T, floor: None if floor <= 0 else int(T * math.log(1 / floor)),
        "no zero floor": lambda T, floor: math.ceil(T * math.log(1 / floor)),
    },
    "roofline_time": {
        "the smaller floor": lambda b, f, bw, pk: (min(b / (bw * 1e9), f / (pk * 1e9)),
                                                   "memory" if b / bw >= f / pk else "compute"),
        "bandwidth in bytes/s": lambda b, f, bw, pk: solutions.roofline_time(b, f, bw * 1e9, pk),
        "a tie is compute": lambda b, f, bw, pk: (max(b / (bw * 1e9), f / (pk * 1e9)),
                                                  "memory" if b / bw > f / pk else "compute"),
    },
    "soft_ce": {
        "no renormalisation": lambda lq, ids, lp: -(lp.float().exp() * lq.gather(-1, ids)).sum(-1),
        "the argmax only": lambda lq, ids, lp: -lq.gather(-1, ids[..., :1]).squeeze(-1),
        "KL the other way": lambda lq, ids, lp: (lq.gather(-1, ids).exp() * (lq.gather(-1, ids)
                                                 - lp.float().log_softmax(-1).clamp(min=-1e4))).sum(-1),
    },
    "trim_targets": {
        "off-map tokens kept": lambda ids, lp, ix: (ix[ids].clamp(min=0), lp.float(), (ix[ids] >= 0).any(-1)),
        "kept = all on the map": lambda ids, lp, ix: (*solutions.trim_targets(ids, lp, ix)[:2], (ix[ids] >= 0).all(-1)),
    },
    "skip_cost": {
        "forgets the fixed part": lambda n, a, m, f, sa, sm: solutions.skip_cost(n, a, m, 0.0, sa, sm),
        "counts the skipped": lambda n, a, m, f, sa, sm: (f + len(sa) * a + len(sm) * m) / (f + n * (a + m)),
    },
    "head_targets": {
        "head i reads t + i": lambda ids, lp, mask, t, i: _head_targets(ids, lp, mask, t, i, shift=0),
        "no end check": lambda ids, lp, mask, t, i: _head_targets(ids, lp, mask, t, i, end_check=False),
    },
    "reinforce_loss": {
        "no baseline": lambda lg, tk, r, b: solutions.reinforce_loss(lg, tk, r, 0.0),
        "the sign flipped": lambda lg, tk, r, b: -solutions.reinforce_loss(lg, tk, r, b),
        "probability, not log": lambda lg, tk, r, b: -((r.float() - b) * lg.softmax(-1).gather(
            -1, tk[:, None]).squeeze(-1)).mean(),
    },
    "prompt_lookup": {
        "the first occurrence": lambda toks, k, n=3: _lookup(toks, k, n, latest=False),
        "shortest n first": lambda toks, k, n=3: _lookup(toks, k, n, longest=False),
        "matches the tail itself": lambda toks, k, n=3: _lookup(toks, k, n, include_tail=True),
    },
    "lookup_tau": {
        "counts the prefill token": lambda p, a, k: solutions.lookup_tau(p, a, k) * len(a) / max(1, len(a) - 1),
        "accepts after a mismatch": lambda p, a, k: _lookup_tau_any_match(p, a, k),
    },
    "ttt_mask": {
        "causal across steps": lambda t, s: torch.ones(t, (s + 1) * t, dtype=torch.bool).tril(s * t)[None, None],
        "no earlier steps": lambda t, s: torch.cat([solutions.ttt_mask(t, 0)[0, 0]]
                                                   + [torch.zeros(t, t, dtype=torch.bool)] * s, 1)[None, None],
    },
    "ttt_step_loss": {
        "no shift": lambda lq, ids, lp, m, d=0.8: solutions.ttt_step_loss(lq, _back(ids), _back(lp), _back(m), d),
        "no decay": lambda lq, ids, lp, m, d=0.8: solutions.ttt_step_loss(lq, ids, lp, m, 1.0 if d != 1.0 else 0.5),
        "mean over padding too": lambda lq, ids, lp, m, d=0.8: solutions.ttt_step_loss(lq, ids, lp,
                                                                                   torch.ones_like(m), d),
    },
    "paired_speedup": {
        "ratio of round medians (unpaired)": lambda me, ar: statistics.median(
            [statistics.median([x for x in r if x is not None]) / statistics.median(a)
             for r, a in zip(me, ar, strict=True)]),
        "mean over prompts": lambda me, ar: _per_prompt_mean(me, ar),
        "ratio of pooled medians": lambda me, ar: statistics.median([x for r in me for x in r if x is not None])
        / statistics.median([x for r in ar for x in r]),
    },
}


def _per_prompt_mean(me, ar):
    per = [statistics.median([m[i] / a[i] for m, a in zip(me, ar, strict=True) if m[i] is not None])
           for i in range(len(ar[0]))]
    return sum(per) / len(per)


def test_every_check_has_wrong_implementations():
    assert sorted(WRONG) == sorted(NAMES)


@pytest.mark.parametrize("name, label", [(n, lab) for n, variants in WRONG.items() for lab in variants])
def test_check_rejects_a_wrong_implementation(name, label):
    with pytest.raises(AssertionError):
        getattr(checks, f"check_{name}")(WRONG[name][label])


@pytest.mark.parametrize("name, label", [(n, lab) for n in ("tree_attention_mask", "kl_weight") for lab in WRONG[n]])
def test_the_oracles_reject_a_wrong_implementation(name, label):
    """The oracles above can fail: each wrong implementation of WRONG is rejected by them too."""
    oracle = assert_mask_sees_exactly_the_ancestors if name == "tree_attention_mask" else \
        assert_schedule_is_exp_decay_with_a_floor
    with pytest.raises(AssertionError):
        oracle(WRONG[name][label])


@pytest.mark.parametrize("label", list(WRONG["verify_sampling_chain"]))
def test_the_law_alone_rejects_each_wrong_verify(label, monkeypatch):
    """Most wrong verifies already fail the greedy-degenerate cases; the χ² tests must catch them on their own."""
    monkeypatch.setattr(checks, "_greedy_cases", lambda gen: [])
    with pytest.raises(AssertionError, match="χ²"):
        checks.check_verify_sampling_chain(WRONG["verify_sampling_chain"][label], runs=3000)


def test_an_unfilled_exercise_stops_a_learner_and_is_filled_in_smoke_and_full(monkeypatch, capsys):
    """Learner mode: Run All halts at the first exercise still holding its stub, saying what to write; smoke and
    full runs check the worked solution; a learner's own function is always the one checked."""
    from dvi_lite.course import exercises, modes

    mine = lambda t, T, floor: max(floor, math.exp(-t / T))  # noqa: E731
    monkeypatch.setattr(modes, "_current", modes._current)  # restored afterwards: other tests read the mode
    monkeypatch.delenv(exercises.FILL_ENV, raising=False)
    modes.check_mode("learner")
    with pytest.raises(exercises.ExerciseToDo, match=r"Exercise 05\.1 is yours to write: .*kl_weight\(t.*"
                                                     r"stubs\.kl_weight"):
        exercises.yours(stubs.kl_weight)
    assert exercises.yours(mine) is mine
    monkeypatch.setenv(exercises.FILL_ENV, "1")  # `make learner` times Run All's sizes with the solutions in
    assert exercises.yours(stubs.kl_weight) is solutions.kl_weight
    monkeypatch.delenv(exercises.FILL_ENV)
    for mode in ("smoke", "full"):
        modes.check_mode(mode)
        assert exercises.yours(stubs.kl_weight) is solutions.kl_weight and exercises.yours(mine) is mine
    assert "checking the worked solution, solutions.kl_weight" in capsys.readouterr().out
    assert [exercises.label(n) for n in ("break_even_alpha", "paired_speedup")] == ["Exercise 00.1", "Exercise 08.1"]
