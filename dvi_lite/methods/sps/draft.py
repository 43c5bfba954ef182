"""The SpS draft model of a target: a small Llama that shares the target's embedding and LM head.

Speculative sampling needs a draft with the target's tokenizer. For a real model with no smaller sibling
(SmolLM2-135M) we make one: a `LlamaForCausalLM` with the target's config but only a few layers, initialised
from some of the target's own layers and its final norm, then distilled from the teacher (`train.py`).

What is its own and what is shared: its decoder layers and final norm are its own (the only weights saved:
`draft.pt`, half precision, with a card `card.json`); the token embedding and the LM head are the target's
very modules (no copy: a 49152 x 576 table is most of SmolLM2's size). The head may be trimmed (FR-Spec:
`TrimmedLMHead`, only the N most frequent tokens' rows, -inf elsewhere, so q = 0 off the map): the draft is
then cheaper, still a causal LM over the full vocabulary, so transformers' assisted generation (`hf_assisted`)
runs the very same draft as our `sps`. Verification is the target's full head either way: lossless.

`resolve_draft(model)` finds the draft of a model whatever dtype it is loaded in: the shared-embedding draft
in `artifacts_dir(model)/sps/` when there is one (SmolLM2: data/smollm2/sps/), else the course draft model
(data/draft_model, a complete HF checkpoint with its own embedding).
"""
from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM, PreTrainedModel

from dvi_lite.core.checks import check_int
from dvi_lite.models.artifacts import artifacts_dir, fingerprint, load_cached, read_piece
from dvi_lite.models.loading import DRAFT_MODEL, load_draft_model
from dvi_lite.models.vocab import check_ids
from dvi_lite.paths import atomic_write_text

DRAFT_FILE = "draft.pt"  # the draft's own weights (layers + norm, fp16), its config and its vocabulary map
CARD_FILE = "card.json"


