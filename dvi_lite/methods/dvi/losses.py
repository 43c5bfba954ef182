"""DVI (Draft -> Verify -> Improve): the pure, model-independent parts of the online learner.

DVI keeps Kangaroo's split (draft q = pi_theta(. | h_k) from the first k layers + a small head, target
p from all layers) but stops throwing the verifier's decision away: every drafted token becomes an
experience (h_k, token, reward r in {0, 1}, the verifier's logits), and the draft learns from them
while it serves. Nothing here touches a model; the training loop feeds logits in and gets losses out.

Pieces:
  * DVIConfig: one dataclass, a comment per default, validated on construction.
  * lambda_schedule / lambda_curve: the KL weight lambda_t = max(kl_floor, exp(-t / tau)).
  * Losses on (B, V) logits. Fast update (the draft, every `fast_every` samples):
        L = (1 - lambda_t) * L_RL + lambda_t * KL(p || q) + ce_weight * ce_decay**t * CE(q, top1(p))
    where L_RL is REINFORCE on the accept bit, -(r - b) log q(token), or its low-variance surrogate
    -log q(top1(p)). Slow update (the verifier, every `slow_every` fast steps):
        L = CE(pi_phi, ground truth) + beta_kl * KL(pi_phi || pi_phi_old)
  * EMABaseline: b for REINFORCE's variance reduction.
  * ReplayBuffer: a fixed-size CPU ring of experiences, sampled in mini-batches.
  * rng_state / set_rng_state: every RNG a run draws from, so a resumed run replays the same numbers.

Notation: p = target / verifier distribution, q = pi = draft distribution.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

RL_VARIANTS = ("reinforce", "surrogate")


# ----------------------------------------------------------------------------------------------
# config


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class DVIConfig:
    # fast update (draft, policy improvement)
    tau: float = 200.0  # time constant of lambda_t = exp(-t / tau), in fast steps: KL-dominated warm-up length
    kl_floor: float = 0.05  # lambda never drops below this: a residual KL keeps the draft near the verifier
    rl_variant: str = "surrogate"  # "surrogate": -log q(top1 of p), low variance; "reinforce": -(r - b) log q(token)
    ce_weight: float = 0.2  # weight of the CE anchor on the verifier's top-1 (dense signal from step 1)
    ce_decay: float = 1.0  # anchor weight is ce_weight * ce_decay**t; 1.0 = constant (no decay)
    baseline_beta: float = 0.9  # EMA factor of the REINFORCE baseline b (higher = slower, smoother)
    accepted_only: bool = False  # sample only accepted experiences (less variance, more bias; off for warm-up)
    backoff_min: int | None = None  # accepted_only: fewer accepted than this -> sample the whole buffer (None = batch_size)
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
    # model / run
    split: int = 2  # exit layer k: the draft is layers [0, k) + head, the verifier layers [k, L)
    seed: int = 0  # buffer sampling, init

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, n_layers: int | None = None) -> DVIConfig:
        """Raise ValueError naming the first bad parameter; with n_layers also check 0 < split < n_layers.

        A bad value here would otherwise show up much later as a NaN loss or a silently frozen term.
        Returns self so that `cfg.validate(n)` can be chained.
        """
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        positive_reals = ("tau", "teacher_temperature", "lr", "slow_lr", "lora_alpha", "grad_clip")
        for name in positive_reals:
            v = getattr(self, name)
            if not _is_real(v) or v <= 0:
                raise bad(name, "a finite number > 0")
        if not _is_real(self.kl_floor) or not 0.0 <= self.kl_floor <= 1.0:
            raise bad("kl_floor", "a number in [0, 1]")
        if self.rl_variant not in RL_VARIANTS:
            raise bad("rl_variant", f"one of {RL_VARIANTS}")
        if not _is_real(self.ce_weight) or self.ce_weight < 0:
            raise bad("ce_weight", "a finite number >= 0")
        if not _is_real(self.ce_decay) or not 0.0 < self.ce_decay <= 1.0:
            raise bad("ce_decay", "a number in (0, 1] (1 = no decay)")
        if not _is_real(self.baseline_beta) or not 0.0 <= self.baseline_beta < 1.0:
            raise bad("baseline_beta", "a number in [0, 1)")
        if not _is_real(self.beta_kl) or self.beta_kl < 0:
            raise bad("beta_kl", "a finite number >= 0")
        if not isinstance(self.accepted_only, bool):
            raise bad("accepted_only", "a bool")
        for name in ("fast_every", "batch_size", "buffer_size", "slow_every", "lora_rank"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise bad(name, "an int >= 1")
        if self.batch_size > self.buffer_size:
            raise ValueError(f"batch_size must be <= buffer_size ({self.buffer_size}), got {self.batch_size!r}")
        if self.backoff_min is not None and (not _is_int(self.backoff_min) or self.backoff_min < 1):
            raise bad("backoff_min", "None or an int >= 1")
        if not _is_int(self.seed):
            raise bad("seed", "an int")
        if not _is_int(self.split) or self.split < 1:
            raise bad("split", "an int >= 1 (exit layer k)")
        if n_layers is not None and not self.split < n_layers:
            raise bad("split", f"an int with 0 < split < {n_layers} (the model's layers)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# lambda schedule


def lambda_schedule(t: float, tau: float, kl_floor: float) -> float:
    """KL weight at fast step t: lambda_t = max(kl_floor, exp(-t / tau)).

    At t = 0 the loss is pure distillation (dense signal while the accept bit is still ~always 0);
    lambda decays with time constant tau, handing the weight to the RL term; the floor keeps a residual
    KL forever so the draft cannot wander away from the verifier once RL dominates.
    """
    if not _is_real(tau) or tau <= 0:
        raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
    if not _is_real(kl_floor) or not 0.0 <= kl_floor <= 1.0:
        raise ValueError(f"kl_floor must be a number in [0, 1], got {kl_floor!r}")
    if not _is_real(t) or t < 0:
        raise ValueError(f"t (fast step) must be a finite number >= 0, got {t!r}")
    return max(float(kl_floor), math.exp(-t / tau))


def lambda_curve(steps: int | Iterable[float], tau: float, kl_floor: float) -> list[float]:
    """lambda_t for t = 0 .. steps - 1 (an int) or for the given steps (an iterable), for plots."""
    ts = range(steps) if _is_int(steps) else steps
    return [lambda_schedule(t, tau, kl_floor) for t in ts]


# ----------------------------------------------------------------------------------------------
# losses (logits (B, V); any leading shape (..., V) is flattened, every position weighs the same)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (N, V) in float32: losses are computed in fp32 whatever the model's dtype."""
    return logits.reshape(-1, logits.shape[-1]).float()


