"""The benchmark harness: `python -m dvi_lite bench --model smollm2 --dtype bfloat16 --prompts FILE --methods ar,pld`.

Every method runs on the same prompts in one process, with a warm-up, then `repeats` timed rounds.
Rounds are *interleaved* (round r runs every method, in an order rotated by r) so that slow drift
of the machine (thermal, allocator, the in-process slow-down noted in PLATFORM_NOTES) hits every
method alike; per-round numbers are kept in the JSON so drift is visible. We report the median.

The same run calibrates the verify-cost model v(n) (study/cost.py) on this model, dtype and device, at
about the prompts' length, and predicts each method's speedup from it: tau / (v(nodes + 1) + K c).
With --json it also measures the machine's memory bandwidth, the roof for a memory-bound decoder.

Speed is measured, never asserted in tests. The JSON shape is stable (other tools read it):
{"provenance": {..., "model", "fingerprint", "dtype"}, "settings": {...}, "verify_cost": {n: v(n)},
"machine": {"copy_GBps", "read_GBps", "weight_bytes", "weights_GBps_at_ar"},
"methods": {name: {"tokens_per_s", "speedup_vs_ar", "tau", "alpha", "c", "predicted_speedup",
"n_prompts", "new_tokens", "domains": {group: tokens/s}, "groups": {group: {...}}, ...}}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm

from dvi_lite.cli import command_line, prog
from dvi_lite.core.engine import acceptance_rate, position_acceptance
from dvi_lite.core.generate import generate
from dvi_lite.core.registry import METHODS
from dvi_lite.course_model.corpus import PROMPTS_DIR
from dvi_lite.models.loading import load_model
from dvi_lite.study import cost, specbench
from dvi_lite.study.provenance import model_facts, provenance


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


def leviathan_speedup(alpha: float, k: float, c: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): Leviathan et al.'s expected speedup, which prices verifying
    K + 1 tokens like one AR step (v = 1). The bench predicts with the measured v(n) instead (study.cost)."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


GROUP_SUMS = ("n", "new_tokens", "time_s", "steps", "accepted", "drafted")  # per domain / task group and round


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
        d = agg["domains"].setdefault(rec.get("domain", "all"), dict.fromkeys(GROUP_SUMS, 0))
        for key, x in zip(GROUP_SUMS, (1, s.new_tokens, s.total_s, len(s.steps), sum(x.accepted for x in s.steps),
                                       sum(x.drafted for x in s.steps)), strict=True):
            d[key] += x
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


def _tau(agg: dict) -> float | None:
    """Tokens per target forward: (accepted + one bonus/correction token per step) / steps; None without drafts."""
    return (agg["accepted"] + agg["steps"]) / agg["steps"] if agg["steps"] and agg["drafted"] else None


def agreement(outputs: list[list[int]], ar_outputs: list[list[int]]) -> dict:
    """How far a method's tokens agree with AR's, prompt by prompt: the fraction of prompts with the very same
    tokens, and the mean length of the common prefix as a fraction of AR's output (1.0 = all identical)."""
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    pairs = list(zip(outputs, ar_outputs, strict=True))
    return {"same_tokens_as_ar": sum(a == b for a, b in pairs) / len(pairs),
            "common_prefix_with_ar": statistics.mean(prefix(a, b) / max(1, len(b)) for a, b in pairs)}


