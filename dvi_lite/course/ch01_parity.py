"""Verify parity: does a batched verify pass pick the same argmax as token-by-token decoding?

In exact arithmetic the target's logits for position t do not depend on whether t is computed
alone (decode) or together with K other positions (verify). In floating point they do: a batched
matmul sums in a different order, and in bf16 a near-tie (two logits within one bf16 step, 2^-8
relative) can flip. Speculative decoding accepts by the *verify* logits, so its greedy output can
differ from plain greedy decoding at such ties: "lossless" is exact in exact arithmetic, and in fp32
the flips are so rare that our tests demand token-for-token equality. (seed 004's xserv lesson.)

Where flips happen is measured in bf16 steps: a position's decode top-1 minus top-2 logit gap divided by
the spacing of bf16 numbers at its top-1 logit (`bf16_step`). `tie_profile` counts positions and flips
below a few such steps; `parity_study` runs it all on any model and prompts (raw text or chat messages).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from dvi_lite.core.checks import check_int
from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.runner import Runner
from dvi_lite.models.loading import DTYPES

TIE_STEPS = (0.5, 1, 2, 4, 8, 16)  # near-tie thresholds, in bf16 steps at the top-1 logit


def bf16_step(x: float) -> float:
    """Spacing of bf16 numbers near x (8 significant bits): the size of a near-tie that can flip."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


@dataclass
class ParityReport:
    dtype: str
    positions: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0
    examples: list[dict] = field(default_factory=list)  # near-ties that flipped: top-2 of both paths
    nearest: list[dict] = field(default_factory=list)  # the closest decode top-2 gaps, flipped or not
    gap_steps: list[float] = field(default_factory=list)  # every position's decode top-2 gap, in bf16 steps
    flip_steps: list[float] = field(default_factory=list)  # the same at the flipped positions

    @property
    def mismatch_rate(self) -> float:
        return self.mismatches / self.positions if self.positions else 0.0

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "positions": self.positions, "mismatches": self.mismatches,
                "mismatch_rate": self.mismatch_rate, "max_abs_diff": self.max_abs_diff, "examples": self.examples,
                "nearest": self.nearest, "gap_steps": self.gap_steps, "flip_steps": self.flip_steps}


def _top2(dec: torch.Tensor, ver: torch.Tensor, t: int) -> dict:
    d2, v2 = dec[t].topk(2), ver[t].topk(2)
    return {"position": t, "decode_top2": [[int(i), float(x)] for x, i in zip(d2.values, d2.indices, strict=True)],
            "verify_top2": [[int(i), float(x)] for x, i in zip(v2.values, v2.indices, strict=True)],
            "flipped": int(d2.indices[0]) != int(v2.indices[0]), "gap": float(d2.values[0] - d2.values[1]),
            "gap_steps": _steps(float(d2.values[0]), float(d2.values[1]))}


def _steps(top1: float, top2: float) -> float:
    step = bf16_step(top1)
    return (top1 - top2) / step if step else math.inf


