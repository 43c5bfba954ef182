"""The self-distillation set (models/distill_data.py) on the course model at toy sizes: what a shard holds,
that a resumed build redoes nothing, that a half-written shard is rebuilt the same, and the reader."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dvi_lite.models import distill_data as dd
from dvi_lite.models import distill_reader as rd
from dvi_lite.models import prompt_pool as pool
from dvi_lite.models.teacher import TeacherConfig, teacher_outputs


def tiny(tokens: int) -> dd.DistillConfig:
    return dd.DistillConfig(tokens=tokens, layers=(2,), top_k=4, answer_tokens=6, shard_prompts=6,
                            specbench_per_shard=1, gen_batch=6, corpus_windows=2, corpus_len=16, val_every=2)


@pytest.fixture(scope="module")
def course_model():
    from dvi_lite.models.loading import load_model

    return load_model("course", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def built(course_model, tmp_path_factory):
    model, tok = course_model
    folder = tmp_path_factory.mktemp("distill")
    card = dd.build(model, tok, tiny(1), folder)  # one shard reaches one token
    return model, tok, folder, card


def test_shard_holds_every_position(built):
    from safetensors.torch import load_file

    model, _, folder, card = built
    assert card["shards"] == 1 and card["answer_tokens"] > 0
    t = load_file(str(folder / "shard_00000.safetensors"))
    n = int(t["offsets"][-1])
    assert t["ids"].shape == (n,) and t["top_ids"].shape == (n, 4) and t["top_logp"].shape == (n, 4)
    assert t["h2"].shape == (n, model.config.hidden_size) and f"h{model.config.num_hidden_layers}" in t
    meta = json.loads((folder / "shard_00000.json").read_text())
    assert sum(r["prompt_tokens"] + r["answer_tokens"] - 1 for r in meta["rows"]) == n  # no state after the last
    assert {r["source"] for r in meta["rows"]} <= {"specbench", "self_instruct", "template"}
    assert card["by_group"] and sum(g["answer_tokens"] for g in card["by_group"].values()) == card["answer_tokens"]
    # what the generating pass kept (KV-cached, left-padded) is one full forward over the same row, up to
    # rounding (models/teacher.py's reference)
    for r in range(len(t["offsets"]) - 1):
        a, b = int(t["offsets"][r]), int(t["offsets"][r + 1])
        ref = teacher_outputs(model, [t["ids"][a:b].long().tolist()], TeacherConfig(layers=(2,), top_k=4,
                                                                                   batch_size=1))
        torch.testing.assert_close(ref.states[2][0], t["h2"][a:b], rtol=0.02, atol=0.02)
        torch.testing.assert_close(ref.top_logp[0].float(), t["top_logp"][a:b].float(), rtol=0.01, atol=0.01)
        assert (ref.top_ids[0, :, 0].int() == t["top_ids"][a:b, 0]).float().mean() > 0.95


def test_resume_redoes_nothing_and_rebuilds_a_half_written_shard(built):
    model, tok, folder, _ = built
    first = (folder / "shard_00000.safetensors").read_bytes()
    stamp = (folder / "shard_00000.json").stat().st_mtime_ns
    (folder / "junk.safetensors.tmp").write_bytes(b"half a write")  # a kill mid-write leaves a .tmp
    card = dd.build(model, tok, tiny(2 * built[3]["answer_tokens"] + 1), folder)
    assert (folder / "shard_00000.json").stat().st_mtime_ns == stamp  # shard 0 was not redone
    assert (folder / "shard_00000.safetensors").read_bytes() == first
    assert card["shards"] >= 2 and not list(folder.glob("*.tmp"))
    # a shard whose JSON is missing is unfinished: it is rebuilt, deterministically, to the same bytes
    last = f"shard_{card['shards'] - 1:05d}"
    before = (folder / f"{last}.safetensors").read_bytes()
    (folder / f"{last}.json").unlink()
    dd.build(model, tok, tiny(card["answer_tokens"]), folder)
    assert (folder / f"{last}.safetensors").read_bytes() == before
    texts = [pool.normalise(r["text"]) for m in rd.done_shards(folder) for r in m["rows"]]
    assert len(texts) == len(set(texts))  # no duplicate prompt across shards


def test_load_as_teacher(built):
    _, _, folder, _ = built
    whole = rd.load_as_teacher(folder, "train", layers=(2,), width=None)
    assert whole.tokens.shape == whole.mask.shape and whole.states[2].shape[:2] == whole.tokens.shape
    assert whole.n_tokens == whole.card["n_tokens"] == whole.card["set"]["positions"] + whole.card["set"][
        "corpus_positions"] - sum(m["positions"] for m in rd.done_shards(folder) if m["split"] == "val")
    cut = rd.load_as_teacher(folder, "train", layers=(2,), width=8, final=False)
    assert cut.tokens.shape[1] <= 8 and cut.final.numel() == 0
    # windows keep every position of every sequence (a window of 1 position has no target pair: dropped)
    assert whole.n_tokens - cut.n_tokens <= len(whole.tokens)
    real = whole.tokens[whole.mask]
    assert torch.equal(cut.tokens[cut.mask][:8], real[:8])
    # each row's first own-answer position: the prompt's length for a whole sequence, 0 for the corpus windows
    shards = [json.loads(p.read_text()) for p in sorted(folder.glob("shard_*.json"))]
    prompts = [r["prompt_tokens"] for m in shards if m["split"] == "train" for r in m["rows"]]
    got = whole.card["answer_from"]
    assert got[len(got) - len(prompts):] == prompts and set(got[: len(got) - len(prompts)]) <= {0}
    assert len(cut.card["answer_from"]) == len(cut.tokens)
    with pytest.raises(ValueError, match="layers"):
        rd.load_as_teacher(folder, "train", layers=(3,))
    with pytest.raises(ValueError, match="split"):
        rd.load_as_teacher(folder, "test")
    with pytest.raises(FileNotFoundError, match="distill-data"):
        rd.load_as_teacher(folder / "nowhere")


def test_bad_config_names_the_parameter():
    with pytest.raises(ValueError, match="shard_prompts"):
        dd.DistillConfig(shard_prompts=2).check()
    with pytest.raises(ValueError, match="temperatures"):
        dd.DistillConfig(temperatures=(3.0,)).check()


def test_prompt_pool_helpers():
    assert pool.clean_question("1. What is the capital of France?\n\nMore text") == "What is the capital of France?"
    assert pool.clean_question("ok") is None
    long = "Summarize: " + "x" * 5000 + " Question?"
    short = pool.shorten(long, 300)
    assert len(short) == 300 and short.startswith("Summarize:") and short.endswith("Question?")
    passages = pool.Passages(paragraphs=["Alpha Beta text " * 40, "Gamma Delta text " * 40],
                             sentences=["The Python interpreter reads the source file line by line."])
    rng = random.Random(0)
    for g in pool.TEMPLATE_GROUPS:
        p = pool.template_prompt(g, passages, rng)
        assert p["group"] == g and p["text"]
    with pytest.raises(ValueError, match="group"):
        pool.template_prompt("qa", passages, rng)


def test_sps_learning_curve_from_the_set(built, tmp_path):
    """A few SpS steps on the set: a curve point at every milestone passed, each with a snapshot, and a stop by
    the time limit resumes to the same final weights as an uninterrupted run."""
    from dataclasses import replace

    from dvi_lite.methods.sps.train import TrainConfig, distil

    model, _, folder, _ = built
    train = rd.load_as_teacher(folder, "train", width=8, final=False)
    val = rd.load_as_teacher(folder, "val", width=8, final=False)
    cfg = TrainConfig(steps=6, batch_rows=2, warmup=1, autocast=False, milestones=(16, 32), val_max_tokens=64)
    card = distil(model, train, cfg, tmp_path / "a", resume=False, ckpt=tmp_path / "a.pt", val=val)
    tokens = [p["tokens"] for p in card["curve"]]
    assert tokens[0] == 0 and tokens == sorted(tokens) and card["curve"][-1]["step"] == 6
    assert any(t >= 16 for t in tokens) and len(list((tmp_path / "a" / "curve").glob("tokens_*.pt"))) == len(tokens) - 1
    assert all(0.0 <= p["val_agreement"] <= 1.0 for p in card["curve"])
    with pytest.raises(ValueError, match="split"):
        rd.load_as_teacher(folder, "holdout")
    stopped = distil(model, train, replace(cfg, max_minutes=0.0), tmp_path / "b", ckpt=tmp_path / "b.pt", val=val)
    assert stopped["stopped"] and stopped["step"] == 1
    resumed = distil(model, train, replace(cfg, max_minutes=0.0), tmp_path / "b", ckpt=tmp_path / "b.pt", val=val)
    while resumed.get("stopped"):
        resumed = distil(model, train, replace(cfg, max_minutes=0.0), tmp_path / "b", ckpt=tmp_path / "b.pt", val=val)
    a = torch.load(tmp_path / "a" / "draft.pt")["state"]
    b = torch.load(tmp_path / "b" / "draft.pt")["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_decode_with_states_answers_as_generate_does(course_model):
    """The shrinking-batch decoder (finished rows leave the batch) answers as HF generate does, greedy fp32, and
    keeps one state and one top-k per position but the last."""
    from dvi_lite.models.batch_decode import decode_with_states

    model, tok = course_model
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ("def add(a, b):", "The quick brown fox jumps over the lazy dog and", "import os\nimport")]
    rows = decode_with_states(model, prompts, 12, 0.0, 0, tok.eos_token_id, (2,), 4, pad=tok.eos_token_id)
    for p, r in zip(prompts, rows, strict=True):  # HF generate, one prompt at a time
        x = torch.tensor([p])
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert r["answer"].tolist() == (ref[: ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref)
    bare = decode_with_states(model, prompts, 12, 0.0, 0, tok.eos_token_id, (2,), 4, pad=tok.eos_token_id,
                              states=False)
    for b, r in zip(bare, rows, strict=True):
        assert b.keys() == {"ids", "answer"} and torch.equal(b["ids"], r["ids"])
    for p, r in zip(prompts, rows, strict=True):
        n = len(p) + len(r["answer"]) - 1
        assert r["ids"].tolist() == (p + r["answer"].tolist())[:-1]
        assert r["h2"].shape[0] == r["top_ids"].shape[0] == r["top_logp"].shape[0] == n


def test_the_token_record_is_resumed_and_states_are_rebuilt_from_it(built, tmp_path, monkeypatch):
    """states=False keeps only the committed record (ids + JSON), the same tokens a full build writes; a later
    build with states reads the record, generates nothing, and rebuilds the states with one teacher forward."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from dvi_lite.models import distill_record as rec

    model, tok, folder, _ = built
    record = tmp_path / "record"
    card = dd.build(model, tok, replace(tiny(1), states=False), tmp_path / "unused", record=record)
    assert card["shards"] == 1 and not (tmp_path / "unused").exists()
    assert sorted(p.name for p in record.iterdir()) == ["card.json", "shard_00000.json.xz", "shard_00000.npz"]
    full = load_file(str(folder / "shard_00000.safetensors"))
    rows, plen = rec.read_record(record, "shard_00000", whole=False)
    assert [x for r in rows for x in r] == full["ids"].tolist() and torch.equal(plen, full["prompt_len"])
    whole = rec.read_record(record, "shard_00000")[0]
    meta = rec.read_meta(record, "shard_00000")
    assert [len(w) for w in whole] == [r["prompt_tokens"] + r["answer_tokens"] for r in meta["rows"]]
    assert all(w[:-1] == r for w, r in zip(whole, rows, strict=True))
    assert rec.token_rows(record, "train")[0] == (whole[0], int(plen[0]))

    def no_generation(*a, **k):
        raise AssertionError("a recorded shard was generated again")

    monkeypatch.setattr(dd, "build_shard", no_generation)
    states = tmp_path / "states"
    card = dd.build(model, tok, tiny(1), states, record=record)
    again = load_file(str(states / "shard_00000.safetensors"))
    assert card["shards"] == 1 and torch.equal(again["ids"], full["ids"])
    torch.testing.assert_close(again["h2"], full["h2"], rtol=0.02, atol=0.02)
    torch.testing.assert_close(again["top_logp"].float(), full["top_logp"].float(), rtol=0.01, atol=0.01)
    with pytest.raises(ValueError, match="states=False keeps only the token record"):
        dd.build(model, tok, replace(tiny(1), states=False), tmp_path / "x")
    some = tmp_path / "some"  # `only`: the states of the named recorded shards, nothing generated
    card = dd.build(model, tok, tiny(10**9), some, record=record, only=[0])
    assert card["shards"] == 1 and torch.equal(load_file(str(some / "shard_00000.safetensors"))["ids"], full["ids"])
    with pytest.raises(ValueError, match="shards must be recorded"):
        dd.build(model, tok, tiny(1), some, record=record, only=[0, 7])


