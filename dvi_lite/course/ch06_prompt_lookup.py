"""Chapter 06 (prompt lookup): what the notebook calls.

Prompt lookup drafts by copying: the last n tokens of the text (n = max_ngram down to 1) are looked up earlier in
the prompt or the answer so far, and the K tokens that followed the most recent match are proposed
(methods/pld.py). There is no draft model, so c ≈ 0; a step without a match drafts nothing and costs one AR step.

In greedy decoding the output is AR's, token for token in fp32, so which drafts verification accepts depends only
on AR's answer: a draft token is accepted exactly when it equals the next token of that answer. `replay` runs the
package's own proposer over a finished (prompt, answer) pair and returns every step's (depth, accepted) without the
model, the τ that pld will measure. That makes prompt lookup's speedup a property of the text: high where answers
copy the prompt (summaries, retrieval answers, translations that keep names and numbers), near 1 on open chat.

    replay(prompt_ids, answer_ids, K=6)       -> [(depth, accepted), ...] per step (engine order)
    tau_by_group(rows)                        -> {group: {"tau", "alpha", "copied", "steps", "n"}}
    match_html(tok, tokens, K)                -> the last n-gram, its earlier occurrence and the proposed copy
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from dvi_lite.core.engine import acceptance_rate
from dvi_lite.methods.pld import PromptLookupDrafter


def replay(prompt_ids: Sequence[int], answer_ids: Sequence[int], K: int = 6, max_ngram: int = 3,
           max_new_tokens: int | None = None) -> list[tuple[int, int]]:
    """The (draft depth, accepted) of every step greedy pld takes to write `answer_ids` after `prompt_ids`.

    The first answer token comes from the prefill; each step then proposes up to min(K, remaining - 1) tokens from
    prompt + answer so far and keeps the longest prefix that matches the answer, plus one token of the target's.
    max_new_tokens: the budget the answer was generated with (default: its length), which caps the last drafts.
    """
    drafter = PromptLookupDrafter(K, max_ngram)
    budget = len(answer_ids) if max_new_tokens is None else max_new_tokens
    tokens, i, log = list(prompt_ids) + list(answer_ids[:1]), 1, []
    while i < len(answer_ids):
        room = min(K, budget - i - 1)
        draft = drafter.lookup(tokens, room) if room > 0 else []
        acc = 0
        while acc < len(draft) and i + acc < len(answer_ids) and draft[acc] == answer_ids[i + acc]:
            acc += 1
        log.append((len(draft), acc))
        tokens += list(answer_ids[i:i + acc + 1])
        i += acc + 1
    return log


def tau_by_group(rows: Iterable[dict], K: int = 6, max_ngram: int = 3) -> dict[str, dict]:
    """Per task group, from rows {"group", "prompt_ids", "answer_ids"}: pld's τ (tokens per target forward), α, the
    share of answer tokens that came from a copy ("copied"), the number of steps and of rows; "all" pools them."""
    logs: dict[str, list] = {}
    sizes: dict[str, list[int]] = {}
    for r in rows:
        log = replay(r["prompt_ids"], r["answer_ids"], K, max_ngram)
        for g in (r["group"], "all"):
            logs.setdefault(g, []).extend(log)
            sizes.setdefault(g, []).append(len(r["answer_ids"]))
    out = {}
    for g, log in logs.items():
        accepted = sum(a for _, a in log)
        out[g] = {"tau": (accepted + len(log)) / len(log) if log else None, "alpha": acceptance_rate(log),
                  "copied": accepted / max(1, sum(sizes[g]) - len(sizes[g])), "steps": len(log), "n": len(sizes[g])}
    return out


def match_html(tok, tokens: Sequence[int], K: int = 6, max_ngram: int = 3, context: int = 12) -> str:
    """The lookup at the end of `tokens`, as HTML: the matched n-gram where it occurred before (blue), the tokens
    that followed it there and that pld proposes (green), and the same n-gram at the end (blue)."""
    drafter = PromptLookupDrafter(K, max_ngram)
    draft = drafter.lookup(list(tokens), K)
    if not draft:
        return "<div style='font-family:monospace'>no earlier occurrence of the last token: nothing to propose</div>"
    n = next(n for n in range(min(max_ngram, len(tokens) - 1), 0, -1)
             if drafter.index[n - 1].get(tuple(tokens[-n:])) is not None)
    start = drafter.index[n - 1][tuple(tokens[-n:])]

    def text(ids: Sequence[int]) -> str:
        return html.escape(tok.decode(list(ids))).replace("\n", "↵")

    def span(ids: Sequence[int], colour: str) -> str:
        return f"<span style='background:{colour}'>{text(ids)}</span>"

    earlier = (text(tokens[max(0, start - n - context):start - n]) + span(tokens[start - n:start], "#a9cdf5")
               + span(tokens[start:start + len(draft)], "#b7e4b0") + text(tokens[start + len(draft):start + len(draft)
                                                                               + context]))
    now = text(tokens[max(0, len(tokens) - n - context):len(tokens) - n]) + span(tokens[-n:], "#a9cdf5")
    return (f"<div style='font-family:monospace;line-height:1.7'>earlier: …{earlier}…<br>now: …{now}"
            f"<span style='background:#b7e4b0;opacity:0.6'>{text(draft)}</span> ← proposed ({len(draft)} tokens, "
            f"{n}-gram match)</div>")
