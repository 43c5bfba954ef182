"""How many Medusa heads, and how big a tree: chosen by the cost model from the heads' measured accuracies.

Every head the drafter runs costs a ResBlock per step, and the heads share one matmul with the LM head, whichever
their number; every tree node costs verify width. Both buy tokens only as far as the heads are right. For H heads
and a sparse tree of N nodes (`trees.sparse_tree` over the first H heads' rank accuracies):

    tau(H, N)     = 1 + E[accepted length]           (the independence model of `trees.expected_accept_length`)
    cost(H, N)    = v(N + 1) + c_shared + H c_head     (one verify forward over the nodes + the heads, per step)
    speedup(H, N) = tau(H, N) / cost(H, N)

v(n) and the heads' cost are measured in the same run: c_shared and c_head are the line through Medusa's draft cost
per step with one head and with every stored head, from one interleaved bench round. The grid is then pure
arithmetic, and `decode_counts` checks the model's tau for the pick by decoding held-out questions (a count).

    python -m dvi_lite medusa-sizing --json results/27_medusa_sizing.json [--apply]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from dvi_lite.commands import add_force, check_outputs
from dvi_lite.core.checks import check_int, check_real
from dvi_lite.methods.medusa.trees import expected_accept_length, sparse_tree
from dvi_lite.models.artifacts import save_piece
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import load_torch

BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
RESULT = "results/27_medusa_sizing.json"  # the committed sizing: its measured v(n) and head costs price a new card


def grid(accuracies: Sequence[Sequence[float]], v: Mapping, c_head: float, c_shared: float = 0.0,
         budgets: Sequence[int] = BUDGETS) -> list[dict]:
    """One row per (heads H, nodes N): the model's tau, the step's cost and the predicted speedup over AR."""
    from dvi_lite.measure.cost import v_of

    check_real("c_head (one head's cost per step)", c_head, 0)
    check_real("c_shared (the heads' shared cost per step)", c_shared, 0)
    rows = []
    for h in range(1, len(accuracies) + 1):
        acc = [list(a) for a in accuracies[:h]]
        for n in budgets:
            check_int("budget (tree nodes)", n, 1)
            paths = sparse_tree(acc, n)
            tau = 1.0 + expected_accept_length(paths, acc)
            cost = v_of(v, len(paths) + 1) + c_shared + h * c_head
            rows.append({"heads": h, "nodes": len(paths), "depth": max(len(p) for p in paths),
                         "tau_model": round(tau, 4), "cost": round(cost, 4), "predicted_speedup": round(tau / cost, 4),
                         "paths": [list(p) for p in paths]})
    return rows


def best(rows: list[dict]) -> dict:
    """The row with the best predicted speedup (ties: fewer heads, then fewer nodes: less to store and run)."""
    if not rows:
        raise ValueError("rows: the grid is empty")
    return max(rows, key=lambda r: (r["predicted_speedup"], -r["heads"], -r["nodes"]))


def step_cost(result: Mapping, method: str = "medusa") -> float:
    """Medusa's measured draft cost per step in a bench result: c per draft forward x draft depth per step."""
    row = result["methods"][method]
    return row["c"] * row["draft_depth_per_step"]


def cost_line(points: Mapping[int, float]) -> tuple[float, float]:
    """(c_shared, c_head): the least-squares line c(H) = c_shared + H c_head through measured {heads: cost per step};
    one point alone is split evenly over its heads (no shared part), the pessimistic guess for fewer heads."""
    if not points:
        raise ValueError("points: give at least one measured {heads: cost per step}")
    hs, cs = list(points), [float(points[h]) for h in points]
    if len(hs) == 1:
        return 0.0, cs[0] / hs[0]
    mh, mc = sum(hs) / len(hs), sum(cs) / len(cs)
    b = sum((h - mh) * (c - mc) for h, c in zip(hs, cs, strict=True)) / sum((h - mh) ** 2 for h in hs)
    b = max(b, 0.0)
    return max(mc - b * mh, 0.0), b


def pick_for(card: dict, v: Mapping, costs: Mapping[int, float]) -> tuple[list[dict], dict, dict]:
    """(grid rows, the pick, the prices) for heads with this training card (its rank accuracies), with the verify
    cost v and Medusa's measured draft cost per step at some head counts ({heads: cost}, `head_costs`)."""
    c_shared, c_head = cost_line(costs)
    rows = grid(card["accuracy"]["rank_accuracy"], v, c_head, c_shared)
    prices = {"v": {str(k): float(x) for k, x in v.items()}, "c_shared": c_shared, "c_head": c_head,
              "measured_cost_per_step": {str(h): float(c) for h, c in costs.items()}}
    return rows, best(rows), prices


def head_costs(model, tok, prompts: list[dict], counts: Sequence[int], v: Mapping) -> dict[int, float]:
    """Medusa's draft cost per step (in AR tokens) with each number of heads, from one interleaved bench round."""
    from dvi_lite.measure.timing import bench

    specs = {h: f"medusa:K={h}:tree=cartesian:branch=1" for h in counts}
    res = bench(model, tok, prompts, ["ar", *specs.values()], max_new_tokens=32, repeats=1, v=v)
    return {h: step_cost({"methods": {"medusa": res[spec]}}) for h, spec in specs.items()}


