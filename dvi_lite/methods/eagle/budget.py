"""How many tree nodes EAGLE-2 should verify: N chosen with the measured verify cost v(n).

A bigger dynamic tree gets more tokens per target forward (tau grows with N, then flattens) but its verify
forward costs v(N + 1), which grows once the forward stops being weight-bound. The drafting cost grows with the
depth K, not with N (each depth is one head forward over the expanded nodes). So for each budget N this measures
tau greedily on held-out questions (a count, independent of the machine's load) and predicts

    speedup(N) = tau(N) / (v(N + 1) + K c)

with v from `measure.cost.verify_cost` and c the head's cost per draft step, both measured in the same session
(the bench's calibration); the N with the best prediction is the one to use.

    python -m dvi_lite eagle-budget --model smollm2 --nodes 8 16 24 32 --json results/28_eagle_budget.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dvi_lite.commands import check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import add_renamed_flags, check_int, check_real

BUDGETS = (8, 16, 24, 32)


def budget_rows(model, tok, prompts: list[dict], v, c: float, nodes: tuple[int, ...] = BUDGETS, K: int = 5,
                branch: int | None = None, head=None, max_new_tokens: int = 128) -> dict:
    """tau and the predicted speedup for every node budget (dynamic tree, greedy), and the best budget."""
    from dvi_lite.measure.cost import predicted_speedup
    from dvi_lite.measure.timing import decode_counts

    check_real("c (draft cost per step)", c, 0)
    check_int("K (draft tokens per step: the tree's depth)", K, 1)
    rows = []
    for n in nodes:
        check_int("nodes (tree budget)", n, 1)
        opts = {"tree": "dynamic", "K": K, "max_nodes": n, "branch": branch, "head": head}
        counts = decode_counts(model, tok, prompts, "eagle", max_new_tokens, opts)
        pred = None if counts["tau"] is None else predicted_speedup(counts["tau"], K, c, v, nodes=n)
        rows.append({"nodes": n, **counts, "predicted_speedup": None if pred is None else round(pred, 4)})
    scored = [r for r in rows if r["predicted_speedup"] is not None]
    best = max(scored, key=lambda r: r["predicted_speedup"])["nodes"] if scored else None
    return {"rows": rows, "best_nodes": best, "K": K, "c": c,
            "v": {str(n): float(x) for n, x in v.items()} if isinstance(v, dict) else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("eagle-budget"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", help="the benchmark's dtype (v and c are measured in it)")
    ap.add_argument("--nodes", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--K", type=int, default=5, help="draft tokens per step: the tree's depth")
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    add_renamed_flags(ap, "k")  # --k: an error naming --K
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"))  # before any work

    def run() -> dict:
        from dvi_lite.measure.cost import verify_cost
        from dvi_lite.measure.provenance import write_result
        from dvi_lite.measure.timing import bench
        from dvi_lite.models.loading import load_model
        from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread

        model, tok = load_model(args.model, dtype=args.dtype)
        prompts = spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)[: check_int("questions", args.questions, 1)]
        v = verify_cost(model, ns=tuple(sorted({1, *[n + 1 for n in args.nodes]})))
        # c: the head's draft time per step over AR's time per token, from one interleaved bench round
        res = bench(model, tok, prompts[:2], ["ar", f"eagle:K={args.K}"], max_new_tokens=32, repeats=1, v=v)
        c = res[f"eagle:K={args.K}"]["c"]
        out = budget_rows(model, tok, prompts, v, c, tuple(args.nodes), args.K, max_new_tokens=args.max_new_tokens)
        out |= {"model": args.model, "dtype": args.dtype, "questions": args.questions}
        if args.json:
            write_result(Path(args.json).stem, out, command_line("eagle-budget", argv), out_dir=Path(args.json).parent)
        return out

    out = run_or_usage_error(ap, run)
    print(json.dumps({"best_nodes": out["best_nodes"], "rows": out["rows"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
