"""`generate()`: any registered method on any prompt, through the one loop (or HF's, for its baselines)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dvi_lite.core.engine import Stats, decode
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator

@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    text: str  # decoded new tokens
    stats: Stats
    method: str


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

    method_kwargs are the method's options (e.g. sps: draft_model=..., k=4), checked against the registry.
    """
    spec = get_method(method)
    sampler = Sampler(temperature, top_k, top_p)
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
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), **gen_kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    new = out[0, len(ids):].tolist()
    return new, Stats(prompt_tokens=len(ids), new_tokens=len(new), total_s=time.perf_counter() - t0)
