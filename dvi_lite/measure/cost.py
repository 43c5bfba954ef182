"""The verify-cost model v(n), measured, and the speedup it predicts.

v(n) = time of one target forward over n new tokens / time of a 1-token forward, with the same number
of cached positions, for the model, dtype and device at hand. It is what decides whether speculation
can pay: a step that drafts K tokens costs one forward over K + 1 tokens, v(K + 1) in units of an AR
step, plus the drafting, K * c (c = one draft token's cost in the same unit). With tau tokens per step,

    predicted speedup = tau / (v(K + 1) + K * c)        (a tree: v(nodes + 1))

A memory-bound model (weights streamed once per forward, whatever n) has v(n) close to 1 for small n,
so verification is nearly free; an overhead- or compute-bound one has v(n) growing with n, and the
same tau buys much less. The calibration is short (a few dozen forwards), so the bench can run it in
the process it times and record it beside the results.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch

from dvi_lite.core.checks import check_int, check_real
from dvi_lite.core.lean import runtime_of
from dvi_lite.core.runner import Runner

NS = (1, 2, 3, 5, 9, 17)  # n new tokens: AR, then K + 1 for the usual draft lengths


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()  # as the decode loop runs (core.engine.grad_free): the same per-op cost
def forward_times(model, ns: tuple[int, ...] = NS, context: int = 200, repeats: int = 7,
                  seed: int = 0) -> dict[int, float]:
    """{n: median seconds of one forward (every layer + the LM head at all n positions) over n new tokens
    with `context` positions already cached}.

    One warm-up round, then `repeats` rounds; each round runs every n once, in a rotated order, so a
    slow spell of the machine (another process, a frequency change) hits every n alike. The cache is
    cropped back to `context` after each forward: every measurement sees the same cache.
    """
    ns = tuple(check_int("n (new tokens per forward)", n, 1) for n in ns)
    if not ns:
        raise ValueError("ns: give at least one n")
    check_int("context (cached positions)", context, 0)
    check_int("repeats", repeats, 1)
    runner = Runner.for_model(model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context + max(ns) > limit:
        raise ValueError(f"context ({context}) + n ({max(ns)}) exceeds the model's {limit} positions")
    vocab = runner.lm_head.weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    dev = runner.device
    cache = runner.new_cache(context + max(ns))
    if context:
        runner.forward(torch.randint(0, vocab, (1, context), generator=gen).to(dev), cache)
    inputs = {n: torch.randint(0, vocab, (1, n), generator=gen).to(dev) for n in ns}  # (1, n) each
    cases = {n: (lambda x=inputs[n]: runner.forward(x, cache)) for n in ns}
    times = interleaved_times(cases, repeats, dev, reset=lambda: cache.crop(context))
    return {n: statistics.median(ts) for n, ts in times.items()}


def interleaved_times(cases: Mapping, repeats: int, device: torch.device, reset: Callable[[], object] = lambda: None,
                      warmup: int = 1) -> dict:
    """{case: [seconds of each timed call]} for `cases` = {name: zero-argument call}.

    `warmup` untimed rounds, then `repeats` timed ones; each round calls every case once, in an order rotated by
    one per round, so a slow spell of the machine (another process, a frequency change) hits every case alike.
    `reset` runs after every call, untimed (e.g. crop a KV cache back, so every call sees the same state)."""
    names = list(cases)
    times: dict = {name: [] for name in names}
    for r in range(warmup + repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = _now(device)
            cases[name]()
            t1 = _now(device)
            reset()
            if r >= warmup:
                times[name].append(t1 - t0)
    return times


def verify_cost(model, ns: tuple[int, ...] = NS, context: int = 200, repeats: int = 7,
                seed: int = 0) -> dict[int, float]:
    """v(n) = median forward time over n new tokens / that over 1 token, for each n (1 is always measured,
    so v(1) == 1 exactly)."""
    ns = tuple(sorted(set(ns) | {1}))
    t = forward_times(model, ns, context, repeats, seed)
    return {n: t[n] / t[1] for n in ns}


def context_for(model, tok, prompts: list[dict], max_new_tokens: int) -> int:
    """The cache length to time v(n) at: the prompts' mean length + half the new tokens (the mean cache length
    while decoding), within the model's positions."""
    from dvi_lite.core.generate import prompt_ids

    lens = [len(prompt_ids(tok, r["prompt"])) for r in prompts]
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return max(0, min(round(statistics.mean(lens)) + max_new_tokens // 2 if lens else 0, limit - max(NS)))


def calibrate(model, tok, prompts: list[dict], max_new_tokens: int,
              repeats: int = 5) -> tuple[dict[int, float], int]:
    """({n: v(n)}, context): the verify-cost table measured at `context_for` the prompts."""
    ctx = context_for(model, tok, prompts, max_new_tokens)
    return verify_cost(model, NS, ctx, repeats), ctx


def steady(tables: list[Mapping]) -> tuple[dict[int, float], list[int]]:
    """(table, flagged): the median v(n) over several calibrations (one per bench round), made non-decreasing in
    n, and the n > 1 whose median came out below 1.

    A forward over more tokens never costs less than one over fewer, so a dip is timing noise: the envelope keeps
    predictions from pricing verification below an AR step. The flag says where that happened, so a report can
    show it rather than a prediction above the "free verification" ceiling.
    """
    if not tables:
        raise ValueError("tables: give at least one v(n) table")
    ns = sorted({int(n) for t in tables for n in t})
    med = {n: statistics.median(float(t[n] if n in t else t[str(n)]) for t in tables
                                if n in t or str(n) in t) for n in ns}
    flagged = [n for n in ns if n > 1 and med[n] < 1]
    out, top = {}, 0.0
    for n in ns:
        top = max(top, med[n])
        out[n] = top
    return out, flagged


def v_of(table: Mapping, n: float) -> float:
    """v at any n >= 1 from a measured table {n: v(n)} (keys may be strings, as read back from JSON):
    linear between measured points, flat below the smallest, extended along the last segment above the
    largest (a forward's cost grows about linearly once it is compute bound); from a single point, in
    proportion to n (the pessimistic compute-bound guess)."""
    check_real("n (tokens per forward)", n, 1)
    pts = sorted((int(k), float(v)) for k, v in table.items())
    if not pts:
        raise ValueError("the v(n) table is empty")
    if n <= pts[0][0] or len(pts) == 1:
        return pts[0][1] if n <= pts[0][0] else pts[0][1] * n / pts[0][0]
    for (n0, v0), (n1, v1) in zip(pts, pts[1:], strict=False):
        if n <= n1:
            return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    (n0, v0), (n1, v1) = pts[-2], pts[-1]
    return v1 + (v1 - v0) * (n - n1) / (n1 - n0)


def predicted_speedup(tau: float, K: float, c: float, v: Mapping | Callable[[float], float],
                      nodes: float | None = None) -> float:
    """tau / (v(K + 1) + K * c): tokens per step over the step's cost in AR forwards.

    tau: mean tokens per target forward (accepted + the bonus/correction token); K: draft depth per step
    (draft forwards); c: one draft forward's cost relative to a 1-token target forward; v: the measured
    table {n: v(n)} or a function of n; nodes: draft tokens verified per step when that differs from K
    (a tree verifies all its nodes in one forward, v(nodes + 1), but drafts them in K forwards).
    """
    check_real("tau (tokens per step)", tau, 1)
    check_real("K (draft tokens per step)", K, 0)
    check_real("c (draft cost per token)", c, 0)
    n = K + 1 if nodes is None else check_real("nodes (draft tokens verified per step)", nodes, 0) + 1
    cost = v(n) if callable(v) else v_of(v, n)
    return tau / (cost + K * c)


def expected_tau(alpha: float, K: int) -> float:
    """Tokens per step of a K-token draft whose tokens are each accepted with probability alpha, in order:
    1 + alpha + ... + alpha^K (the verifier's own token included)."""
    check_real("alpha", alpha, 0.0, 1.0)
    check_int("K (draft tokens per step)", K, 0)
    return float(K + 1) if alpha >= 1.0 else (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def best_speedup(alpha: float, c: float, v: Mapping | Callable[[float], float], k_max: int = 8) -> tuple[float, int]:
    """(predicted speedup, K) at the draft length K in [1, k_max] that the cost model prefers, for a chain whose
    tokens are each accepted with probability alpha."""
    check_int("k_max", k_max, 1)
    return max((predicted_speedup(expected_tau(alpha, k), k, c, v), k) for k in range(1, k_max + 1))


def _edge(ok, rising: bool) -> float | None:
    """Where a monotone condition on [0, 1] switches: the smallest x with ok(x) when it holds above the edge
    (rising), else the largest; None when it holds nowhere. Bisection to ~1e-12."""
    if not ok(1.0 if rising else 0.0):
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if ok(mid) == rising:
            hi = mid
        else:
            lo = mid
    return hi if rising else lo


def alpha_needed(target: float, c: float, v, k_max: int = 8, K: int | None = None) -> float | None:
    """The smallest per-token acceptance at which the cost model predicts `target` speedup at draft cost c
    (best K <= k_max, or at the given K); None if even alpha = 1 falls short (the speedup rises with alpha)."""
    if K is not None:
        return _edge(lambda a: predicted_speedup(expected_tau(a, K), K, c, v) >= target, rising=True)
    return _edge(lambda a: best_speedup(a, c, v, k_max)[0] >= target, rising=True)


def c_needed(target: float, alpha: float, v, k_max: int = 8) -> float | None:
    """The largest draft cost c at which acceptance alpha still predicts `target` speedup; None if even a free
    draft (c = 0) falls short (the speedup falls as c grows)."""
    return _edge(lambda c: best_speedup(alpha, c, v, k_max)[0] >= target, rising=False)


# --------------------------------------------------------------------------- machine facts: the roofline's two sides

def weight_bytes(model) -> int:
    """Bytes of weights one decoding forward reads: every parameter once (tied ones once), except an untied input
    embedding, of which a forward reads only the rows of its tokens. Divided by the time per AR token it gives the
    bandwidth AR achieves, to set against `memory_bandwidth`. On the lean or int8 runtime: its packed weights."""
    if runtime_of(model) != "hf":
        return Runner.for_model(model).streamed_bytes()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or emb.weight is not head.weight):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


@torch.no_grad()
def memory_bandwidth(mb: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> dict[str, float]:
    """The machine's measured memory bandwidth in GB/s (1e9 bytes): a torch copy of `mb` MiB (read + write
    counted, 2 x mb) and a sum over it (read only); medians of `repeats` after one warm-up.

    The buffer is far larger than any cache, so this is what streaming weights from memory can reach: the
    roof that a memory-bound decoder (weights read once per forward) runs against.
    """
    check_int("mb (buffer size in MiB)", mb, 1)
    check_int("repeats", repeats, 1)
    dev = torch.device(device)
    a = torch.ones(mb * 2**20 // 4, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    times: dict[str, list[float]] = {"copy": [], "read": []}
    for r in range(repeats + 1):  # round 0 is the warm-up (first touch of b's pages)
        t0 = _now(dev)
        b.copy_(a)
        t1 = _now(dev)
        a.sum()
        t2 = _now(dev)
        if r:
            times["copy"].append(t1 - t0)
            times["read"].append(t2 - t1)
    nbytes = a.numel() * a.element_size()
    return {"copy_GBps": 2 * nbytes / statistics.median(times["copy"]) / 1e9,
            "read_GBps": nbytes / statistics.median(times["read"]) / 1e9, "buffer_mib": mb}


@torch.no_grad()
def gemv_rates(sizes_mib: tuple[float, ...] = (1, 4, 16, 64, 256), cols: int = 576, repeats: int = 20,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict[float, float]:
    """{matrix MiB: GB/s} of one matrix-vector product (a decoding step's shape: batch 1) over a weight matrix of
    that size, `cols` wide; median of `repeats` after a warm-up.

    Small matrices stay in the caches between calls and run far above the DRAM figure of `memory_bandwidth`;
    once a matrix outgrows the last-level cache every call streams it from DRAM. That is why a draft small enough
    to stay in cache costs a few % of a target forward that streams hundreds of MB.
    """
    check_int("cols", cols, 1)
    check_int("repeats", repeats, 1)
    dev = torch.device(device)
    out = {}
    for mib in sizes_mib:
        check_real("matrix size (MiB)", mib, 0, low_open=True)
        rows = max(1, round(mib * 2**20 / (cols * torch.finfo(dtype).bits // 8)))
        w = torch.randn(rows, cols, dtype=dtype, device=dev)
        x = torch.randn(cols, dtype=dtype, device=dev)
        times = []
        for r in range(repeats + 1):
            t0 = _now(dev)
            torch.mv(w, x)
            if r:
                times.append(_now(dev) - t0)
        out[mib] = w.numel() * w.element_size() / statistics.median(times) / 1e9
    return out


@torch.no_grad()
def compute_peak(n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> float:
    """The machine's matrix-multiply rate in GFLOP/s (2 n^3 per n x n product; median of `repeats` after a
    warm-up): the compute roof a forward over many tokens at once runs against."""
    check_int("n (matrix side)", n, 1)
    check_int("repeats", repeats, 1)
    dev = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    times = []
    for r in range(repeats + 1):
        t0 = _now(dev)
        a @ b
        if r:
            times.append(_now(dev) - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9
