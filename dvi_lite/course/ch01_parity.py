"""Verify parity: does a batched verify pass pick the same argmax as token-by-token decoding?

In exact arithmetic the target's logits for position t do not depend on whether t is computed
alone (decode) or together with K other positions (verify). In floating point they do: a batched
matmul sums in a different order, and in bf16 a near-tie (two logits within one bf16 step, 2^-8
relative) can flip. Speculative decoding accepts by the *verify* logits, so its greedy output can
differ from plain greedy decoding at such ties: "lossless" is exact in exact arithmetic, and in fp32
the flips are so rare that our tests demand token-for-token equality. (seed 004's xserv lesson.)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from dvi_lite.core.runner import Runner
from dvi_lite.models.loading import DTYPES


@dataclass
class ParityReport:
    dtype: str
    positions: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0
    examples: list[dict] = field(default_factory=list)  # near-ties that flipped: top-2 of both paths
    nearest: list[dict] = field(default_factory=list)  # the closest decode top-2 gaps, flipped or not

    @property
    def mismatch_rate(self) -> float:
        return self.mismatches / self.positions if self.positions else 0.0

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "positions": self.positions, "mismatches": self.mismatches,
                "mismatch_rate": self.mismatch_rate, "max_abs_diff": self.max_abs_diff, "examples": self.examples,
                "nearest": self.nearest}


def _top2(dec: torch.Tensor, ver: torch.Tensor, t: int) -> dict:
    d2, v2 = dec[t].topk(2), ver[t].topk(2)
    return {"position": t, "decode_top2": [[int(i), float(x)] for x, i in zip(d2.values, d2.indices, strict=True)],
            "verify_top2": [[int(i), float(x)] for x, i in zip(v2.values, v2.indices, strict=True)],
            "flipped": int(d2.indices[0]) != int(v2.indices[0]), "gap": float(d2.values[0] - d2.values[1])}


@torch.no_grad()
def decode_vs_verify(runner: Runner, prompt_ids: list[int], new_tokens: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Greedy-decode new_tokens one at a time, then recompute the same positions K+1 at a time.

    Returns (decode logits (N, V), verify logits (N, V), the generated tokens).
    """
    cache = runner.new_cache(len(prompt_ids) + new_tokens + k + 2)
    logits, _ = runner.forward(torch.tensor([prompt_ids], device=runner.device), cache)
    dec, toks = [logits[0, -1]], []
    for _ in range(new_tokens - 1):
        toks.append(int(dec[-1].argmax()))
        logits, _ = runner.forward(torch.tensor([[toks[-1]]], device=runner.device), cache)
        dec.append(logits[0, -1])
    toks.append(int(dec[-1].argmax()))
    cache = runner.new_cache(len(prompt_ids) + new_tokens + k + 2)  # verify path: chunks of K+1
    logits, _ = runner.forward(torch.tensor([prompt_ids], device=runner.device), cache)
    ver = [logits[0, -1]]
    for s in range(0, new_tokens - 1, k + 1):
        chunk = toks[s : min(s + k + 1, new_tokens - 1)]
        logits, _ = runner.forward(torch.tensor([chunk], device=runner.device), cache)
        ver += list(logits[0])
    return torch.stack(dec).float(), torch.stack(ver).float(), toks


def measure_parity(model, prompts: list[list[int]], dtypes=("float32", "bfloat16", "float16"), new_tokens: int = 32,
                   k: int = 4, max_examples: int = 5) -> dict[str, ParityReport]:
    """Mismatch rate of argmax(verify) vs argmax(decode), per dtype, on the same positions."""
    reports = {}
    for name in dtypes:
        m = copy.deepcopy(model).to(DTYPES[name])
        runner = Runner(m)
        rep = ParityReport(name)
        for ids in prompts:
            dec, ver, _ = decode_vs_verify(runner, ids, new_tokens, k)
            rep.positions += dec.shape[0]
            rep.max_abs_diff = max(rep.max_abs_diff, float((dec - ver).abs().max()))
            flips = (dec.argmax(-1) != ver.argmax(-1)).nonzero().flatten().tolist()
            rep.mismatches += len(flips)
            rep.examples += [_top2(dec, ver, t) for t in flips[: max(0, max_examples - len(rep.examples))]]
            top = dec.topk(2, dim=-1).values  # (N, 2)
            gaps = (top[:, 0] - top[:, 1]).tolist()
            for t in sorted(range(len(gaps)), key=gaps.__getitem__)[:max_examples]:
                rep.nearest.append(_top2(dec, ver, t))
        rep.nearest = sorted(rep.nearest, key=lambda e: e["gap"])[:max_examples]
        reports[name] = rep
        del m
    return reports
