"""The teacher data (models/teacher.py): what it stores equals the model's own forward, and its questions are
never the bench's."""
from __future__ import annotations

import pytest
import torch

from dvi_lite.core.runner import Runner
from dvi_lite.models import artifacts
from dvi_lite.models.loading import load_model
from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread, training_questions
from dvi_lite.models.teacher import TeacherConfig, build_teacher, load_teacher, soft_ce, teacher_outputs


@pytest.fixture(scope="module")
def course():
    return load_model("course", dtype="float32")


def test_outputs_equal_the_models_forward(course):
    model, tok = course
    rows = [tok("def f(x):\n    return x + 1\n")["input_ids"], tok("The cat sat")["input_ids"]]
    cfg = TeacherConfig(layers=(2, 5), top_k=4, batch_size=2)
    data = teacher_outputs(model, rows, cfg)
    assert data.mask.sum(1).tolist() == [len(r) for r in rows] and data.n_tokens == sum(map(len, rows))
    runner = Runner.for_model(model)
    for i, r in enumerate(rows):  # one row at a time, no padding: the batched, padded run must agree
        x = torch.tensor([r])
        pos = torch.arange(len(r))[None]
        h2 = runner.layers_forward(runner.embed(x), None, pos, 0, 2)
        h = runner.layers_forward(h2, None, pos, 2)
        # the batched, padded fp32 run may differ from this one in the last bits, which can round to the
        # neighbouring bf16 value: one bf16 step (at most 2^-7 relative) is the tolerance
        bf16_step = {"rtol": 2 ** -7, "atol": 1e-5}
        torch.testing.assert_close(data.state(2)[i, : len(r)].float(), h2[0].to(torch.bfloat16).float(), **bf16_step)
        torch.testing.assert_close(data.final[i, : len(r)].float(), h[0].to(torch.bfloat16).float(), **bf16_step)
        logp = runner.logits(h).float().log_softmax(-1)[0]  # (T, V)
        assert torch.equal(data.top_ids[i, : len(r), 0], logp.argmax(-1))
        torch.testing.assert_close(data.top_logp[i, : len(r)].float(), logp.topk(4, -1).values, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match=r"keeps the states after layers \[2, 5\], not 3"):
        data.state(3)


def test_soft_targets_replace_hard_labels_by_the_models_top_k(course):
    """soft_targets: the hard labels of a token record become the target's own top-k, as the teacher computes it."""
    from dvi_lite.models.teacher import soft_targets

    model, tok = course
    rows = [tok("def f(x):\n    return x + 1\n")["input_ids"], tok("The cat sat")["input_ids"]]
    want = teacher_outputs(model, rows, TeacherConfig(layers=(2,), top_k=4, batch_size=2))
    hard = teacher_outputs(model, rows, TeacherConfig(layers=(2,), top_k=1, batch_size=2))
    hard.top_logp.zero_()  # as a record gives it: one label, probability 1
    got = soft_targets(model, hard, top_k=4, batch_rows=1)
    for i, r in enumerate(rows):
        assert torch.equal(got.top_ids[i, : len(r)], want.top_ids[i, : len(r)])
        torch.testing.assert_close(got.top_logp[i, : len(r)].float(), want.top_logp[i, : len(r)].float(),
                                   atol=2e-3, rtol=1e-3)
    assert got.card["targets"].startswith("soft: the target's top-4")


def test_soft_targets_are_kept_for_the_next_run_and_a_torn_file_is_recomputed(course, tmp_path, monkeypatch):
    from dvi_lite.models import teacher
    from dvi_lite.models.teacher import soft_targets

    model, tok = course
    monkeypatch.setattr(teacher, "BUILD_DIR", tmp_path)
    rows = [tok("The cat sat on the mat")["input_ids"]]
    first = soft_targets(model, teacher_outputs(model, rows, TeacherConfig(layers=(2,), top_k=1)), top_k=3)
    kept = list((tmp_path / "cache").glob("soft_top3_*.pt"))
    assert len(kept) == 1
    hard = teacher_outputs(model, rows, TeacherConfig(layers=(2,), top_k=1))
    monkeypatch.setattr(teacher, "tqdm", lambda *a, **k: pytest.fail("the teacher pass ran again"))
    again = soft_targets(model, hard, top_k=3)
    assert torch.equal(again.top_ids, first.top_ids) and torch.equal(again.top_logp, first.top_logp)
    monkeypatch.undo()
    monkeypatch.setattr(teacher, "BUILD_DIR", tmp_path)
    kept[0].write_bytes(b"torn")
    third = soft_targets(model, teacher_outputs(model, rows, TeacherConfig(layers=(2,), top_k=1)), top_k=3)
    assert torch.equal(third.top_ids, first.top_ids)


