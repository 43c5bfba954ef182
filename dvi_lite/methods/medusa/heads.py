"""Medusa heads (Cai et al. 2024): extra decoding heads on the target's last hidden state.

The offset convention (one convention, used by the heads, the training and the drafter):

    h_t = the final *pre-norm* hidden state at position t (input token x_t). The model itself reads it
          to predict x_{t+1}: p_t = softmax(lm_head(norm(h_t))).
    head i (i = 0 .. H-1) reads the same h_t and predicts x_{t+2+i}: q_i = softmax(head_i(h_t)).

So head 0 predicts the token *after next*; the model predicts the next one itself.

A head (Medusa-1 §2.1.1, with Project Gorgon's fix): a frozen copy of the model's final RMSNorm, a
residual block x + SiLU(W x + b) with W = b = 0, and an LM head initialised from the model's. At
initialisation every head therefore predicts exactly the model's own next-token distribution, and
training only learns the shift. Without the norm the LM head reads states far larger than it was
trained on, so its logits are much too sharp (notebook 04 shows the lesson).

LM head: by default each head owns a trainable copy (Medusa-1: the token two ahead has another
distribution, and a copy can move it). `shared_lm_head=True` reuses the model's frozen head instead:
far fewer parameters, and drafting reads the vocabulary projection once for all heads, which is what
decode speed on a CPU is bound by.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from dvi_lite.core.checks import check_int
from dvi_lite.models.artifacts import artifacts_dir, fingerprint, load_cached, save_piece
from dvi_lite.paths import DATA_DIR, atomic_write_text
from dvi_lite.safety import load_torch

HEADS_DIR = DATA_DIR / "medusa"
HEADS_PATH = HEADS_DIR / "heads.pt"
TRAIN_COMMAND = "python -m dvi_lite medusa-train"


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
        check_int("num_heads", num_heads, 1)
        head = model.get_output_embeddings()
        dim, vocab = head.weight.shape[1], head.weight.shape[0]
        self.num_heads, self.use_norm, self.shared_lm_head = num_heads, bool(norm), bool(shared_lm_head)
        self.hidden_size, self.vocab_size = dim, vocab
        self.model_fingerprint = fingerprint(model)
        self.accuracies: list[list[float]] | None = None  # measured (H, branch) rank accuracies (sparse trees)
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


    def small(self, h: torch.Tensor, n: int, vocab) -> torch.Tensor:
        """The first n heads' logits on a trimmed vocabulary's ids only (a models.vocab.TrimmedHead): (..., D) ->
        (n, ..., N). Through the shared head that is one (N, D) matmul instead of the full (V, D) one."""
        if self.shared_lm_head:
            return vocab.small(torch.stack([self.features(i, h) for i in range(n)]))
        return self(h, n)[..., vocab.ids]  # own heads: their full rows, then the map's columns


def save_heads(heads: MedusaHeads, model, path: str | Path = HEADS_PATH, card: dict | None = None) -> None:
    """Half-precision weights + what is needed to rebuild them (and check they fit `model`); card as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.half() for k, v in heads.state_dict().items()}
    save_piece({"num_heads": heads.num_heads, "norm": heads.use_norm, "shared_lm_head": heads.shared_lm_head,
                "fingerprint": fingerprint(model), "accuracies": heads.accuracies, "state": state}, path)
    if card is not None:
        atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2) + "\n")


def heads_path(model) -> Path:
    """The default heads file for this model, whatever dtype it is loaded in (the fingerprint is dtype-independent):
    data/medusa/heads.pt for the course model, data/smollm2/medusa/heads.pt for SmolLM2."""
    return artifacts_dir(model) / "medusa" / HEADS_PATH.name


def load_heads(model, path: str | Path | None = None) -> MedusaHeads:
    """The trained heads for this model, loaded once (models.artifacts.load_cached); a clear error otherwise."""
    path = Path(path) if path is not None else heads_path(model)
    if not path.is_file():
        raise FileNotFoundError(f"no Medusa heads at {path}; train them with `{TRAIN_COMMAND} --heads 4` "
                                "(SmolLM2: `python -m dvi_lite prepare --model smollm2`, the teacher-distilled "
                                "recipe in medusa/teacher_recipe.py; or pass heads=...)")
    return load_cached("medusa", model, path, lambda: _load_heads(model, path))


def _load_heads(model, path: Path) -> MedusaHeads:
    ck = load_torch(path, "Medusa heads file", keys=("num_heads", "norm", "shared_lm_head", "fingerprint", "state"))
    if ck.get("fingerprint") != fingerprint(model):
        raise ValueError(f"Medusa heads {path} were trained for another model; train heads for this one with "
                         f"`{TRAIN_COMMAND} --model <its folder>`")
    heads = MedusaHeads(model, ck["num_heads"], norm=ck["norm"], shared_lm_head=ck["shared_lm_head"])
    dtype = next(model.parameters()).dtype
    heads.load_state_dict({k: v.to(dtype) for k, v in ck["state"].items()})
    heads.accuracies = ck.get("accuracies")
    return heads.eval()
