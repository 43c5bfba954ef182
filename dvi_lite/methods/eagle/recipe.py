"""The EAGLE head of a model without a self-distillation set: the course model, or any local checkpoint.

SmolLM2's head learns from its self-distillation set (`distill-data`, read by train.train_from_set). Every other
model learns, like its Kangaroo adapter's and Medusa heads' recipes, from the small teacher set
(models/teacher.py): the model's own greedy answers to the Spec-Bench training questions plus windows of the
course corpus, run once through the model, keeping per position the states after the head's fused layers, the
last layer's state and the top-k next tokens. On it the head trains by the same recipe (train.train_eagle:
EAGLE-3's training-time test, the same optimiser and schedule), with rows held out for the learning curve.

One function, `prepare_model`, is that recipe: `python -m dvi_lite eagle-train --model course` and
`python -m dvi_lite prepare --model <folder>` both call it.

    python -m dvi_lite eagle-train --model course --out data/eagle --force   # the committed course head
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dvi_lite.methods.eagle.head import HeadConfig
from dvi_lite.methods.eagle.train import EagleTrainConfig, committed_vocab, train_eagle
from dvi_lite.models.teacher import TeacherConfig, TeacherData, fill_states, teacher_for, teacher_path

# the teacher set: fewer own answers than the default (greedy generation is its slow part on a CPU) and more corpus
# windows, since the course model's held-out prompts are corpus-like (code and prose)
TEACHER = TeacherConfig(answers=32, corpus_windows=320)
TEACHER_SMOKE = TeacherConfig(answers=2, answer_tokens=8, corpus_windows=2, seq_len=32, gen_batch=2, top_k=8)
# the head's training on it: EagleTrainConfig's recipe, sized to about 10 minutes of one CPU core on the course model
TRAIN = EagleTrainConfig(steps=240, eval_every=30, warmup=20, lr=1e-3, val_frac=0.1, val_rows=32)
TRAIN_SMOKE = EagleTrainConfig(steps=3, warmup=1, eval_every=0, val_rows=2, batch_rows=2)


def teacher_set(model, tok, layers: tuple[int, ...], smoke: bool = False, path: str | Path | None = None
                ) -> TeacherData:
    """The model's teacher set with the states after `layers` (built once under build/teacher/<fingerprint>/; a set
    built before for other layers gets the missing states added). smoke: a few rows, at `path` (required)."""
    if smoke and path is None:
        raise ValueError("a smoke teacher set needs its own path (it must never stand in for the real one)")
    cfg = replace(TEACHER_SMOKE if smoke else TEACHER, layers=tuple(sorted(set(layers))))
    data = teacher_for(model, tok, cfg, path if path is not None else teacher_path(model))
    return fill_states(model, data, tuple(sorted(set(layers))))


def prepare_model(model_path, out_dir: str | Path, command: str = "", smoke: bool = False,
                  max_minutes: float | None = None, steps: int | None = None, resume: bool = True) -> dict:
    """Train the EAGLE head of `model_path` (a name, a folder, or a models.loading.Loaded) on its teacher set into
    out_dir (head.pt + card.json; checkpoint and curve snapshots beside them, ignored by git). The draft vocabulary
    is the model's top-8192 map (the full vocabulary when it has no more tokens, as the course model). smoke: a
    few steps on a few rows. max_minutes: stop resumably; the same call continues. Returns the card."""
    from dvi_lite.models.loading import load_once

    model, tok = load_once(model_path, dtype="float32")
    cfg = replace(TRAIN_SMOKE if smoke else TRAIN, head=HeadConfig(), max_minutes=max_minutes)
    if steps is not None:
        cfg = replace(cfg, steps=steps)
    n = model.config.num_hidden_layers
    layers = tuple(k for k in cfg.head.resolved(n).layers if k < n)  # the last layer's state is `final`
    out_dir = Path(out_dir)
    data = teacher_set(model, tok, layers, smoke, out_dir / "teacher_smoke.pt" if smoke else None)
    data.card.setdefault("source", "teacher set (models/teacher.py): own answers + course corpus windows")
    data.card.setdefault("n_rows", len(data.tokens))
    data.card.setdefault("n_tokens", data.n_tokens)
    ids = committed_vocab(model, cfg.head.vocab, tok)
    return train_eagle(model, data, cfg, out_dir, resume, None, ids, progress=not smoke, command=command)[1]
