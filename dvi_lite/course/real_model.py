"""The real model in the notebooks: SmolLM2-135M-Instruct in bf16 on Spec-Bench dev questions.

Full mode measures each chapter's headline on the real model, where a forward over a few new tokens costs
about as much as over one (the memory-bound regime of the papers' GPUs). Smoke mode runs the very same calls
on the course model and its held-out prompts, so CI covers the code in minutes without loading SmolLM2.

The recipe results (`results/15_*_smollm2.json`, `results/16_*_smollm2.json`) come from the commands on their
provenance; `recipe_result` reads one and says which command regenerates it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from dvi_lite.paths import ROOT


@dataclass
class RealModel:
    """A loaded model, its tokenizer, the prompts its bench times, and how to name it in a figure."""

    model: object
    tok: object
    prompts: list[dict]  # the bench's prompts (chat template applied for Spec-Bench questions)
    label: str  # e.g. "smollm2 bfloat16, Spec-Bench dev" or "course model (smoke)"
    smoke: bool


def load_real(smoke: bool, n_prompts: int, max_new_tokens: int, name: str = "smollm2",
              dtype: str = "bfloat16") -> RealModel:
    """SmolLM2 (`name`, `dtype`) on the first `n_prompts` Spec-Bench dev questions of the bench's spread; in
    smoke mode the course model (fp32) on its held-out prompts instead."""
    import dvi_lite
    from dvi_lite.models import specbench
    from dvi_lite.study import bench

    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    if smoke:
        from dvi_lite.models.corpus import load_prompts

        model, tok = dvi_lite.load_model(None)
        return RealModel(model, tok, bench.spread(load_prompts(), n_prompts), "course model (smoke)", True)
    if n_prompts > specbench.EVAL_QUESTIONS:
        raise ValueError(f"n_prompts must be <= {specbench.EVAL_QUESTIONS} on Spec-Bench dev (the rest train the "
                         f"drafts), got {n_prompts}")
    model, tok = dvi_lite.load_model(name, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    records = specbench.spread(specbench.read_prompts(specbench.SPEC_BENCH_DEV), n_prompts)
    prompts = bench.prepare(model, tok, records, 1, max_new_tokens)
    return RealModel(model, tok, prompts, f"{name} {dtype}, Spec-Bench dev", False)


def recipe_result(name: str) -> dict:
    """results/<name>.json, written by a recipe command (its provenance says which); a clear error if absent."""
    path = ROOT / "results" / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it is written by the recipe in its issue (see the README's "
                                "command table), e.g. `python -m dvi_lite prepare --model smollm2`")
    return json.loads(path.read_text())


def command_of(result: dict) -> str:
    """The command that wrote a results file (its provenance), for the notebook to print: an absolute path outside
    the repository (a scratch file the run wrote) reads <file>, so no machine's paths reach a learner."""
    prov = result.get("provenance") or {}
    root = str(ROOT) + "/"
    return " ".join(w.replace(root, "") if w.startswith(root) else "<file>" if w.startswith("/") else w
                    for w in prov.get("command", "?").split())
