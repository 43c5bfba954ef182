"""How many layers the SpS draft should have: chosen by the cost model from drafts trained at equal tokens.

A deeper draft agrees with the target more often (alpha rises) and costs more per token (c rises). For drafts
of 1..4 layers trained by the same recipe on the same tokens (`sps-train --layers 0 1 ...`), this measures

    alpha(L)  acceptance when decoding held-out questions greedily (a count: the machine's load cannot move it)
    c(L)      one draft token's time over an AR token's, from one interleaved bench round
    best      max over K of tau(alpha, K) / (v(K + 1) + K c)     (measure.cost.best_speedup, v measured here)

and picks the L with the best prediction.

    python -m dvi_lite sps-sizing --drafts build/sps_layers/l1 build/sps_layers/l2 --json results/27_sps_sizing.json
    python -m dvi_lite sps-sizing --apply results/27_sps_sizing.json --force   # its best K into defaults.json

`--apply` writes the pick's best K into the model's defaults.json ("sps": {"K": ...}), which SpS and HF assisted
generation draft with when no K is given: the study runs SpS at its sized configuration, and names the file.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dvi_lite.commands import add_force, check_outputs
from dvi_lite.core.checks import check_int


def rows_of(model, tok, drafts: list[Path], prompts: list[dict], timing_prompts: list[dict], max_new_tokens: int,
            v: dict, K: int = 4) -> list[dict]:
    """One row per draft folder: its layers, tokens seen, held-out agreement (its card), alpha and tau by decoding,
    c by one bench round, and the cost model's best K and predicted speedup."""
    from dvi_lite.measure.cost import best_speedup
    from dvi_lite.measure.timing import bench, decode_counts
    from dvi_lite.methods.sps.draft import load_draft

    rows = []
    for d in drafts:
        card = json.loads((Path(d) / "card.json").read_text())
        draft = load_draft(model, Path(d) / "draft.pt")
        counts = decode_counts(model, tok, prompts, "sps", max_new_tokens, {"draft_model": draft, "K": K})
        res = bench(model, tok, timing_prompts, ["ar", "sps"], max_new_tokens=32, repeats=1, v=v,
                    options={"sps": {"draft_model": draft, "K": K}})
        c = res["sps"]["c"]
        s, k = best_speedup(counts["alpha"], c, v)
        rows.append({"draft": str(d), "layers": len(card["config"]["layers"]), "tokens_seen": card["tokens_seen"],
                     "val_agreement": card["final"]["val_agreement"], **counts, "c": c, "best_K": k,
                     "predicted_speedup": round(s, 4), "device": card.get("device")})
    return rows


def apply(result: Path, defaults: Path) -> dict:
    """defaults.json's "sps" entry from a sizing result: the chosen draft's best K, and where it came from."""
    from dvi_lite.paths import atomic_write_text

    body = json.loads(result.read_text())
    best = next(r for r in body["rows"] if r["layers"] == body["best_layers"])
    entry = {"K": int(best["best_K"]), "why": f"sps-sizing's pick ({result.as_posix()}): the best K of the "
             f"{best['layers']}-layer draft by tau / (v(K + 1) + K c), alpha {best['alpha']} and c {best['c']:.3f} "
             "measured"}
    d = json.loads(defaults.read_text()) if defaults.is_file() else {}
    d["sps"] = entry
    atomic_write_text(defaults, json.dumps(d, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    from dvi_lite.commands import command_line, prog, run_or_usage_error

    ap = argparse.ArgumentParser(prog=prog("sps-sizing"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", help="the benchmark's dtype (v and c are measured in it)")
    ap.add_argument("--drafts", nargs="+", default=None, help="draft folders (draft.pt + card.json) to compare")
    ap.add_argument("--apply", default=None, metavar="RESULT",
                    help="write RESULT's best K into the model's defaults.json (committed: needs --force)")
    add_force(ap)
    ap.add_argument("--questions", type=int, default=12, help="held-out questions decoded for alpha")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.apply:
        from dvi_lite.models.artifacts import artifacts_dir
        from dvi_lite.models.loading import load_model
        from dvi_lite.safety import check_output

        if not Path(args.apply).is_file():
            ap.error(f"--apply {args.apply}: no such sizing result (run sps-sizing --drafts ... --json first)")
        model, _ = run_or_usage_error(ap, load_model, args.model, dtype=args.dtype)
        target = artifacts_dir(model) / "defaults.json"
        run_or_usage_error(ap, check_output, target, force=args.force, flag="--apply")
        print(json.dumps(run_or_usage_error(ap, apply, Path(args.apply), target)))
        return 0
    if not args.drafts:
        ap.error("give --drafts FOLDER ... to measure, or --apply RESULT to write a measured pick")
    check_outputs(ap, (args.json, "file", "--json"))  # before any work

    def run() -> dict:
        from dvi_lite.measure.cost import verify_cost
        from dvi_lite.measure.provenance import write_result
        from dvi_lite.models.loading import load_model
        from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread

        missing = [d for d in args.drafts if not (Path(d) / "draft.pt").is_file()]
        if missing:
            raise ValueError(f"--drafts: no draft.pt in {missing}")
        model, tok = load_model(args.model, dtype=args.dtype)
        prompts = spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)[: check_int("questions", args.questions, 1)]
        v = verify_cost(model, ns=tuple(range(1, 10)))
        rows = rows_of(model, tok, [Path(d) for d in args.drafts], prompts, prompts[:3], args.max_new_tokens, v)
        best = max(rows, key=lambda r: (r["predicted_speedup"], -r["layers"]))
        out = {"rows": rows, "best_layers": best["layers"], "v": {str(k): float(x) for k, x in v.items()},
               "model": args.model, "dtype": args.dtype, "questions": args.questions}
        if args.json:
            write_result(Path(args.json).stem, out, command_line("sps-sizing", argv), out_dir=Path(args.json).parent)
        return out

    out = run_or_usage_error(ap, run)
    print(json.dumps({"best_layers": out["best_layers"], "rows": [{k: r[k] for k in ("layers", "alpha", "c", "best_K",
                     "predicted_speedup")} for r in out["rows"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
