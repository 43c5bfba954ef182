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
    best_copy_point(prompt_ids, answer_ids)   -> where in an answer the longest copy was accepted (for match_html)
    contrast_pair(rows)                       -> a copy-heavy row and a chat row (the notebook's experiment)
    check_invariants(...)                     -> notebook 06's claims (correctness only), one line each
"""
from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

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


def tau_by_group(rows: Iterable[dict], K: int = 6, max_ngram: int = 3,
                 max_new_tokens: int | None = None) -> dict[str, dict]:
    """Per task group, from rows {"group", "prompt_ids", "answer_ids"}: pld's τ (tokens per target forward), α, the
    share of answer tokens that came from a copy ("copied"), the number of steps and of rows; "all" pools them.
    max_new_tokens: the budget the answers were generated with (see `replay`; default: each answer's length)."""
    logs: dict[str, list] = {}
    sizes: dict[str, list[int]] = {}
    for r in rows:
        log = replay(r["prompt_ids"], r["answer_ids"], K, max_ngram, max_new_tokens)
        for g in (r["group"], "all"):
            logs.setdefault(g, []).extend(log)
            sizes.setdefault(g, []).append(len(r["answer_ids"]))
    out = {}
    for g, log in sorted(logs.items(), key=lambda kv: kv[0] == "all"):  # the pooled row last
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


def best_copy_point(prompt_ids: Sequence[int], answer_ids: Sequence[int], K: int = 6, max_ngram: int = 3) -> int:
    """How many answer tokens were written when the step that accepted the most draft tokens began (the first such
    step; 1 if nothing was ever accepted): `match_html(tok, prompt_ids + answer_ids[:i])` then shows that lookup."""
    i, best, at = 1, 0, 1
    for _, acc in replay(prompt_ids, answer_ids, K, max_ngram):
        if acc > best:
            best, at = acc, i
        i += acc + 1
    return at


def contrast_pair(rows: Sequence[dict], copy: str = "translation", chat: str = "multi-turn") -> tuple[dict, dict]:
    """The first row of the `copy` group and of the `chat` group; without those groups (the course model's code and
    prose prompts) the first rows of the groups with the highest and the lowest replayed τ."""
    groups = {r["group"] for r in rows}
    if not {copy, chat} <= groups:
        if len(groups) < 2:
            raise ValueError(f"contrast_pair needs rows from two task groups, got {sorted(groups)}")
        by_tau = tau_by_group(rows)
        ranked = sorted(groups, key=lambda g: -by_tau[g]["tau"])
        copy, chat = ranked[0], ranked[-1]
    return next(r for r in rows if r["group"] == copy), next(r for r in rows if r["group"] == chat)


def check_invariants(rows: Sequence[dict], max_new_tokens: int, fp32: bool, by_text: dict, by_run: dict,
                     bench_res: dict, methods: list[str], committed: Sequence[Path]) -> list[str]:
    """Notebook 06's claims, correctness only (never timing): replaying pld's own output gives its very steps in any
    dtype; in fp32 greedy pld writes AR's tokens; every τ >= 1 and α in [0, 1]; the token view accounts for every
    new token; the benchmark has its rows; the committed study files hold pld's per-group rows.

    rows: {"group", "prompt_ids", "answer_ids" (AR's), "pld" (a GenerationResult)}; by_text / by_run: tau_by_group
    over AR's answers and over pld's own outputs."""
    from dvi_lite.course.token_view import origins
    from dvi_lite.study.table import check_bench, finite, require

    for r in rows:
        steps = [(s.drafted, s.accepted) for s in r["pld"].stats.steps]
        require(replay(r["prompt_ids"], r["pld"].token_ids, max_new_tokens=max_new_tokens) == steps,
                f"replaying pld's output ({r['group']}) does not give its steps {steps}")
        require(len(origins(r["pld"].stats)) == len(r["pld"].token_ids), "the token view misses a token")
    out = [f"replaying pld's own output reproduces its (drafted, accepted) steps on {len(rows)} prompts; "
           "the token view colours every new token"]
    same = sum(r["pld"].token_ids == r["answer_ids"] for r in rows)
    if fp32:
        require(same == len(rows), f"fp32 greedy pld differs from AR on {len(rows) - same} of {len(rows)} prompts")
        out.append(f"fp32: greedy pld writes AR's tokens on {same}/{len(rows)} prompts")
    else:
        out.append(f"bf16: pld's output equals AR's on {same}/{len(rows)} prompts (not claimed: batched "
                   "verification flips near-ties)")
    for name, table in (("replay of AR's answers", by_text), ("pld's own runs", by_run)):
        for g, row in table.items():
            if row["tau"] is not None:
                finite(row["tau"], f"{name}: tau in {g}", 1)
            if row["alpha"] is not None:
                require(0 <= row["alpha"] <= 1, f"{name}: alpha in {g} = {row['alpha']} not in [0, 1]")
    out += [f"tau >= 1 and alpha in [0, 1] in every group ({', '.join(by_text)})", check_bench(bench_res, methods)]
    for path in committed:
        require(Path(path).is_file(), f"{Path(path).name} is missing")
        groups = json.loads(Path(path).read_text())["methods"]["pld"]["groups"]
        require(bool(groups) and all(g["tau"] is None or g["tau"] >= 1 for g in groups.values()),
                f"{Path(path).name}: pld's per-group rows are missing or have tau < 1")
        out.append(f"{Path(path).name}: pld's rows for {len(groups)} task groups, tau >= 1")
    return out
