"""Checks of the prompt-lookup and EAGLE exercises (re-exported by `checks`).

Each compares `fn` with the package's own code on seeded cases: the proposer with methods.pld.PromptLookupDrafter,
τ on a known answer with course.ch06_prompt_lookup.replay, the training-time test's mask with
methods.eagle.ttt.ttt_mask, and its loss slot by slot with the package's `soft_ce` (what methods.eagle.ttt.ttt_loss
sums after the head's forward). A stub's NotImplementedError passes through.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dvi_lite.course.ch06_prompt_lookup import replay
from dvi_lite.course.exercises.checks_training import _call, _same
from dvi_lite.methods.eagle.ttt import ttt_mask as reference_mask
from dvi_lite.methods.pld import PromptLookupDrafter
from dvi_lite.models.teacher import soft_ce


def _texts(seed: int, n: int = 60) -> list[list[int]]:
    """Token lists with repeats to copy: small vocabularies, a repeated template, and a few edge cases."""
    gen = torch.Generator().manual_seed(seed)
    out = [[1], [1, 1], [1, 2], [1, 2, 1], [3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 1, 2, 7, 8, 9]]
    for i in range(n):
        v = 3 + i % 6
        out.append(torch.randint(0, v, (2 + i % 23,), generator=gen).tolist())
    return out


# --------------------------------------------------------------------------- 06 prompt lookup

def check_prompt_lookup(fn: Callable, seed: int = 0) -> str:
    """Against methods.pld.PromptLookupDrafter.lookup (the proposer pld decodes with)."""
    cases = 0
    for tokens in _texts(seed):
        for k in (1, 3, 6):
            for max_ngram in (1, 2, 3):
                label = f"prompt_lookup({tokens}, K={k}, max_ngram={max_ngram})"
                want = PromptLookupDrafter(k, max_ngram).lookup(list(tokens), k)
                got = _call(fn, label, list(tokens), k, max_ngram)
                assert list(got) == want, f"{label} = {got!r}, expected {want} (the longest n first; for that n the " \
                                          "most recent earlier occurrence; the K tokens that followed it)"
                cases += 1
    return f"ok: the proposals match pld's proposer on {cases} cases (ties, no match, n = 1..3)"


def check_lookup_tau(fn: Callable, seed: int = 1) -> str:
    """Against course.ch06_prompt_lookup.replay (the engine's greedy steps, replayed on the answer)."""
    texts = _texts(seed, 40)
    cases = 0
    for prompt, answer in zip(texts[::2], texts[1::2], strict=False):
        for k in (1, 2, 5):
            label = f"lookup_tau({prompt}, {answer}, K={k})"
            log = replay(prompt, answer, k)
            want = (len(answer) - 1) / len(log) if log else 1.0
            got = _call(fn, label, prompt, answer, k)
            assert abs(float(got) - want) <= 1e-12, f"{label} = {got!r}, expected {want} from the steps {log} " \
                                                    "(depth, accepted): one target token per step"
            cases += 1
    return f"ok: τ matches the replayed greedy steps on {cases} (prompt, answer) pairs"


# --------------------------------------------------------------------------- 07 EAGLE

def check_ttt_mask(fn: Callable) -> str:
    """Against methods.eagle.ttt.ttt_mask for rows of 1..7 slots and steps 0..4."""
    for t in range(1, 8):
        for step in range(5):
            label = f"ttt_mask({t}, {step})"
            got = _call(fn, label, t, step)
            _same(got, reference_mask(t, step), label, " (step 0: causal over the committed slots; each later "
                  "step: only the slot's own copy, a diagonal)", atol=0)
            assert got.dtype == torch.bool, f"{label} has dtype {got.dtype}, expected torch.bool"
    return "ok: the masks match the training-time test's for 7 row lengths × 5 steps"


def _reference_ttt(logqs, top_ids, top_logp, mask, decay) -> torch.Tensor:
    """The loss read slot by slot: every slot j whose target position j + 1 + s is a real token, its soft CE."""
    parts = []
    for s, logq in enumerate(logqs):
        rows, j = torch.nonzero(mask[:, 1 + s:], as_tuple=True)  # slots whose target exists
        ce = soft_ce(logq[rows, j], top_ids[rows, j + 1 + s], top_logp[rows, j + 1 + s])
        parts.append(decay ** s * ce.mean() if len(ce) else torch.zeros(()))
    return torch.stack(parts).sum()


def check_ttt_step_loss(fn: Callable, seed: int = 0) -> str:
    """Against the training-time test's loss read slot by slot with the package's `soft_ce`."""
    gen = torch.Generator().manual_seed(seed)
    for b, t, v, k, steps, decay in ((2, 6, 9, 3, 3, 0.8), (3, 4, 5, 5, 4, 0.5), (1, 3, 7, 2, 1, 1.0)):
        logqs = [torch.randn(b, t, v, generator=gen).log_softmax(-1) for _ in range(steps)]
        top_ids = torch.randint(0, v, (b, t, k), generator=gen)
        top_logp = torch.randn(b, t, k, generator=gen)
        mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b, 1), generator=gen)  # right-padded rows
        label = f"ttt_step_loss({steps} steps of ({b}, {t}, {v}), k={k}, decay={decay})"
        _same(_call(fn, label, logqs, top_ids, top_logp, mask, decay),
              _reference_ttt(logqs, top_ids, top_logp, mask, decay), label,
              " (step s's targets and weights are shifted left by 1 + s; each step is a weighted mean; Σ decay^s)")
    return "ok: the loss matches the training-time test's on 3 batches (1 to 4 steps)"
