"""Our own forward for Llama-family checkpoints: the HF model's weights, packed, driven by a dozen torch ops.

Why: HF's eager modules cost about as much in per-op overhead (13 module calls a layer, casts, views, a
rotary embedding per call, K and V repeated for GQA) as in streaming the weights, on a small model at batch
1. A verify of n tokens pays that overhead once, so measured against an HF target speculation looks better
than it would against a target served as fast as its weights allow. This runner is that faster target:

- one fused QKV and one fused gate/up matrix per layer (3 matmuls per sub-layer become 1);
- torch's fused RMSNorm, a RoPE table computed once (by the model's own rotary embedding: same numbers);
- the preallocated KV cache written in place (`KVCache`), attention with GQA (no copy of K and V);
- one mask per step (per distinct cache length), built by the same helpers as the HF runner's;
- bf16 weights reordered once for oneDNN's matrix-vector kernel (same products, streamed faster);
- on a CPU, attention of a bf16 model in fp32 (torch's bf16 sdpa is several times slower for a few queries);
- weights optionally in int8 (per-output-channel scales, torch's CPU weight-only kernel): half the bytes; or int4
  (per group of 32 inputs, a scale and a zero point; the LM head kept at 8 bits): a quarter.

It is a drop-in `Runner`: the same `layers_forward` (start / end / skip / capture / mask / parents), `logits`,
`new_cache`, `positions`, `forward`, so every drafter runs on it unchanged. `use_runtime(model, "lean")` makes
`Runner.for_model(model)` hand it out; the HF modules stay on the model for drafters that read them (the norm,
the LM head, the rotary embedding). A batch runs without a cache only (training, enumeration); trees are
attended by sdpa with a mask.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner

RUNTIMES = ("hf", "lean", "int8", "int4")  # hf: the model's own modules (the reference); lean: this file; int8 /
# int4: lean with quantized linear layers (int4: 4-bit layers, an 8-bit LM head)
SUPPORTED = ("a Llama-family *ForCausalLM (model_type 'llama') with SiLU MLP, no biases, default RoPE, "
             "pretraining_tp 1; a KV cache for batch 1")


class UnsupportedModel(ValueError):
    """The checkpoint is outside what the lean forward implements (the message says what is supported)."""


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot run `model` (None: it can)."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    checks = [
        (getattr(cfg, "model_type", None) == "llama", f"model_type {getattr(cfg, 'model_type', None)!r}"),
        (getattr(cfg, "hidden_act", "silu") == "silu", f"hidden_act {getattr(cfg, 'hidden_act', None)!r}"),
        (not getattr(cfg, "attention_bias", False), "attention_bias=True"),
        (not getattr(cfg, "mlp_bias", False), "mlp_bias=True"),
        (rope.get("rope_type", "default") == "default", f"rope_type {rope.get('rope_type')!r}"),
        (getattr(cfg, "pretraining_tp", 1) == 1, f"pretraining_tp {getattr(cfg, 'pretraining_tp', None)}"),
        (getattr(model, "lm_head", None) is not None and model.lm_head.bias is None, "an LM head with a bias"),
    ]
    bad = [why for ok, why in checks if not ok]
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        bad.append(f"weights of dtype {sorted(map(str, dtypes))} (float32, bfloat16 or float16 only)")
    return ", ".join(bad) if bad else None


@dataclass
class Int8Weight:
    """A linear layer's weight in int8 with one scale per output row: W ≈ q * scale[:, None]."""
    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,) in the activations' dtype

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        """Symmetric per-row rounding (absmax / 127); computed in fp32, the scale stored in w's dtype."""
        w32 = w.float()
        scale = (w32.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (N,)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.to(w.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]  # (N, K)


@dataclass
class PackedWeight:
    """A bf16 weight reordered once into oneDNN's blocked layout (what torch.compile's CPU freezing does): the
    same products as F.linear, bit for bit, but the matrix-vector kernel streams it about 1.4x faster here."""
    w: torch.Tensor  # oneDNN's layout of the (N, K) weight
    shape: tuple[int, int]

    @classmethod
    def maybe(cls, w: torch.Tensor) -> "PackedWeight | torch.Tensor":
        """Packed when it pays and works (bf16 on a CPU with oneDNN); else the plain weight."""
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return w.contiguous()
        try:
            return cls(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1), tuple(w.shape))
        except RuntimeError:  # a CPU without bf16 support in oneDNN
            return w.contiguous()


