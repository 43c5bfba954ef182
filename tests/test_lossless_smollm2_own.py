"""Drafts with their own weights on the real model are lossless: greedy == AR in fp32 on SmolLM2.

SpS (its SmolLM2 draft model) and Medusa (its heads), each with its committed piece from data/smollm2/
(the same files the bf16 benchmark uses: pieces are found by a dtype-independent fingerprint), on
helpers.SMOLLM2_QUESTIONS Spec-Bench dev questions x SMOLLM2_NEW tokens. Some draft must be accepted, or the test
would pass for a drafter that proposes nothing.
"""
from __future__ import annotations

import pytest
from helpers import smollm2_reference

import dvi_lite

pytestmark = pytest.mark.slow

CASES = {"sps": {}, "medusa": {"tree": "sparse"}}


@pytest.mark.parametrize("method", list(CASES))
def test_greedy_equals_ar_fp32(method):
    from test_smollm2 import smollm2

    model, tok = smollm2("float32")
    accepted = steps = 0
    for i, (prompt, ref) in enumerate(smollm2_reference()):
        out = dvi_lite.generate(model, tok, prompt, method=method, max_new_tokens=len(ref), **CASES[method])
        assert out.token_ids == ref, f"{method}: question {i} differs from AR"
        accepted += sum(s.accepted for s in out.stats.steps)
        steps += len(out.stats.steps)
    assert accepted > 0, f"{method}: no draft was ever accepted in {steps} steps"