def test_the_record_as_hard_labels_trains_an_sps_draft(course_model, tmp_path):
    """record_as_teacher: the scored positions are exactly those whose next token is an answer token, each with
    that token as its target; the SpS recipe trains on it unchanged (3 steps, held out on the val shard)."""
    from dataclasses import replace

    from dvi_lite.methods.sps.train import TrainConfig, distil
    from dvi_lite.models import distill_record as rec

    model, tok = course_model
    record = tmp_path / "record"
    card = dd.build(model, tok, replace(tiny(1), states=False, tokens=60), tmp_path / "unused", record=record)
    assert card["shards"] >= 2 and card["val_shards"]  # val_every = 2: shard 1 is held out
    rows = rec.token_rows(record, "train")
    t = rec.record_as_teacher(record, "train", width=16)
    assert t.n_tokens == sum(len(ids) - plen for ids, plen in rows)  # one target per answer token
    i, j = t.mask.nonzero(as_tuple=True)
    assert torch.equal(t.top_ids[i, j, 0], t.tokens[i, j + 1])  # the target is the next token in the row
    val = rec.record_as_teacher(record, "val", width=16)
    cfg = TrainConfig(layers=(0,), vocab=None, steps=3, batch_rows=2, warmup=1, autocast=False, milestones=())
    out = distil(model, t, cfg, tmp_path / "sps", ckpt=tmp_path / "ckpt.pt", val=val)
    assert out["final"]["val_tokens"] == val.n_tokens and 0 <= out["final"]["val_agreement"] <= 1
    assert out["data"]["n_tokens"] == t.n_tokens
    from dvi_lite.models.corpus import load_prompts
    from dvi_lite.study import curves

    rows = curves.curve_tau(model, tok, "sps", tmp_path / "sps" / "curve", load_prompts()[:2], 6, {"K": 3},
                            progress=False)  # the final snapshot loads as a draft and decodes
    assert [r["tokens"] for r in rows] == [out["tokens_seen"]] and 1.0 <= rows[0]["tau"] <= 1 + 3


