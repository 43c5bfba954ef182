"""`python -m dvi_lite.methods.dvi.ablation`: DVI vs KL-only distillation vs pure RL, online, on a real model.

    python -m dvi_lite.methods.dvi.ablation --model smollm2 --dtype bfloat16 --split 5 \\
        --json results/15_dvi_smollm2.json --save-head data/smollm2/dvi

Each arm (serve.ARMS) is an online run over the same stream of Spec-Bench dev training questions (same
length, same seed, same starting head), reporting the acceptance / tau curve over the stream and the
final head's greedy tau / alpha on held-out bench questions. --save-head commits the "dvi" arm's head
(bf16, with a card): the default run is the ablation's DVI arm. Checkpoints per arm in --ckpt-dir, --resume
continues a killed run.

paper_ablation (the issue's "DVI as the paper trains it"): the same three arms with the trained head, each a KL
warm-start on the self-distillation set then the online reward phase (paper.train_paper), for several seeds at an
equal number of tokens, ranked with 95% intervals; `python -m dvi_lite dvi --data FOLDER --ablation` runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dvi_lite.commands import check_outputs, run_or_usage_error
from dvi_lite.core.checks import add_renamed_flags
from dvi_lite.measure.paired import ci95
from dvi_lite.methods.dvi import paper
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.serve import ARMS, RECIPE, arm_config, frozen_model, heldout_before, online_run, save_head
from dvi_lite.models.artifacts import ckpt_path
from dvi_lite.models.teacher import TeacherData
from dvi_lite.paths import atomic_write_text

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
    ap.add_argument("--t-lambda", type=float, default=None,
                    help="T_λ, lambda's time constant (default: the base config's)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--eval-questions", type=int, default=RECIPE["eval_questions"])
    ap.add_argument("--eval-tokens", type=int, default=RECIPE["eval_tokens"])
    ap.add_argument("--json", default=None, help="write the results here (e.g. results/15_dvi_smollm2.json)")
    ap.add_argument("--save-head", default=None, help="save the dvi arm's head (bf16) + card here")
    ap.add_argument("--force", action="store_true", help="let --save-head / --json replace committed files")
    ap.add_argument("--ckpt-dir", default=None,
                    help="checkpoints per arm (default: under build/ckpt/, keyed by the model and the recipe)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--cost-model", nargs=2, metavar=("V_JSON", "C_JSON"), default=None,
                    help="only add the cost model's verdict to --json: v(n) from V_JSON's verify_cost (a bench "
                    "result) and c at --split from C_JSON (the Kangaroo sweep's table); no training")
    add_renamed_flags(ap, "tau")  # --tau: an error naming --t-lambda
    return ap


def cost_model(res: dict, v: dict, c: float, target: float = 1.3, ks: tuple[int, ...] = (1, 2, 3, 4, 6)) -> dict:
    """What the cost model says: each arm's held-out alpha -> predicted speedup at the best K (geometric tau),
    and the per-token acceptance needed for `target` x AR at each K (measure.cost.predicted_speedup)."""
    from dvi_lite.measure.cost import alpha_needed, expected_tau, predicted_speedup

    def best(alpha: float) -> dict:
        rows = [{"K": k, "speedup": predicted_speedup(expected_tau(alpha, k), k, c, v)} for k in ks]
        return max(rows, key=lambda r: r["speedup"])

    arms = {"untrained": res["heldout_before"]["alpha"], **{a: r["heldout"]["alpha"] for a, r in res["arms"].items()}}
    return {"c": c, "v": v, "target_vs_ar": target, "model": "tau = sum_{i<=K} alpha^i, speedup = tau / (v(K+1) + K c)",
            "predicted_best": {a: {"alpha": al, **best(al)} for a, al in arms.items()},
            "alpha_needed": {str(k): alpha_needed(target, c, v, K=k) for k in ks}}


def run(args: argparse.Namespace, command: str) -> dict:
    from dvi_lite.measure.provenance import provenance

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
        atomic_write_text(Path(args.json), json.dumps(res, indent=2) + "\n")
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
    over = {k: v for k, v in (("t_lambda", args.t_lambda), ("lr", args.lr)) if v is not None}
    base = arm_config("dvi", split=args.split, **over)
    res = {"what": "DVI ablation on a real model: online runs over the same stream of Spec-Bench dev training "
                   "questions (same length, seed, starting head), different objectives; then the final head's "
                   "greedy tau / alpha on held-out bench questions",
           "model": args.model, "dtype": args.dtype, "recipe": recipe, "arms_changes": {a: ARMS[a] for a in arms},
           "heldout_before": heldout_before(model, tok, base, recipe), "arms": {}}
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else ckpt_path("dvi_ablation", model, recipe, suffix="")
    for arm in arms:
        cfg = arm_config(arm, split=args.split, **over)
        trainer, summary = online_run(model, tok, cfg, recipe, arm, out=ckpt_dir, ckpt_dir=ckpt_dir / arm,
                                      resume=args.resume)
        res["arms"][arm] = summary
        if arm == "dvi" and args.save_head:
            save_head(trainer, summary, Path(args.save_head), command, recipe)
        print(json.dumps({"arm": arm, "fast_steps": summary["fast_steps"], "heldout": summary["heldout"]}))
        del trainer
    res["provenance"] = provenance(command)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), json.dumps(res, indent=2) + "\n")
    return res




def paper_ablation(model, tok, train: TeacherData, val: TeacherData, base: DVIConfig = paper.PAPER,
                   recipe: paper.PaperRecipe | None = None, arms: Sequence[str] = ("dvi", "kl", "rl"),
                   seeds: Sequence[int] = (0, 1, 2), out_dir: str | Path = "build/dvi_paper_ablation",
                   command: str = "", metric: str = "agree") -> dict[str, Any]:
    """DVI vs KL-only vs pure RL (serve.ARMS on `base`), each for every seed, at an equal number of tokens.

    Every arm of one seed sees the same warm-start positions in the same order, the same stream of questions and
    starts from the same head; only the objective differs. Per arm: the final held-out agreement and KL (val
    split), bench tau / alpha when recipe.eval_questions; mean / sd / 95% t-interval over seeds; paired
    differences to "dvi" (same seed); arms ranked by the mean of `metric` ("agree": higher is better, "kl":
    lower), with "separated" saying whether the ranking's neighbours' intervals are disjoint.
    Returns a JSON-ready dict with provenance (results/...json).
    """
    from dvi_lite.measure.provenance import provenance
    from dvi_lite.methods.dvi.serve import arm_config

    recipe = (recipe or paper.PaperRecipe()).check()
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct ints, got {list(seeds)!r}")
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"arms must be among {list(ARMS)}, got {list(arms)!r}")
    if metric not in ("agree", "kl"):
        raise ValueError(f"metric must be 'agree' or 'kl', got {metric!r}")
    out_dir = Path(out_dir)
    runs: dict[str, dict[int, dict]] = {a: {} for a in arms}
    for seed in seeds:
        for arm in arms:
            cfg = arm_config(arm, base=base, seed=seed)
            d = out_dir / arm / f"seed_{seed}"
            card = paper.train_paper(model, tok, train, val, cfg, dataclasses.replace(recipe, max_minutes=None), d,
                               resume=True, command=command)
            runs[arm][seed] = {"final": card["final"], "heldout_bench": card["heldout_bench"],
                               "warm_positions": card["warm_positions"], "experiences": card["experiences"],
                               "tokens_generated": card["tokens_generated"], "fast_steps": card["fast_steps"],
                               "curve": card["curve"]}
    keys = ["agree", "kl"] + (["tau", "alpha"] if recipe.eval_questions else [])

    def val_of(r: dict, key: str) -> float | None:
        return r["final"][key] if key in ("agree", "kl") else (r["heldout_bench"] or {}).get(key)

    summary = {a: {key: ci95([val_of(runs[a][s], key) for s in seeds]) for key in keys
                   if all(val_of(runs[a][s], key) is not None for s in seeds)} for a in arms}
    paired = {a: {key: ci95([val_of(runs[a][s], key) - val_of(runs["dvi"][s], key) for s in seeds])
                  for key in summary[a] if key in summary["dvi"]} for a in arms if a != "dvi" and "dvi" in arms}
    sign = -1.0 if metric == "agree" else 1.0
    ranking = sorted(arms, key=lambda a: sign * summary[a][metric]["mean"])

    def disjoint(a: str, b: str) -> bool | None:
        ia, ib = summary[a][metric]["ci95"], summary[b][metric]["ci95"]
        return None if ia is None or ib is None else (ia[1] < ib[0] or ib[1] < ia[0])

    prov = provenance(command or None, device=next(model.parameters()).device)
    return {"what": "DVI ablation as the paper trains it: KL warm-start on the self-distillation set then the online "
                    "reward phase; arms differ only in the objective; equal tokens per arm and seed",
            "arms_changes": {a: ARMS[a] for a in arms}, "base_config": base.to_dict(), "recipe": recipe.recipe(),
            "seeds": list(seeds), "metric": metric, "runs": {a: {str(s): r for s, r in rs.items()}
                                                             for a, rs in runs.items()},
            "summary": summary, "paired_vs_dvi": paired, "ranking": ranking,
            "separated": [disjoint(a, b) for a, b in zip(ranking[:-1], ranking[1:], strict=True)],
            "data": {"warm": train.card.get("source"), "val": val.card.get("source")},
            "provenance": prov}


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"), (args.ckpt_dir, "dir", "--ckpt-dir"),
                  (args.save_head, "dir", "--save-head"), force=args.force)  # before any work
    cmd = " ".join([PROG, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    run_or_usage_error(ap, run, args, cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
