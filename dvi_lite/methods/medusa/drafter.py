"""Medusa (Cai et al. 2024): extra decoding heads on the target's last hidden state, verified as a tree.

Notation: p = target distribution, q = draft (head) distribution.

The offset convention (one convention, used by the heads, the training and the drafter):

    h_t = the final *pre-norm* hidden state at position t (input token x_t). The model itself reads it
          to predict x_{t+1}: p_t = softmax(lm_head(norm(h_t))).
    head i (i = 0 .. H-1) reads the same h_t and predicts x_{t+2+i}: q_i = softmax(head_i(h_t)).

So head 0 predicts the token *after next*, never the next token (the model does that itself). In the
engine the pending token is x_{t+1}: sampled from p_t, not yet in the target's cache. The drafter keeps
the state that predicted it — the prompt's last state after prefill (DecodeState.prefill_hidden),
then Outcome.hidden[:, -1] after every verification (the state at the last accepted token, whose
logits gave next_token, the new pending token). Applied to that state, head i proposes the tokens
of tree depth i: head 0 the children of the pending token, head 1 their children, and so on.

A head (Medusa-1, Cai et al. §2.1.1, with Project Gorgon's fix — seed 002): a frozen copy of the model's
final RMSNorm, a residual block x + SiLU(W x + b) with W = b = 0 (the identity at initialisation), and
an LM head initialised from the model's. At initialisation every head therefore predicts exactly the
model's own next-token distribution; training only learns the shift. Without the norm the LM head
sees states far larger than it was trained on (rms 14 on the course model): the logits are about ten
times too sharp, and untrained heads start at a KL of 66 nats instead of 4.2 (measured on the course
model), although their top-1 barely moves (RMSNorm divides each state by a positive number; only its
per-channel weight can change the argmax).

LM head: by default each head owns a trainable copy (as Medusa-1: the token two ahead has a different
distribution over the vocabulary, and a copy can move it). `shared_lm_head=True` reuses the model's
frozen head instead: ~V*D fewer parameters per head (on the course model the vocabulary projection is
most of a head: 2.1M of its 2.2M parameters), and drafting then reads the projection once for all heads
(one (H, D) x (D, V) matmul) instead of H times, which is what decode speed on a CPU is bound by
(course model, 1 thread: 4 heads draft in 3.8 ms with own heads, 1.8 ms shared; a 1-token forward of
the model takes about 10 ms).

Candidate trees are built from the heads' top-k lists. A node is named by its *path* of ranks
(r_0, ..., r_d): its token is the rank-r_d token of head d, its parent the path (r_0, ..., r_{d-1}).
Three builders, all pure functions: the full Cartesian product (`cartesian_tree`), best-first pruning
by confidence / path probability / entropy-scaled confidence under a node budget (`pruned_tree`), and
a fixed sparse tree chosen once from measured per-rank head accuracies (`sparse_tree`, Medusa's
`medusa_choices`). The candidates are deterministic given the context, so under sampling they are
verified as point masses (verify_tree with q = None), which keeps the output law exactly p. (The heads
never see the pending token: under sampling, when it is not the model's likeliest, their guesses for
the tokens after it are worse, so acceptance drops; the output law does not change.)
Medusa's "typical acceptance" (lossy: accept a candidate when p(x) > min(eps, delta exp(-H(p)))) is not
offered: verify_step applies exactly one rule per sampler (greedy match or lossless rejection), and a
drafter cannot choose another without an engine hook (e.g. a verification function on the Proposal).
"""
from __future__ import annotations

import copy
import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dvi_lite.paths import DATA_DIR
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.models.artifacts import artifacts_dir, fingerprint
from dvi_lite.core.runner import Runner
from dvi_lite.methods.medusa.tree_attention import validate_parents

