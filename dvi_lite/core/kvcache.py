"""A preallocated KV cache with O(1) rollback, shared by every method.

Why our own: speculative decoding appends K+1 positions, then throws away the rejected ones, every
step. With a preallocated buffer, "throw away" is setting a length (no copy, no realloc), and a tree
keeps its accepted path with one gather. Each layer has its own length because self-speculative
drafters (Kangaroo, Draft & Verify) write only the layers they run.

It duck-types the one method HF attention modules call: `update(k, v, layer_idx) -> (k_all, v_all)`.
"""
from __future__ import annotations

import torch


def kv_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of a Llama-family config: GQA models have fewer KV heads than query heads."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim


def kv_bytes(config, positions: int, element_size: int, n_layers: int | None = None) -> int:
    """Bytes a K and V cache holds for `positions` positions in every layer."""
    n_kv, head_dim = kv_shape(config)
    return 2 * (n_layers or config.num_hidden_layers) * n_kv * head_dim * positions * element_size


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (n_layers, 1, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, 1, H, Tmax, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = [0] * n_layers
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, max_len: int, n_layers: int | None = None) -> "KVCache":
        """A cache shaped for `model`'s attention (n_layers=1: e.g. a Kangaroo adapter's own cache)."""
        cfg = model.config
        n_kv, head_dim = kv_shape(cfg)
        p = next(model.parameters())
        return cls(n_layers or cfg.num_hidden_layers, n_kv, head_dim, max_len, p.dtype, p.device)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append k, v (1, H, n, D) to one layer; return that layer's whole (1, H, T, D) views."""
        start = self.lens[layer_idx]
        end = start + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} positions > max_len {self.max_len}")
        self.k[layer_idx, :, :, start:end] = k
        self.v[layer_idx, :, :, start:end] = v
        self.lens[layer_idx] = end
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def __len__(self) -> int:
        """Committed length = the shortest layer. Drafters may write extra (draft) positions into
        the layers they run, never fewer than the committed ones, so the minimum is what every
        layer agrees on."""
        return min(self.lens)

    def crop(self, length: int, layers: range | None = None) -> None:
        """Roll back to the first `length` positions (O(1): only lengths change)."""
        for i in layers if layers is not None else range(len(self.lens)):
            self.lens[i] = min(self.lens[i], length)

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions [0, start) plus start+idx (in order): a tree's accepted path."""
        if idx.numel() and torch.equal(idx, torch.arange(idx.numel(), device=idx.device)):
            self.crop(start + idx.numel())  # a chain prefix: no copy needed
            return
        src = start + idx
        n = idx.numel()
        self.k[:, :, :, start : start + n] = self.k[:, :, :, src]
        self.v[:, :, :, start : start + n] = self.v[:, :, :, src]
        self.crop(start + n)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's live (1, H, T, D) keys and values (for tests and inspection)."""
        return self.k[i, :, :, : self.lens[i]], self.v[i, :, :, : self.lens[i]]
