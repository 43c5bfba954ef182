"""dvi_lite.models.loading: load_model's clear errors, and a round trip through save_pretrained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_cfg
from transformers import LlamaForCausalLM

from dvi_lite import load_model
from dvi_lite.models.loading import resolve_device, resolve_dtype

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"


def _checkpoint(tmp_path: Path, **cfg) -> Path:
    """A folder with just a config.json (enough for the checks that run before transformers)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **cfg}))
    return d


def test_missing_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(missing)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="must be a folder"):
        load_model(f)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_model_type(tmp_path):
    with pytest.raises(ValueError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(_checkpoint(tmp_path, model_type="gpt2"))


def test_not_a_causal_lm(tmp_path):
    with pytest.raises(ValueError, match="not a causal LM.*LlamaModel"):
        load_model(_checkpoint(tmp_path, architectures=["LlamaModel"]))


@pytest.mark.parametrize("dtype", ["float8", "int8", torch.float64])
def test_bad_dtype(tmp_path, dtype):
    with pytest.raises(ValueError, match="dtype"):
        load_model(_checkpoint(tmp_path), dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_model(_checkpoint(tmp_path), device="cuda")


@pytest.mark.parametrize("device", ["tpu", "not a device"])
def test_bad_device(device):
    with pytest.raises(ValueError, match="device"):
        resolve_device(device)


def test_resolve_dtype_defaults():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16 and resolve_dtype(torch.float16, "cpu") == torch.float16


@pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="data/tokenizer is not committed here")
def test_load_saved_tiny_model(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_cfg(vocab=len(tok), layers=1, d=16, heads=2, kv_heads=1, ffn=32))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_model(tmp_path, device="cpu")
    assert not loaded.training
    assert loaded.dtype == torch.float32 and loaded.config._attn_implementation == "sdpa"
    assert ltok.pad_token_id is not None
    ids = ltok("def f(x):", add_special_tokens=False)["input_ids"]
    assert ids and ltok.decode(ids) == "def f(x):"
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(loaded(x).logits, model.eval()(x).logits)
    loaded_bf16, _ = load_model(str(tmp_path), dtype="bf16", device="cpu")
    assert loaded_bf16.dtype == torch.bfloat16
