"""Shared fixtures: tiny random Llama models (never the course model), a stub tokenizer.

The builders, tokenizers, statistics and shared checks live in tests/helpers.py (see its docstring for
the model recipe); the names below are re-exported so that `from conftest import X` keeps working.
"""
from __future__ import annotations

import pytest
import torch
from helpers import (  # noqa: F401  (re-exported for `from conftest import ...`)
    ALPHA,
    DEEP_PROMPTS,
    EOS,
    LAW_TEST_BUDGET,
    LAW_TESTS_RUN,
    PROMPT8,
    VOCAB,
    IdTokenizer,
    StubTokenizer,
    assert_cache_equals_fresh,
    assert_lossless_sampling,
    chi2_pvalue,
    exact_law_3,
    lossless_draws,
    make_deep_model,
    make_draft,
    make_target,
    random_dist,
    tiny_cfg,
)
from transformers import LlamaForCausalLM

torch.set_num_threads(1)  # 2 cores and a background job: one thread is fastest for these tiny models


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return make_target()


@pytest.fixture(scope="session")
def draft(target) -> LlamaForCausalLM:
    return make_draft(target)


@pytest.fixture(scope="session")
def tok() -> StubTokenizer:
    return StubTokenizer()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """10 random prompts of 2..7 ids in [1, 62] (no eos, no pad)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(10):
        n = int(torch.randint(2, 8, (1,), generator=g))
        out.append(torch.randint(1, EOS, (n,), generator=g).tolist())
    return out


@pytest.fixture(scope="session")
def target8() -> LlamaForCausalLM:
    """Vocabulary-8 target for exact-law tests (enumerating 8**3 continuations is cheap)."""
    return make_target(vocab=8, layers=2, seed=2)


@pytest.fixture(scope="session")
def draft8(target8) -> LlamaForCausalLM:
    return make_draft(target8, seed=3, noise=0.3)


@pytest.fixture(scope="session")
def tok8() -> StubTokenizer:
    return StubTokenizer(vocab=8, eos_token_id=None)


@pytest.fixture(scope="module")
def deep_model() -> LlamaForCausalLM:
    """4 layers, peaked logits and deep layers that matter, so shallow (self-speculative) drafts get rejected."""
    return make_deep_model()


# ---------------------------------------------------------------- the law-test budget, over all workers

@pytest.fixture(autouse=True, scope="session")
def _course_chi_square_in_the_budget():
    """The course's chi_square (notebook 01's, the exercise checks', notebook 04's typical-acceptance test) is a
    law test too: every call the suite makes counts against LAW_TEST_BUDGET like a law_test p-value, and the
    level a correct sampler must beat is the suite's ALPHA (the exercise checks' P_PASS, 1e-4 for learners, is
    ALPHA while the tests run; the tests that read a chi_square p-value compare it with ALPHA)."""
    import functools

    from dvi_lite.course import ch01_speculative_sampling as ch01
    from dvi_lite.course.exercises import checks

    real = ch01.chi_square

    @functools.wraps(real)
    def counted(*args, **kwargs):
        LAW_TESTS_RUN[0] += 1
        return real(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(ch01, "chi_square", counted)
    mp.setattr(checks, "chi_square", counted)
    mp.setattr(checks, "P_PASS", ALPHA)
    yield
    mp.undo()


_WORKER_LAW_TESTS: list[int] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """(xdist controller) collect each worker's count of law tests."""
    _WORKER_LAW_TESTS.append(int(getattr(node, "workeroutput", {}).get("law_tests", 0)))


def pytest_sessionfinish(session, exitstatus) -> None:
    """A worker reports its count; the controller (or a run without xdist) fails the run when the suite made
    more law tests than LAW_TEST_BUDGET, since ALPHA = 1 % / LAW_TEST_BUDGET then no longer bounds the
    suite's false alarms."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["law_tests"] = LAW_TESTS_RUN[0]
        return
    total = LAW_TESTS_RUN[0] + sum(_WORKER_LAW_TESTS)
    print(f"\nlaw tests made: {total} (budget {LAW_TEST_BUDGET}, alpha {ALPHA:g} each)")
    if total > LAW_TEST_BUDGET:
        print(f"FAIL: {total} law tests passed LAW_TEST_BUDGET = {LAW_TEST_BUDGET}: raise it (tests/helpers.py)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
