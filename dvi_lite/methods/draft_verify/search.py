"""Draft & Verify's skip-set search: which sub-layers to skip, found by Bayesian optimisation.

The objective is the paper's: measured wall seconds per generated token of greedy draft_verify on
calibration prompts from the corpus' val split (never the held-out test prompts). The search engine itself
(`search_skip`, `SearchConfig`, `SearchResult`) is model-independent and lives in `bo` (re-exported here);
`search` plugs in the measured objective, and `save_search` writes the best set with its score and the whole
trial log, where `skipset.load_skip` finds it (`python -m dvi_lite draft-verify-search`). The timed objective
suits the course model; on a real model its noise exceeds the gaps between skip sets, so `prepare_smollm2`
(defined in `recipe`, re-exported here) searches with the low-noise objective of `objective` instead.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dvi_lite.commands import add_force, command_line, prog, run_or_usage_error
from dvi_lite.core.generate import generate
from dvi_lite.core.runner import Skip
from dvi_lite.methods.draft_verify.bo import SAMPLERS, SearchConfig, SearchResult, search_skip
from dvi_lite.methods.draft_verify.recipe import prepare_smollm2
from dvi_lite.methods.draft_verify.skipset import n_skipped, skip_file, skip_to_dict
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.models.corpus import make_prompts
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import check_output

# Public names of the search: the engine from `bo` and SmolLM2's recipe from `recipe` are re-exported, so
# notebooks, tests and `study.prepare` (which names "...draft_verify.search:prepare_smollm2") keep importing
# them from here.
__all__ = ["SAMPLERS", "SearchConfig", "SearchResult", "calibration_prompts", "main", "prepare_smollm2", "save_search",
           "search", "search_skip", "time_per_token"]

# ----------------------------------------------------------------------------- the measured objective

def calibration_prompts(n: int = 8, seed: int = 0) -> list[dict]:
    """Prompts from the corpus' val split (never the held-out test prompts the results use)."""
    half = max(1, n // 2)
    ps = make_prompts(n_per_domain=half, seed=seed, split="val")
    return ps[:n] if len(ps) >= n else ps


def time_per_token(model, tok, skip: Skip, prompts: list[dict], max_new_tokens: int = 32, **opts) -> float:
    """The paper's objective: wall seconds per generated token of greedy draft_verify on `prompts`."""
    t, n = 0.0, 0
    for p in prompts:
        t0 = time.perf_counter()
        out = generate(model, tok, p["prompt"], "draft_verify", max_new_tokens, skip=skip, **opts)
        t += time.perf_counter() - t0
        n += len(out.token_ids)
    return t / max(n, 1)


def search(model, tok, cfg: SearchConfig, prompts: list[dict], max_new_tokens: int = 32, progress: bool = True,
           **opts) -> SearchResult:
    """Bayesian optimisation of the skip set (`search_skip`) on the measured objective."""
    return search_skip(lambda s: time_per_token(model, tok, s, prompts, max_new_tokens, **opts),
                       model.config.num_hidden_layers, cfg, progress=progress)


def save_search(model, res: SearchResult, path: Path | None = None, **extra) -> Path:
    """The best skip set + its score, the whole trial log and the model fingerprint, as JSON."""
    path = Path(path) if path is not None else skip_file(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": fingerprint(model), "best_skip": skip_to_dict(res.best_skip),
            "best_seconds_per_token": res.best_value, "n_skipped": n_skipped(res.best_skip),
            "n_sublayers": 2 * model.config.num_hidden_layers, **extra, "search": res.to_dict()}
    atomic_write_text(path, json.dumps(body, indent=2) + "\n")
    return path


def _search_from_args(args: argparse.Namespace) -> tuple[Any, SearchResult]:
    from dvi_lite.models.loading import load_model

    cfg = SearchConfig(n_trials=args.trials, time_budget_s=args.budget_s, seed=args.seed, skip_ratio=args.ratio)
    model, tok = load_model(args.model, dtype="float32")
    check_output(args.out if args.out else skip_file(model), kind="file", force=args.force)  # before the search
    return model, search(model, tok, cfg, calibration_prompts(args.n_calib, args.seed), args.max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    from dvi_lite.measure.provenance import provenance

    ap = argparse.ArgumentParser(prog=prog("draft-verify-search"),
                                 description="Search Draft & Verify's skip set by Bayesian optimisation")
    ap.add_argument("--model", default=None, help="local HF Llama-family checkpoint (default: the course model)")
    ap.add_argument("--trials", type=int, default=60, help="objective evaluations at most")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget in seconds")
    ap.add_argument("--ratio", type=float, default=0.4, help="skip exactly this fraction of the 2L sub-layers")
    ap.add_argument("--n-calib", type=int, default=6, help="calibration prompts (corpus val split)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: data/draft_verify/skip.json (course model), "
                    "build/models/<fingerprint>/draft_verify/skip.json (another model); a committed file needs --force")
    add_force(ap)
    args = ap.parse_args(argv)
    model, res = run_or_usage_error(ap, _search_from_args, args)
    path = save_search(model, res, args.out, provenance=provenance(command_line("draft-verify-search", argv)))
    print(f"best {skip_to_dict(res.best_skip)}: {res.best_value * 1e3:.2f} ms/token -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
