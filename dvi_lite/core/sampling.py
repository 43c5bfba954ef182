"""Turning logits into the distribution we sample from: temperature, top-k, top-p.

The same `Sampler` processes the target's logits (p) and the draft's logits (q). That is what makes
speculative sampling follow the *processed* target distribution exactly: the rejection rule only
guarantees "output ~ p" for the p it is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TINY_TEMPERATURE = 1e-30  # below this, logits / T overflows float32 for any logit over about 3e8 * T


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p (1 = off)

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """What a drafter's stopping rule and top-k candidates read: probs(logits) when sampling, and
        softmax(logits) at temperature 1 when greedy (probs() is then a one-hot: confidence always 1)."""
        return logits.float().softmax(-1) if self.greedy else self.probs(logits)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        if self.temperature < TINY_TEMPERATURE:  # logits / T would overflow (inf - inf = NaN): take the limit T -> 0+,
            x = logits.float()  # the uniform law on the argmax (a tie shares it)
            x = torch.where(x == x.amax(-1, keepdim=True), 0.0, float("-inf"))
        else:
            x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, idx = torch.sort(x, dim=-1, descending=True)
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop = cum - sorted_x.softmax(-1) >= self.top_p  # mass before this token already >= top_p
            x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
        return x.softmax(-1)

    def pick(self, logits: torch.Tensor, gen: torch.Generator | None = None) -> int:
        """One token from (V,) logits: argmax when greedy, else a sample of probs(logits)."""
        if self.greedy:
            return int(logits.argmax(-1))
        return sample(self.probs(logits), gen)


def sample(probs: torch.Tensor, gen: torch.Generator | None = None) -> int:
    """One token id from a (V,) distribution."""
    return int(torch.multinomial(probs, 1, generator=gen))


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(0 if seed is None else seed)
    return g
