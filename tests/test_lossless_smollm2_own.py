"""Drafts with their own weights on the real model are lossless: greedy == AR in fp32 on SmolLM2.

SpS (its SmolLM2 draft model), Medusa (its heads) and EAGLE (its feature head, as a chain and as a dynamic tree),
each with its committed piece from data/smollm2/
(the same files the bf16 benchmark uses: pieces are found by a dtype-independent fingerprint), on
helpers.SMOLLM2_QUESTIONS Spec-Bench dev questions x SMOLLM2_NEW tokens. Some draft must be accepted, or the test
would pass for a drafter that proposes nothing.
"""
from __future__ import annotations

import pytest
from helpers import assert_smollm2_greedy_equals_ar

pytestmark = pytest.mark.slow

CASES = [("sps", {}), ("medusa", {"tree": "sparse"}), ("eagle", {"tree": "chain"}), ("eagle", {"tree": "dynamic"})]


@pytest.mark.parametrize(("method", "options"), CASES, ids=[f"{m}-{o.get('tree', 'chain')}" for m, o in CASES])
def test_greedy_equals_ar_fp32(method, options):
    assert_smollm2_greedy_equals_ar(method, **options)