def test_a_set_without_a_held_out_shard_yet(course_model, tmp_path):
    """The first held-out shard is the val_every-th: before it, missing_ok gives None (the recipes hold out rows
    of their own), and without missing_ok the error says why."""
    from dataclasses import replace

    from dvi_lite.methods.kangaroo.train import load_set
    from dvi_lite.models import distill_reader as rd

    model, tok = course_model
    record = tmp_path / "record"
    dd.build(model, tok, replace(tiny(1), states=False, val_every=5), tmp_path / "unused", record=record)
    assert rd.load_distill(model, record, "val", missing_ok=True) is None
    with pytest.raises(ValueError, match="has no answer token yet"):
        rd.load_distill(model, record, "val")
    train, val = load_set(model, record, 2, 1000)
    assert val is None and train.state(2).shape[:2] == train.tokens.shape


def test_the_committed_record_is_whole():
    """data/smollm2/distill/ (when committed): every shard's ids are there and agree with its JSON and the card."""
    from dvi_lite.models import distill_record as rec
    from dvi_lite.paths import DATA_DIR

    record = DATA_DIR / "smollm2" / "distill"
    if not (record / "card.json").is_file():
        pytest.skip("no committed token record")
    card = json.loads((record / "card.json").read_text())
    metas = rec.shard_metas(record)
    assert [m["shard"] for m in metas] == list(range(card["shards"]))
    assert not list(record.glob("shard_*.json"))  # the committed JSONs are compressed (xz)
    assert sum(m["answer_tokens"] for m in metas) == card["answer_tokens"]
    for m in metas:
        rows, plen = rec.read_record(record, f"shard_{m['shard']:05d}")
        assert [len(r) for r in rows] == [r["prompt_tokens"] + r["answer_tokens"] for r in m["rows"]]
        assert plen.tolist() == [r["prompt_tokens"] for r in m["rows"]]
        assert all(0 <= t < 49152 for r in rows for t in r)
