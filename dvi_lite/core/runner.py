"""Run a Llama-family HF model layer by layer: the one forward every method uses.

Why not `model(...)`: the methods need to stop after layer k (Kangaroo, DVI), skip attention or MLP
sub-layers (Draft & Verify), start from hidden states at layer k (self-speculative verification),
attend along a tree (Medusa) and read hidden states (Medusa heads). Calling the model's own modules
(`self_attn`, `mlp`, norms, rotary embedding) keeps the arithmetic identical to HF's, so greedy
tokens match `model.generate` exactly, while we own the mask, the positions and the cache.

Tree attention has two backends (`Runner(model, attention=...)`): "sdpa", the reference, gives every
layer a dense (n, past + n) bool mask; "triton" hands the tree's parent array to a mask-free Triton
kernel instead, through transformers' AttentionInterface, so the model's own attention module still
computes q, k, v, the rotary embedding and the output projection. Chains use sdpa under both.
"""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

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


ATTENTION = ("sdpa", "triton")  # how a tree is attended: dense mask + sdpa (the reference), or the Triton kernel
# The kernel lives with Medusa, which brought tree attention. It is named by a string, as the registry names
# factories, so the core imports no method module and triton is imported only when "triton" is asked for.
_TREE_KERNELS = {"triton": "dvi_lite.methods.medusa.tree_attention:triton_kernel_for"}
HF_TREE_ATTENTION = "dvi_lite_tree"  # the name of `hf_tree_attention` in transformers' AttentionInterface


def hf_tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      dropout: float = 0.0, scaling: float | None = None, tree_attend: Callable | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """An HF attention function: the n new positions are a tree, attended by `tree_attend` (the kernel
    prepared for this tree's parents) instead of sdpa with a mask.

    HF attention modules (LlamaAttention and kin) call it after `KVCache.update`, passing on the extra
    kwargs the runner gave them: query (1, H, n, D); key/value (1, Hkv, past + n, D), the layer's cached
    past followed by the n new nodes. The kernel maps GQA heads itself (query head h reads kv head
    h // (H / Hkv), as HF's repeat_kv does). Returns HF's layout: (1, n, H, D) and no weights.
    """
    n = query.shape[2]
    past = key.shape[2] - n
    out = tree_attend(query, key[:, :, :past], value[:, :, :past], key[:, :, past:], value[:, :, past:],
                      scaling)  # (1, H, n, D)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _attention_implementation(configs: list, name: str) -> Iterator[None]:
    """HF attention modules pick their attention function by `config._attn_implementation`: set it for
    one forward, then restore it (not thread-safe: no two threads may share a model here)."""
    old = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, o in zip(configs, old, strict=True):
            c._attn_implementation = o


_CACHE_ATTR = "_dvi_lite_runners"  # {attention: Runner} kept in the model's own __dict__


