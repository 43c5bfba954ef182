"""DVI as the paper trains it: a trainable draft head, a KL warm-start on the self-distillation set, then the
online reward phase on a stream of questions; its learning curve; and the ablation with seeds.

    PAPER / PaperRecipe  the config (head="trained": a trainable draft LM head over the trimmed map, initialised
                         from the target's rows, + lora_S on the exit block) and the run's sizes
    heldout              top-1 agreement with the target and KL(p_top-k || q) on held-out positions (the val split)
    train_paper          warm-start -> online, one fast-step counter t across both phases, so lambda_t =
                         max(kl_floor, exp(-t / T_λ)) decays through the warm-start (the lambda_t phase) and the
                         online phase runs at the floor (the reward phase). Milestones of tokens seen -> held-out
                         agreement + an fp16 snapshot under out_dir/curve/; max_minutes stops (checkpointed) and
                         the same call resumes; atomic checkpoints (checkpoint.py)
    (ablation.paper_ablation: DVI vs KL-only vs pure RL with this recipe, over seeds)

The warm-start's reward is the online one, computed offline: the draft's greedy token (argmax q on the map) is
"accepted" when it is the target's top-1 at that position (greedy verification accepts exactly then). The
teacher is the target's stored top-k (k = 32 on the set) on the map, renormalised; the online phase's teacher is
the verifier's full logits on the map. Both phases train the same parameters with the same losses.fast_loss.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dvi_lite.core.checks import RenamedFields, new_names
from dvi_lite.methods.dvi.checkpoint import _save, _write_text
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.learner import OnlineTrainer
from dvi_lite.methods.dvi.losses import fast_loss, kl_loss
from dvi_lite.methods.dvi.policy import TRAINER_FILE, DVIPolicy
from dvi_lite.models.teacher import TeacherData
from dvi_lite.models.vocab import TrimmedHead

# the paper's head on SmolLM2 (the three-seed ablation's exit layer 4; the committed head exits at cli.SMOLLM2_SPLIT;
# the committed 8192-token map): ~4.92M trainable values
# (head rows 8192 x 576 = 4.72M, lora_S at rank 32 = 203k, exit_norm, alpha) against the shared head's 51k
PAPER = DVIConfig(split=4, head="trained", head_lr_mult=0.1, lora_rank=32, lora_alpha=64.0, t_lambda=1000.0,
                  kl_floor=0.05, rl_variant="reinforce", ce_weight=0.2, lr=1e-3, fast_every=8, batch_size=64,
                  buffer_size=2048, seed=0)
MILESTONES = (100_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000)


@dataclass
class PaperRecipe(RenamedFields):
    renamed_fields = ("k",)  # PaperRecipe(k=...) fails: k is now K
    warm_tokens: int = 1_000_000  # positions of the set's train split in the KL warm-start (cycled if fewer)
    warm_batch: int = 256  # positions per warm-start step
    sequences: int = 36  # stream questions in the online reward phase
    max_new_tokens: int = 64  # new tokens per stream question
    K: int = 6  # draft tokens per step online
    vocab: int | None = 8192  # the trimmed map (this model's top-N); None = all V rows
    max_prompt_tokens: int = 384
    milestones: tuple[int, ...] = MILESTONES  # tokens seen at which the held-out agreement is measured
    val_max_tokens: int = 40_000  # held-out positions scored at each point
    eval_questions: int = 6  # held-out bench questions for tau / alpha at the end (0 = skip)
    eval_tokens: int = 48
    online_lr: float | None = None  # the online phase's learning rate (None: the config's lr, as in the warm start)
    max_minutes: float | None = None  # stop (checkpointed, resumable) once training took this long in all

    def check(self) -> PaperRecipe:
        for name in ("warm_tokens", "sequences", "eval_questions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("warm_batch", "max_new_tokens", "K", "val_max_tokens", "eval_tokens", "max_prompt_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.online_lr is not None and not (isinstance(self.online_lr, (int, float))
                                               and math.isfinite(self.online_lr) and self.online_lr > 0):
            raise ValueError(f"online_lr must be None or a finite number > 0, got {self.online_lr!r}")
        if self.max_minutes is not None and not (isinstance(self.max_minutes, (int, float))
                                                 and math.isfinite(self.max_minutes) and self.max_minutes >= 0):
            raise ValueError(f"max_minutes must be None or a finite number >= 0, got {self.max_minutes!r}")
        return self

    def recipe(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: everything but the time budget."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k != "max_minutes"}


class _OutOfTime(Exception):
    """Raised from the online phase's callback once the time budget is spent (the state is between updates)."""


