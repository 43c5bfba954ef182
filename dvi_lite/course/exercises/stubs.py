"""The course's exercises, as stubs to fill in: one small function each, grouped by chapter.

Copy a stub into your notebook, write its body, and run its check on it:

    from dvi_lite.course.exercises import checks, stubs
    def expected_tokens(alpha, K): ...          # your version of stubs.expected_tokens
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

def break_even_alpha(K: int, c: float, v_table: Mapping[int, float]) -> float | None:
    """The acceptance rate α at which drafting K tokens per step breaks even: predicted speedup = 1.

    predicted speedup = τ / (v(K+1) + K·c) with τ = (1 − α^{K+1}) / (1 − α), which rises from 1 (α = 0)
    to K + 1 (α = 1). Solve τ(α) = v(K+1) + K·c for α in [0, 1] (to 1e-6); read v(n) from the measured
    table with `dvi_lite.measure.cost.v_of`. Return 0.0 if the cost is <= 1 (any α pays) and None if it
    is > K + 1 (no drafter, however good, pays on this machine at this K).
    Why: before training anything, it says how good a drafter must be on this machine.
    """
    raise _todo("break_even_alpha")


# --------------------------------------------------------------------------- 01 speculative sampling

def expected_tokens(alpha: float, K: int) -> float:
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


# --------------------------------------------------------------------------- 08 the study

def paired_speedup(method_rounds: Sequence[Sequence[float | None]], ar_rounds: Sequence[Sequence[float | None]]
                   ) -> float:
    """(08) The study's headline speedup of one method over AR, paired by prompt.

    method_rounds[r][i] and ar_rounds[r][i] are the decode rates (tokens/s) of the method and of AR on prompt i in
    round r, run back to back; None where a run had no decode phase. Per prompt, take the median over rounds of
    method / AR in the same round (skip a round where either is None or AR's rate is 0), drop a prompt with no
    ratio left, and return the median over prompts.
    Why: the machine drifts between rounds; a ratio within a pair cancels it, a ratio of two round medians does not.
    """
    raise _todo("paired_speedup")


# --------------------------------------------------------------------------- what each draft is trained on

def roofline_time(weight_bytes: float, flops: float, bandwidth_gbps: float, gflops: float) -> tuple[float, str]:
    """(00) The least time one decoding forward can take, and what bounds it: (seconds, "memory" or "compute").

    A forward must stream every weight once (weight_bytes at bandwidth_gbps, in 1e9 bytes/s) and do its
    arithmetic (flops at gflops, 1e9 flop/s). Either floor alone bounds it; the larger one is the roof. Return
    "memory" when streaming takes at least as long as the arithmetic.
    Why: it tells you whether verifying K + 1 tokens in one forward can cost about as little as one.
    """
    raise _todo("roofline_time")


def soft_ce(logq: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """(01) The loss every distilled draft here minimises (the SpS draft, the Kangaroo adapter, the Medusa heads):
    the cross-entropy of the draft's log-probs `logq` (..., V) against the target's top-k distribution.

    top_ids (..., k) are the target's k most likely tokens and top_logp (..., k) their log-probs; an entry of
    -inf is a token left out. Renormalise p over the kept top-k (a softmax of top_logp), then return
    -Σ_j p_j log q(top_ids_j) per position, shape (...).
    Why: minimising it is minimising KL(p_top-k ‖ q), the draft learning the target's distribution, not only its
    argmax.
    """
    raise _todo("soft_ce")


def trim_targets(ids: torch.Tensor, logp: torch.Tensor, index_of: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(02) Map the target's top-k (ids (B, k), logp (B, k)) into a trimmed draft head of N rows.

    index_of (V,) gives each vocabulary id's row in the trimmed head, or -1 if the id is off the map. Return
    (rows (B, k): index_of[ids] with -1 replaced by 0, logp (B, k) as float with -inf where the id is off the map,
    kept (B,): whether any of the k ids is on the map).
    Why: a head over the 8k most used tokens is 6× cheaper than the full 49k one, and the loss must ignore
    targets the head cannot say (soft_ce renormalises over the rest).
    """
    raise _todo("trim_targets")


def skip_cost(n_layers: int, attn: float, mlp: float, fixed: float, skip_attn: Sequence[int],
              skip_mlp: Sequence[int]) -> float:
    """(03) Draft & Verify's draft cost c: a forward that skips some sub-layers, relative to a full one.

    One attention sub-layer costs attn seconds, one MLP sub-layer mlp, and what every forward pays (embedding,
    final norm, LM head, overhead) costs fixed. skip_attn / skip_mlp are the layer indices skipped (no
    repeats). Return the draft forward's time over the full forward's, fixed + n_layers (attn + mlp).
    Why: skipping half the sub-layers never halves the cost: the LM head and the overhead stay.
    """
    raise _todo("skip_cost")


def head_targets(top_ids: torch.Tensor, top_logp: torch.Tensor, mask: torch.Tensor, t: torch.Tensor, i: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(04) What Medusa head i learns at position t of each row: the target's distribution one step further
    ahead per head.

    top_ids / top_logp (N, T, k) hold the target's top-k next-token ids and log-probs at each position (at
    position s: the distribution of token s + 1); mask (N, T) marks real tokens; t (N,) is one position per row.
    Head 0 sits with the base model's own next token x_{t+1} and predicts x_{t+2}, so head i predicts
    x_{t+2+i}: the target's top-k at position s = t + 1 + i. Return (ids (N, k), logp (N, k), valid (N,)):
    valid is False where s is past the row's end (read position T - 1 there) or not a real token.
    """
    raise _todo("head_targets")


def reinforce_loss(logits: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor, baseline: float
                   ) -> torch.Tensor:
    """(05) DVI's policy-gradient term on the accept bit: mean over drafts of -(r - b) · log π(token).

    logits (N, V) are the draft head's, tokens (N,) the drafted tokens, rewards (N,) 1 if verification accepted
    the token and 0 if not, baseline b the running mean reward. The advantage r - b carries no gradient.
    Return a scalar.
    Why: tokens accepted more often than usual get pushed up, rejected ones down: the head learns from what
    verification says, not from a teacher.
    """
    raise _todo("reinforce_loss")


# --------------------------------------------------------------------------- 06 prompt lookup

def prompt_lookup(tokens: Sequence[int], K: int, max_ngram: int = 3) -> list[int]:
    """The prompt-lookup proposer: up to K draft tokens copied from earlier in `tokens`.

    For n = max_ngram down to 1 (and n < len(tokens)): look for an earlier occurrence of the last n tokens, one
    that ends before the last token; take the MOST RECENT such occurrence and return the (up to) K tokens that
    followed it. The first n that matches wins; with no match at any n, return [].
    Why the most recent: in a list or a repeated template the latest match continues with the next item.
    """
    raise _todo("prompt_lookup")


def lookup_tau(prompt_ids: Sequence[int], answer_ids: Sequence[int], K: int) -> float:
    """τ of greedy prompt lookup on a known answer, without running any model.

    Greedy pld writes AR's answer, so a draft token is accepted exactly when it equals the answer's next token.
    The first answer token comes from the prefill. Then, with i answer tokens written, one step proposes
    prompt_lookup(prompt + answer[:i], min(K, len(answer) - i - 1)) (nothing if that is <= 0), accepts the longest
    prefix equal to answer[i:], and adds those tokens plus one of the target's. Return the answer's tokens after
    the first, divided by the number of steps (1.0 for a one-token answer).
    """
    raise _todo("lookup_tau")


# --------------------------------------------------------------------------- 07 EAGLE

def ttt_mask(t: int, step: int) -> torch.Tensor:
    """The attention pattern of EAGLE-3's training-time test at unrolled step `step` (0-based), for a row of t slots.

    The keys are the t slots of step 0, then the t slots of each step 1..step (shape (t, (step + 1) t)). Slot j of
    any step stands for one more draft token after position j: it sees step 0's slots 0..j (the committed prefix,
    causal) and its OWN slot j in every later step up to `step`, nothing else. Return a bool tensor
    (1, 1, t, (step + 1) t).
    """
    raise _todo("ttt_mask")


def ttt_step_loss(logqs: Sequence[torch.Tensor], top_ids: torch.Tensor, top_logp: torch.Tensor,
                  mask: torch.Tensor, decay: float = 0.8) -> torch.Tensor:
    """The training-time-test loss, given each unrolled step's draft log-probs.

    logqs[s] (B, T, V): the head's log-probs at step s; slot j of step s predicts the token after position
    j + 1 + s, so its targets are the teacher's top-k at position j + 1 + s: top_ids / top_logp (B, T, k) shifted
    left by 1 + s (zeros past the end), weighted by mask (B, T) shifted the same way (real tokens only). Step s's
    loss is the weighted mean soft cross-entropy (exercise soft_ce) over the slots; return Σ_s decay^s · loss_s.
    Why decay: a later draft token is reached only when every earlier one was accepted, so it matters less.
    """
    raise _todo("ttt_step_loss")
