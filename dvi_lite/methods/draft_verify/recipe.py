"""Draft & Verify's skip set for a real model (SmolLM2), by the low-noise objective (`objective`).

The recipe: the teacher data's own-answer rows are split into calibration rows (the first ones) and
held-out rows (the last ones, other questions); only answer positions are scored (drafting never runs
on the prompt). The sub-layer costs are measured once. Then for each skip ratio, at an exactly equal
number of skipped sub-layers: Bayesian optimisation (`bo.search_skip`), the best of as many random
skip sets, and two uniform sets (evenly spaced whole layers; evenly spaced sub-layers), all scored on the
calibration rows; each arm's winner is re-scored on the held-out rows. Ratios go up to 0.5 (`RATIOS`), as
the authors search. The ratio whose BO winner predicts the largest calibration speedup is kept and saved
where `skipset.load_skip` finds it, with its card. The evidence is kept with it: every BO trial (skip set,
alpha_hat, c, K, predicted speedup) and every random set, in the skip file, the summary and the results.
`python -m dvi_lite.methods.draft_verify.recipe --help`.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.runner import Skip
from dvi_lite.methods.draft_verify.bo import SearchConfig, SearchResult, search_skip
from dvi_lite.methods.draft_verify.objective import Calibration, SkipObjective, measure_sublayer_costs
from dvi_lite.methods.draft_verify.skipset import (
    candidate_sublayers,
    mask_to_skip,
    n_skipped,
    random_skips,
    ratio_to_count,
    skip_from_dict,
    skip_to_dict,
    uniform_skip,
)
from dvi_lite.models.artifacts import artifacts_dir, fingerprint
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import smoke_dir

V_RESULTS = "results/14_smollm2_bf16.json"  # the measured v(n) of SmolLM2 in bf16 on this machine
# Skip ratios the recipe compares: 4, 8, 12, 18, 24, 30 of SmolLM2's 60 sub-layers (even counts, so the
# whole-layer uniform set skips as many). Up to 0.5 as the authors search: their published sets skip 0.425
# (LLaMA-2-13B, -chat, CodeLLaMA-13B) and 0.525 (LLaMA-2-70B) of the sub-layers. SmolLM2's acceptance falls
# fast beyond ~0.2, which is what the larger ratios are there to show (or refute) with numbers.
RATIOS = (0.0667, 0.1333, 0.2, 0.3, 0.4, 0.5)


@dataclass
class RecipeConfig:
    ratios: tuple[float, ...] = RATIOS  # skip ratios compared (see RATIOS): up to 0.5, as the authors search
    trials: int = 40  # per ratio: BO trials, and as many random skip sets
    calib_rows: int = 24  # own-answer rows the search scores on (the first ones)
    heldout_rows: int = 48  # own-answer rows the winners are re-scored on (the last ones: other questions)
    max_positions: int = 24  # scored answer positions per row at most, evenly spaced
    k_max: int = 8  # draft lengths considered by the value
    vocab: int | None = None  # a trimmed draft head's size (None: the full head)
    compare_vocab: int | None = 8192  # also score the unskipped model through this trimmed head: the ceiling it
    # puts on alpha (the course-corpus map can miss the model's own argmax on Spec-Bench answers)
    sampler: str = "tpe"
    seed: int = 0
    context: int = 256  # cached positions when the sub-layer costs are timed
    cost_repeats: int = 15
    batch_size: int = 8

    @classmethod
    def smoke(cls) -> "RecipeConfig":
        return cls(ratios=(0.25,), trials=2, calib_rows=2, heldout_rows=2, max_positions=4, vocab=None,
                   compare_vocab=None, context=8, cost_repeats=1)


def answer_spans(data, tok) -> tuple[list[int], list[tuple[int, int]]]:
    """(row indices, (start, end) scored positions) of the teacher's own-answer rows: from the position
    that predicts the first answer token to the one that predicts the last token of the row. Data with
    no own answers (a model without a chat template, e.g. the course model's corpus-only teacher): every
    row, scored at every position."""
    from dvi_lite.core.generate import prompt_ids
    from dvi_lite.models.specbench import SPEC_BENCH_DEV, read_prompts

    ids = data.card.get("questions") or []
    keep = int(data.card.get("config", {}).get("prompt_tokens", 320))
    recs = {r["id"]: r for r in read_prompts(SPEC_BENCH_DEV)}
    lens = data.mask.sum(1).tolist()
    if "answer_from" in data.card:  # the self-distillation set: each window's first answer position is recorded
        keep_rows = [(i, max(0, a - 1)) for i, a in enumerate(data.card["answer_from"]) if max(0, a - 1) < lens[i] - 1]
        if not keep_rows:
            raise ValueError("the set has no own-answer positions to score")
        return [i for i, _ in keep_rows], [(a, lens[i] - 1) for i, a in keep_rows]
    if not ids:
        return [i for i in range(len(lens)) if lens[i] > 1], [(0, n - 1) for n in lens if n > 1]
    rows, spans = [], []
    for i, qid in enumerate(ids):
        p = prompt_ids(tok, [{"role": "user", "content": recs[qid]["turns"][0]}])[-keep:]
        if data.tokens[i, : len(p)].tolist() != p:
            raise ValueError(f"teacher row {i} does not start with question {qid}'s prompt: wrong tokenizer or data")
        if lens[i] - 1 > len(p) - 1:
            rows.append(i)
            spans.append((len(p) - 1, lens[i] - 1))
    if not rows:
        raise ValueError("the teacher data has no own-answer rows to score (built with answers=0?)")
    return rows, spans


def uniform_sublayers(n_layers: int, ratio: float) -> Skip:
    """Evenly spaced sub-layers among the searchable ones (near every other sub-layer at ratio ~ 0.5)."""
    cand = candidate_sublayers(n_layers)
    m = ratio_to_count(ratio, n_layers)
    z = [0] * (2 * n_layers)
    for j in range(m):
        z[cand[int((j + 0.5) * len(cand) / m)]] = 1
    return mask_to_skip(z, n_layers)


def _calibration(model, data, rows, spans, cfg: RecipeConfig) -> Calibration:
    """The rows' scored positions, each labelled with the full model's own argmax on the same tokens (not the
    record's labels, which came from a longer context: the full model would miss some of them itself)."""
    toks = [data.tokens[i, : int(data.mask[i].sum())].tolist() for i in rows]
    return Calibration(model, toks, spans, None, cfg.batch_size, cfg.max_positions)


def run_recipe(model, tok, data, cfg: RecipeConfig, v, progress: bool = True) -> dict:
    """Everything the search measures; returns the summary (the chosen set under "chosen")."""
    from dvi_lite.models.vocab import resolve_vocab

    t0 = time.time()
    n = model.config.num_hidden_layers
    vocab = resolve_vocab(model, tok, cfg.vocab)
    rows, spans = answer_spans(data, tok)
    if len(rows) < cfg.calib_rows + cfg.heldout_rows:
        raise ValueError(f"calib_rows + heldout_rows = {cfg.calib_rows + cfg.heldout_rows} > the {len(rows)} "
                         "own-answer rows of the teacher data")
    cal_i, held_i = slice(0, cfg.calib_rows), slice(len(rows) - cfg.heldout_rows, len(rows))
    cal = _calibration(model, data, rows[cal_i], spans[cal_i], cfg)
    held = _calibration(model, data, rows[held_i], spans[held_i], cfg)
    costs = measure_sublayer_costs(model, cfg.context, cfg.cost_repeats, vocab, cfg.seed)
    f_cal = SkipObjective(cal, costs, v, cfg.k_max, vocab)
    f_held = SkipObjective(held, costs, v, cfg.k_max, vocab)
    full = {"calibration": f_cal.evaluate(Skip()), "heldout": f_held.evaluate(Skip())}
    if cfg.compare_vocab is not None:
        head = resolve_vocab(model, tok, cfg.compare_vocab)
        full[f"alpha_hat_trimmed_head_{cfg.compare_vocab}"] = {"calibration": cal.agreement(Skip(), head),
                                                                "heldout": held.agreement(Skip(), head)}
    sweep = []
    for ratio in cfg.ratios:
        arms: dict[str, dict] = {}
        for name, s in (("uniform_layers", uniform_skip(n, ratio)), ("uniform_sublayers", uniform_sublayers(n, ratio))):
            arms[name] = {"skip": s, "calibration": f_cal.evaluate(s)}
        rnd = random_skips(n, ratio, cfg.trials, seed=cfg.seed + 1)
        vals = [f_cal.evaluate(s)["speedup"] for s in tqdm(rnd, desc=f"random r={ratio}", disable=not progress)]
        best = max(range(len(rnd)), key=lambda i: vals[i])
        arms["random"] = {"skip": rnd[best], "calibration": f_cal.evaluate(rnd[best]),
                          "all_calibration_speedups": vals}
        arms["random"]["trials"] = [{**skip_to_dict(s), **f_cal.evaluate(s)} for s in rnd]
        res = search_skip(f_cal, n, SearchConfig(n_trials=cfg.trials, skip_ratio=ratio, seed=cfg.seed,
                                                 sampler=cfg.sampler), progress=progress)
        arms["bo"] = {"skip": res.best_skip, "calibration": f_cal.evaluate(res.best_skip),
                      "best_so_far": [-x for x in res.best_so_far()], "search": search_evidence(res, f_cal)}
        for a in arms.values():
            a["heldout"] = f_held.evaluate(a["skip"])
        counts = {k: n_skipped(a["skip"]) for k, a in arms.items()}
        sweep.append({"ratio": ratio, "n_skipped": counts, "arms": arms})
    chosen = max(sweep, key=lambda r: r["arms"]["bo"]["calibration"]["speedup"])
    return {"n_layers": n, "rows": {"calibration": rows[cal_i], "heldout": rows[held_i]},
            "positions": {"calibration": cal.n_positions, "heldout": held.n_positions},
            "costs": costs.to_dict(), "vocab": cfg.vocab, "no_skip": full, "sweep": sweep,
            "chosen": {"ratio": chosen["ratio"], **chosen["arms"]["bo"]}, "config": asdict(cfg),
            "wall_time_s": round(time.time() - t0, 1), "objective_evaluations": len(f_cal.log) + len(f_held.log)}


def search_evidence(res: SearchResult, objective: SkipObjective) -> dict:
    """The BO search as evidence: its config, stop reason and every trial (in order) with the objective's
    parts at that trial's skip set (alpha_hat, c, K, tau, predicted speedup; value = minus the speedup)."""
    d = res.to_dict()
    for t in d["trials"]:
        t.update(objective.evaluate(skip_from_dict(t)))  # logged: no re-scoring
    return d


def _jsonable(x: Any) -> Any:
    """x in JSON-safe form, every key kept (the search evidence too): a Skip -> its index lists, a
    SearchResult -> its dict, numpy / torch scalars -> Python numbers, sets -> sorted lists, paths -> str,
    and non-finite floats -> None (JSON has no Infinity or NaN; an invalid skip set scores inf)."""
    if isinstance(x, Skip):
        return skip_to_dict(x)
    if isinstance(x, SearchResult):
        return _jsonable(x.to_dict())
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(_jsonable(v) for v in x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def load_v(path: str | Path | None = None) -> dict:
    """The measured v(n) table of SmolLM2 bf16 (results/14_smollm2_bf16.json)."""
    from dvi_lite.paths import ROOT

    return json.loads((Path(path) if path else ROOT / V_RESULTS).read_text())["verify_cost"]


def prepare_smollm2(model_path: str, out_dir: Path, command: str, smoke: bool = False, teacher=None,
                    dtype: str = "bfloat16", v=None, summary_path: str | Path | None = None,
                    cfg: RecipeConfig | None = None) -> dict:
    """Search SmolLM2's skip set by the recipe and write it to out_dir/skip.json with its card.

    teacher: the teacher file (default: the model's, `teacher.teacher_path`; smoke builds a tiny one in out_dir
    when it is missing). v: the v(n) table (default: SmolLM2 bf16's measured one). Returns the summary.
    """
    from dvi_lite.measure.provenance import device_name, git_commit, provenance
    from dvi_lite.models.loading import load_once
    from dvi_lite.models.teacher import TeacherConfig, load_teacher, teacher_outputs, teacher_path

    cfg = cfg if cfg is not None else RecipeConfig.smoke() if smoke else RecipeConfig()
    torch.manual_seed(cfg.seed)
    model, tok = load_once(model_path, dtype=dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tpath = Path(teacher) if teacher is not None else teacher_path(model)
    if tpath.is_dir():  # a self-distillation set (distill-data): its held-out split, answers scored only
        from dvi_lite.models.distill_reader import load_distill

        data = load_distill(model, tpath, "val", corpus=False)
    elif smoke and not tpath.is_file():  # a tiny teacher over 4 seeded random rows (no corpus to tokenize)
        gen = torch.Generator().manual_seed(cfg.seed)
        rows = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen).tolist()
        data, tpath = teacher_outputs(model, rows, TeacherConfig(layers=(1,), top_k=2)), "smoke: 4 random rows"
    else:
        data = load_teacher(tpath)
    summary = run_recipe(model, tok, data, cfg, v if v is not None else load_v(), progress=not smoke)
    ch = summary["chosen"]
    tcommit = data.card.get("provenance", {}).get("commit")
    card = {"data": {"teacher": str(tpath), "n_rows": data.card.get("n_rows"), "rows": summary["rows"],
                     "positions": summary["positions"], "teacher_commit": tcommit},
            "trials": cfg.trials, "ratios": list(cfg.ratios), "command": command, "commit": git_commit(),
            "device": device_name(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "wall_time_s": summary["wall_time_s"],
            "objective": "predicted speedup tau(alpha_hat, K) / (v(K + 1) + K c), best K <= k_max",
            "calibration": ch["calibration"], "heldout": ch["heldout"], "vocab": cfg.vocab}
    body = {"fingerprint": fingerprint(model), "best_skip": skip_to_dict(ch["skip"]),
            "n_skipped": n_skipped(ch["skip"]),
            "n_sublayers": 2 * summary["n_layers"], "ratio": ch["ratio"], "K": ch["calibration"]["K"],
            "card": card, "provenance": provenance(command), "search": ch["search"]}
    path = out_dir / "skip.json"
    atomic_write_text(path, json.dumps(_jsonable(body), indent=1) + "\n")
    summary = _jsonable(summary)
    summary["skip_file"] = str(path)
    if summary_path is not None:
        body = {**summary, "provenance": provenance(command)}
        atomic_write_text(Path(summary_path), json.dumps(body, indent=1) + "\n")
    return summary


BENCH_FIELDS = ("tokens_per_s", "speedup_vs_ar", "tau", "alpha", "c", "draft_depth_per_step", "drafted_per_step",
                "verify_cost_per_step", "predicted_speedup", "measured_over_predicted", "same_tokens_as_ar",
                "common_prefix_with_ar", "new_tokens", "n_prompts")


def _arm_row(arm: dict, target: float, v) -> dict:
    """One arm of one ratio for the results table: its predicted speedup and alpha_hat on calibration and
    held-out rows, its draft cost c and K, and whether it can pay at all: the acceptance the cost model needs
    at this c for break-even (1.0x) and for `target` (None: not even alpha = 1 reaches it), against the
    held-out alpha_hat the skip set has."""
    from dvi_lite.measure.cost import alpha_needed

    c = arm["calibration"]["c"]
    row = {f"{part}_{key}": arm[part][key] for part in ("calibration", "heldout") for key in ("speedup", "alpha_hat")}
    row |= {"c": c, "K": arm["calibration"].get("K", arm["calibration"].get("k")),  # k: a summary before the rename
            "alpha_needed_for_1x_at_c": alpha_needed(1.0, c, v),
            "alpha_needed_for_target_at_c": alpha_needed(target, c, v)}
    row["pays_heldout"] = arm["heldout"]["speedup"] > 1.0
    return row


def write_results(summary_path: str | Path, bench_paths: list[str | Path], out: str | Path, command: str,
                  target: float = 1.3) -> dict:
    """results/15_draft_verify_smollm2.json: the search (every arm on calibration and held-out rows, per
    ratio), the bench runs of the chosen set, and what the cost model says `target` would need."""
    from dvi_lite.measure.cost import alpha_needed, c_needed
    from dvi_lite.measure.provenance import provenance

    summ = json.loads(Path(summary_path).read_text())
    v = load_v()
    table = {}
    for r in summ["sweep"]:
        table[str(r["ratio"])] = {name: _arm_row(a, target, v) for name, a in r["arms"].items()}
        rnd = r["arms"]["random"]["all_calibration_speedups"]
        table[str(r["ratio"])]["random"]["calibration_speedup_median_of_all"] = sorted(rnd)[len(rnd) // 2]
    ch = summ["chosen"]
    need = {"target": target, "objective_c": ch["calibration"]["c"], "heldout_alpha_hat": ch["heldout"]["alpha_hat"],
            "alpha_needed_at_objective_c": alpha_needed(target, ch["calibration"]["c"], v),
            "c_needed_at_heldout_alpha_hat": c_needed(target, ch["heldout"]["alpha_hat"], v)}
    bench = {}
    for bp in bench_paths:
        b = json.loads(Path(bp).read_text())
        for name, m in b["methods"].items():
            row = {k: m.get(k) for k in BENCH_FIELDS}
            if name != "ar" and m.get("alpha") is not None and m.get("c") is not None:
                row["alpha_needed_for_target_at_measured_c"] = alpha_needed(target, m["c"], b["verify_cost"])
                row["c_needed_for_target_at_measured_alpha"] = c_needed(target, m["alpha"], b["verify_cost"])
            bench[name] = row
        bench_meta = {"provenance": b["provenance"], "settings": b["settings"], "verify_cost": b["verify_cost"]}
    body = {"provenance": provenance(command), "what": "Draft & Verify on SmolLM2-135M-Instruct bf16: skip-set "
            "search by a low-noise objective (teacher-forced alpha_hat + sub-layer cost model), BO vs the best of as "
            "many random sets vs uniform sets at equal skip ratios, scored on calibration and held-out rows; the "
            "chosen set benchmarked with fixed and adaptive gamma", "skip_file": summ.get("skip_file"),
            "chosen": {k: ch[k] for k in ("ratio", "skip", "calibration", "heldout")},
            "comparison": table, "needed": need, "search": summ, "bench": bench,
            "bench_meta": bench_meta if bench_paths else None}
    # compact: every trial is kept
    atomic_write_text(Path(out), json.dumps(_jsonable(body), separators=(",", ":")) + "\n")
    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("draft-verify-recipe"),
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="folder of skip.json (default: "
                    "artifacts_dir(model)/draft_verify; with --smoke, build/smoke/)")
    ap.add_argument("--summary", default=None, help="write the whole summary (JSON) here")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--data", default=None, help="score on this self-distillation set's held-out split (a folder "
                    "from distill-data) instead of the model's teacher file")
    ap.add_argument("--trials", type=int, default=None, help="override the recipe's trials per arm and ratio")
    ap.add_argument("--ratios", type=float, nargs="+", default=None, help="override the recipe's skip ratios")
    ap.add_argument("--bench", nargs="+", default=None, help="with --results: bench JSONs of the chosen set")
    ap.add_argument("--results", default=None, help="with --summary and --bench: write the results JSON here")
    add_force(ap)
    args = ap.parse_args(argv)
    if args.results is not None:
        check_outputs(ap, (args.results, "file", "--results"), force=args.force)
        write_results(args.summary, args.bench or [], args.results, command_line("draft-verify-recipe", argv))
        return 0
    cfg = RecipeConfig.smoke() if args.smoke else RecipeConfig()
    if args.trials is not None:
        cfg = replace(cfg, trials=args.trials)
    if args.ratios is not None:
        cfg = replace(cfg, ratios=tuple(args.ratios))
    from dvi_lite.models.loading import Loaded, load_model

    model, tok = run_or_usage_error(ap, load_model, args.model, dtype="bfloat16")
    out_dir = Path(args.out) if args.out else smoke_dir("draft-verify-recipe") if args.smoke else \
        artifacts_dir(model) / "draft_verify"
    check_outputs(ap, (out_dir, "dir", "--out"), (args.summary, "file", "--summary"), force=args.force,
                  smoke=args.smoke)
    out = prepare_smollm2(Loaded(model, tok, args.model), out_dir, command_line("draft-verify-recipe", argv),
                          args.smoke, teacher=args.data, summary_path=args.summary, cfg=cfg)
    print(json.dumps({"chosen": out["chosen"]["ratio"], "calibration": out["chosen"]["calibration"],
                      "heldout": out["chosen"]["heldout"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
