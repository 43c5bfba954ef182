"""Run a Llama-family HF model layer by layer: the one forward every method uses.

Why not `model(...)`: the methods need to stop after layer k (Kangaroo, DVI), skip attention or MLP
sub-layers (Draft & Verify), start from hidden states at layer k (self-speculative verification),
attend along a tree (Medusa) and read hidden states (Medusa heads). Calling the model's own modules
(`self_attn`, `mlp`, norms, rotary embedding) keeps the arithmetic identical to HF's, so greedy
tokens match `model.generate` exactly, while we own the mask, the positions and the cache.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dvi_lite.core.kvcache import KVCache


def chain_mask(n: int, past: int, device) -> torch.Tensor | None:
    """Causal mask for n new positions after `past` cached ones, (1, 1, n, past + n) bool (True = attend).

    None when n == 1 (one query sees everything) or past == 0 (sdpa's own causal path, as HF does).
    """
    if n == 1 or past == 0:
        return None
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(past + n, device=device)[None, :]
    return (k <= past + q)[None, None]


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """(n, n) bool, A[i, j] = node j is node i or one of its ancestors. parents[i] < i, -1 = root child."""
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    par = parents.tolist()
    for i in range(n):  # parents come first, so each row = own bit | parent's row
        if par[i] >= 0:
            anc[i] |= anc[par[i]]
    return anc


def tree_mask(parents: torch.Tensor, past: int) -> torch.Tensor:
    """(1, 1, n, past + n) bool: every node sees the cache and its own ancestors only."""
    anc = ancestor_matrix(parents)
    ctx = torch.ones(anc.shape[0], past, dtype=torch.bool, device=parents.device)
    return torch.cat([ctx, anc], dim=1)[None, None]


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """(n,) long: each node's depth, 0 for children of the cached prefix (parents[i] < i, -1 = root child)."""
    depth = [0] * parents.numel()
    for i, p in enumerate(parents.tolist()):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return torch.tensor(depth, dtype=torch.long, device=parents.device)


@dataclass
class Skip:
    """Which sub-layers to skip (Draft & Verify): sets of layer indices."""
    attn: frozenset = frozenset()
    mlp: frozenset = frozenset()


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its Runner (dies with the model)


class Runner:
    """Thin, stateless driver over an HF `*ForCausalLM` (Llama family)."""

    @classmethod
    def for_model(cls, model) -> "Runner":
        """The model's runner, built once: the layer handles are looked up on first use only."""
        r = _RUNNERS.get(model)
        if r is None:
            r = _RUNNERS[model] = cls(model)
        return r

    def __init__(self, model):
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl != "sdpa":  # our masks are boolean / None-means-causal, which only sdpa reads that way
            raise ValueError(f"model must use attn_implementation='sdpa' (got {impl!r}); load it with "
                             "from_pretrained(..., attn_implementation='sdpa') or dvi_lite.load_model")
        self.model = model
        base = model.model
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self.n_layers = len(self.layers)
        self.device = self.lm_head.weight.device

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.for_model(self.model, max_len)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # (1, n) -> (1, n, D)

    def layers_forward(self, h: torch.Tensor, cache: KVCache | None, positions: torch.Tensor,
                       start: int = 0, end: int | None = None, parents: torch.Tensor | None = None,
                       skip: Skip | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run layers [start, end) on h (1, n, D) at `positions` (1, n); append their KV to `cache`.

        parents: None = the n positions form a chain; else a tree (parents[i] < i, -1 = child of the
        cached prefix). The mask is built per distinct past length, since layers may differ there.
        mask: an explicit (1, 1, n, past + n) mask for every layer run (the caller guarantees they all
        hold `past` positions), e.g. the rows of a tree whose first nodes are already cached.
        """
        end = self.n_layers if end is None else end
        n = h.shape[1]
        pe = self.rotary(h, positions)
        masks: dict[int, torch.Tensor | None] = {}
        for i in range(start, end):
            layer = self.layers[i]
            if skip is None or i not in skip.attn:
                past = cache.lens[i] if cache is not None else 0
                if mask is not None:
                    masks[past] = mask
                elif past not in masks:
                    masks[past] = chain_mask(n, past, h.device) if parents is None else tree_mask(parents, past)
                a, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=pe,
                                       attention_mask=masks[past], past_key_values=cache)
                h = h + a
            if skip is None or i not in skip.mlp:
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (1, n, D) -> (1, n, V)."""
        return self.lm_head(self.norm(h))

    def positions(self, cache: KVCache | None, n: int, parents: torch.Tensor | None = None,
                  layer: int = 0) -> torch.Tensor:
        """Position ids (1, n): cache length + offset (chain) or + depth (tree)."""
        past = cache.lens[layer] if cache is not None else 0
        off = torch.arange(n, device=self.device) if parents is None else tree_depths(parents)
        return (past + off)[None]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: KVCache | None, parents: torch.Tensor | None = None,
                skip: Skip | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Full model on new token ids (1, n): returns (logits (1, n, V), final pre-norm hidden (1, n, D))."""
        h = self.layers_forward(self.embed(ids), cache, self.positions(cache, ids.shape[1], parents),
                                parents=parents, skip=skip)
        return self.logits(h), h