def _kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probs (N, V) -> (N,); 0 log 0 = 0 (masked -inf logits are fine)."""
    p = logp.exp()  # (N, V)
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))  # (N, V)
    return terms.sum(-1)


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p_verify || p_draft), mean over the batch; the teacher is detached.

    Forward (mode-covering) KL: early on the draft must put mass wherever the verifier does. The
    temperature softens the teacher only: the student's softmax at T = 1 is the policy that actually
    drafts, so that is the distribution to train (no Hinton T^2 rescaling either).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    logp = F.log_softmax(_rows(teacher_logits.detach()) / temperature, dim=-1)  # (N, V)
    logq = F.log_softmax(_rows(student_logits), dim=-1)  # (N, V)
    return _kl_rows(logp, logq).mean()


def reinforce_loss(student_logits: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor,
                   baseline: float | torch.Tensor) -> torch.Tensor:
    """REINFORCE on the accept bit: mean of -(r - b) * log pi(token).

    Its gradient is an unbiased estimate of -grad E[r] (the baseline b only cuts variance): tokens
    accepted more often than usual (r > b) get their log-prob pushed up, rejected ones (r < b) down.
    The advantage r - b is a constant (no gradient). The tokens are the ones the draft proposed.
    """
    logq = F.log_softmax(_rows(student_logits), dim=-1)  # (N, V)
    logq_tok = logq.gather(-1, tokens.reshape(-1, 1).long()).squeeze(-1)  # (N,)
    adv = (rewards.reshape(-1).float() - torch.as_tensor(baseline, dtype=torch.float32)).detach()  # (N,)
    return -(adv.to(logq_tok.device) * logq_tok).mean()


def surrogate_loss(student_logits: torch.Tensor, teacher_top1: torch.Tensor) -> torch.Tensor:
    """Surrogate policy term: -log pi(v_top1), mean; v_top1 = the verifier's greedy token.

    Greedy acceptance is exactly the event "draft's token == v_top1", so raising pi(v_top1) raises the
    accept rate; it needs no sampled reward (dense from step 1, no variance from the accept bit) and
    -log pi gives large gradients precisely where pi(v_top1) is small.
    """
    return F.cross_entropy(_rows(student_logits), teacher_top1.reshape(-1).long())


def ce_anchor(student_logits: torch.Tensor, teacher_top1: torch.Tensor) -> torch.Tensor:
    """CE anchor on the verifier's top-1: -log pi(v_top1), mean. Numerically = surrogate_loss.

    DVI keeps both names because they are different terms of the fast loss with different weights:
    the policy term rides the schedule, (1 - lambda_t) (about 0 at warm-up, and it may be REINFORCE
    instead), while the anchor has its own weight ce_weight * ce_decay**t, present from step 1 so the
    argmax is pinned while the KL shapes the rest of the distribution. With rl_variant="surrogate" the
    two add up: CE gets weight (1 - lambda_t) + ce_weight * ce_decay**t.
    """
    return F.cross_entropy(_rows(student_logits), teacher_top1.reshape(-1).long())


def fast_loss(batch: dict[str, torch.Tensor], cfg: DVIConfig, step: int,
              baseline: float | torch.Tensor | EMABaseline = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The draft's loss at fast step `step`:

        L = (1 - lambda_t) * L_RL + lambda_t * KL(p || q) + ce_weight * ce_decay**t * CE(q, top1(p))

    batch: "student_logits" (B, V) computed by the caller from the stored h_k (with grad),
    "teacher_logits" (B, V), "tokens" (B,) the drafted tokens, "rewards" (B,) the accept bits
    (ReplayBuffer.sample gives all but the student logits). `baseline` is b before this batch: update
    the EMABaseline *after* the loss, so b does not depend on the rewards it is subtracted from.
    Returns (loss, components); components are floats for logging: lambda, ce_weight (effective),
    baseline, l_rl, l_kl, l_ce, total.
    """
    s, t = batch["student_logits"], batch["teacher_logits"]  # (B, V), (B, V)
    if s.shape != t.shape:
        raise ValueError(f"student_logits {tuple(s.shape)} and teacher_logits {tuple(t.shape)} differ in shape")
    if isinstance(baseline, EMABaseline):
        baseline = baseline.value
    lam = lambda_schedule(step, cfg.tau, cfg.kl_floor)
    ce_w = cfg.ce_weight * cfg.ce_decay ** step
    top1 = t.detach().argmax(-1)  # (B,)
    if cfg.rl_variant == "reinforce":
        l_rl = reinforce_loss(s, batch["tokens"], batch["rewards"], baseline)
    else:
        l_rl = surrogate_loss(s, top1)
    l_kl = kl_loss(t, s, cfg.teacher_temperature)
    l_ce = ce_anchor(s, top1)
    total = (1.0 - lam) * l_rl + lam * l_kl + ce_w * l_ce
    parts = {"lambda": lam, "ce_weight": ce_w, "baseline": float(baseline), "l_rl": l_rl.item(),
             "l_kl": l_kl.item(), "l_ce": l_ce.item(), "total": total.item()}
    return total, parts


