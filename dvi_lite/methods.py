"""`generate()` and the method registry: every method is a name -> drafter factory.

Methods register themselves with `@register("name")`; the bench CLI and the notebooks list them
from `METHODS`. `hf` and `hf_assisted` wrap transformers' own `generate` as reference baselines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from dvi_lite.engine import Drafter, Stats, decode
from dvi_lite.runner import Runner
from dvi_lite.sampling import Sampler, make_generator

METHODS: dict[str, Callable[..., Drafter | dict]] = {}  # name -> factory(model, tokenizer, **options)


def register(name: str):
    def deco(factory):
        METHODS[name] = factory
        return factory
    return deco


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    text: str  # decoded new tokens
    stats: Stats
    method: str


@register("ar")
def _ar(model, tokenizer, **kw) -> Drafter:
    """Plain autoregressive decoding: the engine with a drafter that proposes nothing."""
    _no_extra("ar", kw)
    return Drafter()


def _no_extra(method: str, kw: dict) -> None:
    if kw:
        raise TypeError(f"method {method!r} takes no options {sorted(kw)}")


@register("hf")
def _hf(model, tokenizer, **kw) -> dict:
    """transformers' `generate` (greedy or sampling): the reference baseline, not our engine."""
    _no_extra("hf", kw)
    return {}


@register("hf_assisted")
def _hf_assisted(model, tokenizer, draft_model=None, k: int = 4, **kw) -> dict:
    """transformers' assisted generation with the same draft model as `sps` (constant K)."""
    _no_extra("hf_assisted", kw)
    from dvi_lite.sps import check_k, resolve_draft

    return {"assistant_model": resolve_draft(model, draft_model), "num_assistant_tokens": check_k(k),
            "num_assistant_tokens_schedule": "constant"}


def _runner(model) -> Runner:
    r = getattr(model, "_dvi_runner", None)
    if r is None:
        r = Runner(model)
        model._dvi_runner = r  # cache the layer handles on the model (cheap, avoids per-call setup)
    return r


def validate(model, tokenizer, prompt, max_new_tokens: int) -> list[int]:
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
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


def generate(model, tokenizer, prompt: str | list[int], method: str = "ar", max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
             stop_at_eos: bool = True, **method_kwargs) -> GenerationResult:
    """Generate with any registered method. Greedy (temperature=0) output is identical for every method.

    method_kwargs go to the method's drafter (e.g. sps: draft_model=..., k=4).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    sampler = Sampler(temperature, top_k, top_p)
    ids = validate(model, tokenizer, prompt, max_new_tokens)
    eos = tokenizer.eos_token_id if stop_at_eos else None
    drafter = METHODS[method](model, tokenizer, **method_kwargs)
    if isinstance(drafter, dict):  # an HF baseline: its generate() kwargs
        new, stats = _hf_generate(model, ids, max_new_tokens, sampler, seed, eos, drafter)
    else:
        gen = make_generator(seed, _runner(model).device)
        new, stats = decode(_runner(model), drafter, ids, max_new_tokens, sampler, gen, eos,
                            max_draft=getattr(drafter, "max_draft", 16))
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
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), **gen_kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    new = out[0, len(ids):].tolist()
    return new, Stats(prompt_tokens=len(ids), new_tokens=len(new), total_s=time.perf_counter() - t0)
