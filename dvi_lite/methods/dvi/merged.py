"""DVI's policy for drafting only: lora_S merged, the model's dtype (the policy itself trains in float32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dvi_lite.methods.dvi.policy import LORA_S, DVIPolicy, _base
from dvi_lite.models.vocab import TrimmedHead


class MergedExit:
    """An inference copy of a DVIPolicy: the same exit, in the model's dtype, with lora_S merged into the block.

    Why: the policy trains in float32 with its LoRA unmerged, and its block's down projection is a zero base
    matrix plus B A; drafting needs none of that. Here gate and up carry their LoRA deltas, down is the delta
    alone, and the block, the norms and the head run in the model's dtype: the draft costs what its weights
    cost. It is a snapshot: a policy that trains on (the online learner) drafts through the policy itself.
    """

    @torch.no_grad()
    def __init__(self, policy: DVIPolicy, dtype: torch.dtype):
        def merged(name: str) -> torch.Tensor:
            layer = getattr(policy.block, name)
            w = _base(layer).weight.detach().float()
            if hasattr(layer, "get_delta_weight") and LORA_S in getattr(layer, "lora_A", {}):
                w = w + layer.get_delta_weight(LORA_S).float()
            return w.to(dtype)

        self.gate_up = torch.cat([merged("gate_proj"), merged("up_proj")])  # (2I, D)
        self.down = merged("down_proj")  # (D, I)
        self.act = policy.block.act
        self.norms = [(m.weight.detach().to(dtype), m.variance_epsilon) for m in (policy.block_norm, policy.exit_norm)]
        self.scale = policy.logit_scale.detach().to(dtype)
        self.head = policy.head
        if policy.head == "trained":
            self.head_w = policy.head_weight.detach().to(dtype)  # (N, D)
            self.head_b = None if policy.head_bias is None else policy.head_bias.detach().to(dtype)

    @classmethod
    def of(cls, policy: DVIPolicy, dtype: torch.dtype) -> "MergedExit":
        """The merged copy of `policy` in `dtype`, built once and kept on the policy until a parameter changes
        (an optimizer step bumps its tensor version): a generate per question no longer re-merges the block."""
        key = (dtype, tuple(p._version for p in policy.parameters()), tuple(b._version for b in policy.buffers()))
        kept = policy.__dict__.get("_dvi_lite_merged")
        if kept is None or kept[0] != key:
            kept = (key, cls(policy, dtype))
            policy.__dict__["_dvi_lite_merged"] = kept
        return kept[1]

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """(..., D) h_k -> (..., D) normalised exit features, in the model's dtype."""
        (w1, e1), (w2, e2) = self.norms
        gate, up = F.linear(F.rms_norm(h, (h.shape[-1],), w1, e1), self.gate_up).chunk(2, dim=-1)
        x = h + F.linear(self.act(gate) * up, self.down)
        return F.rms_norm(x, (x.shape[-1],), w2, e2)

    def logits(self, h: torch.Tensor, lm_head: nn.Module, vocab: TrimmedHead | None) -> torch.Tensor:
        """Draft logits (..., N) on the drafter's map (a trained head: its own rows), or (..., V) without one."""
        z = self.features(h)
        if self.head == "trained":
            return F.linear(z, self.head_w, self.head_b) * self.scale
        if vocab is not None:
            return vocab.small(z) * self.scale
        head = _base(lm_head)
        return F.linear(z, head.weight.detach(), None if head.bias is None else head.bias.detach()) * self.scale
