"""EAGLE's drafter: the head drafts from the target's own fused features, as a chain or an EAGLE-2 dynamic tree.

Where the features come from: they cost nothing extra. The drafter asks the engine (`Drafter.capture_layers`
for the prefill, `Proposal.capture` for every verify forward) for the target's states after the head's fused
layers; the engine hands them back for the positions it keeps (`DecodeState.prefill_hidden`,
`Outcome.features`: pending token + accepted path). With the head's offsets (head.py), the committed positions
[0, c) and the pending token x_c give the inputs (F_j, x_{j+1}) for j < c: the last of them, (F_{c-1}, x_c), is
the "root" whose output drafts x_{c+1}.

The head's KV cache (one layer, core.kvcache) holds the inputs of committed positions only. `todo` holds the
fused features and tokens it has not seen yet (the prompt after prefill; the pending token and accepted path
after a verification). `propose` feeds them in one chunk, then drafts, appending draft positions; `feedback`
crops the cache back to the committed inputs, since a drafted position was fed the head's own predicted
feature, and the verify forward has just computed the real one.

Chain (tree="chain"): K tokens, each from the head's q (argmax when greedy, a sample when sampling: the
engine's rejection rule then needs q). Dynamic tree (tree="dynamic", EAGLE-2): the root's top-`branch` tokens
are depth 0; at every next depth the `branch` frontier nodes of highest cumulative draft log-probability are
expanded together (one head step with a tree mask), each adding its top-`branch` children; then all candidates
are reranked by cumulative log-probability and the best `max_nodes` kept. A path's score never rises, so the kept
set is closed under ancestors: a tree. Its candidates are deterministic given the context, so under sampling they
are verified as point masses (q = None): the shared tree verifier's recursive rejection, child after child with the
residual, keeps the output law exactly the target's.

Static tree (tree="static", EAGLE-1's kind): a fixed set of rank paths, e.g. (0, 1) = "the second-best child of
the best root token", expanded the same way at every step whatever the head's confidence. Its shape is the one
that maximises the expected accepted length under per-depth, per-rank acceptance measured from the dynamic tree's
own accepted paths (static_tree.py, the same best-first rule as Medusa's sparse tree), so the two trees differ
only in whether the shape follows this step's scores: EAGLE-2's claim, ablated.

Prompt-lookup branch (lookup=True, dynamic tree only): the tokens that followed the last earlier match of the
context's suffix (methods/pld.py) are merged into the same tree: the copy follows the tree's nodes while their
tokens agree and continues as a chain of new nodes where it leaves them. Siblings stay distinct tokens, every
node is still a point mass, so verification is unchanged and lossless; the copy costs no head step, only up
to K more nodes in the verify forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from dvi_lite.core.checks import check_choice, check_int, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner, chain_mask
from dvi_lite.methods.eagle.head import EagleHead, load_head, load_static_paths
from dvi_lite.methods.pld import PromptLookupDrafter
from dvi_lite.models.artifacts import fingerprint

TREES = ("chain", "dynamic", "static")
RankPath = tuple[int, ...]  # a node by the ranks of the tokens on its path: (0, 1) = best root, its second child
DEFAULT_BRANCH = 4  # children per expanded node, and nodes expanded per depth (EAGLE-2's top-k)
DEFAULT_MAX_NODES = 24  # nodes verified (EAGLE-2's total tokens; the cost model's v(N) picks it per machine)


class EagleDrafter(Drafter):
    """EAGLE-3 head + chain or EAGLE-2 dynamic tree; see the module docstring. `log`: per step, the proposal's size
    and depth and the accepted count."""
    name = "eagle"

    def __init__(self, runner: Runner, head: EagleHead, K: int = 5, tree: str = "dynamic",
                 branch: int | None = None, max_nodes: int | None = None, lookup: bool = False,
                 paths: Sequence[RankPath] | None = None):
        if not isinstance(head, EagleHead):
            raise ValueError(f"head must be an EagleHead, a path or None, got {type(head).__name__}")
        if head.model_fingerprint != fingerprint(runner.model):
            raise ValueError("this EAGLE head was built for another model; train one for this model with "
                             "`python -m dvi_lite eagle-train`")
        self.runner, self.head = runner, head
        self.K = check_int("K (draft tokens per step; a tree's depth)", K, 1)
        self.tree = check_choice("tree", tree, TREES)
        if self.tree != "dynamic" and (branch is not None or max_nodes is not None):
            raise ValueError(f"branch and max_nodes apply to tree='dynamic' only (tree={self.tree!r} is "
                             "K tokens in a chain, or the static tree's rank paths)")
        if (paths is not None) != (self.tree == "static"):
            raise ValueError("paths (the rank paths of a fixed tree) go with tree='static', and it needs them")
        self.paths = check_paths(paths) if paths is not None else None
        if self.paths is not None:  # the static tree fixes its depth, node count and widest rank
            self.K = max(len(q) for q in self.paths)
            branch, max_nodes = 1 + max(r for q in self.paths for r in q), len(self.paths)
        self.branch = check_int("branch (children per expanded node)", DEFAULT_BRANCH if branch is None else branch, 1)
        self.max_nodes = check_int("max_nodes (nodes verified)",
                                   DEFAULT_MAX_NODES if max_nodes is None else max_nodes, 1)
        if not isinstance(lookup, bool):
            raise ValueError(f"lookup must be True or False, got {lookup!r}")
        if lookup and self.tree != "dynamic":
            raise ValueError("lookup merges a prompt-lookup branch into the tree: use it with tree='dynamic'")
        self.lookup = PromptLookupDrafter(self.K, max_ngram=3) if lookup else None
        # the target cache room of one proposal: the tree, and the copy's new nodes
        self.max_draft = self.K if self.tree == "chain" else self.max_nodes + (self.K if lookup else 0)
        self.capture_layers = tuple(sorted(set(head.layers)))
        self.log: list[dict] = []  # per step: nodes drafted, accepted count, and the accepted node's rank path
        self._ranks: list[RankPath] = []  # the last proposal's nodes, by rank path

    def extra_params(self) -> int:
        return self.head.extra_params()

    # ------------------------------------------------------------------ the head's cache and unseen inputs

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        # draft positions a proposal appends before feedback crops them: the expanded nodes
        room = (len(self.paths) if self.paths is not None else self.K * max(self.branch, 1)) + 2
        self.cache = KVCache.for_model(self.runner.model, state.cache.max_len + room, n_layers=1)
        self.todo_f = [self._fused(state.prefill_hidden)]  # (1, T, D): F_0 .. F_{T-1}
        self.todo_t = prompt[0, 1:].tolist() + [state.pending]  # x_1 .. x_T (x_T = pending)
        self.base = 0
        if self.lookup is not None:
            self.lookup.prefill(state, prompt)

    def _fused(self, states: dict) -> torch.Tensor:
        return self.head.fuse([states[k] for k in self.head.layers])  # (1, n, D)

    def _feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the unseen committed inputs in one chunk: (root output g (1, 1, D), root logits (N,))."""
        g = torch.cat(self.todo_f, 1)  # (1, n, D)
        tokens = torch.tensor([self.todo_t], device=g.device)  # (1, n)
        past, n = len(self.cache), g.shape[1]
        pos = (past + torch.arange(n, device=g.device))[None]
        mask = chain_mask(n, past, g.device) if past else None
        out, logits = self.head.step(g, tokens, pos, self.cache, mask)
        self.todo_f, self.todo_t = [], []
        self.base = len(self.cache)  # committed inputs the cache holds; draft positions come after
        return out[:, -1:], logits[0, -1]

    # ------------------------------------------------------------------ proposals

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        depth = min(self.K, state.remaining - 1)  # tokens after the pending one still wanted
        dev = state.device
        self.base = len(self.cache)
        if depth <= 0:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=dev), capture=self.capture_layers)
        g, logits = self._feed()
        if self.tree == "chain":
            return self._chain(state, g, logits, depth)
        prop = self._dynamic_tree(g, logits, depth, dev)
        return prop if self.lookup is None else self._merge_copy(prop, self.lookup.lookup(state.tokens, depth))

    @staticmethod
    def _merge_copy(prop: Proposal, copy: list[int]) -> Proposal:
        """The tree with a copied chain merged in: follow existing children while tokens agree, then append."""
        if not copy:
            return prop
        tokens, parents = prop.tokens.tolist(), prop.parents.tolist()
        node = -1
        for t in copy:
            child = next((i for i, (tk, pa) in enumerate(zip(tokens, parents, strict=True)) if pa == node and tk == t),
                         None)
            if child is None:
                tokens.append(t)
                parents.append(node)
                child = len(tokens) - 1
            node = child
        dev = prop.tokens.device
        return Proposal(torch.tensor(tokens, device=dev), None, torch.tensor(parents, device=dev),
                        capture=prop.capture)

    def _chain(self, state: DecodeState, g: torch.Tensor, logits: torch.Tensor, depth: int) -> Proposal:
        """K tokens in a row: q = the head's law through the sampler (one-hot when greedy)."""
        head, dev, greedy = self.head, state.device, state.sampler.greedy
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(depth):
            if greedy:
                tok = int(head.ids[int(logits.argmax())])
            else:
                q = state.sampler.probs(head.to_vocab(logits))  # (V,), 0 off the draft vocabulary
                tok = int(torch.multinomial(q, 1, generator=state.gen))
                qs.append(q)
            tokens.append(tok)
            if i + 1 < depth:  # input (g, d_{i+1}) at position base + i: the head's own feature replaces F
                pos = torch.tensor([[self.base + i]], device=dev)
                g, lg = head.step(g, torch.tensor([[tok]], device=dev), pos, self.cache)
                logits = lg[0, -1]
        return Proposal(torch.tensor(tokens, device=dev), None if greedy else torch.stack(qs),
                        capture=self.capture_layers)

    def _dynamic_tree(self, g: torch.Tensor, logits: torch.Tensor, depth: int, dev) -> Proposal:
        """EAGLE-2: expand the best frontier nodes by cumulative log-probability, rerank, keep max_nodes. (A static
        tree, `paths` set, takes the same steps with a fixed choice: the nodes whose rank path is in `paths`.)"""
        head, b = self.head, self.branch
        tok: list[int] = []  # per candidate: vocabulary id
        par: list[int] = []  # parent candidate (-1: child of the pending token)
        score: list[float] = []  # cumulative draft log-probability of the path
        dep: list[int] = []
        rank: list[RankPath] = []  # the ranks of the tokens on its path
        fixed = None if self.paths is None else set(self.paths)
        inner = None if fixed is None else {q[:-1] for q in fixed}  # rank paths with a child in the tree
        out_g: dict[int, torch.Tensor] = {}  # expanded candidate -> its output (1, 1, D): its children's feature
        slot: dict[int, int] = {}  # expanded candidate -> its index in the head's cache

        def add_children(parent: int, lg: torch.Tensor, base_score: float, d: int) -> list[int]:
            lp = lg.float().log_softmax(-1)  # (N,), T = 1: the draft's own confidence ranks the tree
            vals, idx = lp.topk(min(b, lp.numel()))
            above = rank[parent] if parent >= 0 else ()
            start = len(tok)
            for r, (t, v) in enumerate(zip(head.ids[idx].tolist(), vals.tolist(), strict=True)):
                if fixed is None or above + (r,) in fixed:
                    tok.append(t)
                    score.append(base_score + v)
                    par.append(parent)
                    dep.append(d)
                    rank.append(above + (r,))
            return list(range(start, len(tok)))

        frontier = add_children(-1, logits, 0.0, 0)
        for d in range(1, depth):
            if fixed is None:
                grow = sorted(frontier, key=lambda i: -score[i])[:b]  # the best b frontier nodes are expanded
            else:
                grow = [i for i in frontier if rank[i] in inner]  # the fixed shape's inner nodes
            if not grow:
                break
            past = len(self.cache)
            feat = torch.cat([g if par[i] < 0 else out_g[par[i]] for i in grow], 1)  # (1, m, D)
            ids = torch.tensor([[tok[i] for i in grow]], device=dev)  # (1, m)
            pos = torch.full((1, len(grow)), self.base + d - 1, device=dev)  # depth-(d-1) nodes' position
            rows, cols = [], []  # (row, column) of every True outside the committed inputs: one write below
            for r, i in enumerate(grow):
                rows.append(r)
                cols.append(past + r)  # itself
                a = par[i]
                while a >= 0:  # its expanded ancestors' draft positions
                    rows.append(r)
                    cols.append(slot[a])
                    a = par[a]
            mask = torch.zeros(1, 1, len(grow), past + len(grow), dtype=torch.bool, device=dev)
            mask[..., : self.base] = True  # every committed input
            mask[0, 0, rows, cols] = True
            outs, lgs = head.step(feat, ids, pos, self.cache, mask)  # (1, m, D), (1, m, N)
            frontier = []
            for r, i in enumerate(grow):
                out_g[i], slot[i] = outs[:, r:r + 1], past + r
                frontier += add_children(i, lgs[0, r], score[i], d)
        # rerank every candidate; ties: shallower first, so a prefix of this order always holds its ancestors
        keep = sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))[: self.max_nodes]
        keep.sort(key=lambda i: (dep[i], i))  # parents before children
        self._ranks = [rank[c] for c in keep]
        where = {c: j for j, c in enumerate(keep)}
        parents = torch.tensor([where[par[c]] if par[c] >= 0 else -1 for c in keep], device=dev)
        tokens = torch.tensor([tok[c] for c in keep], device=dev)
        return Proposal(tokens, None, parents, capture=self.capture_layers)  # q None: point masses when sampling

    # ------------------------------------------------------------------ after verification

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        self.cache.crop(self.base)  # drop the draft positions: the real features of the kept ones are known now
        prop = outcome.proposal
        self.todo_f.append(self._fused(outcome.features))  # (1, n+1, D): F at the pending token + accepted path
        toks = prop.tokens.tolist()
        self.todo_t += [toks[i] for i in outcome.path] + [outcome.next_token]
        on_tree = prop.parents is not None and bool(outcome.path) and outcome.path[-1] < len(self._ranks)
        self.log.append({"drafted": len(prop), "accepted": outcome.n_accepted,
                         "ranks": list(self._ranks[outcome.path[-1]]) if on_tree else []})


