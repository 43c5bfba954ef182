"""Kangaroo (Liu et al. 2024): self-speculative decoding by double early exit, with a small adapter.

The draft is the target's own first s = `split` layers + an adapter (one attention layer between two
RMSNorms) + the target's LM head: q = softmax(lm_head(adapter(h_s))). Verification runs only layers
[s, L) on the states drafting already computed (EarlyExitDrafter + the engine's Proposal.hidden). The
second early exit stops drafting after the first token whose top-1 probability falls below eta (that
token is still proposed, as in Kangaroo's inference code). `vocab`: a trimmed draft head over the N most
frequent tokens (models.vocab; verification keeps the full head, so still lossless). An adapter is
trained for one exit layer: its file is per split (data/kangaroo/adapter_k<split>.pt), and the default
split is models.artifacts.default_split_for(model) (a committed per-model default, else core.checks.default_split),
as for every self-speculative method.

The adapter keeps its own one-layer KV cache. Invariant: it holds positions [0, A) and `todo` holds
the exit-layer states of committed positions [A, committed) it has not seen yet — the "last draft token"
case: when every draft is accepted, the last one was never fed to the adapter (only verification ran
it through the shallow layers), so its state comes from Outcome.split_hidden.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

from dvi_lite.core.checks import check_split, reject_renamed
from dvi_lite.core.engine import DecodeState, Outcome, Proposal
from dvi_lite.core.kvcache import KVCache, kv_shape
from dvi_lite.core.runner import Runner, chain_mask
from dvi_lite.methods.early_exit import EarlyExitDrafter
from dvi_lite.models.artifacts import artifacts_dir, default_split_for, fingerprint, load_cached, save_piece
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab
from dvi_lite.paths import DATA_DIR, atomic_write_text
from dvi_lite.safety import load_torch

ADAPTER_DIR = DATA_DIR / "kangaroo"


class KangarooAdapter(nn.Module):
    """h_s (1, n, D) -> normalised states for the target's LM head: out_norm(h + attn(in_norm(h)))."""

    def __init__(self, model, split: int):
        super().__init__()
        cfg = model.config
        n_kv, head_dim = kv_shape(cfg)
        acfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                           num_key_value_heads=n_kv, head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps,
                           num_hidden_layers=1, attention_bias=False, attn_implementation="sdpa")
        self.split = split
        self.in_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = LlamaAttention(acfg, layer_idx=0)
        self.out_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layer = model.model.layers[split]  # start from the first deep layer's attention and the final norm
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(self.attn, name).weight.copy_(getattr(layer.self_attn, name).weight)
            self.in_norm.weight.copy_(layer.input_layernorm.weight)
            self.out_norm.weight.copy_(model.model.norm.weight)
        p = next(model.parameters())
        self.to(device=p.device, dtype=p.dtype)

    def forward(self, h: torch.Tensor, position_embeddings, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        a, _ = self.attn(hidden_states=self.in_norm(h), position_embeddings=position_embeddings,
                         attention_mask=mask, past_key_values=cache)
        return self.out_norm(h + a)

    def extra_params(self) -> int:
        """Parameters the adapter adds to the target: its attention (q, k, v, o) and its two RMSNorms."""
        return sum(p.numel() for p in self.parameters())


def adapter_path(split: int, root: Path = ADAPTER_DIR) -> Path:
    return Path(root) / f"adapter_k{split}.pt"


def model_adapter_path(model, split: int) -> Path:
    """The default adapter file for this model: data/kangaroo/ for the course model."""
    return adapter_path(split, artifacts_dir(model) / "kangaroo")


def trained_vocab(path: Path) -> int | None:
    """The trimmed head size N an adapter file was trained through, from its card (None: the full head)."""
    card = path.with_suffix(".json")
    if not card.is_file():
        return None
    c = json.loads(card.read_text())
    return c.get("vocab_n") or c.get("config", {}).get("vocab")


def save_adapter(adapter: KangarooAdapter, model, path: Path, card: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.half() for k, v in adapter.state_dict().items()}  # small, half precision
    save_piece({"split": adapter.split, "fingerprint": fingerprint(model), "state": state}, path)
    if card is not None:
        atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2) + "\n")


def load_adapter(model, split: int, path: str | Path | None = None) -> KangarooAdapter:
    """The trained adapter for this model and exit layer (loaded once per model); a clear error if there is none."""
    path = Path(path) if path is not None else model_adapter_path(model, split)
    return load_cached("kangaroo_adapter", model, path, lambda: _load_adapter(model, split, path), extra=split)


