"""Checkpoints of the online learner: an exact resume (trainer.pt) and the policy method="dvi" loads (policy.pt).

The state between two sequences (parameters, optimisers, buffer, baseline, counters, every RNG) is
everything a resume needs, so a run killed and resumed from a checkpoint replays the same numbers as
an uninterrupted one. Files are written to a temporary name and renamed: a kill never leaves half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dvi_lite.core.checks import new_names
from dvi_lite.methods.dvi.buffer import rng_state, set_rng_state
from dvi_lite.methods.dvi.policy import POLICY_FILE, TRAINER_FILE, load_verifier_lora_state, verifier_lora_state
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.safety import load_torch


def _save(obj: Any, f: Path) -> None:
    """torch.save to a temporary name, then rename: a reader never sees half a file."""
    tmp = f.with_name(f.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, f)


def _write_text(f: Path, text: str) -> None:
    """Write a text file to a temporary name, then rename: a kill mid-write leaves the old file whole."""
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, f)


def _logged_step(line: str) -> float:
    """The fast step a log line records; a blank or torn line (a kill inside its write: it can only be a step
    after the last checkpoint, whose own line was written before it) counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


# the config fields added with the trained head (DVIConfig.head), as every earlier checkpoint ran
PRE_HEAD_OPTION = {"head": "shared", "head_lr_mult": 0.1}


class Checkpointing:
    """The checkpoint methods of OnlineTrainer (a mixin: they read and restore the trainer's own fields)."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "fingerprint": fingerprint(self.model), "config": self.cfg.to_dict(),
                "slow_updates": self.slow_updates, "policy": self.policy.trainable_state(),
                "lora_D": verifier_lora_state(self.model) if self.slow_updates else None,
                "fast_opt": self.fast_opt.state_dict(),
                "slow_opt": self.slow_opt.state_dict() if self.slow_opt is not None else None,
                "buffer": self.buffer.state_dict(), "baseline": self.baseline.state_dict(),
                "gen": self.gen.get_state(), "rng": rng_state(),
                "counters": {"fast_step": self.fast_step, "slow_step": self.slow_step, "prompt_idx": self.prompt_idx,
                             "unconsumed": self.unconsumed, "tokens_generated": self.tokens_generated,
                             "elapsed": self.elapsed},
                "fresh_rewards": list(self.fresh_rewards), "sequences": [list(s) for s in self.sequences],
                "recent": {"acc": list(self._recent_acc), "time": self._recent_time, "new": self._recent_new,
                           **self.recent},
                "meta": self.meta, "vocab": self._vocab_n()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        if st["fingerprint"] != fingerprint(self.model):
            raise ValueError("DVI checkpoint was trained for another model (fingerprint mismatch)")
        saved = {**PRE_HEAD_OPTION, **new_names(st["config"])}  # before the head option: a shared head; tau: t_lambda
        if saved != self.cfg.to_dict():
            diff = {k: (v, saved.get(k)) for k, v in self.cfg.to_dict().items() if saved.get(k) != v}
            raise ValueError(f"DVI checkpoint config differs from this trainer's (now, saved): {diff}")
        if st.get("vocab") != self._vocab_n():
            raise ValueError(f"DVI checkpoint was trained with vocab={st.get('vocab')} (trimmed head size; None = "
                             f"full), this trainer has vocab={self._vocab_n()}")
        if bool(st["slow_updates"]) != self.slow_updates:
            raise ValueError(f"DVI checkpoint has slow_updates={st['slow_updates']}, this trainer {self.slow_updates}")
        self.policy.load_trainable_state(st["policy"])
        self.fast_opt.load_state_dict(st["fast_opt"])
        if self.slow_updates:
            load_verifier_lora_state(self.model, st["lora_D"])
            self.slow_opt.load_state_dict(st["slow_opt"])
        self.buffer.load_state_dict(st["buffer"])
        self.baseline.load_state_dict(st["baseline"])
        self.gen.set_state(st["gen"])
        set_rng_state(st["rng"])
        k = st["counters"]
        self.fast_step, self.slow_step, self.prompt_idx = k["fast_step"], k["slow_step"], k["prompt_idx"]
        self.unconsumed, self.tokens_generated, self.elapsed = k["unconsumed"], k["tokens_generated"], k["elapsed"]
        self.fresh_rewards = list(st["fresh_rewards"])
        self.sequences = [list(s) for s in st["sequences"]]
        rc = dict(st["recent"])
        self._recent_acc = [tuple(x) for x in rc.pop("acc")]
        self._recent_time, self._recent_new = rc.pop("time"), rc.pop("new")
        self.recent = rc
        self.meta = dict(st.get("meta", {}))

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write trainer.pt (everything for an exact resume) and policy.pt (for method="dvi") into a dir."""
        d = Path(path) if path is not None else self.ckpt_dir
        if d is None:
            raise ValueError("save_checkpoint: give a directory (or construct the trainer with ckpt_dir=...)")
        d.mkdir(parents=True, exist_ok=True)
        _save(self.state_dict(), d / TRAINER_FILE)
        self.save_policy(d)
        self.last_good_checkpoint = d
        return d

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        """Restore a save_checkpoint() dir into this (freshly built) trainer; the JSONL log is cut back to it."""
        d = Path(path) if path is not None else self.ckpt_dir
        f = None if d is None else d / TRAINER_FILE
        if f is None or not f.is_file():
            raise FileNotFoundError(f"no DVI trainer checkpoint at {f}")
        self.load_state_dict(load_torch(f, "DVI trainer checkpoint"))
        self.last_good_checkpoint = d
        if self.log_path is not None and self.log_path.is_file():  # drop steps logged after the checkpoint
            keep = [ln for ln in self.log_path.read_text().splitlines() if _logged_step(ln) <= self.fast_step]
            _write_text(self.log_path, "".join(ln + "\n" for ln in keep))

    def _vocab_n(self) -> int | None:
        """The trimmed draft head's size N the trainer learns on (None: the full vocabulary)."""
        vocab = getattr(self, "vocab", None)
        return None if vocab is None else len(vocab)

    def save_policy(self, path: str | Path, dtype: torch.dtype | None = None, head_rank: int | None = None) -> Path:
        """policy.pt in a dir: what method="dvi" loads (split, model fingerprint, lora_S + head, lora_D; a trained
        head's rows and their token ids, "head_ids").

        dtype: store the head's tensors in it (e.g. torch.bfloat16 for a committed file; None = as trained,
        float32); loading copies them into the policy's float32 parameters. "vocab" records the trimmed head
        size N the head was trained with (draft with the same `vocab`). head_rank: store a trained head as the
        target's rows + a rank-`head_rank` correction (policy.head_delta) instead of all N x D rows (None: all).
        """
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        pol = self.policy.trainable_state()
        if head_rank is not None and "head_weight" in pol:
            del pol["head_weight"]
            pol["head_delta"] = self.policy.head_delta(head_rank)
        if dtype is not None:
            pol = {k: ({n: t.to(dtype) for n, t in v.items()} if isinstance(v, dict) else v.to(dtype))
                   for k, v in pol.items()}
        ids = self.policy.head_ids
        bundle = {"version": 1, "split": self.cfg.split, "fingerprint": fingerprint(self.model),
                  "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha, "fast_step": self.fast_step,
                  "vocab": self._vocab_n(), "policy": pol, "head": self.policy.head,
                  "head_ids": None if ids is None else ids.detach().cpu().to(torch.int32),
                  "lora_D": verifier_lora_state(self.model) if self.slow_updates else None}
        _save(bundle, d / POLICY_FILE)
        return d / POLICY_FILE