# ---------------------------------------------------------------------------------------------- the set


def positions(data: TeacherData, max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (P,), cols (P,)) of the real positions, row-major; the first max_tokens of them when given."""
    r, c = data.mask.nonzero(as_tuple=True)
    return (r, c) if max_tokens is None else (r[:max_tokens], c[:max_tokens])


def _inverse(vocab: TrimmedHead | None, v: int) -> torch.Tensor | None:
    """full id -> map index (-1 off the map), (V,)."""
    if vocab is None:
        return None
    inv = torch.full((v,), -1, dtype=torch.long)
    inv[vocab.ids.cpu()] = torch.arange(len(vocab))
    return inv


def teacher_batch(data: TeacherData, split: int, rows: torch.Tensor, cols: torch.Tensor, vocab: TrimmedHead | None,
                  v: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The set's positions as a fast-update batch on the drafter's vocabulary.

    h (B, D) float32: the states after layer `split`; teacher_logits (B, N) (or (B, V)): the target's top-k
    log-probs on the map, -inf elsewhere (log_softmax renormalises them: KL to the top-k on the map);
    top1 (B,): the target's top-1 full id; keep (B,) bool: the position has some teacher mass on the map.
    """
    h = data.state(split)[rows, cols].float()  # (B, D)
    ids = data.top_ids[rows, cols].long()  # (B, K) full ids, best first
    logp = data.top_logp[rows, cols].float()  # (B, K)
    inv = _inverse(vocab, v)
    idx = ids if inv is None else inv[ids]  # (B, K) map index, -1 off the map
    valid = idx >= 0
    n = v if vocab is None else len(vocab)
    tl = torch.full((len(rows), n), float("-inf"))
    tl.scatter_reduce_(1, idx.clamp(min=0), torch.where(valid, logp, torch.full_like(logp, float("-inf"))),
                       reduce="amax")
    return {"h": h.to(device), "teacher_logits": tl.to(device), "top1": ids[:, 0].to(device),
            "keep": valid.any(1).to(device)}


def _drafted(vocab: TrimmedHead | None, idx: torch.Tensor) -> torch.Tensor:
    """Map indices (or full ids) of the argmax -> full token ids."""
    return idx if vocab is None else vocab.ids.to(idx.device)[idx]


@torch.no_grad()
def heldout(policy: DVIPolicy, vocab: TrimmedHead | None, data: TeacherData, split: int, max_tokens: int = 40_000,
            chunk: int = 1024) -> dict[str, float | int]:
    """Held-out agreement and KL of the draft head on the set's positions (the first max_tokens real ones).

    agree: P(argmax q == the target's top-1), over every position (a top-1 off the map counts as a miss);
    kl: mean KL(p_top-k on the map, renormalised || q) over the positions with teacher mass on the map.
    """
    rows, cols = positions(data, max_tokens)
    v = _vocab_size(policy)
    hits, kl_sum, kl_n = 0, 0.0, 0
    was = policy.training
    policy.eval()
    dev = policy.exit_norm.weight.device
    for i in range(0, len(rows), chunk):
        b = teacher_batch(data, split, rows[i:i + chunk], cols[i:i + chunk], vocab, v, dev)
        s = policy.logits(b["h"], vocab)  # (B, N)
        hits += int((_drafted(vocab, s.argmax(-1)) == b["top1"]).sum())
        k = b["keep"]
        if k.any():
            kl_sum += float(kl_loss(b["teacher_logits"][k], s[k])) * int(k.sum())
            kl_n += int(k.sum())
    policy.train(was)
    return {"agree": hits / max(1, len(rows)), "kl": kl_sum / max(1, kl_n), "positions": int(len(rows))}


def _vocab_size(policy: DVIPolicy) -> int:
    from dvi_lite.methods.dvi.policy import _base

    return _base(policy.lm_head).weight.shape[0]