HEADS_DIR = DATA_DIR / "medusa"
HEADS_PATH = HEADS_DIR / "heads.pt"
MAX_TREE_NODES = 1024  # a bigger tree costs more than a prefill per step; use pruning or a sparse tree
TREES = ("cartesian", "pruned", "sparse")
PRUNE_MODES = ("confidence", "path", "entropy")

Path_ = tuple[int, ...]  # a node: ranks (r_0, ..., r_d) in the heads' top-k lists


# ---------------------------------------------------------------------------------------- the heads

class ResBlock(nn.Module):
    """x + SiLU(W x + b), W = b = 0 at init: exactly the identity, so a new head = the model's own head."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # Medusa keeps nn.Linear's random bias; zero makes the start exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """num_heads heads on the final pre-norm state h_t; head i predicts x_{t+2+i} (see the module doc).

    norm=False drops the frozen RMSNorm (Project Gorgon's bug, kept for notebook 04's lesson).
    """

    def __init__(self, model, num_heads: int = 4, norm: bool = True, shared_lm_head: bool = False):
        super().__init__()
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        head = model.get_output_embeddings()
        dim, vocab = head.weight.shape[1], head.weight.shape[0]
        self.num_heads, self.use_norm, self.shared_lm_head = num_heads, bool(norm), bool(shared_lm_head)
        self.hidden_size, self.vocab_size = dim, vocab
        self.model_fingerprint = fingerprint(model)
        self.accuracies: list[list[float]] | None = None  # measured (H, k) rank accuracies (sparse trees)
        self.norm = copy.deepcopy(model.model.norm) if norm else None  # frozen: the model's own norm
        if self.norm is not None:
            self.norm.requires_grad_(False)
        self.blocks = nn.ModuleList(ResBlock(dim) for _ in range(num_heads))
        self._shared = [head]  # a list: the model's head is not registered (not saved, not trained)
        if not shared_lm_head:  # own trainable copy per head (Medusa-1)
            self.lm_heads = nn.ModuleList(nn.Linear(dim, vocab, bias=head.bias is not None) for _ in range(num_heads))
            with torch.no_grad():
                for lm in self.lm_heads:
                    lm.weight.copy_(head.weight)  # a copy, not a tie (the course model ties head = embeddings)
                    if head.bias is not None:
                        lm.bias.copy_(head.bias)
        p = head.weight
        self.to(device=p.device, dtype=p.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def features(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Head i before its vocabulary projection: (..., D) -> (..., D)."""
        return self.blocks[i](self.norm(h) if self.norm is not None else h)

    def _shared_head(self, z: torch.Tensor) -> torch.Tensor:
        """The model's LM head, detached: training the heads never writes a gradient into the model."""
        lm = self._shared[0]
        return nn.functional.linear(z, lm.weight.detach(), None if lm.bias is None else lm.bias.detach())

    def head(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Head i's logits for x_{t+2+i} from h_t: (..., D) -> (..., V)."""
        z = self.features(i, h)
        return self._shared_head(z) if self.shared_lm_head else self.lm_heads[i](z)

    def forward(self, h: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """The first n heads (all by default): (..., D) -> (n, ..., V)."""
        n = self.num_heads if n is None else n
        if self.shared_lm_head:  # one matmul: the shared (V, D) projection is read once for all heads
            return self._shared_head(torch.stack([self.features(i, h) for i in range(n)]))
        return torch.stack([self.head(i, h) for i in range(n)])


def save_heads(heads: MedusaHeads, model, path: str | Path = HEADS_PATH, card: dict | None = None) -> None:
    """Half-precision weights + what is needed to rebuild them (and check they fit `model`); card as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.half() for k, v in heads.state_dict().items()}
    torch.save({"num_heads": heads.num_heads, "norm": heads.use_norm, "shared_lm_head": heads.shared_lm_head,
                "fingerprint": fingerprint(model), "accuracies": heads.accuracies, "state": state}, path)
    if card is not None:
        path.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")


_LOADED: dict = {}  # load once per (model, file version), not on every generate() call


def heads_path(model) -> Path:
    """The default heads file for this model: data/medusa/heads.pt for the course model."""
    return artifacts_dir(model) / "medusa" / HEADS_PATH.name


def load_heads(model, path: str | Path | None = None) -> MedusaHeads:
    """The trained heads for this model; FileNotFoundError / ValueError with what to do otherwise."""
    path = Path(path) if path is not None else heads_path(model)
    if not path.is_file():
        raise FileNotFoundError(f"no Medusa heads at {path}; train them with "
                                "`python -m dvi_lite.methods.medusa.train --heads 4` (or pass heads=...)")
    p = next(model.parameters())
    key = (fingerprint(model), str(p.dtype), str(p.device), str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load_heads(model, path)
    return _LOADED[key]


def _load_heads(model, path: Path) -> MedusaHeads:
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if ck.get("fingerprint") != fingerprint(model):
        raise ValueError(f"Medusa heads {path} were trained for another model; train heads for this one with "
                         "`python -m dvi_lite.methods.medusa.train --model <its folder>`")
    heads = MedusaHeads(model, ck["num_heads"], norm=ck["norm"], shared_lm_head=ck["shared_lm_head"])
    dtype = next(model.parameters()).dtype
    heads.load_state_dict({k: v.to(dtype) for k, v in ck["state"].items()})
    heads.accuracies = ck.get("accuracies")
    return heads.eval()


# ---------------------------------------------------------------------------------------- trees

def validate_tree_args(num_heads, top_k) -> tuple[int, int]:
    """Clear errors for the two numbers every tree needs (naming the parameter)."""
    for name, v in (("num_heads", num_heads), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return num_heads, top_k


def cartesian_size(num_heads: int, top_k: int) -> int:
    """k + k^2 + ... + k^H nodes."""
    return sum(top_k ** d for d in range(1, num_heads + 1))


@dataclass(frozen=True)
class CandidateTree:
    """A candidate tree in the engine's convention, plus where each node came from.

    tokens (N,), parents (N,): parents[i] < i, -1 = child of the pending token (Proposal's convention);
    paths[i]: node i's ranks (r_0, ..., r_d), so its depth is len(paths[i]) - 1 and its token is the
    rank-r_d candidate of head d; path_probs (N,): product of the heads' probabilities along the path.
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
        if self.paths:
            return max(map(len, self.paths))
        d: list[int] = []
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return max(d, default=0)


def check_paths(paths: Sequence[Sequence[int]], num_heads: int | None = None, top_k: int | None = None) -> list[Path_]:
    """A node list (Medusa's medusa_choices) as sorted tuples, or a ValueError naming `tree`.

    Every node's prefix must be a node too (else it would have no parent), ranks in [0, top_k),
    depth <= num_heads, no duplicates. Sorted by (depth, ranks): parents come first.
    """
    try:
        out = [tuple(int(r) for r in p) for p in paths]
        if any(tuple(p) != o for p, o in zip(paths, out)):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"tree must be a list of rank paths like [(0,), (1,), (0, 0)], got {paths!r}") from None
    seen = set(out)
    if len(seen) != len(out):
        raise ValueError("tree has duplicate paths")
    for p in out:
        if not p:
            raise ValueError("tree paths must be non-empty (the pending token is the implicit root)")
        if min(p) < 0 or (top_k is not None and max(p) >= top_k):
            raise ValueError(f"tree path {p} has a rank outside [0, top_k={top_k})")
        if num_heads is not None and len(p) > num_heads:
            raise ValueError(f"tree path {p} is deeper than num_heads={num_heads}")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree")
    return sorted(out, key=lambda p: (len(p), p))


def cartesian_paths(num_heads: int, top_k: int) -> list[Path_]:
    """Every rank path of length 1..num_heads: the full Cartesian product, sorted (depth, ranks)."""
    validate_tree_args(num_heads, top_k)
    n = cartesian_size(num_heads, top_k)
    if n > MAX_TREE_NODES:
        raise ValueError(f"a cartesian tree with num_heads={num_heads}, top_k={top_k} has {n} nodes > "
                         f"{MAX_TREE_NODES}; lower top_k or use tree='pruned' / 'sparse' with max_nodes")
    level: list[Path_] = [()]
    out: list[Path_] = []
    for _ in range(num_heads):
        level = [p + (r,) for p in level for r in range(top_k)]
        out += level
    return out


def best_first_paths(scores: Sequence[Sequence[float]], node_thresholds: Sequence[float] | None = None,
                     path_threshold: float | None = None, max_nodes: int | None = None) -> list[Path_]:
    """The best nodes by path score = prod_d scores[d][r_d], in (depth, ranks) order.

    scores (H, k): per-depth, per-rank probabilities (or accuracies), all in [0, 1].
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

    Medusa's typical-acceptance rule (Cai et al. §2.3.1, posterior_threshold 0.09, alpha 0.3) used to
    prune: a flat (uncertain) head, whose best candidates all have small probabilities, gets a lower
    bar so that some of them survive; a peaked head keeps the plain threshold.
    """
    alpha = math.sqrt(threshold) if alpha is None else alpha
    ent = entropy.tolist() if isinstance(entropy, torch.Tensor) else list(entropy)
    return [min(threshold, alpha * math.exp(-float(e))) for e in ent]


def tree_from_paths(paths: Sequence[Path_], top_tokens: torch.Tensor,
                    top_probs: torch.Tensor | None = None) -> CandidateTree:
    """Tokens and parents of the nodes `paths` (sorted, parents first) given the heads' top-k lists (H, k)."""
    index = {p: i for i, p in enumerate(paths)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    dev = top_tokens.device
    depth = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=dev)
    rank = torch.tensor([p[-1] for p in paths], dtype=torch.long, device=dev)
    probs = None
    if top_probs is not None:
        probs = torch.tensor([math.prod(float(top_probs[d, r]) for d, r in enumerate(p)) for p in paths])
    return CandidateTree(top_tokens[depth, rank], torch.tensor(parents, dtype=torch.long, device=dev),
                         tuple(paths), probs)


def cartesian_tree(top_tokens: torch.Tensor, top_probs: torch.Tensor, top_k: int) -> CandidateTree:
    """Every combination of the heads' top-k tokens, depth = number of heads (rows of top_tokens)."""
    num_heads = top_tokens.shape[0]
    validate_tree_args(num_heads, top_k)
    _check_topk(top_tokens, top_probs, top_k)
    return tree_from_paths(cartesian_paths(num_heads, top_k), top_tokens, top_probs)


def pruned_tree(top_tokens: torch.Tensor, top_probs: torch.Tensor, threshold: float | None = None,
                mode: str = "confidence", max_nodes: int | None = None,
                entropy: torch.Tensor | Sequence[float] | None = None, alpha: float | None = None) -> CandidateTree:
    """The Cartesian tree pruned to what the heads believe in (Project Gorgon's three rules).

    mode "confidence": keep a node if its head gave its token >= threshold;
    mode "path":       keep it if the product of probabilities along its path >= threshold;
    mode "entropy":    confidence with a per-head threshold min(threshold, alpha exp(-entropy_d));
    then keep the max_nodes best by path probability. A pruned node takes its subtree with it.
    """
    num_heads, top_k = top_tokens.shape
    validate_tree_args(num_heads, top_k)
    _check_topk(top_tokens, top_probs, top_k)
    if mode not in PRUNE_MODES:
        raise ValueError(f"mode (prune) must be one of {PRUNE_MODES}, got {mode!r}")
    node_thr, path_thr = None, None
    if threshold is not None:
        check_threshold(threshold)
        if mode == "confidence":
            node_thr = [threshold] * num_heads
        elif mode == "path":
            path_thr = threshold
        else:
            if entropy is None:
                raise ValueError("mode='entropy' needs the heads' entropies (entropy=...)")
            node_thr = entropy_thresholds(entropy, threshold, alpha)
    if max_nodes is None and threshold is None and cartesian_size(num_heads, top_k) > MAX_TREE_NODES:
        raise ValueError(f"an unpruned tree of num_heads={num_heads}, top_k={top_k} exceeds {MAX_TREE_NODES} "
                         "nodes: give max_nodes or a threshold")
    paths = best_first_paths(top_probs.tolist(), node_thr, path_thr, max_nodes)
    return tree_from_paths(paths, top_tokens, top_probs)


def sparse_tree(accuracies: Sequence[Sequence[float]] | torch.Tensor, budget: int) -> list[Path_]:
    """A fixed tree of `budget` nodes maximising the expected accepted length (Medusa's medusa_choices).

    accuracies (H, k): accuracies[d][r] = P(head d's rank-r token is the token the target accepts at
    depth d), measured (medusa_train.head_accuracy). Assuming heads are right independently, node
    (r_0..r_d) lies on the accepted path with probability prod_j accuracies[j][r_j], and since nodes of
    one depth are mutually exclusive, E[accepted length] = the sum of those over the tree. Adding the
    best frontier node each time (best-first) maximises it for every budget.
    """
    acc = accuracies.tolist() if isinstance(accuracies, torch.Tensor) else [list(r) for r in accuracies]
    if not acc or not all(len(r) == len(acc[0]) and r for r in acc):
        raise ValueError(f"accuracies must be a non-empty (num_heads, top_k) table, got {accuracies!r}")
    if any(not 0.0 <= float(a) <= 1.0 for r in acc for a in r):
        raise ValueError("accuracies must be probabilities in [0, 1]")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget (max_nodes) must be an int >= 1, got {budget!r}")
    return best_first_paths(acc, max_nodes=budget)


def expected_accept_length(paths: Sequence[Path_], accuracies: Sequence[Sequence[float]]) -> float:
    """Sum over nodes of prod_j accuracies[j][r_j]: the sparse tree's objective (independence model)."""
    return sum(math.prod(float(accuracies[d][r]) for d, r in enumerate(p)) for p in paths)


def check_threshold(threshold) -> float:
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    return float(threshold)


def _check_topk(top_tokens: torch.Tensor, top_probs: torch.Tensor, top_k: int) -> None:
    if top_tokens.ndim != 2 or top_probs.shape != top_tokens.shape:
        raise ValueError(f"top_tokens and top_probs must both be (num_heads, top_k), got {tuple(top_tokens.shape)} "
                         f"and {tuple(top_probs.shape)}")
    if top_tokens.shape[1] != top_k:
        raise ValueError(f"top_k={top_k} but the top-k lists have {top_tokens.shape[1]} entries")


def head_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heads' logits (H, V) -> (top tokens (H, k), their probabilities (H, k), entropies (H,)), softmax at T = 1."""
    logp = logits.float().log_softmax(-1)
    probs = logp.exp()
    ent = -(probs * logp).nan_to_num().sum(-1)  # 0 * log 0 = 0
    vals, idx = probs.topk(top_k, -1)
    return idx, vals, ent


# ---------------------------------------------------------------------------------------- drafter

@dataclass
class _Static:
    """A fixed node list with its index tensors, so a step only gathers tokens."""
    paths: tuple[Path_, ...]
    parents: torch.Tensor  # (N,)
    depth: torch.Tensor  # (N,)
    rank: torch.Tensor  # (N,)
    max_depth: int  # nodes on the longest path
    by_depth: dict = field(default_factory=dict)  # max depth -> _Static restricted to it (end of generation)


def _static(paths: list[Path_], device) -> _Static:
    index = {p: i for i, p in enumerate(paths)}
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return _Static(tuple(paths), t([index[p[:-1]] if len(p) > 1 else -1 for p in paths]),
                   t([len(p) - 1 for p in paths]), t([p[-1] for p in paths]), max(map(len, paths), default=0))


class MedusaDrafter(Drafter):
    """Heads on the state that predicted the pending token -> a candidate tree -> one verify pass.

    log: one dict per step (tree_size, depth, accepted, head_accepted[d] = depth d accepted, ranks of
    the accepted nodes) for the notebook's plots; `summary()` aggregates it.
    """
    name = "medusa"

    def __init__(self, runner, heads: MedusaHeads, num_heads: int | None = None, top_k: int = 4,
                 tree: str | Sequence[Sequence[int]] = "pruned", threshold: float | None = None,
                 max_nodes: int | None = None, prune: str = "confidence",
                 accuracies: Sequence[Sequence[float]] | None = None):
        self.runner, self.heads = runner, heads
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"heads must be MedusaHeads, a path or None, got {type(heads).__name__}")
        if heads.model_fingerprint != fingerprint(runner.model):
            raise ValueError("these Medusa heads were built for another model; train heads for this one")
        num_heads = heads.num_heads if num_heads is None else num_heads
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"branch (top_k: candidates per head) must be an int >= 1, got {top_k!r}")
        validate_tree_args(num_heads, top_k)
        if num_heads > heads.num_heads:
            raise ValueError(f"num_heads={num_heads} but the heads have only {heads.num_heads}")
        if top_k > heads.vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary ({heads.vocab_size} tokens)")
        self.num_heads, self.top_k, self.prune = num_heads, top_k, prune
        self.threshold = None if threshold is None else check_threshold(threshold)
        if max_nodes is not None and (not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1):
            raise ValueError(f"max_nodes must be an int >= 1 or None, got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.tree = tree if isinstance(tree, str) else "custom"
        if isinstance(tree, str) and tree not in TREES:
            raise ValueError(f"tree must be one of {TREES} or a list of rank paths, got {tree!r}")
        if self.tree != "pruned" and (threshold is not None or prune != "confidence"):
            raise ValueError("threshold and prune apply to tree='pruned' only")
        if self.tree in ("cartesian", "custom") and max_nodes is not None:
            raise ValueError("max_nodes applies to tree='pruned' (node budget) or 'sparse' (its size) only")
        dev = runner.device
        self.static: _Static | None = None
        if self.tree == "cartesian":
            self.static = _static(cartesian_paths(num_heads, top_k), dev)
        elif self.tree == "custom":
            self.static = _static(check_paths(tree, num_heads, top_k), dev)
        elif self.tree == "sparse":
            acc = accuracies if accuracies is not None else heads.accuracies
            if acc is None:
                raise ValueError("tree='sparse' needs measured per-rank head accuracies: pass accuracies=(H, k) "
                                 "or use heads trained by dvi_lite.methods.medusa.train (it stores them)")
            acc = [list(r)[:top_k] for r in list(acc)[:num_heads]]
            if len(acc) < num_heads or any(len(r) < top_k for r in acc):
                raise ValueError(f"accuracies cover fewer than num_heads={num_heads} heads x top_k={top_k} ranks")
            self.static = _static(sparse_tree(acc, max_nodes or 16), dev)
        else:
            if prune not in PRUNE_MODES:
                raise ValueError(f"prune must be one of {PRUNE_MODES}, got {prune!r}")
            if max_nodes is None and self.threshold is None:
                self.max_nodes = 16  # the default budget of an adaptive tree
            if self.max_nodes is None and cartesian_size(num_heads, top_k) > MAX_TREE_NODES:
                raise ValueError(f"tree='pruned' with num_heads={num_heads}, top_k={top_k} may exceed "
                                 f"{MAX_TREE_NODES} nodes: give max_nodes")
        if self.static is not None:
            self.max_draft = len(self.static.paths)  # cache room the engine reserves for one proposal
        else:
            self.max_draft = self.max_nodes or cartesian_size(num_heads, top_k)
        self.log: list[dict] = []
        self.h: torch.Tensor | None = None
        self._tree: CandidateTree | None = None

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
        depth = min(self.num_heads, state.remaining - 1)  # tokens after the pending one still wanted
        dev = state.device
        if depth <= 0:
            self._tree = None
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=dev))
        logits = self.heads(self.h[0, -1], depth)  # (depth, V): head d drafts tree depth d
        top_tokens, top_probs, ent = head_topk(logits, self.top_k)  # (depth, k), (depth, k), (depth,)
        if self.static is not None:
            s = self._static_for(depth)
            tree = CandidateTree(top_tokens[s.depth, s.rank], s.parents, s.paths)
        else:
            tree = pruned_tree(top_tokens, top_probs, self.threshold, self.prune, self.max_nodes,
                               ent if self.prune == "entropy" else None)
        self._tree = tree
        if len(tree) == 0:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=dev))
        return Proposal(tree.tokens, None, tree.parents)  # q = None: greedy, or point masses when sampling

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        self.h = outcome.hidden[:, -1:]  # the state at the last accepted token: it predicted next_token
        tree, n = self._tree, outcome.n_accepted
        depth = tree.depth if tree is not None else 0
        self.log.append({"tree_size": len(tree) if tree is not None else 0, "depth": depth, "accepted": n,
                         "head_accepted": [d < n for d in range(depth)],
                         "ranks": [tree.paths[i][-1] for i in outcome.path] if tree is not None else []})

    def summary(self) -> dict:
        return medusa_summary(self.log, self.num_heads, self.top_k)


