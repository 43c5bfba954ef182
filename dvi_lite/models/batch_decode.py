"""Batched decoding that keeps the target's outputs at every position and drops finished rows as it goes.

The self-distillation set (models/distill_data.py) needs, for each prompt + answer, the states after some layers
and the target's top-k log-probs at every position. Generating already runs the full model over every position
(the prompt at prefill, then one token a step), so forward hooks keep those states as they are computed, and
the top-k comes from the logits the step computes anyway: no second teacher forward.

HF `generate` keeps a finished row in the batch until every row is done. Answers here run from a few tokens
to 256, so about half of its compute would go to rows already finished. This loop removes a row from the batch
and from the KV cache (`DynamicCache.batch_select_indices`) at its EOS, so every token computed is kept.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from dvi_lite.core.runner import Runner


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """(b, V) -> (b,): greedy at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(1).to(logits.device)


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) logits -> the top-k ids (int32) and log-probs (fp16) under the full softmax."""
    v, i = logits.float().log_softmax(-1).topk(k, dim=-1)
    return i.to("cpu", torch.int32), v.to("cpu", torch.float16)


@torch.no_grad()
def decode_with_states(model, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
                       eos: int | None, layers: tuple[int, ...], top_k: int, pad: int = 0,
                       states: bool = True) -> list[dict]:
    """Answer every prompt (left-padded together) and keep, at every position of prompt + answer but the last
    token (whose forward never runs), `ids`, the state after each of `layers` and after the last layer (bf16),
    and the target's `top_ids` / `top_logp`. Returns one dict of tensors per prompt, plus `answer` (its ids).
    states=False keeps `ids` and `answer` only (no hooks, no top-k over the prompt: the same tokens, cheaper)."""
    runner = Runner.for_model(model)
    last_layer = runner.n_layers
    keep = sorted(set(layers)) + [last_layer] if states else []
    dev = runner.device
    cur: dict[int, torch.Tensor] = {}

    def hook(k: int):
        def fn(_module, _args, out):
            cur[k] = (out[0] if isinstance(out, tuple) else out).detach()  # (b, t, D)
        return fn

    handles = [runner.layers[k - 1].register_forward_hook(hook(k)) for k in keep]
    try:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)  # (B, W)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        pos = (att.cumsum(-1) - 1).clamp(min=0)  # (B, W)
        cache = DynamicCache(config=model.config)
        gen = torch.Generator().manual_seed(seed)
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
        parts: list[dict[str, list[torch.Tensor]]] = [{} for _ in prompts]
        for r, p in enumerate(prompts if states else []):  # the prompt positions: states, top-k from the last state
            h = {k: cur[k][r, width - len(p):] for k in keep}  # (len, D)
            ti, tl = _top(runner.logits(h[last_layer]), top_k)
            parts[r] = {**{f"h{k}": [h[k].to("cpu", torch.bfloat16)] for k in keep}, "top_ids": [ti],
                        "top_logp": [tl]}
        answers: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        next_pos = torch.tensor([len(p) for p in prompts], device=dev)  # (b,)
        while True:
            tok = _pick(logits, temperature, gen)  # (b,)
            for r, t in zip(active, tok.tolist(), strict=True):
                answers[r].append(t)
            going = [i for i, r in enumerate(active) if answers[r][-1] != eos and len(answers[r]) < max_new]
            if not going:
                break
            if len(going) < len(active):  # finished rows leave the batch and the cache
                sel = torch.tensor(going, device=dev)
                cache.batch_select_indices(sel)
                att, tok, next_pos = att[sel], tok[sel], next_pos[sel]
                active = [active[i] for i in going]
            att = torch.cat([att, att.new_ones(len(active), 1)], dim=1)
            logits = model(input_ids=tok[:, None], attention_mask=att, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]  # (b, V)
            if not states:
                next_pos = next_pos + 1
                continue
            ti, tl = _top(logits, top_k)
            for i, r in enumerate(active):
                for k in keep:
                    parts[r][f"h{k}"].append(cur[k][i].to("cpu", torch.bfloat16))
                parts[r]["top_ids"].append(ti[i:i + 1])
                parts[r]["top_logp"].append(tl[i:i + 1])
            next_pos = next_pos + 1
    finally:
        for h in handles:
            h.remove()
    rows = []
    for p, a, part in zip(prompts, answers, parts, strict=True):
        row = {key: torch.cat(v) for key, v in part.items()}
        row["ids"] = torch.tensor((p + a)[:-1], dtype=torch.int32)
        row["answer"] = torch.tensor(a, dtype=torch.int32)
        assert all(len(v) == len(row["ids"]) for key, v in row.items() if key != "answer"), "positions misaligned"
        rows.append(row)
    return rows
