"""Chat prompts: a list of messages goes through the tokenizer's chat template (SmolLM2's tokenizer,
loaded alone: cheap); malformed messages and tokenizers without a template get clear errors."""
from __future__ import annotations

import pytest
import torch
from helpers import StubTokenizer, tiny_cfg
from test_smollm2 import smollm2_tokenizer
from transformers import LlamaForCausalLM

import dvi_lite
from dvi_lite.core.generate import CHAT_ROLES, prompt_ids

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_messages_use_the_chat_template_with_the_generation_prompt(tok):
    ids = prompt_ids(tok, MESSAGES)
    ref = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == list(ref["input_ids"])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and "What is 2 + 2?" in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES,
                   {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    assert "Be brief." in tok.decode(prompt_ids(tok, with_system))


def test_str_and_ids_are_unchanged(tok):
    assert prompt_ids(tok, "Hello") == tok("Hello", add_special_tokens=False)["input_ids"]
    assert prompt_ids(tok, [5, 6, 7]) == [5, 6, 7]
    assert "<|im_start|>" not in tok.decode(prompt_ids(tok, "Hello"))  # a str stays a raw continuation


def test_generate_takes_messages(tok):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_cfg(vocab=len(tok), layers=1, d=16, heads=2, kv_heads=1, ffn=32, max_pos=256)).eval()
    out = dvi_lite.generate(model, tok, MESSAGES, max_new_tokens=4, stop_at_eos=False)
    assert out.stats.prompt_tokens == len(prompt_ids(tok, MESSAGES)) and len(out.token_ids) == 4
    ids = dvi_lite.generate(model, tok, prompt_ids(tok, MESSAGES), max_new_tokens=4, stop_at_eos=False)
    assert ids.token_ids == out.token_ids


@pytest.mark.parametrize("messages, why", [
    ([{"content": "hi"}], "message 0 has no 'role'"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{}], "no 'role' and no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "message 1 has role 'bot'.*" +
     ", ".join(CHAT_ROLES)),
    ([{"role": "user", "content": 3}], "str content"),
    ([{"role": "user", "content": "a"}, "b"], "message 1 must be a dict"),
])
def test_malformed_messages(tok, messages, why):
    with pytest.raises(ValueError, match=why):
        prompt_ids(tok, messages)


def test_other_bad_prompts(tok):
    with pytest.raises(TypeError, match="prompt must be a str, a list of token ids or a list of chat messages"):
        prompt_ids(tok, [1, "a"])
    with pytest.raises(TypeError, match="prompt must be"):
        prompt_ids(tok, {"role": "user", "content": "x"})


def test_tokenizer_without_a_chat_template():
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(StubTokenizer(), MESSAGES)
    course_tok = dvi_lite.load_model()[1]
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(course_tok, MESSAGES)
