"""`python -m dvi_lite.methods.dvi.ablation`: DVI vs KL-only distillation vs pure RL, online, on a real model.

    python -m dvi_lite.methods.dvi.ablation --model smollm2 --dtype bfloat16 --split 5 \\
        --json results/15_dvi_smollm2.json --save-head data/smollm2/dvi

Each arm (serve.ARMS) is an online run over the same stream of Spec-Bench dev training questions (same
length, same seed, same starting head), reporting the acceptance / tau curve over the stream and the
final head's greedy tau / alpha on held-out bench questions. --save-head commits the "dvi" arm's head
(bf16, with a card): the default run is the ablation's DVI arm. Checkpoints per arm in --ckpt-dir, --resume
continues a killed run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dvi_lite.cli import run_or_usage_error
from dvi_lite.methods.dvi.serve import ARMS, RECIPE, arm_config, frozen_model, heldout_before, online_run, save_head
from dvi_lite.paths import ROOT

PROG = "python -m dvi_lite.methods.dvi.ablation"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="DVI vs KL-only vs pure RL, online over a question stream")
    ap.add_argument("--model", default="smollm2", help="model name or folder (default smollm2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms among {list(ARMS)}")
    ap.add_argument("--split", type=int, default=RECIPE["split"], help="exit layer k")
    ap.add_argument("--sequences", type=int, default=RECIPE["sequences"], help="stream questions per arm")
    ap.add_argument("--max-new-tokens", type=int, default=RECIPE["max_new_tokens"])
    ap.add_argument("--vocab", default=str(RECIPE["vocab"]), help="trimmed head size N, or 'full'")
    ap.add_argument("--tau", type=float, default=None, help="lambda time constant (default: the base config's)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--eval-questions", type=int, default=RECIPE["eval_questions"])
    ap.add_argument("--eval-tokens", type=int, default=RECIPE["eval_tokens"])
    ap.add_argument("--json", default=None, help="write the results here (e.g. results/15_dvi_smollm2.json)")
    ap.add_argument("--save-head", default=None, help="save the dvi arm's head (bf16) + card here")
    ap.add_argument("--ckpt-dir", default=str(ROOT / "build" / "ckpt" / "dvi_ablation"))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--cost-model", nargs=2, metavar=("V_JSON", "C_JSON"), default=None,
                    help="only add the cost model's verdict to --json: v(n) from V_JSON's verify_cost (a bench "
                    "result) and c at --split from C_JSON (the Kangaroo sweep's table); no training")
    return ap


def geometric_tau(alpha: float, k: int) -> float:
    """Tokens per step when each of k drafts is accepted with probability alpha, independently, in order."""
    return sum(alpha ** i for i in range(k + 1))


def cost_model(res: dict, v: dict, c: float, target: float = 1.3, ks: tuple[int, ...] = (1, 2, 3, 4, 6)) -> dict:
    """What the cost model says: each arm's held-out alpha -> predicted speedup at the best K (geometric tau),
    and the per-token acceptance needed for `target` x AR at each K (study.cost.predicted_speedup)."""
    from dvi_lite.study.cost import predicted_speedup

    def best(alpha: float) -> dict:
        rows = [{"k": k, "speedup": predicted_speedup(geometric_tau(alpha, k), k, c, v)} for k in ks]
        return max(rows, key=lambda r: r["speedup"])

    def needed(k: int) -> float | None:
        lo, hi = 0.0, 0.999
        if predicted_speedup(geometric_tau(hi, k), k, c, v) < target:
            return None
        for _ in range(40):  # bisection on alpha
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted_speedup(geometric_tau(mid, k), k, c, v) < target else (lo, mid)
        return hi

    arms = {"untrained": res["heldout_before"]["alpha"], **{a: r["heldout"]["alpha"] for a, r in res["arms"].items()}}
    return {"c": c, "v": v, "target_vs_ar": target, "model": "tau = sum_{i<=K} alpha^i, speedup = tau / (v(K+1) + K c)",
            "predicted_best": {a: {"alpha": al, **best(al)} for a, al in arms.items()},
            "alpha_needed": {str(k): needed(k) for k in ks}}


def run(args: argparse.Namespace, command: str) -> dict:
    from dvi_lite.study.provenance import provenance

    if args.cost_model:
        if not args.json or not Path(args.json).is_file():
            raise ValueError("--cost-model adds to an existing --json result file")
        res = json.loads(Path(args.json).read_text())
        v = json.loads(Path(args.cost_model[0]).read_text())["verify_cost"]
        table = json.loads(Path(args.cost_model[1]).read_text())["sweep"]["table"]
        row = next((r for r in table if r["k"] == args.split), None)
        if row is None:
            raise ValueError(f"--split {args.split}: no exit layer {args.split} in {args.cost_model[1]}'s sweep")
        res["cost_model"] = {**cost_model(res, v, row["c"]), "c_source": f"{args.cost_model[1]} (Kangaroo's draft "
                             f"step at k={args.split}, trimmed head: the same layers and head as DVI's)",
                             "v_source": args.cost_model[0], "provenance": provenance(command)}
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return res

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"--arms must name arms among {list(ARMS)}, got {args.arms!r}")
    if args.save_head and "dvi" not in arms:
        raise ValueError("--save-head saves the dvi arm's head: include 'dvi' in --arms")
    recipe = {**RECIPE, "split": args.split, "sequences": args.sequences, "max_new_tokens": args.max_new_tokens,
              "vocab": None if args.vocab == "full" else int(args.vocab), "eval_questions": args.eval_questions,
              "eval_tokens": args.eval_tokens}
    model, tok = frozen_model(args.model, args.dtype)
    over = {k: v for k, v in (("tau", args.tau), ("lr", args.lr)) if v is not None}
    base = arm_config("dvi", split=args.split, **over)
    res = {"what": "DVI ablation on a real model: online runs over the same stream of Spec-Bench dev training "
                   "questions (same length, seed, starting head), different objectives; then the final head's "
                   "greedy tau / alpha on held-out bench questions",
           "model": args.model, "dtype": args.dtype, "recipe": recipe, "arms_changes": {a: ARMS[a] for a in arms},
           "heldout_before": heldout_before(model, tok, base, recipe), "arms": {}}
    for arm in arms:
        cfg = arm_config(arm, split=args.split, **over)
        trainer, summary = online_run(model, tok, cfg, recipe, arm, out=Path(args.ckpt_dir),
                                      ckpt_dir=Path(args.ckpt_dir) / arm, resume=args.resume)
        res["arms"][arm] = summary
        if arm == "dvi" and args.save_head:
            save_head(trainer, summary, Path(args.save_head), command, recipe)
        print(json.dumps({"arm": arm, "fast_steps": summary["fast_steps"], "heldout": summary["heldout"]}))
        del trainer
    res["provenance"] = provenance(command)
    res["provenance"]["device_words"] = "cpu, 2 cores"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    cmd = " ".join([PROG, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    run_or_usage_error(ap, run, args, cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
