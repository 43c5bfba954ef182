"""Prompt lookup decoding (`pld`): the n-gram lookup, options, and losslessness (greedy on both models,
the exact sampling law on a tiny model)."""
from __future__ import annotations

import pytest
from helpers import assert_lossless_sampling

import dvi_lite
from dvi_lite.core.registry import get_method
from dvi_lite.methods.pld import PromptLookupDrafter

NEW = 32


def lookup(tokens: list[int], K: int = 6, max_ngram: int = 3) -> list[int]:
    return PromptLookupDrafter(K, max_ngram, vocab=100).lookup(tokens, K)


def test_lookup_copies_what_followed_the_longest_match():
    assert lookup([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2, 3]  # (2, 3) occurred at 1: copy what followed
    assert lookup([1, 2, 3, 4, 9, 2, 3], K=2) == [4, 9]
    # (7, 2, 3) beats the more recent (2, 3): the longest n-gram wins
    assert lookup([7, 2, 3, 5, 2, 3, 6, 7, 2, 3]) == [5, 2, 3, 6, 7, 2]


def test_lookup_takes_the_most_recent_match():
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], K=3) == [8, 5, 6]


def test_lookup_without_a_match_drafts_nothing():
    assert lookup([1, 2, 3, 4]) == [] and lookup([1]) == []
    assert lookup([1, 2, 3, 1], max_ngram=1) == [2, 3, 1]  # a 1-gram still matches


def test_lookup_is_incremental():
    """The index grows with the text: each call sees exactly what a fresh drafter would."""
    d = PromptLookupDrafter(4, 3, vocab=100)
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    for t in range(1, len(seq) + 1):
        assert d.lookup(seq[:t], 4) == lookup(seq[:t], 4), t


def test_registry_row_and_option_errors():
    m = get_method("pld")
    assert m.engine and m.resolve() == {"K": 6, "max_ngram": 3}
    with pytest.raises(ValueError, match="'K'"):
        m.resolve(K=0)
    with pytest.raises(ValueError, match="max_ngram"):
        m.resolve(max_ngram=0)
    with pytest.raises(ValueError, match="no option 'n'"):
        m.resolve(n=2)


def test_sampling_is_lossless(target8, tok8):
    """Point-mass drafts under rejection sampling: the first three tokens follow the target's exact law."""
    assert_lossless_sampling(target8, tok8, "pld", temperature=1.0, max_new_tokens=4, K=2, max_ngram=2)


def _greedy_equal(model, tok, prompts, **options) -> float:
    """pld's greedy tokens equal AR's on every prompt; returns pld's mean tokens per step."""
    taus = []
    for p in prompts:
        ar = dvi_lite.generate(model, tok, p, method="ar", max_new_tokens=NEW)
        pld = dvi_lite.generate(model, tok, p, method="pld", max_new_tokens=NEW, **options)
        assert pld.token_ids == ar.token_ids, p
        taus.append(pld.stats.tau)
    return sum(taus) / len(taus)


@pytest.mark.slow
def test_greedy_equals_ar_on_the_course_model():
    from dvi_lite.models.corpus import load_prompts
    from dvi_lite.study.bench import spread

    model, tok = dvi_lite.load_model()
    prompts = [p["prompt"] for p in spread(load_prompts(), 6)]
    assert _greedy_equal(model, tok, prompts) > 1.0  # it drafted and something was accepted
    assert _greedy_equal(model, tok, prompts[:2], K=3, max_ngram=1) > 1.0


@pytest.mark.slow
def test_greedy_equals_ar_on_smollm2_fp32():
    """On the shared real-model reference (every task group; summarization and RAG give it text to copy)."""
    from helpers import assert_smollm2_greedy_equals_ar

    assert_smollm2_greedy_equals_ar("pld")
