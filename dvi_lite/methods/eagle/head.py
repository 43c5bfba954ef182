"""EAGLE-3's draft head (Li et al. 2025): one decoder layer over the target's own fused features.

The offset convention (one convention, shared by the head, its training and the drafter):

    F_j = fc(concat(h_low_j, h_mid_j, h_high_j))   the target's states after the low, middle and high fused
          layers at position j (input token x_j), fused 3D -> D: what the target "knows" after x_j.
    draft input j = (F_j, x_{j+1}), at rotary position j, predicts x_{j+2}: the head sees the target's features
          of the prefix and the token that the target's next-token prediction produced.
    step 2, 3, ...: the head's own output g (pre-norm) replaces F: input (g_j, x_{j+2}) predicts x_{j+3}, and so
          on. That is how it drafts several tokens without the target, and what the training-time test trains.

A step (`EagleHead.step`): u = proj(concat(e_norm(embed(x)), g_norm(g))) (2D -> D; EAGLE-3 joins the token's
embedding and the feature the same way, with the concatenation feeding its attention's projections), then one
transformers LlamaDecoderLayer with the target's shapes (a copy of the target layer right after the high fused
layer, so the layer starts from what reads such states), a final RMSNorm (the target's) and an LM head over a
trimmed draft vocabulary (FR-Spec; EAGLE-3's d2t map: `ids`, the committed top-N map of models/vocab.py) whose
rows start as the target's tied embedding rows. Init: fc = [0 | 0 | I] (the high layer's state), proj = [I | I].

The head's attention keeps its own one-layer KV cache (core.kvcache.KVCache, cropped like the target's); the
training-time test passes a `StepKV` instead, which stacks the keys of the unrolled steps.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from dvi_lite.core.checks import check_int
from dvi_lite.models.artifacts import artifacts_dir, fingerprint, load_cached, read_piece, save_piece

TRAIN_COMMAND = "python -m dvi_lite eagle-train"


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's fused layers for an L-layer target: states after 2, L // 2 and L - 3 layers (SmolLM2: 2, 15, 27;
    the 12-layer course model: 2, 6, 9), clamped into [1, L] and sorted (a tiny model may repeat one)."""
    return tuple(sorted(min(n_layers, max(1, k)) for k in (2, n_layers // 2, n_layers - 3)))  # type: ignore[return-value]


@dataclass
class HeadConfig:
    """What a head is: the fused layers, the target layer its decoder layer is copied from, its draft vocabulary."""
    layers: tuple[int, ...] | None = None  # states after these many target layers (3 of them); None = default_layers
    init_layer: int | None = None  # target layer copied into the decoder layer; None = the one after the highest fused
    vocab: int | None = 8192  # trimmed draft vocabulary: this model's top-N map; None = the full vocabulary
    train_lm_head: bool = False  # EAGLE-3 trains its draft LM head; False keeps the target's rows frozen and
    # shared (EAGLE-1/2), so the committed head is the fusion and the layer alone: about half the bytes

    def resolved(self, n_layers: int) -> "HeadConfig":
        """The config with its None filled in for an n_layers target, every value checked (ValueError names it)."""
        layers = default_layers(n_layers) if self.layers is None else tuple(self.layers)
        if len(layers) != 3 or not all(isinstance(k, int) and 1 <= k <= n_layers for k in layers):
            raise ValueError(f"layers must be 3 layer counts in [1, {n_layers}] (low, middle, high), "
                             f"got {self.layers!r}")
        init = min(max(layers), n_layers - 1) if self.init_layer is None else self.init_layer
        check_int("init_layer", init, 0, n_layers - 1, what="the target layer the decoder layer starts from")
        if self.vocab is not None:
            check_int("vocab (draft vocabulary size N)", self.vocab, 1)
        return HeadConfig(tuple(sorted(layers)), init, self.vocab, bool(self.train_lm_head))


class StepKV:
    """A cache for the training-time test: keys of the unrolled steps stacked along the sequence.

    Duck-types `update(k, v, layer_idx)` as HF attention modules call it: appends this step's (B, H, T, Dh)
    keys and values and returns every step's so far, (B, H, (s+1) T, Dh), as the step-s attention reads them.
    """

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, 2), torch.cat(self.v, 2)


class EagleHead(nn.Module):
    """fc (3D -> D) fusion + [embedding, feature] projection (2D -> D) + one decoder layer + norm + draft LM head."""

    def __init__(self, model, cfg: HeadConfig | None = None, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        tcfg = model.config
        n, d = tcfg.num_hidden_layers, tcfg.hidden_size
        self.cfg = (cfg or HeadConfig()).resolved(n)
        self.model_fingerprint = fingerprint(model)
        emb = model.get_input_embeddings().weight.detach()  # (V, D): tied with the LM head in SmolLM2 / the course
        ids = torch.arange(emb.shape[0]) if vocab_ids is None else torch.as_tensor(vocab_ids).long().cpu()
        self.register_buffer("ids", ids.clone(), persistent=True)  # (N,) draft index -> vocabulary id (d2t)
        inv = torch.full((emb.shape[0],), -1, dtype=torch.long)
        inv[ids] = torch.arange(len(ids))
        self.register_buffer("inv", inv, persistent=False)  # (V,) vocabulary id -> draft index, -1 off the map
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.e_norm = LlamaRMSNorm(d, eps=tcfg.rms_norm_eps)
        self.g_norm = LlamaRMSNorm(d, eps=tcfg.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(tcfg, layer_idx=0)  # layer_idx 0: the head's own one-layer cache
        self.norm = LlamaRMSNorm(d, eps=tcfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, len(ids), bias=False)
        self.rotary = LlamaRotaryEmbedding(tcfg)
        with torch.no_grad():
            eye = torch.eye(d)
            self.fc.weight.copy_(torch.cat([0 * eye, 0 * eye, eye], 1))  # starts as the high layer's state
            self.proj.weight.copy_(torch.cat([eye, eye], 1))  # starts as e_norm(embed) + g_norm(feature)
            self.layer.load_state_dict(model.model.layers[self.cfg.init_layer].state_dict())
            self.norm.weight.copy_(model.model.norm.weight)
            self.lm_head.weight.copy_(emb.index_select(0, ids.to(emb.device)))  # the target's rows of the map
        self.lm_head.weight.requires_grad_(self.cfg.train_lm_head)
        self._embed = [model.get_input_embeddings()]  # the target's frozen embedding, shared (not a submodule)
        p = next(model.parameters())
        inv_freq = self.rotary.inv_freq.clone()
        self.to(device=p.device, dtype=p.dtype)
        self.rotary.inv_freq = inv_freq.to(p.device)  # rotary frequencies stay fp32 (a bf16 head would round them)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.cfg.layers

    def extra_params(self) -> int:
        """Values the head adds to the target: fc, proj, its layer, norms, and its own LM head when it trains one."""
        return sum(p.numel() for p in self.trainable())

    def trainable(self) -> list[nn.Parameter]:
        """The parameters training updates (the LM head only when cfg.train_lm_head)."""
        return [p for p in self.parameters() if p.requires_grad]

    def fuse(self, states: list[torch.Tensor]) -> torch.Tensor:
        """[h_low, h_mid, h_high] (B, T, D) each -> F (B, T, D)."""
        x = torch.cat(states, -1)  # (B, T, 3D)
        return self.fc(x.to(self.fc.weight.dtype))

    def step(self, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache=None,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: features g (B, T, D), tokens (B, T), positions (B, T) -> (g' (B, T, D) pre-norm, the
        draft vocabulary's logits (B, T, N)). cache: a KVCache (n_layers=1) or StepKV the attention appends to;
        mask: (B or 1, 1, T, past + T) bool (True = attend), None = causal over the new positions only."""
        e = self._embed[0](tokens).to(g.dtype)  # (B, T, D)
        u = self.proj(torch.cat([self.e_norm(e), self.g_norm(g)], -1))  # (B, T, 2D) -> (B, T, D)
        pe = self.rotary(u, positions)
        lay = self.layer
        causal = mask is None and u.shape[1] > 1
        if causal:  # no cache past (training's first step or a prefill into an empty cache): sdpa's causal path
            mask = torch.ones(u.shape[1], u.shape[1], dtype=torch.bool, device=u.device).tril()[None, None]
        a, _ = lay.self_attn(hidden_states=lay.input_layernorm(u), position_embeddings=pe, attention_mask=mask,
                             past_key_values=cache)
        u = u + a
        u = u + lay.mlp(lay.post_attention_layernorm(u))  # (B, T, D)
        return u, self.lm_head(self.norm(u))  # (B, T, D), (B, T, N)

    def to_vocab(self, small: torch.Tensor) -> torch.Tensor:
        """(..., N) draft logits -> (..., V): scattered into the full vocabulary, -inf off the map (q = 0 there)."""
        out = small.new_full((*small.shape[:-1], self.inv.numel()), float("-inf"))
        out[..., self.ids] = small
        return out

    def map_targets(self, top_ids: torch.Tensor, top_logp: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher top-k (..., k) in the draft index space: (indices in [0, N), log-probs with -inf off the map,
        on (...): the position has a target on the map)."""
        small = self.inv[top_ids]  # (..., k)
        off = small < 0
        logp = top_logp.float().masked_fill(off, float("-inf"))
        on = ~off.all(-1)
        return small.clamp(min=0), logp.masked_fill(~on[..., None], 0.0), on


def head_path(model) -> Path:
    """The default head file for this model: artifacts_dir(model)/eagle/head.pt."""
    return artifacts_dir(model) / "eagle" / "head.pt"


def static_tree_path(model) -> Path:
    """The rank paths of this model's static tree, beside its head (methods/eagle/static_tree.py)."""
    return artifacts_dir(model) / "eagle" / "static_tree.json"


def load_static_paths(model) -> list[tuple[int, ...]]:
    """This model's static tree, as rank paths; a clear error naming the command that measures it."""
    import json

    path = static_tree_path(model)
    if not path.is_file():
        raise ValueError(f"tree='static' needs this model's static tree ({path} is missing): measure it with "
                         "`python -m dvi_lite eagle-static-tree`, or pass paths=[(0,), (1,), (0, 0), ...]")
    return [tuple(q) for q in json.loads(path.read_text())["paths"]]


def save_head(head: EagleHead, path: str | Path) -> Path:
    """The head in half precision (what is committed), with its config and the target's fingerprint; atomic and
    deflated (models.artifacts.save_piece)."""
    state = {k: v.half() if v.is_floating_point() else v for k, v in head.state_dict().items()
             if head.cfg.train_lm_head or k != "lm_head.weight"}  # a frozen LM head is the target's rows
    body = {"cfg": asdict(head.cfg), "fingerprint": head.model_fingerprint, "state": state}
    return save_piece(body, path)


def load_head(model, path: str | Path | None = None) -> EagleHead:
    """A saved head for `model` (loaded once per model), in the model's dtype; a clear error if there is none."""
    path = Path(path) if path is not None else head_path(model)

    def load() -> EagleHead:
        body = read_piece(path, model, "EAGLE head", TRAIN_COMMAND)
        c = body["cfg"]
        cfg = HeadConfig(tuple(c["layers"]), c["init_layer"], c["vocab"], c.get("train_lm_head", True))
        head = EagleHead(model, cfg, body["state"]["ids"])
        p = next(model.parameters())
        state = {k: v.to(p.dtype) if v.is_floating_point() else v for k, v in body["state"].items()}
        if not cfg.train_lm_head:
            state["lm_head.weight"] = head.lm_head.weight.detach()  # the target's rows, rebuilt, not stored
        head.load_state_dict(state)
        return head.eval()

    return load_cached("eagle_head", model, path, load)
