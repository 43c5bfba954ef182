"""The course's exercises, as stubs to fill in: one small function each, grouped by chapter.

Copy a stub into your notebook, write its body, and run its check on it:

    from dvi_lite.course.exercises import checks, stubs
    def expected_tokens(alpha, k): ...          # your version of stubs.expected_tokens
    checks.check_expected_tokens(expected_tokens)

Each check compares your function with the package's own code (the verify functions, the cost model, the
drafters) on seeded cases and says what differs. Solutions: `dvi_lite/course/exercises/solutions.py`.

Notation: p = target distribution, q = draft distribution; K = draft tokens per step; τ = tokens per target
forward; α = acceptance rate; c = draft cost per token (in target forwards); v(n) = verify cost of n tokens
(in 1-token forwards); predicted speedup = τ / (v(K+1) + K·c); exit layer k; η = the early-exit threshold.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _todo(name: str) -> NotImplementedError:
    return NotImplementedError(f"exercise: write `{name}` (stubs.py states the task; checks.check_{name} tests it)")


# --------------------------------------------------------------------------- 00 foundations

def break_even_alpha(k: int, c: float, v_table: Mapping[int, float]) -> float | None:
    """The acceptance rate α at which drafting K tokens per step breaks even: predicted speedup = 1.

    predicted speedup = τ / (v(K+1) + K·c) with τ = (1 − α^{K+1}) / (1 − α), which rises from 1 (α = 0)
    to K + 1 (α = 1). Solve τ(α) = v(K+1) + K·c for α in [0, 1] (to 1e-6); read v(n) from the measured
    table with `dvi_lite.study.cost.v_of`. Return 0.0 if the cost is <= 1 (any α pays) and None if it
    is > K + 1 (no drafter, however good, pays on this machine at this K).
    Why: before training anything, it says how good a drafter must be on this machine.
    """
    raise _todo("break_even_alpha")


# --------------------------------------------------------------------------- 01 speculative sampling

def expected_tokens(alpha: float, k: int) -> float:
    """τ(K): the mean tokens one target forward emits when each of the K drafts is accepted with
    probability α, independently, and the step stops at the first rejection.

    A step emits the accepted prefix plus one token (the residual sample at the rejection, or the bonus
    token when all K pass). Derive the closed form; mind α = 1 (every draft accepted: K + 1 tokens).
    """
    raise _todo("expected_tokens")


def acceptance_from_tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """α computed as 1 − TV(p, q), with TV(p, q) = ½ Σ_x |p(x) − q(x)|. p, q: (V,) distributions.

    The check compares it with α = Σ_x min(p(x), q(x)) (the acceptance probability of one draft x ~ q
    under the rule min(1, p(x)/q(x))) and with a simulated acceptance rate: prove they are equal.
    """
    raise _todo("acceptance_from_tv")


def verify_sampling_chain(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                          gen: torch.Generator | None = None) -> tuple[int, int]:
    """Lossless speculative sampling of a chain: draft (K,), q (K, V), p (K+1, V) -> (n accepted, next token).

    Draft token i (drawn from q[i]) is accepted with probability min(1, p[i, x] / q[i, x]), in order, until
    the first rejection. At a rejection at position n, the next token is a sample of the residual
    norm(max(0, p[n] − q[n])); if all K pass, the next (bonus) token is a sample of p[K]. Use `gen` for
    every random draw. The same contract as `dvi_lite.core.verify.verify_sampling_chain`: the check
    tests that the emitted tokens follow p position by position, and that one-hot p and q reproduce
    greedy verification.
    """
    raise _todo("verify_sampling_chain")


def broken_threshold_verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, threshold: float,
                            gen: torch.Generator | None = None) -> tuple[int, int]:
    """A tempting shortcut that is NOT lossless: accept draft token i iff p[i, x] >= threshold.

    Same shapes and return as `verify_sampling_chain`: draft (K,), q (K, V), p (K+1, V) -> (n, next).
    n = the number of leading drafts whose target probability is >= threshold; the next token is a sample
    of p[n] ("fall back to the target, surely that is safe"), also after all K pass (p[K]).
    The check confirms your rule, then runs the χ² test of the emitted tokens against p and expects it
    to FAIL: the output law is no longer p.
    """
    raise _todo("broken_threshold_verify")


def best_k(alpha: float, c: float, v_table: Mapping[int, float], ks: Sequence[int]) -> int:
    """The K among `ks` with the highest predicted speedup τ(K) / (v(K+1) + K·c) (ties: the smallest K).

    τ(K) = (1 − α^{K+1}) / (1 − α); v(n) from the measured table (`dvi_lite.study.cost.v_of`).
    Why: τ saturates at 1 / (1 − α) while the cost keeps growing with K, so the best K is interior.
    """
    raise _todo("best_k")


# --------------------------------------------------------------------------- 02 Kangaroo

def drafted_length(confidences: Sequence[float], eta: float | None, k_max: int) -> int:
    """How many tokens one step drafts under Kangaroo's second early exit.

    confidences[i] = the draft's top-1 probability when it drafts token i (at least k_max entries).
    Draft token after token; the token drafted at a confidence below η is still proposed, and drafting
    stops after it. Never more than k_max tokens; eta None = no early exit (always k_max).
    """
    raise _todo("drafted_length")


# --------------------------------------------------------------------------- 03 Draft & Verify

def adaptive_gamma_step(gamma: float, ar: float, accepted: int, drafted: int, reached_max: bool = False,
                        target_alpha: float = 0.9, beta1: float = 0.5, beta2: float = 0.9,
                        eps: float = 0.01) -> tuple[float, float]:
    """One update of Draft & Verify's adaptive threshold γ after a verification -> (new γ, new AR).

        AR  <- beta1 · AR + (1 − beta1) · accepted / drafted
        γ~  =  γ + eps if AR < target_alpha, else γ − eps (but γ when reached_max: the draft ran to its
               maximum length, so the threshold did not end it)
        γ   <- beta2 · γ + (1 − beta2) · γ~, clamped to [0, 1]
    drafted == 0 carries no information: return (gamma, ar) unchanged.
    """
    raise _todo("adaptive_gamma_step")


# --------------------------------------------------------------------------- 04 Medusa

def tree_attention_mask(parents: Sequence[int], past: int) -> torch.Tensor:
    """The tree-attention mask, (1, 1, N, past + N) bool, True = may attend.

    parents[i] < i is node i's parent, −1 = a child of the last committed token. Every node sees the
    `past` cached positions, itself and its ancestors, and nothing else (not its siblings' branches).
    """
    raise _todo("tree_attention_mask")


# --------------------------------------------------------------------------- 05 DVI

def kl_weight(t: float, T: float, floor: float) -> float:
    """DVI's KL weight at fast step t: λ_t = max(floor, exp(−t / T)).

    (The package's `lambda_schedule(t, tau, kl_floor)` calls the time constant `tau`: it is T here, not
    the τ of tokens per step.)
    """
    raise _todo("kl_weight")


def floor_step(T: float, floor: float) -> int | None:
    """The first integer step t at which λ_t = max(floor, exp(−t / T)) has reached the floor.

    floor in [0, 1]; None when it never does (floor = 0). Derive it in closed form, no loop over t.
    """
    raise _todo("floor_step")


# --------------------------------------------------------------------------- 06 the study

def pays_off(alpha: float, c: float, v_table: Mapping[int, float],
             ks: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8)) -> bool:
    """Does speculation pay here: is the predicted speedup τ(K) / (v(K+1) + K·c) > 1 for some K in ks?"""
    raise _todo("pays_off")
