"""The timing harness under the bench: methods run by name on the same prompts, paired and interleaved.

`bench` runs every method on the same prompts in one process, with a warm-up, then `repeats` timed rounds; within
a round the methods run back to back on each prompt, in an order rotated by prompt and round, and each method's
speedup is its rate over AR's on the same prompt in the same round (measure.paired), with the verify-cost model
calibrated per round (measure.cost) and the rounds summarised (measure.summary). `step_log` and `decode_counts`
give the per-step counts behind tau and alpha. Methods are named through the registry, so this module imports no
method: the recipes that size a method's pieces (sps, medusa, eagle) call it from above, and the `bench` command
(study.bench) wraps it with model loading, prompt files and the JSON it writes.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from tqdm.auto import tqdm

from dvi_lite.core.checks import RENAMED, reject_renamed
from dvi_lite.core.engine import acceptance_rate, position_acceptance
from dvi_lite.core.generate import generate
from dvi_lite.core.lean import RUNTIMES, serving
from dvi_lite.core.registry import METHODS
from dvi_lite.measure import cost, paired
from dvi_lite.measure.summary import summarise


def parse_spec(spec: str) -> tuple[str, dict]:
    """'kangaroo:branch=2:threshold=0.4' -> ('kangaroo', {'branch': 2, 'threshold': 0.4}).

    A method label may carry options after colons, so one run can compare variants of a method
    (the label is the row name). Values are read as int, float, none/true/false, else string.
    `label=...` only names a row ('draft_verify:label=uniform') and is not passed to the method. An old option name
    ('sps:k=4': K now, k is the exit layer) fails naming the new one (core.checks.RENAMED).
    """
    name, *parts = spec.split(":")
    opts = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise ValueError(f"--methods: option {part!r} in {spec!r} must look like key=value")
        opts[key] = _value(val)
    opts.pop("label", None)
    reject_renamed({n: v for n, v in opts.items() if n in RENAMED}, f"--methods {spec!r}")
    return name, opts


def _value(v: str):
    low = v.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def check_method(name: str, flag: str = "--methods") -> None:
    if name not in METHODS:
        raise ValueError(f"{flag}: unknown method {name!r}; registered: {', '.join(sorted(METHODS))}")


def leviathan_speedup(alpha: float, K: float, c: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): Leviathan et al.'s expected speedup, which prices verifying
    K + 1 tokens like one AR step (v = 1). The bench predicts with the measured v(n) instead (measure.cost)."""
    tokens = K + 1 if alpha >= 1 else (1 - alpha ** (K + 1)) / (1 - alpha)
    return tokens / (K * c + 1)


TIMING = ("paired per prompt and interleaved, rounds in one process; speedup = the median over prompts of "
          "per-prompt decode-phase ratios to AR, with a 90% bootstrap interval")
GROUP_SUMS = ("n", "new_tokens", "time_s", "steps", "accepted", "drafted")  # per domain / task group and round


def new_sums() -> dict:
    """The sums one method gathers over one round of prompts (filled by `add_run`)."""
    return {"new_tokens": 0, "time_s": 0.0, "decode_tokens": 0, "decode_s": 0.0, "steps": 0, "accepted": 0,
            "drafted": 0, "log": [], "draft_s": 0.0, "verify_s": 0.0, "domains": {}, "outputs": [], "prompts": [],
            "peak_mem_bytes": None}


def split_runtime(label: str) -> tuple[str, str | None]:
    """("ar", "lean") from "ar@lean": a bench label may name the runtime it runs on (core.lean.RUNTIMES)."""
    base, _, runtime = label.partition("@")
    if runtime and runtime not in RUNTIMES:
        raise ValueError(f"{label!r}: the runtime after '@' must be one of {list(RUNTIMES)}, got {runtime!r}")
    return base, runtime or None