def check_paths(paths) -> list[RankPath]:
    """A static tree's rank paths, checked: non-empty tuples of ranks >= 0, no repeats, closed under prefixes
    (every node's parent is in the tree), listed in any order; returned shallow first."""
    try:
        out = sorted({tuple(int(r) for r in q) for q in paths}, key=lambda q: (len(q), q))
    except (TypeError, ValueError):
        raise ValueError(f"paths must be a list of rank tuples like [(0,), (1,), (0, 0)], got {paths!r}") from None
    if not out or any(not q or min(q) < 0 for q in out):
        raise ValueError(f"paths must be non-empty rank tuples with ranks >= 0, got {paths!r}")
    have = set(out)
    orphans = [q for q in out if len(q) > 1 and q[:-1] not in have]
    if orphans:
        raise ValueError(f"paths must hold every node's parent: {orphans[0]} has no {orphans[0][:-1]}")
    return out


def make_drafter(model, tokenizer, head=None, K: int = 5, tree: str = "dynamic", branch: int | None = None,
                 max_nodes: int | None = None, lookup: bool = False, paths: Sequence[RankPath] | None = None,
                 **old) -> EagleDrafter:
    """EAGLE: a head (None: this model's committed head; or an EagleHead or its file) drafts from the target's fused
    features: tree='chain' (K tokens) or 'dynamic' (EAGLE-2: depth K, `branch` expanded per depth and children per
    node, the best `max_nodes` verified; lookup: a prompt-lookup copy merged into the tree) or 'static' (the fixed
    rank `paths`; None: the shape measured for this head, static_tree.py). Lossless under greedy and sampling."""
    reject_renamed(old, "eagle.make_drafter")
    if head is None or isinstance(head, (str, Path)):
        head = load_head(model, head)
    if tree == "static" and paths is None:
        paths = load_static_paths(model)
    return EagleDrafter(Runner.for_model(model), head, K, tree, branch, max_nodes, lookup, paths)
