"""Typical acceptance (Cai et al. 2024, Medusa, sec. 2.3.1): Medusa's LOSSY verification rule for sampling.

Rejection sampling keeps the output law exactly the target's p, but it accepts a deterministic
(top-k) candidate x only with probability p(x), so sampling at T > 0 accepts little. Medusa trades
exactness for longer accepted runs: a candidate x is accepted when the target finds it typical enough,

    p(x) > min(epsilon, delta * exp(-H(p))),

with p the target's distribution at the candidate's parent (the sampler's: temperature, top-k,
top-p) and H(p) its entropy. A flat p (high entropy) lowers the bar; a peaked one raises it, up to
epsilon. Among the root-to-node paths whose nodes all pass, the longest wins (ties: the most likely,
by the sum of log p, as in Medusa's code), and the token after it is p's argmax there: the paper's
"greedy decoding for the first token, accepted unconditionally".

Defaults from Medusa's reference code (FasterDecoding/Medusa, medusa/model/medusa_model.py:
posterior_threshold=0.09, posterior_alpha=0.3, "recommended to be sqrt(posterior_threshold)"):
epsilon = 0.09, delta = 0.3. (That code takes the entropy of p with log(p + 1e-5); we use the exact
entropy, with 0 log 0 = 0.)

NOT LOSSLESS: the output no longer follows p (tests/test_typical.py shows a chi-square test fail
where the default rule passes). Under greedy decoding (T = 0) the rule is not used: verification
stays the exact greedy match, as in Medusa's code.
"""
from __future__ import annotations

import torch

from dvi_lite.core.sampling import Sampler

ACCEPTANCE = ("exact", "typical")
TYPICAL_EPSILON = 0.09  # Medusa's posterior_threshold
TYPICAL_DELTA = 0.3  # Medusa's posterior_alpha (~ sqrt(epsilon))


def typical_threshold(p: torch.Tensor, epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> torch.Tensor:
    """(..., V) distributions -> (...,) acceptance thresholds min(epsilon, delta * exp(-H(p)))."""
    entropy = -torch.special.xlogy(p, p).sum(-1)  # (...,) nats; 0 log 0 = 0
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def verify_typical(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, epsilon: float = TYPICAL_EPSILON,
                   delta: float = TYPICAL_DELTA) -> tuple[list[int], int]:
    """Typical acceptance on a candidate tree: (accepted node indices along the path, next token).

    tokens (N,), parents (N,) (parents[i] < i, -1 = child of the pending token), p (N+1, V): the
    target's distribution after the pending token (row 0) and after each node (row i + 1).
    """
    n = tokens.numel()
    if n == 0:
        return [], int(p[0].argmax())
    par = parents.tolist()
    rows = torch.tensor([q + 1 for q in par], device=p.device)  # (N,) the row of each node's parent
    pt = p[rows, tokens.to(p.device)]  # (N,) p(node's token | its ancestors)
    ok = (pt > typical_threshold(p, epsilon, delta)[rows]).tolist()
    logp = pt.double().clamp_min(1e-300).log().tolist()
    score: dict[int, tuple[int, float]] = {-1: (0, 0.0)}  # reachable node -> (path length, log-likelihood)
    best = -1
    for i in range(n):  # parents come first, so a node's parent is scored before it
        if ok[i] and par[i] in score:
            length, ll = score[par[i]]
            score[i] = (length + 1, ll + logp[i])
            if score[i] > score[best]:
                best = i
    path, node = [], best
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1], int(p[best + 1].argmax())


def typical_accept(tokens: torch.Tensor, parents: torch.Tensor, epsilon: float, delta: float, logits: torch.Tensor,
                   sampler: Sampler, gen: torch.Generator | None = None) -> tuple[list[int], int]:
    """`Proposal.accept` once the tree and the constants are bound (functools.partial): typical acceptance
    on the sampler's distribution of the target's logits (N+1, V)."""
    return verify_typical(tokens, parents, sampler.probs(logits), epsilon, delta)