def medusa_summary(log: list[dict], num_heads: int, top_k: int) -> dict:
    """Aggregates of MedusaDrafter.log: mean tree size, tau, per-head acceptance, rank hits.

    head_acceptance[d]: P(depth d accepted | the tree reached depth d) — what head d contributes.
    head_acceptance_given_previous[d]: the same, given depth d-1 was accepted (the engine's
    position_acceptance). rank_hits[d][r]: how often the accepted depth-d token was head d's rank r
    (divide by steps to get the per-rank accuracies a sparse tree is built from).
    """
    steps = len(log)
    reached = [sum(1 for s in log if s["depth"] > d) for d in range(num_heads)]
    acc = [sum(1 for s in log if s["accepted"] > d) for d in range(num_heads)]
    prev = [sum(1 for s in log if s["depth"] > d and s["accepted"] >= d) for d in range(num_heads)]
    hits = [[0] * top_k for _ in range(num_heads)]
    for s in log:
        for d, r in enumerate(s["ranks"]):
            hits[d][r] += 1
    return {"steps": steps,
            "mean_tree_size": sum(s["tree_size"] for s in log) / steps if steps else 0.0,
            "tau": sum(s["accepted"] + 1 for s in log) / steps if steps else None,
            "head_acceptance": [a / r if r else 0.0 for a, r in zip(acc, reached)],
            "head_acceptance_given_previous": [a / p if p else 0.0 for a, p in zip(acc, prev)],
            "rank_hits": hits}


def make_drafter(model, tokenizer, heads=None, num_heads: int | None = None, branch: int = 4, tree="pruned",
            threshold: float | None = None, max_nodes: int | None = None, prune: str = "confidence",
            accuracies=None):
    """Medusa heads (None: data/medusa/heads.pt) draft a tree from each head's top-`branch` tokens:
    'cartesian' (all combinations), 'pruned' (best max_nodes=16 by path probability, optional
    threshold, prune = confidence|path|entropy), 'sparse' (fixed, from measured accuracies,
    max_nodes=16) or a list of rank paths; lossless under greedy and sampling. (`branch` is the heads'
    top-k: generate()'s own top_k is the sampler's.)"""
    r = Runner.for_model(model)
    if heads is None or isinstance(heads, (str, Path)):
        heads = load_heads(model, heads)
    return MedusaDrafter(r, heads, num_heads, branch, tree, threshold, max_nodes, prune, accuracies)
