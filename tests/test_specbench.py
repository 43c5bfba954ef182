"""The prompt reader: our JSONL and Spec-Bench's, task groups, spreading, the second turn, malformed lines."""
from __future__ import annotations

import json

import pytest

from dvi_lite.models.specbench import GROUPS, SPEC_BENCH_DEV, read_prompts, second_turn, spread


def _write(tmp_path, lines: list) -> str:
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(f)


def test_the_committed_dev_half():
    recs = read_prompts(SPEC_BENCH_DEV)
    assert len(recs) == 240 and len({r["id"] for r in recs}) == 240
    counts = {g: sum(r["group"] == g for r in recs) for g in GROUPS}
    assert counts == {g: 40 for g in GROUPS}  # 8 MT-bench categories x 5 = 40 multi-turn
    mt = [r for r in recs if r["group"] == "multi-turn"]
    assert len({r["category"] for r in mt}) == 8 and all(len(r["turns"]) == 2 for r in mt)
    assert all(r["domain"] == r["group"] for r in recs)
    assert (SPEC_BENCH_DEV.parent / "LICENSE").is_file() and (SPEC_BENCH_DEV.parent / "SOURCE.md").is_file()


def test_spec_bench_line_is_a_user_message(tmp_path):
    (r,) = read_prompts(_write(tmp_path, [{"question_id": 7, "category": "rag", "turns": ["Q?"]}]))
    assert r == {"id": "7", "group": "rag", "category": "rag", "domain": "rag",
                 "prompt": [{"role": "user", "content": "Q?"}], "turns": ["Q?"]}


def test_our_format_is_a_raw_continuation(tmp_path):
    recs = read_prompts(_write(tmp_path, [{"id": "a", "domain": "code", "prompt": "def f():"}, "",
                                          {"prompt": "Once upon"}]))
    assert [(r["id"], r["group"], r["prompt"]) for r in recs] == [("a", "code", "def f():"), ("3", "all", "Once upon")]


def test_spread_covers_every_group_and_mt_category():
    recs = read_prompts(SPEC_BENCH_DEV)
    six = spread(recs, 6)
    assert [r["group"] for r in six] == list(GROUPS)
    first_mt = [r["category"] for r in spread(recs, 48) if r["group"] == "multi-turn"]
    assert len(set(first_mt)) == 8  # inside the group, round robin over its categories
    assert spread(recs, 10) == spread(recs, 10) and len(spread(recs, 1000)) == 240
    with pytest.raises(ValueError, match=">= 1"):
        spread(recs, 0)


def test_second_turn():
    rec = next(r for r in read_prompts(SPEC_BENCH_DEV) if r["group"] == "multi-turn")
    conv = second_turn(rec, "my answer")
    assert [m["role"] for m in conv] == ["user", "assistant", "user"]
    assert conv[0]["content"] == rec["turns"][0] and conv[1]["content"] == "my answer"
    assert conv[2]["content"] == rec["turns"][1]
    single = next(r for r in read_prompts(SPEC_BENCH_DEV) if r["group"] == "qa")
    with pytest.raises(ValueError, match="no second turn"):
        second_turn(single, "x")


@pytest.mark.parametrize("bad, why", [
    ("{not json", "Expecting"),
    ('["a list"]', "expected a JSON object"),
    ({"question_id": 1, "turns": ["x"]}, "category"),
    ({"category": "qa", "turns": []}, "'turns' must be"),
    ({"category": "qa", "turns": [3]}, "'turns' must be"),
    ({"prompt": ""}, "'prompt' must be"),
    ({"text": "x"}, "needs a 'prompt' field"),
])
def test_malformed_line_gives_file_and_line_number(tmp_path, bad, why):
    path = _write(tmp_path, [{"prompt": "fine"}, "", bad])
    with pytest.raises(ValueError, match=rf"p\.jsonl: line 3: .*{why}"):
        read_prompts(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(_write(tmp_path, [""]))
