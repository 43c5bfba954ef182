"""EAGLE-3's training-time test: train the head on the inputs it will really see when drafting several tokens.

At draft step 1 the head reads the target's fused feature F_j; from step 2 on it reads its own previous output g,
which drifts away from any feature the target would compute. A head trained on target features only (EAGLE-1's
teacher forcing) never sees that drift. The training-time test unrolls the head `steps` times over a whole row
at once:

    step 0:  slot j reads (F_j,        x_{j+1}) at position j       and predicts x_{j+2}  (teacher row j+1)
    step s:  slot j reads (g^{s-1}_j,  x_{j+1+s}) at position j + s and predicts x_{j+2+s} (teacher row j+1+s)

Slot j of step s stands for the (s+1)-th draft token after the committed prefix x_0..x_{j+1}, so it attends to
what drafting would have in the head's cache: the committed inputs (step 0, slots <= j, causal) and its own
earlier draft steps (slot j of steps 1..s-1), and nothing else. `StepKV` stacks the steps' keys; `ttt_mask` is
that pattern: a causal block, then one diagonal per earlier step. Step s's loss is weighted decay**s (0.8**s).
The tokens fed are the data's (teacher forcing on tokens, not on features), as in EAGLE-3.
"""
from __future__ import annotations

import torch

from dvi_lite.methods.eagle.head import EagleHead, StepKV
from dvi_lite.models.teacher import soft_ce


def ahead(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, T, ...) shifted n positions to the left along T, zero-filled at the end: out[:, j] = x[:, j + n]."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_mask(t: int, step: int, device=None) -> torch.Tensor:
    """(1, 1, T, (step + 1) T) bool: slot j sees step 0's slots <= j and its own slot of steps 1..step."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, 1)[None, None]


def ttt_loss(head: EagleHead, states: list[torch.Tensor], tokens: torch.Tensor, mask: torch.Tensor,
             top_ids: torch.Tensor, top_logp: torch.Tensor, steps: int = 4, decay: float = 0.8
             ) -> tuple[torch.Tensor, list[dict]]:
    """The training-time-test loss of one batch: sum over steps s of decay**s * mean soft CE of step s.

    states: [h_low, h_mid, h_high] (B, T, D) each; tokens (B, T); mask (B, T) real tokens (rows right-padded);
    top_ids / top_logp (B, T, k): the teacher's top-k next tokens at every position. Returns the loss and, per
    step, {"agree": draft top-1 == teacher top-1, "n": positions} (teacher-forced acceptance of draft token s+1).
    """
    b, t = tokens.shape
    g = head.fuse(states)  # (B, T, D): F_j
    kv = StepKV()
    total = g.new_zeros(()).float()
    stats = []
    for s in range(steps):
        x = ahead(tokens, 1 + s)  # (B, T): x_{j+1+s}
        w = ahead(mask, 1 + s)  # (B, T): the target row j+1+s exists
        if not w.any():
            break
        pos = (torch.arange(t, device=g.device) + s)[None].expand(b, -1)  # (B, T)
        g, logits = head.step(g, x, pos, kv, ttt_mask(t, s, g.device))  # (B, T, D), (B, T, N)
        logq = logits.float().log_softmax(-1)
        ids, logp, on = head.map_targets(ahead(top_ids, 1 + s), ahead(top_logp, 1 + s))
        keep = (w & on).float()
        ce = soft_ce(logq, ids, logp)  # (B, T)
        total = total + decay ** s * (ce * keep).sum() / keep.sum().clamp(min=1.0)
        hit = (head.ids[logq.argmax(-1)] == ahead(top_ids, 1 + s)[..., 0]) & w
        stats.append({"agree": int(hit.sum()), "n": int(w.sum())})
    return total, stats
