"""The fast and slow losses of DVI, on logits only: nothing here touches a model.

Notation: p = target / verifier distribution, q = pi = draft distribution. Losses take (B, V) logits
(any leading shape (..., V) is flattened, every position weighs the same) and compute in float32.

  * lambda_schedule / lambda_curve: the KL weight lambda_t = max(kl_floor, exp(-t / T_λ)).
  * Fast update (the draft, every `fast_every` experiences):
        L = (1 - lambda_t) * L_RL + lambda_t * KL(p || q) + ce_weight * ce_decay**t * CE(q, top1(p))
    where L_RL is the policy-gradient term on the accept bit, -(r - b) log q(token) with an EMA baseline b,
    over every tested draft (rl_variant="reinforce", our default) or over the accepted drafts only
    ("accepted", the reference trainer's default), or (rl_variant="surrogate") -log q(top1(p)), which never
    reads the reward: with it DVI is online distillation.
  * What the policy-gradient term is, as run: a biased, greedy-action policy-gradient surrogate, not an
    unbiased REINFORCE estimate of grad E[r]. The drafted token is the argmax of q (greedy drafting), not a
    sample of q, and the replay buffer re-uses tokens drafted by older policies without importance weights.
    It still points the right way: an accepted argmax (r = 1 > b) gains probability, a rejected one loses it.
  * Slow update (the verifier, every `slow_every` fast steps):
        L = CE(pi_phi, ground truth) + beta_kl * KL(pi_phi || pi_phi_old)
  * EMABaseline: b for REINFORCE's variance reduction.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from dvi_lite.core.checks import is_int
from dvi_lite.methods.dvi.config import DVIConfig, is_finite

# ----------------------------------------------------------------------------------------------
# lambda schedule


def lambda_schedule(t: float, t_lambda: float, kl_floor: float) -> float:
    """KL weight at fast step t: lambda_t = max(kl_floor, exp(-t / T_λ)).

    At t = 0 the loss is pure distillation (dense signal while the accept bit is still ~always 0);
    lambda decays with time constant T_λ (t_lambda), handing the weight to the RL term; the floor keeps a residual
    KL forever so the draft cannot wander away from the verifier once RL dominates.
    """
    if not is_finite(t_lambda) or t_lambda <= 0:
        raise ValueError(f"t_lambda (T_λ) must be a finite number > 0, got {t_lambda!r}")
    if not is_finite(kl_floor) or not 0.0 <= kl_floor <= 1.0:
        raise ValueError(f"kl_floor must be a number in [0, 1], got {kl_floor!r}")
    if not is_finite(t) or t < 0:
        raise ValueError(f"t (fast step) must be a finite number >= 0, got {t!r}")
    return max(float(kl_floor), math.exp(-t / t_lambda))


def lambda_curve(steps: int | Iterable[float], t_lambda: float, kl_floor: float) -> list[float]:
    """lambda_t for t = 0 .. steps - 1 (an int) or for the given steps (an iterable), for plots."""
    ts = range(steps) if is_int(steps) else steps
    return [lambda_schedule(t, t_lambda, kl_floor) for t in ts]


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
    """The REINFORCE form on the accept bit: mean of -(r - b) * log pi(token).

    Tokens accepted more often than usual (r > b) get their log-prob pushed up, rejected ones (r < b) down;
    the advantage r - b is a constant (no gradient). Only if `tokens` were sampled from the current pi
    would this be an unbiased estimate of -grad E[r] (b only cuts variance). In DVI's loop they are not:
    drafts are greedy (the argmax of pi) and replayed experiences come from older policies with no
    importance weights, so as run it is a biased, greedy-action policy-gradient surrogate.
    """
    logq = F.log_softmax(_rows(student_logits), dim=-1)  # (N, V)
    logq_tok = logq.gather(-1, tokens.reshape(-1, 1).long()).squeeze(-1)  # (N,)
    adv = (rewards.reshape(-1).float() - torch.as_tensor(baseline, dtype=torch.float32)).detach()  # (N,)
    return -(adv.to(logq_tok.device) * logq_tok).mean()


def accepted_reinforce_loss(student_logits: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor,
                            baseline: float | torch.Tensor) -> torch.Tensor:
    """The reference trainer's default policy term: -(r - b) * log pi(token), averaged over the ACCEPTED
    experiences of the batch only (r = 1); rejections add nothing to it (the KL still sees every experience).
    A batch with no accepted experience gives 0. `reinforce_loss` is the same term over every experience, so a
    rejected draft (r = 0 < b) is pushed down too: our variant, not the reference's default."""
    logq = F.log_softmax(_rows(student_logits), dim=-1)  # (N, V)
    logq_tok = logq.gather(-1, tokens.reshape(-1, 1).long()).squeeze(-1)  # (N,)
    r = rewards.reshape(-1).float().to(logq_tok.device)
    acc = r == 1.0  # (N,)
    if not bool(acc.any()):
        return logq_tok.sum() * 0.0  # keeps the graph: zero gradient
    adv = (r[acc] - torch.as_tensor(baseline, dtype=torch.float32)).detach()
    return -(adv * logq_tok[acc]).mean()


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
    return surrogate_loss(student_logits, teacher_top1)


def fast_loss(batch: dict[str, torch.Tensor], cfg: DVIConfig, step: int,
              baseline: float | torch.Tensor | EMABaseline = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The draft's loss at fast step `step`:

        L = (1 - lambda_t) * L_RL + lambda_t * KL(p || q) + ce_weight * ce_decay**t * CE(q, top1(p))

    L_RL reads the rewards with rl_variant="reinforce" (our default: every tested draft) or "accepted" (the
    reference trainer's default: accepted drafts only); with "surrogate" it is -log q(top1(p)) and the loss does
    not depend on the rewards at all.

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
    lam = lambda_schedule(step, cfg.t_lambda, cfg.kl_floor)
    ce_w = cfg.ce_weight * cfg.ce_decay ** step
    top1 = t.detach().argmax(-1)  # (B,)
    if cfg.rl_variant == "reinforce":
        l_rl = reinforce_loss(s, batch["tokens"], batch["rewards"], baseline)
    elif cfg.rl_variant == "accepted":
        l_rl = accepted_reinforce_loss(s, batch["tokens"], batch["rewards"], baseline)
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
    """b <- beta * b + (1 - beta) * mean(r): the running accept rate, the policy-gradient term's baseline.

    Subtracting b centres the advantage: with acceptance at 80%, an accept is only mildly good news and a
    reject is strong bad news. (For on-policy samples a baseline adds no bias; DVI's drafts are greedy and
    replayed, see the module docstring.)
    """

    def __init__(self, beta: float = 0.9, value: float = 0.0):
        if not is_finite(beta) or not 0.0 <= beta < 1.0:
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