def options_for(options: dict[str, dict], label: str) -> tuple[str, dict]:
    """A bench label's method and options, merged in this order: options[method], then options[label], then the
    label's own ('eagle:lookup=true' -> ('eagle', {**options['eagle'], 'lookup': True})); a runtime after '@' is
    not an option (split_runtime reads it)."""
    name, own = parse_spec(split_runtime(label)[0])
    return name, {**options.get(name, {}), **(options.get(label, {}) if label != name else {}), **own}


def run_one(model, tok, rec: dict, i: int, method: str, max_new_tokens: int, temperature: float, top_p: float,
            seed: int, options: dict, runtime: str | None = None):
    """One timed generation of prompt `rec` (the i-th; its seed is seed + i), with CUDA's peak memory if any.
    runtime: serve the target on it for this generation only (None: as the model is served)."""
    if runtime is not None:
        with serving(model, runtime):
            return run_one(model, tok, rec, i, method, max_new_tokens, temperature, top_p, seed, options)
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    res = generate(model, tok, rec["prompt"], method=method, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, seed=seed + i, **options)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return res, peak


def add_run(agg: dict, rec: dict, res, peak: int | None) -> None:
    """Add one generation to a method's round sums: tokens, time (decode phase apart), engine counters, per
    domain too, the tokens, the prompt's own rates (for the paired ratios) and the peak memory."""
    s = res.stats
    steps, acc, drafted = len(s.steps), sum(x.accepted for x in s.steps), sum(x.drafted for x in s.steps)
    agg["new_tokens"] += s.new_tokens
    agg["time_s"] += s.total_s
    if s.new_tokens > 1:
        agg["decode_tokens"] += s.new_tokens - 1
        agg["decode_s"] += s.total_s - s.prefill_s
    agg["steps"] += steps
    agg["accepted"] += acc
    agg["drafted"] += drafted
    agg["log"] += [(x.depth, x.accepted) for x in s.steps]  # (depth, accepted) per step
    agg["draft_s"] += sum(x.draft_s for x in s.steps)
    agg["verify_s"] += sum(x.verify_s for x in s.steps)
    d = agg["domains"].setdefault(rec.get("domain", "all"), dict.fromkeys(GROUP_SUMS, 0))
    for key, x in zip(GROUP_SUMS, (1, s.new_tokens, s.total_s, steps, acc, drafted), strict=True):
        d[key] += x
    agg["outputs"].append(res.token_ids)
    decoded = s.new_tokens > 1  # a decode phase to measure: the tokens after the first, and their time
    agg["prompts"].append({**paired.rates(s.new_tokens, s.total_s, s.prefill_s), "new_tokens": s.new_tokens,
                           "total_s": s.total_s, "decode_tokens": s.new_tokens - 1 if decoded else 0,
                           "decode_s": s.total_s - s.prefill_s if decoded else 0.0, "steps": steps, "accepted": acc,
                           "drafted": drafted, "distinct": len(set(res.token_ids)) / max(1, len(res.token_ids))})
    if peak is not None:  # CPU tensors have no allocator counter: study.memory's accounting stands in
        agg["peak_mem_bytes"] = max(peak, agg["peak_mem_bytes"] or 0)


def run_method(model, tok, prompts: list[dict], method: str, max_new_tokens: int, temperature: float,
               top_p: float, seed: int, options: dict, runtime: str | None = None) -> dict:
    """All prompts once, one method: the round sums of `add_run`."""
    agg = new_sums()
    for i, rec in enumerate(prompts):
        add_run(agg, rec, *run_one(model, tok, rec, i, method, max_new_tokens, temperature, top_p, seed, options,
                                   runtime))
    return agg


def step_log(model, tok, prompts: list[dict], method: str, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, **options) -> list[tuple[int, int]]:
    """(draft depth, accepted) of every decoding step of `method` over `prompts`, in order.

    The per-step log behind tau, alpha and position_acceptance. `bench` keeps only those aggregates in its JSON
    (a log per step would make every results file thousands of lines long), so this is how to get it.
    """
    return run_method(model, tok, prompts, method, max_new_tokens, temperature, top_p, seed, options)["log"]