def _load_adapter(model, split: int, path: Path) -> KangarooAdapter:
    if not path.is_file():
        raise FileNotFoundError(f"no Kangaroo adapter for exit layer {split} at {path}; train one with "
                                f"`python -m dvi_lite kangaroo-train --split {split}` (or pass adapter=...)")
    ck = load_torch(path, "Kangaroo adapter", keys=("split", "fingerprint", "state"))
    if ck["fingerprint"] != fingerprint(model) or ck["split"] != split:
        raise ValueError(f"Kangaroo adapter {path} was trained for another model or exit layer "
                         f"(split {ck['split']}); train one for this model with `python -m dvi_lite kangaroo-train`")
    adapter = KangarooAdapter(model, split)
    p = next(model.parameters())
    adapter.load_state_dict({k: v.to(p.dtype) for k, v in ck["state"].items()})
    return adapter.eval()


class KangarooDrafter(EarlyExitDrafter):
    name = "kangaroo"

    def __init__(self, runner: Runner, adapter: KangarooAdapter, K: int = 6, threshold: float | None = 0.6,
                 branch: int = 1, vocab: TrimmedHead | None = None):
        super().__init__(runner, adapter.split, K, threshold, branch, vocab)
        self.adapter = adapter
        self.capture_layer = adapter.split

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        self.cache = KVCache.for_model(self.runner.model, state.cache.max_len, n_layers=1)
        self.todo = [state.prefill_hidden[self.split]]  # the prompt's exit-layer states, fed on first use

    def exit_scores(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.cat(self.todo + [h], 1)  # (1, n, D): unseen committed states, then this input
        self.todo = []
        past = len(self.cache)
        pos = (past + torch.arange(x.shape[1], device=x.device))[None]
        out = self.adapter(x, self.runner.rotary(x, pos), self.cache, chain_mask(x.shape[1], past, x.device))
        return self.head_scores(out[:, -1:])  # (1, 1, N)

    def extra_params(self) -> int:
        return self.adapter.extra_params() + super().extra_params()

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        self.adapter_base = len(self.cache) + sum(t.shape[1] for t in self.todo)  # = committed positions
        return super().propose(state)

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        fed = outcome.proposal.hidden.shape[1]  # inputs [pending, d1, ...] whose exit state went through the adapter
        committed = [0] + [i + 1 for i in outcome.path]  # node indices (pending = 0) now in the target's cache
        j = 0  # the adapter keeps the fed chain prefix that was committed
        while j < min(fed, len(committed)) and committed[j] == j:
            j += 1
        self.cache.crop(self.adapter_base + j)
        if j < len(committed):  # the last draft token (all accepted) or an accepted tree leaf: never fed
            self.todo = [outcome.split_hidden[:, committed[j:]]]


def make_drafter(model, tokenizer, split: int | None = None, K: int = 6, threshold: float | None = 0.6,
                 adapter: KangarooAdapter | str | Path | None = None, branch: int = 1, vocab=None,
                 **old) -> KangarooDrafter:
    """Kangaroo: exit at layer `split`, adapter + shared head draft up to K tokens, stop below top-1 prob `threshold`;
    branch > 1 adds the next top-(branch-1) tokens at each step as tree leaves (one verify pass).

    split=None: a given adapter object's own exit layer, else core.checks.default_split. vocab: a trimmed
    draft head (models.vocab.resolve_vocab: an int N, a saved map's path); None = the head the adapter was
    trained through (its card's "vocab_n": this model's top-N map, or the full vocabulary); "full" = the full
    vocabulary whatever the adapter was trained through.
    """
    reject_renamed(old, "kangaroo.make_drafter")
    r = Runner.for_model(model)
    if split is None:
        split = adapter.split if isinstance(adapter, KangarooAdapter) else default_split_for(model)
    split = check_split(split, r.n_layers)
    if vocab is None and (adapter is None or isinstance(adapter, (str, Path))):
        vocab = trained_vocab(Path(adapter) if adapter is not None else model_adapter_path(model, split))
    elif isinstance(vocab, str) and vocab == "full":
        vocab = None
    if adapter is None or isinstance(adapter, (str, Path)):
        adapter = load_adapter(model, split, adapter)
    elif adapter.split != split:
        raise ValueError(f"split {split}: the given Kangaroo adapter was trained for exit layer {adapter.split}")
    return KangarooDrafter(r, adapter, K, threshold, branch, resolve_vocab(model, tokenizer, vocab))
