"""A trimmed-vocabulary draft head (FR-Spec; EAGLE-3's d2t map): the draft scores only the N most frequent tokens.

Why: the LM head is a (V, D) matrix read at every draft step; on a small model with a large vocabulary it is a
big share of the draft's cost. Most text uses few tokens, so a head over the N tokens most frequent on a
corpus keeps nearly every draft the full head would have made, for N/V of the head's cost.

How: the map is the N token ids (int32), most frequent first, counted on the course corpus with the model's
own tokenizer (`count_tokens`, `build_vocab_map`). `TrimmedHead` selects those N rows of the head weight
once, (N, D), computes (..., N) logits and scatters them into the full vocabulary with -inf elsewhere, so the
draft's q is exactly 0 outside the map. Verification still runs the model's full head, so acceptance and the
output law are untouched: lossless, whatever N (a token outside the map is simply never drafted).

Files: `artifacts_dir(model)/vocab/top<N>.pt` ({"ids": int32 (N,), "vocab_size", "n"}) plus a card
top<N>.json (coverage on the corpus, tokens counted, tokenizer, provenance). The drafters' option `vocab`:
None = the full head; an int N = this model's top-N map (counted and saved on first use); a path = a saved map;
a sequence / tensor of ids = that map. Loaded heads are cached per model (models.artifacts.load_cached).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dvi_lite.core.checks import check_int, is_int
from dvi_lite.models.artifacts import artifacts_dir, fingerprint, load_cached
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import load_torch


def _base(linear: nn.Module) -> nn.Module:
    """The plain nn.Linear under a peft wrapper (or the module itself)."""
    return linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear


def head_vocab_size(model) -> int:
    return _base(model.get_output_embeddings()).weight.shape[0]


# ---------------------------------------------------------------------------------------------- counting

def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int, batch: int = 256) -> torch.Tensor:
    """Token frequencies (vocab_size,) int64 of `texts` tokenized by `tokenizer` (no special tokens)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    texts = list(texts)
    for i in range(0, len(texts), batch):
        for ids in tokenizer(texts[i: i + batch], add_special_tokens=False)["input_ids"]:
            if ids:
                counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def corpus_texts(split: str = "train") -> list[str]:
    """The course corpus (dvi_lite.models.corpus), one text per document: what every map is counted on."""
    from dvi_lite.models.corpus import load_docs

    return [d.text for d in load_docs(split)]


def top_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent ids, most frequent first (ties: lower id first), int32 (n,)."""
    order = np.lexsort((np.arange(counts.numel()), -counts.numpy()))  # stable: by count desc, then id
    return torch.from_numpy(order[:n].astype(np.int32))


def vocab_map_path(model, n: int) -> Path:
    return artifacts_dir(model) / "vocab" / f"top{n}.pt"


def save_vocab_map(ids: torch.Tensor, model, path: str | Path, card: dict | None = None) -> Path:
    """The map (int32 ids, most frequent first) and, if given, its card (path with .json)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.as_tensor(ids).to(torch.int32).cpu()
    body = {"ids": ids, "n": int(ids.numel()), "vocab_size": head_vocab_size(model), "fingerprint": fingerprint(model)}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(body, tmp)
    os.replace(tmp, path)
    if card is not None:
        atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2) + "\n")
    return path


def build_vocab_map(model, tokenizer, n: int, texts: Sequence[str] | None = None, path: str | Path | None = None,
                    command: str = "", answers: torch.Tensor | None = None) -> Path:
    """Count the corpus (default: the course corpus' train split) with the model's tokenizer; save the top-n map.

    answers: token ids the model itself wrote (e.g. the teacher data's rows, padding removed). They are what a
    draft must propose on chat questions, and a corpus of code and prose misses many of their tokens, so their
    frequencies are mixed in with the same weight as the corpus' (each normalised to sum to one).
    The card records how much of the counted text the map covers (overall, and of the answers).
    """
    v = head_vocab_size(model)
    n = check_int("vocab (trimmed head size N)", n, 1, v)
    if tokenizer is None:
        raise ValueError(f"vocab={n}: counting the corpus needs the model's tokenizer (got None); or pass a "
                         "saved map's path")
    counts = count_tokens(tokenizer, corpus_texts() if texts is None else texts, v)
    own = None if answers is None else torch.bincount(torch.as_tensor(answers).long().flatten(), minlength=v)[:v]
    mixed = counts.double() / max(1, int(counts.sum()))
    if own is not None:
        mixed = mixed + own.double() / max(1, int(own.sum()))
    ids = top_ids(mixed, n)
    total = int(counts.sum())
    from dvi_lite.measure.provenance import provenance  # lazy: provenance reads git and the environment

    card = {"n": n, "vocab_size": v, "coverage": float(counts[ids.long()].sum()) / total if total else None,
            "answers_coverage": None if own is None else float(own[ids.long()].sum()) / max(1, int(own.sum())),
            "answer_tokens_counted": None if own is None else int(own.sum()),
            "tokens_counted": total, "corpus": "course corpus, train split" if texts is None else "given texts",
            "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
            "provenance": provenance(command or None)}
    return save_vocab_map(ids, model, vocab_map_path(model, n) if path is None else path, card)