@torch.no_grad()
def decode_vs_verify(runner: Runner, prompt_ids: list[int], new_tokens: int,
                     K: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Greedy-decode new_tokens one at a time, then recompute the same positions K+1 at a time.

    Returns (decode logits (N, V), verify logits (N, V), the generated tokens).
    """
    cache = runner.new_cache(len(prompt_ids) + new_tokens + K + 2)
    logits, _ = runner.forward(torch.tensor([prompt_ids], device=runner.device), cache)
    dec, toks = [logits[0, -1]], []
    for _ in range(new_tokens - 1):
        toks.append(int(dec[-1].argmax()))
        logits, _ = runner.forward(torch.tensor([[toks[-1]]], device=runner.device), cache)
        dec.append(logits[0, -1])
    toks.append(int(dec[-1].argmax()))
    cache = runner.new_cache(len(prompt_ids) + new_tokens + K + 2)  # verify path: chunks of K+1
    logits, _ = runner.forward(torch.tensor([prompt_ids], device=runner.device), cache)
    ver = [logits[0, -1]]
    for s in range(0, new_tokens - 1, K + 1):
        chunk = toks[s : min(s + K + 1, new_tokens - 1)]
        logits, _ = runner.forward(torch.tensor([chunk], device=runner.device), cache)
        ver += list(logits[0])
    return torch.stack(dec).float(), torch.stack(ver).float(), toks


def measure_parity(model, prompts: list[list[int]], dtypes=("float32", "bfloat16", "float16"), new_tokens: int = 32,
                   K: int = 4, max_examples: int = 5) -> dict[str, ParityReport]:
    """Mismatch rate of argmax(verify) vs argmax(decode), per dtype, on the same positions, with every
    position's near-tie size (decode top-2 gap in bf16 steps). A model already in a dtype runs as is; for the
    others a copy is cast."""
    reports = {}
    for name in dtypes:
        m = model if next(model.parameters()).dtype == DTYPES[name] else copy.deepcopy(model).to(DTYPES[name])
        runner = Runner(m)
        rep = ParityReport(name)
        for ids in prompts:
            dec, ver, _ = decode_vs_verify(runner, ids, new_tokens, K)
            rep.positions += dec.shape[0]
            rep.max_abs_diff = max(rep.max_abs_diff, float((dec - ver).abs().max()))
            flips = (dec.argmax(-1) != ver.argmax(-1)).nonzero().flatten().tolist()
            rep.mismatches += len(flips)
            rep.examples += [_top2(dec, ver, t) for t in flips[: max(0, max_examples - len(rep.examples))]]
            top = dec.topk(2, dim=-1).values  # (N, 2)
            steps = [_steps(a, b) for a, b in top.tolist()]
            rep.gap_steps += steps
            rep.flip_steps += [steps[t] for t in flips]
            gaps = (top[:, 0] - top[:, 1]).tolist()
            for t in sorted(range(len(gaps)), key=gaps.__getitem__)[:max_examples]:
                rep.nearest.append(_top2(dec, ver, t))
        rep.nearest = sorted(rep.nearest, key=lambda e: e["gap"])[:max_examples]
        reports[name] = rep
        if m is not model:
            del m
    return reports


def tie_profile(rep: ParityReport, steps: tuple[float, ...] = TIE_STEPS) -> list[dict]:
    """For each threshold s (in bf16 steps): the positions whose decode top-2 gap is below s, and the flips
    among them. If flips are rounding at near-ties, they all sit below a few steps while most positions do not."""
    return [{"below_steps": s, "positions": sum(g < s for g in rep.gap_steps),
             "flips": sum(g < s for g in rep.flip_steps)} for s in steps]


def parity_study(model, tok, prompts: list, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                 new_tokens: int = 32, K: int = 4, max_examples: int = 5) -> dict:
    """Verify parity of `model` on `prompts` (records with a "prompt", or prompts: a str, token ids, chat
    messages), per dtype: {"rows": counts per dtype, "examples": flips, "nearest": the smallest decode top-2
    gaps (flipped or not), each with its dtype, tokens, gap and bf16 step, "ties": {dtype: tie_profile},
    "gap_steps" / "flip_steps": {dtype: gaps in bf16 steps of every / every flipped position}}."""
    check_int("new_tokens", new_tokens, 1)
    check_int("K (draft tokens per step)", K, 1)
    ids = [prompt_ids(tok, p["prompt"] if isinstance(p, dict) else p) for p in prompts]
    reps = measure_parity(model, ids, dtypes, new_tokens, K, max_examples)
    out: dict = {"rows": [], "examples": [], "nearest": [], "ties": {}, "gap_steps": {}, "flip_steps": {}}
    for name, rep in reps.items():
        d = rep.to_dict()
        nearest = min(rep.gap_steps, default=math.inf)
        out["rows"].append({**{x: d[x] for x in ("dtype", "positions", "mismatches", "mismatch_rate", "max_abs_diff")},
                            "nearest_gap_steps": nearest})
        out["examples"] += [describe(ex, name, tok) for ex in rep.examples]
        out["nearest"] += [describe(ex, name, tok) for ex in rep.nearest]
        out["ties"][name] = tie_profile(rep)
        out["gap_steps"][name], out["flip_steps"][name] = rep.gap_steps, rep.flip_steps
    return out


def describe(ex: dict, dtype: str, tok) -> dict:
    """A top-2 record made readable: its dtype, the two decode tokens as text, the gap and the bf16 step."""
    (t1, v1), (t2, v2) = ex["decode_top2"]
    return {**ex, "dtype": dtype, "tokens": [tok.decode([t1]), tok.decode([t2])], "decode_gap": v1 - v2,
            "bf16_step": bf16_step(v1)}


def check_invariants(study: dict) -> list[str]:
    """A parity study's claims: consistent counts (flips <= positions, each threshold's flips <= its positions,
    the counts growing with the threshold), no argmax flip in fp32, and near-ties reported for every dtype."""
    from dvi_lite.study.table import require

    for r in study["rows"]:
        name = r["dtype"]
        require(0 <= r["mismatches"] <= r["positions"] and r["positions"] > 0, f"parity counts inconsistent: {r}")
        require(len(study["flip_steps"][name]) == r["mismatches"], f"{name}: flip gaps do not match the mismatches")
        ties = study["ties"][name]
        require(all(t["flips"] <= t["positions"] <= r["positions"] for t in ties), f"{name}: tie counts {ties}")
        pairs = zip(ties, ties[1:], strict=False)
        require(all(a["positions"] <= b["positions"] and a["flips"] <= b["flips"] for a, b in pairs),
                f"{name}: tie counts do not grow with the threshold: {ties}")
        require(any(e["dtype"] == name for e in study["nearest"]), f"{name}: no near-tie reported")
        if name == "float32":
            require(r["mismatches"] == 0, f"fp32 verify flipped {r['mismatches']} argmaxes")
    return [f"parity study: {len(study['rows'])} dtypes, counts consistent, near-ties reported, 0 flips in fp32"]
