"""DVI learning while serving: the trimmed-head learner, the question stream, the ablation arms, the committed
head's format (bf16, its vocab) and prepare_smollm2 in smoke mode (course model). Tiny / course models only."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer

import dvi_lite
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.drafter import make_drafter
from dvi_lite.methods.dvi.learner import OnlineTrainer
from dvi_lite.methods.dvi.losses import lambda_schedule
from dvi_lite.methods.dvi.policy import load_policy
from dvi_lite.methods.dvi.serve import ARMS, arm_config, curve, heldout_questions, question_stream

CFG = dict(split=2, fast_every=8, batch_size=8, buffer_size=128, t_lambda=5.0, seed=0)
MAP = list(range(0, 64, 2))  # a 32-token trimmed head on the 64-token deep model


def test_trimmed_head_learner_trains_on_the_map_and_stays_lossless(deep_model):
    tr = OnlineTrainer(deep_model, DEEP_PROMPTS, DVIConfig(**CFG), max_new_tokens=16, vocab=MAP, progress=False)
    recs = tr.train(3)
    assert len(recs) == 3 and all(r["loss"] == r["loss"] for r in recs)
    n = len(tr.buffer)
    b = tr.buffer.sample(n, torch.Generator().manual_seed(0))
    assert b["teacher_logits"].shape[-1] == len(MAP)  # (n, N): the verifier's logits on the map's ids
    assert int(b["tokens"].min()) >= 0 and int(b["tokens"].max()) < len(MAP)  # drafts are map indices
    assert tr.draft_logits(b["h"][:2]).shape == (2, len(MAP))
    for p in DEEP_PROMPTS:  # the trimmed trained head still decodes exactly the model's greedy output
        ar = dvi_lite.generate(deep_model, IdTokenizer(), p, max_new_tokens=20, stop_at_eos=False)
        dv = dvi_lite.generate(deep_model, IdTokenizer(), p, method="dvi", state=tr.policy, vocab=MAP,
                               max_new_tokens=20, stop_at_eos=False)
        assert dv.token_ids == ar.token_ids


def test_max_sequences_bounds_the_stream(deep_model):
    tr = OnlineTrainer(deep_model, DEEP_PROMPTS, DVIConfig(**CFG), max_new_tokens=12, progress=False)
    tr.train(10**6, max_sequences=3)
    assert tr.prompt_idx == 3 and tr.unconsumed < CFG["fast_every"]
    with pytest.raises(ValueError, match="max_sequences"):
        tr.train(1, max_sequences=0)


def test_saved_bf16_head_loads_with_its_vocab(deep_model, tmp_path):
    tr = OnlineTrainer(deep_model, DEEP_PROMPTS, DVIConfig(**CFG), max_new_tokens=16, vocab=MAP, progress=False)
    tr.train(2)
    f = tr.save_policy(tmp_path, dtype=torch.bfloat16)
    bundle = torch.load(f, weights_only=False)
    assert bundle["vocab"] == len(MAP) and bundle["policy"]["exit_norm"].dtype == torch.bfloat16
    pol = load_policy(deep_model, tmp_path)
    assert pol.trained_vocab == len(MAP)
    want = {k: v.to(torch.bfloat16).float() for k, v in tr.policy.trainable_state()["lora_S"].items()}
    got = pol.trainable_state()["lora_S"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="vocab"):  # vocab=None = the head's own N: this model's top-N map, which
        make_drafter(deep_model, None, state=tmp_path)  # would be counted on the corpus (no tokenizer here)
    assert make_drafter(deep_model, IdTokenizer(), state=tmp_path, vocab="full").vocab is None
    assert len(make_drafter(deep_model, IdTokenizer(), state=tmp_path, vocab=MAP).vocab) == len(MAP)


def test_ablation_arms_differ_only_in_the_objective():
    dvi, kl, rl = (arm_config(a, split=3) for a in ("dvi", "kl", "rl"))
    assert set(ARMS) == {"dvi", "kl", "rl", "reference"} and dvi.rl_variant == "reinforce" and dvi.ce_weight > 0
    assert all(lambda_schedule(t, kl.t_lambda, kl.kl_floor) == 1.0 for t in (0, 5, 500))  # KL only, reward unread
    assert lambda_schedule(1, rl.t_lambda, rl.kl_floor) == 0.0 and rl.ce_weight == 0.0  # reward only after t = 0
    same = {k for k, v in dvi.to_dict().items() if v == kl.to_dict()[k] == rl.to_dict()[k]}
    assert {"split", "seed", "lr", "batch_size", "fast_every", "rl_variant"} <= same
    with pytest.raises(ValueError, match="arm"):
        arm_config("ppo")


def test_curve_bins_the_stream():
    recs = [{"sequences": s, "step": i + 1, "accept_rate": s / 10, "tau": 1.0, "top1_agree": 0.5, "lambda": 1.0}
            for i, s in enumerate([1, 2, 2, 3, 4])]
    c = curve(recs, bins=2)
    assert [b["questions"] for b in c] == [[1, 2], [3, 4]]
    assert c[0]["accept_rate"] == pytest.approx((0.1 + 0.2 + 0.2) / 3)


def test_stream_never_holds_a_bench_question():
    from dvi_lite.models.loading import load_model

    _, tok = load_model("course")
    ids, qids = question_stream(tok, seed=0, max_prompt_tokens=128, n=20)
    assert len(ids) == len(qids) == 20 and all(0 < len(x) <= 128 for x in ids)
    _, bench_ids = heldout_questions(tok, 48)
    assert not set(qids) & set(bench_ids)
    assert question_stream(tok, seed=0, max_prompt_tokens=128, n=20)[1] == qids  # deterministic
    assert question_stream(tok, seed=1, max_prompt_tokens=128, n=20)[1] != qids


def test_prepare_smollm2_smoke_on_the_course_model(tmp_path):
    from dvi_lite.methods.dvi.serve import prepare_smollm2

    card = prepare_smollm2("course", tmp_path, "pytest", smoke=True)
    saved = json.loads((tmp_path / "dvi" / "card.json").read_text())
    assert saved["fast_steps"] == card["fast_steps"] >= 1 and saved["provenance"]["command"] == "pytest"
    assert saved["data"]["question_ids"] and saved["device"].startswith("cpu") and saved["wall_time_s"] > 0
    model, _ = dvi_lite.load_model("course")
    pol = load_policy(model, tmp_path / "dvi")
    assert pol.split == card["split"]


def test_ch05_ablation_helpers_read_the_results_format(tmp_path):
    from dvi_lite.course import ch05_dvi as dl

    arm = {"fast_steps": 4, "heldout": {"tau": 1.2, "alpha": 0.1},
           "curve": [{"questions": [1, 2], "accept_rate": 0.05}, {"questions": [3, 4], "accept_rate": 0.1}]}
    res = {"model": "m", "dtype": "bfloat16", "recipe": {"split": 4}, "heldout_before": {"tau": 1.0, "alpha": 0.0},
           "arms": {"dvi": arm, "kl": arm}}
    rows = dl.ablation_rows(res)
    assert [r["heldout_tau"] for r in rows] == [1.0, 1.2, 1.2] and rows[1]["stream_accept_last"] == 0.1
    fig = dl.ablation_figure(res)  # a line per arm, a bar per row (the untrained start included), one colour per arm
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.x[0] for b in bars] == [r["arm"] for r in rows] and len(fig.data) == 2 + len(rows)
    lines = {t.name: t.line.color for t in fig.data if t.type == "scatter"}
    assert all(b.marker.color == lines[b.x[0]] for b in bars[1:])
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert dl.load_ablation(tmp_path / "r.json") == res
    with pytest.raises(FileNotFoundError, match="ablation"):
        dl.load_ablation(tmp_path / "missing.json")
    assert dl.BASE.rl_variant == "reinforce"  # the notebook's baseline is the paper's objective


def test_cli_streams_specbench_questions_and_saves_half_precision(tmp_path):
    from dvi_lite.methods.dvi.cli import main

    out = tmp_path / "out"
    args = ["--split", "2", "--out", str(out), "--ckpt-dir", str(tmp_path / "ck"), "--prompts", "specbench",
            "--max-prompt-tokens", "96", "--max-new-tokens", "12", "--eval-prompts", "1", "--steps", "1",
            "--vocab", "full", "--save-dtype", "bfloat16"]
    assert main(args) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["fast_steps"] == 1 and card["run"]["prompts"] == "specbench" and card["eval_after"]["prompts"] == 1
    assert torch.load(out / "policy.pt", weights_only=False)["policy"]["exit_norm"].dtype == torch.bfloat16


def test_cost_model_verdict_from_measured_inputs():
    from dvi_lite.measure.cost import expected_tau, predicted_speedup
    from dvi_lite.methods.dvi.ablation import cost_model

    assert expected_tau(0.5, 2) == pytest.approx(1.75) and expected_tau(0.0, 6) == 1.0
    v = {"1": 1.0, "2": 1.0, "9": 1.2}
    res = {"heldout_before": {"alpha": 0.1}, "arms": {"dvi": {"heldout": {"alpha": 0.3}}}}
    out = cost_model(res, v, 0.1, target=1.3, ks=(1, 2))
    assert set(out["predicted_best"]) == {"untrained", "dvi"}
    a1 = out["alpha_needed"]["1"]  # at the needed alpha the formula gives the target
    assert predicted_speedup(expected_tau(a1, 1), 1, 0.1, v) == pytest.approx(1.3, rel=1e-6)
    assert out["predicted_best"]["dvi"]["speedup"] > out["predicted_best"]["untrained"]["speedup"]
