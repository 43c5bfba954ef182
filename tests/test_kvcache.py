"""dvi_lite.core.kvcache: append, O(1) crop, keep (chain prefix and tree path gather), overflow."""
from __future__ import annotations

import pytest
import torch

from dvi_lite.core.kvcache import KVCache

L, H, D = 3, 2, 4


def _kv(start: int, n: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, H, n, D) keys/values whose every entry encodes (layer, position): easy to track moves."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    k = (100 * layer + pos)[None, None, :, None].expand(1, H, n, D).clone()
    return k, -k


def _fill(cache: KVCache, n: int) -> None:
    for layer in range(L):
        cache.update(*_kv(0, n, layer), layer)


def _positions(cache: KVCache, layer: int) -> list[int]:
    k, v = cache.layer(layer)
    assert torch.equal(v, -k)
    return (k[0, 0, :, 0] - 100 * layer).long().tolist()


def test_update_appends_and_returns_whole_views():
    c = KVCache(L, H, D, max_len=10)
    assert len(c) == 0 and c.lens == [0, 0, 0]
    k, v = c.update(*_kv(0, 4), 0)
    assert k.shape == (1, H, 4, D) and v.shape == (1, H, 4, D)
    k, v = c.update(*_kv(4, 2), 0)
    assert k.shape == (1, H, 6, D)
    assert _positions(c, 0) == [0, 1, 2, 3, 4, 5]
    assert c.lens == [6, 0, 0]  # per-layer lengths (len() of uneven layers is not pinned down here)
    assert c.layer(1)[0].shape == (1, H, 0, D)
    for layer in (1, 2):
        c.update(*_kv(0, 6, layer), layer)
    assert len(c) == 6


def test_crop_only_shortens():
    c = KVCache(L, H, D, max_len=10)
    _fill(c, 6)
    c.crop(4)
    assert c.lens == [4, 4, 4] and _positions(c, 2) == [0, 1, 2, 3]
    c.crop(8)  # never grows
    assert c.lens == [4, 4, 4]
    c.crop(2, layers=range(1, 3))
    assert c.lens == [4, 2, 2]
    c.update(*_kv(2, 1, 1), 1)  # appending after a crop overwrites the dropped positions
    assert _positions(c, 1) == [0, 1, 2]


def test_keep_chain_prefix_is_a_crop():
    c = KVCache(L, H, D, max_len=10)
    _fill(c, 8)
    c.keep(5, torch.tensor([0, 1]))
    assert c.lens == [7] * L
    for layer in range(L):
        assert _positions(c, layer) == [0, 1, 2, 3, 4, 5, 6]


def test_keep_non_prefix_moves_the_kept_positions():
    c = KVCache(L, H, D, max_len=10)
    _fill(c, 9)  # prefix 0..3, then 5 tree nodes at 4..8
    c.keep(4, torch.tensor([0, 2, 4]))  # root (pos 4), node 2 (pos 6), node 4 (pos 8)
    assert c.lens == [7] * L
    for layer in range(L):
        assert _positions(c, layer) == [0, 1, 2, 3, 4, 6, 8]


def test_keep_handles_overlapping_moves_and_empty_paths():
    c = KVCache(L, H, D, max_len=10)
    _fill(c, 8)
    c.keep(2, torch.tensor([1, 2, 5]))  # sources 3, 4, 7 -> targets 2, 3, 4 (overlapping ranges)
    assert _positions(c, 0) == [0, 1, 3, 4, 7]
    c.keep(3, torch.empty(0, dtype=torch.long))
    assert c.lens == [3] * L and _positions(c, 1) == [0, 1, 3]


def test_exceeding_max_len_raises():
    c = KVCache(L, H, D, max_len=5)
    c.update(*_kv(0, 4), 0)
    with pytest.raises(RuntimeError, match="max_len"):
        c.update(*_kv(4, 2), 0)
    assert c.lens[0] == 4  # nothing was written
    c.update(*_kv(4, 1), 0)  # exactly full is fine
    assert c.lens[0] == 5


def test_for_model_shapes(target):
    cfg = target.config
    c = KVCache.for_model(target, 17)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert c.k.shape == (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 17, head_dim)
    assert c.k.dtype == torch.float32 and c.max_len == 17
