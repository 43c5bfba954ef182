"""Where a token's time goes on each runtime, and what int8 and int4 weights cost in accuracy.

`python -m dvi_lite runtimes --model smollm2 --dtype bfloat16 --json results/40_runtimes_smollm2_bf16.json`

Three measurements, one per question a learner asks before trusting a speedup measured on one runtime:
1. **How fast is each runtime's AR?** AR on hf, lean, int8 and int4 (and HF generate), paired per prompt and interleaved
   (measure.timing.bench with `ar@lean`-style labels): each runtime's decode rate over the HF runtime's AR, with
   an interval, the weight bytes one token reads, and the share of a step that streaming them takes.
2. **What does a forward over n tokens cost?** t(n) on each runtime at the prompts' mean context, fitted as
   t(n) = a + b n: a is what every forward pays whatever n (weights streamed, per-op overhead), b the price of
   one more token; v(n) = t(n) / t(1) is what the cost model uses.
3. **What does quantization change?** On teacher-forced text (each prompt and the lean runtime's greedy answer to
   it): the largest and the mean logit error of int8 and int4 against the same forward with the checkpoint's
   weights, and how often they pick the same greedy token.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from dvi_lite.commands import add_force, check_outputs, command_line, prog
from dvi_lite.core.generate import generate, has_chat_template, prompt_ids
from dvi_lite.core.lean import RUNTIMES, serving, use_runtime
from dvi_lite.core.runner import Runner
from dvi_lite.measure import cost
from dvi_lite.measure.provenance import provenance, results_json
from dvi_lite.measure.timing import TIMING, bench
from dvi_lite.models import specbench
from dvi_lite.models.artifacts import model_facts
from dvi_lite.models.loading import load_model
from dvi_lite.paths import atomic_write_text
from dvi_lite.study.bench import prepare, streaming

NS = (1, 2, 3, 5, 9, 17, 33)


def line_fit(t: dict[int, float]) -> dict[str, float]:
    """t(n) = a + b n by least squares over the measured n: {"a_s", "b_s", "b_over_a"}."""
    n = np.array(sorted(t), dtype=float)
    y = np.array([t[int(k)] for k in n])
    b, a = np.polyfit(n, y, 1)
    return {"a_s": float(a), "b_s": float(b), "b_over_a": float(b / a)}


def forward_costs(model, context: int, repeats: int) -> dict[str, dict]:
    """{runtime: {"t_s": {n: seconds}, "v": {n: v(n)}, "fit": line_fit}} at `context` cached positions."""
    out = {}
    for rt in RUNTIMES:
        with serving(model, rt):
            t = cost.forward_times(model, NS, context, repeats)
        out[rt] = {"t_s": t, "v": {n: t[n] / t[1] for n in NS}, "fit": line_fit(t)}
    return out


@torch.no_grad()
def quant_error(model, tok, prompts: list[dict], max_new_tokens: int) -> dict[str, dict]:
    """{runtime: error} of int8 and int4 against lean (the checkpoint's weights), on each prompt + lean's greedy
    answer, teacher-forced: the largest and mean logit error and how often both pick the same greedy token."""
    quant = {rt: use_runtime(model, rt) for rt in ("int8", "int4")}
    lean = use_runtime(model, "lean")  # generate below decodes on lean: the text every runtime is scored on
    sums = {rt: {"max": 0.0, "mean": [], "same": 0} for rt in quant}
    n = 0
    for rec in prompts:
        ids = prompt_ids(tok, rec["prompt"])
        ids = ids + generate(model, tok, ids, method="ar", max_new_tokens=max_new_tokens).token_ids
        x = torch.tensor([ids], device=lean.device)
        a = lean.forward(x, None)[0][0].float()  # (T, V)
        n += a.shape[0]
        for rt, r in quant.items():
            b = r.forward(x, None)[0][0].float()
            d = (a - b).abs()
            sums[rt]["max"] = max(sums[rt]["max"], float(d.max()))
            sums[rt]["mean"].append(float(d.mean()))
            sums[rt]["same"] += int((a.argmax(-1) == b.argmax(-1)).sum())
    use_runtime(model, "hf")
    return {rt: {"positions": n, "greedy_agreement": v["same"] / n, "max_abs_logit_error": v["max"],
                 "mean_abs_logit_error": statistics.mean(v["mean"])} for rt, v in sums.items()}


@torch.inference_mode()
def kernel_rates(model, repeats: int = 200) -> list[dict]:
    """One decoding step's matrix-vector product (batch 1) per layer shape of `model` and weight format: microseconds
    and GB/s of weight bytes. Says whether a format's kernel streams its bytes as fast as packed bf16: int8 halves
    the bytes, but a kernel that dequantizes at a lower rate gives back part of the gain."""
    import time

    from dvi_lite.core.lean import Int4Weight, Int8Weight, PackedWeight, linear, nbytes

    r = use_runtime(model, "hf")
    a, m = r.layers[0].self_attn, r.layers[0].mlp
    shapes = {"qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
              "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]), "down": m.down_proj.weight,
              "lm_head": r.lm_head.weight}
    rows = []
    for name, w in shapes.items():
        w = w.detach()
        x = torch.randn(1, 1, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0)).to(w.device)
        formats = {"packed": PackedWeight.maybe(w), "int8": Int8Weight.quantize(w)}
        if w.shape[1] % 32 == 0:
            formats["int4"] = Int4Weight.quantize(w)
        for fmt, q in formats.items():
            for _ in range(20):
                linear(x, q)
            t0 = time.perf_counter()
            for _ in range(repeats):
                linear(x, q)
            dt = (time.perf_counter() - t0) / repeats
            rows.append({"matrix": name, "shape": list(w.shape), "format": fmt, "us": dt * 1e6,
                         "bytes": nbytes(q), "GBps": nbytes(q) / dt / 1e9})
    return rows


def grad_mode_times(model, context: int = 340, repeats: int = 40) -> dict[str, dict]:
    """{runtime: median ms of one decoding forward (1 token at `context` cached positions) under torch.no_grad and
    under torch.inference_mode}, the two interleaved. Why the decode loop runs in inference mode
    (core.engine.grad_free): the same products, less bookkeeping per op, and a forward here is hundreds of ops."""
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    out = {}
    for rt in RUNTIMES:
        with serving(model, rt) as r, torch.no_grad():
            vocab = r.lm_head.weight.shape[0]
            g = torch.Generator().manual_seed(0)
            cache = r.new_cache(context + 1)
            r.forward(torch.randint(0, vocab, (1, context), generator=g).to(r.device), cache)
            x = torch.randint(0, vocab, (1, 1), generator=g).to(r.device)  # (1, 1)

            def under(mode, r=r, cache=cache, x=x):
                with modes[mode]():
                    r.forward(x, cache)

            cases = {m: (lambda m=m: under(m)) for m in modes}
            times = cost.interleaved_times(cases, repeats, r.device, reset=lambda c=cache: c.crop(context), warmup=2)
        ms = {m: 1e3 * statistics.median(ts) for m, ts in times.items()}
        out[rt] = {**{f"{m}_ms": v for m, v in ms.items()}, "saved_ms": ms["no_grad"] - ms["inference_mode"],
                   "context": context, "repeats": repeats}
    return out


LABELS = ["ar", "ar@lean", "ar@int8", "ar@int4", "hf"]  # AR on each runtime, and HF generate


def measure(model, tok, prompts: list[dict], max_new_tokens: int, repeats: int, forward_repeats: int = 7,
            machine: dict | None = None) -> dict:
    """The three measurements on prepared prompts: {"machine", "ar", "forward", "quant_error", "context"}.

    ar: `LABELS` paired per prompt and interleaved, each with its weight bytes and streaming share; forward:
    t(n) per runtime at the prompts' mean context (`forward_costs`); quant_error: int8 and int4 against the
    checkpoint's weights. machine: a measured bandwidth to reuse (None: measured here)."""
    machine = machine or cost.memory_bandwidth(device=Runner.for_model(model).device)
    results = bench(model, tok, prompts, LABELS, max_new_tokens, repeats, v={1: 1.0})
    streaming(model, results, "hf", machine["read_GBps"])
    ctx = cost.context_for(model, tok, prompts, max_new_tokens)
    return {"machine": machine, "ar": results, "forward": forward_costs(model, ctx, forward_repeats),
            "quant_error": quant_error(model, tok, prompts, max_new_tokens), "context": ctx}


def report(res: dict) -> str:
    """The measurements as text: AR per runtime, the fitted t(n) and v(n) per runtime, the quantization error."""
    lines = []
    for m, r in res["ar"].items():
        share, ci = r.get("streaming_share"), r.get("speedup_interval")
        lines.append(f"{m:8s} {r['decode_tokens_per_s']:6.1f} tok/s decode   x HF-runtime AR "
                     f"{r.get('speedup_vs_ar') or 1:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
                     + f"   weights {r['weight_bytes'] / 1e6:.0f} MB"
                     + (f", streaming {share:.0%} of a step" if share else ""))
    for rt, f in res["forward"].items():
        lines.append(f"{rt:5s} t(n) = {f['fit']['a_s'] * 1e3:.1f} ms + {f['fit']['b_s'] * 1e3:.2f} ms × n;   v(n): "
                     + ", ".join(f"{n}: {v:.2f}" for n, v in f["v"].items()))
    for rt, e in res["quant_error"].items():
        lines.append(f"{rt} against the checkpoint's weights: the same greedy token at {e['greedy_agreement']:.1%} "
                     f"of {e['positions']} positions, logit error max {e['max_abs_logit_error']:.2f}, "
                     f"mean {e['mean_abs_logit_error']:.3f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("runtimes"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="course (default), smollm2 or a checkpoint folder")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 on CPU)")
    ap.add_argument("--n-prompts", type=int, default=6, help="held-out questions, spread over the task groups")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds of the paired AR comparison")
    ap.add_argument("--kernels", action="store_true",
                    help="only time one decoding step's matrix-vector product per layer shape and weight format, "
                         "and one decoding forward per runtime under no_grad and under inference_mode")
    ap.add_argument("--json", default=None, help="write the results here (checked before any work)")
    add_force(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"), force=args.force)
    for name in ("n_prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        model, tok = load_model(args.model, dtype=args.dtype)
        for rt in RUNTIMES:  # an unsupported checkpoint fails here, before any timing
            use_runtime(model, rt)
        use_runtime(model, "hf")
    except ValueError as e:
        ap.error(str(e))
    if args.kernels:
        rows = kernel_rates(model)
        for k in rows:
            print(f"{k['matrix']:8s} {str(tuple(k['shape'])):14s} {k['format']:7s} {k['us']:8.1f} us "
                  f"{k['GBps']:6.1f} GB/s of weights")
        modes = grad_mode_times(model)
        for rt, g in modes.items():
            print(f"{rt:5s} one decoding forward: {g['no_grad_ms']:.2f} ms under no_grad, "
                  f"{g['inference_mode_ms']:.2f} ms under inference_mode")
        if args.json:
            body = {"provenance": provenance(command_line("runtimes", argv), None, timing=TIMING,
                                             **model_facts(args.model, model)), "kernels": rows, "grad_modes": modes}
            atomic_write_text(Path(args.json), results_json(body))
        return 0
    path = specbench.SPEC_BENCH_DEV if has_chat_template(tok) else None
    from dvi_lite.models.corpus import HELDOUT_PROMPTS

    records = specbench.read_prompts(path or HELDOUT_PROMPTS)
    prompts = prepare(model, tok, specbench.spread(records, args.n_prompts), 1, args.max_new_tokens)
    res = measure(model, tok, prompts, args.max_new_tokens, args.repeats)
    print(report(res))
    if args.json:
        body = {"provenance": provenance(command_line("runtimes", argv), None, timing=TIMING,
                                         **model_facts(args.model, model)),
                "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "context": res.pop("context"),
                             "prompts": str(path or HELDOUT_PROMPTS)}, **res}
        atomic_write_text(Path(args.json), results_json(body))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
