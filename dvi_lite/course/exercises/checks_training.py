"""Checks of the exercises on what each draft is trained on and what it costs (re-exported by `checks`).

Each compares `fn` with the package's own code on seeded cases: the distillation loss (models.teacher.soft_ce),
the trimmed-head targets and Medusa's per-head targets (methods.medusa.teacher_train), Draft & Verify's draft cost
(methods.draft_verify.objective.SublayerCosts.c), DVI's REINFORCE term (methods.dvi.losses); the roofline against
its two floors written out. A stub's NotImplementedError passes through.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from dvi_lite.core.runner import Skip
from dvi_lite.methods.draft_verify.objective import SublayerCosts
from dvi_lite.methods.dvi.losses import reinforce_loss as reference_reinforce
from dvi_lite.methods.medusa.teacher_train import head_targets as reference_head_targets
from dvi_lite.methods.medusa.teacher_train import trim_targets as reference_trim
from dvi_lite.models.teacher import soft_ce as reference_soft_ce


def _call(fn: Callable, label: str, *args, **kwargs):
    """fn(*args, **kwargs); any error but NotImplementedError becomes an AssertionError naming the case (the one
    such helper: `checks` and `checks_chapters` import it)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the learner's bug, reported with its case
        raise AssertionError(f"{label} raised {type(e).__name__}: {e}") from e


def _same(got, want: torch.Tensor, label: str, hint: str, atol: float = 1e-5) -> None:
    ok = isinstance(got, torch.Tensor) and got.shape == want.shape and bool(
        torch.allclose(got.float(), want.float(), atol=atol, rtol=1e-5, equal_nan=True))
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
    assert ok, f"{label}: got {shape} {got!r:.200}, expected {tuple(want.shape)} {want!r:.200}{hint}"


# --------------------------------------------------------------------------- 00 foundations

def check_roofline_time(fn: Callable) -> str:
    """Against max(bytes / bandwidth, flops / peak) and the bound that sets it, on a grid of machines and models."""
    cases = [(269e6, 270e6, 11.5, 100.0), (269e6, 270e6 * 64, 11.5, 100.0), (16.5e6, 33e6, 40.0, 2.0),
             (1e9, 2e9, 2000.0, 1e6), (2e9, 2e9, 1.0, 1.0), (4e6, 8e9, 50.0, 500.0)]
    for b, f, bw, peak in cases:
        label = f"roofline_time({b:g}, {f:g}, {bw:g}, {peak:g})"
        got = _call(fn, label, b, f, bw, peak)
        stream, compute = b / (bw * 1e9), f / (peak * 1e9)
        want = (max(stream, compute), "memory" if stream >= compute else "compute")
        assert isinstance(got, tuple) and len(got) == 2, f"{label} returned {got!r}, expected (seconds, bound)"
        assert abs(float(got[0]) - want[0]) <= 1e-12 + 1e-9 * want[0], \
            f"{label}: {got[0]!r} s, expected {want[0]!r} (bandwidth and peak are in 1e9 per second)"
        assert got[1] == want[1], f"{label}: bound {got[1]!r}, expected {want[1]!r} (streaming {stream:.3g} s, " \
                                  f"arithmetic {compute:.3g} s; a tie is memory)"
    return f"ok: the floor and its bound match on {len(cases)} machines, the tie included"


# --------------------------------------------------------------------------- 01 speculative sampling (the SpS draft)

def check_soft_ce(fn: Callable, seed: int = 0) -> str:
    """Against models.teacher.soft_ce, with batch shapes, peaked and flat targets and left-out (-inf) entries."""
    gen = torch.Generator().manual_seed(seed)
    for shape, v, k in (((5,), 11, 3), ((2, 4), 50, 8), ((3, 1, 2), 7, 7)):
        logq = torch.randn(*shape, v, generator=gen).log_softmax(-1)
        ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(int(torch.tensor(shape).prod()))]
                          ).reshape(*shape, k)
        logp = torch.randn(*shape, k, generator=gen) * 3
        logp[..., -1] = float("-inf")  # a token left out (off the trimmed head's map)
        label = f"soft_ce(logq {tuple(logq.shape)}, top_ids {tuple(ids.shape)}, top_logp)"
        _same(_call(fn, label, logq, ids, logp), reference_soft_ce(logq, ids, logp), label,
              " (p = softmax(top_logp) over the kept entries, then -Σ p · logq[top_ids] over the last axis)")
    return "ok: the loss matches models.teacher.soft_ce on 3 shapes, -inf entries included"


# --------------------------------------------------------------------------- 02 Kangaroo (the trimmed head)

