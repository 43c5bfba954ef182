"""The training loop's shared pieces: the config, the learning-rate schedule, batching and the encoded corpus.

The course model's trainer (course_model.train) and every method's recipe (kangaroo, medusa, eagle, dvi) train
with these: a TrainConfig, warm-up then cosine to a floor (lr_at), random windows of a token stream (batch), and
the course corpus encoded once per process (encode_split).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from dvi_lite.models.corpus import CORPUS_DIR, load_docs
from dvi_lite.models.tokenizer import EOS
from dvi_lite.paths import BUILD_DIR, DATA_DIR, atomic_write_bytes


@dataclass
class TrainConfig:
    out_dir: str = str(DATA_DIR / "course_model")  # where the HF folder is written
    n_layer: int = 12  # deep enough for layer-wise methods (exit layers, skipping)
    d_model: int = 256  # hidden size
    n_head: int = 8  # query heads (head_dim = d_model / n_head)
    n_kv_head: int = 4  # key/value heads: GQA, so the code paths real Llama/Qwen models use are exercised
    d_ff: int = 704  # SwiGLU intermediate size (~2.75 d)
    vocab_size: int = 8192  # BPE vocabulary (byte-level)
    max_pos: int = 512  # RoPE context the model is configured for
    seq_len: int = 256  # training window
    batch_size: int = 16  # windows per step
    steps: int = 900  # optimiser steps (tokens seen = steps * batch_size * seq_len)
    lr: float = 2e-3  # peak learning rate
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac, never to zero
    warmup: int = 60  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    grad_clip: float = 1.0  # global norm clip
    eval_every: int = 100  # steps between val-loss estimates
    eval_batches: int = 8  # windows per domain per val estimate
    ckpt_every_s: float = 300.0  # seconds between checkpoints (resume with --resume)
    seed: int = 1234  # one seed for init, data order and sampling
    threads: int = 0  # torch threads (0 = torch default)
    extra: dict = field(default_factory=dict)


_ENCODED: dict = {}  # (tokenizer path, vocab size, split, domain) -> stream: encode each split once per process


def encode_split(tok: PreTrainedTokenizerFast, split: str, domain: str | None = None) -> np.ndarray:
    """One flat uint16 token stream, documents separated by EOS: cached per process, and on disk under build/ keyed
    by the tokenizer's vocabulary and the corpus files' bytes (encoding the train split takes seconds, and every
    notebook kernel and test worker needs it)."""
    key = (tok.name_or_path, len(tok), split, domain)
    if key not in _ENCODED:
        _ENCODED[key] = _cached_on_disk(tok, split, domain)
    return _ENCODED[key]


def _cached_on_disk(tok: PreTrainedTokenizerFast, split: str, domain: str | None) -> np.ndarray:
    h = hashlib.sha256(json.dumps([tok.backend_tokenizer.to_str(), split, domain]).encode())
    for f in sorted(CORPUS_DIR.glob("*.jsonl.xz")):
        h.update(f.read_bytes())
    path = BUILD_DIR / "cache" / f"encoded_{h.hexdigest()[:16]}.npy"
    if path.is_file():
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError):  # a torn file: encode again below
            pass
    ids = _encode_split(tok, split, domain)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())
    return ids


def _encode_split(tok: PreTrainedTokenizerFast, split: str, domain: str | None) -> np.ndarray:
    eos = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    texts = [d.text for d in load_docs(split, domain)]
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [eos]
    return np.asarray(ids, dtype=np.uint16)


def batch(data: np.ndarray, cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i : i + cfg.seq_len].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + cfg.seq_len].astype(np.int64)) for i in ix])
    return x, y  # (B, T), (B, T)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Warm-up, then cosine to a non-zero floor (Gorgon's lesson: never decay to zero)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
