"""The online DVI learner: decode -> replay buffer -> fast (and slow) updates, on a stream of prompts.

Every draft token the verifier tests becomes an experience (h_k, token, reward r = accepted, the
verifier's logits) in a ReplayBuffer, and every `fast_every` new experiences a *fast update* trains
the draft head with losses.fast_loss (KL warm-up -> RL, lambda_t). Optional *slow updates* keep a
LoRA on the verifier (the deep layers, policy.attach_verifier_lora) tracking the stream.

OnlineTrainer runs the loop (JSONL diagnostics, a per-step callback, a NaN guard); its checkpoints
(exact resume, policy.pt for method="dvi") are in checkpoint.py. The CLI is `python -m dvi_lite dvi`.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from tqdm.auto import tqdm

from dvi_lite.core.checks import check_int, check_prob, check_real, reject_renamed
from dvi_lite.core.engine import acceptance_rate, decode
from dvi_lite.core.kvcache import kv_bytes
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.dvi.buffer import ReplayBuffer
from dvi_lite.methods.dvi.checkpoint import Checkpointing
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.drafter import DVIDrafter
from dvi_lite.methods.dvi.losses import EMABaseline, fast_loss, slow_loss
from dvi_lite.methods.dvi.policy import DVIPolicy, _base, attach_verifier_lora, verifier_lora_params
from dvi_lite.models.training import lr_at
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab


class NonFiniteError(FloatingPointError):
    """A DVI update produced a NaN/inf loss or gradient; the update was not applied."""


class OnlineTrainer(Checkpointing):
    """The online DVI loop on a stream of prompts (token-id lists, cycled in order).

        repeat: decode the next prompt with the shared engine (greedy by default) -> experiences into
                the ReplayBuffer -> while >= fast_every unconsumed experiences: a fast update of the
                draft (lora_S, exit_norm, alpha); every slow_every fast steps a slow update of lora_D
                (only with slow_updates=True).

    Updates run between sequences: a sequence is drafted by one policy and verified by one verifier,
    and the state between sequences (parameters, optimisers, buffer, counters, RNGs) is everything a
    checkpoint needs for an exact resume. `train(n, callback)` runs n fast steps and returns their
    diagnostics (one dict per step; also appended to `log_path` as JSONL and passed to `callback`).
    """

    def __init__(self, model, prompts: Sequence[Sequence[int]], cfg: DVIConfig | None = None, *,
                 slow_updates: bool = False, max_new_tokens: int = 64, K: int = 6,
                 threshold: float | None = None, temperature: float = 0.0, total_steps: int | None = None,
                 warmup: int = 10, min_lr_frac: float = 0.1, slow_inner: int = 4, slow_batch: int = 4,
                 slow_history: int = 64, eos_token_id: int | None = None, log_path: str | Path | None = None,
                 ckpt_dir: str | Path | None = None, ckpt_every: int = 0,
                 buffer_logits_dtype: torch.dtype = torch.float32, progress: bool = True, vocab: Any = None, **old):
        reject_renamed(old, "OnlineTrainer")
        self.runner = Runner.for_model(model)
        self.model = model
        self.cfg = (cfg if cfg is not None else DVIConfig()).for_layers(self.runner.n_layers)
        self.prompts = [list(map(int, p)) for p in prompts]
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, 2)
        ctx = getattr(model.config, "max_position_embeddings", None)
        vocab_size = _base(model.lm_head).weight.shape[0]
        for i, p in enumerate(self.prompts):
            if ctx is not None and len(p) + max_new_tokens > ctx:
                raise ValueError(f"prompts[{i}] ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {ctx}; cut the prompts (train_prompts(max_len=...))")
            if min(p) < 0 or max(p) >= vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab_size}), got {min(p)}..{max(p)}")
        self.K = check_int("K", K, 1, what="draft tokens per step")
        self.threshold = None if threshold is None else check_prob("threshold", threshold, what="eta")
        self.sampler = Sampler(temperature)
        if total_steps is not None:
            check_int("total_steps", total_steps, 1)
        self.total_steps, self.warmup = total_steps, check_int("warmup", warmup, 0)
        self.min_lr_frac = check_real("min_lr_frac", min_lr_frac, 0.0, 1.0)
        self.slow_inner = check_int("slow_inner", slow_inner, 1)
        self.slow_batch = check_int("slow_batch", slow_batch, 1)
        self.slow_history = check_int("slow_history", slow_history, 1)
        self.ckpt_every = check_int("ckpt_every", ckpt_every, 0)
        self.eos_token_id, self.progress = eos_token_id, progress
        self.log_path = Path(log_path) if log_path is not None else None
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.last_good_checkpoint: Path | None = None
        c = self.cfg
        # trimmed draft head (models.vocab): drafts, buffer logits and the fast update live on its N ids
        self.vocab = vocab if isinstance(vocab, TrimmedHead) else resolve_vocab(model, None, vocab)
        self._inv = None  # full id -> map index (-1 off the map)
        if self.vocab is not None:
            self._inv = torch.full((vocab_size,), -1, dtype=torch.long, device=self.vocab.ids.device)
            self._inv[self.vocab.ids] = torch.arange(len(self.vocab), device=self.vocab.ids.device)
        with torch.random.fork_rng(devices=[]):  # deterministic init that leaves the caller's RNG alone
            torch.manual_seed(c.seed)
            self.policy = DVIPolicy(model, c.split, c.lora_rank, c.lora_alpha, head=c.head,
                                    head_ids=None if self.vocab is None else self.vocab.ids)
        if c.head == "trained":  # the trained head's own map: its weight is the policy's head_weight
            self.vocab = self.policy.head_map
        self.fast_opt = torch.optim.AdamW(self.param_groups(), lr=c.lr, weight_decay=0.0)
        self.slow_updates = bool(slow_updates)
        self.slow_opt = None
        if self.slow_updates:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(c.seed + 1)
                params = attach_verifier_lora(model, c.split, c.lora_rank, c.lora_alpha)
            self.slow_opt = torch.optim.AdamW(params, lr=c.slow_lr, weight_decay=0.0)
        self.buffer = ReplayBuffer(c.buffer_size, buffer_logits_dtype)
        self.baseline = EMABaseline(c.baseline_beta)
        self.gen = torch.Generator().manual_seed(c.seed)  # buffer and slow-batch sampling
        self.fast_step = self.slow_step = 0
        self.prompt_idx = 0  # prompts consumed so far (the next one is prompts[prompt_idx % n])
        self.unconsumed = 0  # experiences added since they were last "paid for" by a fast update
        self.fresh_rewards: list[float] = []  # rewards since the last fast update (acceptance, baseline)
        self.sequences: list[list[int]] = []  # recent prompt + output ids: the slow update's data
        self.tokens_generated = 0
        self.elapsed = 0.0
        self.recent: dict[str, float] = {}  # stats of the sequences since the last fast update
        self._recent_acc: list[tuple[int, int]] = []
        self._recent_time = self._recent_new = 0.0
        self.meta: dict[str, Any] = {}  # free-form (the CLI keeps the before-training evaluation here)

    def param_groups(self) -> list[dict[str, Any]]:
        """The fast optimiser's groups: lora_S + exit_norm + alpha at lr, a trained head's rows at lr * head_lr_mult
        ("lr_mult": every update sets lr(step) * lr_mult)."""
        named = self.policy.named_trainable()
        head = [p for n, p in named.items() if n in ("head_weight", "head_bias")]
        rest = [p for n, p in named.items() if n not in ("head_weight", "head_bias")]
        groups = [{"params": rest, "lr_mult": 1.0}]
        if head:
            groups.append({"params": head, "lr_mult": self.cfg.head_lr_mult})
        return groups

    def set_lr(self, lr: float) -> None:
        for g in self.fast_opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)

    # ------------------------------------------------------------------ decoding
    def lr(self, step: int) -> float:
        if self.total_steps is None:  # open-ended stream: warm-up, then constant
            return self.cfg.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.cfg.lr
        return lr_at(step, SimpleNamespace(lr=self.cfg.lr, warmup=self.warmup, steps=self.total_steps,
                                           min_lr_frac=self.min_lr_frac))

    def _decode_next(self) -> int:
        ids = self.prompts[self.prompt_idx % len(self.prompts)]
        self.prompt_idx += 1
        drafter = DVIDrafter(self.runner, self.policy, self.K, self.threshold, collect=True, vocab=self.vocab)
        gen = make_generator(self.cfg.seed * 1_000_003 + self.prompt_idx, self.runner.device)
        self.policy.eval()
        new, stats = decode(self.runner, drafter, ids, self.max_new_tokens, self.sampler, gen,
                            self.eos_token_id)
        got = drafter.drain()
        n = 0
        if got is not None:
            h, tokens, rewards, logits = got
            if self.vocab is not None:  # onto the map: logits (n, N), tokens as map indices (drafts are on it)
                logits, tokens = logits[:, self.vocab.ids], self._inv[tokens]
            self.buffer.add(h, tokens, rewards, logits)
            n = h.shape[0]
            self.unconsumed += n
            self.fresh_rewards += rewards.tolist()
        self.sequences = (self.sequences + [ids + new])[-self.slow_history:]
        self.tokens_generated += len(new)
        self._recent_acc += [(s.depth, s.accepted) for s in stats.steps]
        self._recent_time += stats.total_s
        self._recent_new += stats.new_tokens
        r = self.runner
        kv_pos = len(ids) + len(new)
        kv = kv_bytes(r.model.config, kv_pos, r.lm_head.weight.element_size(), r.n_layers)
        self.recent.update(kv_positions=kv_pos, kv_mib=kv / 2**20)
        return n

    # ------------------------------------------------------------------ updates
    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, D) h_k -> (B, V) float32 draft logits, or (B, N) on the trimmed head's ids (with grad)."""
        return self.policy.logits(h, self.vocab)

    def _nonfinite(self, what: str, parts: dict[str, float]) -> NonFiniteError:
        ck = str(self.last_good_checkpoint) if self.last_good_checkpoint else "none saved in this run"
        return NonFiniteError(
            f"DVI stopped: non-finite {what} at fast step {self.fast_step} (slow step {self.slow_step}); "
            f"components {parts}. The update was NOT applied: the parameters are those after the last good step, "
            f"and no checkpoint was written for it (last good checkpoint: {ck}). Try a lower lr / slow_lr, "
            f"a lower grad_clip, or check the model's dtype (fp16 overflows; use bf16 or fp32).")

    def apply_fast(self, loss: torch.Tensor, parts: dict[str, float], what: str = "fast") -> float:
        """Backward, clip and step the fast optimiser; a non-finite loss or gradient raises NonFiniteError with the
        update NOT applied. Returns the gradient norm before clipping."""
        if not math.isfinite(parts["total"]):
            raise self._nonfinite(f"{what} loss", parts)
        self.fast_opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.policy.trainable(), self.cfg.grad_clip))
        if not math.isfinite(gnorm):
            self.fast_opt.zero_grad(set_to_none=True)
            raise self._nonfinite(f"{what} gradient", {**parts, "grad_norm": gnorm})
        self.fast_opt.step()
        return gnorm

    def _fast_update(self) -> dict[str, Any]:
        c, t = self.cfg, self.fast_step
        lr = self.lr(t)
        self.set_lr(lr)
        batch = self.buffer.sample(c.batch_size, self.gen, c.accepted_only, c.backoff_min)
        dev = self.runner.device
        self.policy.train()
        s = self.draft_logits(batch["h"].to(dev))  # (B, V) or (B, N) float32, with grad
        tl = batch["teacher_logits"].to(dev)  # (B, V)
        loss, parts = fast_loss({"student_logits": s, "teacher_logits": tl, "tokens": batch["tokens"].to(dev),
                                 "rewards": batch["rewards"].to(dev)}, c, t, self.baseline)
        self.policy.eval()
        gnorm = self.apply_fast(loss, parts)
        fresh = torch.tensor(self.fresh_rewards)
        self.baseline.update(fresh)  # after the loss: b never depends on the rewards it is subtracted from
        self.fresh_rewards = []
        with torch.no_grad():
            sd = s.detach()
            top1 = tl.argmax(-1)
            pi_v = sd.softmax(-1).gather(-1, top1[:, None]).mean().item()
            agree = (sd.argmax(-1) == top1).float().mean().item()
        self.fast_step += 1
        if self._recent_acc:  # sequences decoded since the last step; else the last measurement carries over
            taus = [a + 1 for _, a in self._recent_acc]
            self.recent.update(accept_rate=acceptance_rate(self._recent_acc), tau=sum(taus) / len(taus),
                               tokens_per_s=self._recent_new / self._recent_time if self._recent_time > 0 else None)
        rec = {"step": self.fast_step, "lambda": parts["lambda"], "lr": lr, "loss": parts["total"],
               "l_rl": parts["l_rl"], "l_kl": parts["l_kl"], "l_ce": parts["l_ce"], "ce_weight": parts["ce_weight"],
               "baseline": self.baseline.value, "grad_norm": gnorm, "fresh": int(fresh.numel()),
               "accept_rate": self.recent.get("accept_rate"), "tau": self.recent.get("tau"),
               "pi_s_v": pi_v, "top1_agree": agree, "std_s": sd.std(-1).mean().item(),
               "std_t": tl.std(-1).mean().item(),
               "logit_scale": self.policy.logit_scale.item(), "head_norm": self.policy.head_norm(),
               "backoff": bool(batch["backoff"]), "buffer": len(self.buffer), "samples_seen": self.buffer.n_seen,
               "sequences": self.prompt_idx, "tokens_generated": self.tokens_generated,
               "tokens_per_s": self.recent.get("tokens_per_s"),
               "kv_positions": self.recent.get("kv_positions"), "kv_mib": self.recent.get("kv_mib")}
        self._recent_acc, self._recent_time, self._recent_new = [], 0.0, 0.0
        return rec

    def _verifier_logits(self, ids: torch.Tensor, hk: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.runner.logits(self.runner.layers_forward(hk, None, pos, self.cfg.split))[0].float()  # (T, V)

    def _slow_update(self) -> dict[str, Any]:
        """`slow_inner` AdamW steps of lora_D on recent sequences: CE(next token) + beta_kl KL(new || old).

        "old" is a frozen copy of the verifier's outputs at the start of this slow update (computed once,
        no grad), so the KL bounds how far one slow update can move the verifier.
        """
        c, r = self.cfg, self.runner
        dev = r.device
        pick = torch.randperm(len(self.sequences), generator=self.gen)[: self.slow_batch].tolist()
        data = []
        with torch.no_grad():
            for i in pick:
                ids = torch.tensor([self.sequences[i]], device=dev)  # (1, T)
                pos = torch.arange(ids.shape[1], device=dev)[None]
                hk = r.layers_forward(r.embed(ids), None, pos, 0, c.split)  # base shallow layers, shared
                data.append((ids, hk, self._verifier_logits(ids, hk)))
        params = verifier_lora_params(self.model)
        losses = []
        for _ in range(self.slow_inner):
            total = sum(slow_loss(self._verifier_logits(ids, hk)[:-1], old[:-1], ids[0, 1:], c.beta_kl)
                        for ids, hk, old in data) / len(data)
            lv = total.item()
            if not math.isfinite(lv):
                raise self._nonfinite("slow loss", {"slow_loss": lv})
            self.slow_opt.zero_grad(set_to_none=True)
            total.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, c.grad_clip))
            if not math.isfinite(gnorm):
                self.slow_opt.zero_grad(set_to_none=True)
                raise self._nonfinite("slow gradient", {"slow_loss": lv, "grad_norm": gnorm})
            self.slow_opt.step()
            losses.append(lv)
        self.slow_step += 1
        with torch.no_grad():
            d_norm = math.sqrt(sum(float(p.pow(2).sum()) for p in params))
        return {"slow_step": self.slow_step, "slow_loss_first": losses[0], "slow_loss_last": losses[-1],
                "lora_D_norm": d_norm}

    # ------------------------------------------------------------------ the loop
    def train(self, steps: int, callback: Callable[[dict], Any] | None = None,
              progress: bool | None = None, max_sequences: int | None = None) -> list[dict]:
        """Run `steps` more fast updates (decoding as many prompts as needed); returns one dict per step.

        callback(record) is called after every fast step (e.g. a notebook widget's live plot); the
        same record is appended to log_path (JSONL). With ckpt_dir and ckpt_every > 0, a checkpoint
        is written every ckpt_every fast steps (and the last good one survives a NaN stop).
        max_sequences: also stop once that many prompts of the stream have been decoded (counting a resumed
        run's) and their experiences used, so runs with different objectives see the same stream.
        """
        check_int("steps", steps, 0)
        if max_sequences is not None:
            check_int("max_sequences", max_sequences, 1)
        c = self.cfg
        target = self.fast_step + steps
        records: list[dict] = []
        show = self.progress if progress is None else progress
        # open-ended (a stream bounded by max_sequences): count steps without a total
        bar = tqdm(total=steps if max_sequences is None else None, desc=f"DVI k={c.split}", disable=not show)
        dry = 0  # sequences in a row that gave no experience (e.g. every output stops at eos at once)
        t0 = time.perf_counter()
        try:
            while self.fast_step < target:
                if self.unconsumed >= c.fast_every:
                    rec = self._fast_update()
                    self.unconsumed -= c.fast_every
                    if self.slow_updates and self.fast_step % c.slow_every == 0:
                        rec.update(self._slow_update())
                    self.elapsed += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    rec["elapsed_s"] = self.elapsed
                    records.append(rec)
                    self._log(rec)
                    if callback is not None:
                        callback(rec)
                    bar.update(1)
                    bar.set_postfix(acc=f"{rec['accept_rate'] if rec['accept_rate'] is not None else float('nan'):.2f}",
                                    lam=f"{rec['lambda']:.2f}", loss=f"{rec['loss']:.3f}")
                    if self.ckpt_dir is not None and self.ckpt_every and self.fast_step % self.ckpt_every == 0:
                        self.save_checkpoint()
                    continue
                if max_sequences is not None and self.prompt_idx >= max_sequences:
                    break
                dry = 0 if self._decode_next() else dry + 1
                if dry > len(self.prompts):
                    raise RuntimeError("DVI: a whole pass over the prompts produced no draft to learn from "
                                       "(outputs end at once?); raise max_new_tokens or check eos_token_id")
        finally:
            self.elapsed += time.perf_counter() - t0
            bar.close()
        return records

    def _log(self, rec: dict) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