def warm_step(tr: OnlineTrainer, b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One fast update on a batch of the set (teacher_batch), with the trainer's loss, schedule and optimiser.

    The drafted token is the current head's argmax (on-policy, greedy like online drafting) and its reward is
    1 when it is the target's top-1. The step counts in tr.fast_step, so lambda_t decays through the warm-start.
    """
    c, t = tr.cfg, tr.fast_step
    k = b["keep"]
    h, tl, top1 = b["h"][k], b["teacher_logits"][k], b["top1"][k]  # (B', D), (B', N), (B',)
    lr = tr.lr(t)
    tr.set_lr(lr)
    tr.policy.train()
    s = tr.draft_logits(h)  # (B', N) float32, with grad
    tokens = s.detach().argmax(-1)  # (B',) map indices: the greedy draft
    rewards = (_drafted(tr.vocab, tokens) == top1).float()  # (B',) the greedy accept bit
    loss, parts = fast_loss({"student_logits": s, "teacher_logits": tl, "tokens": tokens, "rewards": rewards},
                            c, t, tr.baseline)
    tr.policy.eval()
    gnorm = tr.apply_fast(loss, parts, "warm-start")
    tr.baseline.update(rewards.cpu())
    tr.fast_step += 1
    rec = {"step": tr.fast_step, "phase": "warm", "lambda": parts["lambda"], "lr": lr, "loss": parts["total"],
           "l_rl": parts["l_rl"], "l_kl": parts["l_kl"], "l_ce": parts["l_ce"], "baseline": tr.baseline.value,
           "grad_norm": gnorm, "positions": int(k.sum()), "top1_agree": float(rewards.mean()) if len(rewards) else None}
    tr._log(rec)
    return rec


# ---------------------------------------------------------------------------------------------- the run


def snapshot(policy: DVIPolicy, path: Path) -> None:
    """The head's trainable state in fp16 (a learning-curve point), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    st = policy.trainable_state()
    st = {k: ({n: x.half() for n, x in v.items()} if isinstance(v, dict) else v.half()) for k, v in st.items()}
    _save({"split": policy.split, "head": policy.head, "head_ids": policy.head_ids, "policy": st}, path)


def make_trainer(model, tok, cfg: DVIConfig, recipe: PaperRecipe, out_dir: Path, ckpt_dir: Path,
                 progress: bool = False) -> OnlineTrainer:
    """The online trainer over the question stream (seeded by cfg.seed), logging to out_dir/log.jsonl."""
    from dvi_lite.methods.dvi.serve import question_stream

    stream, _ = question_stream(tok, cfg.seed, recipe.max_prompt_tokens, max(1, recipe.sequences))
    return OnlineTrainer(model, stream, cfg, max_new_tokens=recipe.max_new_tokens, K=recipe.K,
                         eos_token_id=tok.eos_token_id, vocab=recipe.vocab, progress=progress,
                         log_path=out_dir / "log.jsonl", ckpt_dir=ckpt_dir)


def train_paper(model, tok, train: TeacherData, val: TeacherData, cfg: DVIConfig = PAPER,
                recipe: PaperRecipe | None = None, out_dir: str | Path = "build/dvi_paper",
                ckpt_dir: str | Path | None = None, resume: bool = True, command: str = "",
                progress: bool = False) -> dict[str, Any]:
    """KL warm-start on `train` (the set's train split), then the online reward phase; returns the card.

    Writes out_dir/policy.pt (float32, what method="dvi" loads), card.json, log.jsonl, curve/tokens_<n>.pt.
    Checkpoints go to ckpt_dir (default out_dir/ckpt) at every curve point and at a stop; resume=True continues
    a run of the same config and recipe (the time budget aside). A run stopped by recipe.max_minutes returns
    {"stopped": True, ...}: call again to go on. The curve's "tokens" are positions of the set seen in the
    warm-start plus experiences (tested drafts) seen online.
    """
    from dvi_lite.measure.provenance import provenance

    recipe = (recipe or PaperRecipe()).check()
    out_dir = Path(out_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else out_dir / "ckpt"
    out_dir.mkdir(parents=True, exist_ok=True)
    tr = make_trainer(model, tok, cfg, recipe, out_dir, ckpt_dir, progress)
    split = tr.cfg.split
    base_lr = tr.cfg.lr
    if resume and (ckpt_dir / TRAINER_FILE).is_file():
        try:
            tr.load_checkpoint()
        except ValueError:  # saved in (or after) the online phase, at the online learning rate: load it at that rate
            if recipe.online_lr is None:
                raise
            tr.cfg = dataclasses.replace(tr.cfg, lr=recipe.online_lr)
            tr.load_checkpoint()
        if new_names(tr.meta.get("paper", {}).get("recipe") or {}) != recipe.recipe():  # k: a pre-rename one
            raise ValueError(f"DVI checkpoint in {ckpt_dir} is of another recipe (now, saved): "
                             f"{recipe.recipe()}, {tr.meta.get('paper', {}).get('recipe')}")
    else:
        if tr.log_path.is_file():
            tr.log_path.unlink()
        tr.meta["paper"] = {"recipe": recipe.recipe(), "phase": "warm", "warm_step": 0, "seen": 0, "elapsed": 0.0,
                            "curve": [{"tokens": 0, "step": 0, "phase": "start",
                                       **heldout(tr.policy, tr.vocab, val, split, recipe.val_max_tokens)}]}
    st = tr.meta["paper"]
    t0 = time.time() - st["elapsed"]

    def out_of_time() -> bool:
        return recipe.max_minutes is not None and time.time() - t0 >= 60 * recipe.max_minutes

    def point(phase: str) -> None:
        st["curve"].append({"tokens": st["seen"], "step": tr.fast_step, "phase": phase,
                            **heldout(tr.policy, tr.vocab, val, split, recipe.val_max_tokens)})
        snapshot(tr.policy, out_dir / "curve" / f"tokens_{st['seen']}.pt")

    def checkpoint() -> None:
        st["elapsed"] = time.time() - t0
        tr.save_checkpoint()

    def stopped() -> dict[str, Any]:
        checkpoint()
        print(f"stopped after {recipe.max_minutes} min at fast step {tr.fast_step} ({st['seen']} tokens seen, "
              f"{st['phase']} phase): run the same command again to resume")
        return {"stopped": True, "phase": st["phase"], "fast_step": tr.fast_step, "tokens_seen": st["seen"],
                "curve": st["curve"], "wall_time_s": round(st["elapsed"], 1)}

    # the KL warm-start (lambda_t phase) on the set's positions, in a seeded order (cycled when too few)
    n_warm = math.ceil(recipe.warm_tokens / recipe.warm_batch) if recipe.warm_tokens else 0
    if st["phase"] == "warm" and n_warm:
        rows, cols = positions(train)
        gen = torch.Generator().manual_seed(tr.cfg.seed)
        reps = n_warm * recipe.warm_batch // len(rows) + 1
        order = torch.cat([torch.randperm(len(rows), generator=gen) for _ in range(reps)])  # (>= n_warm * B,)
        v, dev = _vocab_size(tr.policy), tr.runner.device
        while st["warm_step"] < n_warm:
            i = st["warm_step"]
            pick = order[i * recipe.warm_batch:(i + 1) * recipe.warm_batch]
            warm_step(tr, teacher_batch(train, split, rows[pick], cols[pick], tr.vocab, v, dev))
            st["warm_step"] += 1
            st["seen"] += len(pick)
            passed = [m for m in recipe.milestones
                      if st["seen"] >= m and all(p["tokens"] < m for p in st["curve"][1:])]
            last = st["warm_step"] == n_warm
            if passed or last:
                point("warm")
            if passed or last or out_of_time():
                if not last and out_of_time():
                    return stopped()
                checkpoint()
    if st["phase"] == "warm":
        st["bench_warm"] = heldout_bench(tr, tok, recipe)  # what decoding gets from the warm start alone
        st["phase"] = "online"
        checkpoint()

    # the online reward phase over the question stream
    warm_cfg = dataclasses.replace(tr.cfg, lr=base_lr)
    if st["phase"] == "online" and recipe.online_lr is not None:  # (re-applied on a resume: the config is not saved)
        tr.cfg = dataclasses.replace(tr.cfg, lr=recipe.online_lr)
    if st["phase"] == "online" and recipe.sequences:
        base_seen = st.setdefault("warm_seen", st["seen"])

        def tick(_rec: dict) -> None:
            st["seen"] = base_seen + tr.buffer.n_seen
            if out_of_time():
                raise _OutOfTime

        try:
            tr.train(10**9, callback=tick, max_sequences=recipe.sequences)
        except _OutOfTime:
            if tr.prompt_idx < recipe.sequences or tr.unconsumed >= tr.cfg.fast_every:
                return stopped()
        st["seen"] = base_seen + tr.buffer.n_seen
        point("online")
    st["phase"] = "done"
    checkpoint()
    tr.cfg = warm_cfg  # the card's config is the run's; recipe.online_lr says what the online phase used
    return finish(tr, tok, train, val, recipe, out_dir, command or None, provenance)


HARD_TARGETS = "hard labels: the record's own next tokens (p = 1), as the target sampled them"


def heldout_bench(tr: OnlineTrainer, tok, recipe: PaperRecipe) -> dict[str, Any] | None:
    """tau / alpha of the current head, decoding the held-out bench questions greedily (None: eval_questions=0)."""
    from dvi_lite.methods.dvi.drafter import evaluate
    from dvi_lite.methods.dvi.serve import heldout_questions

    if not recipe.eval_questions:
        return None
    held, ids = heldout_questions(tok, recipe.eval_questions)
    return {**evaluate(tr.model, tok, held, tr.policy, max_new_tokens=recipe.eval_tokens, K=recipe.K, threshold=None),
            "question_ids": ids, "greedy": True}


def finish(tr: OnlineTrainer, tok, train: TeacherData, val: TeacherData, recipe: PaperRecipe, out_dir: Path,
           command: str | None, provenance) -> dict[str, Any]:
    """policy.pt (float32) + card.json: capacity, data, the curve, the held-out bench tau / alpha after the warm
    start and at the end, provenance."""
    st = tr.meta["paper"]
    f = tr.save_policy(out_dir)
    bench = heldout_bench(tr, tok, recipe)
    prov = provenance(command, device=tr.runner.device)
    card = {"method": "dvi", "what": "DVI as the paper trains it: trainable draft LM head (target rows) + lora_S, "
            "KL warm-start on the self-distillation set (lambda_t phase), then the online reward phase",
            "split": tr.cfg.split, "config": tr.cfg.to_dict(), "recipe": recipe.recipe(),
            "capacity": capacity(tr.policy),
            "data": {"warm": {**{k: train.card.get(k) for k in ("source", "split", "n_rows", "n_tokens")},
                              "targets": train.card.get("targets", HARD_TARGETS)},
                     "val": {k: val.card.get(k) for k in ("source", "split", "n_rows", "n_tokens")},
                     "online": "Spec-Bench dev training questions (serve.question_stream), seed "
                               f"{tr.cfg.seed}, first {tr.prompt_idx}"},
            "fast_steps": tr.fast_step, "warm_steps": st["warm_step"], "tokens_seen": st["seen"],
            "warm_positions": st.get("warm_seen", st["seen"]), "experiences": tr.buffer.n_seen,
            "tokens_generated": tr.tokens_generated, "curve": st["curve"], "final": st["curve"][-1],
            "heldout_bench_warm": st.get("bench_warm"), "heldout_bench": bench,
            "wall_time_s": round(st["elapsed"], 1), "bytes": f.stat().st_size,
            "command": prov["command"], "commit": prov["commit"], "provenance": prov}
    _write_text(out_dir / "card.json", json.dumps(card, indent=2) + "\n")
    return card


def capacity(policy: DVIPolicy) -> dict[str, int]:
    """Trainable values of the head by part: lora_S, the trained head's rows, the rest (exit_norm, alpha)."""
    named = policy.named_trainable()
    lora = sum(p.numel() for n, p in named.items() if "lora_" in n)
    head = sum(p.numel() for n, p in named.items() if n in ("head_weight", "head_bias"))
    total = sum(p.numel() for p in named.values())
    return {"trainable": total, "lora_S": lora, "head_rows": head, "other": total - lora - head,
            "extra_params": policy.extra_params()}
