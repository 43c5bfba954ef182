"""dvi_lite.methods.sps.draft / train: the shared-embedding SpS draft (SmolLM2's recipe) on the course model.

The recipe's smoke run (tiny teacher, 3 steps) writes draft.pt + card; the loaded draft shares the target's
embedding (the very tensor), sps with it is lossless (greedy = AR), transformers' assisted generation accepts
it, a trimmed head scores the full vocabulary with -inf off its map, and the default draft of a model is found
whatever dtype the model is loaded in.
"""
from __future__ import annotations

import json

import pytest
import torch

import dvi_lite
from dvi_lite.methods.params import added_parameters
from dvi_lite.methods.sps import draft as sps_draft
from dvi_lite.methods.sps.draft import (
    DRAFT_FILE,
    TrimmedLMHead,
    build_draft,
    draft_vocab_size,
    load_draft,
    resolve_draft,
    save_draft,
)
from dvi_lite.methods.sps.train import TrainConfig, lr_at, prepare_smollm2, split_rows
from dvi_lite.models.loading import COURSE_MODEL, DRAFT_MODEL

PROMPTS = ["def add(a, b):", "The history of the", "Once upon a time", "import numpy as np\n"]
NEW = 24


@pytest.fixture(scope="module")
def course():
    return dvi_lite.load_model("course")


@pytest.fixture(scope="module")
def smoke(course, tmp_path_factory):
    out = tmp_path_factory.mktemp("sps")
    card = prepare_smollm2(str(COURSE_MODEL), out, "pytest smoke", smoke=True)
    return out, card


def test_smoke_recipe_writes_draft_and_card(smoke):
    out, card = smoke
    assert (out / DRAFT_FILE).is_file() and json.loads((out / "card.json").read_text())["steps"] == 3
    for key in ("data", "steps", "command", "commit", "device", "wall_time_s", "init", "final"):
        assert key in card, key
    assert 0.0 <= card["final"]["val_agreement"] <= 1.0
    body = torch.load(out / DRAFT_FILE, weights_only=True)
    assert all(v.dtype == torch.float16 for v in body["state"].values())
    assert not any("embed" in k or "lm_head" in k for k in body["state"])  # the shared tables are not stored
    assert body["layers"] == list(TrainConfig.layers)


def test_loaded_draft_shares_the_targets_embedding(course, smoke):
    model, _ = course
    draft = resolve_draft(model, smoke[0])
    assert draft.get_input_embeddings().weight is model.get_input_embeddings().weight
    assert draft.get_output_embeddings() is model.get_output_embeddings()
    assert draft.config.num_hidden_layers == len(TrainConfig.layers)
    assert resolve_draft(model, smoke[0]) is draft  # loaded once per model
    own = sum(p.numel() for p in draft.model.layers.parameters()) + draft.model.norm.weight.numel()
    assert added_parameters(model, "sps", None, draft_model=smoke[0]) == own


@pytest.mark.parametrize("k", [1, 3])
def test_sps_with_the_shared_draft_is_greedy_lossless(course, smoke, k):
    model, tok = course
    for p in PROMPTS:
        ar = dvi_lite.generate(model, tok, p, method="ar", max_new_tokens=NEW, stop_at_eos=False)
        out = dvi_lite.generate(model, tok, p, method="sps", draft_model=smoke[0], K=k, max_new_tokens=NEW,
                                stop_at_eos=False)
        assert out.token_ids == ar.token_ids, p


def test_hf_assisted_accepts_the_shared_draft(course, smoke):
    model, tok = course
    for p in PROMPTS[:2]:
        ar = dvi_lite.generate(model, tok, p, method="ar", max_new_tokens=NEW)
        hf = dvi_lite.generate(model, tok, p, method="hf_assisted", draft_model=smoke[0], K=3, max_new_tokens=NEW)
        assert hf.token_ids == ar.token_ids, p


