"""Train every method's pieces for a model that is not the course model, so the notebooks run on it.

The course model's Kangaroo adapter, Medusa heads, Draft & Verify skip set and DVI head are committed in
data/. A local HF checkpoint has none of them, and each loader refuses pieces trained for another model
(a fingerprint check), so before the notebooks run on `--model X` this fills X's own folder,
build/models/<fingerprint>/ (see `artifacts`), with the same recipes the course used. What is already
there is kept (rerunning is cheap and resumes nothing twice); `--force` retrains.

    python -m dvi_lite prepare --model /models/Llama-3.2-1B          # the course recipes' sizes
    python -m dvi_lite prepare --model /models/Llama-3.2-1B --smoke  # a few steps each (a dry run)

`python -m dvi_lite reproduce --model X` calls this first.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from dvi_lite.cli import command_line, prog, run_or_usage_error
from dvi_lite.core.checks import default_split
from dvi_lite.models.artifacts import COURSE_FINGERPRINT, artifacts_dir, fingerprint


@dataclass
class PrepareConfig:
    split: int | None = None  # exit layer k of Kangaroo and DVI; None = the model's default_split
    adapter_steps: int = 300  # Kangaroo adapter distillation steps (the course recipe)
    heads_steps: int = 240  # Medusa heads steps (course recipe: 4 heads, shared LM head)
    search_trials: int = 40  # Draft & Verify Bayesian-optimisation trials
    skip_ratio: float = 0.5  # fraction of sub-layers the Draft & Verify draft skips (notebook 03's default)
    dvi_steps: int = 200  # DVI online fast updates (notebook 05's main run)
    seed: int = 0

    @classmethod
    def smoke(cls) -> "PrepareConfig":
        return cls(adapter_steps=2, heads_steps=2, search_trials=2, dvi_steps=2)


def _pieces(model, split: int) -> dict[str, Path]:
    from dvi_lite.methods.draft_verify.skipset import skip_file
    from dvi_lite.methods.dvi.policy import POLICY_FILE
    from dvi_lite.methods.kangaroo.drafter import model_adapter_path
    from dvi_lite.methods.medusa.heads import heads_path

    return {"kangaroo adapter": model_adapter_path(model, split), "medusa heads": heads_path(model),
            "draft_verify skip set": skip_file(model), "dvi head": artifacts_dir(model) / "dvi" / POLICY_FILE}


def prepare(model_path: str | None, cfg: PrepareConfig, force: bool = False, command: str = "") -> dict[str, str]:
    """Train what `model_path` lacks; returns {piece: file}. The course model needs nothing."""
    from dvi_lite.methods.draft_verify import search as dv
    from dvi_lite.methods.dvi import cli as dvi
    from dvi_lite.methods.kangaroo.train import AdapterConfig, train_adapter
    from dvi_lite.methods.medusa.train import MedusaTrainConfig, train_heads
    from dvi_lite.models.loading import load_model
    from dvi_lite.study.provenance import provenance

    model, tok = load_model(model_path, dtype="float32")
    split = default_split(model.config.num_hidden_layers) if cfg.split is None else cfg.split
    pieces = _pieces(model, split)
    if fingerprint(model) == COURSE_FINGERPRINT and not force:
        print("the course model: its pieces are committed in data/, nothing to train")
        return {k: str(v) for k, v in pieces.items()}
    todo = {k: v for k, v in pieces.items() if force or not v.is_file()}
    print(f"pieces for {model_path} in {artifacts_dir(model)}: training {', '.join(todo) or 'nothing'}")
    if "kangaroo adapter" in todo:
        train_adapter(AdapterConfig(split=split, steps=cfg.adapter_steps, seed=cfg.seed), model_path,
                      todo["kangaroo adapter"], command=command,
                      ckpt_name=f"kangaroo_k{split}_{fingerprint(model)}")
    if "medusa heads" in todo:
        heads_cfg = MedusaTrainConfig(heads=4, steps=cfg.heads_steps, batch_size=4, shared_lm_head=True, seed=cfg.seed)
        train_heads(heads_cfg, model_path, todo["medusa heads"], command=command)
    if "draft_verify skip set" in todo:
        search_cfg = dv.SearchConfig(n_trials=cfg.search_trials, seed=cfg.seed, skip_ratio=cfg.skip_ratio)
        res = dv.search(model, tok, search_cfg, dv.calibration_prompts(6, cfg.seed), 32)
        dv.save_search(model, res, todo["draft_verify skip set"], provenance=provenance(command))
    if "dvi head" in todo:
        dvi.main(["--model", str(model_path), "--split", str(split), "--steps", str(cfg.dvi_steps),
                  "--out", str(todo["dvi head"].parent), "--seed", str(cfg.seed), "--eval-prompts", "0",
                  "--ckpt-dir", str(artifacts_dir(model).parent / f"ckpt_{fingerprint(model)}_dvi")])
    return {k: str(v) for k, v in pieces.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("prepare"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local HF Llama-family checkpoint folder")
    ap.add_argument("--smoke", action="store_true",
                    help="a few steps per piece (checks the pipeline, trains nothing useful)")
    ap.add_argument("--force", action="store_true", help="retrain pieces that already exist")
    args = ap.parse_args(argv)
    cfg = PrepareConfig.smoke() if args.smoke else PrepareConfig()
    out = run_or_usage_error(ap, prepare, args.model, cfg, args.force, command_line("prepare", argv))
    for k, v in out.items():
        print(f"{k:<22} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
