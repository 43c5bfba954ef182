"""DVI (Draft -> Verify -> Improve): self-speculative decoding whose draft learns online from the verifier.

Kangaroo's split (the target's first k layers draft, layers [k, L) verify, the shallow KV cache and
hidden states are shared) plus a learner: every draft token the verifier tests becomes an experience
(h_k, token, reward r = accepted, the verifier's logits) in a replay buffer, and every `fast_every` new
experiences a *fast update* trains the draft with dvi_core.fast_loss (KL warm-up -> RL, lambda_t).
Optional *slow updates* keep a LoRA on the verifier (the deep layers) tracking the stream.

The draft policy pi_theta(t | h_k)
----------------------------------
    h_k  --(layers [0, k) of the BASE model, shared with verification)
    x    = h_k + ExitMLP(norm_b(h_k))        ExitMLP: a copy of layer k's MLP carrying LoRA "lora_S";
                                              its output projection's base weight is zero, so the branch
                                              is exactly LoRA's B A (...) = 0 at init
    q    = softmax(alpha * lm_head(exit_norm(x)))   exit_norm: clone of the final RMSNorm (trainable);
                                              lm_head: the model's own, shared and frozen; alpha: a
                                              learnable logit scale, init 1

Design decision: where lora_S lives (losslessness + shallow reuse)
------------------------------------------------------------------
The obvious place for the draft's LoRA, the shallow layers [0, k), is the one place it must not be:
those layers are *shared* with verification, so a LoRA there changes h_k for the verifier too. The
system would still be lossless, but w.r.t. the LoRA'd model (greedy = greedy of a model that drifts
every fast step), not the base model. Running the LoRA'd shallow layers into a separate draft cache
would restore losslessness but give up the shallow reuse (verification recomputes [0, k)), and h_k
would depend on theta, so a replayed h_k would be stale (replay would need whole contexts).

So lora_S lives in a draft-only, position-wise exit block *after* layer k:
  (a) lossless w.r.t. the base model: the verifier (layers [0, L) + the final norm + the LM head)
      never runs a lora_S weight; greedy DVI == plain greedy of the base model, at any training step;
  (b) shallow reuse: layers [0, k) are the base model's, so the drafting pass's KV cache and h_k are
      exactly what verification needs (Proposal.hidden, as early_exit / kangaroo);
  (c) peft-managed: lora_S is injected by peft (inject_adapter_in_model, adapter_name="lora_S") into
      the exit block, saved and loaded with get/set_peft_model_state_dict;
  (d) exact replay: pi_theta depends on h_k only (no attention, no own KV cache), so the buffer's
      (h_k, token) pairs re-evaluate exactly under the current theta, and there is no "last draft
      token" cache bookkeeping (Kangaroo's adapter cache) at all; updates between sequences never leave
      a stale cache behind. The price: the head cannot attend (Kangaroo's adapter can).
  (e) zero start: at step 0 the draft is exactly the early-exit draft (`method="early_exit"`).

lora_D (slow updates) is OFF by default. Enabling it injects a LoRA into the model's deep layers
[k, L) *in place* (peft, adapter_name="lora_D", zero-initialised so nothing changes until trained);
the verifier is then the updated model, and decoding stays lossless w.r.t. that *updated* verifier
(the seed's design), no longer w.r.t. the base model. Slow updates run between sequences, so one
sequence is always verified by one model (its deep KV cache is never stale).

Pieces: DVIPolicy (the draft head), DVIDrafter (drafts with it, collects experiences in feedback()),
OnlineTrainer (decode -> buffer -> fast/slow updates, JSONL diagnostics, callback, NaN guard,
checkpoints with exact resume), `method="dvi"` (a saved policy), evaluate(), and the CLI
`python -m dvi_lite.methods.dvi.learner --steps N --split 2 --out data/dvi` (also the GPU entry point).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from dvi_lite.paths import DATA_DIR
from dvi_lite.methods.dvi.losses import DVIConfig, EMABaseline, ReplayBuffer, fast_loss, rng_state, set_rng_state, slow_loss
from dvi_lite.methods.early_exit import EarlyExitDrafter, check_split, check_threshold
from dvi_lite.core.engine import DecodeState, Outcome, acceptance_rate, decode
from dvi_lite.models.artifacts import artifacts_dir, fingerprint
from dvi_lite.core.generate import generate
from dvi_lite.core.runner import Runner
from dvi_lite.study.provenance import ROOT, provenance
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.course_model.train import lr_at

LORA_S, LORA_D = "lora_S", "lora_D"
DVI_DIR = DATA_DIR / "dvi"  # default `state` of method="dvi": policy.pt (+ card.json, log.jsonl)
POLICY_FILE, TRAINER_FILE = "policy.pt", "trainer.pt"
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def _peft():
    import peft  # imported lazily: every other method works without touching peft

    return peft


def _base(linear: nn.Module) -> nn.Module:
    """The plain nn.Linear under a peft wrapper (or the module itself)."""
    return linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear


def _check_int(name: str, v: Any, lo: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


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
    """pi_theta(. | h_k): residual exit block with LoRA "lora_S" -> exit_norm -> shared LM head -> x alpha.

    Trainable (the fast update's parameters): lora_S, exit_norm.weight, logit_scale. Everything else
    is frozen: the block's base weights, its input norm, and the LM head, which is the model's own
    module (not a copy, not registered as a submodule: it never moves, trains or gets saved here).
    The block runs in float32 whatever the model's dtype (the fast update trains it in fp32); h_k is
    upcast on the way in and cast to the LM head's dtype before the head.
    """

    def __init__(self, model, split: int, lora_rank: int = 8, lora_alpha: float = 16.0):
        super().__init__()
        import copy

        layers = model.model.layers
        self.split = check_split(split, len(layers))
        _check_int("lora_rank", lora_rank, 1)
        if not isinstance(lora_alpha, (int, float)) or not math.isfinite(lora_alpha) or lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be a finite number > 0, got {lora_alpha!r}")
        self.lora_rank, self.lora_alpha = lora_rank, float(lora_alpha)
        layer = layers[split]  # the first deep layer: the block starts from its MLP
        for n in MLP_LINEARS:
            if not hasattr(layer.mlp, n):
                raise ValueError(f"DVI needs a gated (gate/up/down_proj) MLP in layer {split}, got {type(layer.mlp).__name__}")
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

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """(..., D) h_k -> (..., D) normalised exit features (float32)."""
        x = h.float()
        x = x + self.block(self.block_norm(x))
        return self.exit_norm(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., D) layer-k states -> (..., V) float32 draft logits alpha * lm_head(exit_norm(...))."""
        head = _base(self.lm_head)
        x = self.features(h).to(head.weight.dtype)
        bias = None if head.bias is None else head.bias.detach()
        return F.linear(x, head.weight.detach(), bias).float() * self.logit_scale  # the head never trains here

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def named_trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def trainable_state(self) -> dict[str, Any]:
        """What a checkpoint needs: lora_S (peft's state dict), exit_norm, logit_scale (CPU copies)."""
        lora = _peft().get_peft_model_state_dict(self, adapter_name=LORA_S)
        return {"lora_S": {k: v.detach().cpu().clone() for k, v in lora.items()},
                "exit_norm": self.exit_norm.weight.detach().cpu().clone(),
                "logit_scale": self.logit_scale.detach().cpu().clone()}

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        res = _peft().set_peft_model_state_dict(self, state["lora_S"], adapter_name=LORA_S)
        missing = [k for k in res.missing_keys if LORA_S in k]
        if missing or res.unexpected_keys:
            raise ValueError(f"lora_S state does not fit this policy (rank/split?): missing {missing}, "
                             f"unexpected {res.unexpected_keys}")
        with torch.no_grad():
            self.exit_norm.weight.copy_(state["exit_norm"])
            self.logit_scale.copy_(state["logit_scale"])

    @torch.no_grad()
    def head_norm(self) -> float:
        """Frobenius norm of the exit head's trainable weights (lora_S + exit_norm), alpha excluded."""
        return math.sqrt(sum(float(p.float().pow(2).sum()) for n, p in self.named_trainable().items()
                             if n != "logit_scale"))


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
    _check_int("lora_rank", lora_rank, 1)
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
# the drafter


class DVIDrafter(EarlyExitDrafter):
    """Early exit at layer k with the DVI policy as exit head; collects experiences when `collect`.

    feedback(): the verifier tests drafts in order until the first rejection, so a step with n drafts
    and a accepted yields min(n, a + 1) experiences: draft i (0-based) was produced from the layer-k
    state of input i ([pending, d1, ...], Proposal.hidden[:, i]), its reward is 1 if i < a else 0,
    and the verifier's logits at input i (Outcome.p_logits[i]) are exactly the distribution it was
    judged against. Drafts after the first rejection were never tested: no reward, not stored.
    The policy has no cache of its own (it is position-wise), so nothing needs rolling back.
    """
    name = "dvi"

    def __init__(self, runner: Runner, policy: DVIPolicy, max_steps: int = 6, threshold: float | None = None,
                 collect: bool = False):
        super().__init__(runner, policy.split, max_steps, threshold, branch=1)
        self.policy = policy
        self.collect = collect
        self._pending: list[tuple[torch.Tensor, ...]] = []

    def exit_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.policy(h).to(self.runner.lm_head.weight.dtype)

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        if not self.collect:
            return
        prop, a = outcome.proposal, outcome.n_accepted
        tested = min(len(prop), a + 1)
        if tested == 0:
            return
        rewards = (torch.arange(tested, device=prop.tokens.device) < a).float()
        self._pending.append((prop.hidden[0, :tested], prop.tokens[:tested], rewards, outcome.p_logits[:tested]))

    def drain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The experiences collected since the last drain: h (n, D), tokens (n,), rewards (n,), logits (n, V)."""
        if not self._pending:
            return None
        out = tuple(torch.cat(parts) for parts in zip(*self._pending))
        self._pending = []
        return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# the online trainer


class NonFiniteError(FloatingPointError):
    """A DVI update produced a NaN/inf loss or gradient; the update was not applied."""


class OnlineTrainer:
    """The online DVI loop on a stream of prompts (token-id lists, cycled in order).

        repeat: decode the next prompt with the shared engine (greedy by default) -> experiences into
                the ReplayBuffer -> while >= fast_every unconsumed experiences: a fast update of the
                draft (lora_S, exit_norm, alpha); every slow_every fast steps a slow update of lora_D
                (only with slow_updates=True).

    Updates run between sequences: a sequence is drafted by one policy and verified by one verifier,
    and the state between sequences (parameters, optimisers, buffer, counters, RNGs) is everything a
    checkpoint needs for an exact resume. `train(n, callback)` runs n fast steps and returns their
    diagnostics (one dict per step; also appended to `log_path` as JSONL and passed to `callback`).
    """

    def __init__(self, model, prompts: Sequence[Sequence[int]], cfg: DVIConfig | None = None, *,
                 slow_updates: bool = False, max_new_tokens: int = 64, max_steps: int = 6,
                 threshold: float | None = None, temperature: float = 0.0, total_steps: int | None = None,
                 warmup: int = 10, min_lr_frac: float = 0.1, slow_inner: int = 4, slow_batch: int = 4,
                 slow_history: int = 64, eos_token_id: int | None = None, log_path: str | Path | None = None,
                 ckpt_dir: str | Path | None = None, ckpt_every: int = 0,
                 buffer_logits_dtype: torch.dtype = torch.float32, progress: bool = True):
        self.cfg = cfg if cfg is not None else DVIConfig()
        self.runner = Runner.for_model(model)
        self.model = model
        self.cfg.validate(self.runner.n_layers)
        self.prompts = [list(map(int, p)) for p in prompts]
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        self.max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 2)
        ctx = getattr(model.config, "max_position_embeddings", None)
        vocab = _base(model.lm_head).weight.shape[0]
        for i, p in enumerate(self.prompts):
            if ctx is not None and len(p) + max_new_tokens > ctx:
                raise ValueError(f"prompts[{i}] ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {ctx}; cut the prompts (train_prompts(max_len=...))")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab}), got {min(p)}..{max(p)}")
        self.max_steps = _check_int("max_steps", max_steps, 1)
        self.threshold = None if threshold is None else check_threshold(threshold)
        self.sampler = Sampler(temperature)
        if total_steps is not None:
            _check_int("total_steps", total_steps, 1)
        self.total_steps, self.warmup = total_steps, _check_int("warmup", warmup, 0)
        if not isinstance(min_lr_frac, (int, float)) or not 0.0 <= min_lr_frac <= 1.0:
            raise ValueError(f"min_lr_frac must be in [0, 1], got {min_lr_frac!r}")
        self.min_lr_frac = float(min_lr_frac)
        self.slow_inner = _check_int("slow_inner", slow_inner, 1)
        self.slow_batch = _check_int("slow_batch", slow_batch, 1)
        self.slow_history = _check_int("slow_history", slow_history, 1)
        self.ckpt_every = _check_int("ckpt_every", ckpt_every, 0)
        self.eos_token_id, self.progress = eos_token_id, progress
        self.log_path = Path(log_path) if log_path is not None else None
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.last_good_checkpoint: Path | None = None
        c = self.cfg
        with torch.random.fork_rng(devices=[]):  # deterministic init that leaves the caller's RNG alone
            torch.manual_seed(c.seed)
            self.policy = DVIPolicy(model, c.split, c.lora_rank, c.lora_alpha)
        self.fast_opt = torch.optim.AdamW(self.policy.trainable(), lr=c.lr, weight_decay=0.0)
        self.slow_updates = bool(slow_updates)
        self.slow_opt = None
        if self.slow_updates:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(c.seed + 1)
                params = attach_verifier_lora(model, c.split, c.lora_rank, c.lora_alpha)
            self.slow_opt = torch.optim.AdamW(params, lr=c.slow_lr, weight_decay=0.0)
        self.buffer = ReplayBuffer(c.buffer_size, buffer_logits_dtype)
        self.baseline = EMABaseline(c.baseline_beta)
        self.gen = torch.Generator().manual_seed(c.seed)  # buffer and slow-batch sampling
        self.fast_step = self.slow_step = 0
        self.prompt_idx = 0  # prompts consumed so far (the next one is prompts[prompt_idx % n])
        self.unconsumed = 0  # experiences added since they were last "paid for" by a fast update
        self.fresh_rewards: list[float] = []  # rewards since the last fast update (acceptance, baseline)
        self.sequences: list[list[int]] = []  # recent prompt + output ids: the slow update's data
        self.tokens_generated = 0
        self.elapsed = 0.0
        self.recent: dict[str, float] = {}  # stats of the sequences since the last fast update
        self._recent_acc: list[tuple[int, int]] = []
        self._recent_time = self._recent_new = 0.0
        self.meta: dict[str, Any] = {}  # free-form (the CLI keeps the before-training evaluation here)

    # ------------------------------------------------------------------ decoding
    def lr(self, step: int) -> float:
        if self.total_steps is None:  # open-ended stream: warm-up, then constant
            return self.cfg.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.cfg.lr
        return lr_at(step, SimpleNamespace(lr=self.cfg.lr, warmup=self.warmup, steps=self.total_steps,
                                           min_lr_frac=self.min_lr_frac))

    def _decode_next(self) -> int:
        ids = self.prompts[self.prompt_idx % len(self.prompts)]
        self.prompt_idx += 1
        drafter = DVIDrafter(self.runner, self.policy, self.max_steps, self.threshold, collect=True)
        gen = make_generator(self.cfg.seed * 1_000_003 + self.prompt_idx, self.runner.device)
        self.policy.eval()
        new, stats = decode(self.runner, drafter, ids, self.max_new_tokens, self.sampler, gen,
                            self.eos_token_id, max_draft=drafter.max_draft)
        got = drafter.drain()
        n = 0
        if got is not None:
            h, tokens, rewards, logits = got
            self.buffer.add(h, tokens, rewards, logits)
            n = h.shape[0]
            self.unconsumed += n
            self.fresh_rewards += rewards.tolist()
        self.sequences = (self.sequences + [ids + new])[-self.slow_history:]
        self.tokens_generated += len(new)
        self._recent_acc += [(s.depth, s.accepted) for s in stats.steps]
        self._recent_time += stats.total_s
        self._recent_new += stats.new_tokens
        r = self.runner
        kv_pos = len(ids) + len(new)
        cfg = r.model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        elt = r.lm_head.weight.element_size()
        self.recent.update(kv_positions=kv_pos, kv_mib=2 * r.n_layers * n_kv * hd * kv_pos * elt / 2**20)
        return n

    # ------------------------------------------------------------------ updates
    def _nonfinite(self, what: str, parts: dict[str, float]) -> NonFiniteError:
        ck = str(self.last_good_checkpoint) if self.last_good_checkpoint else "none saved in this run"
        return NonFiniteError(
            f"DVI stopped: non-finite {what} at fast step {self.fast_step} (slow step {self.slow_step}); "
            f"components {parts}. The update was NOT applied: the parameters are those after the last good step, "
            f"and no checkpoint was written for it (last good checkpoint: {ck}). Try a lower lr / slow_lr, "
            f"a lower grad_clip, or check the model's dtype (fp16 overflows; use bf16 or fp32).")

    def _fast_update(self) -> dict[str, Any]:
        c, t = self.cfg, self.fast_step
        lr = self.lr(t)
        for g in self.fast_opt.param_groups:
            g["lr"] = lr
        batch = self.buffer.sample(c.batch_size, self.gen, c.accepted_only, c.backoff_min)
        dev = self.runner.device
        self.policy.train()
        s = self.policy(batch["h"].to(dev))  # (B, V) float32, with grad
        tl = batch["teacher_logits"].to(dev)  # (B, V)
        loss, parts = fast_loss({"student_logits": s, "teacher_logits": tl, "tokens": batch["tokens"].to(dev),
                                 "rewards": batch["rewards"].to(dev)}, c, t, self.baseline)
        self.policy.eval()
        if not math.isfinite(parts["total"]):
            raise self._nonfinite("fast loss", parts)
        self.fast_opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.policy.trainable(), c.grad_clip))
        if not math.isfinite(gnorm):
            self.fast_opt.zero_grad(set_to_none=True)
            raise self._nonfinite("fast gradient", {**parts, "grad_norm": gnorm})
        self.fast_opt.step()
        fresh = torch.tensor(self.fresh_rewards)
        self.baseline.update(fresh)  # after the loss: b never depends on the rewards it is subtracted from
        self.fresh_rewards = []
        with torch.no_grad():
            sd = s.detach()
            top1 = tl.argmax(-1)
            pi_v = sd.softmax(-1).gather(-1, top1[:, None]).mean().item()
            agree = (sd.argmax(-1) == top1).float().mean().item()
        self.fast_step += 1
        if self._recent_acc:  # sequences decoded since the last step; else the last measurement carries over
            taus = [a + 1 for _, a in self._recent_acc]
            self.recent.update(accept_rate=acceptance_rate(self._recent_acc), tau=sum(taus) / len(taus),
                               tokens_per_s=self._recent_new / self._recent_time if self._recent_time > 0 else None)
        rec = {"step": self.fast_step, "lambda": parts["lambda"], "lr": lr, "loss": parts["total"],
               "l_rl": parts["l_rl"], "l_kl": parts["l_kl"], "l_ce": parts["l_ce"], "ce_weight": parts["ce_weight"],
               "baseline": self.baseline.value, "grad_norm": gnorm, "fresh": int(fresh.numel()),
               "accept_rate": self.recent.get("accept_rate"), "tau": self.recent.get("tau"),
               "pi_s_v": pi_v, "top1_agree": agree, "std_s": sd.std(-1).mean().item(), "std_t": tl.std(-1).mean().item(),
               "logit_scale": self.policy.logit_scale.item(), "head_norm": self.policy.head_norm(),
               "backoff": bool(batch["backoff"]), "buffer": len(self.buffer), "samples_seen": self.buffer.n_seen,
               "sequences": self.prompt_idx, "tokens_generated": self.tokens_generated,
               "tokens_per_s": self.recent.get("tokens_per_s"),
               "kv_positions": self.recent.get("kv_positions"), "kv_mib": self.recent.get("kv_mib")}
        self._recent_acc, self._recent_time, self._recent_new = [], 0.0, 0.0
        return rec

    def _verifier_logits(self, ids: torch.Tensor, hk: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.runner.logits(self.runner.layers_forward(hk, None, pos, self.cfg.split))[0].float()  # (T, V)

    def _slow_update(self) -> dict[str, Any]:
        """`slow_inner` AdamW steps of lora_D on recent sequences: CE(next token) + beta_kl KL(new || old).

        "old" is a frozen copy of the verifier's outputs at the start of this slow update (computed once,
        no grad), so the KL bounds how far one slow update can move the verifier.
        """
        c, r = self.cfg, self.runner
        dev = r.device
        pick = torch.randperm(len(self.sequences), generator=self.gen)[: self.slow_batch].tolist()
        data = []
        with torch.no_grad():
            for i in pick:
                ids = torch.tensor([self.sequences[i]], device=dev)  # (1, T)
                pos = torch.arange(ids.shape[1], device=dev)[None]
                hk = r.layers_forward(r.embed(ids), None, pos, 0, c.split)  # base shallow layers, shared
                data.append((ids, hk, self._verifier_logits(ids, hk)))
        params = verifier_lora_params(self.model)
        losses = []
        for _ in range(self.slow_inner):
            total = sum(slow_loss(self._verifier_logits(ids, hk)[:-1], old[:-1], ids[0, 1:], c.beta_kl)
                        for ids, hk, old in data) / len(data)
            lv = total.item()
            if not math.isfinite(lv):
                raise self._nonfinite("slow loss", {"slow_loss": lv})
            self.slow_opt.zero_grad(set_to_none=True)
            total.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, c.grad_clip))
            if not math.isfinite(gnorm):
                self.slow_opt.zero_grad(set_to_none=True)
                raise self._nonfinite("slow gradient", {"slow_loss": lv, "grad_norm": gnorm})
            self.slow_opt.step()
            losses.append(lv)
        self.slow_step += 1
        with torch.no_grad():
            d_norm = math.sqrt(sum(float(p.pow(2).sum()) for p in params))
        return {"slow_step": self.slow_step, "slow_loss_first": losses[0], "slow_loss_last": losses[-1],
                "lora_D_norm": d_norm}

    # ------------------------------------------------------------------ the loop
    def train(self, steps: int, callback: Callable[[dict], Any] | None = None, progress: bool | None = None) -> list[dict]:
        """Run `steps` more fast updates (decoding as many prompts as needed); returns one dict per step.

        callback(record) is called after every fast step (e.g. a notebook widget's live plot); the
        same record is appended to log_path (JSONL). With ckpt_dir and ckpt_every > 0, a checkpoint
        is written every ckpt_every fast steps (and the last good one survives a NaN stop).
        """
        _check_int("steps", steps, 0)
        c = self.cfg
        target = self.fast_step + steps
        records: list[dict] = []
        show = self.progress if progress is None else progress
        bar = tqdm(total=steps, desc=f"DVI k={c.split}", disable=not show)
        dry = 0  # sequences in a row that gave no experience (e.g. every output stops at eos at once)
        t0 = time.perf_counter()
        try:
            while self.fast_step < target:
                if self.unconsumed >= c.fast_every:
                    rec = self._fast_update()
                    self.unconsumed -= c.fast_every
                    if self.slow_updates and self.fast_step % c.slow_every == 0:
                        rec.update(self._slow_update())
                    self.elapsed += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    rec["elapsed_s"] = self.elapsed
                    records.append(rec)
                    self._log(rec)
                    if callback is not None:
                        callback(rec)
                    bar.update(1)
                    bar.set_postfix(acc=f"{rec['accept_rate'] if rec['accept_rate'] is not None else float('nan'):.2f}",
                                    lam=f"{rec['lambda']:.2f}", loss=f"{rec['loss']:.3f}")
                    if self.ckpt_dir is not None and self.ckpt_every and self.fast_step % self.ckpt_every == 0:
                        self.save_checkpoint()
                    continue
                dry = 0 if self._decode_next() else dry + 1
                if dry > len(self.prompts):
                    raise RuntimeError("DVI: a whole pass over the prompts produced no draft to learn from "
                                       "(outputs end at once?); raise max_new_tokens or check eos_token_id")
        finally:
            self.elapsed += time.perf_counter() - t0
            bar.close()
        return records

    def _log(self, rec: dict) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "fingerprint": fingerprint(self.model), "config": self.cfg.to_dict(),
                "slow_updates": self.slow_updates, "policy": self.policy.trainable_state(),
                "lora_D": verifier_lora_state(self.model) if self.slow_updates else None,
                "fast_opt": self.fast_opt.state_dict(),
                "slow_opt": self.slow_opt.state_dict() if self.slow_opt is not None else None,
                "buffer": self.buffer.state_dict(), "baseline": self.baseline.state_dict(),
                "gen": self.gen.get_state(), "rng": rng_state(),
                "counters": {"fast_step": self.fast_step, "slow_step": self.slow_step, "prompt_idx": self.prompt_idx,
                             "unconsumed": self.unconsumed, "tokens_generated": self.tokens_generated,
                             "elapsed": self.elapsed},
                "fresh_rewards": list(self.fresh_rewards), "sequences": [list(s) for s in self.sequences],
                "recent": {"acc": list(self._recent_acc), "time": self._recent_time, "new": self._recent_new,
                           **self.recent},
                "meta": self.meta}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        if st["fingerprint"] != fingerprint(self.model):
            raise ValueError("DVI checkpoint was trained for another model (fingerprint mismatch)")
        if st["config"] != self.cfg.to_dict():
            diff = {k: (v, st["config"].get(k)) for k, v in self.cfg.to_dict().items() if st["config"].get(k) != v}
            raise ValueError(f"DVI checkpoint config differs from this trainer's (now, saved): {diff}")
        if bool(st["slow_updates"]) != self.slow_updates:
            raise ValueError(f"DVI checkpoint has slow_updates={st['slow_updates']}, this trainer {self.slow_updates}")
        self.policy.load_trainable_state(st["policy"])
        self.fast_opt.load_state_dict(st["fast_opt"])
        if self.slow_updates:
            load_verifier_lora_state(self.model, st["lora_D"])
            self.slow_opt.load_state_dict(st["slow_opt"])
        self.buffer.load_state_dict(st["buffer"])
        self.baseline.load_state_dict(st["baseline"])
        self.gen.set_state(st["gen"])
        set_rng_state(st["rng"])
        k = st["counters"]
        self.fast_step, self.slow_step, self.prompt_idx = k["fast_step"], k["slow_step"], k["prompt_idx"]
        self.unconsumed, self.tokens_generated, self.elapsed = k["unconsumed"], k["tokens_generated"], k["elapsed"]
        self.fresh_rewards = list(st["fresh_rewards"])
        self.sequences = [list(s) for s in st["sequences"]]
        rc = dict(st["recent"])
        self._recent_acc = [tuple(x) for x in rc.pop("acc")]
        self._recent_time, self._recent_new = rc.pop("time"), rc.pop("new")
        self.recent = rc
        self.meta = dict(st.get("meta", {}))

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write trainer.pt (everything for an exact resume) and policy.pt (for method="dvi") into a dir."""
        d = Path(path) if path is not None else self.ckpt_dir
        if d is None:
            raise ValueError("save_checkpoint: give a directory (or construct the trainer with ckpt_dir=...)")
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (TRAINER_FILE + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, d / TRAINER_FILE)
        self.save_policy(d)
        self.last_good_checkpoint = d
        return d

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        """Restore a save_checkpoint() dir into this (freshly built) trainer; the JSONL log is cut back to it."""
        d = Path(path) if path is not None else self.ckpt_dir
        f = None if d is None else d / TRAINER_FILE
        if f is None or not f.is_file():
            raise FileNotFoundError(f"no DVI trainer checkpoint at {f}")
        self.load_state_dict(torch.load(f, map_location="cpu", weights_only=False))
        self.last_good_checkpoint = d
        if self.log_path is not None and self.log_path.is_file():  # drop steps logged after the checkpoint
            keep = [ln for ln in self.log_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= self.fast_step]
            self.log_path.write_text("".join(ln + "\n" for ln in keep))

    def save_policy(self, path: str | Path) -> Path:
        """policy.pt in a dir: what method="dvi" loads (split, model fingerprint, lora_S + head, lora_D)."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        bundle = {"version": 1, "split": self.cfg.split, "fingerprint": fingerprint(self.model),
                  "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha, "fast_step": self.fast_step,
                  "policy": self.policy.trainable_state(),
                  "lora_D": verifier_lora_state(self.model) if self.slow_updates else None}
        tmp = d / (POLICY_FILE + ".tmp")
        torch.save(bundle, tmp)
        os.replace(tmp, d / POLICY_FILE)
        return d / POLICY_FILE


# ----------------------------------------------------------------------------------------------
# loading a trained policy, the method, evaluation


_LOADED: dict = {}


def load_policy(model, state: str | Path | None = None, split: int | None = None,
                load_verifier: bool = False) -> DVIPolicy:
    """The DVI policy saved in `state` (a dir with policy.pt, or the file; None = this model's default:
    data/dvi/ for the course model, build/models/<fingerprint>/dvi/ for another).

    load_verifier=True also attaches the checkpoint's lora_D to the model IN PLACE (the updated
    verifier); by default it is ignored and decoding stays lossless w.r.t. the base model.
    """
    p = Path(state) if state is not None else artifacts_dir(model) / "dvi"
    f = p / POLICY_FILE if p.suffix != ".pt" else p
    if not f.is_file():
        raise FileNotFoundError(f"no DVI policy at {f}; train one with `python -m dvi_lite.methods.dvi.learner --steps 300 "
                                f"--split {split or 2} --out {p}` (or pass state=<dir with policy.pt>)")
    key = (id(model), str(f.resolve()), f.stat().st_mtime_ns, load_verifier)
    hit = _LOADED.get(key)
    if hit is not None and hit[0]() is model:  # (the weakref guards against a recycled id)
        pol = hit[1]
    else:
        b = torch.load(f, map_location="cpu", weights_only=False)
        if b["fingerprint"] != fingerprint(model):
            raise ValueError(f"DVI policy {f} was trained for another model; train one for this model with "
                             "`python -m dvi_lite.methods.dvi.learner --model <path>`")
        with torch.random.fork_rng(devices=[]):
            pol = DVIPolicy(model, b["split"], b["lora_rank"], b["lora_alpha"])
        pol.load_trainable_state(b["policy"])
        pol.eval()
        if load_verifier and b["lora_D"] is not None:
            attach_verifier_lora(model, b["split"], b["lora_rank"], b["lora_alpha"])
            load_verifier_lora_state(model, b["lora_D"])
        _LOADED[key] = (weakref.ref(model), pol)
    if split is not None and split != pol.split:
        raise ValueError(f"split {split} requested but the DVI policy at {f} was trained for split {pol.split}")
    return pol


def make_drafter(model, tokenizer, split: int | None = None, state: str | Path | DVIPolicy | None = None,
         max_steps: int = 6, threshold: float | None = 0.6, load_verifier: bool = False):
    """DVI: the target's first k layers + the trained exit head (lora_S) draft, layers [k, L) verify.

    state: a dir with policy.pt (None = data/dvi/), or a DVIPolicy (e.g. OnlineTrainer.policy).
    Greedy output equals plain greedy decoding of the model (lora_D, if loaded, is part of the model)."""
    r = Runner.for_model(model)
    if split is not None:
        check_split(split, r.n_layers)
    if isinstance(state, DVIPolicy):
        if split is not None and split != state.split:
            raise ValueError(f"split {split} requested but the given DVI policy exits at layer {state.split}")
        policy = state
    else:
        policy = load_policy(model, state, split, load_verifier)
    return DVIDrafter(r, policy, max_steps, threshold)


def evaluate(model, tokenizer, prompts: Sequence[str | Sequence[int]], state: str | Path | DVIPolicy | None = None,
             max_new_tokens: int = 64, max_steps: int = 6, threshold: float | None = None,
             temperature: float = 0.0) -> dict[str, Any]:
    """tau (tokens per target forward), alpha (per-token acceptance) and tokens/s of method="dvi" on prompts.

    Call it before and after training (state=trainer.policy) to see what the online loop bought.
    """
    steps, new, secs = [], 0, 0.0
    for i, p in enumerate(prompts):
        out = generate(model, tokenizer, p if isinstance(p, str) else list(p), method="dvi", state=state,
                       max_new_tokens=max_new_tokens, max_steps=max_steps, threshold=threshold,
                       temperature=temperature, seed=i)
        steps += out.stats.steps
        new += out.stats.new_tokens
        secs += out.stats.total_s
    return {"tau": sum(s.accepted + 1 for s in steps) / len(steps) if steps else None,
            "alpha": acceptance_rate([(s.depth, s.accepted) for s in steps]),
            "tokens_per_s": new / secs if secs > 0 else None, "prompts": len(prompts), "new_tokens": new}


# ----------------------------------------------------------------------------------------------
# CLI


def train_prompts(tok, path: str | Path | None = None, n_per_domain: int = 400, seed: int = 0,
                  max_len: int = 192) -> list[list[int]]:
    """Prompt ids for training: a JSONL file (field 'prompt') or the corpus' train split (never the
    held-out test prompts), each cut to its last max_len tokens, shuffled with `seed`."""
    from dvi_lite.course_model.corpus import load_prompts, make_prompts

    recs = load_prompts(path) if path else make_prompts(n_per_domain, seed, split="train")
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"][-max_len:] for r in recs]
    ids = [x for x in ids if x]
    random.Random(seed).shuffle(ids)
    if not ids:
        raise ValueError("no training prompts")
    return ids


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dvi_lite.methods.dvi.learner",
                                 description="Online DVI training (Draft -> Verify -> Improve) on corpus prompts.")
    ap.add_argument("--steps", type=int, default=300, help="fast updates to run (in total, counting a resumed run's)")
    ap.add_argument("--split", type=int, default=2, help="exit layer k")
    ap.add_argument("--out", default=None, help="policy.pt, card.json, log.jsonl go here (default: data/dvi for the "
                    "course model, build/models/<fingerprint>/dvi for another)")
    ap.add_argument("--ckpt-dir", default=None, help="resume checkpoint dir (default build/ckpt/dvi_k<split>)")
    ap.add_argument("--ckpt-every", type=int, default=25, help="fast steps between checkpoints")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--model", default=None, help="local HF checkpoint (default: the course model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--prompts", default=None, help="JSONL prompts (field 'prompt'); default: corpus train split")
    ap.add_argument("--prompts-per-domain", type=int, default=400)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=6, help="draft tokens per step")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--slow", action="store_true", help="enable slow updates of lora_D (lossless w.r.t. the UPDATED verifier)")
    ap.add_argument("--rl", default=DVIConfig.rl_variant, choices=["surrogate", "reinforce"])
    ap.add_argument("--tau", type=float, default=None, help="lambda time constant (default: steps / 5)")
    ap.add_argument("--kl-floor", type=float, default=DVIConfig.kl_floor)
    ap.add_argument("--lr", type=float, default=DVIConfig.lr)
    ap.add_argument("--lora-rank", type=int, default=DVIConfig.lora_rank)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for tau/alpha before and after (0 = skip)")
    args = ap.parse_args(argv)
    command = "python -m dvi_lite.methods.dvi.learner " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        cfg = DVIConfig(split=args.split, rl_variant=args.rl, tau=args.tau if args.tau is not None else max(1.0, args.steps / 5),
                        kl_floor=args.kl_floor, lr=args.lr, lora_rank=args.lora_rank, seed=args.seed)
        return _run_cli(args, cfg, command)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    return {}


def _run_cli(args, cfg: DVIConfig, command: str) -> dict:
    from dvi_lite.course_model.corpus import load_prompts
    from dvi_lite.models.loading import load_model

    torch.manual_seed(cfg.seed)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    for p in model.parameters():
        p.requires_grad_(False)
    cfg.validate(Runner.for_model(model).n_layers)
    prompts = train_prompts(tok, args.prompts, args.prompts_per_domain, cfg.seed, args.max_prompt_tokens)
    out = Path(args.out) if args.out else artifacts_dir(model) / "dvi"
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else ROOT / "build" / "ckpt" / f"dvi_k{cfg.split}"
    trainer = OnlineTrainer(model, prompts, cfg, slow_updates=args.slow, max_new_tokens=args.max_new_tokens,
                            max_steps=args.max_steps, temperature=args.temperature, total_steps=args.steps,
                            eos_token_id=tok.eos_token_id, log_path=out / "log.jsonl", ckpt_dir=ckpt,
                            ckpt_every=args.ckpt_every)
    if args.resume and (ckpt / TRAINER_FILE).is_file():
        trainer.load_checkpoint()
    elif trainer.log_path.is_file():
        trainer.log_path.unlink()  # a fresh run starts a fresh log
    held = [r["prompt"] for r in load_prompts(n=args.eval_prompts)] if args.eval_prompts else []
    ev = dict(max_new_tokens=args.max_new_tokens, max_steps=args.max_steps, threshold=None)
    if held and "eval_before" not in trainer.meta:
        trainer.meta["eval_before"] = evaluate(model, tok, held, trainer.policy, **ev)
    trainer.train(max(0, args.steps - trainer.fast_step))
    trainer.save_checkpoint()
    trainer.save_policy(out)
    after = evaluate(model, tok, held, trainer.policy, **ev) if held else None
    log = [json.loads(x) for x in trainer.log_path.read_text().splitlines()] if trainer.log_path.is_file() else []
    card = {"method": "dvi", "split": cfg.split, "fast_steps": trainer.fast_step, "slow_steps": trainer.slow_step,
            "slow_updates": trainer.slow_updates, "sequences": trainer.prompt_idx,
            "tokens_generated": trainer.tokens_generated, "experiences": trainer.buffer.n_seen,
            "trainable_params": sum(p.numel() for p in trainer.policy.trainable()),
            "eval_before": trainer.meta.get("eval_before"), "eval_after": after, "eval_prompts": len(held),
            "wall_time_s": trainer.elapsed, "config": cfg.to_dict(),
            "run": {"max_new_tokens": args.max_new_tokens, "max_steps": args.max_steps,
                    "temperature": args.temperature, "dtype": str(next(model.parameters()).dtype),
                    "model": args.model or "course model", "prompts": args.prompts or "corpus train split"},
            "provenance": provenance(command, device=Runner.for_model(model).device),
            "log": log[:: max(1, len(log) // 100)]}
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps({k: card[k] for k in ("split", "fast_steps", "eval_before", "eval_after", "wall_time_s")}))
    return card


if __name__ == "__main__":
    # `python -m dvi_lite.methods.dvi.learner` runs this file a second time as __main__ (the package already imported it
    # to register the method; runpy warns about that). Use the package's copy for everything, so there is
    # one DVIPolicy class and METHODS["dvi"] is the package's factory.
    from dvi_lite import dvi as _dvi_module
    from dvi_lite.core.generate import METHODS

    METHODS["dvi"] = _dvi_module._dvi
    _dvi_module.main()
