"""`python -m dvi_lite dvi`: online DVI training on corpus prompts or a question stream (also the GPU entry point).

    python -m dvi_lite dvi --steps 300                       # the course model, on the CPU
    python -m dvi_lite dvi --model smollm2 --dtype bfloat16 --prompts specbench --vocab 8192 --split 5 \
        --steps 100 --save-dtype bfloat16                    # SmolLM2: chat-formatted Spec-Bench dev questions
    python -m dvi_lite dvi --steps 2000 --device cuda --dtype bfloat16 --model <folder> --out <dir>

--prompts specbench streams Spec-Bench dev's training questions (serve.question_stream: never the bench's
own), chat-formatted; the held-out evaluation then uses the bench's first questions. The ablation and the
committed SmolLM2 head's recipe are in serve.py / ablation.py.

It writes policy.pt (what method="dvi" loads), card.json (config, before/after evaluation,
provenance) and log.jsonl (one record per fast step), and checkpoints for --resume.
`python -m dvi_lite.methods.dvi.cli` runs the same main().

DVI as the paper trains it (paper.py): --data FOLDER (a self-distillation set, `python -m dvi_lite distill-data`)
switches to a trainable draft LM head over the trimmed map (--head trained), a KL warm-start on the set's train
split (--warm-start-tokens positions, lambda_t decaying with --t-lambda, T_λ, by default a third of the
warm-start's steps), then the online reward phase over --sequences Spec-Bench training questions; held-out agreement
on the val split at milestones of tokens seen; --max-minutes stops resumably (the same command continues).
--ablation runs the --arms (our variant "dvi", the reference trainers' default "reference", KL-only "kl", pure RL
"rl") for every --seeds and writes --json:

    python -m dvi_lite dvi --model smollm2 --data build/distill/<fingerprint> --split 2 --vocab 8192 \
        --warm-start-tokens 1000000 --sequences 36 --max-minutes 60 --out build/dvi_paper/smollm2
    python -m dvi_lite dvi --model smollm2 --data data/smollm2/distill --ablation --seeds 0,1,2 \
        --arms dvi,kl,rl,reference --warm-start-tokens 100000 --sequences 12 --soft-top-k 32 --online-lr 1e-4 \
        --json results/41_dvi_ablation.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import torch

from dvi_lite.commands import add_force, command_line, require_positive, run_or_usage_error, seed_list
from dvi_lite.core.checks import add_renamed_flags
from dvi_lite.core.runner import Runner
from dvi_lite.methods.dvi.ablation import paper_ablation
from dvi_lite.methods.dvi.config import HEADS, RL_VARIANTS, DVIConfig
from dvi_lite.methods.dvi.drafter import evaluate
from dvi_lite.methods.dvi.learner import OnlineTrainer
from dvi_lite.methods.dvi.paper import HARD_TARGETS, PAPER, PaperRecipe, train_paper
from dvi_lite.methods.dvi.policy import TRAINER_FILE
from dvi_lite.models.artifacts import artifacts_dir, ckpt_path, save_piece
from dvi_lite.paths import atomic_write_text
from dvi_lite.safety import check_output, load_torch

PROG = "python -m dvi_lite dvi"


def train_prompts(tok, path: str | Path | None = None, n_per_domain: int = 400, seed: int = 0,
                  max_len: int = 192) -> list[list[int]]:
    """Prompt ids for training: a JSONL file (field 'prompt') or the corpus' train split (never the
    held-out test prompts), each cut to its last max_len tokens, shuffled with `seed`."""
    from dvi_lite.models.corpus import load_prompts, make_prompts

    recs = load_prompts(path) if path else make_prompts(n_per_domain, seed, split="train")
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"][-max_len:] for r in recs]
    ids = [x for x in ids if x]
    random.Random(seed).shuffle(ids)
    if not ids:
        raise ValueError("no training prompts")
    return ids


def int_at_least(lo: int):
    """argparse type: an int >= lo (argparse's one-line error names the flag)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}")
        return v
    return parse


def minutes(text: str) -> float:
    """argparse type: a finite number of minutes >= 0 (0 = one step, then stop: a resumable slice)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of minutes >= 0, got {text!r}")
    return v


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Online DVI training (Draft -> Verify -> Improve) on "
                                 "corpus prompts.")
    ap.add_argument("--steps", type=int, default=300, help="fast updates to run (in total, counting a resumed run's)")
    ap.add_argument("--split", type=int, default=None, help="exit layer k (default: the model's default exit layer)")
    ap.add_argument("--out", default=None, help="policy.pt, card.json, log.jsonl go here (default: the model's "
                    "pieces folder, artifacts_dir(model)/dvi)")
    ap.add_argument("--ckpt-dir", default=None, help="resume checkpoint dir (default: under build/ckpt/)")
    add_force(ap)
    ap.add_argument("--ckpt-every", type=int, default=25, help="fast steps between checkpoints")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--model", default=None, help="local HF checkpoint (default: the course model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--prompts", default=None, help="JSONL prompts (field 'prompt'), or 'specbench' (Spec-Bench dev "
                    "training questions, chat-formatted for a chat model); default: corpus train split")
    ap.add_argument("--vocab", default=None, help="trimmed draft head: N (this model's top-N map), a map file "
                    "or 'full' (the default: the full vocabulary)")
    ap.add_argument("--save-dtype", default=None, choices=["bfloat16", "float16"],
                    help="store policy.pt in half precision (default: float32, as trained)")
    ap.add_argument("--head-rank", type=int, default=None,
                    help="with --save-dtype: store a trained head as the target's rows + a rank-r change (SVD of what "
                    "training moved) instead of all its rows (default: all rows)")
    ap.add_argument("--prompts-per-domain", type=int, default=400)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--K", type=int, default=6, help="draft tokens per step")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--slow", action="store_true",
                    help="enable slow updates of lora_D (lossless w.r.t. the UPDATED verifier)")
    ap.add_argument("--rl", default=DVIConfig.rl_variant, choices=list(RL_VARIANTS))
    ap.add_argument("--t-lambda", type=float, default=None, help="T_λ, lambda's time constant (default: steps / 5)")
    ap.add_argument("--kl-floor", type=float, default=DVIConfig.kl_floor)
    ap.add_argument("--lr", type=float, default=DVIConfig.lr)
    ap.add_argument("--lora-rank", type=int_at_least(1), default=None,
                    help=f"rank of lora_S (default {DVIConfig.lora_rank}; {PAPER.lora_rank} with --data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=16,
                    help="held-out prompts for tau/alpha before and after (0 = skip)")
    paper_args = ap.add_argument_group("DVI as the paper trains it (--data)")
    paper_args.add_argument("--data", default=None, help="a self-distillation set folder (python -m dvi_lite "
                            "distill-data): KL warm-start on its train split, held-out agreement on its val split")
    paper_args.add_argument("--head", default=None, choices=list(HEADS),
                            help="draft LM head: the model's, frozen ('shared', the default without --data) or a "
                            "trainable copy of its rows over the map ('trained', the default with --data)")
    paper_args.add_argument("--warm-start-tokens", type=int_at_least(0), default=PaperRecipe.warm_tokens,
                            help="positions of the set in the KL warm-start (default %(default)s)")
    paper_args.add_argument("--soft-top-k", type=int_at_least(1), default=None,
                            help="warm-start on the target's own top-k log-probs (a teacher forward over the set) "
                            "instead of a token record's hard labels")
    paper_args.add_argument("--warm-batch", type=int_at_least(1), default=PaperRecipe.warm_batch,
                            help="positions per warm-start step")
    paper_args.add_argument("--sequences", type=int_at_least(0), default=PaperRecipe.sequences,
                            help="stream questions in the online reward phase (Spec-Bench dev training questions)")
    paper_args.add_argument("--online-lr", type=float, default=None,
                            help="the online phase's learning rate (default: --lr, as in the warm start)")
    paper_args.add_argument("--val-max-tokens", type=int_at_least(1), default=PaperRecipe.val_max_tokens,
                            help="held-out positions scored at each curve point")
    paper_args.add_argument("--max-minutes", type=minutes, default=None,
                            help="stop (checkpointed) after this much training; the same command resumes")
    paper_args.add_argument("--ablation", action="store_true",
                            help="DVI vs KL-only vs pure RL at equal tokens, for every --seeds (needs --data)")
    paper_args.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="ablation seeds (default 0,1,2)")
    paper_args.add_argument("--arms", default="dvi,kl,rl,reference",
                            help="ablation arms (comma-separated, among dvi, kl, rl, reference)")
    paper_args.add_argument("--json", default=None, help="a results file (e.g. results/...json): the ablation's, or "
                            "a single run's stream (acceptance over the online questions, the held-out bench)")
    add_renamed_flags(ap, "k", "tau")  # --k, --tau: an error naming --K, --t-lambda
    return ap


def main(argv: list[str] | None = None) -> int:
    """Train, save policy.pt + card.json + log.jsonl; a bad flag or input ends in a usage error."""
    ap = parser()
    args = ap.parse_args(argv)
    require_positive(ap, args, "steps")
    if args.head_rank is not None and (args.head_rank < 1 or not args.save_dtype):
        ap.error(f"--head-rank must be an int >= 1 and goes with --save-dtype, got {args.head_rank}")
    if args.data is None:
        for flag, bad in (("--ablation", args.ablation), ("--max-minutes", args.max_minutes is not None)):
            if bad:
                ap.error(f"{flag} needs --data FOLDER (a self-distillation set)")
        run_or_usage_error(ap, train, args, command_line("dvi_lite dvi", argv))
        return 0
    if args.slow or args.resume:
        ap.error("--data runs resume by themselves and have no slow updates: drop --slow / --resume")
    run_or_usage_error(ap, train_on_set, args, command_line("dvi_lite dvi", argv))
    return 0


def train_on_set(args: argparse.Namespace, command: str, loaded=None) -> dict:
    """--data: the paper's recipe (paper.train_paper), or with --ablation its three arms over --seeds. loaded: a
    models.loading.Loaded handed down by `prepare` (else args.model is loaded here)."""
    from dvi_lite.models.distill_reader import load_distill
    from dvi_lite.models.loading import bf16_is_fast, load_once

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if bf16_is_fast(device) else "float32")  # fp32 where bf16 GEMMs are slow
    model, tok = load_once(loaded if loaded is not None else args.model, dtype=dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    n_layers = Runner.for_model(model).n_layers
    split = args.split if args.split is not None else min(PAPER.split, n_layers - 1)
    rank = args.lora_rank or PAPER.lora_rank
    n_warm = -(-args.warm_start_tokens // args.warm_batch)
    cfg = dataclasses.replace(PAPER, split=split, head=args.head or "trained", lora_rank=rank,
                              lora_alpha=2.0 * rank, lr=args.lr, rl_variant=args.rl, kl_floor=args.kl_floor,
                              t_lambda=args.t_lambda if args.t_lambda is not None else max(1.0, n_warm / 3),
                              seed=args.seed)
    cfg = cfg.for_layers(n_layers)
    vocab = (PaperRecipe.vocab if args.vocab is None else None if args.vocab == "full"
             else int(args.vocab) if args.vocab.isdigit() else args.vocab)
    recipe = PaperRecipe(warm_tokens=args.warm_start_tokens, warm_batch=args.warm_batch, sequences=args.sequences,
                         max_new_tokens=args.max_new_tokens, K=args.K, vocab=vocab,
                         max_prompt_tokens=args.max_prompt_tokens, val_max_tokens=args.val_max_tokens,
                         eval_questions=args.eval_prompts, online_lr=args.online_lr,
                         max_minutes=args.max_minutes).check()
    from dvi_lite.models.artifacts import fingerprint
    from dvi_lite.paths import BUILD_DIR
    from dvi_lite.safety import check_output

    out = Path(args.out) if args.out else BUILD_DIR / "dvi_paper" / fingerprint(model)
    force = getattr(args, "force", False)
    check_output(out, kind="dir", force=force)  # before any work: a bad place, or a committed file without --force
    check_output(args.json, kind="file", force=force, flag="--json")
    check_output(args.ckpt_dir, kind="dir", force=force, flag="--ckpt-dir")
    # soft targets cost a full forward per position: then read only the positions the warm start uses
    budget = {"max_tokens": args.warm_start_tokens} if args.soft_top_k else {}
    train_set = load_distill(model, args.data, "train", layers=(split,), **budget)
    val_set = load_distill(model, args.data, "val", layers=(split,), corpus=False,
                           **({"max_tokens": args.val_max_tokens} if args.soft_top_k else {}))
    if args.soft_top_k:  # the target's soft top-k in place of the record's hard labels (a state set has them)
        from dvi_lite.models.teacher import soft_targets

        train_set, val_set = (soft_targets(model, d, args.soft_top_k) for d in (train_set, val_set))
    if args.ablation:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        res = paper_ablation(model, tok, train_set, val_set, cfg, recipe, arms, args.seeds, out / "ablation", command)
        res["warm_targets"] = train_set.card.get("targets", HARD_TARGETS)
        if args.json:
            from dvi_lite.measure.provenance import results_json

            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(args.json), results_json(res))
        print(json.dumps({"ranking": res["ranking"], "separated": res["separated"],
                          "summary": {a: s[recipe_metric(res)]["mean"] for a, s in res["summary"].items()}}))
        return res
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else ckpt_path(  # under build/, never beside a committed piece
        "dvi_paper", model, {"cfg": cfg.to_dict(), "recipe": dataclasses.asdict(recipe), "out": str(out.resolve())},
        suffix="")
    card = train_paper(model, tok, train_set, val_set, cfg, recipe, out, ckpt, resume=True, command=command,
                       progress=True)
    if args.save_dtype and not card.get("stopped"):  # the committed form: the head's tensors in half precision
        from dvi_lite.methods.dvi.policy import POLICY_FILE

        b = load_torch(out / POLICY_FILE, "DVI policy", keys=("policy",))
        if args.head_rank is not None and "head_weight" in b["policy"]:  # rows -> the target's + a low-rank change
            from dvi_lite.methods.dvi.policy import _read_policy

            b["policy"]["head_delta"] = _read_policy(model, out / POLICY_FILE, False).head_delta(args.head_rank)
            del b["policy"]["head_weight"]
        half = getattr(torch, args.save_dtype)
        b["policy"] = {k: ({n: t.to(half) for n, t in v.items()} if isinstance(v, dict) else v.to(half))
                       for k, v in b["policy"].items()}
        save_piece(b, out / POLICY_FILE)
        card = stored_form(out, args.save_dtype, args.head_rank)
    if args.json and not card.get("stopped"):
        from dvi_lite.measure.provenance import results_json
        from dvi_lite.methods.dvi.serve import stream_result

        atomic_write_text(Path(args.json), results_json(stream_result(card, out / "log.jsonl")))
        print(f"wrote {args.json}")
    print(json.dumps({k: card.get(k) for k in ("stopped", "fast_steps", "tokens_seen", "final", "wall_time_s")}))
    return card


def stored_form(out: Path, dtype: str, head_rank: int | None) -> dict:
    """The card says what the committed file holds: its bytes, dtype and (a compact head) the rank of the change."""
    from dvi_lite.methods.dvi.checkpoint import _write_text
    from dvi_lite.methods.dvi.policy import POLICY_FILE

    card = json.loads((out / "card.json").read_text())
    card["bytes"] = (out / POLICY_FILE).stat().st_size
    card["stored"] = {"dtype": dtype, "head": "the target's rows + a rank-r change (U V)" if head_rank else "rows",
                      "head_rank": head_rank}
    _write_text(out / "card.json", json.dumps(card, indent=2) + "\n")
    return card


# SmolLM2's committed head: the exit Kangaroo's adapter uses (the exit sweep's first, results/15_kangaroo_smollm2.json:
# the cheapest draft, at an acceptance level with the deeper exits'); the online phase at a tenth of the warm start's
# lr (at the warm start's own lr the online phase undid what the warm start taught, on held-out questions); and the
# trained rows stored as the target's + a rank-64 change (what fits the tracked tree's budget)
SMOLLM2_SPLIT = 2
SMOLLM2_ONLINE_LR = 1e-4
SMOLLM2_HEAD_RANK = 64


def prepare_smollm2(model_path, out_dir: Path, command: str, smoke: bool = False, data: str | Path | None = None,
                    max_minutes: float | None = None) -> dict:
    """`prepare`'s recipe for the DVI head: with a self-distillation set, the paper's (KL warm-start on the set, then
    the online phase; `train_on_set`), saved in bf16 to out_dir/dvi; without one, the online arm (serve's recipe).
    model_path: a name, a folder, or the models.loading.Loaded that `prepare` hands down."""
    from dvi_lite.methods.dvi import serve

    if data is None:
        return serve.prepare_smollm2(model_path, out_dir, command, smoke)
    from dvi_lite.paths import BUILD_DIR

    argv = ["--data", str(data), "--split", str(SMOLLM2_SPLIT), "--out", str(Path(out_dir) / "dvi"),
            "--save-dtype", "bfloat16", "--ckpt-dir", str(BUILD_DIR / "ckpt" / "dvi_paper_smollm2"),
            "--online-lr", str(SMOLLM2_ONLINE_LR), "--head-rank", str(SMOLLM2_HEAD_RANK),
            "--force"]  # prepare decided: it runs only when asked to
    argv += ["--max-minutes", str(max_minutes)] if max_minutes is not None else []
    argv += ["--warm-start-tokens", "256", "--sequences", "2", "--max-new-tokens", "8", "--eval-prompts", "0"] \
        if smoke else []
    return train_on_set(parser().parse_args(argv), command, loaded=model_path)


def recipe_metric(res: dict) -> str:
    return res.get("metric", "agree")


def train(args: argparse.Namespace, command: str) -> dict:
    """The run main() describes: returns the card it writes to <out>/card.json."""
    from dvi_lite.measure.provenance import provenance
    from dvi_lite.models.corpus import load_prompts
    from dvi_lite.models.loading import load_model

    cfg = DVIConfig(split=args.split, rl_variant=args.rl, kl_floor=args.kl_floor, lr=args.lr,
                    t_lambda=args.t_lambda if args.t_lambda is not None else max(1.0, args.steps / 5),
                    lora_rank=args.lora_rank or DVIConfig.lora_rank, seed=args.seed, head=args.head or "shared")
    torch.manual_seed(cfg.seed)  # every RNG a checkpoint saves is seeded: two runs save equal states
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    for p in model.parameters():
        p.requires_grad_(False)
    runner = Runner.for_model(model)
    cfg = cfg.for_layers(runner.n_layers)
    specbench = args.prompts == "specbench"
    if specbench:
        from dvi_lite.methods.dvi.serve import heldout_questions, question_stream

        prompts, _ = question_stream(tok, cfg.seed, args.max_prompt_tokens)
    else:
        prompts = train_prompts(tok, args.prompts, args.prompts_per_domain, cfg.seed, args.max_prompt_tokens)
    vocab = None if args.vocab in (None, "full") else int(args.vocab) if args.vocab.isdigit() else args.vocab
    out = Path(args.out) if args.out else artifacts_dir(model) / "dvi"
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else ckpt_path(f"dvi_k{cfg.split}", model, cfg.to_dict(), suffix="")
    check_output(out, kind="dir", force=args.force)  # before any forward: a committed policy needs --force
    check_output(ckpt, kind="dir", force=args.force, flag="--ckpt-dir")
    trainer = OnlineTrainer(model, prompts, cfg, slow_updates=args.slow, max_new_tokens=args.max_new_tokens,
                            K=args.K, temperature=args.temperature, total_steps=args.steps,
                            eos_token_id=tok.eos_token_id, log_path=out / "log.jsonl", ckpt_dir=ckpt,
                            ckpt_every=args.ckpt_every, vocab=vocab)
    if args.resume and (ckpt / TRAINER_FILE).is_file():
        trainer.load_checkpoint()
    elif trainer.log_path.is_file():
        trainer.log_path.unlink()  # a fresh run starts a fresh log
    if not args.eval_prompts:
        held = []
    elif specbench:
        held = heldout_questions(tok, args.eval_prompts)[0]
    else:
        held = [r["prompt"] for r in load_prompts(n=args.eval_prompts)]
    ev = dict(max_new_tokens=args.max_new_tokens, K=args.K, threshold=None, vocab=trainer.vocab)
    if held and "eval_before" not in trainer.meta:
        trainer.meta["eval_before"] = evaluate(model, tok, held, trainer.policy, **ev)
    trainer.train(max(0, args.steps - trainer.fast_step))
    trainer.save_checkpoint()
    trainer.save_policy(out, dtype=getattr(torch, args.save_dtype) if args.save_dtype else None)
    after = evaluate(model, tok, held, trainer.policy, **ev) if held else None
    log = [json.loads(x) for x in trainer.log_path.read_text().splitlines()] if trainer.log_path.is_file() else []
    card = {"method": "dvi", "split": cfg.split, "fast_steps": trainer.fast_step, "slow_steps": trainer.slow_step,
            "slow_updates": trainer.slow_updates, "sequences": trainer.prompt_idx,
            "tokens_generated": trainer.tokens_generated, "experiences": trainer.buffer.n_seen,
            "trainable_params": sum(p.numel() for p in trainer.policy.trainable()),
            "eval_before": trainer.meta.get("eval_before"), "eval_after": after, "eval_prompts": len(held),
            "wall_time_s": trainer.elapsed, "config": cfg.to_dict(),
            "run": {"max_new_tokens": args.max_new_tokens, "K": args.K,
                    "temperature": args.temperature, "dtype": str(next(model.parameters()).dtype),
                    "model": args.model or "course model", "prompts": args.prompts or "corpus train split",
                    "vocab": args.vocab},
            "provenance": provenance(command, device=runner.device),
            "log": log[:: max(1, len(log) // 100)]}
    atomic_write_text(out / "card.json", json.dumps(card, indent=2) + "\n")
    print(json.dumps({k: card[k] for k in ("split", "fast_steps", "eval_before", "eval_after", "wall_time_s")}))
    return card


if __name__ == "__main__":
    raise SystemExit(main())