def check_trim_targets(fn: Callable, seed: int = 0) -> str:
    """Against methods.medusa.teacher_train.trim_targets (the map every trimmed head trains through)."""
    gen = torch.Generator().manual_seed(seed)
    v, n = 40, 12
    index_of = torch.full((v,), -1, dtype=torch.long)
    index_of[torch.randperm(v, generator=gen)[:n]] = torch.arange(n)
    ids = torch.randint(0, v, (9, 4), generator=gen)
    ids[0] = torch.nonzero(index_of < 0).flatten()[:4]  # a row with nothing on the map
    logp = torch.randn(9, 4, generator=gen).half()
    label = "trim_targets(ids (9, 4), logp (9, 4), index_of (40,))"
    got = _call(fn, label, ids, logp, index_of)
    want = reference_trim(ids, logp, index_of)
    assert isinstance(got, tuple) and len(got) == 3, f"{label} returned {type(got).__name__}, expected 3 tensors"
    for what, g, w, hint in zip(("rows", "logp", "kept"), got, want, (
            " (index_of[ids], with the off-map -1 replaced by 0)", " (float, -inf where the id is off the map)",
            " (any id of the row on the map: row 0 has none)"), strict=True):
        _same(g, w, f"{label}: {what}", hint)
        assert g.dtype == w.dtype, f"{label}: {what} has dtype {g.dtype}, expected {w.dtype}{hint}"
    return "ok: rows, masked log-probs and the kept flags match on 9 rows (one entirely off the map)"


# --------------------------------------------------------------------------- 03 Draft & Verify

def check_skip_cost(fn: Callable, seed: int = 0) -> str:
    """Against methods.draft_verify.objective.SublayerCosts.c on random costs and skip sets."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(60):
        n = 2 + i % 30
        attn, mlp, fixed = (float(x) for x in torch.rand(3, generator=gen) * 1e-3 + 1e-5)
        sa = sorted(torch.randperm(n, generator=gen)[: int(torch.randint(0, n + 1, (), generator=gen))].tolist())
        sm = sorted(torch.randperm(n, generator=gen)[: int(torch.randint(0, n + 1, (), generator=gen))].tolist())
        costs = SublayerCosts(n, attn, mlp, head=0.0, full=fixed + n * (attn + mlp))
        want = costs.c(Skip(frozenset(sa), frozenset(sm)))
        label = f"skip_cost({n}, {attn:.3g}, {mlp:.3g}, {fixed:.3g}, skip_attn={sa}, skip_mlp={sm})"
        got = _call(fn, label, n, attn, mlp, fixed, sa, sm)
        assert abs(float(got) - want) <= 1e-9, f"{label} = {got!r}, expected {want!r} (kept sub-layers plus the " \
                                               "fixed part, over the fixed part plus every sub-layer)"
    return "ok: c matches SublayerCosts.c on 60 random skip sets (none skipped to all skipped)"


# --------------------------------------------------------------------------- 04 Medusa

def check_head_targets(fn: Callable, seed: int = 0) -> str:
    """Against methods.medusa.teacher_train.head_targets for heads 0..4 at every position (row ends included)."""
    gen = torch.Generator().manual_seed(seed)
    n, t_len, k = 6, 9, 3
    top_ids = torch.randint(0, 100, (n, t_len, k), generator=gen)
    top_logp = torch.randn(n, t_len, k, generator=gen)
    mask = torch.arange(t_len)[None] < torch.tensor([9, 7, 5, 9, 3, 8])[:, None]  # right-padded rows
    data = SimpleNamespace(top_ids=top_ids, top_logp=top_logp, mask=mask)
    rows = torch.arange(n)
    for i in range(5):
        for t0 in range(t_len):
            t = (torch.arange(n) + t0) % t_len
            label = f"head_targets(..., t={t.tolist()}, i={i})"
            got = _call(fn, label, top_ids, top_logp, mask, t, i)
            want = reference_head_targets(data, rows, t, i)
            assert isinstance(got, tuple) and len(got) == 3, f"{label} returned {type(got).__name__}, expected 3"
            for what, g, w in zip(("ids", "logp", "valid"), got, want, strict=True):
                _same(g, w, f"{label}: {what}", " (head i reads position t + 1 + i; past the row's end, or on "
                      "padding, it is not valid)")
    return "ok: heads 0..4 read the right positions, with validity, on 9 positions × 6 rows"


# --------------------------------------------------------------------------- 05 DVI

def check_reinforce_loss(fn: Callable, seed: int = 0) -> str:
    """Against methods.dvi.losses.reinforce_loss: the value and the gradient it sends to the logits."""
    gen = torch.Generator().manual_seed(seed)
    for n, v, b in ((4, 7, 0.5), (16, 30, 0.1), (1, 5, 0.0), (9, 12, 0.9)):
        logits = torch.randn(n, v, generator=gen)
        tokens = torch.randint(0, v, (n,), generator=gen)
        rewards = (torch.rand(n, generator=gen) < 0.5).float()
        label = f"reinforce_loss(logits ({n}, {v}), tokens, rewards={rewards.tolist()}, baseline={b})"
        mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got = _call(fn, label, mine, tokens, rewards, b)
        want = reference_reinforce(ref, tokens, rewards, b)
        _same(got, want, label, " (mean over drafts of -(r - b) · log softmax(logits)[token])")
        got.backward()
        want.backward()
        _same(mine.grad, ref.grad, f"{label}: the gradient", " (the advantage r - b must carry no gradient)")
    return "ok: the loss and its gradient match DVI's reinforce_loss on 4 batches"
