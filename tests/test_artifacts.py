"""dvi_lite.models.artifacts + dvi_lite.study.prepare: every model gets its own trained pieces, found by default.

The course model's pieces are committed in data/; any other checkpoint's go to build/models/<fingerprint>/,
so the notebooks run unchanged on it after `prepare`, and training for it never overwrites data/.
"""
import json
from pathlib import Path

import pytest
import torch

import dvi_lite
from dvi_lite.models import artifacts


def test_course_fingerprint_is_the_committed_course_model():
    model, _ = dvi_lite.load_model()
    assert artifacts.fingerprint(model) == artifacts.COURSE_FINGERPRINT
    assert artifacts.artifacts_dir(model) == artifacts.DATA_DIR


@pytest.fixture()
def other_model(tmp_path, monkeypatch):
    """A 4-layer random Llama with the course tokenizer, saved as an HF folder; pieces go to tmp."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dvi_lite.course_model.train import TOKENIZER_DIR

    monkeypatch.setenv("DVI_MODELS_DIR", str(tmp_path / "models"))  # seen by notebook kernels too
    tok = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")


@pytest.mark.slow
def test_prepare_trains_every_piece_once_into_the_models_own_folder(other_model, tmp_path):
    """User story 4 in miniature: prepare a new model (each piece once, into its own folder), every method finds
    its piece and stays lossless, then the study notebook (every method) runs on it."""
    import nbformat
    import papermill as pm

    from dvi_lite.study.prepare import PrepareConfig, prepare
    from dvi_lite.study.reproduce import NOTEBOOKS_DIR

    pieces = prepare(other_model, PrepareConfig.smoke())
    model, tok = dvi_lite.load_model(other_model)
    home = artifacts.artifacts_dir(model)
    assert home == tmp_path / "models" / artifacts.fingerprint(model)
    assert all(f.startswith(str(home)) for f in pieces.values())
    mtimes = {k: Path(f).stat().st_mtime_ns for k, f in pieces.items()}
    assert prepare(other_model, PrepareConfig.smoke()) == pieces  # nothing retrained the second time
    assert {k: Path(f).stat().st_mtime_ns for k, f in pieces.items()} == mtimes
    # every method now finds its piece by default, and stays lossless on this model
    ar = dvi_lite.generate(model, tok, "def f(x):", method="ar", max_new_tokens=12, stop_at_eos=False).token_ids
    for method, kw in [("kangaroo", {}), ("medusa", {}), ("draft_verify", {}), ("dvi", {}), ("eagle", {}),
                       ("eagle", {"tree": "chain"})]:
        out = dvi_lite.generate(model, tok, "def f(x):", method=method, max_new_tokens=12, stop_at_eos=False, **kw)
        assert out.token_ids == ar, method
    out = tmp_path / "08.ipynb"
    pm.execute_notebook(str(NOTEBOOKS_DIR / "08_results.ipynb"), str(out), kernel_name="python3",
                        parameters={"MODE": "smoke", "MODEL_PATH": other_model}, cwd=str(NOTEBOOKS_DIR),
                        progress_bar=False)
    done = nbformat.read(out, as_version=4)
    errors = [o for c in done.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.fixture()
def course_copy(tmp_path, monkeypatch):
    """The course model's folder copied, one embedding value nudged (a fingerprint of its own); pieces go to tmp."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dvi_lite.models.loading import COURSE_MODEL

    monkeypatch.setenv("DVI_MODELS_DIR", str(tmp_path / "models"))
    folder = tmp_path / "course_copy"
    shutil.copytree(COURSE_MODEL, folder)  # the tokenizer's link is copied as a file
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][0, 0] += 0.01  # row 0 is one of the fingerprint's probe rows
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_prepare_makes_an_eagle_head_with_its_card_for_a_copy_of_the_course_model(course_copy, capsys):
    """`prepare --model <folder>` trains the EAGLE head by eagle/recipe.py (the teacher set, then the training-time
    test), and writes its card beside it; the head drafts on that model, losslessly. The other pieces are placed
    beforehand (empty files: prepare keeps what exists), so only the EAGLE recipe runs, at smoke sizes."""
    from dvi_lite.study.prepare import PrepareConfig, _pieces, prepare

    model, tok = dvi_lite.load_model(course_copy, dtype="float32")
    assert artifacts.fingerprint(model) != artifacts.COURSE_FINGERPRINT
    for name, f in _pieces(model, 2).items():
        if name != "eagle head":
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
    command = f"python -m dvi_lite prepare --model {course_copy} --smoke"
    pieces = prepare(course_copy, PrepareConfig.smoke(), command=command)
    assert "training eagle head" in capsys.readouterr().out
    head = Path(pieces["eagle head"])
    assert head == artifacts.artifacts_dir(model) / "eagle" / "head.pt" and head.is_file()
    card = json.loads((head.parent / "card.json").read_text())
    assert card["target"] == artifacts.fingerprint(model) and card["head"]["layers"] == [2, 6, 9]
    assert card["data"]["source"].startswith("teacher set") and card["train_tokens_seen"] > 0
    assert card["steps"] == 3 and card["command"] == command and card["commit"] and card["device"]
    ar = dvi_lite.generate(model, tok, "def f(x):", method="ar", max_new_tokens=12).token_ids
    assert dvi_lite.generate(model, tok, "def f(x):", method="eagle", max_new_tokens=12).token_ids == ar


