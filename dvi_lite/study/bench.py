"""The bench command: `python -m dvi_lite bench --model smollm2 --dtype bfloat16 --prompts FILE --methods ar,pld`.

The timing harness is measure.timing.bench: every method runs on the same prompts in one process, with a warm-up,
then `repeats` timed rounds. Within a round
the methods run back to back on each prompt, in an order rotated by prompt and round, and each method's speedup is
its rate over AR's *on the same prompt in the same round*: paired, so the machine's drift (thermal, allocator, the
in-process slow-down noted in PLATFORM_NOTES) cancels. The headline is the decode-phase speedup (tokens after the
first / time after it), the median over prompts with a 90% bootstrap interval (measure.paired); the end-to-end one
(prefill included) stands beside it.

Each round also calibrates the verify-cost model v(n) (measure/cost.py) on this model, dtype and device, at about
the prompts' length, and the draft cost c is taken against that round's AR. The bench predicts each method's
speedup from them: tau / (v(nodes + 1) + K c). With --json it also measures the machine's memory bandwidth.

With --json, the first round's results so far are written after each of its prompts, marked
settings.partial = {"prompts_done", "of"}, and the finished run replaces them: a run cut short keeps what it measured.

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
import sys
from pathlib import Path

from dvi_lite.commands import add_force, check_outputs, command_line, prog
from dvi_lite.core.checks import add_renamed_flags
from dvi_lite.core.generate import generate, has_chat_template
from dvi_lite.core.lean import RUNTIMES, serving, use_runtime
from dvi_lite.core.registry import METHODS
from dvi_lite.measure import cost
from dvi_lite.measure.provenance import provenance, results_json
from dvi_lite.measure.timing import TIMING, bench, check_method, parse_spec, split_runtime
from dvi_lite.models import specbench
from dvi_lite.models.artifacts import model_facts
from dvi_lite.models.corpus import HELDOUT_PROMPTS
from dvi_lite.models.loading import load_model
from dvi_lite.paths import atomic_write_text


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
                    "question_dev.jsonl.xz for a model with a chat template, else data/prompts/heldout.jsonl.xz")
    ap.add_argument("--n-prompts", type=int, default=20, help="use N prompts, spread over the task groups")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: time Spec-Bench's second turn, asked after the model's own first answer (greedy AR, "
                    "untimed); a prompt with one turn is timed on it")
    ap.add_argument("--draft-model", default=None,
                    help="draft model folder for sps/hf_assisted (default: the model's committed draft)")
    ap.add_argument("--K", type=int, default=None,
                    help="draft tokens per step for sps / hf_assisted (default: the sized K in the model's "
                    "defaults.json, else 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="new tokens per prompt (>= 128 keeps the prefill a small share of a long prompt's time)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--runtime", choices=RUNTIMES, default="hf",
                    help="the target's forward: hf (its own modules, the reference), lean (our packed forward) or "
                         "int8 / int4 (lean with quantized weights); a label may override it: ar@lean")
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
            check_method(parse_spec(split_runtime(m)[0])[0])
        for name in ("repeats", "max_new_tokens", "n_prompts", "K"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        records = specbench.read_prompts(args.prompts) if args.prompts else None  # a bad file fails before loading
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        use_runtime(model, args.runtime)  # an unsupported checkpoint: a ValueError naming what is supported
        chat = has_chat_template(tok)
        path = args.prompts or (specbench.SPEC_BENCH_DEV if chat else HELDOUT_PROMPTS)
        records = records or specbench.read_prompts(path)
        if Path(path).resolve() == specbench.SPEC_BENCH_DEV.resolve() and args.n_prompts > specbench.EVAL_QUESTIONS:
            raise ValueError(f"--n-prompts must be <= {specbench.EVAL_QUESTIONS} on Spec-Bench dev: the other "
                             "questions are what drafts are trained on (specbench.training_questions)")
        prompts = prepare(model, tok, specbench.spread(records, args.n_prompts), args.turns, args.max_new_tokens)
        measure = args.machine if args.machine is not None else args.json is not None
        machine = cost.memory_bandwidth(device=next(model.parameters()).device) if measure else {}
        opts = {m: {"draft_model": args.draft_model, **({} if args.K is None else {"K": args.K})}
                for m in ("sps", "hf_assisted")}
        calib: dict = {}
        cmd = command_line("bench", argv)
        settings = {**{k: x for k, x in vars(args).items() if k != "json"}, "prompts": str(path),
                    "chat_template": chat}

        def partial(summary: dict, done: int, v: dict) -> None:  # the first round so far: a cut run keeps it
            body = {"provenance": provenance(cmd, args.device, timing=TIMING, **model_facts(args.model, model)),
                    "settings": {**settings, "partial": {"prompts_done": done, "of": len(prompts)}},
                    "verify_cost": v, "methods": summary}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(args.json), results_json(body))

        results = bench(model, tok, prompts, methods, args.max_new_tokens, args.repeats, args.temperature,
                        args.top_p, args.seed, opts, calibration=calib, progress=partial if args.json else None)
        v, ctx = calib["v"], calib["context"]
    except (ValueError, FileNotFoundError, TypeError) as e:
        ap.error(str(e))
    machine = {"copy_GBps": None, "read_GBps": None, **machine, "weight_bytes": cost.weight_bytes(model)}
    streaming(model, results, args.runtime, machine.get("read_GBps"))
    machine["weights_GBps_at_ar"] = results.get("ar", {}).get("weights_GBps_at_ar")
    print(format_table(results))
    print("v(n): " + ", ".join(f"{n}: {x:.2f}" for n, x in v.items()) + f" (context {ctx}, median of "
          f"{len(calib['rounds'])} rounds)")
    if calib["below_one"]:
        print(f"note: v(n) came out below 1 at n = {calib['below_one']} (timing noise: a forward over more tokens "
              "does not cost less); predictions use the non-decreasing envelope")
    if args.json:
        settings = {**settings, "n_prompts_used": len(prompts),
                    "second_turn_prompts": sum(p.get("turn") == 2 for p in prompts), "verify_cost_context": ctx}
        body = {"provenance": provenance(cmd, args.device, timing=TIMING,
                                         **model_facts(args.model, model)),
                "settings": settings, "verify_cost": v, "verify_cost_rounds": calib["rounds"],
                "verify_cost_below_one": calib["below_one"], "machine": machine, "methods": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), results_json(body))
        print(f"wrote {args.json}")
    return 0


def streaming(model, results: dict, runtime: str, read_GBps: float | None) -> None:
    """For AR (on each runtime a label names) and HF generate: the weight bytes one token reads, the bandwidth
    that reaches at the measured rate, and the share of a decode step that streaming them takes at the machine's
    read bandwidth (the rest is everything else: per-op overhead, attention, norms)."""
    for m, r in results.items():
        base, rt = split_runtime(m)
        if base not in ("ar", "hf"):
            continue
        with serving(model, "hf" if base == "hf" else rt or runtime):
            wb = cost.weight_bytes(model)  # one token = one forward = the weights read once
        r.update(weight_bytes=wb, weights_GBps_at_ar=wb * r["tokens_per_s"] / 1e9,
                 streaming_share=wb / (read_GBps * 1e9) * r["decode_tokens_per_s"]
                 if read_GBps and r.get("decode_tokens_per_s") else None)


def spread(prompts: list[dict], n: int) -> list[dict]:
    """n prompts spread over domains (task groups), so a small n still covers each: specbench.spread on
    records that may carry only a "domain" (as models.corpus.load_prompts gives them)."""
    if n < 1:
        return []
    keyed = [{**p, "group": p.get("group", p.get("domain", "all")),
              "category": p.get("category", p.get("group", p.get("domain", "all")))} for p in prompts]
    return specbench.spread(keyed, n)


if __name__ == "__main__":
    sys.exit(main())