def committed_pick(card: dict, result: str | Path = RESULT) -> dict:
    """The pick for a freshly trained card, priced with the committed sizing result's measured v and head costs."""
    from dvi_lite.paths import ROOT

    r = json.loads((ROOT / result).read_text())
    costs = {int(h): c for h, c in r["measured_cost_per_step"].items()}
    return pick_for(card, {int(n): x for n, x in r["v"].items()}, costs)[1]


def apply(pick: dict, heads_file: Path, defaults_file: Path, result: str) -> dict:
    """Keep the cost model's pick: the heads file keeps its first `pick["heads"]` heads (their accuracies too), the
    card says so, and the model's defaults.json gets the tree ("medusa": K, branch, the node paths), which
    `medusa.make_drafter` uses when no tree is given. Returns the defaults entry."""

    ck = load_torch(heads_file, "Medusa heads file", keys=("num_heads", "state"))
    h = pick["heads"]
    if h > ck["num_heads"]:
        raise ValueError(f"the pick uses {h} heads; {heads_file} holds {ck['num_heads']}")
    ck["state"] = {k: v for k, v in ck["state"].items() if not k.startswith("blocks.")
                   or int(k.split(".")[1]) < h}
    ck["num_heads"], ck["accuracies"] = h, (ck.get("accuracies") or [])[:h] or None
    save_piece(ck, heads_file)
    card_file = heads_file.with_suffix(".json")
    card = json.loads(card_file.read_text())
    card["stored_heads"] = h
    card["sizing"] = {k: pick[k] for k in ("heads", "nodes", "tau_model", "cost", "predicted_speedup")} | {
        "result": result, "why": "the cost model's pick (medusa-sizing): the heads beyond it are not stored"}
    atomic_write_text(card_file, json.dumps(card, indent=2) + "\n")
    entry = {"K": h, "branch": 1 + max(max(p) for p in pick["paths"]), "tree": pick["paths"],
             "why": f"medusa-sizing's pick ({result})"}
    d = json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}
    if "vocab" in d.get("medusa", {}):  # the map the heads draft on is the heads' own choice: kept
        entry["vocab"] = d["medusa"]["vocab"]
    atomic_write_text(defaults_file, json.dumps(d | {"medusa": entry}, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    from dvi_lite.commands import command_line, prog, run_or_usage_error

    ap = argparse.ArgumentParser(prog=prog("medusa-sizing"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--questions", type=int, default=12, help="held-out questions to check the chosen tau by decoding")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", action="store_true", help="keep the pick: store only its heads and write the tree "
                    "into the model's defaults.json (what medusa drafts with when no tree is given)")
    add_force(ap)
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"))  # before any work
    if args.apply and not args.json:
        ap.error("--apply needs --json (the result the card and the defaults point to)")

    def run() -> dict:
        from dvi_lite.measure.cost import verify_cost
        from dvi_lite.measure.provenance import write_result
        from dvi_lite.measure.timing import decode_counts
        from dvi_lite.methods.medusa.heads import heads_path
        from dvi_lite.models.artifacts import artifacts_dir
        from dvi_lite.models.loading import load_model
        from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread
        from dvi_lite.safety import check_output

        model, tok = load_model(args.model, dtype="bfloat16")
        if args.apply:  # --apply rewrites the heads file and defaults.json: committed ones need --force
            check_output(heads_path(model), force=args.force, flag="--apply")
            check_output(artifacts_dir(model) / "defaults.json", force=args.force, flag="--apply")
        card = json.loads(heads_path(model).with_suffix(".json").read_text())
        acc = card["accuracy"]["rank_accuracy"]
        prompts = spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)[: check_int("questions", args.questions, 1)]
        v = verify_cost(model, ns=tuple(sorted({1, *[n + 1 for n in BUDGETS]})))
        stored = card.get("stored_heads", card["num_heads"])  # a file --apply trimmed keeps fewer heads
        rows, pick, prices = pick_for(card, v, head_costs(model, tok, prompts[:2], sorted({1, stored}), v))
        checks = []
        also = best([x for x in rows if x["heads"] == stored])  # the best tree over every stored head, beside it
        for r in [pick] + ([also] if also is not pick else []):
            opts = {"K": r["heads"], "tree": [tuple(p) for p in r["paths"]],
                    "branch": 1 + max(max(p) for p in r["paths"])}
            checks.append({"heads": r["heads"], "nodes": r["nodes"], "tau_model": r["tau_model"],
                           **decode_counts(model, tok, prompts, "medusa", args.max_new_tokens, opts)})
        out = {"rows": rows, "best": {k: pick[k] for k in pick if k != "paths"}, "best_paths": pick["paths"],
               **prices, "accuracies": acc,
               "decode_check": checks, "questions": args.questions, "max_new_tokens": args.max_new_tokens,
               "model": args.model}
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
