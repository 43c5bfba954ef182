"""The benchmark harness: `python -m dvi_lite bench --model smollm2 --dtype bfloat16 --prompts FILE --methods ar,pld`.

Every method runs on the same prompts in one process, with a warm-up, then `repeats` timed rounds. Within a round
the methods run back to back on each prompt, in an order rotated by prompt and round, and each method's speedup is
its rate over AR's *on the same prompt in the same round*: paired, so the machine's drift (thermal, allocator, the
in-process slow-down noted in PLATFORM_NOTES) cancels. The headline is the decode-phase speedup (tokens after the
first / time after it), the median over prompts with a 90% bootstrap interval (study.paired); the end-to-end one
(prefill included) stands beside it.

Each round also calibrates the verify-cost model v(n) (study/cost.py) on this model, dtype and device, at about
the prompts' length, and the draft cost c is taken against that round's AR. The bench predicts each method's
speedup from them: tau / (v(nodes + 1) + K c). With --json it also measures the machine's memory bandwidth.

Speed is measured, never asserted in tests. The JSON shape is stable (other tools read it):
{"provenance": {..., "model", "fingerprint", "dtype"}, "settings": {...}, "verify_cost": {n: v(n)},
"machine": {"copy_GBps", "read_GBps", "weight_bytes", "weights_GBps_at_ar"},
"verify_cost_rounds": [...], "verify_cost_below_one": [n, ...],
"methods": {name: {"tokens_per_s" (end to end), "decode_tokens_per_s", "speedup_vs_ar" (decode phase, paired),
"speedup_interval": [lo, hi], "speedup_vs_ar_e2e", "speedup_interval_e2e", "speedup_per_prompt", "tau", "alpha",
"c", "predicted_speedup", "n_prompts", "new_tokens", "domains": {group: tokens/s}, "groups": {group: {...}}, ...}}}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm

from dvi_lite.cli import add_force, check_outputs, command_line, prog
from dvi_lite.core.checks import RENAMED, add_renamed_flags, reject_renamed
from dvi_lite.core.generate import generate
from dvi_lite.core.registry import METHODS
from dvi_lite.course_model.corpus import PROMPTS_DIR
from dvi_lite.models.loading import load_model
from dvi_lite.study import cost, paired, specbench
from dvi_lite.study.provenance import model_facts, provenance
from dvi_lite.study.summary import summarise


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


def check_method(name: str) -> None:
    if name not in METHODS:
        raise ValueError(f"--methods: unknown method {name!r}; registered: {', '.join(sorted(METHODS))}")


def leviathan_speedup(alpha: float, K: float, c: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): Leviathan et al.'s expected speedup, which prices verifying
    K + 1 tokens like one AR step (v = 1). The bench predicts with the measured v(n) instead (study.cost)."""
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


def run_one(model, tok, rec: dict, i: int, method: str, max_new_tokens: int, temperature: float, top_p: float,
            seed: int, options: dict):
    """One timed generation of prompt `rec` (the i-th; its seed is seed + i), with CUDA's peak memory if any."""
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
    agg["prompts"].append(paired.rates(s.new_tokens, s.total_s, s.prefill_s))
    if peak is not None:  # CPU tensors have no allocator counter: study.memory's accounting stands in
        agg["peak_mem_bytes"] = max(peak, agg["peak_mem_bytes"] or 0)


def run_method(model, tok, prompts: list[dict], method: str, max_new_tokens: int, temperature: float,
               top_p: float, seed: int, options: dict) -> dict:
    """All prompts once, one method: the round sums of `add_run`."""
    agg = new_sums()
    for i, rec in enumerate(prompts):
        add_run(agg, rec, *run_one(model, tok, rec, i, method, max_new_tokens, temperature, top_p, seed, options))
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
          calibration: dict | None = None) -> dict:
    """Paired, interleaved, warmed-up benchmark of `methods` on `prompts`; returns the JSON 'methods' dict.

    Each round runs every prompt once per method, the methods back to back on the same prompt, in an order
    rotated by prompt and round, so each method's ratio to AR is taken a few seconds apart (study.paired).
    v: the verify-cost table {n: v(n)} the predictions use; None = calibrate inside each round, before its
    generations, and predict with the rounds' steady table (cost.steady). `calibration`, if given, receives
    {"v", "rounds", "below_one", "context"}.
    """
    options = options or {}
    spec = {}  # label -> (method, options): options from `options[method]`, `options[label]`, then the label
    for m in methods:
        name, opts = parse_spec(m)
        check_method(name)
        spec[m] = (name, {**options.get(name, {}), **(options.get(m, {}) if m != name else {}), **opts})
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