def test_bad_layers_are_named(course):
    model, _ = course
    with pytest.raises(ValueError, match=r"layers must lie in \[1, 11\].*\[12\]"):
        teacher_outputs(model, [[1, 2, 3]], TeacherConfig(layers=(12,)))


def test_build_and_load_round_trip(course, tmp_path):
    model, tok = course
    cfg = TeacherConfig(layers=(2,), top_k=3, answers=0, corpus_windows=2, seq_len=16)
    path = tmp_path / "t.pt"
    built = build_teacher(model, tok, cfg, path, command="test")
    back = load_teacher(path)
    assert torch.equal(back.tokens, built.tokens) and back.tokens.shape == (2, 16)
    assert back.card["model"] == artifacts.fingerprint(model) and back.card["n_tokens"] == 32
    with pytest.raises(ValueError, match="answers \\+ corpus_windows must be >= 1"):
        build_teacher(model, tok, TeacherConfig(answers=0, corpus_windows=0), tmp_path / "e.pt")
    with pytest.raises(FileNotFoundError, match="python -m dvi_lite teacher"):
        load_teacher(tmp_path / "absent.pt")


def test_soft_ce_is_cross_entropy_to_the_renormalised_top_k():
    logq = torch.randn(5, 10).log_softmax(-1)
    ids = torch.tensor([[3, 1]] * 5)
    top_logp = torch.tensor([[0.0, -20.0]] * 5)  # p is (almost) one-hot on token 3
    torch.testing.assert_close(soft_ce(logq, ids, top_logp), -logq[:, 3], atol=1e-6, rtol=0)


def test_training_questions_are_never_the_benchs():
    records = read_prompts(SPEC_BENCH_DEV)
    train = training_questions(records)
    measured = {r["id"] for r in spread(records, EVAL_QUESTIONS)}
    assert len(train) == len(records) - EVAL_QUESTIONS and not measured & {r["id"] for r in train}
    assert {r["group"] for r in train[:12]} == {r["group"] for r in records}  # itself spread over the groups


def test_smollm2_pieces_are_committed_in_data(monkeypatch):
    class M:  # only the fingerprint decides the folder
        pass
    monkeypatch.setattr(artifacts, "fingerprint", lambda m: artifacts.SMOLLM2_FINGERPRINT)
    assert artifacts.artifacts_dir(M()) == artifacts.DATA_DIR / "smollm2"
    monkeypatch.setattr(artifacts, "fingerprint", lambda m: "0123456789abcdef")
    assert artifacts.artifacts_dir(M()) == artifacts.MODELS_DIR / "0123456789abcdef"


def test_states_are_kept_per_layer_for_the_next_command(course, tmp_path, monkeypatch):
    """fill_states(cache=True): a second command on the same rows reads the states back (no forward), and asking
    for one more layer computes only that one; the cached states equal a fresh pass."""
    from dvi_lite.models import teacher
    from dvi_lite.models.teacher import fill_states

    model, tok = course
    monkeypatch.setattr(teacher, "BUILD_DIR", tmp_path)
    rows = [tok("The cat sat on the mat")["input_ids"], tok("def f(x):")["input_ids"]]
    bare = lambda: teacher_outputs(model, rows, TeacherConfig(layers=(1,), top_k=1))  # noqa: E731
    first = fill_states(model, bare(), (2,), cache=True)
    assert len(list((tmp_path / "cache").glob("states_L2_*.pt"))) == 1
    data = bare()  # (the teacher pass that makes the rows shows a bar of its own)
    with monkeypatch.context() as m:
        m.setattr(teacher, "tqdm", lambda *a, **k: pytest.fail("the states pass ran again"))
        again = fill_states(model, data, (2,), cache=True)
    assert torch.equal(again.states[2], first.states[2])
    seen, data = [], bare()
    with monkeypatch.context() as m:
        m.setattr(teacher, "tqdm", lambda it, desc="", **k: seen.append(desc) or it)
        both = fill_states(model, data, (2, 3), cache=True)
    assert seen == ["states after layers [3]"]
    fresh = fill_states(model, bare(), (2, 3))
    assert torch.equal(both.states[2], fresh.states[2]) and torch.equal(both.states[3], fresh.states[3])

