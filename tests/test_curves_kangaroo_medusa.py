"""The Kangaroo adapter's and the Medusa heads' learning curves on a tiny self-distillation set (the course
model): a curve point with its snapshot at every milestone passed, agreements in [0, 1], and a run stopped by
the time budget resumes to the same final weights as an uninterrupted run."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from dvi_lite.models import distill_data as dd
from dvi_lite.models import distill_reader as rd

MILESTONES = (16, 32)


def tiny(tokens: int) -> dd.DistillConfig:
    """tests/test_distill_data.py's toy set, without the corpus shard (encoding the corpus takes half a minute)."""
    return dd.DistillConfig(tokens=tokens, layers=(2,), top_k=4, answer_tokens=6, shard_prompts=6,
                            specbench_per_shard=1, gen_batch=6, corpus_windows=0, corpus_len=16, val_every=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The course model and a set of two shards: shard 0 trains, shard 1 is held out (val_every=2)."""
    from dvi_lite.models.loading import load_model

    model, tok = load_model("course", dtype="float32", device="cpu")
    folder = tmp_path_factory.mktemp("distill")
    card = dd.build(model, tok, tiny(1), folder)
    card = dd.build(model, tok, tiny(card["answer_tokens"] + 1), folder)
    assert card["shards"] == 2 and card["val_shards"] == [1]
    return model, tok, folder


def _check_curve(curve: list[dict], tokens_seen: int, steps: int, folder: Path) -> list[Path]:
    """Points at 0 tokens, after every milestone passed, at the end; agreements in [0, 1]; one snapshot per
    point after 0. Returns the snapshots, in curve order."""
    tokens = [p["tokens"] for p in curve]
    assert tokens[0] == 0 and curve[0]["step"] == 0 and tokens == sorted(tokens)
    assert curve[-1]["step"] == steps and tokens[-1] == tokens_seen
    for m in MILESTONES:
        if m <= tokens_seen:  # passed: exactly one point is the first at or past it
            assert sum(a < m <= b for a, b in zip(tokens[:-1], tokens[1:], strict=True)) == 1
    assert all(0.0 <= p["val_agreement"] <= 1.0 and p["val_tokens"] > 0 for p in curve)
    snaps = [folder / f"tokens_{t}.pt" for t in tokens[1:]]
    assert all(s.is_file() for s in snaps) and len(list(folder.glob("tokens_*.pt"))) == len(set(tokens[1:]))
    assert not list(folder.glob("*.tmp"))
    return snaps


def test_kangaroo_learning_curve_and_a_time_stop_resumes_exactly(built, tmp_path):
    from dvi_lite.methods.kangaroo.distill import TeacherFitConfig
    from dvi_lite.methods.kangaroo.drafter import load_adapter
    from dvi_lite.methods.kangaroo.train import curve_dir, train_from_teacher

    model, tok, folder = built
    train = rd.load_as_teacher(folder, "train", layers=(2,), width=8, final=False)
    val = rd.load_as_teacher(folder, "val", layers=(2,), width=8, final=False)
    vocab = torch.unique(torch.cat([train.top_ids.flatten(), val.top_ids.flatten()])).tolist()
    cfg = TeacherFitConfig(split=2, steps=6, batch_rows=2, warmup=1, vocab=vocab, bf16=False, milestones=MILESTONES,
                           val_max_tokens=64, ckpt_every_s=1e9)
    a = tmp_path / "a" / "adapter_k2.pt"
    card = train_from_teacher(model, tok, train, cfg, a, ckpt=tmp_path / "a.pt", val=val)
    assert card["tokens_seen"] >= MILESTONES[-1] and card["val_data"]["split"] == "val"
    snaps = _check_curve(card["curve"], card["tokens_seen"], 6, curve_dir(a))
    assert card["val"]["alpha"] == pytest.approx(card["curve"][-1]["val_agreement"], abs=1e-4)
    last = load_adapter(model, 2, snaps[-1])  # a snapshot is a loadable adapter: tau can be measured from it
    assert all(torch.equal(v, w) for v, w in zip(last.state_dict().values(),
                                                 load_adapter(model, 2, a).state_dict().values(), strict=True))

    b = tmp_path / "b" / "adapter_k2.pt"
    stop = replace(cfg, max_minutes=0.0)  # every call stops after one step, with a checkpoint
    runs = [train_from_teacher(model, tok, train, stop, b, resume=True, ckpt=tmp_path / "b.pt", val=val)]
    assert runs[0]["stopped"] and runs[0]["step"] == 1 and not b.is_file()
    while runs[-1].get("stopped") and len(runs) < 12:  # bounded: a resume that restarts would never end
        runs.append(train_from_teacher(model, tok, train, stop, b, resume=True, ckpt=tmp_path / "b.pt", val=val))
    assert len(runs) == 6 and runs[-1]["tokens_seen"] == card["tokens_seen"]
    full = torch.load(tmp_path / "a.pt", weights_only=False)["adapter"]
    resumed = torch.load(tmp_path / "b.pt", weights_only=False)["adapter"]
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    assert runs[-1]["val"] == card["val"]
    with pytest.raises(ValueError, match="another recipe"):  # a checkpoint of another recipe is not resumed
        train_from_teacher(model, tok, train, replace(stop, lr=0.5), b, resume=True, ckpt=tmp_path / "b.pt", val=val)


def _kangaroo_cli(model, data: Path, tmp_path: Path, monkeypatch) -> tuple[dict, list[str]]:
    """`kangaroo-train --data DATA` for 2 steps at exit layer 2 through a 300-token map: (its card, the args)."""
    import json

    from dvi_lite.methods.kangaroo import train as kt
    from dvi_lite.models.vocab import save_vocab_map

    monkeypatch.setattr(kt, "BUILD_DIR", tmp_path / "build")
    save_vocab_map(torch.arange(300), model, tmp_path / "v.pt")
    args = ["--model", "course", "--data", str(data), "--split", "2", "--steps", "2", "--vocab",
            str(tmp_path / "v.pt"), "--out", str(tmp_path / "a.pt")]
    assert kt.main(args) == 0
    return json.loads((tmp_path / "a.json").read_text()), args


def test_kangaroo_cli_on_the_set(built, tmp_path, monkeypatch, capsys):
    """`kangaroo-train --data FOLDER`: the set's train shards train, its val shards give the curve."""
    from dvi_lite.methods.kangaroo import train as kt

    model, _, folder = built
    card, args = _kangaroo_cli(model, folder, tmp_path, monkeypatch)
    assert card["steps"] == 2 and card["curve"][-1]["step"] == 2 and card["val_data"]["split"] == "val"
    assert card["command"].startswith("python -m dvi_lite kangaroo-train --model course --data")
    assert list((tmp_path / "build" / "ckpt").glob("kangaroo_set_k2_*.pt"))
    with pytest.raises(SystemExit):
        kt.main(args + ["--teacher", "auto"])
    capsys.readouterr()


def test_medusa_learning_curve_and_a_time_stop_resumes_exactly(built, tmp_path):
    from dvi_lite.methods.medusa.heads import MedusaHeads, load_heads
    from dvi_lite.methods.medusa.teacher_train import DistillConfig, distill_with_curve
    from dvi_lite.models.vocab import resolve_vocab

    model, tok, folder = built
    train = rd.load_as_teacher(folder, "train", width=8, final=True)
    val = rd.load_as_teacher(folder, "val", width=8, final=True)
    trimmed = resolve_vocab(model, tok, torch.unique(train.top_ids).tolist())
    cfg = DistillConfig(heads=2, steps=6, batch_size=8, warmup=1, vocab=None, branch=3, eval_positions=64,
                        milestones=MILESTONES, ckpt_every_s=1e9)
    rows, val_rows = torch.arange(len(train.tokens)), torch.arange(len(val.tokens))

    def run(out: str, c: DistillConfig, heads: MedusaHeads) -> dict:
        return distill_with_curve(heads, train, trimmed, c, rows, tmp_path / f"{out}.pt", resume=True,
                                  progress=False, val=val, val_rows=val_rows, curve_dir=tmp_path / out / "curve")

    whole = MedusaHeads(model, 2, norm=True, shared_lm_head=True)
    done = run("a", cfg, whole)
    assert not done["stopped"] and done["tokens_seen"] == 6 * 8
    snaps = _check_curve(done["curve"], done["tokens_seen"], 6, tmp_path / "a" / "curve")
    assert all(len(p["top1"]) == 2 and all(0.0 <= a <= 1.0 for a in p["top1"]) for p in done["curve"])
    last = load_heads(model, snaps[-1])  # a snapshot is loadable heads, with that point's rank accuracies
    assert len(last.accuracies) == 2 and last.accuracies[0][0] == pytest.approx(done["curve"][-1]["val_agreement"],
                                                                                abs=1e-4)
    assert all(torch.equal(v.half().float(), w) for v, w in zip(whole.state_dict().values(),
                                                        last.state_dict().values(), strict=True))

    stop = replace(cfg, max_minutes=0.0)  # every call stops after one step, with a checkpoint
    runs = [run("b", stop, MedusaHeads(model, 2, norm=True, shared_lm_head=True))]
    assert runs[0]["stopped"] and runs[0]["step"] == 1
    while runs[-1]["stopped"] and len(runs) < 12:  # bounded: a resume that restarts would never end
        resumed = MedusaHeads(model, 2, norm=True, shared_lm_head=True)
        runs.append(run("b", stop, resumed))
    assert len(runs) == 6 and runs[-1]["tokens_seen"] == done["tokens_seen"]
    assert [x["loss"] for x in runs[-1]["log"]] == [x["loss"] for x in done["log"]]
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert runs[-1]["curve"][-1] == done["curve"][-1]


def test_medusa_prepare_on_the_set(built, tmp_path, monkeypatch):
    """prepare_smollm2(data=FOLDER) on the course model at toy sizes: the card's curve, a time stop, resume."""
    from dvi_lite.methods.medusa import teacher_recipe as tt

    @dataclass
    class Small(tt.DistillConfig):
        heads: int = 2
        batch_size: int = 8
        vocab: int | None = None  # the teacher's own ids
        branch: int = 3
        eval_positions: int = 64
        milestones: tuple[int, ...] = MILESTONES
        ckpt_every_s: float = 1e9

    _, _, folder = built
    monkeypatch.setattr(tt, "DistillConfig", Small)
    monkeypatch.setattr(tt, "BUILD_DIR", tmp_path / "build")
    out = tmp_path / "medusa"
    stopped = tt.prepare_smollm2("course", out, "pytest", data=folder, max_minutes=0.0, steps=3)
    assert stopped["stopped"] and stopped["step"] == 1 and not (out / "heads.pt").exists()
    card = tt.prepare_smollm2("course", out, "pytest", data=folder, steps=3)  # no budget: resumes to the end
    assert (out / "heads.pt").is_file() and card["steps"] == 3 and card["tokens_seen"] == 3 * 8
    assert card["data"]["val_data"]["split"] == "val" and card["curve"][-1]["step"] == 3
    assert [p["step"] for p in card["curve"]][:2] == [0, 1]  # the stopped run's point is kept


def test_kangaroo_cli_on_the_token_record(built, tmp_path, monkeypatch, capsys):
    """`kangaroo-train --data RECORD` (the committed token record, no states): hard labels, the exit layer's
    states computed from the ids (models/teacher.fill_states, equal to a full teacher forward's)."""
    from dvi_lite.methods.kangaroo import train as kt
    from dvi_lite.models.distill_record import record_as_teacher
    from dvi_lite.models.teacher import TeacherConfig, fill_states, teacher_outputs

    model, tok, _ = built
    record = tmp_path / "record"
    card = dd.build(model, tok, replace(tiny(1), states=False, tokens=60), tmp_path / "unused", record=record)
    assert card["val_shards"] and not rd.is_state_set(record)
    data = fill_states(model, record_as_teacher(record, "train", width=16), (2,))
    ref = teacher_outputs(model, data.tokens[:3].tolist(), TeacherConfig(layers=(2,), top_k=1, batch_size=3))
    torch.testing.assert_close(data.state(2)[:3].float(), ref.states[2].float(), rtol=0.02, atol=0.02)
    out, _ = _kangaroo_cli(model, record, tmp_path, monkeypatch)
    assert out["steps"] == 2 and out["val_data"]["split"] == "val" and out["curve"][-1]["val_tokens"] > 0
    capsys.readouterr()

    # tau along the curve: each snapshot decodes as the adapter (study/curves.py), rows joined with the card
    from dvi_lite.models.corpus import load_prompts
    from dvi_lite.study import curves

    prompts = load_prompts()[:2]
    rows = curves.curve_tau(model, tok, "kangaroo", kt.curve_dir(tmp_path / "a.pt"), prompts, 8, {"split": 2},
                            progress=False)
    assert [r["tokens"] for r in rows] == sorted(p["tokens"] for p in out["curve"][1:])
    assert all(1.0 <= r["tau"] <= 1 + 6 and r["target_forwards"] > 0 for r in rows)
    joined = curves.join_card(rows, out)
    assert all("val_agreement" in r for r in joined)


def test_medusa_and_eagle_train_on_the_token_record(built, tmp_path):
    """load_distill on the token record: the final state is a full forward's (the Medusa heads' and EAGLE's
    input), computed from the ids; both trainers take the hard-label data as they take the soft one."""
    from dvi_lite.methods.eagle.head import HeadConfig
    from dvi_lite.methods.eagle.train import EagleTrainConfig, train_eagle
    from dvi_lite.methods.medusa.heads import MedusaHeads
    from dvi_lite.methods.medusa.teacher_train import DistillConfig, distill_with_curve
    from dvi_lite.models.teacher import TeacherConfig, teacher_outputs
    from dvi_lite.models.vocab import resolve_vocab

    model, tok, _ = built
    record = tmp_path / "record"
    dd.build(model, tok, replace(tiny(1), states=False, tokens=60), tmp_path / "unused", record=record)
    n = model.config.num_hidden_layers
    train = rd.load_distill(model, record, "train", layers=(2, n - 1), final=True, width=16)
    val = rd.load_distill(model, record, "val", layers=(2, n - 1), final=True, width=16)
    ref = teacher_outputs(model, train.tokens[:2].tolist(), TeacherConfig(layers=(2,), top_k=1, batch_size=2))
    torch.testing.assert_close(train.final[:2].float(), ref.final.float(), rtol=0.02, atol=0.02)
    assert train.card["labels"].startswith("hard") and set(train.states) == {2, n - 1}

    trimmed = resolve_vocab(model, tok, torch.unique(train.top_ids).tolist())
    cfg = DistillConfig(heads=2, steps=2, batch_size=8, warmup=1, vocab=None, branch=3, eval_positions=64,
                        milestones=MILESTONES, ckpt_every_s=1e9)
    done = distill_with_curve(MedusaHeads(model, 2, norm=True, shared_lm_head=True), train, trimmed, cfg,
                              torch.arange(len(train.tokens)), tmp_path / "m.pt", progress=False, val=val,
                              val_rows=torch.arange(len(val.tokens)), curve_dir=tmp_path / "m" / "curve")
    assert not done["stopped"] and 0.0 <= done["curve"][-1]["val_agreement"] <= 1.0
    ecfg = EagleTrainConfig(head=HeadConfig(layers=(2, n - 1, n), vocab=None), steps=2, batch_rows=2, warmup=1,
                            ttt_steps=2, val_frac=0.2, eval_every=2, ckpt_every=2, bf16=False)
    _, card = train_eagle(model, train, ecfg, tmp_path / "e", resume=False, progress=False)
    assert card["steps"] == 2
    from dvi_lite.methods.eagle.train import prepare_smollm2 as eagle_recipe  # prepare's recipe, on the record

    card = eagle_recipe("course", tmp_path / "recipe", "pytest", smoke=True, data=record)
    assert card["steps"] == 3 and (tmp_path / "recipe" / "head.pt").is_file()
