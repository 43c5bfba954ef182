"""EAGLE's training (methods/eagle/ttt.py, train.py): the training-time test computes exactly what drafting computes,
a few steps on the course model's teacher outputs lower the loss, and a killed-and-resumed run ends bit-exact."""
from __future__ import annotations

import json

import pytest
import torch

import dvi_lite
from dvi_lite.core.kvcache import KVCache
from dvi_lite.methods.eagle.head import EagleHead, HeadConfig, load_head
from dvi_lite.methods.eagle.train import EagleTrainConfig, fused_states, train_eagle
from dvi_lite.methods.eagle.ttt import ttt_loss, ttt_mask
from dvi_lite.models.teacher import TeacherConfig, teacher_outputs


def test_ttt_mask_is_causal_then_diagonal():
    m = ttt_mask(3, 2)[0, 0]
    assert m.shape == (3, 9)
    assert torch.equal(m[:, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    eye = torch.eye(3, dtype=torch.bool)
    assert torch.equal(m[:, 3:6], eye) and torch.equal(m[:, 6:], eye)


@torch.no_grad()
def test_unrolled_steps_compute_what_drafting_computes(target):
    """Step s, slot j of the training-time test = the head drafting its (s+1)-th token after the prefix x_0..x_{j+1}
    with its own KV cache: committed inputs 0..j fed, then s draft steps fed the head's own outputs."""
    rows = [[3, 17, 4, 22, 9, 41, 5, 8, 30], [7, 7, 12, 2, 50, 1]]
    data = teacher_outputs(target, rows, TeacherConfig(layers=(1, 2), top_k=4, batch_size=2))
    head = EagleHead(target).eval()
    states = [s.float() for s in fused_states(data, head.layers, 3)]
    seen = []  # each unrolled step's logits (B, T, N)
    step = head.step

    def record(*a, **k):
        out = step(*a, **k)
        seen.append(out[1])
        return out

    head.step = record
    ttt_loss(head, states, data.tokens, data.mask, data.top_ids, data.top_logp, steps=3)
    head.step = step
    assert len(seen) == 3
    for row in range(2):
        toks = data.tokens[row]
        n = int(data.mask[row].sum())
        for j in range(n - 4):
            cache = KVCache.for_model(target, 32, n_layers=1)
            feats = head.fuse([s[row:row + 1, : j + 1] for s in states])  # F_0 .. F_j
            g, logits = head.step(feats, toks[None, 1: j + 2], torch.arange(j + 1)[None], cache)
            g, logits = g[:, -1:], logits[0, -1]
            for s in range(3):
                if s:
                    g, lg = head.step(g, toks[None, j + 1 + s: j + 2 + s], torch.tensor([[j + s]]), cache)
                    logits = lg[0, -1]
                torch.testing.assert_close(seen[s][row, j], logits, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def course_teacher():
    model, tok = dvi_lite.load_model("course", dtype="float32")
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 3,
             "Speculative decoding drafts tokens cheaply and verifies them at once.",
             "for i in range(10):\n    print(i * i)\n", "Once upon a time there was a small robot who liked to count.",
             "import numpy as np\nx = np.zeros(3)\nprint(x.sum())\n"]
    rows = [tok(t)["input_ids"][:32] for t in texts]
    return model, teacher_outputs(model, rows, TeacherConfig(layers=(2, 6, 9), top_k=8, batch_size=8))


CFG = dict(head=HeadConfig(vocab=None), steps=8, batch_rows=2, warmup=2, lr=2e-3, ttt_steps=3, val_frac=0.2,
           eval_every=4, ckpt_every=2, bf16=False)


class Killed(Exception):
    pass


@pytest.mark.slow
def test_smoke_training_lowers_the_loss_and_resumes_bit_exact(course_teacher, tmp_path):
    model, data = course_teacher
    cfg = EagleTrainConfig(**CFG)
    head_a, card_a = train_eagle(model, data, cfg, tmp_path / "a", resume=False, progress=False)
    losses = [x["loss"] for x in card_a["log"]]
    assert sum(losses[-3:]) / 3 < losses[0], losses
    assert card_a["final"]["val_loss"] < card_a["init"]["val_loss"], (card_a["init"], card_a["final"])
    assert len(card_a["final"]["val_agreement_steps"]) == 3 and [c["step"] for c in card_a["curve"]] == [4, 8]
    assert json.loads((tmp_path / "a" / "card.json").read_text())["steps"] == 8

    def kill(step: int) -> None:
        if step == 5:  # after step 5: the last checkpoint is step 4's, so step 5 is redone
            raise Killed

    ckpt = tmp_path / "ckpt.pt"  # (the default is under build/ckpt/, keyed by the model, recipe and output)
    with pytest.raises(Killed):
        train_eagle(model, data, cfg, tmp_path / "b", resume=False, on_step=kill, progress=False, ckpt=ckpt)
    assert torch.load(ckpt, weights_only=True)["step"] == 4
    head_b, card_b = train_eagle(model, data, cfg, tmp_path / "b", resume=True, progress=False, ckpt=ckpt)
    for k, v in head_a.state_dict().items():
        assert torch.equal(v, head_b.state_dict()[k]), k
    assert card_b["log"] == card_a["log"] and card_b["curve"] == card_a["curve"] and card_b["final"] == card_a["final"]
    with pytest.raises(ValueError, match="written with another config"):  # the same checkpoint, another config
        train_eagle(model, data, EagleTrainConfig(**{**CFG, "lr": 1e-3}), tmp_path / "b", progress=False, ckpt=ckpt)
    loaded = load_head(model, tmp_path / "a" / "head.pt")  # the half-precision file drafts
    assert loaded.layers == (2, 6, 9)
    snaps = sorted((tmp_path / "a" / "curve").glob("tokens_*.pt"))  # one snapshot per curve point, each a head
    assert sorted(int(p.stem.split("_")[1]) for p in snaps) == sorted(c["tokens_seen"] for c in card_a["curve"])
    assert load_head(model, snaps[0]).layers == (2, 6, 9)


def test_a_time_budget_stops_at_a_curve_point_and_resumes_to_the_same_head(course_teacher, tmp_path):
    model, data = course_teacher
    whole, _ = train_eagle(model, data, EagleTrainConfig(**CFG), tmp_path / "a", resume=False, progress=False)
    stop = EagleTrainConfig(**{**CFG, "max_minutes": 0.0})  # every call stops after one step, checkpointed
    head, out = train_eagle(model, data, stop, tmp_path / "b", resume=False, progress=False)
    assert out["stopped"] and out["step"] == 1 and (tmp_path / "b" / "curve").is_dir()
    calls = 1
    while out.get("stopped"):
        head, out = train_eagle(model, data, stop, tmp_path / "b", resume=True, progress=False)
        calls += 1
    assert calls == 8 and out["steps"] == 8
    for k, v in whole.state_dict().items():
        assert torch.equal(v, head.state_dict()[k]), k


def test_bad_settings_are_named(course_teacher, tmp_path):
    model, data = course_teacher
    with pytest.raises(ValueError, match="ttt_steps"):
        train_eagle(model, data, EagleTrainConfig(**{**CFG, "ttt_steps": 0}), tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"keeps the states after layers \[2, 6, 9\], not 3"):
        train_eagle(model, data, EagleTrainConfig(**{**CFG, "head": HeadConfig(layers=(3, 6, 9), vocab=None)}),
                    tmp_path, progress=False)
