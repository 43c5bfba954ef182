"""`generate()`: any registered method on any prompt, through the one loop (or HF's, for its baselines)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Union

import torch
from transformers.generation.streamers import BaseStreamer

from dvi_lite.core.engine import Stats, decode
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import TINY_TEMPERATURE, Sampler, make_generator


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    text: str  # decoded new tokens
    stats: Stats
    method: str


CHAT_ROLES = ("system", "user", "assistant")
Prompt = Union[str, list[int], list[dict]]  # raw text, token ids, or chat messages [{"role", "content"}]


def check_messages(messages: list) -> list[dict]:
    """Chat messages as the chat template expects them, or a ValueError naming what is wrong."""
    if not messages:
        raise ValueError("prompt is empty: give at least one chat message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        missing = [key for key in ("role", "content") if key not in m]
        if missing:
            raise ValueError(f"chat message {i} has no {' and no '.join(map(repr, missing))}: each message needs "
                             f"'role' (one of {', '.join(CHAT_ROLES)}) and 'content' (a str)")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"chat message {i} has role {m['role']!r}; the allowed roles: {', '.join(CHAT_ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"chat message {i} ({m['role']}) must have str content, got {type(m['content']).__name__}")
        utf8(m["content"], f"chat message {i}'s content")
    return list(messages)


def utf8(text: str, what: str) -> str:
    """`text` if it is valid Unicode; a command line's undecodable bytes arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise ValueError(f"{what} is not valid UTF-8 text (bytes {bad!r} at character {e.start}); "
                         "give the text in UTF-8") from None
    return text


def has_chat_template(tokenizer) -> bool:
    """Whether chat messages can be given to this tokenizer (SmolLM2's has a template; the course model's has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The token ids a prompt stands for: the one place that turns prompts into ids (generate, the bench).

    A str is a raw continuation, tokenized without special tokens (as the course model was trained); a
    list of ints is taken as is; a list of chat messages goes through the tokenizer's chat template with
    the generation prompt added (the assistant turn the model should write), as instruct models expect.
    """
    if isinstance(prompt, str):
        return tokenizer(utf8(prompt, "prompt"), add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and any(isinstance(m, dict) for m in prompt):
        messages = check_messages(prompt)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template, so chat messages cannot be used with it; "
                             "give the prompt as a str (a raw continuation) or as token ids")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    raise TypeError(f"prompt must be a str, a list of token ids or a list of chat messages "
                    f"[{{'role': ..., 'content': ...}}], got {type(prompt).__name__}")


def validate(model, tokenizer, prompt: Prompt, max_new_tokens: int) -> list[int]:
    """The prompt's token ids, after checking them and max_new_tokens against the model."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and len(ids) + max_new_tokens > ctx:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"context of {ctx} positions; shorten the prompt or lower max_new_tokens")
    vocab = model.get_output_embeddings().weight.shape[0]
    if max(ids) >= vocab or min(ids) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
    return ids


def generate(model, tokenizer, prompt: Prompt, method: str = "ar", max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
             stop_at_eos: bool = True, **method_kwargs) -> GenerationResult:
    """Generate with any registered method. Greedy (temperature=0) output is identical for every method.

    prompt: a str (raw continuation), token ids, or chat messages [{"role": "user", "content": ...}]
    (the tokenizer's chat template is applied, with the generation prompt).

    method_kwargs are the method's options (e.g. sps: draft_model=..., K=4), checked against the registry.
    """
    spec = get_method(method)
    if not isinstance(stop_at_eos, bool):
        raise ValueError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    sampler = Sampler(temperature, top_k, top_p)
    if not spec.engine and 0 < sampler.temperature < TINY_TEMPERATURE:
        raise ValueError(f"temperature {temperature!r}: transformers' generate (method {method!r}) divides the "
                         f"logits by it and overflows below {TINY_TEMPERATURE}; use 0 (greedy) or a temperature "
                         f">= {TINY_TEMPERATURE} (the package's own loop takes any temperature >= 0)")
    ids = validate(model, tokenizer, prompt, max_new_tokens)
    eos = tokenizer.eos_token_id if stop_at_eos else None
    built = spec.build(model, tokenizer, **method_kwargs)
    if not spec.engine:  # an HF baseline: its generate() kwargs
        new, stats = _hf_generate(model, ids, max_new_tokens, sampler, seed, eos, built.kwargs)
    else:
        runner = Runner.for_model(model)
        gen = make_generator(seed, runner.device)
        new, stats = decode(runner, built, ids, max_new_tokens, sampler, gen, eos)
    return GenerationResult(new, tokenizer.decode(new), stats, method)


@torch.no_grad()
def _hf_generate(model, ids, max_new_tokens, sampler: Sampler, seed, eos, extra: dict) -> tuple[list[int], Stats]:
    """transformers' own generate (and assisted generation), timed the same way as ours."""
    gen_kw: dict = {"max_new_tokens": max_new_tokens, "do_sample": not sampler.greedy,
                    "pad_token_id": model.config.pad_token_id, "eos_token_id": eos, **extra}
    if not sampler.greedy:
        gen_kw.update(temperature=sampler.temperature, top_k=sampler.top_k or None, top_p=sampler.top_p)
    if seed is not None:
        torch.manual_seed(seed)
    dev = model.get_output_embeddings().weight.device
    x = torch.tensor([ids], device=dev)
    first = _FirstToken(dev)
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), streamer=first, **gen_kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    new = out[0, len(ids):].tolist()
    prefill_s = (first.at - t0) if first.at is not None else 0.0
    return new, Stats(prompt_tokens=len(ids), new_tokens=len(new), prefill_s=prefill_s,
                      total_s=time.perf_counter() - t0)


class _FirstToken(BaseStreamer):
    """Notes when HF's generate emits its first new tokens, the end of its prefill, so that its decode-phase rate
    is measured as ours is. (Assisted generation emits the first draft's accepted tokens with its first token, so
    its prefill includes one verification.)"""

    def __init__(self, device: torch.device):
        self.device, self.calls, self.at = device, 0, None

    def put(self, value) -> None:
        self.calls += 1  # the first call is the prompt
        if self.calls == 2:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.at = time.perf_counter()

    def end(self) -> None:
        pass
