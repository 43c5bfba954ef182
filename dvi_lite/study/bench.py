"""The benchmark harness: `python -m dvi_lite bench --methods ar,hf,hf_assisted,sps`.

Every method runs on the same prompts in one process, with a warm-up, then `repeats` timed rounds.
Rounds are *interleaved* (round r runs every method, in an order rotated by r) so that slow drift
of the machine (thermal, allocator, the in-process slow-down noted in PLATFORM_NOTES) hits every
method alike; per-round numbers are kept in the JSON so drift is visible. We report the median.

Speed is measured, never asserted in tests. The JSON shape is stable (other tools read it):
{"provenance": {...}, "methods": {name: {"tokens_per_s", "speedup_vs_ar", "tau", "alpha",
"n_prompts", "new_tokens", ...}}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.cli import command_line, prog
from dvi_lite.core.engine import acceptance_rate, position_acceptance
from dvi_lite.core.generate import generate
from dvi_lite.core.registry import METHODS
from dvi_lite.course_model.corpus import load_prompts
from dvi_lite.models.loading import load_model
from dvi_lite.study.provenance import provenance


def parse_spec(spec: str) -> tuple[str, dict]:
    """'kangaroo:branch=2:threshold=0.4' -> ('kangaroo', {'branch': 2, 'threshold': 0.4}).

    A method label may carry options after colons, so one run can compare variants of a method
    (the label is the row name). Values are read as int, float, none/true/false, else string.
    `label=...` only names a row ('draft_verify:label=uniform') and is not passed to the method.
    """
    name, *parts = spec.split(":")
    opts = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise ValueError(f"--methods: option {part!r} in {spec!r} must look like key=value")
        opts[key] = _value(val)
    opts.pop("label", None)
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


def check_method(name: str) -> None:
    if name not in METHODS:
        raise ValueError(f"--methods: unknown method {name!r}; registered: {', '.join(sorted(METHODS))}")


def predicted_speedup(alpha: float, k: float, c: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): Leviathan et al.'s expected speedup."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def run_method(model, tok, prompts: list[dict], method: str, max_new_tokens: int, temperature: float,
               top_p: float, seed: int, options: dict) -> dict:
    """All prompts once; sums of tokens, time and engine counters (per domain too), and on CUDA the peak
    memory the allocator held while this method ran (weights, draft models, KV cache, activations)."""
    agg = {"new_tokens": 0, "time_s": 0.0, "steps": 0, "accepted": 0, "drafted": 0, "log": [],
           "draft_s": 0.0, "verify_s": 0.0, "domains": {}, "outputs": [], "peak_mem_bytes": None}
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i, rec in enumerate(prompts):
        res = generate(model, tok, rec["prompt"], method=method, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, seed=seed + i, **options)
        s = res.stats
        agg["new_tokens"] += s.new_tokens
        agg["time_s"] += s.total_s
        agg["steps"] += len(s.steps)
        agg["accepted"] += sum(x.accepted for x in s.steps)
        agg["drafted"] += sum(x.drafted for x in s.steps)
        agg["log"] += [(x.depth, x.accepted) for x in s.steps]  # (depth, accepted) per step
        agg["draft_s"] += sum(x.draft_s for x in s.steps)
        agg["verify_s"] += sum(x.verify_s for x in s.steps)
        d = agg["domains"].setdefault(rec.get("domain", "all"), {"new_tokens": 0, "time_s": 0.0})
        d["new_tokens"] += s.new_tokens
        d["time_s"] += s.total_s
        agg["outputs"].append(res.token_ids)
    if dev.type == "cuda":  # CPU tensors have no allocator counter: study.memory's accounting stands in
        agg["peak_mem_bytes"] = torch.cuda.max_memory_allocated(dev)
    return agg


def step_log(model, tok, prompts: list[dict], method: str, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, **options) -> list[tuple[int, int]]:
    """(draft depth, accepted) of every decoding step of `method` over `prompts`, in order.

    The per-step log behind tau, alpha and position_acceptance. `bench` keeps only those aggregates in its JSON
    (a log per step would make every results file thousands of lines long), so this is how to get it.
    """
    return run_method(model, tok, prompts, method, max_new_tokens, temperature, top_p, seed, options)["log"]


def summarise(rounds: dict[str, list[dict]], n_prompts: int) -> dict:
    """Median tokens/s over rounds, speedup vs our AR, tau, alpha, draft cost ratio c, formula check."""
    out: dict[str, dict] = {}
    for m, rs in rounds.items():
        last = rs[-1]
        tps = [r["new_tokens"] / r["time_s"] for r in rs]
        steps = last["steps"]
        tau = (last["accepted"] + steps) / steps if steps and last["drafted"] else None
        alpha = acceptance_rate(last["log"])  # per tested draft token, as in Stats.alpha
        out[m] = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_rounds": tps,
            "tau": tau,
            "alpha": alpha,
            "n_prompts": n_prompts,
            "new_tokens": last["new_tokens"],
            "distinct_token_fraction": statistics.mean(len(set(o)) / max(1, len(o)) for o in last["outputs"]),
            "domains": {d: statistics.median(r["domains"][d]["new_tokens"] / r["domains"][d]["time_s"]
                                             for r in rs)
                        for d in last["domains"]},
            "position_acceptance": position_acceptance(last["log"]),
            "draft_s_per_step": last["draft_s"] / steps if steps else None,
            "verify_s_per_step": last["verify_s"] / steps if steps else None,
            "peak_mem_bytes": max((r["peak_mem_bytes"] for r in rs if r.get("peak_mem_bytes") is not None),
                                  default=None),
        }
    ar = out.get("ar")
    for m, r in out.items():
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        if ar and r["alpha"] is not None and r["draft_s_per_step"] is not None:
            # c = draft time per draft step / target time per token (AR's time per token); K = the draft's
            # depth per step (= drafted tokens for a chain; a tree's extra leaves cost no draft step)
            log = rounds[m][-1]["log"]
            k = sum(d for d, _ in log) / max(1, len(log))
            t_target = 1.0 / ar["tokens_per_s"]
            c = r["draft_s_per_step"] / max(k, 1e-9) / t_target
            r["c"] = c
            r["draft_depth_per_step"] = k
            r["drafted_per_step"] = rounds[m][-1]["drafted"] / max(1, rounds[m][-1]["steps"])
            r["predicted_speedup"] = predicted_speedup(r["alpha"], k, c)
            r["measured_over_predicted"] = r["speedup_vs_ar"] / r["predicted_speedup"]
    return out


def bench(model, tok, prompts: list[dict], methods: list[str], max_new_tokens: int = 64, repeats: int = 3,
          temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, options: dict | None = None,
          warmup: int = 1, logs: dict[str, list] | None = None) -> dict:
    """Interleaved, warmed-up benchmark of `methods` on `prompts`; returns the JSON 'methods' dict."""
    options = options or {}
    spec = {}  # label -> (method, options): options from `options[method]`, `options[label]`, then the label
    for m in methods:
        name, opts = parse_spec(m)
        check_method(name)
        spec[m] = (name, {**options.get(name, {}), **(options.get(m, {}) if m != name else {}), **opts})
    for m in methods:  # warm-up (also builds drafters' caches, loads draft models)
        for _ in range(warmup):
            run_method(model, tok, prompts[:1], *_args(spec[m], max_new_tokens, temperature, top_p, seed))
    rounds: dict[str, list[dict]] = {m: [] for m in methods}
    bar = tqdm(total=repeats * len(methods), desc="bench")
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            bar.set_postfix(method=m, round=r)
            args = _args(spec[m], max_new_tokens, temperature, top_p, seed)
            rounds[m].append(run_method(model, tok, prompts, *args))
            bar.update()
    bar.close()
    if logs is not None:  # label -> (depth, accepted) per step of every timed round
        for m, rs in rounds.items():
            logs[m] = [x for r in rs for x in r["log"]]
    return summarise(rounds, len(prompts))


def _args(spec: tuple[str, dict], max_new_tokens, temperature, top_p, seed) -> tuple:
    name, opts = spec
    return name, max_new_tokens, temperature, top_p, seed, opts


def format_table(results: dict) -> str:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    w = max([14] + [len(m) + 2 for m in results])
    lines = [f"{'method':<{w}}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'alpha':>7}{'c':>7}{'meas/pred':>10}",
             "-" * (w + 49)]
    for m, r in results.items():
        lines.append(f"{m:<{w}}{f(r['tokens_per_s'], 1):>9}{f(r['speedup_vs_ar']):>9}{f(r['tau']):>7}"
                     f"{f(r['alpha']):>7}{f(r.get('c')):>7}{f(r.get('measured_over_predicted')):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("bench"), description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ar,hf", help="comma-separated, from: " + ", ".join(sorted(METHODS)) +
                    "; options after colons, e.g. kangaroo:threshold=0.4:branch=2")
    ap.add_argument("--prompts", default=None,
                    help="JSONL with a 'prompt' field (default data/prompts/heldout.jsonl)")
    ap.add_argument("--n-prompts", type=int, default=20, help="use the first N prompts (spread over domains)")
    ap.add_argument("--model", default=None, help="local HF Llama-family checkpoint folder (default: course model)")
    ap.add_argument("--draft-model", default=None,
                    help="draft model folder for sps/hf_assisted (default: course draft)")
    ap.add_argument("--k", type=int, default=4, help="draft length for sps / hf_assisted")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write results JSON here")
    args = ap.parse_args(argv)
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise ValueError("--methods: give at least one method")
        for m in methods:
            check_method(parse_spec(m)[0])
        for name in ("repeats", "max_new_tokens", "n_prompts", "k"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        prompts = spread(load_prompts(args.prompts), args.n_prompts)
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        opts = {m: {"k": args.k, "draft_model": args.draft_model} for m in ("sps", "hf_assisted")}
        results = bench(model, tok, prompts, methods, args.max_new_tokens, args.repeats, args.temperature,
                        args.top_p, args.seed, opts)
    except (ValueError, FileNotFoundError, TypeError) as e:
        ap.error(str(e))
    print(format_table(results))
    if args.json:
        cmd = command_line("bench", argv)
        body = {"provenance": provenance(cmd, args.device, timing="interleaved rounds in one process, median"),
                "settings": {k: v for k, v in vars(args).items() if k != "json"}, "methods": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def spread(prompts: list[dict], n: int) -> list[dict]:
    """n prompts alternating between domains, so a small n still covers code and prose."""
    by: dict[str, list[dict]] = {}
    for p in prompts:
        by.setdefault(p.get("domain", "all"), []).append(p)
    out, i = [], 0
    while len(out) < min(n, len(prompts)):
        for d in by.values():
            if i < len(d) and len(out) < n:
                out.append(d[i])
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