@dataclass
class Int4Weight:
    """A linear layer's weight in 4 bits, per group of GROUP inputs: W ≈ (q - 8) * scale + zero, q in 0..15, packed
    for torch's CPU int4 kernel (the convention gpt-fast and torchao use)."""
    packed: torch.Tensor  # the kernel's layout of the (N, K) 4-bit codes
    scale_zero: torch.Tensor  # (K / GROUP, N, 2) in the activations' dtype
    shape: tuple[int, int]

    GROUP = 32  # inputs per scale: finer groups, less error; the kernel reads one (scale, zero) per group

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int4Weight":
        """Asymmetric rounding per group (min to max in 15 steps), computed in fp32."""
        n, k = w.shape
        if k % cls.GROUP or k % 32:
            raise ValueError(f"int4 needs input sizes divisible by {max(cls.GROUP, 32)}, got {k}")
        g = w.float().view(n, k // cls.GROUP, cls.GROUP)
        lo, hi = g.amin(-1), g.amax(-1)  # (N, K / G)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(w.dtype)  # (K / G, N, 2)
        return cls(packed, sz, (n, k))


Weight = torch.Tensor | PackedWeight | Int8Weight | Int4Weight


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N), for a dense, a packed or an int8 weight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, w.w, None, "none", [], "")
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if isinstance(w, Int4Weight):
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, Int4Weight.GROUP, w.scale_zero)
    else:
        out = torch.ops.aten._weight_int8pack_mm(x2, w.q, w.scale)  # (M, N)
    return out.view(*x.shape[:-1], -1)


def nbytes(w: Weight) -> int:
    """Bytes of weights a forward streams for `w`."""
    ts = ((w.q, w.scale) if isinstance(w, Int8Weight) else (w.w,) if isinstance(w, PackedWeight)
          else (w.packed, w.scale_zero) if isinstance(w, Int4Weight) else (w,))
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class Layer:
    """One decoder layer's packed weights."""
    ln1: torch.Tensor  # (D,)
    qkv: Weight  # (Hq*Dh + 2*Hkv*Dh, D)
    o: Weight  # (D, Hq*Dh)
    ln2: torch.Tensor  # (D,)
    gate_up: Weight  # (2I, D)
    down: Weight  # (D, I)


QUANT = {"int8": Int8Weight.quantize, "int4": Int4Weight.quantize}  # runtime -> how a layer's weights are stored


def pack_layer(layer, quant: str | None) -> Layer:
    """Concatenate an HF LlamaDecoderLayer's projections (rows of q, k, v; rows of gate, up)."""
    a, m = layer.self_attn, layer.mlp
    qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
    gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
    ws = [qkv, a.o_proj.weight.detach(), gate_up, m.down_proj.weight.detach()]
    ws = [QUANT[quant](w) if quant else PackedWeight.maybe(w) for w in ws]
    return Layer(layer.input_layernorm.weight.detach(), ws[0], ws[1], layer.post_attention_layernorm.weight.detach(),
                 ws[2], ws[3])


