"""DVI's draft policy pi_theta(t | h_k), the verifier's LoRA for slow updates, and loading a saved policy.

The draft policy pi_theta(t | h_k)
----------------------------------
    h_k  --(layers [0, k) of the BASE model, shared with verification)
    x    = h_k + ExitMLP(norm_b(h_k))        ExitMLP: a copy of layer k's MLP carrying LoRA "lora_S";
                                              its output projection's base weight is zero, so the branch
                                              is exactly LoRA's B A (...) = 0 at init
    q    = softmax(alpha * lm_head(exit_norm(x)))   exit_norm: clone of the final RMSNorm (trainable);
                                              lm_head: the model's own, shared and frozen; alpha: a
                                              learnable logit scale, init 1

Where lora_S lives: the paper's stated design, the reference repo, and this package
----------------------------------------------------------------------------------
The paper presents DVI as lossless self-speculation: the draft (the shallow exit) learns online, while
what the verifier emits does not change. Its reference code puts `lora_draft` on the
*shallow layers* [0, k) themselves. Those layers are shared with verification, so a LoRA there changes
h_k for the verifier too: the repo's output is then lossless only w.r.t. the LoRA'd model (greedy =
greedy of a model that drifts every fast step), not w.r.t. the base model. Running the LoRA'd shallow
layers into a separate draft cache would restore losslessness but give up the shallow reuse
(verification recomputes [0, k)), and h_k would depend on theta (a replayed h_k would be stale).

This package keeps the paper's stated property rather than the repo's placement: lora_S lives in a
draft-only, position-wise exit block *after* layer k:
  (a) lossless w.r.t. the base model: the verifier (layers [0, L) + the final norm + the LM head)
      never runs a lora_S weight; greedy DVI == plain greedy of the base model, at any training step;
  (b) shallow reuse: layers [0, k) are the base model's, so the drafting pass's KV cache and h_k are
      exactly what verification needs (Proposal.hidden, as early_exit / kangaroo);
  (c) peft-managed: lora_S is injected by peft (inject_adapter_in_model, adapter_name="lora_S") into
      the exit block, saved and loaded with get/set_peft_model_state_dict;
  (d) exact replay of h: pi_theta depends on h_k only (no attention, no own KV cache), so the buffer's
      (h_k, token) pairs re-evaluate exactly under the current theta, and there is no "last draft
      token" cache bookkeeping (Kangaroo's adapter cache) at all; updates between sequences never leave
      a stale cache behind. The price: the head cannot attend (Kangaroo's adapter can).
  (e) zero start: at step 0 the draft is exactly the early-exit draft (`method="early_exit"`).
The cost in memory: the exit block holds a full copy of layer k's MLP (3 * D * I values, frozen, the
down projection zero) besides the trainable LoRA; `DVIPolicy.extra_params` counts all of it.

The head's capacity: "shared" or "trained" (DVIConfig.head)
---------------------------------------------------------
"shared" (the default, and every policy file written before the option): the LM head is the model's own,
frozen; on SmolLM2 at rank 8 only ~51k values train (lora_S 50.7k + exit_norm + alpha). "trained" follows
the reference repo, whose `exit_proj` is a trainable copy of the LM head: here a trainable (N, D) draft LM
head over the drafter's vocabulary (the trimmed map's N rows, `models.vocab`; or all V rows), each row
initialised from the target's own row (the tied embedding on SmolLM2), plus lora_S on the exit block as
before. On SmolLM2 with the 8192-token map that is 8192 * 576 = 4.72M more values. Verification never reads
it (it scores drafts only), so decoding stays lossless. The head's ids travel in policy.pt ("head_ids").

lora_D (slow updates) is OFF by default. Enabling it injects a LoRA into the model's deep layers
[k, L) *in place* (peft, adapter_name="lora_D", zero-initialised so nothing changes until trained);
the verifier is then the updated model, and decoding stays lossless w.r.t. that *updated* verifier
(the seed's design), no longer w.r.t. the base model. Slow updates run between sequences, so one
sequence is always verified by one model (its deep KV cache is never stale).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from dvi_lite.core.checks import check_int, check_split, default_split
from dvi_lite.methods.dvi.config import is_finite
from dvi_lite.models.artifacts import artifacts_dir, fingerprint, load_cached
from dvi_lite.models.vocab import TrimmedHead, check_ids
from dvi_lite.safety import load_torch

LORA_S, LORA_D = "lora_S", "lora_D"
POLICY_FILE, TRAINER_FILE = "policy.pt", "trainer.pt"  # what method="dvi" loads; what a resume loads
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def _peft():
    import peft  # imported lazily: every other method works without touching peft

    return peft


def _base(linear: nn.Module) -> nn.Module:
    """The plain nn.Linear under a peft wrapper (or the module itself)."""
    return linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear


# ----------------------------------------------------------------------------------------------
# the draft policy


class ExitMLP(nn.Module):
    """act(gate(x)) * up(x) -> down: layer k's SwiGLU MLP, gate/up copied, down's base weight zero."""

    def __init__(self, mlp: nn.Module, act: str):
        super().__init__()
        gate, up, down = (_base(getattr(mlp, n)) for n in MLP_LINEARS)
        self.gate_proj = nn.Linear(gate.in_features, gate.out_features, bias=gate.bias is not None)
        self.up_proj = nn.Linear(up.in_features, up.out_features, bias=up.bias is not None)
        self.down_proj = nn.Linear(down.in_features, down.out_features, bias=down.bias is not None)
        self.act = ACT2FN[act]
        with torch.no_grad():
            for mine, theirs in ((self.gate_proj, gate), (self.up_proj, up)):
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None:
                    mine.bias.copy_(theirs.bias)
            self.down_proj.weight.zero_()  # the branch starts at exactly 0: only LoRA's B A can open it
            if self.down_proj.bias is not None:
                self.down_proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DVIPolicy(nn.Module):
    """pi_theta(. | h_k): residual exit block with LoRA "lora_S" -> exit_norm -> LM head -> x alpha.

    head="shared": trainable (the fast update's parameters) are lora_S, exit_norm.weight, logit_scale.
    Everything else is frozen: the block's base weights, its input norm, and the LM head, which is the
    model's own module (not a copy, not registered as a submodule: it never moves, trains or gets saved here).
    head="trained": also `head_weight` (N, D), a trainable float32 copy of the target's LM-head rows at
    `head_ids` (the drafter's trimmed map; None = all V rows); `head_map` is a TrimmedHead over those ids
    whose weight IS head_weight (so `head_map.small` / `head_map.expand` are the draft head's own logits).
    The block runs in float32 whatever the model's dtype (the fast update trains it in fp32); h_k is
    upcast on the way in and cast to the LM head's dtype before a shared head.
    """

    def __init__(self, model, split: int, lora_rank: int = 8, lora_alpha: float = 16.0, head: str = "shared",
                 head_ids: torch.Tensor | None = None):
        super().__init__()
        layers = model.model.layers
        self.split = check_split(split, len(layers))
        check_int("lora_rank", lora_rank, 1)
        if not is_finite(lora_alpha) or lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be a finite number > 0, got {lora_alpha!r}")
        self.lora_rank, self.lora_alpha = lora_rank, float(lora_alpha)
        layer = layers[split]  # the first deep layer: the block starts from its MLP
        for n in MLP_LINEARS:
            if not hasattr(layer.mlp, n):
                raise ValueError(f"DVI needs a gated (gate/up/down_proj) MLP in layer {split}, "
                                 f"got {type(layer.mlp).__name__}")
        dev = model.lm_head.weight.device
        self.block_norm = copy.deepcopy(layer.post_attention_layernorm).to(dev, torch.float32)
        self.block = ExitMLP(layer.mlp, model.config.hidden_act).to(dev, torch.float32)
        self.exit_norm = copy.deepcopy(model.model.norm).to(dev, torch.float32)
        self.logit_scale = nn.Parameter(torch.ones((), device=dev))
        object.__setattr__(self, "lm_head", model.lm_head)  # shared, not a submodule
        cfg = _peft().LoraConfig(r=lora_rank, lora_alpha=self.lora_alpha, lora_dropout=0.0,
                                 target_modules=[f"block.{n}" for n in MLP_LINEARS])
        _peft().inject_adapter_in_model(cfg, self, adapter_name=LORA_S)  # freezes every non-LoRA parameter
        self.exit_norm.weight.requires_grad_(True)
        self.logit_scale.requires_grad_(True)
        self.trained_vocab: Any = None  # set by load_policy from the file: the trimmed head it learned on
        if head not in ("shared", "trained"):
            raise ValueError(f"head must be one of ('shared', 'trained'), got {head!r}")
        self.head = head
        self.head_ids: torch.Tensor | None = None  # (N,) the trained head's token ids (None: all V, or shared)
        self.head_map: TrimmedHead | None = None
        if head == "trained":
            lm = _base(model.lm_head)
            v = lm.weight.shape[0]
            ids = None if head_ids is None else check_ids(head_ids, v).to(dev)  # (N,)
            rows = lm.weight.detach() if ids is None else lm.weight.detach().index_select(0, ids)  # (N, D)
            self.head_weight = nn.Parameter(rows.to(dev, torch.float32).clone())  # init: the target's rows
            bias = None if lm.bias is None else lm.bias.detach() if ids is None else lm.bias.detach()[ids]
            self.head_bias = None if bias is None else nn.Parameter(bias.float().clone())  # a biased head: trains too
            if ids is not None:
                self.head_ids = ids
                self.head_map = TrimmedHead(lm, ids)  # its (N, D) copy is replaced by the trainable rows:
                self.head_map.weight, self.head_map.bias = self.head_weight, self.head_bias

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """(..., D) h_k -> (..., D) normalised exit features (float32)."""
        x = h.float()
        x = x + self.block(self.block_norm(x))
        return self.exit_norm(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., D) layer-k states -> (..., V) float32 draft logits alpha * head(exit_norm(...)); a trained head
        over a trimmed map gives -inf off its ids."""
        if self.head == "trained":
            small = self.logits(h)  # (..., N) or (..., V)
            return small if self.head_map is None else self.head_map.expand(small)
        head = _base(self.lm_head)
        x = self.features(h).to(head.weight.dtype)
        bias = None if head.bias is None else head.bias.detach()
        return F.linear(x, head.weight.detach(), bias).float() * self.logit_scale  # the head never trains here

    def logits(self, h: torch.Tensor, vocab: TrimmedHead | None = None) -> torch.Tensor:
        """(..., D) layer-k states -> float32 logits on the drafter's vocabulary: (..., N) on `vocab`'s ids, or
        (..., V) with vocab=None. A trained head scores its own ids: `vocab` must be None or hold those ids."""
        if self.head == "trained":
            self.check_vocab(vocab)
            return F.linear(self.features(h), self.head_weight, self.head_bias) * self.logit_scale
        if vocab is None:
            return self(h)
        return vocab.small(self.features(h)).float() * self.logit_scale

    def check_vocab(self, vocab: TrimmedHead | None) -> None:
        """A trained head drafts on its own ids only: `vocab` (the drafter's) must be None or the same map."""
        if self.head != "trained" or vocab is None or vocab is self.head_map:
            return
        if self.head_ids is None or not torch.equal(vocab.ids.to(self.head_ids.device), self.head_ids):
            n = "all" if self.head_ids is None else len(self.head_ids)
            raise ValueError(f"this DVI policy's trained head scores {n} token ids; the drafter's vocab has "
                             f"{len(vocab)} others (draft with vocab=None: the head's own map)")

    def extra_params(self) -> int:
        """Parameters this policy adds to the target: every one it holds, trainable or not -- the exit MLP
        copy (gate, up, down: 3 * D * I, frozen), lora_S, the two norm copies and alpha, and a trained head's
        (N, D) rows. A shared LM head is the model's own and is not counted."""
        return sum(p.numel() for p in self.parameters())

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def named_trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def trainable_state(self) -> dict[str, Any]:
        """What a checkpoint needs: lora_S (peft's state dict), exit_norm, logit_scale (CPU copies)."""
        lora = _peft().get_peft_model_state_dict(self, adapter_name=LORA_S)
        out = {"lora_S": {k: v.detach().cpu().clone() for k, v in lora.items()},
               "exit_norm": self.exit_norm.weight.detach().cpu().clone(),
               "logit_scale": self.logit_scale.detach().cpu().clone()}
        if self.head == "trained":  # a trained head's rows (and bias); its ids are in the file's "head_ids"
            out["head_weight"] = self.head_weight.detach().cpu().clone()
            if self.head_bias is not None:
                out["head_bias"] = self.head_bias.detach().cpu().clone()
        return out

    def target_rows(self) -> torch.Tensor:
        """(N, D) float32: the target's LM-head rows at the trained head's ids (its initialisation)."""
        lm = _base(self.lm_head)
        w = lm.weight.detach() if self.head_ids is None else lm.weight.detach().index_select(0, self.head_ids)
        return w.float()

    @torch.no_grad()
    def head_delta(self, rank: int) -> dict[str, torch.Tensor]:
        """The trained rows as the target's rows + U V: the best rank-`rank` approximation (SVD) of what training
        moved, U (N, r) and V (r, D) on the CPU. A committed file stores these instead of all N x D rows."""
        if self.head != "trained":
            raise ValueError(f"head_delta needs a trained head; this policy's head is {self.head!r}")
        check_int("rank (head delta)", rank, 1)
        u, s, vh = torch.linalg.svd(self.head_weight.detach().float() - self.target_rows(), full_matrices=False)
        r = min(rank, len(s))
        return {"U": (u[:, :r] * s[:r]).cpu(), "V": vh[:r].cpu()}  # (N, r), (r, D)

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        lora = {k: v.float() for k, v in state["lora_S"].items()}  # a committed head may be stored in bf16
        res = _peft().set_peft_model_state_dict(self, lora, adapter_name=LORA_S)
        missing = [k for k in res.missing_keys if LORA_S in k]
        if missing or res.unexpected_keys:
            raise ValueError(f"lora_S state does not fit this policy (rank/split?): missing {missing}, "
                             f"unexpected {res.unexpected_keys}")
        has_rows = "head_weight" in state or "head_delta" in state
        if (self.head == "trained") != has_rows:
            raise ValueError(f"this policy's head is {self.head!r}; the state "
                             f"{'holds' if has_rows else 'lacks'} a trained head's rows")
        if "head_delta" in state:  # a compact file: the target's rows + U V
            d = state["head_delta"]
            state = {**state, "head_weight": self.target_rows().cpu() + d["U"].float() @ d["V"].float()}
        with torch.no_grad():
            self.exit_norm.weight.copy_(state["exit_norm"])
            self.logit_scale.copy_(state["logit_scale"])
            if self.head == "trained":
                if state["head_weight"].shape != self.head_weight.shape:
                    raise ValueError(f"trained head rows {tuple(state['head_weight'].shape)} do not fit this "
                                     f"policy's {tuple(self.head_weight.shape)}")
                self.head_weight.copy_(state["head_weight"])
                if self.head_bias is not None:
                    self.head_bias.copy_(state["head_bias"])

    @torch.no_grad()
    def head_norm(self) -> float:
        """Frobenius norm of the exit head's trainable weights (lora_S + exit_norm), alpha and a trained LM
        head's rows excluded (those start at the target's, far from 0)."""
        return math.sqrt(sum(float(p.float().pow(2).sum()) for n, p in self.named_trainable().items()
                             if n not in ("logit_scale", "head_weight", "head_bias")))


# ----------------------------------------------------------------------------------------------
# the verifier's LoRA (slow updates), in the model itself


def verifier_lora_params(model) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if f".{LORA_D}." in n]


def attach_verifier_lora(model, split: int, lora_rank: int = 8, lora_alpha: float = 16.0) -> list[nn.Parameter]:
    """Inject LoRA "lora_D" into every linear module of the deep layers [split, L), IN PLACE; zero at init.

    Idempotent: a model that already carries lora_D (for the same split) keeps it and its weights.
    From now on every method decoding with this model verifies with base + lora_D. The adapter
    weights are kept in float32 (peft casts the input and adds the result back in the base dtype).
    peft also sets requires_grad=False on every base weight of the model: they stay frozen.
    """
    layers = model.model.layers
    check_split(split, len(layers))
    check_int("lora_rank", lora_rank, 1)
    done = getattr(model, "_dvi_lora_D", None)
    if done is not None:
        if done != (split, lora_rank):
            raise ValueError(f"model already carries lora_D for split {done[0]} with rank {done[1]}; "
                             f"got split {split}, rank {lora_rank} (load a fresh model)")
        return verifier_lora_params(model)
    names = [f"model.layers.{i}.{n}" for i in range(split, len(layers))
             for n, m in layers[i].named_modules() if isinstance(m, nn.Linear)]
    cfg = _peft().LoraConfig(r=lora_rank, lora_alpha=float(lora_alpha), lora_dropout=0.0, target_modules=names)
    with torch.random.fork_rng(devices=[]):
        _peft().inject_adapter_in_model(cfg, model, adapter_name=LORA_D)  # also freezes every base weight
    for p in verifier_lora_params(model):
        p.data = p.data.float()
    model._dvi_lora_D = (split, lora_rank)
    return verifier_lora_params(model)


def verifier_lora_state(model) -> dict[str, torch.Tensor] | None:
    if getattr(model, "_dvi_lora_D", None) is None:
        return None
    sd = _peft().get_peft_model_state_dict(model, adapter_name=LORA_D)
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def load_verifier_lora_state(model, state: dict[str, torch.Tensor]) -> None:
    res = _peft().set_peft_model_state_dict(model, state, adapter_name=LORA_D)
    if res.unexpected_keys:
        raise ValueError(f"lora_D state does not fit this model: unexpected {res.unexpected_keys[:4]}")


# ----------------------------------------------------------------------------------------------
# loading a saved policy


def policy_file(model) -> Path:
    """Where this model's DVI policy lives: data/dvi/ for the course model, build/models/<fingerprint>/dvi/."""
    return artifacts_dir(model) / "dvi" / POLICY_FILE


def load_policy(model, state: str | Path | None = None, split: int | None = None,
                load_verifier: bool = False) -> DVIPolicy:
    """The DVI policy saved in `state` (a dir with policy.pt, or the file; None = this model's policy_file).

    Loaded once per model and file (models.artifacts.load_cached). split=None takes the policy's own
    exit layer; a given split must match it. load_verifier=True also attaches the checkpoint's lora_D
    to the model IN PLACE (the updated verifier); by default it is ignored and decoding stays lossless
    w.r.t. the base model.
    """
    p = Path(state) if state is not None else policy_file(model).parent
    f = p / POLICY_FILE if p.suffix != ".pt" else p
    if not f.is_file():
        k = split if split is not None else default_split(len(model.model.layers))
        raise FileNotFoundError(f"no DVI policy at {f}; train one with `python -m dvi_lite dvi --steps 300 "
                                f"--split {k} --out {p}` (or pass state=<dir with policy.pt>)")
    pol = load_cached("dvi", model, f, lambda: _read_policy(model, f, load_verifier), extra=load_verifier)
    if split is not None and split != pol.split:
        raise ValueError(f"split {split} requested but the DVI policy at {f} was trained for split {pol.split}")
    return pol


def _read_policy(model, f: Path, load_verifier: bool) -> DVIPolicy:
    b = load_torch(f, "DVI policy", keys=("fingerprint", "split", "lora_rank", "lora_alpha", "policy"))
    if b["fingerprint"] != fingerprint(model):
        raise ValueError(f"DVI policy {f} was trained for another model; train one for this model with "
                         "`python -m dvi_lite dvi --model <path>`")
    head, head_ids = b.get("head", "shared"), b.get("head_ids")  # files before the option: a shared head
    with torch.random.fork_rng(devices=[]):  # peft's init draws random numbers: leave the caller's RNG alone
        pol = DVIPolicy(model, b["split"], b["lora_rank"], b["lora_alpha"], head=head,
                        head_ids=None if head_ids is None else head_ids.long())
    pol.load_trainable_state(b["policy"])
    # the trimmed head it was trained on: size N (None: full vocabulary); a trained head carries its own ids
    pol.trained_vocab = b.get("vocab") if head == "shared" else pol.head_ids
    pol.eval()
    if load_verifier and b["lora_D"] is not None:
        attach_verifier_lora(model, b["split"], b["lora_rank"], b["lora_alpha"])
        load_verifier_lora_state(model, b["lora_D"])
    return pol
