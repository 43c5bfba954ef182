"""DVI learning while serving, on a real model: a stream of Spec-Bench dev questions, the ablation, the recipe.

The paper's setting: the draft head learns online from the verifier's accept/reject feedback while the
model answers a stream of user questions. The stream is Spec-Bench dev's *training* questions
(models.specbench.training_questions: never the ones the bench measures), chat-formatted
(core.generate.prompt_ids), shuffled by a seed, and cut to prompts of at most `max_prompt_tokens` tokens.

    question_stream   the stream (token ids + question ids)
    ARMS / arm_config  the ablation's objectives on one base config: "dvi" (the paper's: KL warm-up with
                       lambda_t, then the reward-driven policy-gradient term with an EMA baseline, plus the
                       CE anchor and the KL floor), "kl" (KL-only online distillation: lambda = 1, no CE),
                       "rl" (pure RL: lambda = 0 after the first update, no CE, no floor), "reference" (the
                       reference trainer's default: the policy term on accepted drafts only, no CE, no floor)
    online_run        one arm over the first `sequences` questions of the stream, then a greedy held-out
                      evaluation (a few bench questions); the learning curve over the stream
    prepare_smollm2   the committed head's recipe (the "dvi" arm), saved in bf16 with a card

The head starts from the model's own early exit (DVIPolicy's zero start), so every arm starts from the
same draft and sees the same questions in the same order; only the objective differs.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.drafter import evaluate
from dvi_lite.methods.dvi.learner import OnlineTrainer
from dvi_lite.models.artifacts import ckpt_path
from dvi_lite.paths import atomic_write_text

# the recipe of the committed SmolLM2 head (prepare_smollm2; the ablation's "dvi" arm)
RECIPE: dict[str, Any] = {"split": 4, "sequences": 36, "max_new_tokens": 64, "K": 6, "vocab": 8192,
                          "max_prompt_tokens": 384, "eval_questions": 6, "eval_tokens": 48}
# a fast update (a batch through the exit block and the trimmed head) costs far less than decoding the
# experiences it needs, so the stream is replayed: a 64-sample update every 8 new experiences
BASE = DVIConfig(split=RECIPE["split"], t_lambda=50.0, kl_floor=0.05, rl_variant="reinforce", ce_weight=0.2, lr=3e-3,
                 fast_every=8, batch_size=64, buffer_size=2048, seed=0)
# the ablation: what each arm changes in the base config
ARMS: dict[str, dict[str, Any]] = {
    "dvi": {},  # the paper's objective (KL warm-up -> reward-driven PG with EMA baseline, CE anchor, KL floor)
    "kl": {"kl_floor": 1.0, "ce_weight": 0.0},  # lambda_t = 1 forever: online KL distillation, reward unread
    "rl": {"kl_floor": 0.0, "t_lambda": 1e-3, "ce_weight": 0.0},  # lambda = 1 only at t = 0, then reward only
    # the reference trainer's default (train_dvi.py): the policy term on accepted drafts only, no CE, KL to 0
    "reference": {"rl_variant": "accepted", "ce_weight": 0.0, "kl_floor": 0.0},
}
SMOKE = {"sequences": 3, "max_new_tokens": 12, "K": 4, "vocab": None, "max_prompt_tokens": 96,
         "eval_questions": 1, "eval_tokens": 8}


def frozen_model(model: Any, dtype: str | None = "bfloat16", tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) with every base weight frozen: a name / folder is loaded (models.loading.load_model
    in `dtype`); a loaded model needs its tokenizer."""
    if model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
        from dvi_lite.models.loading import load_model

        model, tokenizer = load_model(model, dtype=dtype)
    elif tokenizer is None:
        raise ValueError("a loaded model needs its tokenizer (tokenizer=...)")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


def arm_config(arm: str, base: DVIConfig = BASE, **overrides: Any) -> DVIConfig:
    """The config of one ablation arm (ARMS) on `base`, with `overrides` applied last (validated)."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
    return dataclasses.replace(base, **{**ARMS[arm], **overrides})


def _records() -> list[dict]:
    from dvi_lite.models import specbench

    return specbench.read_prompts(specbench.SPEC_BENCH_DEV)


def _prompt(tok, rec: dict) -> Any:
    """Chat messages for a chat model; the question's first turn as raw text for one without a template."""
    return rec["prompt"] if getattr(tok, "chat_template", None) else rec["turns"][0]