def _args(spec: tuple[str, dict], max_new_tokens, temperature, top_p, seed) -> tuple:
    name, opts = spec
    return name, max_new_tokens, temperature, top_p, seed, opts


def format_table(results: dict) -> str:
    """The overall table (decode-phase speedup with its interval, end to end beside it), then (with more than one
    task group) each method's decode-phase speedup vs AR per group."""
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    iv = lambda r, key: "-" if None in (r.get(key) or [None]) else f"[{r[key][0]:.2f}, {r[key][1]:.2f}]"  # noqa: E731
    w = max([14] + [len(m) + 2 for m in results])
    lines = [f"{'method':<{w}}{'dec tok/s':>10}{'speedup':>9}{'90% interval':>15}{'e2e':>7}{'tau':>7}{'alpha':>7}"
             f"{'c':>7}{'pred':>7}{'meas/pred':>10}{'=AR':>6}", "-" * (w + 85)]
    for m, r in results.items():
        lines.append(f"{m:<{w}}{f(r.get('decode_tokens_per_s'), 1):>10}{f(r.get('speedup_vs_ar')):>9}"
                     f"{iv(r, 'speedup_interval'):>15}{f(r.get('speedup_vs_ar_e2e')):>7}{f(r['tau']):>7}"
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
                    "question_dev.jsonl.xz for a model with a chat template, else data/prompts/heldout.jsonl")
    ap.add_argument("--n-prompts", type=int, default=20, help="use N prompts, spread over the task groups")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: time Spec-Bench's second turn, asked after the model's own first answer (greedy AR, "
                    "untimed); a prompt with one turn is timed on it")
    ap.add_argument("--draft-model", default=None,
                    help="draft model folder for sps/hf_assisted (default: the model's committed draft)")
    ap.add_argument("--K", type=int, default=4, help="draft tokens per step for sps / hf_assisted")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="new tokens per prompt (>= 128 keeps the prefill a small share of a long prompt's time)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the memory bandwidth (a copy and a sum of 512 MiB; default: on with --json)")
    ap.add_argument("--json", default=None, help="write results JSON here (checked before any work)")
    add_force(ap)
    add_renamed_flags(ap, "k")  # --k: an error naming --K
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"), force=args.force)
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise ValueError("--methods: give at least one method")
        for m in methods:
            check_method(parse_spec(m)[0])
        for name in ("repeats", "max_new_tokens", "n_prompts", "K"):
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
        measure = args.machine if args.machine is not None else args.json is not None
        machine = cost.memory_bandwidth(device=next(model.parameters()).device) if measure else {}
        opts = {m: {"K": args.K, "draft_model": args.draft_model} for m in ("sps", "hf_assisted")}
        calib: dict = {}
        results = bench(model, tok, prompts, methods, args.max_new_tokens, args.repeats, args.temperature,
                        args.top_p, args.seed, opts, calibration=calib)
        v, ctx = calib["v"], calib["context"]
    except (ValueError, FileNotFoundError, TypeError) as e:
        ap.error(str(e))
    machine = {"copy_GBps": None, "read_GBps": None, **machine, "weight_bytes": cost.weight_bytes(model)}
    for m in ("ar", "hf"):  # one token = one forward = the weights read once
        if m in results:
            results[m]["weights_GBps_at_ar"] = machine["weight_bytes"] * results[m]["tokens_per_s"] / 1e9
    machine["weights_GBps_at_ar"] = results.get("ar", {}).get("weights_GBps_at_ar")
    print(format_table(results))
    print("v(n): " + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()) + f" (context {ctx}, median of "
          f"{len(calib['rounds'])} rounds)")
    if calib["below_one"]:
        print(f"note: v(n) came out below 1 at n = {calib['below_one']} (timing noise: a forward over more tokens "
              "does not cost less); predictions use the non-decreasing envelope")
    if args.json:
        cmd = command_line("bench", argv)
        settings = {**{k: x for k, x in vars(args).items() if k != "json"}, "prompts": str(path),
                    "n_prompts_used": len(prompts), "second_turn_prompts": sum(p.get("turn") == 2 for p in prompts),
                    "chat_template": chat, "verify_cost_context": ctx}
        body = {"provenance": provenance(cmd, args.device, timing=TIMING,
                                         **model_facts(args.model, model)),
                "settings": settings, "verify_cost": v, "verify_cost_rounds": calib["rounds"],
                "verify_cost_below_one": calib["below_one"], "machine": machine, "methods": results}
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