class TrimmedLMHead(nn.Module):
    """The target's LM head restricted to `ids`: (..., D) -> (..., V) logits, -inf off the map.

    Its (N, D) rows are a frozen copy selected once; `small` gives the (..., N) logits (training, argmax).
    """

    def __init__(self, lm_head: nn.Module, ids: torch.Tensor):
        super().__init__()
        w = lm_head.weight
        self.vocab_size = w.shape[0]
        self.register_buffer("ids", check_ids(ids, self.vocab_size).to(w.device), persistent=False)  # (N,)
        self.weight = nn.Parameter(w.detach().index_select(0, self.ids).clone(), requires_grad=False)  # (N, D)

    @property
    def out_features(self) -> int:
        return self.vocab_size

    def small(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., N): the map's logits only."""
        return F.linear(x.to(self.weight.dtype), self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.small(x)  # (..., N)
        out = s.new_full((*s.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        out[..., self.ids] = s
        return out


def draft_vocab_size(draft: PreTrainedModel) -> int:
    """The draft's output vocabulary (a trimmed head still scores the full vocabulary, -inf off its map)."""
    head = draft.get_output_embeddings()
    return head.vocab_size if isinstance(head, TrimmedLMHead) else head.weight.shape[0]


def build_draft(target: PreTrainedModel, layers: Sequence[int], vocab_ids: Any = None) -> LlamaForCausalLM:
    """A draft with len(layers) decoder layers copied from the target's `layers` (+ a copy of its final norm),
    the target's embedding and LM head shared (trimmed to `vocab_ids` when given), in the target's dtype/device.
    """
    n_target = target.config.num_hidden_layers
    layers = [check_int("draft layers (target layer indices)", i, 0, n_target - 1) for i in layers]
    if not layers:
        raise ValueError("draft layers must name at least one of the target's layers to copy")
    if target.config.model_type != "llama":
        raise ValueError(f"the shared-embedding draft is a Llama; the target is {target.config.model_type!r}")
    w = target.get_input_embeddings().weight
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = False  # the head is set below (shared or trimmed); transformers must not re-tie it
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):  # no random 49152 x D tables: embedding and head come from the target
        draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens = target.get_input_embeddings()
    draft.lm_head = target.get_output_embeddings()
    draft.model.layers.to_empty(device=w.device)
    draft.model.norm.to_empty(device=w.device)
    draft.model.rotary_emb = target.model.rotary_emb  # same rope: shared (a buffer, no weights)
    for i, j in enumerate(layers):
        draft.model.layers[i].load_state_dict(target.model.layers[j].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.layers.to(w.dtype)
    draft.model.norm.to(w.dtype)
    if vocab_ids is not None:
        draft.lm_head = TrimmedLMHead(target.get_output_embeddings(), torch.as_tensor(vocab_ids))
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.eval()
    draft.dvi_source_layers = list(layers)
    return draft


def own_state(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's own weights: its layers and final norm (never the shared embedding / head)."""
    return {k: v for k, v in draft.model.state_dict().items() if k.startswith(("layers.", "norm."))}


def draft_body(draft: PreTrainedModel, target: PreTrainedModel) -> dict:
    """What a saved draft holds: own weights in fp16, source layers, vocabulary map, the target's fingerprint."""
    head = draft.get_output_embeddings()
    return {"state": {k: v.detach().to("cpu", torch.float16) for k, v in own_state(draft).items()},
            "layers": list(getattr(draft, "dvi_source_layers", range(draft.config.num_hidden_layers))),
            "vocab_ids": head.ids.to("cpu", torch.int32) if isinstance(head, TrimmedLMHead) else None,
            "fingerprint": fingerprint(target)}


def save_draft(draft: PreTrainedModel, target: PreTrainedModel, out_dir: str | Path, card: dict | None = None
               ) -> Path:
    """draft.pt (own weights in fp16, source layers, vocabulary map, target fingerprint) and card.json."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (DRAFT_FILE + ".tmp")
    torch.save(draft_body(draft, target), tmp)
    os.replace(tmp, out / DRAFT_FILE)
    if card is not None:
        atomic_write_text(out / CARD_FILE, json.dumps(card, indent=1) + "\n")
    return out / DRAFT_FILE


def load_draft(target: PreTrainedModel, path: str | Path) -> LlamaForCausalLM:
    """A saved shared-embedding draft (folder or its draft.pt) built on `target`, in the target's dtype/device."""
    f = Path(path) / DRAFT_FILE if Path(path).is_dir() else Path(path)
    body = read_piece(f, target, "draft_model", "dvi_lite.methods.sps.train.prepare_smollm2 (or pass an HF "
                      "checkpoint folder); the draft shares the embedding of the model it was trained for")
    draft = build_draft(target, body["layers"], body["vocab_ids"])
    w = target.get_input_embeddings().weight
    draft.model.load_state_dict({k: v.to(w.dtype) for k, v in body["state"].items()}, strict=False)
    return draft


def is_shared_draft(path: str | Path) -> bool:
    p = Path(path)
    return (p / DRAFT_FILE).is_file() or (p.is_file() and p.name == DRAFT_FILE)


def default_draft_path(model: PreTrainedModel) -> Path:
    """This model's committed SpS draft: artifacts_dir(model)/sps/ if trained, else the course draft model."""
    own = artifacts_dir(model) / "sps"
    return own if is_shared_draft(own) else DRAFT_MODEL


def resolve_draft(model: PreTrainedModel, draft_model: Any = None) -> PreTrainedModel:
    """The given draft model (object or folder), or this model's committed draft (loaded once per model/dtype).

    The one place a target's draft is found (`models.loading.load_draft_model` loads only complete HF
    checkpoints and imports no method module, so loading and this module import in one direction only).

    A folder is either a shared-embedding draft (draft.pt, built on `model`) or a complete HF checkpoint
    (loaded in the target's dtype, on its device). Checks the vocabularies agree: rejection sampling
    compares p and q token by token.
    """
    if draft_model is None or isinstance(draft_model, (str, bytes)) or hasattr(draft_model, "__fspath__"):
        path = default_draft_path(model) if draft_model is None else Path(os.fsdecode(draft_model))
        w = model.get_output_embeddings().weight  # the draft goes where the target's head is, in its dtype
        if is_shared_draft(path):
            draft_model = load_cached("sps_draft", model, path, lambda: load_draft(model, path))
        else:
            draft_model = load_cached("draft_model", model, path,
                                      lambda: load_draft_model(path, dtype=w.dtype, device=str(w.device)))
    if not isinstance(draft_model, nn.Module) or not hasattr(draft_model, "get_output_embeddings"):
        raise TypeError(f"draft_model must be a causal LM, a folder or None, got {type(draft_model).__name__}")
    v_draft, v_target = draft_vocab_size(draft_model), model.get_output_embeddings().weight.shape[0]
    if v_draft != v_target:
        raise ValueError(f"draft model vocabulary ({v_draft}) differs from the target's ({v_target}): "
                         "speculative sampling needs the same tokenizer")
    return draft_model


def added_values(model: PreTrainedModel, draft: PreTrainedModel) -> int:
    """Values the draft adds to the target: its parameters, less those it shares with the target."""
    shared = {id(p) for p in model.parameters()}
    return sum(p.numel() for p in draft.parameters() if id(p) not in shared)
