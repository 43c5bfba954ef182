"""Benchmark prompts from JSONL: our own format (a "prompt" field) and Spec-Bench's ("turns").

Spec-Bench (Xia et al. 2024) is the benchmark Kangaroo, DVI and the Spec-Bench leaderboard report on:
480 questions in six task groups. Its lines look like
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}
and its results are reported per task group, the 8 MT-bench categories together as "multi-turn
conversation". The first turn is a user message (chat template); with two turns, the second one is
asked after the model's own first answer, as Spec-Bench does (`second_turn`).

Every reader returns plain dicts, so the bench can treat both formats alike:
    {"id", "group", "category", "domain" (= group, what the bench aggregates by), "prompt", "turns"}
"prompt" is what `dvi_lite.generate` takes: a str for our format (a raw continuation), a list of chat
messages for Spec-Bench's.
"""
from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

from dvi_lite.paths import DATA_DIR

SPEC_BENCH_DEV = DATA_DIR / "spec_bench" / "question_dev.jsonl.xz"  # xz: a third of the bytes in the tracked tree
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's order


def group_of(category: str) -> str:
    """Spec-Bench task group of a category; a category Spec-Bench does not have is its own group."""
    return "multi-turn" if category in MT_BENCH else category


def _nonempty_str(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def parse_line(obj: Any, lineno: int) -> dict:
    """One JSON object -> a prompt record; a ValueError (without the file name) says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "turns" in obj:  # Spec-Bench
        turns, category = obj["turns"], obj.get("category")
        if not isinstance(turns, list) or not turns or not all(_nonempty_str(t) for t in turns):
            raise ValueError("'turns' must be a non-empty list of non-empty strings")
        if not _nonempty_str(category):
            raise ValueError("a Spec-Bench line needs a 'category' (a non-empty string)")
        group = group_of(category)
        return {"id": str(obj.get("question_id", lineno)), "group": group, "category": category, "domain": group,
                "prompt": [{"role": "user", "content": turns[0]}], "turns": list(turns)}
    if "prompt" in obj:  # ours: a raw continuation, grouped by its domain
        if not _nonempty_str(obj["prompt"]):
            raise ValueError("'prompt' must be a non-empty string")
        group = obj.get("domain", "all")
        if not _nonempty_str(group):
            raise ValueError("'domain' must be a non-empty string")
        return {"id": str(obj.get("id", lineno)), "group": group, "category": group, "domain": group,
                "prompt": obj["prompt"], "turns": []}
    raise ValueError(f"needs a 'prompt' field (our format) or 'turns' (Spec-Bench's); it has {sorted(obj)}")


def read_prompts(path: str | Path) -> list[dict]:
    """Every prompt of a JSONL file (or an xz-compressed one, `.jsonl.xz`), in file order; blank lines are skipped.

    A malformed line raises a ValueError naming the file and the line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    out = []
    opener = lzma.open if path.suffix == ".xz" else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(parse_line(json.loads(line), lineno))
                except ValueError as e:  # json.JSONDecodeError is a ValueError too
                    raise ValueError(f"{path}: line {lineno}: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {str(path)!r}: line {lineno + 1} is not UTF-8 text; "
                         "a prompts file is JSON Lines in UTF-8") from None
    except (lzma.LZMAError, EOFError) as e:
        raise ValueError(f"prompts file {str(path)!r} is not a readable .xz file ({e})") from None
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def _round_robin(lists: list[list[dict]]) -> list[dict]:
    out, i = [], 0
    while any(i < len(x) for x in lists):
        out += [x[i] for x in lists if i < len(x)]
        i += 1
    return out


def spread(records: list[dict], n: int) -> list[dict]:
    """n records spread over the task groups (and, inside a group, over its categories), in a fixed order.

    Round robin: the first record of every group, then the second of every group, ...; Spec-Bench's
    groups come first in its order, other groups after them in order of appearance. Deterministic: the
    same file and n always give the same prompts.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of prompts must be an int >= 1, got {n!r}")
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        groups.setdefault(r["group"], {}).setdefault(r["category"], []).append(r)
    order = [g for g in GROUPS if g in groups] + [g for g in groups if g not in GROUPS]
    return _round_robin([_round_robin(list(groups[g].values())) for g in order])[:n]


EVAL_QUESTIONS = 48  # the bench measures on the first EVAL_QUESTIONS of spread(); drafts never train on them


def training_questions(records: list[dict], held: int = EVAL_QUESTIONS) -> list[dict]:
    """The questions drafts may be trained on: every record outside the first `held` of spread(records).

    The bench draws its prompts from the front of the same spread order (it never asks for more than
    `held`), so what a draft was distilled on is never what it is measured on. Deterministic, and itself
    spread over the groups.
    """
    measured = {id(r) for r in spread(records, held)}
    return spread([r for r in records if id(r) not in measured], len(records))


def first_turns(records: list[dict], chat: bool) -> list[dict]:
    """Records asked on their first turn: the user message (chat) or, for a tokenizer without a chat template, the
    turn as a raw string."""
    return [{**r, "prompt": r["prompt"] if chat else r["turns"][0], "turn": 1} for r in records]


def second_turn(record: dict, first_answer: str) -> list[dict]:
    """The conversation for Spec-Bench's second turn: the first question, the model's own first answer,
    then the second question (the model answers it next)."""
    turns = record.get("turns") or []
    if len(turns) < 2:
        raise ValueError(f"prompt {record.get('id')!r} has {len(turns)} turn(s): no second turn to ask")
    if not isinstance(first_answer, str):
        raise ValueError(f"first_answer must be the model's first answer as a str, got {type(first_answer).__name__}")
    return [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": turns[1]}]
