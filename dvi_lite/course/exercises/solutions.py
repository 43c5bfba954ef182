"""Worked solutions of the exercises in `stubs.py` (same names, same signatures), short on purpose.

Each passes its `checks.check_<name>`; the tasks are stated in the stubs' docstrings, the derivations in the
notebooks' "Exercises" sections. Notation as everywhere: p target, q draft, K drafts per step, τ tokens per
target forward, α acceptance rate, c draft cost per token, v(n) verify cost of n tokens.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch

from dvi_lite.core.sampling import sample
from dvi_lite.measure.cost import v_of

# --------------------------------------------------------------------------- 00 foundations


def break_even_alpha(K: int, c: float, v_table: Mapping[int, float]) -> float | None:
    """τ(α) is increasing, so bisect τ(α) = v(K+1) + K·c on [0, 1]."""
    cost = v_of(v_table, K + 1) + K * c  # one step, in AR forwards
    if cost <= 1:
        return 0.0
    if cost > K + 1:  # τ <= K + 1 < cost for every α
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # 2^-60: far below the 1e-6 asked for
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, K) < cost else (lo, mid)
    return hi


# --------------------------------------------------------------------------- 01 speculative sampling


def expected_tokens(alpha: float, K: int) -> float:
    """P(at least i drafts accepted) = α^i, and a step emits 1 + (accepted) tokens, so
    τ = Σ_{i=0..K} α^i = (1 − α^{K+1}) / (1 − α), a geometric sum (K + 1 at α = 1)."""
    if alpha == 1:
        return K + 1.0
    return (1 - alpha ** (K + 1)) / (1 - alpha)


def acceptance_from_tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """min(a, b) = (a + b − |a − b|) / 2 summed over tokens: Σ min(p, q) = 1 − ½ Σ |p − q|."""
    return 1.0 - 0.5 * float((p - q).abs().sum())


def verify_sampling_chain(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                          gen: torch.Generator | None = None) -> tuple[int, int]:
    """Test drafts in order; the first rejection resamples the mass p has and q lacks."""
    K = draft.numel()
    for i in range(K):
        x = int(draft[i])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u >= float(p[i, x] / q[i, x]):  # accept with probability min(1, p/q)
            missing = torch.clamp(p[i] - q[i], min=0)  # (V,) what p still needs
            total = missing.sum()
            return i, sample(missing / total if total > 0 else p[i], gen)
    return K, sample(p[K], gen)  # all K accepted: the bonus token


def broken_threshold_verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, threshold: float,
                            gen: torch.Generator | None = None) -> tuple[int, int]:
    """Accept while p(x) >= threshold, then sample p at the stop: deterministic acceptance, wrong law."""
    n = 0
    while n < draft.numel() and float(p[n, int(draft[n])]) >= threshold:
        n += 1
    return n, sample(p[n], gen)


# --------------------------------------------------------------------------- 02 Kangaroo


def drafted_length(confidences: Sequence[float], eta: float | None, k_max: int) -> int:
    """Count the tokens drafted; a low-confidence token is proposed, and ends the draft."""
    n = 0
    for conf in confidences[:k_max]:
        n += 1
        if eta is not None and conf < eta:
            break
    return n


# --------------------------------------------------------------------------- 03 Draft & Verify


def adaptive_gamma_step(gamma: float, ar: float, accepted: int, drafted: int, reached_max: bool = False,
                        target_alpha: float = 0.9, beta1: float = 0.5, beta2: float = 0.9,
                        eps: float = 0.01) -> tuple[float, float]:
    """Two EMAs: the matchness AR follows accepted / drafted, γ moves a step eps toward more (or less) caution."""
    if drafted == 0:
        return gamma, ar
    new_ar = beta1 * ar + (1 - beta1) * accepted / drafted
    if new_ar < target_alpha:
        goal = gamma + eps  # too many rejections: exit earlier
    elif reached_max:
        goal = gamma  # the threshold did not end this draft: lowering it would not lengthen drafts
    else:
        goal = gamma - eps
    return min(1.0, max(0.0, beta2 * gamma + (1 - beta2) * goal)), new_ar


# --------------------------------------------------------------------------- 04 Medusa


def tree_attention_mask(parents: Sequence[int], past: int) -> torch.Tensor:
    """Row i of the node block = row of i's parent | i itself (parents come first), then prepend the cache."""
    par = [int(x) for x in parents]
    n = len(par)
    sees = torch.zeros(n, n, dtype=torch.bool)  # (N, N) node i may attend to node j
    for i, parent in enumerate(par):
        if parent >= 0:
            sees[i] = sees[parent]
        sees[i, i] = True
    cache = torch.ones(n, past, dtype=torch.bool)  # (N, past) every node sees the committed tokens
    return torch.cat([cache, sees], dim=1)[None, None]  # (1, 1, N, past + N)