class LeanRunner(Runner):
    """A `Runner` whose layers are this file's forward over packed weights (see the module docstring)."""

    def __init__(self, model, quant: str | None = None, max_positions: int | None = None):
        why = unsupported_reason(model)
        if why:
            raise UnsupportedModel(f"the lean runtime supports {SUPPORTED}; this checkpoint has {why} "
                                   "(use runtime 'hf')")
        super().__init__(model, "sdpa")
        cfg = model.config
        self.quant = quant
        if quant not in (None, *QUANT):
            raise ValueError(f"quant must be None or one of {list(QUANT)}, got {quant!r}")
        self.packed = []
        for i, layer in enumerate(self.layers):
            try:
                self.packed.append(pack_layer(layer, quant))
            except (RuntimeError, AttributeError, TypeError, ValueError) as e:  # missing, misshapen, not a tensor
                raise UnsupportedModel(f"the lean runtime supports {SUPPORTED}; layer {i}'s weights cannot be packed "
                                       f"({str(e).splitlines()[0][:200]}) (use runtime 'hf')") from None
        self.eps = cfg.rms_norm_eps
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.embed_w = self.embed_tokens.weight.detach()
        self.norm_w = self.norm.weight.detach()
        head = self.lm_head.weight.detach()
        # the LM head stays at 8 bits under int4: its rounding moves every logit, and it is a sixth of the bytes
        self.head_w: Weight = Int8Weight.quantize(head) if quant else PackedWeight.maybe(head)
        # on a CPU, sdpa over bf16 / fp16 is several times slower than over fp32 for a few queries: attention runs in
        # fp32 there, over a cache kept in fp32 (the K and V of a few hundred positions: small beside the weights)
        dt = self.embed_w.dtype
        self.attn_dtype = torch.float32 if self.device.type == "cpu" and dt in (torch.bfloat16, torch.float16) else dt
        # cos / sin for every position, by the model's own rotary embedding: the same numbers HF computes per call
        n_pos = max_positions or cfg.max_position_embeddings
        pos = torch.arange(n_pos, device=self.device)[None]
        cos, sin = self.rotary(self.embed_w[:1][None].to(self.attn_dtype), pos)  # (1, P, Dh) each, attention's dtype
        self.cos, self.sin = cos[0], sin[0]  # (P, Dh)

    def streamed_bytes(self) -> int:
        """Bytes of weights one decoding forward reads: the packed layers, the norms and the LM head (the input
        embedding only by the rows of its tokens)."""
        per = [nbytes(w) for L in self.packed for w in (L.ln1, L.qkv, L.o, L.ln2, L.gate_up, L.down)]
        return sum(per) + nbytes(self.norm_w) + nbytes(self.head_w)

    def new_cache(self, max_len: int) -> KVCache:
        """The target's cache, in the attention's dtype (fp32 for a bf16 model on a CPU)."""
        cfg = self.model.config
        return KVCache(cfg.num_hidden_layers, self.n_kv, self.head_dim, max_len, self.attn_dtype, self.device)

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, H, n, Dh) rotated by the table rows of its positions (cos, sin: (B, 1, n, Dh))."""
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def attend(self, i: int, x: torch.Tensor, cache: KVCache | None, cos, sin, mask) -> torch.Tensor:
        """Self-attention of layer i on normed x (B, n, D); appends the new K, V to the cache."""
        L = self.packed[i]
        b, n = x.shape[:2]
        qkv = linear(x, L.qkv).to(self.attn_dtype)  # (B, n, (Hq + 2 Hkv) Dh); a no-op unless fp32 attention
        heads = qkv.view(b, n, self.n_heads + 2 * self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hq+2Hkv, n, Dh)
        qk = self.rope(heads[:, : self.n_heads + self.n_kv], cos, sin)  # q's and k's heads rotated at once
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads:]  # (B, Hq, n, Dh), (B, Hkv, n, Dh)
        v = heads[:, self.n_heads + self.n_kv:]  # (B, Hkv, n, Dh)
        if cache is not None:
            k, v = cache.update(k, v, i)  # (1, Hkv, past + n, Dh)
        causal = mask is None and n > 1  # as HF: no mask and several queries = causal (an empty cache)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                           scale=self.head_dim ** -0.5)  # (B, Hq, n, Dh)
        return linear(a.transpose(1, 2).reshape(b, n, self.q_size).to(x.dtype), L.o)  # (B, n, D)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        L = self.packed[i]
        gate, up = linear(x, L.gate_up).chunk(2, dim=-1)  # (1, n, I) each
        return linear(F.silu(gate) * up, L.down)  # (1, n, D)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_w)  # (1, n) -> (1, n, D)

    def layers_forward(self, h: torch.Tensor, cache: KVCache | None, positions: torch.Tensor, *args, **kwargs):
        """`Runner.layers_forward` (the same loop, arguments and meaning) over this file's layer pieces below."""
        if h.shape[0] != 1 and cache is not None:
            raise ValueError(f"the lean runtime caches batch 1 only, got a batch of {h.shape[0]}")
        return super().layers_forward(h, cache, positions, *args, **kwargs)

    def position_table(self, h: torch.Tensor, positions: torch.Tensor):
        return self.cos[positions][:, None], self.sin[positions][:, None]  # (1 or B, 1, n, Dh) each

    def attn_block(self, i: int, h: torch.Tensor, cache, pe, mask: torch.Tensor | None, extra: dict) -> torch.Tensor:
        return self.attend(i, self.rms(h, self.packed[i].ln1), cache, *pe, mask)

    def mlp_block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(i, self.rms(h, self.packed[i].ln2))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (1, n, D) -> (1, n, V)."""
        return linear(self.rms(h, self.norm_w), self.head_w)


def use_runtime(model, runtime: str = "hf") -> Runner:
    """Serve `model` on `runtime` (one of RUNTIMES): every later `Runner.for_model(model)` returns that runner.

    "hf" restores the reference. Each runtime's runner is built once per model and kept (switching back and forth,
    as the bench does per generation, costs nothing); its weights are a packed copy taken then, so weights changed
    afterwards are not seen. An unsupported checkpoint raises `UnsupportedModel` naming what is supported.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
    built = model.__dict__.setdefault("_dvi_lite_runtimes", {})
    if runtime not in built:
        built[runtime] = Runner(model) if runtime == "hf" else LeanRunner(model, None if runtime == "lean" else runtime)
    model.__dict__.setdefault("_dvi_lite_runners", {})["sdpa"] = built[runtime]
    model.__dict__["_dvi_lite_runtime"] = runtime
    return built[runtime]


@contextmanager
def serving(model, runtime: str | None) -> Iterator[Runner]:
    """`with serving(model, "lean"):` serve `model` on `runtime` inside the block and as before after it, also when
    the block raises (None: leave it as it is served)."""
    was = runtime_of(model)
    try:
        yield use_runtime(model, runtime or was)
    finally:
        use_runtime(model, was)


def runtime_of(model) -> str:
    """The runtime `model` is served on ("hf" unless `use_runtime` said otherwise)."""
    return model.__dict__.get("_dvi_lite_runtime", "hf")
