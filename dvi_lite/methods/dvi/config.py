"""DVIConfig: every knob of the online learner in one dataclass, a comment per default, checked on construction.

A bad value here would otherwise show up much later as a NaN loss or a silently frozen term, so the
config validates itself and names the first bad parameter.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from dvi_lite.core.checks import RenamedFields, default_split, is_int, is_real

RL_VARIANTS = ("reinforce", "surrogate", "accepted")  # accepted: the reference trainer's default
HEADS = ("shared", "trained")  # the draft LM head: the model's own, frozen; or a trainable copy of its rows


def is_finite(x: Any) -> bool:
    """A real number that is neither NaN nor infinite (a loss weight or a rate must be one)."""
    return is_real(x) and math.isfinite(x)


@dataclass
class DVIConfig(RenamedFields):
    renamed_fields = ("tau",)  # DVIConfig(tau=...) fails: tau is now t_lambda (τ is tokens per target forward)
    # fast update (draft, policy improvement)
    t_lambda: float = 200.0  # T_λ, the time constant of lambda_t = exp(-t / T_λ), in fast steps: the KL-dominated
    # warm-up length
    kl_floor: float = 0.05  # lambda never drops below this: a residual KL keeps the draft near the verifier
    # the policy term: "reinforce" (the paper's: reward-driven, -(r - b) log q(token) on the accept bits, EMA
    # baseline b) or "surrogate" (-log q(top1 of p): online distillation, never reads the reward)
    rl_variant: str = "reinforce"
    ce_weight: float = 0.2  # weight of the CE anchor on the verifier's top-1 (dense signal from step 1)
    ce_decay: float = 1.0  # anchor weight is ce_weight * ce_decay**t; 1.0 = constant (no decay)
    baseline_beta: float = 0.9  # EMA factor of the REINFORCE baseline b (higher = slower, smoother)
    accepted_only: bool = False  # sample only accepted experiences (less variance, more bias; off for warm-up)
    backoff_min: int | None = None  # accepted_only: fewer accepted than this -> sample all (None = batch_size)
    teacher_temperature: float = 1.0  # temperature of p in the KL term (1.0 = sharp teacher, the decision it makes)
    lr: float = 1e-3  # draft (fast) learning rate
    grad_clip: float = 1.0  # global grad-norm clip of each update
    fast_every: int = 32  # new experiences between two fast updates
    batch_size: int = 32  # experiences per fast update
    buffer_size: int = 4096  # replay capacity (ring: the oldest experiences are overwritten)
    # slow update (verifier maintenance)
    slow_every: int = 20  # fast updates between two slow updates
    slow_lr: float = 1e-4  # verifier (slow) learning rate: conservative by design
    beta_kl: float = 0.1  # weight of KL(pi_phi || pi_phi_old), keeps the verifier from drifting
    lora_rank: int = 8  # rank of the LoRA adapters
    lora_alpha: float = 16.0  # LoRA scaling numerator (scale = alpha / rank)
    # draft head capacity: "shared" = the model's LM head, frozen (trainable: lora_S, exit_norm, alpha; ~51k values
    # on SmolLM2 at rank 8); "trained" = the reference's trainable draft LM head, a copy of the target's rows over
    # the drafter's vocabulary (the trimmed map's N rows, or all V) initialised from the target (+ lora_S, ...)
    head: str = "shared"
    head_lr_mult: float = 0.1  # the trained head's lr = lr * head_lr_mult (its rows start at the target's: move gently)
    # model / run
    split: int | None = None  # exit layer k: draft = layers [0, k) + head, verifier = [k, L); None = default_split(L)
    seed: int = 0  # buffer sampling, init

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, n_layers: int | None = None) -> DVIConfig:
        """Raise ValueError naming the first bad parameter; with n_layers also check 0 < split < n_layers.

        Returns self so that `cfg.validate(n)` can be chained.
        """
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("t_lambda", "teacher_temperature", "lr", "slow_lr", "lora_alpha", "grad_clip"):
            v = getattr(self, name)
            if not is_finite(v) or v <= 0:
                raise bad(name, "a finite number > 0")
        if not is_finite(self.kl_floor) or not 0.0 <= self.kl_floor <= 1.0:
            raise bad("kl_floor", "a number in [0, 1]")
        if self.head not in HEADS:
            raise bad("head", f"one of {HEADS}")
        if not is_finite(self.head_lr_mult) or self.head_lr_mult <= 0:
            raise bad("head_lr_mult", "a finite number > 0")
        if self.rl_variant not in RL_VARIANTS:
            raise bad("rl_variant", f"one of {RL_VARIANTS}")
        if not is_finite(self.ce_weight) or self.ce_weight < 0:
            raise bad("ce_weight", "a finite number >= 0")
        if not is_finite(self.ce_decay) or not 0.0 < self.ce_decay <= 1.0:
            raise bad("ce_decay", "a number in (0, 1] (1 = no decay)")
        if not is_finite(self.baseline_beta) or not 0.0 <= self.baseline_beta < 1.0:
            raise bad("baseline_beta", "a number in [0, 1)")
        if not is_finite(self.beta_kl) or self.beta_kl < 0:
            raise bad("beta_kl", "a finite number >= 0")
        if not isinstance(self.accepted_only, bool):
            raise bad("accepted_only", "a bool")
        for name in ("fast_every", "batch_size", "buffer_size", "slow_every", "lora_rank"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise bad(name, "an int >= 1")
        if self.batch_size > self.buffer_size:
            raise ValueError(f"batch_size must be <= buffer_size ({self.buffer_size}), got {self.batch_size!r}")
        if self.backoff_min is not None and (not is_int(self.backoff_min) or self.backoff_min < 1):
            raise bad("backoff_min", "None or an int >= 1")
        if not is_int(self.seed):
            raise bad("seed", "an int")
        if self.split is not None and (not is_int(self.split) or self.split < 1):
            raise bad("split", "None or an int >= 1 (exit layer k)")
        if n_layers is not None and self.split is not None and not self.split < n_layers:
            raise bad("split", f"an int with 0 < split < {n_layers} (the model's layers)")
        return self

    def for_layers(self, n_layers: int) -> DVIConfig:
        """This config checked against a model of n_layers; split=None becomes default_split(n_layers).

        Returns self when split is already set (so a caller's config object is the trainer's), else a copy.
        """
        cfg = self if self.split is not None else dataclasses.replace(self, split=default_split(n_layers))
        return cfg.validate(n_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