def test_trimmed_head_draft_round_trip(course, tmp_path):
    model, tok = course
    ids = torch.arange(0, 8192, 3)
    draft = build_draft(model, [0, 11], ids)
    save_draft(draft, model, tmp_path)
    back = load_draft(model, tmp_path)
    assert isinstance(back.lm_head, TrimmedLMHead) and draft_vocab_size(back) == 8192
    assert torch.equal(back.lm_head.ids.cpu(), ids)
    x = torch.tensor([[5, 17, 300]])
    logits = back(x).logits  # (1, 3, V)
    off = torch.ones(8192, dtype=torch.bool)
    off[ids] = False
    assert torch.isinf(logits[..., off]).all() and torch.isfinite(logits[..., ids]).all()
    assert torch.allclose(back.model.layers[1].mlp.up_proj.weight, model.model.layers[11].mlp.up_proj.weight.half()
                          .float())
    ar = dvi_lite.generate(model, tok, PROMPTS[0], method="ar", max_new_tokens=NEW, stop_at_eos=False)
    out = dvi_lite.generate(model, tok, PROMPTS[0], method="sps", draft_model=tmp_path, K=3, max_new_tokens=NEW,
                            stop_at_eos=False)
    assert out.token_ids == ar.token_ids


def test_default_draft_found_whatever_the_dtype(course, smoke, monkeypatch):
    model, _ = course
    assert sps_draft.default_draft_path(model) == DRAFT_MODEL  # the course model: its own draft model
    m16, _ = dvi_lite.load_model("course", dtype="bfloat16")
    assert next(resolve_draft(m16).parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(sps_draft, "artifacts_dir", lambda m: smoke[0].parent)  # as if trained for this model
    (smoke[0].parent / "sps").mkdir(exist_ok=True)
    (smoke[0].parent / "sps" / DRAFT_FILE).write_bytes((smoke[0] / DRAFT_FILE).read_bytes())
    for m in (model, m16):
        d = resolve_draft(m)
        assert d.get_input_embeddings() is m.get_input_embeddings()
        assert d.model.layers[0].self_attn.q_proj.weight.dtype == m.dtype


def test_errors_name_the_problem(course, target, smoke):
    model, _ = course
    with pytest.raises(ValueError, match="draft_model .* was trained for the model .*, not this one"):
        load_draft(target, smoke[0])
    with pytest.raises(FileNotFoundError, match="draft_model"):
        load_draft(model, smoke[0] / "nothing")
    with pytest.raises(ValueError, match="draft layers"):
        build_draft(model, [12])
    with pytest.raises(ValueError, match="vocabulary"):
        resolve_draft(model, target)


def test_split_and_schedule():
    tr, va = split_rows(20, TrainConfig())
    assert len(va) == 2 and sorted(torch.cat([tr, va]).tolist()) == list(range(20))
    cfg = TrainConfig(steps=100, warmup=10)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(cfg.min_lr_frac, abs=1e-3)
    with pytest.raises(ValueError, match="needs >= 2"):
        split_rows(1, TrainConfig())


def test_sps_sizing_names_a_missing_draft(tmp_path, capsys):
    """sps-sizing refuses a folder without draft.pt before loading anything, naming --drafts."""
    from dvi_lite.methods.sps import sizing

    with pytest.raises(SystemExit) as e:
        sizing.main(["--drafts", str(tmp_path)])
    assert e.value.code == 2
    assert "--drafts" in capsys.readouterr().err


def test_sizing_apply_writes_the_picks_best_k_and_sps_reads_it(tmp_path, monkeypatch):
    """`sps-sizing --apply`: the chosen draft's best K goes into defaults.json, and SpS (and HF assisted) draft
    with it when no K is given; a draft of one's own keeps the fallback."""
    import json

    from dvi_lite.methods.sps import drafter
    from dvi_lite.methods.sps.sizing import apply

    result = tmp_path / "sizing.json"
    result.write_text(json.dumps({"best_layers": 2, "rows": [
        {"layers": 1, "best_K": 1, "alpha": 0.1, "c": 0.05}, {"layers": 2, "best_K": 3, "alpha": 0.2, "c": 0.09}]}))
    defaults = tmp_path / "defaults.json"
    defaults.write_text(json.dumps({"split": 4}))
    entry = apply(result, defaults)
    assert entry["K"] == 3 and json.loads(defaults.read_text()) == {"split": 4, "sps": entry}
    monkeypatch.setattr(drafter, "model_defaults", lambda model: json.loads(defaults.read_text()))
    assert drafter.sized_k(object()) == 3 and drafter.sized_k(object(), draft_model="mine") == 4