def bench(model, tok, prompts: list[dict], methods: list[str], max_new_tokens: int = 64, repeats: int = 3,
          temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, options: dict | None = None,
          warmup: int = 1, logs: dict[str, list] | None = None, v: Mapping | None = None,
          calibration: dict | None = None, progress: Callable[[dict, int, Mapping], None] | None = None) -> dict:
    """Paired, interleaved, warmed-up benchmark of `methods` on `prompts`; returns the JSON 'methods' dict.

    Each round runs every prompt once per method, the methods back to back on the same prompt, in an order
    rotated by prompt and round, so each method's ratio to AR is taken a few seconds apart (measure.paired).
    v: the verify-cost table {n: v(n)} the predictions use; None = calibrate inside each round, before its
    generations, and predict with the rounds' steady table (cost.steady). `calibration`, if given, receives
    {"v", "rounds", "below_one", "context"}. `progress(summary, k, v)`, if given, receives the summary of the first
    round's first k prompts (and the v(n) table it predicts with) after each prompt of that round, so a run cut
    short keeps what it measured.
    """
    options = options or {}
    spec = {}  # label -> (method, its options, runtime)
    for m in methods:
        name, opts = options_for(options, m)
        check_method(name)
        spec[m] = (name, opts, split_runtime(m)[1])
    for m in methods:  # warm-up (also builds drafters' caches, loads draft models)
        for _ in range(warmup):
            run_method(model, tok, prompts[:1], *_args(spec[m], max_new_tokens, temperature, top_p, seed))
    ctx = cost.context_for(model, tok, prompts, max_new_tokens) if v is None else None
    rounds: dict[str, list[dict]] = {m: [] for m in methods}
    tables: list[dict] = []
    bar = tqdm(total=repeats * len(methods) * len(prompts), desc="bench")
    for r in range(repeats):
        if v is None:
            tables.append(cost.verify_cost(model, cost.NS, ctx, repeats=5))
        sums = {m: new_sums() for m in methods}
        for i, rec in enumerate(prompts):
            turn = (r + i) % len(methods)
            for m in methods[turn:] + methods[:turn]:
                bar.set_postfix(method=m, round=r)
                add_run(sums[m], rec, *run_one(model, tok, rec, i, *_args(spec[m], max_new_tokens, temperature,
                                                                           top_p, seed)))
                bar.update()
            if progress is not None and r == 0:
                part = v if v is not None else cost.steady(tables)[0]
                progress(summarise({m: [sums[m]] for m in methods}, i + 1, part,
                                   groups=[p.get("domain", "all") for p in prompts[: i + 1]]), i + 1, part)
        for m in methods:
            rounds[m].append(sums[m])
    bar.close()
    if v is None:
        v, below = cost.steady(tables)
        if calibration is not None:
            calibration.update(v=v, rounds=tables, below_one=below, context=ctx)
    if logs is not None:  # label -> (depth, accepted) per step of every timed round
        for m, rs in rounds.items():
            logs[m] = [x for r in rs for x in r["log"]]
    return summarise(rounds, len(prompts), v, groups=[p.get("domain", "all") for p in prompts])


def _args(spec: tuple[str, dict, str | None], max_new_tokens, temperature, top_p, seed) -> tuple:
    name, opts, runtime = spec
    return name, max_new_tokens, temperature, top_p, seed, opts, runtime


def decode_counts(model, tok, prompts: list[dict], method: str, max_new_tokens: int, options: dict) -> dict:
    """Greedy decoding of every prompt: tau, alpha, the first draft position's acceptance, decode-loop forwards."""
    log = step_log(model, tok, prompts, method, max_new_tokens, **options)
    steps = len(log)
    accepted = sum(a for _, a in log)
    first = position_acceptance(log)
    return {"tau": round((accepted + steps) / steps, 4) if steps else None,
            "alpha": None if (a := acceptance_rate(log)) is None else round(a, 4),
            "first_acceptance": round(first[0], 4) if first else None, "target_forwards": steps}
