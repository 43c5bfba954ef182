"""The replay buffer of DVI's experiences, and the RNG state a checkpoint needs for an exact resume.

  * ReplayBuffer: a fixed-size CPU ring of experiences (h_k, token, reward, the verifier's logits),
    sampled in mini-batches by the fast update.
  * rng_state / set_rng_state: every RNG a run draws from, so a resumed run replays the same numbers.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dvi_lite.core.checks import is_int


class ReplayBuffer:
    """A fixed-capacity ring of experiences (h_k, token, reward, teacher logits), kept on CPU.

    The fast update replays recent experiences in mini-batches instead of single tokens (one token is
    a very noisy gradient); the ring forgets the oldest, so the buffer follows the stream. Full teacher
    logits (V,) are stored: fine at course scale (4096 x 8k vocab x 4 bytes = 128 MiB), and the KL needs
    the whole distribution; `logits_dtype=torch.float16` halves that. Storage is allocated on the first
    add, when D and V are known.
    """

    def __init__(self, capacity: int, logits_dtype: torch.dtype = torch.float32):
        if not is_int(capacity) or capacity < 1:
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
        if not is_int(batch_size) or batch_size < 1:
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
