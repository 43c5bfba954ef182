"""Medusa's drafter (Cai et al. 2024): the heads draft a candidate tree, the target verifies it in one pass.

Which state the heads read: the engine's pending token x_{t+1} was sampled from p_t and is not yet in
the target's cache. The drafter keeps h_t, the state that predicted it (the prompt's last state after
prefill, then the state at the last accepted token after every verification). Applied to h_t, head d
proposes the tokens of tree depth d: head 0 the children of the pending token, head 1 theirs, and so on.

The candidates are deterministic given the context, so under sampling they are verified as point masses
(a Proposal with q = None), which keeps the output law exactly p. Medusa's lossy "typical acceptance"
(typical.py) is an explicit opt-in, acceptance="typical": its proposals carry their own rule
(Proposal.accept), and the output then no longer follows p.

attention="triton" verifies the trees with the Triton tree-attention kernel (tree_attention.py) instead
of a dense mask + sdpa: the proposals name that runner (Proposal.runner); the loop stays the one loop.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dvi_lite.core.checks import check_choice, check_int, check_prob, check_real, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.core.runner import Runner, tree_depths
from dvi_lite.methods.medusa.heads import TRAIN_COMMAND, MedusaHeads, load_heads
from dvi_lite.methods.medusa.trees import (
    MAX_TREE_NODES,
    PRUNE_MODES,
    TREES,
    CandidateTree,
    Path_,
    cartesian_paths,
    cartesian_size,
    check_paths,
    head_topk,
    path_parents,
    pruned_tree,
    sparse_tree,
    validate_tree_args,
)
from dvi_lite.methods.medusa.typical import ACCEPTANCE, TYPICAL_DELTA, TYPICAL_EPSILON, typical_accept
from dvi_lite.models.artifacts import fingerprint, model_defaults
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab

DEFAULT_MAX_NODES = 16  # the node budget of a pruned or sparse tree when none is given


@dataclass
class _Static:
    """A fixed node list with its index tensors, so a step only gathers tokens."""
    paths: tuple[Path_, ...]
    parents: torch.Tensor  # (N,)
    depth: torch.Tensor  # (N,): node i's token comes from head depth[i]
    rank: torch.Tensor  # (N,): ... at rank rank[i]
    max_depth: int  # nodes on the longest path
    by_depth: dict = field(default_factory=dict)  # max depth -> _Static restricted to it (end of generation)


def _static(paths: list[Path_], device) -> _Static:
    parents = path_parents(paths, device)
    depth = tree_depths(parents).long()  # (N,), long even when empty
    rank = torch.tensor([p[-1] for p in paths], dtype=torch.long, device=device)
    return _Static(tuple(paths), parents, depth, rank, int(depth.max()) + 1 if len(paths) else 0)


class MedusaDrafter(Drafter):
    """Heads on the state that predicted the pending token -> a candidate tree -> one verify pass.

    K: heads used (draft tokens along a path; None = every head); branch: candidates per head.
    acceptance: "exact" (lossless) or "typical" (Medusa's lossy rule when sampling, with typical_epsilon
    and typical_delta; typical.py). The runner's attention backend ("sdpa" or "triton") verifies the trees.
    log: one dict per step (tree_size, depth, accepted, head_accepted[d] = depth d accepted, ranks of
    the accepted nodes) for the notebook's plots; `summary()` aggregates it.
    """
    name = "medusa"

    def __init__(self, runner: Runner, heads: MedusaHeads, K: int | None = None, branch: int = 4,
                 tree: str | Sequence[Sequence[int]] = "pruned", threshold: float | None = None,
                 max_nodes: int | None = None, prune: str = "confidence",
                 accuracies: Sequence[Sequence[float]] | None = None, acceptance: str = "exact",
                 typical_epsilon: float = TYPICAL_EPSILON, typical_delta: float = TYPICAL_DELTA,
                 vocab: TrimmedHead | None = None):
        self.runner, self.heads, self.vocab = runner, heads, vocab
        self.acceptance = check_choice("acceptance", acceptance, ACCEPTANCE)
        self.typical_epsilon = check_prob("typical_epsilon", typical_epsilon)
        self.typical_delta = check_real("typical_delta", typical_delta, 0.0)
        self.verifier = runner if runner.attention != "sdpa" else None  # Proposal.runner: None = the engine's
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"heads must be MedusaHeads, a path or None, got {type(heads).__name__}")
        if heads.model_fingerprint != fingerprint(runner.model):
            raise ValueError("these Medusa heads were built for another model; train heads for this one")
        K = heads.num_heads if K is None else K
        validate_tree_args(K, branch)
        if K > heads.num_heads:
            raise ValueError(f"K={K} but the heads have only {heads.num_heads}")
        n_vocab = heads.vocab_size if vocab is None else len(vocab)
        if branch > n_vocab:
            raise ValueError(f"branch={branch} exceeds the vocabulary ({n_vocab} tokens"
                             f"{'' if vocab is None else ' in the draft map'})")
        self.K, self.branch, self.prune = K, branch, prune
        self.threshold = None if threshold is None else check_prob("threshold", threshold)
        if max_nodes is not None:
            check_int("max_nodes", max_nodes, 1, what="node budget")
        self.max_nodes = max_nodes
        self.tree = tree if isinstance(tree, str) else "custom"
        if isinstance(tree, str) and tree not in TREES:
            raise ValueError(f"tree must be one of {TREES} or a list of rank paths, got {tree!r}")
        if self.tree != "pruned" and (threshold is not None or prune != "confidence"):
            raise ValueError("threshold and prune apply to tree='pruned' only")
        if self.tree in ("cartesian", "custom") and max_nodes is not None:
            raise ValueError("max_nodes applies to tree='pruned' (node budget) or 'sparse' (its size) only")
        self.static = self._build_static(tree, accuracies)
        if self.static is None:  # pruned: adaptive, best-first under a budget
            if prune not in PRUNE_MODES:
                raise ValueError(f"prune must be one of {PRUNE_MODES}, got {prune!r}")
            if max_nodes is None and self.threshold is None:
                self.max_nodes = DEFAULT_MAX_NODES
            if self.max_nodes is None and cartesian_size(K, branch) > MAX_TREE_NODES:
                raise ValueError(f"tree='pruned' with K={K}, branch={branch} may exceed "
                                 f"{MAX_TREE_NODES} nodes: give max_nodes")
            self.max_draft = self.max_nodes or cartesian_size(K, branch)
        else:
            self.max_draft = len(self.static.paths)  # cache room the engine reserves for one proposal
        self.log: list[dict] = []
        self.h: torch.Tensor | None = None
        self._tree: CandidateTree | None = None

    def _build_static(self, tree, accuracies) -> _Static | None:
        """The fixed node list of a cartesian, custom or sparse tree (None for a pruned one)."""
        K, branch, dev = self.K, self.branch, self.runner.device
        if self.tree == "cartesian":
            return _static(cartesian_paths(K, branch), dev)
        if self.tree == "custom":
            return _static(check_paths(tree, K, branch), dev)
        if self.tree == "sparse":
            acc = accuracies if accuracies is not None else self.heads.accuracies
            if acc is None:
                raise ValueError("tree='sparse' needs measured per-rank head accuracies: pass accuracies=(K, branch) "
                                 f"or use heads trained by `{TRAIN_COMMAND}` (it stores them)")
            acc = [list(r)[:branch] for r in list(acc)[:K]]
            if len(acc) < K or any(len(r) < branch for r in acc):
                raise ValueError(f"accuracies cover fewer than K={K} heads x branch={branch} ranks")
            return _static(sparse_tree(acc, self.max_nodes or DEFAULT_MAX_NODES), dev)
        return None

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        self.h = state.prefill_hidden[self.runner.n_layers][:, -1:]  # (1, 1, D): predicted the pending token

    def _static_for(self, depth: int) -> _Static:
        s = self.static
        if depth >= s.max_depth:
            return s
        if depth not in s.by_depth:  # near max_new_tokens: drop nodes that could not be emitted anyway
            s.by_depth[depth] = _static([p for p in s.paths if len(p) <= depth], self.runner.device)
        return s.by_depth[depth]

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        depth = min(self.K, state.remaining - 1)  # tokens after the pending one still wanted
        dev = state.device
        if depth <= 0:
            self._tree = None
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=dev))
        if self.vocab is None:
            logits = self.heads(self.h[0, -1], depth)  # (depth, V): head d drafts tree depth d
            top_tokens, top_probs, ent = head_topk(logits, self.branch)  # (depth, branch) x 2, (depth,)
        else:  # the heads' logits on the map's N ids only (T = 1 over those), then back to token ids
            top, top_probs, ent = head_topk(self.heads.small(self.h[0, -1], depth, self.vocab), self.branch)
            top_tokens = self.vocab.ids[top]  # (depth, branch)
        if self.static is not None:
            s = self._static_for(depth)
            tree = CandidateTree(top_tokens[s.depth, s.rank], s.parents, s.paths)
        else:
            tree = pruned_tree(top_tokens, top_probs, self.threshold, self.prune, self.max_nodes,
                               ent if self.prune == "entropy" else None)
        self._tree = tree
        if len(tree) == 0:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=dev))
        accept = None  # the engine's exact rule
        if self.acceptance == "typical" and not state.sampler.greedy:
            accept = functools.partial(typical_accept, tree.tokens, tree.parents, self.typical_epsilon,
                                       self.typical_delta)
        # q = None: greedy, or point masses when sampling
        return Proposal(tree.tokens, None, tree.parents, runner=self.verifier, accept=accept)

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        self.h = outcome.hidden[:, -1:]  # the state at the last accepted token: it predicted next_token
        tree, n = self._tree, outcome.n_accepted
        depth = tree.depth if tree is not None else 0
        self.log.append({"tree_size": len(tree) if tree is not None else 0, "depth": depth, "accepted": n,
                         "head_accepted": [d < n for d in range(depth)],
                         "ranks": [tree.paths[i][-1] for i in outcome.path] if tree is not None else []})

    def summary(self) -> dict:
        return medusa_summary(self.log, self.K, self.branch)


def medusa_summary(log: list[dict], K: int, branch: int) -> dict:
    """Aggregates of MedusaDrafter.log: mean tree size, tau, per-head acceptance, rank hits.

    head_acceptance[d]: P(depth d accepted | the tree reached depth d): what head d contributes.
    head_acceptance_given_previous[d]: the same, given depth d-1 was accepted (the engine's
    position_acceptance). rank_hits[d][r]: how often the accepted depth-d token was head d's rank r
    (divide by steps to get the per-rank accuracies a sparse tree is built from).
    """
    steps = len(log)
    reached = [sum(1 for s in log if s["depth"] > d) for d in range(K)]
    acc = [sum(1 for s in log if s["accepted"] > d) for d in range(K)]
    prev = [sum(1 for s in log if s["depth"] > d and s["accepted"] >= d) for d in range(K)]
    hits = [[0] * branch for _ in range(K)]
    for s in log:
        for d, r in enumerate(s["ranks"]):
            hits[d][r] += 1
    return {"steps": steps,
            "mean_tree_size": sum(s["tree_size"] for s in log) / steps if steps else 0.0,
            "tau": sum(s["accepted"] + 1 for s in log) / steps if steps else None,
            "head_acceptance": [a / r if r else 0.0 for a, r in zip(acc, reached, strict=True)],
            "head_acceptance_given_previous": [a / p if p else 0.0 for a, p in zip(acc, prev, strict=True)],
            "rank_hits": hits}


def make_drafter(model, tokenizer, heads=None, K: int | None = None, branch: int | None = None, tree=None,
                 threshold: float | None = None, max_nodes: int | None = None, prune: str = "confidence",
                 accuracies=None, attention: str = "sdpa", acceptance: str = "exact",
                 typical_epsilon: float = TYPICAL_EPSILON, typical_delta: float = TYPICAL_DELTA,
                 vocab=None, **old) -> MedusaDrafter:
    """Medusa heads (None: this model's committed heads) draft a tree of each head's top-`branch` tokens.

    With no tree given and the committed heads, the model's committed choice is used (its defaults.json "medusa":
    the heads, candidates and tree that `medusa-sizing` picked by the cost model), else a pruned tree, branch 4.

    tree: 'cartesian' (all combinations), 'pruned' (the best max_nodes by path probability, optional
    threshold, prune = confidence|path|entropy), 'sparse' (fixed, from measured accuracies) or a list of
    rank paths. attention: 'sdpa' (dense tree mask, the reference) or 'triton' (the tree kernel; CUDA, or
    Triton's interpreter on CPU). Lossless under greedy and sampling with acceptance='exact' (the default);
    acceptance='typical' is Medusa's lossy rule when sampling. (`branch` is the heads' candidate count;
    generate()'s own top_k is the sampler's.)
    """
    reject_renamed(old, "medusa.make_drafter")
    if tree is None:  # no tree chosen: the model's committed choice (defaults.json "medusa"), else a pruned tree
        d = model_defaults(model).get("medusa", {}) if heads is None and threshold is None else {}
        tree, K = d.get("tree", "pruned"), K if K is not None else d.get("K")
        branch = branch if branch is not None else d.get("branch")
        max_nodes = max_nodes if max_nodes is not None else d.get("max_nodes")
    if vocab is None and heads is None:  # the committed heads draft on the model's committed map, if it names one
        vocab = model_defaults(model).get("medusa", {}).get("vocab")
    branch = branch if branch is not None else 4
    if heads is None or isinstance(heads, (str, Path)):
        heads = load_heads(model, heads)
    trimmed = None if vocab in (None, "full") else resolve_vocab(model, tokenizer, vocab)
    return MedusaDrafter(Runner.for_model(model, attention), heads, K, branch, tree, threshold, max_nodes, prune,
                         accuracies, acceptance, typical_epsilon, typical_delta, trimmed)
