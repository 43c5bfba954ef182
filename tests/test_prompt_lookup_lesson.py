"""Chapter 06's helpers: replaying greedy prompt lookup on a known answer gives the engine's own steps."""
import pytest

from dvi_lite.course import ch06_prompt_lookup as ch


@pytest.fixture(scope="module")
def course():
    from dvi_lite.models.loading import load_model

    return load_model("course", dtype="float32", device="cpu")


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "the cat sat on the mat. the cat sat on the",
           "Once upon a time", "import numpy as np\nimport numpy"]


@pytest.mark.parametrize("k", [2, 6])
def test_replay_is_the_engines_greedy_run(course, k):
    """On fp32 greedy runs of pld, the replay over AR's answer gives the very same (depth, accepted) per step."""
    from dvi_lite.core.generate import generate, prompt_ids

    model, tok = course
    for prompt in PROMPTS:
        res = generate(model, tok, prompt, method="pld", max_new_tokens=40, K=k)
        ar = generate(model, tok, prompt, method="ar", max_new_tokens=40)
        assert res.token_ids == ar.token_ids
        log = [(s.drafted, s.accepted) for s in res.stats.steps]
        assert ch.replay(prompt_ids(tok, prompt), ar.token_ids, k, max_new_tokens=40) == log, prompt


def test_tau_by_group_pools_the_steps():
    rows = [{"group": "copy", "prompt_ids": [1, 2, 3, 4], "answer_ids": [1, 2, 3, 4, 1, 2, 3]},
            {"group": "chat", "prompt_ids": [5, 6], "answer_ids": [7, 8, 9]}]
    out = ch.tau_by_group(rows, K=6)
    assert out["chat"]["tau"] == 1.0 and out["chat"]["copied"] == 0.0 and out["chat"]["alpha"] is None
    # copy: the prefill gives 1; [2, 3, 4, 1] is copied from the prompt and accepted (+ the target's 2); the last
    # token is the target's alone (no room left to draft): 2 steps for 6 tokens
    assert out["copy"]["tau"] == 3.0 and out["copy"]["steps"] == 2 and out["copy"]["copied"] == 4 / 6
    assert out["all"]["steps"] == 4 and out["all"]["n"] == 2


def test_match_html_shows_the_match_and_the_copy(course):
    _, tok = course
    ids = tok("the cat sat on the mat. the cat", add_special_tokens=False)["input_ids"]
    page = ch.match_html(tok, ids, K=3)
    assert "proposed (3 tokens" in page and "gram match" in page
    assert "nothing to propose" in ch.match_html(tok, ids[:1], K=3)


def test_best_copy_point_is_where_the_longest_copy_was_accepted():
    prompt, answer = [1, 2, 3, 4, 5, 6], [9, 1, 2, 3, 4, 5]
    log = ch.replay(prompt, answer)
    assert log[0] == (0, 0)  # after "9" nothing matches: an AR step writes "1"
    at = ch.best_copy_point(prompt, answer)
    assert at == 2 and ch.PromptLookupDrafter(6, 3).lookup(prompt + answer[:at], 6)[:3] == [2, 3, 4]
    assert ch.best_copy_point([5, 6], [7, 8, 9]) == 1  # nothing ever accepted


def test_contrast_pair_prefers_the_named_groups_and_falls_back_to_tau():
    rows = [{"group": g, "prompt_ids": p, "answer_ids": a} for g, p, a in
            (("multi-turn", [5, 6], [7, 8, 9]), ("translation", [1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3]))]
    copy, chat = ch.contrast_pair(rows)
    assert copy["group"] == "translation" and chat["group"] == "multi-turn"
    other = [{**rows[0], "group": "prose"}, {**rows[1], "group": "code"}]
    copy, chat = ch.contrast_pair(other)
    assert copy["group"] == "code" and chat["group"] == "prose"
    with pytest.raises(ValueError, match="two task groups"):
        ch.contrast_pair(other[:1])


def test_tau_by_group_puts_the_pooled_row_last():
    rows = [{"group": "b", "prompt_ids": [1], "answer_ids": [1, 1, 1]},
            {"group": "a", "prompt_ids": [2], "answer_ids": [3]}]
    assert list(ch.tau_by_group(rows, max_new_tokens=8)) == ["b", "a", "all"]