# --------------------------------------------------------------------------- 05 DVI


def kl_weight(t: float, T: float, floor: float) -> float:
    """Exponential decay with time constant T, never below the floor."""
    return max(floor, math.exp(-t / T))


def floor_step(T: float, floor: float) -> int | None:
    """exp(−t/T) <= floor  <=>  t >= T·ln(1/floor): the smallest such integer is the ceiling."""
    if floor <= 0:
        return None
    t = max(0, math.ceil(T * math.log(1 / floor)))
    while t > 0 and math.exp(-(t - 1) / T) <= floor:  # rounding can put the ceiling one step late...
        t -= 1
    while math.exp(-t / T) > floor:  # ...or one step early
        t += 1
    return t


# --------------------------------------------------------------------------- 08 the study


def paired_speedup(method_rounds: Sequence[Sequence[float | None]], ar_rounds: Sequence[Sequence[float | None]]
                   ) -> float:
    """Per prompt the median over rounds of method / AR in the same round, then the median over prompts."""
    per = []
    for i in range(len(ar_rounds[0])):
        ratios = [m[i] / a[i] for m, a in zip(method_rounds, ar_rounds, strict=True) if m[i] is not None and a[i]]
        if ratios:
            per.append(statistics.median(ratios))
    return statistics.median(per)


# --------------------------------------------------------------------------- what each draft is trained on

def roofline_time(weight_bytes: float, flops: float, bandwidth_gbps: float, gflops: float) -> tuple[float, str]:
    stream, compute = weight_bytes / (bandwidth_gbps * 1e9), flops / (gflops * 1e9)
    return max(stream, compute), "memory" if stream >= compute else "compute"


def soft_ce(logq: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    p = top_logp.float().softmax(-1)  # renormalised over the kept top-k; -inf -> 0
    return -(p * logq.gather(-1, top_ids)).sum(-1)


def trim_targets(ids: torch.Tensor, logp: torch.Tensor, index_of: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = index_of[ids]
    on = rows >= 0
    return rows.clamp(min=0), logp.float().masked_fill(~on, float("-inf")), on.any(-1)


def skip_cost(n_layers: int, attn: float, mlp: float, fixed: float, skip_attn: Sequence[int],
              skip_mlp: Sequence[int]) -> float:
    kept = fixed + (n_layers - len(skip_attn)) * attn + (n_layers - len(skip_mlp)) * mlp
    return kept / (fixed + n_layers * (attn + mlp))


def head_targets(top_ids: torch.Tensor, top_logp: torch.Tensor, mask: torch.Tensor, t: torch.Tensor, i: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = t + 1 + i
    inside = s < mask.shape[1]
    s = s.clamp(max=mask.shape[1] - 1)
    n = torch.arange(len(t))
    return top_ids[n, s], top_logp[n, s], inside & mask[n, s]


def reinforce_loss(logits: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor, baseline: float
                   ) -> torch.Tensor:
    logq = logits.float().log_softmax(-1).gather(-1, tokens[:, None].long()).squeeze(-1)  # (N,)
    return -((rewards.float() - baseline).detach() * logq).mean()


# --------------------------------------------------------------------------- 06 prompt lookup

def prompt_lookup(tokens: Sequence[int], K: int, max_ngram: int = 3) -> list[int]:
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # an occurrence tokens[end - n:end] ending before the last
            if tokens[end - n:end] == tail:
                return tokens[end:end + K]
    return []


def lookup_tau(prompt_ids: Sequence[int], answer_ids: Sequence[int], K: int) -> float:
    i, steps = 1, 0
    while i < len(answer_ids):
        room = min(K, len(answer_ids) - i - 1)
        draft = prompt_lookup(list(prompt_ids) + list(answer_ids[:i]), room) if room > 0 else []
        acc = 0
        while acc < len(draft) and draft[acc] == answer_ids[i + acc]:
            acc += 1
        i, steps = i + acc + 1, steps + 1
    return (len(answer_ids) - 1) / steps if steps else 1.0


# --------------------------------------------------------------------------- 07 EAGLE

def ttt_mask(t: int, step: int) -> torch.Tensor:
    blocks = [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * step
    return torch.cat(blocks, 1)[None, None]


def _ahead(x: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[:, : max(0, x.shape[1] - n)] = x[:, n:]
    return out


def ttt_step_loss(logqs: Sequence[torch.Tensor], top_ids: torch.Tensor, top_logp: torch.Tensor,
                  mask: torch.Tensor, decay: float = 0.8) -> torch.Tensor:
    total = torch.zeros(())
    for s, logq in enumerate(logqs):
        w = _ahead(mask, 1 + s).float()
        ce = soft_ce(logq, _ahead(top_ids, 1 + s), _ahead(top_logp, 1 + s))
        total = total + decay ** s * (ce * w).sum() / w.sum().clamp(min=1.0)
    return total
