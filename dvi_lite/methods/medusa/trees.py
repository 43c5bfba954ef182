"""Candidate trees for Medusa, built from the heads' top-`branch` lists: pure functions, no model.

A node is named by its *path* of ranks (r_0, ..., r_d): its token is the rank-r_d token of head d, its
parent the path (r_0, ..., r_{d-1}); the pending token is the implicit root. Three builders:
`cartesian_tree` (every combination), `pruned_tree` (best-first by confidence, path probability or
entropy-scaled confidence, under a node budget) and `sparse_tree` (a fixed tree chosen once from
measured per-rank head accuracies: Medusa's `medusa_choices`). Node lists are sorted by (depth, ranks),
so parents come first, as the engine's `Proposal.parents` convention needs.

Names: `K` = heads used = draft tokens along a path (the tree's depth); `branch` = candidates per head.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dvi_lite.core.checks import check_int, check_prob
from dvi_lite.core.runner import tree_depths
from dvi_lite.methods.medusa.tree_attention import validate_parents

MAX_TREE_NODES = 1024  # a bigger tree costs more than a prefill per step; use pruning or a sparse tree
TREES = ("cartesian", "pruned", "sparse")
PRUNE_MODES = ("confidence", "path", "entropy")

Path_ = tuple[int, ...]  # a node: ranks (r_0, ..., r_d) in the heads' top-branch lists


def max_depth(parents: torch.Tensor) -> int:
    """Nodes on the longest root-to-leaf chain (= heads a tree uses); 0 for an empty tree."""
    return int(tree_depths(parents).max()) + 1 if parents.numel() else 0


def validate_tree_args(K, branch) -> tuple[int, int]:
    """Clear errors for the two numbers every tree needs (naming the parameter)."""
    check_int("K", K, 1, what="heads used: draft tokens along a path")
    check_int("branch", branch, 1, what="candidates per head")
    return K, branch


def cartesian_size(K: int, branch: int) -> int:
    """branch + branch^2 + ... + branch^K nodes."""
    return sum(branch ** d for d in range(1, K + 1))


@dataclass(frozen=True)
class CandidateTree:
    """A candidate tree in the engine's convention, plus where each node came from.

    tokens (N,), parents (N,): parents[i] < i, -1 = child of the pending token (Proposal's convention);
    paths[i]: node i's ranks (r_0, ..., r_d), so its token is the rank-r_d candidate of head d;
    path_probs (N,): product of the heads' probabilities along the path.
    """
    tokens: torch.Tensor
    parents: torch.Tensor
    paths: tuple[Path_, ...] = ()
    path_probs: torch.Tensor | None = None

    def __post_init__(self):
        par = validate_parents(self.parents)  # ValueError naming `parents` on malformed arrays
        object.__setattr__(self, "parents", par)
        if self.tokens.shape != par.shape:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(par.shape)} must have one "
                             "entry per node")
        if self.paths and len(self.paths) != par.numel():
            raise ValueError(f"paths has {len(self.paths)} entries for {par.numel()} nodes")

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def depth(self) -> int:
        """Longest root-to-leaf chain (nodes), = the number of heads the tree uses."""
        return max_depth(self.parents)


def check_paths(paths: Sequence[Sequence[int]], K: int | None = None, branch: int | None = None) -> list[Path_]:
    """A node list (Medusa's medusa_choices) as sorted tuples, or a ValueError naming `tree`.

    Every node's prefix must be a node too (else it would have no parent), ranks in [0, branch),
    depth <= K, no duplicates. Sorted by (depth, ranks): parents come first.
    """
    try:
        out = [tuple(int(r) for r in p) for p in paths]
        if any(tuple(p) != o for p, o in zip(paths, out, strict=True)):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"tree must be a list of rank paths like [(0,), (1,), (0, 0)], got {paths!r}") from None
    seen = set(out)
    if len(seen) != len(out):
        raise ValueError("tree has duplicate paths")
    for p in out:
        if not p:
            raise ValueError("tree paths must be non-empty (the pending token is the implicit root)")
        if min(p) < 0 or (branch is not None and max(p) >= branch):
            raise ValueError(f"tree path {p} has a rank outside [0, branch={branch})")
        if K is not None and len(p) > K:
            raise ValueError(f"tree path {p} is deeper than K={K}")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree")
    return sorted(out, key=lambda p: (len(p), p))


def cartesian_paths(K: int, branch: int) -> list[Path_]:
    """Every rank path of length 1..K: the full Cartesian product, sorted (depth, ranks)."""
    validate_tree_args(K, branch)
    n = cartesian_size(K, branch)
    if n > MAX_TREE_NODES:
        raise ValueError(f"a cartesian tree with K={K}, branch={branch} has {n} nodes > "
                         f"{MAX_TREE_NODES}; lower branch or use tree='pruned' / 'sparse' with max_nodes")
    level: list[Path_] = [()]
    out: list[Path_] = []
    for _ in range(K):
        level = [p + (r,) for p in level for r in range(branch)]
        out += level
    return out


def best_first_paths(scores: Sequence[Sequence[float]], node_thresholds: Sequence[float] | None = None,
                     path_threshold: float | None = None, max_nodes: int | None = None) -> list[Path_]:
    """The best nodes by path score = prod_d scores[d][r_d], in (depth, ranks) order.

    scores (K, branch): per-depth, per-rank probabilities (or accuracies), all in [0, 1].
    A node is eligible when its own score >= node_thresholds[d] and its path score >= path_threshold,
    and its parent is kept. Best-first search from the root keeps the max_nodes best eligible nodes:
    path scores never increase along a path, so that set is closed under ancestors (a valid tree) and
    it is also the set maximising the sum of path scores (the expected accepted length) for its size.
    """
    rows = [list(map(float, r)) for r in scores]
    if max_nodes is not None and max_nodes < 1:
        return []
    heap: list[tuple[float, Path_]] = [(-1.0, ())]  # the root (pending token), popped first and not kept
    out: list[Path_] = []
    while heap and (max_nodes is None or len(out) < max_nodes):
        neg, path = heapq.heappop(heap)
        if path:
            out.append(path)
        d = len(path)
        if d == len(rows):
            continue
        for r, s in enumerate(rows[d]):
            ps = -neg * s
            if node_thresholds is not None and s < node_thresholds[d]:
                continue
            if path_threshold is not None and ps < path_threshold:
                continue
            heapq.heappush(heap, (-ps, path + (r,)))  # ties: smaller ranks first (tuple order)
    return sorted(out, key=lambda p: (len(p), p))


def entropy_thresholds(entropy: Sequence[float] | torch.Tensor, threshold: float,
                       alpha: float | None = None) -> list[float]:
    """Per-head thresholds min(threshold, alpha * exp(-H_d)), alpha = sqrt(threshold) by default.

    Medusa's typical-acceptance rule (Cai et al. §2.3.1) used to prune: a flat (uncertain) head, whose
    best candidates all have small probabilities, gets a lower bar so that some of them survive; a
    peaked head keeps the plain threshold.
    """
    alpha = math.sqrt(threshold) if alpha is None else alpha
    ent = entropy.tolist() if isinstance(entropy, torch.Tensor) else list(entropy)
    return [min(threshold, alpha * math.exp(-float(e))) for e in ent]


def path_parents(paths: Sequence[Path_], device=None) -> torch.Tensor:
    """(N,) parent indices of sorted `paths` (parents first): -1 for depth-0 nodes."""
    index = {p: i for i, p in enumerate(paths)}
    return torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long, device=device)


def tree_from_paths(paths: Sequence[Path_], top_tokens: torch.Tensor,
                    top_probs: torch.Tensor | None = None) -> CandidateTree:
    """Tokens and parents of the nodes `paths` (sorted, parents first) given the heads' top lists (K, branch)."""
    dev = top_tokens.device
    parents = path_parents(paths, dev)
    depth = tree_depths(parents).long()  # (N,): node i's token comes from head depth[i] (long even if empty)
    rank = torch.tensor([p[-1] for p in paths], dtype=torch.long, device=dev)
    probs = None
    if top_probs is not None:
        probs = torch.tensor([math.prod(float(top_probs[d, r]) for d, r in enumerate(p)) for p in paths])
    return CandidateTree(top_tokens[depth, rank], parents, tuple(paths), probs)


def cartesian_tree(top_tokens: torch.Tensor, top_probs: torch.Tensor, branch: int) -> CandidateTree:
    """Every combination of the heads' top-branch tokens, depth = number of heads (rows of top_tokens)."""
    K = top_tokens.shape[0]
    validate_tree_args(K, branch)
    _check_topk(top_tokens, top_probs, branch)
    return tree_from_paths(cartesian_paths(K, branch), top_tokens, top_probs)


def pruned_tree(top_tokens: torch.Tensor, top_probs: torch.Tensor, threshold: float | None = None,
                mode: str = "confidence", max_nodes: int | None = None,
                entropy: torch.Tensor | Sequence[float] | None = None, alpha: float | None = None) -> CandidateTree:
    """The Cartesian tree pruned to what the heads believe in (Project Gorgon's three rules).

    mode "confidence": keep a node if its head gave its token >= threshold;
    mode "path":       keep it if the product of probabilities along its path >= threshold;
    mode "entropy":    confidence with a per-head threshold min(threshold, alpha exp(-entropy_d));
    then keep the max_nodes best by path probability. A pruned node takes its subtree with it.
    """
    K, branch = top_tokens.shape
    validate_tree_args(K, branch)
    _check_topk(top_tokens, top_probs, branch)
    if mode not in PRUNE_MODES:
        raise ValueError(f"mode (prune) must be one of {PRUNE_MODES}, got {mode!r}")
    node_thr, path_thr = None, None
    if threshold is not None:
        check_prob("threshold", threshold)
        if mode == "confidence":
            node_thr = [threshold] * K
        elif mode == "path":
            path_thr = threshold
        else:
            if entropy is None:
                raise ValueError("mode='entropy' needs the heads' entropies (entropy=...)")
            node_thr = entropy_thresholds(entropy, threshold, alpha)
    if max_nodes is None and threshold is None and cartesian_size(K, branch) > MAX_TREE_NODES:
        raise ValueError(f"an unpruned tree of K={K}, branch={branch} exceeds {MAX_TREE_NODES} "
                         "nodes: give max_nodes or a threshold")
    paths = best_first_paths(top_probs.tolist(), node_thr, path_thr, max_nodes)
    return tree_from_paths(paths, top_tokens, top_probs)


def sparse_tree(accuracies: Sequence[Sequence[float]] | torch.Tensor, budget: int) -> list[Path_]:
    """A fixed tree of `budget` nodes maximising the expected accepted length (Medusa's medusa_choices).

    accuracies (K, branch): accuracies[d][r] = P(head d's rank-r token is the token the target accepts
    at depth d), measured by medusa.train.head_accuracy. Assuming heads are right independently, node
    (r_0..r_d) lies on the accepted path with probability prod_j accuracies[j][r_j], and since nodes of
    one depth are mutually exclusive, E[accepted length] = the sum of those over the tree. Adding the
    best frontier node each time (best-first) maximises it for every budget.
    """
    acc = accuracies.tolist() if isinstance(accuracies, torch.Tensor) else [list(r) for r in accuracies]
    if not acc or not all(len(r) == len(acc[0]) and r for r in acc):
        raise ValueError(f"accuracies must be a non-empty (K, branch) table, got {accuracies!r}")
    if any(not 0.0 <= float(a) <= 1.0 for r in acc for a in r):
        raise ValueError("accuracies must be probabilities in [0, 1]")
    check_int("budget (max_nodes)", budget, 1)
    return best_first_paths(acc, max_nodes=budget)


def expected_accept_length(paths: Sequence[Path_], accuracies: Sequence[Sequence[float]]) -> float:
    """Sum over nodes of prod_j accuracies[j][r_j]: the sparse tree's objective (independence model)."""
    return sum(math.prod(float(accuracies[d][r]) for d, r in enumerate(p)) for p in paths)


def _check_topk(top_tokens: torch.Tensor, top_probs: torch.Tensor, branch: int) -> None:
    if top_tokens.ndim != 2 or top_probs.shape != top_tokens.shape:
        raise ValueError(f"top_tokens and top_probs must both be (K, branch), got {tuple(top_tokens.shape)} "
                         f"and {tuple(top_probs.shape)}")
    if top_tokens.shape[1] != branch:
        raise ValueError(f"branch={branch} but the top lists have {top_tokens.shape[1]} entries")


def head_topk(logits: torch.Tensor, branch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heads' logits (K, V) -> (top tokens (K, branch), their probabilities (K, branch), entropies (K,)), T = 1."""
    logp = logits.float().log_softmax(-1)
    probs = logp.exp()
    ent = -(probs * logp).nan_to_num().sum(-1)  # 0 * log 0 = 0
    vals, idx = probs.topk(branch, -1)
    return idx, vals, ent