def test_course_model_needs_no_preparation(capsys):
    from dvi_lite.study.prepare import PrepareConfig, prepare

    pieces = prepare(None, PrepareConfig.smoke())
    assert "nothing to train" in capsys.readouterr().out
    assert pieces["kangaroo adapter"].endswith("data/kangaroo/adapter_k2.pt")


def test_fingerprint_names_the_weights_not_their_dtype():
    """A greedy check in fp32 and a bf16 benchmark must find the same committed pieces."""
    from dvi_lite import load_model
    from dvi_lite.models.artifacts import COURSE_FINGERPRINT, artifacts_dir, fingerprint
    from dvi_lite.paths import DATA_DIR

    for dtype in ("float32", "bfloat16", "float16"):
        model, _ = load_model(dtype=dtype)
        assert fingerprint(model) == COURSE_FINGERPRINT, dtype
        assert artifacts_dir(model) == DATA_DIR, dtype


def test_smollm2_pieces_are_committed_and_prepare_keeps_them(capsys):
    """`prepare --model smollm2` finds every committed piece (no --force: nothing is retrained)."""
    from dvi_lite.paths import DATA_DIR
    from dvi_lite.study.prepare import SMOLLM2_RECIPES, PrepareConfig, prepare

    pieces = prepare("smollm2", PrepareConfig())
    out = capsys.readouterr().out
    assert "committed" in out
    assert set(pieces) == {"vocabulary map"} | {name for name, *_ in SMOLLM2_RECIPES}
    for name, f in pieces.items():  # a piece not made yet is named, with how to make it; none is trained here
        assert f.startswith(str(DATA_DIR / "smollm2")), name
        assert Path(f).is_file() or f"--only '{name}'" in out or f"'{name}'" in out, name
    assert all(Path(pieces[name]).is_file() for name in ("vocabulary map", "kangaroo adapter", "dvi head",
                                                         "draft_verify skip set", "medusa heads", "sps draft"))


CALLS: list[tuple[str, dict]] = []


def recipe_reading_the_set(model_path, out_dir, command, smoke=False, data=None):
    CALLS.append(("reads", {"data": data, "smoke": smoke, "model": model_path}))


def recipe_without_data(model_path, out_dir, command, smoke=False):
    CALLS.append(("plain", {"smoke": smoke, "model": model_path}))


def test_prepare_smollm2_hands_the_set_to_the_recipes_that_read_one(monkeypatch, tmp_path, capsys):
    """`prepare --model smollm2 --data FOLDER`: the set goes to each recipe that takes `data`, not to the others;
    another model refuses it with the reason."""
    from dvi_lite.models import vocab
    from dvi_lite.study import prepare as prep

    monkeypatch.setattr(prep, "SMOLLM2_RECIPES", (("a", f"{__name__}:recipe_reading_the_set", ".", "a.pt"),
                                                  ("b", f"{__name__}:recipe_without_data", ".", "b.pt")))
    monkeypatch.setattr(vocab, "build_vocab_map", lambda *a, **k: None)
    from dvi_lite.models import loading

    loads = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a) or real("course", dtype="float32"))
    CALLS.clear()
    prep.prepare("smollm2", prep.PrepareConfig.smoke(), force=True, data=tmp_path / "set")
    handed = CALLS[0][1].pop("model")
    assert CALLS[1][1].pop("model") is handed  # loaded once, handed to every recipe
    assert isinstance(handed, loading.Loaded) and handed.name == "smollm2" and len(loads) == 1
    assert loading.load_once(handed) == (handed.model, handed.tokenizer)
    assert CALLS == [("reads", {"data": tmp_path / "set", "smoke": True}), ("plain", {"smoke": True})]
    assert "the self-distillation set" in capsys.readouterr().out
    with pytest.raises(ValueError, match="data .* is read by SmolLM2's recipes only"):
        prep.prepare("course", prep.PrepareConfig(), data=tmp_path / "set")
