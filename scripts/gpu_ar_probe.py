"""Where an AR token's time goes on a GPU: our AR (both runtimes) beside HF generate, on the course model.

    python scripts/gpu_ar_probe.py OUT.json [--device cuda] [--tokens 96]

On the H200 lease of 2026-11-28 our AR decoded SmolLM2 at 13.8 tokens/s and HF generate at 22.0 on the same
questions, while a speculative step cost less than an AR step: the baseline, not the target, looked slow. This
probe needs no carried model (the course model is in the tree): per-token time of each loop, and, from torch's
profiler over one short generation of each, the CUDA runtime calls per token (kernel launches, synchronisations,
copies back to the host) and the operators that take the most host time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def profile(fn, tokens: int) -> dict:
    """CUDA runtime calls per token and the ten operators with the most host time, over one generation."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=acts) as p:
        fn()
    ev = p.key_averages()
    calls = {e.key: e.count for e in ev if e.key.startswith("cuda") or e.key.startswith("aten::item")
             or e.key.startswith("aten::_local_scalar_dense")}
    top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"calls_per_token": {k: round(n / tokens, 1) for k, n in sorted(calls.items(), key=lambda x: -x[1])},
            "top_host_ms_per_token": {e.key: round(e.self_cpu_time_total / 1e3 / tokens, 3) for e in top}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from dvi_lite.core.generate import generate
    from dvi_lite.core.lean import use_runtime
    from dvi_lite.measure.provenance import provenance
    from dvi_lite.methods.medusa.tree_attention_check import timeit_us
    from dvi_lite.models.loading import load_model

    dev = torch.device(args.device)
    model, tok = load_model("course", dtype="float32", device=args.device)
    prompt = "Once upon a time, there was a little robot who wanted to learn how to paint. Every morning"
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    n = args.tokens

    def ours(runtime: str):
        def run():
            use_runtime(model, runtime)
            out = generate(model, tok, prompt, method="ar", max_new_tokens=n, stop_at_eos=False)
            assert len(out.token_ids) == n
        return run

    def hf():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)

    def bare():  # a forward per token through HF's modules with its cache, nothing else: the floor of HF's loop
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, x = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(n - 1):
                out = model(x, past_key_values=cache, use_cache=True)
                cache, x = out.past_key_values, out.logits[:, -1:].argmax(-1)

    loops = {"ours_hf": ours("hf"), "ours_lean": ours("lean"), "hf_generate": hf, "hf_forward_loop": bare}
    res: dict = {"model": "course (12 layers, fp32)", "tokens": n, "ms_per_token": {}, "profile": {}}
    for name, fn in loops.items():
        res["ms_per_token"][name] = round(timeit_us(fn, dev, args.reps) / 1e3 / n, 3)  # median of reps
        print(name, res["ms_per_token"][name], "ms/token", flush=True)
    use_runtime(model, "hf")
    for name, fn in loops.items():
        res["profile"][name] = profile(fn, n)
        print(name, json.dumps(res["profile"][name]["calls_per_token"]), flush=True)
    res["provenance"] = provenance("python scripts/gpu_ar_probe.py", device=args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
