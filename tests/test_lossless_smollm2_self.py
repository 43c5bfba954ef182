"""Self-speculation on the real model is lossless: greedy == AR in fp32 on SmolLM2, with the committed pieces.

Kangaroo, Draft & Verify and DVI, each with its SmolLM2 piece from data/smollm2/ (the same files the bf16
benchmark uses: pieces are found by a dtype-independent fingerprint), on helpers.SMOLLM2_QUESTIONS
Spec-Bench dev questions x SMOLLM2_NEW tokens. Some draft must be accepted, or the test
would pass for a drafter that proposes nothing.
"""
from __future__ import annotations

import pytest
from helpers import assert_smollm2_greedy_equals_ar

pytestmark = pytest.mark.slow

CASES = {"kangaroo": {}, "draft_verify": {}, "dvi": {}}


@pytest.mark.parametrize("method", list(CASES))
def test_greedy_equals_ar_fp32(method):
    assert_smollm2_greedy_equals_ar(method, **CASES[method])