def question_stream(tok, seed: int = 0, max_prompt_tokens: int = 384,
                    n: int | None = None) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, question ids): Spec-Bench dev's training questions, shuffled by `seed`, prompts longer
    than max_prompt_tokens dropped (kept whole: cutting a chat prompt would cut its template), first n."""
    from dvi_lite.core.generate import prompt_ids
    from dvi_lite.models.specbench import training_questions

    recs = list(training_questions(_records()))
    random.Random(seed).shuffle(recs)
    ids, qids = [], []
    for r in recs:
        x = prompt_ids(tok, _prompt(tok, r))
        if 0 < len(x) <= max_prompt_tokens:
            ids.append(x)
            qids.append(r["id"])
        if n is not None and len(ids) >= n:
            break
    if not ids:
        raise ValueError(f"no Spec-Bench training question fits max_prompt_tokens={max_prompt_tokens}")
    return ids, qids


def heldout_questions(tok, n: int) -> tuple[list[Any], list[str]]:
    """The first n bench questions (models.specbench.spread): unseen by the stream, measured greedy."""
    from dvi_lite.models.specbench import spread

    recs = spread(_records(), n)
    return [_prompt(tok, r) for r in recs], [r["id"] for r in recs]


def curve(records: list[dict], bins: int = 8) -> list[dict]:
    """The learning curve over the stream: mean acceptance / tau / top-1 agreement per bin of questions."""
    if not records:
        return []
    n_seq = max(r["sequences"] for r in records)
    out = []
    for b in range(bins):
        lo, hi = b * n_seq / bins, (b + 1) * n_seq / bins
        rs = [r for r in records if lo < r["sequences"] <= hi]
        if not rs:
            continue

        def mean(key: str, rs=rs) -> float | None:
            v = [r[key] for r in rs if r.get(key) is not None]
            return sum(v) / len(v) if v else None

        out.append({"questions": [int(lo) + 1, int(hi)], "fast_steps": [rs[0]["step"], rs[-1]["step"]],
                    "accept_rate": mean("accept_rate"), "tau": mean("tau"), "top1_agree": mean("top1_agree"),
                    "lambda": mean("lambda")})
    return out


def stream_result(card: dict, log: Path, bins: int = 10) -> dict:
    """A paper run's results entry: acceptance, τ and top-1 agreement over the online stream in `bins` bins of
    questions (serve.curve over the log's online records), the held-out bench after the warm start and at the end,
    the held-out agreement curve, and the card's provenance."""
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    online = [r for r in recs if r.get("phase") != "warm" and r.get("sequences")]  # warm steps carry a phase
    keep = ("split", "config", "recipe", "data", "fast_steps", "tokens_seen", "experiences", "tokens_generated",
            "final", "heldout_bench_warm", "heldout_bench", "wall_time_s", "curve")
    return {"what": "DVI as the paper trains it, with a long online phase: acceptance over the stream of questions "
                    "(each bin the mean over its fast updates) and the held-out bench before and after it",
            **{k: card.get(k) for k in keep}, "stream": curve(online, bins), "stream_questions": card.get("data", {})
            .get("online"), "provenance": card.get("provenance")}


def online_run(model, tok, cfg: DVIConfig, recipe: dict[str, Any], arm: str = "dvi", out: Path | None = None,
               ckpt_dir: Path | None = None, resume: bool = False, progress: bool = True) -> tuple[OnlineTrainer, dict]:
    """One online run over the stream's first recipe["sequences"] questions, then the held-out evaluation.

    Returns (trainer, summary): config, stream question ids, fast steps, wall time, the curve over the
    stream, the held-out tau / alpha of the final head. out: log.jsonl goes there. ckpt_dir: checkpoints
    every 10 fast steps; resume=True continues from one (same config, same stream).
    """
    stream, qids = question_stream(tok, cfg.seed, recipe["max_prompt_tokens"], recipe["sequences"])
    trainer = OnlineTrainer(model, stream, cfg, max_new_tokens=recipe["max_new_tokens"], K=recipe["K"],
                            eos_token_id=tok.eos_token_id, vocab=recipe["vocab"], progress=progress,
                            log_path=None if out is None else Path(out) / f"log_{arm}.jsonl",
                            ckpt_dir=ckpt_dir, ckpt_every=10 if ckpt_dir is not None else 0)
    if resume and ckpt_dir is not None and (Path(ckpt_dir) / "trainer.pt").is_file():
        trainer.load_checkpoint()
    elif trainer.log_path is not None and trainer.log_path.is_file():
        trainer.log_path.unlink()
    t0 = time.perf_counter()
    trainer.train(10**9, max_sequences=len(stream))
    records = ([json.loads(x) for x in trainer.log_path.read_text().splitlines()]
               if trainer.log_path is not None and trainer.log_path.is_file() else [])
    if ckpt_dir is not None:
        trainer.save_checkpoint()
    held, held_ids = heldout_questions(tok, recipe["eval_questions"])
    ev = evaluate(model, tok, held, trainer.policy, max_new_tokens=recipe["eval_tokens"], K=recipe["K"],
                  threshold=None, vocab=trainer.vocab)
    summary = {"arm": arm, "config": cfg.to_dict(), "stream_questions": qids[: trainer.prompt_idx],
               "fast_steps": trainer.fast_step, "experiences": trainer.buffer.n_seen,
               "tokens_generated": trainer.tokens_generated, "train_wall_s": trainer.elapsed,
               "run_wall_s": time.perf_counter() - t0, "curve": curve(records),
               "heldout": {**ev, "question_ids": held_ids, "max_new_tokens": recipe["eval_tokens"], "greedy": True,
                           "K": recipe["K"], "threshold": None}}
    return trainer, summary


def heldout_before(model, tok, cfg: DVIConfig, recipe: dict[str, Any]) -> dict:
    """The held-out evaluation of the untrained head (the early exit every arm starts from)."""
    from dvi_lite.methods.dvi.policy import DVIPolicy
    from dvi_lite.models.vocab import resolve_vocab

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        pol = DVIPolicy(model, cfg.split, cfg.lora_rank, cfg.lora_alpha)
    held, ids = heldout_questions(tok, recipe["eval_questions"])
    return {**evaluate(model, tok, held, pol, max_new_tokens=recipe["eval_tokens"], K=recipe["K"], threshold=None,
                       vocab=resolve_vocab(model, tok, recipe["vocab"])), "question_ids": ids}


def save_head(trainer: OnlineTrainer, summary: dict, out_dir: Path, command: str, recipe: dict[str, Any],
              model_name: str = "SmolLM2-135M-Instruct") -> dict:
    """out_dir/policy.pt (bf16) + card.json: data (the stream's question ids), steps, command, commit, device."""
    from dvi_lite.measure.provenance import device_name, provenance

    out_dir = Path(out_dir)
    f = trainer.save_policy(out_dir, dtype=torch.bfloat16)
    card = {"method": "dvi", "model": model_name,
            "split": trainer.cfg.split, "vocab": recipe["vocab"], "dtype_saved": "bfloat16",
            "data": {"stream": "Spec-Bench dev training questions (models.specbench.training_questions), "
                     f"chat-formatted, shuffled with seed {trainer.cfg.seed}, prompts <= "
                     f"{recipe['max_prompt_tokens']} tokens", "question_ids": summary["stream_questions"]},
            "fast_steps": trainer.fast_step, "experiences": trainer.buffer.n_seen,
            "tokens_generated": trainer.tokens_generated, "recipe": recipe, "config": trainer.cfg.to_dict(),
            "warm_start": "none: the exit head starts as the model's own early exit at layer k (zero-init LoRA)",
            "device": device_name(trainer.runner.device),
            "wall_time_s": summary["train_wall_s"], "heldout": summary["heldout"],
            "bytes": f.stat().st_size, "provenance": provenance(command, device=trainer.runner.device)}
    card.update(command=card["provenance"]["command"], commit=card["provenance"]["commit"])
    atomic_write_text(out_dir / "card.json", json.dumps(card, indent=2) + "\n")
    return card


def prepare_smollm2(model_path: str, out_dir: Path, command: str, smoke: bool = False) -> dict:
    """Regenerate the committed DVI head by the recipe: the "dvi" arm over the stream, saved (bf16) with a
    card to out_dir/dvi/ (out_dir: the artifacts folder, data/smollm2 for SmolLM2). smoke: a few tiny
    sequences (seconds; CI on the course model). Checkpoints under build/ckpt/, keyed by the model's fingerprint and
    the recipe (artifacts.ckpt_path): a killed run resumes where it stopped. Returns the card."""
    from dvi_lite.models.loading import bf16_is_fast, default_device, load_once, model_name

    recipe = {**RECIPE, **SMOKE} if smoke else dict(RECIPE)
    loaded, tok = load_once(model_path, "float32" if smoke or not bf16_is_fast(default_device()) else "bfloat16")
    model, tok = frozen_model(loaded, tokenizer=tok)
    n_layers = len(model.model.layers)
    split = min(recipe["split"], n_layers - 1)
    cfg = arm_config("dvi", split=split)
    ckpt = None if smoke else ckpt_path(f"dvi_online_k{split}", model, {"recipe": recipe, "config": cfg.to_dict()},
                                        suffix="")  # a killed run of this model and recipe resumes from here
    try:
        trainer, summary = online_run(model, tok, cfg, recipe, ckpt_dir=ckpt, resume=True, progress=not smoke)
    except ValueError as e:  # a checkpoint of another recipe: start fresh
        if "checkpoint" not in str(e):
            raise
        (ckpt / "trainer.pt").unlink()
        trainer, summary = online_run(model, tok, cfg, recipe, ckpt_dir=ckpt, progress=not smoke)
    return save_head(trainer, summary, Path(out_dir) / "dvi", command, recipe,
                     "SmolLM2-135M-Instruct" if model_name(model_path) == "smollm2" else model_name(model_path))