def load_vocab_ids(model, path: str | Path) -> torch.Tensor:
    """A saved map's ids (N,) int64, checked against the model's vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no vocabulary map at {path}; build one with "
                                "dvi_lite.models.vocab.build_vocab_map(model, tokenizer, n) (or pass vocab=<int>)")
    body = load_torch(path, "vocabulary map", keys=("ids", "vocab_size"))
    if body["vocab_size"] != head_vocab_size(model):
        raise ValueError(f"vocabulary map {path} is for a vocabulary of {body['vocab_size']} tokens; this model has "
                         f"{head_vocab_size(model)}")
    return check_ids(body["ids"], head_vocab_size(model))


def check_ids(ids: Any, v: int) -> torch.Tensor:
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"vocab ids must be a non-empty list of token ids, got {ids.dtype} with {ids.numel()}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= v or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"vocab ids must be distinct token ids in [0, {v})")
    return ids


# ---------------------------------------------------------------------------------------------- the head

class TrimmedHead:
    """The model's LM head restricted to `ids`: (..., D) normalised states -> (..., V) logits, -inf off the map.

    The (N, D) rows are selected once (a copy: N * D extra values, what `numel` reports); the model's head
    itself is untouched and still verifies on the full vocabulary.
    """

    def __init__(self, lm_head: nn.Module, ids: torch.Tensor):
        head = _base(lm_head)
        w = head.weight
        self.vocab_size = w.shape[0]
        self.ids = check_ids(ids, self.vocab_size).to(w.device)  # (N,)
        self.weight = w.detach().index_select(0, self.ids)  # (N, D)
        self.bias = None if head.bias is None else head.bias.detach().index_select(0, self.ids)  # (N,)

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def numel(self) -> int:
        """Values this head adds to the model: its selected rows (and bias)."""
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def small(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., N): logits of the map's tokens only (the cheap part)."""
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def expand(self, small: torch.Tensor) -> torch.Tensor:
        """(..., N) -> (..., V): scattered into the full vocabulary, -inf outside the map (q = 0 there)."""
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids] = small
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(self.small(x))


def resolve_vocab(model, tokenizer, vocab: Any) -> TrimmedHead | None:
    """The drafters' `vocab` option -> a TrimmedHead for this model (None: the full head).

    vocab: None; an int N (this model's top-N map, counted on the course corpus with `tokenizer` and saved on
    first use); a path to a saved map; or a sequence / tensor of token ids.
    """
    if vocab is None:
        return None
    lm_head = model.get_output_embeddings()
    v = head_vocab_size(model)
    if is_int(vocab):
        n = check_int("vocab (trimmed head size N)", vocab, 1, v)
        path = vocab_map_path(model, n)
        if not path.is_file():
            build_vocab_map(model, tokenizer, n, path=path)
        return load_cached("vocab_head", model, path, lambda: TrimmedHead(lm_head, load_vocab_ids(model, path)))
    if isinstance(vocab, (str, bytes)) or hasattr(vocab, "__fspath__"):
        path = Path(os.fsdecode(vocab))
        return load_cached("vocab_head", model, path, lambda: TrimmedHead(lm_head, load_vocab_ids(model, path)))
    if isinstance(vocab, TrimmedHead):
        if vocab.vocab_size != v:
            raise ValueError(f"the given TrimmedHead is for a vocabulary of {vocab.vocab_size}; this model has {v}")
        return vocab
    if isinstance(vocab, (torch.Tensor, Sequence, np.ndarray)) and not isinstance(vocab, bool):
        return TrimmedHead(lm_head, check_ids(vocab, v))
    raise ValueError(f"vocab must be None, an int N (the N most frequent tokens), a saved map's path or a list of "
                     f"token ids, got {vocab!r}")
