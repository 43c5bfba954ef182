"""Check the Triton tree-attention kernel against the sdpa reference: `python -m dvi_lite tree-attention --check`.

Random trees (chains, stars and uniform ones) over random shapes, in fp32 and, on a GPU, fp16 and bf16;
the exit status says whether every max error is within its dtype's tolerance. On a GPU it also times the
kernel, the reference and sdpa alone on Medusa-like shapes. Without a GPU it runs the kernel under
Triton's interpreter: a correctness check, not a speed one. Writes a JSON summary with --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from dvi_lite.commands import check_outputs, prog
from dvi_lite.core.runner import tree_mask
from dvi_lite.methods.medusa.tree_attention import kernel_defined, tree_attention_reference, tree_attention_triton

COMMAND = "tree-attention"  # python -m dvi_lite <COMMAND>
TOLERANCE = {"torch.float32": 1e-4, "torch.float16": 1e-2, "torch.bfloat16": 5e-2}  # max abs error per dtype


def _random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random valid tree: mostly uniform parents, sometimes a chain or a star (the two extremes)."""
    kind = int(torch.randint(0, 6, (1,), generator=gen))
    if kind == 0:
        return torch.arange(n) - 1  # chain
    if kind == 1:
        return torch.full((n,), -1)  # star
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)], dtype=torch.long)


def timeit_us(fn, device: torch.device, reps: int = 50) -> float:
    """Median wall time of fn() in microseconds (synchronising the device around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def check(n: int = 300, seed: int = 0, device: str | None = None) -> dict[str, Any]:
    """Triton vs reference on `n` random trees (fp32, fp16 and bf16 when on GPU) plus timings."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32] + ([torch.float16, torch.bfloat16] if dev.type == "cuda" else [])
    errs: dict[str, float] = {str(dt): 0.0 for dt in dtypes}
    worst: dict[str, Any] = {}
    heads = [(2, 1), (4, 2), (2, 2), (32, 8)]
    for t in range(n):
        N = int(torch.randint(1, 65, (1,), generator=gen))
        P = int(torch.randint(0, 300, (1,), generator=gen))
        D = [16, 32, 64, 128][int(torch.randint(0, 4, (1,), generator=gen))]
        H, Hkv = heads[int(torch.randint(0, len(heads), (1,), generator=gen))]
        B = int(torch.randint(1, 3, (1,), generator=gen))
        par = _random_parents(N, gen)
        dt = dtypes[t % len(dtypes)]
        x = [torch.randn(s, generator=gen).to(dev, dt)
             for s in ((B, H, N, D), (B, Hkv, P, D), (B, Hkv, P, D), (B, Hkv, N, D), (B, Hkv, N, D))]
        ref = tree_attention_reference(*x, par.to(dev)).float()
        got = tree_attention_triton(*x, par.to(dev)).float()
        e = (got - ref).abs().max().item()
        if e >= errs[str(dt)]:
            errs[str(dt)] = e
            worst[str(dt)] = dict(B=B, H=H, Hkv=Hkv, N=N, P=P, D=D, parents=par.tolist())
    timings = []
    if dev.type == "cuda":  # Medusa-like shapes: a 64-node tree over a long past, Llama-7B/8B-like heads
        for P, N, H, Hkv, D in [(512, 64, 32, 32, 128), (2048, 64, 32, 8, 128), (8192, 64, 32, 8, 128)]:
            par = _random_parents(N, gen).to(dev)
            x = [torch.randn(s, generator=gen).to(dev, torch.float16)
                 for s in ((1, H, N, D), (1, Hkv, P, D), (1, Hkv, P, D), (1, Hkv, N, D), (1, Hkv, N, D))]
            mask = tree_mask(par.cpu(), P).to(dev)
            k = torch.cat([x[1], x[3]], 2).repeat_interleave(H // Hkv, 1)
            v = torch.cat([x[2], x[4]], 2).repeat_interleave(H // Hkv, 1)
            sdpa = partial(F.scaled_dot_product_attention, x[0], k, v, attn_mask=mask)
            timings.append(dict(
                P=P, N=N, H=H, Hkv=Hkv, D=D, dtype="float16",
                triton_us=timeit_us(lambda x=x, par=par: tree_attention_triton(*x, par), dev),
                reference_us=timeit_us(lambda x=x, par=par: tree_attention_reference(*x, par), dev),
                sdpa_premasked_us=timeit_us(sdpa, dev)))
    return dict(device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev), trees=n, seed=seed,
                max_abs_err=errs, worst_case=worst, timings_us=timings,
                note="reference_us includes validation + host-built mask + GQA repeat; sdpa_premasked_us is sdpa alone")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog(COMMAND), description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="run the comparison (the only action)")
    ap.add_argument("--n", type=int, default=300, help="number of random trees")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (needs TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    check_outputs(ap, (args.out, "file", "--out"))  # before any work
    if not args.check:
        ap.print_help()
        return 2
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    if on_cpu and not kernel_defined() and os.environ.get("TRITON_INTERPRET") != "1":
        # the kernel is defined lazily, so choosing the interpreter here still takes effect
        os.environ["TRITON_INTERPRET"] = "1"
        print("no GPU: running the kernel in Triton's interpreter (TRITON_INTERPRET=1): a correctness check, slow")
    try:
        summary = check(args.n, args.seed, args.device)
    except RuntimeError as e:  # no triton, or CPU tensors without the interpreter
        ap.error(str(e))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(e <= TOLERANCE[k] for k, e in summary["max_abs_err"].items()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
