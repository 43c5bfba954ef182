"""Draft & Verify's adaptive draft-exiting: a threshold on the draft's confidence that follows acceptance.

Drafting stops after the first draft token whose top-1 probability falls below gamma. A fixed gamma is
right for one prompt and wrong for the next; the authors' feedback rule moves gamma after every
verification so that a running acceptance rate (accepted / drafted) tracks a target. Whether that beats
a well-chosen fixed gamma is an empirical question per model. Model-independent: tests simulate it.

Across prompts, gamma is carried, as in the authors' evaluation harness: their decoding function restarts
its running matchness at 0 on every call but returns the final threshold (`th_stop_draft`), and the harness
passes it into the next prompt's call (only the first prompt starts at th_stop_draft). A gamma reset at
every prompt never leaves the neighbourhood of its start value in a few hundred tokens (0.01 steps damped
by beta2 = 0.9), so "adaptive" would then measure the same thing as "fixed at gamma0".
"""
from __future__ import annotations

import numpy as np

from dvi_lite.core.checks import check_prob, check_real, is_real


class AdaptiveThreshold:
    """Draft & Verify's adaptive draft-exiting, as in the authors' code: stop drafting after the first draft
    token whose top-1 probability is < gamma, and move gamma after each verification.

    Update after verification e, with the authors' matchness AR_e = accepted / drafted
    (`(max_matched - 1) / drafted_n_tokens` in their decoding.py: every drafted token counts, also those
    after the first rejection, which were never tested):
        AR      <- beta1 * AR + (1 - beta1) * AR_e
        gamma~  =  gamma + eps  if AR < target_alpha  else  gamma - eps
        gamma   <- beta2 * gamma + (1 - beta2) * gamma~          (then clamped to [0, 1]; theirs is not)
    and gamma~ = gamma (held) when AR >= target_alpha but the draft ran to its maximum length K: the
    threshold did not end that draft, so lowering it would not lengthen drafts (`reached_max=True`).
    A higher gamma exits earlier, so drafts are shorter and a larger share of them is accepted: AR rises
    with gamma, which makes this negative feedback settle. The rule reads only the sign of AR - alpha,
    so with noisy per-step rates AR's median, not its mean, settles near alpha (tests/test_skip_search.py
    simulates it). AR here is the authors' accepted / drafted, not the engine's per-token alpha
    (accepted / tested), so its target is not comparable with a measured alpha.

    Defaults, from the authors' code (`auto_parameters=[1, 0.5, 0.9, 1e-2, 0.9]` = update every
    verification, beta1, alpha, eps, beta2; `th_stop_draft=0.8`; running matchness starts at 0): beta1 = 0.5,
    target_alpha = 0.9, eps = 0.01, beta2 = 0.9, gamma0 = 0.8, ar0 = 0. The paper writes the test as
    AR <= alpha; the code (and this class) uses AR < alpha, a difference only at exact equality.

    Per prompt (`start_prompt`, which the drafter calls at prefill): AR restarts at ar0, as their matchness
    is a local of each generate call; gamma is carried over from the previous prompt (carry=True, their
    harness feeds each call's returned threshold into the next), or restarts at gamma0 (carry=False: the
    per-prompt reset, for comparison). `reset` starts over completely (gamma0, ar0, empty traces): call it
    between experiments that must not share gamma. The traces run across prompts; `prompt_starts` holds the
    trace index at which each prompt began.
    The drafter (`DraftVerifyDrafter`) asks `should_stop` at every draft token and calls `update` after
    every verification.
    """

    def __init__(self, target_alpha: float = 0.9, beta1: float = 0.5, beta2: float = 0.9, eps: float = 0.01,
                 gamma0: float = 0.8, ar0: float = 0.0, carry: bool = True):
        if not is_real(target_alpha) or not 0.0 < target_alpha < 1.0:  # 1 would be unreachable: gamma only rises
            raise ValueError(f"target alpha (target acceptance rate) must be in (0, 1), got {target_alpha!r}")
        for name, v in (("beta1", beta1), ("beta2", beta2)):
            if not is_real(v) or not 0.0 <= v < 1.0:
                raise ValueError(f"{name} (EMA decay) must be in [0, 1), got {v!r}")
        self.eps = check_prob("eps (threshold step)", eps)
        self.gamma0, self.ar0 = check_real("gamma0", gamma0, 0.0, 1.0), check_real("ar0", ar0, 0.0, 1.0)
        self.target_alpha, self.beta1, self.beta2 = float(target_alpha), float(beta1), float(beta2)
        if not isinstance(carry, bool):
            raise ValueError(f"carry (keep gamma across prompts) must be True or False, got {carry!r}")
        self.carry = carry
        self.reset()

    def reset(self) -> None:
        """Start over: gamma0 / ar0, empty traces, no prompt seen (the explicit reset between experiments)."""
        self.gamma = self.gamma0
        self.ar = self.ar0
        self.trace_ar: list[float] = []
        self.trace_gamma: list[float] = []
        self.prompt_starts: list[int] = []

    def start_prompt(self) -> None:
        """A new prompt (generation) begins: AR restarts at ar0 (the authors' per-call matchness); gamma is
        kept when `carry` (their harness passes the last call's threshold on), else back to gamma0."""
        self.ar = self.ar0
        if not self.carry:
            self.gamma = self.gamma0
        self.prompt_starts.append(len(self.trace_gamma))

    @property
    def n_prompts(self) -> int:
        """Prompts started since the last `reset`."""
        return len(self.prompt_starts)

    def should_stop(self, prob: float) -> bool:
        """Stop drafting: the draft's top-1 probability (its confidence) is below the threshold gamma."""
        return float(prob) < self.gamma

    def update(self, accepted: int, drafted: int, reached_max: bool = False) -> float:
        """Feed one verification (accepted of `drafted` draft tokens); returns the new gamma.

        drafted == 0 (nothing was drafted, so nothing verified) carries no acceptance information: the
        state is left unchanged and nothing is traced. reached_max: the draft ran to its maximum length.
        """
        for name, v in (("accepted", accepted), ("drafted", drafted)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if accepted > drafted:
            raise ValueError(f"accepted ({accepted}) cannot exceed drafted ({drafted})")
        if drafted == 0:
            return self.gamma
        ar_e = accepted / drafted
        self.ar = self.beta1 * self.ar + (1.0 - self.beta1) * ar_e
        if self.ar < self.target_alpha:
            target = self.gamma + self.eps
        else:
            target = self.gamma if reached_max else self.gamma - self.eps
        self.gamma = min(1.0, max(0.0, self.beta2 * self.gamma + (1.0 - self.beta2) * target))
        self.trace_ar.append(self.ar)
        self.trace_gamma.append(self.gamma)
        return self.gamma

    def state_dict(self) -> dict:
        """The state and traces, JSON-able (for results files and plots)."""
        return {"gamma": self.gamma, "ar": self.ar, "carry": self.carry, "n_prompts": self.n_prompts,
                "prompt_starts": list(self.prompt_starts), "trace_ar": list(self.trace_ar),
                "trace_gamma": list(self.trace_gamma)}
