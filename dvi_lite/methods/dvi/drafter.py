"""method="dvi": early exit at layer k with the trained DVI head as the exit head; and its evaluation.

The drafter is Kangaroo's split (layers [0, k) draft, [k, L) verify, the shallow KV cache and hidden
states are shared) with the DVI policy as the head. With `collect=True` it also records what the
verifier said about each draft token: the experiences the online learner trains on. Drafting stops after
the first token whose top-1 probability is below `threshold` (that token is proposed and tested, as in
DVI's `spec_decode`). `vocab`: a trimmed draft head over the N most frequent tokens (models.vocab): the
policy's exit features go through the selected rows only (q = 0 off the map); verification keeps the
model's full head, so decoding stays lossless.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dvi_lite.core.checks import check_split, reject_renamed
from dvi_lite.core.engine import DecodeState, Outcome, Stats
from dvi_lite.core.generate import generate
from dvi_lite.core.runner import Runner
from dvi_lite.methods.dvi.merged import MergedExit
from dvi_lite.methods.dvi.policy import DVIPolicy, load_policy
from dvi_lite.methods.early_exit import EarlyExitDrafter
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab


class DVIDrafter(EarlyExitDrafter):
    """Early exit at layer k with the DVI policy as exit head; collects experiences when `collect`.

    K: draft tokens per step. feedback(): the verifier tests drafts in order until the first
    rejection, so a step with n drafts and a accepted yields min(n, a + 1) experiences: draft i (0-based)
    was produced from the layer-k state of input i ([pending, d1, ...], Proposal.hidden[:, i]), its
    reward is 1 if i < a else 0, and the verifier's logits at input i (Outcome.p_logits[i]) are exactly
    the distribution it was judged against. Drafts after the first rejection were never tested: no
    reward, not stored. The policy has no cache of its own (it is position-wise): nothing to roll back.
    """
    name = "dvi"

    def __init__(self, runner: Runner, policy: DVIPolicy, K: int = 6, threshold: float | None = None,
                 collect: bool = False, vocab: TrimmedHead | None = None, merged: bool = True):
        if policy.head == "trained":  # a trained head drafts on its own ids (checked), through its own rows
            policy.check_vocab(vocab)
            vocab = policy.head_map
        super().__init__(runner, policy.split, K, threshold, 1, vocab)  # a chain (branch 1): one experience per draft
        self.policy = policy
        self.collect = collect
        self.learns = collect  # its experiences are trained on: the loop keeps them autograd-ready (no_grad)
        self._pending: list[tuple[torch.Tensor, ...]] = []
        # drafting only: the policy merged into the model's dtype (a snapshot); a learning drafter uses the policy
        self.merged = MergedExit.of(policy, runner.lm_head.weight.dtype) if merged and not collect else None

    def exit_scores(self, h: torch.Tensor) -> torch.Tensor:
        """(1, n, D) -> (1, n, N) on the drafter's map (N = V without one), in the model's dtype."""
        if self.merged is not None:
            return self.merged.logits(h, self.runner.lm_head, self.vocab)
        if self.vocab is None:
            return self.policy(h).to(self.runner.lm_head.weight.dtype)
        return self.policy.logits(h, self.vocab).to(self.runner.lm_head.weight.dtype)

    def extra_params(self) -> int:
        """Values DVI adds to the target: the whole policy (exit MLP copy incl. its frozen weights, a trained head's
        rows) + a trimmed copy of the shared head's rows."""
        if self.policy.head == "trained":  # the map's rows ARE the policy's head_weight: counted once
            return self.policy.extra_params()
        return self.policy.extra_params() + super().extra_params()

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        if not self.collect:
            return
        prop, a = outcome.proposal, outcome.n_accepted
        tested = min(len(prop), a + 1)
        if tested == 0:
            return
        rewards = (torch.arange(tested, device=prop.tokens.device) < a).float()  # (tested,)
        self._pending.append((prop.hidden[0, :tested], prop.tokens[:tested], rewards, outcome.p_logits[:tested]))

    def drain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The experiences collected since the last drain: h (n, D), tokens (n,), rewards (n,), logits (n, V)."""
        if not self._pending:
            return None
        out = tuple(torch.cat(parts) for parts in zip(*self._pending, strict=True))
        self._pending = []
        return out  # type: ignore[return-value]


def make_drafter(model, tokenizer, split: int | None = None, state: str | Path | DVIPolicy | None = None,
                 K: int = 6, threshold: float | None = 0.6, load_verifier: bool = False, vocab=None,
                 merged: bool = True, **old) -> DVIDrafter:
    """DVI: the target's first `split` layers + the trained exit head (lora_S) draft, layers [split, L) verify.

    state: a dir with policy.pt (None = this model's committed policy), or a DVIPolicy (e.g.
    OnlineTrainer.policy). split=None: the policy's own exit layer; a given split must match it.
    Greedy output equals plain greedy decoding of the model (lora_D, if loaded, is part of the model).
    vocab: a trimmed draft head (models.vocab.resolve_vocab: an int N, a saved map's path); None = the head
    the policy was trained on (its file's "vocab": this model's top-N map, or the full vocabulary); "full" =
    the full vocabulary whatever the policy was trained on. merged: draft through `MergedExit` (lora_S merged, the
    model's dtype); False: through the policy itself (float32, LoRA unmerged).
    """
    reject_renamed(old, "dvi.make_drafter")
    r = Runner.for_model(model)
    if split is not None:
        check_split(split, r.n_layers)
    if isinstance(state, DVIPolicy):
        if split is not None and split != state.split:
            raise ValueError(f"split {split} requested but the given DVI policy exits at layer {state.split}")
        policy = state
    else:
        policy = load_policy(model, state, split, load_verifier)
    if policy.head == "trained":  # its own ids (policy.head_map); a given vocab must name the same map
        if isinstance(vocab, str) and vocab == "full":
            if policy.head_ids is not None:
                raise ValueError(f"vocab='full': this DVI policy's trained head scores {len(policy.head_ids)} "
                                 "token ids only (draft with vocab=None)")
            vocab = None
        return DVIDrafter(r, policy, K, threshold, vocab=None if vocab is None else resolve_vocab(model, tokenizer,
                                                                                                   vocab),
                          merged=merged)
    if vocab is None:
        vocab = getattr(policy, "trained_vocab", None)
    elif isinstance(vocab, str) and vocab == "full":
        vocab = None
    return DVIDrafter(r, policy, K, threshold, vocab=resolve_vocab(model, tokenizer, vocab), merged=merged)


def evaluate(model, tokenizer, prompts: Sequence[Any], state: str | Path | DVIPolicy | None = None,
             max_new_tokens: int = 64, K: int = 6, threshold: float | None = None,
             temperature: float = 0.0, vocab: Any = None, **old) -> dict[str, Any]:
    """tau (tokens per target forward), alpha (per-token acceptance) and tokens/s of method="dvi" on prompts.

    Call it before and after training (state=trainer.policy) to see what the online loop bought.
    prompts: str, token ids or chat messages (generate's prompts); vocab: the drafter's (trainer.vocab).
    """
    reject_renamed(old, "dvi.evaluate")
    stats = Stats.pool(
        generate(model, tokenizer, p if isinstance(p, str) else list(p), method="dvi", state=state,
                 max_new_tokens=max_new_tokens, K=K, threshold=threshold, temperature=temperature, seed=i,
                 **({} if vocab is None else {"vocab": vocab})).stats
        for i, p in enumerate(prompts))
    return {"tau": stats.tau, "alpha": stats.alpha, "tokens_per_s": stats.tokens_per_s or None,
            "prompts": len(prompts), "new_tokens": stats.new_tokens}