class Runner:
    """Thin, stateless driver over an HF `*ForCausalLM` (Llama family).

    attention: how trees (`parents` given) are attended, one of ATTENTION. "sdpa" (default) is the
    reference; "triton" runs the Triton tree kernel (CUDA; on CPU only under Triton's interpreter,
    TRITON_INTERPRET=1 set before the kernel is first defined: for correctness tests, not speed).
    """

    @classmethod
    def for_model(cls, model, attention: str = "sdpa") -> "Runner":
        """The model's runner for `attention`, built once: the layer handles are looked up on first use only."""
        # Kept on the model itself, not in a module-level map: model -> runner -> model is a plain reference
        # cycle, so the garbage collector frees both once the caller drops the model (a weak-keyed map would
        # not: its value, the runner, keeps the key alive).
        per = model.__dict__.setdefault(_CACHE_ATTR, {})
        r = per.get(attention)
        if r is None:
            r = per[attention] = cls(model, attention)
        return r

    def __init__(self, model, attention: str = "sdpa"):
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl != "sdpa":  # our masks are boolean / None-means-causal, which only sdpa reads that way
            raise ValueError(f"model must use attn_implementation='sdpa' (got {impl!r}); load it with "
                             "from_pretrained(..., attn_implementation='sdpa') or dvi_lite.load_model")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {list(ATTENTION)}, got {attention!r}")
        self.model = model
        self.attention = attention
        base = model.model
        if model.lm_head.weight.device.type == "cpu":
            # HF repeats K and V for every query head whenever a mask is given (every verify of n >= 2) unless told
            # that sdpa takes GQA masked: it does on CPU, with bit-identical logits. Read by transformers per call;
            # a value the user set is kept. (On CUDA masked GQA would fall back to sdpa's math kernel: not set.)
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self.n_layers = len(self.layers)
        self.device = self.lm_head.weight.device
        # tree_kernel(parents) -> attend(q, k_cache, v_cache, k_new, v_new, scale) -> (1, H, n, D); None = sdpa
        self.tree_kernel: Callable | None = None
        if attention != "sdpa":
            module, fn = _TREE_KERNELS[attention].split(":")
            self.tree_kernel = getattr(importlib.import_module(module), fn)(self.device)  # raises if it cannot run
            from transformers import AttentionInterface

            AttentionInterface.register(HF_TREE_ATTENTION, hf_tree_attention)
            self._attn_configs = list({id(layer.self_attn.config): layer.self_attn.config
                                       for layer in self.layers}.values())

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.for_model(self.model, max_len)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # (1, n) -> (1, n, D)

    def layers_forward(self, h: torch.Tensor, cache: KVCache | None, positions: torch.Tensor,
                       start: int = 0, end: int | None = None, parents: torch.Tensor | None = None,
                       skip: Skip | None = None, mask: torch.Tensor | None = None,
                       capture: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Run layers [start, end) on h (1, n, D) at `positions` (1, n); append their KV to `cache`.

        parents: None = the n positions form a chain; else a tree (parents[i] < i, -1 = child of the
        cached prefix). The mask is built per distinct past length, since layers may differ there.
        mask: an explicit (1, 1, n, past + n) mask for every layer run (the caller guarantees they all
        hold `past` positions), e.g. the rows of a tree whose first nodes are already cached.
        A tree with no explicit mask goes through the Triton kernel when this runner's attention is "triton".
        capture: {k: None, ...} to fill in place with the state after k layers (1, n, D), for every k in
        [start, end] it names (EAGLE's fused features); other keys are left as they are. None: nothing kept.
        """
        end = self.n_layers if end is None else end
        if capture is not None and start in capture:
            capture[start] = h
        n = h.shape[1]
        pe = self.position_table(h, positions)
        masks: dict[int, torch.Tensor | None] = {}
        kernel = parents is not None and mask is None and self.tree_kernel is not None
        extra = {"tree_attend": self.tree_kernel(parents)} if kernel else {}  # to hf_tree_attention, via the module
        with _attention_implementation(self._attn_configs, HF_TREE_ATTENTION) if kernel else nullcontext():
            for i in range(start, end):
                if skip is None or i not in skip.attn:
                    past = cache.lens[i] if cache is not None else 0
                    if kernel:
                        masks[past] = None  # the kernel reads `parents`, no mask
                    elif mask is not None:
                        masks[past] = mask
                    elif past not in masks:
                        masks[past] = chain_mask(n, past, h.device) if parents is None else tree_mask(parents, past)
                    h = h + self.attn_block(i, h, cache, pe, masks[past], extra)
                if skip is None or i not in skip.mlp:
                    h = h + self.mlp_block(i, h)
                if capture is not None and i + 1 in capture:
                    capture[i + 1] = h  # h is rebound, never written in place: the kept tensor stays as it is
        return h

    # The three pieces of a layer stack that a runtime replaces (core.lean): the loop above stays one loop.
    def position_table(self, h: torch.Tensor, positions: torch.Tensor):
        """What attention rotates by at `positions` (1, n): the model's rotary (cos, sin)."""
        return self.rotary(h, positions)

    def attn_block(self, i: int, h: torch.Tensor, cache, pe, mask: torch.Tensor | None, extra: dict) -> torch.Tensor:
        """Layer i's attention on its normed input: (1, n, D) -> the residual update (1, n, D); appends K, V."""
        layer = self.layers[i]
        a, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=pe, attention_mask=mask,
                               past_key_values=cache, **extra)
        return a

    def mlp_block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP on its normed input: (1, n, D) -> the residual update (1, n, D)."""
        layer = self.layers[i]
        return layer.mlp(layer.post_attention_layernorm(h))

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
