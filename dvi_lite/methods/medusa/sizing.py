"""How many Medusa heads, and how big a tree: chosen by the cost model from the heads' measured accuracies.

Every head the drafter runs costs a ResBlock and a head matmul per step, and every tree node costs verify
width. Both buy tokens only as far as the heads are right. For H heads and a sparse tree of N nodes
(`trees.sparse_tree` over the first H heads' rank accuracies):

    tau(H, N)     = 1 + E[accepted length]           (the independence model of `trees.expected_accept_length`)
    cost(H, N)    = v(N + 1) + H c_head               (one verify forward over the nodes + the heads, per step)
    speedup(H, N) = tau(H, N) / cost(H, N)

v is the bench's measured verify-cost table and c_head one head's cost per step relative to an AR token,
from the same bench (its measured draft cost per step over the heads it ran). The grid is pure arithmetic;
`decode_counts` then checks the model's tau for the chosen configuration by decoding (a count, not a timing).

    python -m dvi_lite medusa-sizing --json results/27_medusa_sizing.json [--apply]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from dvi_lite.core.checks import check_int, check_real
from dvi_lite.methods.medusa.trees import expected_accept_length, sparse_tree

BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BENCH = "results/27_drafts_smollm2_bf16.json"  # the SmolLM2 bench of the retrained drafts: v(n) and Medusa's c


def grid(accuracies: Sequence[Sequence[float]], v: Mapping, c_head: float,
         budgets: Sequence[int] = BUDGETS) -> list[dict]:
    """One row per (heads H, nodes N): the model's tau, the step's cost and the predicted speedup over AR."""
    from dvi_lite.study.cost import v_of

    check_real("c_head (one head's cost per step)", c_head, 0)
    rows = []
    for h in range(1, len(accuracies) + 1):
        acc = [list(a) for a in accuracies[:h]]
        for n in budgets:
            check_int("budget (tree nodes)", n, 1)
            paths = sparse_tree(acc, n)
            tau = 1.0 + expected_accept_length(paths, acc)
            cost = v_of(v, len(paths) + 1) + h * c_head
            rows.append({"heads": h, "nodes": len(paths), "depth": max(len(p) for p in paths),
                         "tau_model": round(tau, 4), "cost": round(cost, 4), "predicted_speedup": round(tau / cost, 4),
                         "paths": [list(p) for p in paths]})
    return rows


def best(rows: list[dict]) -> dict:
    """The row with the best predicted speedup (ties: fewer heads, then fewer nodes: less to store and run)."""
    if not rows:
        raise ValueError("rows: the grid is empty")
    return max(rows, key=lambda r: (r["predicted_speedup"], -r["heads"], -r["nodes"]))


def from_bench(result: Mapping, method: str = "medusa", heads_run: int = 4) -> tuple[dict, float]:
    """(v table, c_head) from a bench result (`python -m dvi_lite bench --json`): its v(n) and the method's
    measured draft cost per step (c per draft forward x draft depth per step) split evenly over the heads it ran."""
    row = result["methods"][method]
    return result["verify_cost"], row["c"] * row["draft_depth_per_step"] / heads_run


def pick_for(card: dict, bench_file: str | Path = BENCH) -> tuple[list[dict], dict, float, dict]:
    """(grid rows, the pick, c_head, v) for heads with this training card (its rank accuracies), priced with a
    bench result's v(n) and Medusa's measured draft cost there."""
    v, c_head = from_bench(json.loads(Path(bench_file).read_text()), heads_run=card["num_heads"])
    rows = grid(card["accuracy"]["rank_accuracy"], v, c_head)
    return rows, best(rows), c_head, v


def apply(pick: dict, heads_file: Path, defaults_file: Path, result: str) -> dict:
    """Keep the cost model's pick: the heads file keeps its first `pick["heads"]` heads (their accuracies too), the
    card says so, and the model's defaults.json gets the tree ("medusa": K, branch, the node paths), which
    `medusa.make_drafter` uses when no tree is given. Returns the defaults entry."""
    import torch

    ck = torch.load(heads_file, map_location="cpu", weights_only=True)
    h = pick["heads"]
    if h > ck["num_heads"]:
        raise ValueError(f"the pick uses {h} heads; {heads_file} holds {ck['num_heads']}")
    ck["state"] = {k: v for k, v in ck["state"].items() if not k.startswith("blocks.")
                   or int(k.split(".")[1]) < h}
    ck["num_heads"], ck["accuracies"] = h, (ck.get("accuracies") or [])[:h] or None
    torch.save(ck, heads_file)
    card_file = heads_file.with_suffix(".json")
    card = json.loads(card_file.read_text())
    card["stored_heads"] = h
    card["sizing"] = {k: pick[k] for k in ("heads", "nodes", "tau_model", "cost", "predicted_speedup")} | {
        "result": result, "why": "the cost model's pick (medusa-sizing): the heads beyond it are not stored"}
    card_file.write_text(json.dumps(card, indent=2) + "\n")
    entry = {"K": h, "branch": 1 + max(max(p) for p in pick["paths"]), "tree": pick["paths"],
             "why": f"medusa-sizing's pick ({result})"}
    d = json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}
    defaults_file.write_text(json.dumps(d | {"medusa": entry}, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    from dvi_lite.cli import command_line, prog, run_or_usage_error

    ap = argparse.ArgumentParser(prog=prog("medusa-sizing"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bench", default=BENCH,
                    help="a bench result (bench --json): its v(n) table and Medusa's draft cost")
    ap.add_argument("--questions", type=int, default=12, help="held-out questions to check the chosen tau by decoding")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true", help="keep the pick: store only its heads and write the tree "
                    "into the model's defaults.json (what medusa drafts with when no tree is given)")
    args = ap.parse_args(argv)
    if args.apply and not args.json:
        ap.error("--apply needs --json (the result the card and the defaults point to)")

    def run() -> dict:
        from dvi_lite.methods.medusa.heads import heads_path
        from dvi_lite.models.artifacts import artifacts_dir
        from dvi_lite.models.loading import load_model
        from dvi_lite.study.curves import decode_counts
        from dvi_lite.study.provenance import write_result
        from dvi_lite.study.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread

        model, tok = load_model(args.model, dtype="bfloat16")
        card = json.loads(heads_path(model).with_suffix(".json").read_text())
        acc = card["accuracy"]["rank_accuracy"]
        rows, pick, c_head, v = pick_for(card, args.bench)
        prompts = spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)[: check_int("questions", args.questions, 1)]
        checks = []
        stored = card.get("stored_heads", card["num_heads"])  # a file --apply trimmed keeps fewer heads
        also = best([x for x in rows if x["heads"] == stored])  # the best tree over every stored head, beside it
        for r in [pick] + ([also] if also is not pick else []):
            opts = {"K": r["heads"], "tree": [tuple(p) for p in r["paths"]],
                    "branch": 1 + max(max(p) for p in r["paths"])}
            checks.append({"heads": r["heads"], "nodes": r["nodes"], "tau_model": r["tau_model"],
                           **decode_counts(model, tok, prompts, "medusa", args.max_new_tokens, opts)})
        out = {"rows": rows, "best": {k: pick[k] for k in pick if k != "paths"}, "best_paths": pick["paths"],
               "c_head": c_head, "v": {str(k): float(x) for k, x in v.items()}, "accuracies": acc,
               "decode_check": checks, "questions": args.questions, "max_new_tokens": args.max_new_tokens,
               "model": args.model, "bench": args.bench}
        if args.json:
            write_result(Path(args.json).stem, out, command_line("medusa-sizing", argv),
                         out_dir=Path(args.json).parent)
        if args.apply:
            out["applied"] = apply(pick, heads_path(model), artifacts_dir(model) / "defaults.json", args.json)
        return out

    out = run_or_usage_error(ap, run)
    print(json.dumps({"best": out["best"], "decode_check": out["decode_check"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