def summarise(rounds: dict[str, list[dict]], n_prompts: int, v: Mapping | None = None) -> dict:
    """Median tokens/s over rounds, speedup vs our AR, tau, alpha, draft cost ratio c, per group too, and the
    speedup that the verify-cost table `v` ({n: v(n)}) predicts from tau and c."""
    out: dict[str, dict] = {}
    for m, rs in rounds.items():
        last = rs[-1]
        tps = [r["new_tokens"] / r["time_s"] for r in rs]
        steps = last["steps"]
        alpha = acceptance_rate(last["log"])  # per tested draft token, as in Stats.alpha
        gtps = {d: statistics.median(r["domains"][d]["new_tokens"] / r["domains"][d]["time_s"] for r in rs)
                for d in last["domains"]}
        out[m] = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_rounds": tps,
            "tau": _tau(last),
            "alpha": alpha,
            "n_prompts": n_prompts,
            "new_tokens": last["new_tokens"],
            "distinct_token_fraction": statistics.mean(len(set(o)) / max(1, len(o)) for o in last["outputs"]),
            "domains": gtps,  # {group: tokens/s}, the old key; "groups" has the rest
            "groups": {d: {"tokens_per_s": gtps[d], "tau": _tau(g), "n_prompts": g["n"], "new_tokens": g["new_tokens"]}
                       for d, g in last["domains"].items()},
            "position_acceptance": position_acceptance(last["log"]),
            "draft_s_per_step": last["draft_s"] / steps if steps else None,
            "verify_s_per_step": last["verify_s"] / steps if steps else None,
            "peak_mem_bytes": max((r["peak_mem_bytes"] for r in rs if r.get("peak_mem_bytes") is not None),
                                  default=None),
        }
    ar = out.get("ar")
    for m, r in out.items():
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        if ar:  # greedy: lossless means AR's tokens; in bf16, batched verification may flip near-ties
            r.update(agreement(rounds[m][-1]["outputs"], rounds["ar"][-1]["outputs"]))
        for d, g in r["groups"].items():
            ref = ar["groups"].get(d) if ar else None
            g["speedup_vs_ar"] = g["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        if ar and r["tau"] is not None and r["draft_s_per_step"] is not None:
            # c = draft time per draft step / target time per token (AR's time per token); K = the draft's
            # depth per step (= drafted tokens for a chain; a tree's extra leaves cost no draft step, but
            # the verify forward sees every node: v(nodes + 1))
            last = rounds[m][-1]
            k = sum(d for d, _ in last["log"]) / max(1, len(last["log"]))
            c = r["draft_s_per_step"] / max(k, 1e-9) / (1.0 / ar["tokens_per_s"])
            nodes = last["drafted"] / max(1, last["steps"])
            r.update(c=c, draft_depth_per_step=k, drafted_per_step=nodes)
            if v:
                r["verify_cost_per_step"] = cost.v_of(v, nodes + 1)  # v(nodes + 1), in 1-token forwards
                r["predicted_speedup"] = cost.predicted_speedup(r["tau"], k, c, v, nodes=nodes)
                r["measured_over_predicted"] = r["speedup_vs_ar"] / r["predicted_speedup"]
    return out


def bench(model, tok, prompts: list[dict], methods: list[str], max_new_tokens: int = 64, repeats: int = 3,
          temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, options: dict | None = None,
          warmup: int = 1, logs: dict[str, list] | None = None, v: Mapping | None = None) -> dict:
    """Interleaved, warmed-up benchmark of `methods` on `prompts`; returns the JSON 'methods' dict.

    v: the verify-cost table {n: v(n)} the predictions use; None = calibrate it here first (`cost.calibrate`).
    """
    options = options or {}
    if v is None:
        v = cost.calibrate(model, tok, prompts, max_new_tokens)[0]
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
    return summarise(rounds, len(prompts), v)


def _args(spec: tuple[str, dict], max_new_tokens, temperature, top_p, seed) -> tuple:
    name, opts = spec
    return name, max_new_tokens, temperature, top_p, seed, opts


def format_table(results: dict) -> str:
    """The overall table, then (with more than one task group) each method's speedup vs AR per group."""
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    w = max([14] + [len(m) + 2 for m in results])
    lines = [f"{'method':<{w}}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'alpha':>7}{'c':>7}{'pred':>7}{'meas/pred':>10}"
             f"{'=AR':>6}", "-" * (w + 62)]
    for m, r in results.items():
        lines.append(f"{m:<{w}}{f(r['tokens_per_s'], 1):>9}{f(r['speedup_vs_ar']):>9}{f(r['tau']):>7}"
                     f"{f(r['alpha']):>7}{f(r.get('c')):>7}{f(r.get('predicted_speedup')):>7}"
                     f"{f(r.get('measured_over_predicted')):>10}{f(r.get('same_tokens_as_ar')):>6}")
    groups = list(next(iter(results.values()), {}).get("groups", {}))
    if len(groups) > 1:
        gw = max(9, *(len(g) + 2 for g in groups))
        lines += ["", f"{'speedup':<{w}}" + "".join(f"{g:>{gw}}" for g in groups), "-" * (w + gw * len(groups))]
        for m, r in results.items():
            lines.append(f"{m:<{w}}" + "".join(f"{f(r['groups'].get(g, {}).get('speedup_vs_ar')):>{gw}}"
                                               for g in groups))
    return "\n".join(lines)


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def prepare(model, tok, records: list[dict], turns: int, max_new_tokens: int) -> list[dict]:
    """The prompts to time. A Spec-Bench record's first turn is a user message through the chat template, or
    the turn as a raw string when the tokenizer has none. With turns=2, a record with a second turn is timed on
    it, asked after the model's own first answer (greedy AR, once, untimed), as Spec-Bench does; a record with
    one turn is timed on that turn. Our records ("prompt") stay raw continuations."""
    chat, out = has_chat_template(tok), []
    for r in records:
        if not r.get("turns"):
            out.append(r)
            continue
        first = r["prompt"] if chat else r["turns"][0]
        if turns == 2 and len(r["turns"]) > 1:
            ids = generate(model, tok, first, "ar", max_new_tokens).token_ids
            answer = tok.decode(ids, skip_special_tokens=True).strip()
            prompt = specbench.second_turn(r, answer) if chat else f"{r['turns'][0]}\n{answer}\n{r['turns'][1]}"
            out.append({**r, "prompt": prompt, "turn": 2})
        else:
            out.append({**r, "prompt": first, "turn": 1})
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("bench"), description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ar,hf", help="comma-separated, from: " + ", ".join(sorted(METHODS)) +
                    "; options after colons, e.g. kangaroo:threshold=0.4:branch=2")
    ap.add_argument("--model", default=None,
                    help="a model name (course, smollm2) or a local HF Llama-family checkpoint folder (default course)")
    ap.add_argument("--prompts", default=None,
                    help="JSONL: ours ('prompt': a raw continuation) or Spec-Bench's ('turns': the first turn is a "
                    "user message through the chat template; with a tokenizer that has no chat template, e.g. the "
                    "course model's, the turn is used as a raw string prompt). Default: data/spec_bench/"
                    "question_dev.jsonl for a model with a chat template, else data/prompts/heldout.jsonl")
    ap.add_argument("--n-prompts", type=int, default=20, help="use N prompts, spread over the task groups")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: time Spec-Bench's second turn, asked after the model's own first answer (greedy AR, "
                    "untimed); a prompt with one turn is timed on it")
    ap.add_argument("--draft-model", default=None,
                    help="draft model folder for sps/hf_assisted (default: the model's committed draft)")
    ap.add_argument("--k", type=int, default=4, help="draft length for sps / hf_assisted")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the memory bandwidth (a copy and a sum of 512 MiB; default: on with --json)")
    ap.add_argument("--json", default=None, help="write results JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
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
        records = specbench.read_prompts(args.prompts) if args.prompts else None  # a bad file fails before loading
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        chat = has_chat_template(tok)
        path = args.prompts or (specbench.SPEC_BENCH_DEV if chat else PROMPTS_DIR / "heldout.jsonl")
        records = records or specbench.read_prompts(path)
        if Path(path).resolve() == specbench.SPEC_BENCH_DEV.resolve() and args.n_prompts > specbench.EVAL_QUESTIONS:
            raise ValueError(f"--n-prompts must be <= {specbench.EVAL_QUESTIONS} on Spec-Bench dev: the other "
                             "questions are what drafts are trained on (specbench.training_questions)")
        prompts = prepare(model, tok, specbench.spread(records, args.n_prompts), args.turns, args.max_new_tokens)
        v, ctx = cost.calibrate(model, tok, prompts, args.max_new_tokens)
        measure = args.machine if args.machine is not None else args.json is not None
        machine = cost.memory_bandwidth(device=next(model.parameters()).device) if measure else {}
        opts = {m: {"k": args.k, "draft_model": args.draft_model} for m in ("sps", "hf_assisted")}
        results = bench(model, tok, prompts, methods, args.max_new_tokens, args.repeats, args.temperature,
                        args.top_p, args.seed, opts, v=v)
    except (ValueError, FileNotFoundError, TypeError) as e:
        ap.error(str(e))
    machine = {"copy_GBps": None, "read_GBps": None, **machine, "weight_bytes": cost.weight_bytes(model)}
    for m in ("ar", "hf"):  # one token = one forward = the weights read once
        if m in results:
            results[m]["weights_GBps_at_ar"] = machine["weight_bytes"] * results[m]["tokens_per_s"] / 1e9
    machine["weights_GBps_at_ar"] = results.get("ar", {}).get("weights_GBps_at_ar")
    print(format_table(results))
    print("v(n): " + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()) + f" (context {ctx})")
    if args.json:
        cmd = command_line("bench", argv)
        settings = {**{k: x for k, x in vars(args).items() if k != "json"}, "prompts": str(path),
                    "n_prompts_used": len(prompts), "second_turn_prompts": sum(p.get("turn") == 2 for p in prompts),
                    "chat_template": chat, "verify_cost_context": ctx}
        body = {"provenance": provenance(cmd, args.device, timing="interleaved rounds in one process, median",
                                         **model_facts(args.model, model)),
                "settings": settings, "verify_cost": v, "machine": machine, "methods": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def spread(prompts: list[dict], n: int) -> list[dict]:
    """n prompts spread over domains (task groups), so a small n still covers each: specbench.spread on
    records that may carry only a "domain" (as course_model.corpus.load_prompts gives them)."""
    if n < 1:
        return []
    keyed = [{**p, "group": p.get("group", p.get("domain", "all")),
              "category": p.get("category", p.get("group", p.get("domain", "all")))} for p in prompts]
    return specbench.spread(keyed, n)


if __name__ == "__main__":
    sys.exit(main())