def slow_loss(logits: torch.Tensor, old_logits: torch.Tensor, targets: torch.Tensor,
              beta_kl: float) -> torch.Tensor:
    """The verifier's loss: CE(pi_phi, targets) + beta_kl * KL(pi_phi || pi_phi_old), old detached.

    CE on the ground-truth next tokens keeps the verifier tracking the domain; the KL to a frozen
    copy makes the update conservative, because the verifier is also the draft's teacher and a jumpy
    teacher turns the accept bit into noise. Reverse direction (the new policy weighs the log-ratio),
    as in trust-region updates: it penalises new mass where the old verifier had little.
    """
    logp_new = F.log_softmax(_rows(logits), dim=-1)  # (N, V)
    logp_old = F.log_softmax(_rows(old_logits.detach()), dim=-1)  # (N, V)
    ce = F.nll_loss(logp_new, targets.reshape(-1).long())
    return ce + beta_kl * _kl_rows(logp_new, logp_old).mean()


# ----------------------------------------------------------------------------------------------
# baseline


class EMABaseline:
    """b <- beta * b + (1 - beta) * mean(r): the running accept rate, REINFORCE's baseline.

    Subtracting b keeps the gradient unbiased and centres the advantage: with acceptance at 80%, an
    accept is only mildly good news and a reject is strong bad news.
    """

    def __init__(self, beta: float = 0.9, value: float = 0.0):
        if not _is_real(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be a number in [0, 1), got {beta!r}")
        self.beta, self.value, self.n_updates = float(beta), float(value), 0

    def update(self, rewards: torch.Tensor) -> float:
        """Fold in one batch of rewards (any shape); an empty batch changes nothing. Returns the new b."""
        r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if r.numel():
            self.value = self.beta * self.value + (1.0 - self.beta) * r.mean().item()
            self.n_updates += 1
        return self.value

    def state_dict(self) -> dict[str, float | int]:
        return {"beta": self.beta, "value": self.value, "n_updates": self.n_updates}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.beta, self.value, self.n_updates = float(state["beta"]), float(state["value"]), int(state["n_updates"])


# ----------------------------------------------------------------------------------------------
# replay buffer


class ReplayBuffer:
    """A fixed-capacity ring of experiences (h_k, token, reward, teacher logits), kept on CPU.

    The fast update replays recent experiences in mini-batches instead of single tokens (one token is
    a very noisy gradient); the ring forgets the oldest, so the buffer follows the stream. Full teacher
    logits (V,) are stored: fine at course scale (4096 x 8k vocab x 4 bytes = 128 MiB), and the KL needs
    the whole distribution; `logits_dtype=torch.float16` halves that. Storage is allocated on the first
    add, when D and V are known.
    """

    def __init__(self, capacity: int, logits_dtype: torch.dtype = torch.float32):
        if not _is_int(capacity) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity, self.logits_dtype = capacity, logits_dtype
        self.size, self.next, self.n_seen = 0, 0, 0  # filled slots, next slot to write, experiences ever added
        self.h: torch.Tensor | None = None  # (C, D) float32
        self.tokens: torch.Tensor | None = None  # (C,) int64
        self.rewards: torch.Tensor | None = None  # (C,) float32, in {0, 1}
        self.teacher_logits: torch.Tensor | None = None  # (C, V) logits_dtype

    def __len__(self) -> int:
        return self.size

    def _alloc(self, d: int, v: int) -> None:
        c = self.capacity
        self.h = torch.zeros(c, d)
        self.tokens = torch.zeros(c, dtype=torch.long)
        self.rewards = torch.zeros(c)
        self.teacher_logits = torch.zeros(c, v, dtype=self.logits_dtype)

    def add(self, h: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor,
            teacher_logits: torch.Tensor) -> None:
        """Append n experiences: h (n, D), tokens (n,), rewards (n,) in {0, 1}, teacher_logits (n, V).

        Overwrites the oldest when full (if n > capacity only the last `capacity` survive).
        """
        h, tokens = h.detach().cpu(), tokens.detach().cpu().reshape(-1)
        rewards, teacher_logits = rewards.detach().cpu().reshape(-1), teacher_logits.detach().cpu()
        if h.ndim != 2 or teacher_logits.ndim != 2:
            raise ValueError(f"h must be (n, D) and teacher_logits (n, V), got {tuple(h.shape)} and "
                             f"{tuple(teacher_logits.shape)}")
        n = h.shape[0]
        if not tokens.numel() == rewards.numel() == teacher_logits.shape[0] == n:
            raise ValueError(f"add: h, tokens, rewards, teacher_logits disagree on n: {n}, {tokens.numel()}, "
                             f"{rewards.numel()}, {teacher_logits.shape[0]}")
        if not bool(((rewards == 0) | (rewards == 1)).all()):
            raise ValueError("rewards must be accept bits in {0, 1}")
        if self.h is None:
            self._alloc(h.shape[1], teacher_logits.shape[1])
        elif (h.shape[1], teacher_logits.shape[1]) != (self.h.shape[1], self.teacher_logits.shape[1]):
            raise ValueError(f"add: expected D={self.h.shape[1]}, V={self.teacher_logits.shape[1]}, got "
                             f"D={h.shape[1]}, V={teacher_logits.shape[1]}")
        self.n_seen += n
        if n > self.capacity:  # only the newest survive; keep their ring positions
            skip = n - self.capacity
            self.next = (self.next + skip) % self.capacity
            h, tokens, rewards, teacher_logits = h[skip:], tokens[skip:], rewards[skip:], teacher_logits[skip:]
            n = self.capacity
        idx = (self.next + torch.arange(n)) % self.capacity  # (n,)
        self.h[idx] = h.float()
        self.tokens[idx] = tokens.long()
        self.rewards[idx] = rewards.float()
        self.teacher_logits[idx] = teacher_logits.to(self.logits_dtype)
        self.next = (self.next + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None, accepted_only: bool = False,
               min_accepted: int | None = None) -> dict[str, Any]:
        """A uniform mini-batch without replacement: min(batch_size, pool) distinct experiences.

        accepted_only restricts the pool to accepted experiences (r = 1), which cuts variance but skews
        the data towards easy states. Backoff: with fewer than `min_accepted` (default batch_size)
        accepted experiences - always the case at cold start - it samples the whole buffer instead, so a
        step is never starved or trained on a handful of repeats; the result says so (backoff=True).
        Returns h (b, D), tokens (b,), rewards (b,), teacher_logits (b, V) float32, index (b,) (slots),
        backoff (bool).
        """
        if self.size == 0:
            raise ValueError("sample: the replay buffer is empty")
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        pool = torch.arange(self.size)  # (size,) filled slots
        backoff = False
        if accepted_only:
            accepted = pool[self.rewards[: self.size] == 1]
            need = batch_size if min_accepted is None else min_accepted
            if accepted.numel() >= need and accepted.numel() > 0:
                pool = accepted
            else:
                backoff = True
        pick = torch.randperm(pool.numel(), generator=generator)[: min(batch_size, pool.numel())]
        idx = pool[pick]  # (b,)
        return {"h": self.h[idx], "tokens": self.tokens[idx], "rewards": self.rewards[idx],
                "teacher_logits": self.teacher_logits[idx].float(), "index": idx, "backoff": backoff}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: the filled slots and the ring pointers (CPU copies)."""
        filled = slice(0, self.size)
        return {"capacity": self.capacity, "logits_dtype": str(self.logits_dtype).removeprefix("torch."),
                "size": self.size, "next": self.next, "n_seen": self.n_seen,
                "h": None if self.h is None else self.h[filled].clone(),
                "tokens": None if self.tokens is None else self.tokens[filled].clone(),
                "rewards": None if self.rewards is None else self.rewards[filled].clone(),
                "teacher_logits": None if self.teacher_logits is None else self.teacher_logits[filled].clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.capacity, self.logits_dtype = int(state["capacity"]), getattr(torch, state["logits_dtype"])
        self.size, self.next, self.n_seen = int(state["size"]), int(state["next"]), int(state["n_seen"])
        self.h = self.tokens = self.rewards = self.teacher_logits = None
        if state["h"] is not None:
            self._alloc(state["h"].shape[1], state["teacher_logits"].shape[1])
            n = self.size
            self.h[:n], self.tokens[:n] = state["h"], state["tokens"]
            self.rewards[:n], self.teacher_logits[:n] = state["rewards"], state["teacher_logits"]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ReplayBuffer:
        buf = cls(int(state["capacity"]))
        buf.load_state_dict(state)
        return buf


# ----------------------------------------------------------------------------------------------
# RNG state


def rng_state() -> dict[str, Any]:
    """Every RNG the online loop may draw from: python `random`, numpy, torch CPU, and CUDA if present.

    Save it in the checkpoint next to the models, optimisers, buffer and baseline: a resumed run then
    draws the same numbers as an uninterrupted one, so the two can be compared for equality.
    """
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() captured (CUDA only when captured and available)."""
    random.setstate(state["python"])
    if state.get("numpy") is not None:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
