"""Prompts for the self-distillation set: what the target model is asked to answer, per Spec-Bench task group.

A draft learns the target's own answers, so the prompts should cover what the bench asks: Spec-Bench's six
task groups (multi-turn, translation, summarization, qa, math_reasoning, rag). Three sources, none of them
the bench's evaluation questions:

- **specbench**: the training half of the Spec-Bench dev questions (`specbench.training_questions`).
- **self_instruct**: questions the model writes itself, a few per call, seeded by two training questions of
  one category ("write one new question of the same kind"), for the groups whose prompts are short questions
  (the MT-bench categories, qa, math_reasoning).
- **template**: prompts built from corpus passages in Spec-Bench's own formats ("Summarize: ...",
  "Translate English to German: ...", a passage then a question), for the groups that need a source text.

Everything is deterministic given a seed: a shard of the set can be rebuilt, and a resumed run picks up
exactly where it stopped.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from dvi_lite.models import specbench

# The groups whose prompts the model writes itself, and the categories that seed each one.
SELF_INSTRUCT_SEEDS: dict[str, tuple[str, ...]] = {
    "multi-turn": specbench.MT_BENCH,
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
}
TEMPLATE_GROUPS = ("translation", "summarization", "rag")
LANGUAGES = ("German", "French", "Spanish", "Italian")
RAG_QUESTIONS = (
    "what is the main idea of the text?",
    "what does the text say about {term}?",
    "explain what {term} is, using the documents.",
    "how is {term} used, according to the text?",
    "what problem does the text describe, and what is the solution?",
    "list the key facts the documents give.",
)
INSTRUCT = ("Here are two example questions:\n1. {a}\n2. {b}\n\nWrite one new question of the same kind about a "
            "different topic. Reply with the question only.")


@dataclass
class Passages:
    """Paragraphs and sentences of the corpus' prose (the Python docs), the source texts of template prompts."""

    paragraphs: list[str]
    sentences: list[str]

    @classmethod
    def from_corpus(cls, split: str = "train") -> "Passages":
        from dvi_lite.models.corpus import load_docs

        paragraphs, sentences = [], []
        for doc in load_docs(split, "prose"):
            for para in re.split(r"\n\s*\n", doc.text):
                flat = " ".join(line.strip() for line in para.splitlines())
                if not _is_prose(flat):
                    continue
                if 400 <= len(flat) <= 2400:
                    paragraphs.append(flat)
                sentences += [s for s in re.split(r"(?<=[.!?])\s+", flat) if 50 <= len(s) <= 220 and _is_prose(s)]
        if not paragraphs or not sentences:
            raise ValueError(f"the corpus' {split!r} prose split has no usable passages")
        return cls(paragraphs, sentences)


def _is_prose(text: str) -> bool:
    """Mostly letters and spaces, no reST markup lines (directives, tables, code)."""
    if not text or text.lstrip().startswith(("..", "::", "=", "-", "*", "|", "+", ">>>")):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters / len(text) > 0.85


def normalise(text: str) -> str:
    """The key two prompts are duplicates under: lower case, one space, no punctuation."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def shorten(text: str, limit: int) -> str:
    """text within `limit` characters: its first third and its last two thirds of the budget, joined by an
    ellipsis, so an instruction at the start ("Summarize:") and a question at the end (RAG) both survive."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + "\n...\n" + text[len(text) - (limit - head - 5):]


def clean_question(text: str) -> str | None:
    """The question in a self-instruct reply, or None when there is none (too short, or a refusal)."""
    text = text.strip()
    text = re.sub(r"^(\d+[.)]|question\s*\d*\s*:|new question\s*:|q\s*:)\s*", "", text, flags=re.I).strip()
    text = text.split("\n\n")[0].strip().strip('"').strip()
    if len(text) < 15 or len(text) > 600 or not any(c.isalpha() for c in text):
        return None
    return text


def self_instruct_requests(group: str, n: int, train: list[dict], rng: random.Random) -> list[dict]:
    """n requests that ask the model for a new question of `group`, each seeded by two training questions of one
    of its categories: {"group", "category", "messages"}."""
    cats = [c for c in SELF_INSTRUCT_SEEDS[group] if sum(q["category"] == c for q in train) >= 2]
    if not cats:
        raise ValueError(f"no category of group {group!r} has two training questions to seed self-instruct")
    out = []
    for _ in range(n):
        cat = rng.choice(cats)
        a, b = rng.sample([q for q in train if q["category"] == cat], 2)
        msg = INSTRUCT.format(a=a["turns"][0][:400], b=b["turns"][0][:400])
        out.append({"group": group, "category": cat, "messages": [{"role": "user", "content": msg}]})
    return out


def template_prompt(group: str, passages: Passages, rng: random.Random) -> dict:
    """One prompt of a source-text group in Spec-Bench's format, from corpus passages."""
    if group == "translation":
        text = f"Translate English to {rng.choice(LANGUAGES)}: {rng.choice(passages.sentences)}"
    elif group == "summarization":
        text = f"Summarize: {rng.choice(passages.paragraphs)}"
    elif group == "rag":
        docs = rng.sample(passages.paragraphs, 2)
        terms = [w for w in re.findall(r"\b[A-Za-z_][\w.]{4,}\b", docs[0]) if not w.islower()] or ["the topic"]
        question = rng.choice(RAG_QUESTIONS).format(term=rng.choice(terms))
        text = f"{docs[0]}\n\n{docs[1]}\n\nUsing the documents above, {question}"
    else:
        raise ValueError(f"group must be one of {TEMPLATE_GROUPS} for a template prompt, got {group!r}")
    return {"group": group, "category": group, "source": "template", "text": text}
