"""Verification, written once: greedy prefix match, speculative (rejection) sampling, trees.

Notation everywhere: p = target distribution, q = draft distribution.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x ~ q is accepted with
probability min(1, p(x) / q(x)); on rejection we sample from the residual norm(max(0, p - q)); if all
K drafts pass, a bonus token comes from p at the next position. The output is distributed exactly as
p (see notebook 01 for the two-line proof), and one draft is accepted with probability
alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q).

A tree is the same rule applied child after child: at a node, try its children in order; each
rejection replaces the node's target by the residual, so the next child is tested against what the
previous ones did not already cover. A chain is the tree where every node has one child.
"""
from __future__ import annotations

from typing import Callable

import torch

from dvi_lite.core.sampling import sample


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what p still needs after q's proposal was rejected. (V,) -> (V,)"""
    r = torch.clamp(p - q, min=0)
    s = r.sum()
    return r / s if s > 0 else p  # s == 0 only through rounding (rejection then had probability ~0)


def _without(p: torch.Tensor, token: int) -> torch.Tensor:
    """residual(p, one-hot(token)) without building the one-hot: p with `token` zeroed, renormalised. (V,)"""
    r = p.clone()
    r[token] = 0
    s = r.sum()
    return r / s if s > 0 else p


def first_token_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact law of the token one draft-and-verify round emits first: accepted draft or residual sample.

    P(x) = q(x) min(1, p(x)/q(x)) + (1 - alpha) residual(x) = min(p, q)(x) + max(0, p - q)(x) = p(x).
    Computed with the same `residual` the sampler uses, so tests can check it equals p exactly.
    """
    accept = torch.minimum(q, p)  # q(x) * min(1, p(x)/q(x))
    alpha = accept.sum()
    return accept + (1 - alpha) * residual(p, q)


def verify_greedy_chain(draft: torch.Tensor, p_logits: torch.Tensor) -> tuple[int, int]:
    """draft (K,), p_logits (K+1, V) -> (n accepted, next token): longest prefix equal to argmax p."""
    target = p_logits.argmax(-1)  # (K+1,)
    match = (draft == target[:-1]).int()
    n = int(match.cumprod(0).sum()) if draft.numel() else 0
    return n, int(target[n])


def verify_sampling_chain(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                          gen: torch.Generator | None = None) -> tuple[int, int]:
    """draft (K,), q (K, V), p (K+1, V) -> (n accepted, next token), lossless rejection sampling."""
    k = draft.numel()
    if k:
        idx = torch.arange(k, device=p.device)
        ratio = p[idx, draft] / q[idx, draft]  # (K,) q[x] > 0 since x ~ q
        u = torch.rand(k, generator=gen, device=p.device)
        ok = (u < ratio).int()
        n = int(ok.cumprod(0).sum())
    else:
        n = 0
    if n < k:
        return n, sample(residual(p[n], q[n]), gen)
    return n, sample(p[k], gen)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                greedy: bool, gen: torch.Generator | None = None,
                probs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Longest accepted root-to-leaf path in a candidate tree, and the token after it.

    tokens (N,), parents (N,) with parents[i] < i and -1 for children of the last committed token;
    p (N+1, V): target distribution at the root (row 0) and after each node (row i+1), or logits
    when greedy; q (N, V): the distribution node i was drawn from given its parent, or None for
    deterministic candidates (top-k picks: q is then a point mass on the token).
    probs: when sampling, p may hold the logits instead and `probs` (the sampler's) turns a row into the target
    law when the walk visits it: a path visits depth + 1 of the N + 1 rows, so the rest are never normalised.
    Returns (accepted node indices along the path, next token).
    """
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents.tolist()):
        children.setdefault(par, []).append(i)
    tok = tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        kids = children.get(node, [])
        if greedy:
            best = int(p[node + 1].argmax())
            nxt = next((c for c in kids if tok[c] == best), None)
            if nxt is None:
                return path, best
        else:
            target = p[node + 1] if probs is None else probs(p[node + 1])
            nxt = None
            for c in kids:
                qc = q[c] if q is not None else None
                ratio = target[tok[c]] / qc[tok[c]] if qc is not None else target[tok[c]]
                if float(torch.rand((), generator=gen, device=p.device)) < float(ratio):
                    nxt = c
                    break
                if qc is None:  # point mass: residual = target with that token removed, renormalised
                    target = _without(target, tok[c])
                else:
                    target = residual(target, qc)
            if nxt is None:
                return path, sample(target, gen)
        path.append(nxt)
        node = nxt
