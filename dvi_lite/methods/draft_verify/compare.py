"""Does Bayesian optimisation find better skip sets than chance? BO vs random vs uniform, over several seeds.

`python -m dvi_lite draft-verify-compare --data FOLDER --ratio 0.2 --trials 200 --seeds 0,1,2 --json OUT`

One search's margin over the best of as many random sets says little: both are one draw each. Here every seed
runs a BO search and draws as many random skip sets, at the same skip ratio, against the same low-noise
objective (objective.py: alpha_hat from the full model's own labels, c from the sub-layer cost model); the
uniform sets are the deterministic baselines. Each arm's winner is re-scored on held-out rows (other questions),
and the table gives, per arm, the mean over seeds with a 95% interval, and BO minus random paired by seed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dvi_lite.commands import add_force, check_outputs, command_line, prog, run_or_usage_error, seed_list
from dvi_lite.core.runner import Skip
from dvi_lite.measure.paired import ci95
from dvi_lite.methods.draft_verify.bo import SearchConfig, search_skip
from dvi_lite.methods.draft_verify.objective import SkipObjective, measure_sublayer_costs
from dvi_lite.methods.draft_verify.recipe import RecipeConfig, _calibration, answer_spans, load_v, uniform_sublayers
from dvi_lite.methods.draft_verify.skipset import random_skips, skip_to_dict, uniform_skip
from dvi_lite.paths import atomic_write_text


def compare(f_cal: SkipObjective, f_held: SkipObjective, n_layers: int, ratio: float, trials: int,
            seeds: list[int], sampler: str = "tpe", progress: bool = True) -> dict:
    """Per seed: BO's pick and the best of `trials` random sets (calibration), both re-scored held out; the
    uniform sets once. Returns the runs and the summary over seeds (speedup and alpha_hat, held out)."""
    uniform = {name: s for name, s in (("uniform_layers", uniform_skip(n_layers, ratio)),
                                       ("uniform_sublayers", uniform_sublayers(n_layers, ratio)))}
    runs: dict[str, dict] = {}
    for seed in seeds:
        rnd = random_skips(n_layers, ratio, trials, seed=seed + 1)
        best_rnd = max(rnd, key=lambda s: f_cal.evaluate(s)["speedup"])
        res = search_skip(f_cal, n_layers, SearchConfig(n_trials=trials, skip_ratio=ratio, seed=seed,
                                                        sampler=sampler), progress=progress)
        runs[str(seed)] = {arm: {"skip": skip_to_dict(s), "calibration": f_cal.evaluate(s),
                                 "heldout": f_held.evaluate(s)}
                           for arm, s in (("bo", res.best_skip), ("random", best_rnd))}
        runs[str(seed)]["bo"]["best_so_far"] = [-x for x in res.best_so_far()]
    base = {arm: {"skip": skip_to_dict(s), "calibration": f_cal.evaluate(s), "heldout": f_held.evaluate(s)}
            for arm, s in uniform.items()}
    summary = {}
    for part in ("calibration", "heldout"):
        for key in ("speedup", "alpha_hat"):
            col = {arm: ci95([r[arm][part][key] for r in runs.values()]) for arm in ("bo", "random")}
            col["bo_minus_random"] = ci95([r["bo"][part][key] - r["random"][part][key] for r in runs.values()])
            col.update({arm: {"value": b[part][key]} for arm, b in base.items()})
            summary[f"{part}_{key}"] = col
    d = summary["heldout_speedup"]["bo_minus_random"]
    separated = d["ci95"] is not None and (d["ci95"][0] > 0 or d["ci95"][1] < 0)
    return {"ratio": ratio, "trials": trials, "seeds": seeds, "sampler": sampler, "runs": runs, "uniform": base,
            "summary": summary, "bo_separates_from_random_heldout": separated,
            "no_skip": {"calibration": f_cal.evaluate(Skip()), "heldout": f_held.evaluate(Skip())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("draft-verify-compare"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", required=True, help="a self-distillation set (distill-data folder): its held-out split")
    ap.add_argument("--ratio", type=float, default=0.2, help="skip this fraction of the 2L sub-layers")
    ap.add_argument("--trials", type=int, default=200, help="BO trials per seed, and as many random sets")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--json", required=True, help="write the comparison here")
    add_force(ap)
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"), force=args.force)
    if args.trials < 1 or not 0 < args.ratio <= 0.5:
        ap.error(f"--trials must be >= 1 and --ratio in (0, 0.5], got {args.trials} and {args.ratio}")
    seeds = args.seeds
    from dvi_lite.models.distill_reader import load_distill
    from dvi_lite.models.loading import load_model

    model, tok = run_or_usage_error(ap, load_model, args.model, dtype="bfloat16")
    data = run_or_usage_error(ap, load_distill, model, Path(args.data), "val", corpus=False)
    cfg = RecipeConfig()
    rows, spans = answer_spans(data, tok)
    n_cal, n_held = cfg.calib_rows, cfg.heldout_rows
    cal = _calibration(model, data, rows[:n_cal], spans[:n_cal], cfg)
    held = _calibration(model, data, rows[-n_held:], spans[-n_held:], cfg)
    costs = measure_sublayer_costs(model, cfg.context, cfg.cost_repeats, None, cfg.seed)
    v = load_v()
    f_cal, f_held = SkipObjective(cal, costs, v, cfg.k_max), SkipObjective(held, costs, v, cfg.k_max)
    res = compare(f_cal, f_held, model.config.num_hidden_layers, args.ratio, args.trials, seeds)
    from dvi_lite.measure.provenance import provenance, results_json

    body = {"provenance": provenance(command_line("draft-verify-compare", argv)), "costs": costs.to_dict(),
            "positions": {"calibration": cal.n_positions, "heldout": held.n_positions}, **res}
    atomic_write_text(Path(args.json), results_json(body))
    s = res["summary"]["heldout_speedup"]
    print(json.dumps({k: s[k] for k in ("bo", "random", "bo_minus_random")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
