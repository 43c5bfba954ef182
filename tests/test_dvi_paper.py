"""DVI as the paper trains it (methods/dvi/paper.py) on the course model and a tiny self-distillation set: the
trained head's capacity and init, the KL warm-start lowers held-out KL, a run stopped by max_minutes=0.0 resumes
bit-exact, greedy fp32 DVI with the trained head equals AR, the ablation returns three arms over three seeds,
the CLI's flags. Old (shared-head) policies still load."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import dvi_lite
from dvi_lite.methods.dvi import cli, paper
from dvi_lite.methods.dvi.ablation import ci95, paper_ablation
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.policy import DVIPolicy, _base, load_policy
from dvi_lite.models import distill_data as dd
from dvi_lite.models import distill_reader as rd

MAP = list(range(0, 8192, 4))  # a 2048-token map of the course model's 8192 (no map file is written)
CFG = DVIConfig(split=2, head="trained", lora_rank=4, lora_alpha=8.0, t_lambda=2.0, lr=3e-3, head_lr_mult=0.3,
                fast_every=4, batch_size=8, buffer_size=64, seed=0)
RECIPE = paper.PaperRecipe(warm_tokens=3 * 64, warm_batch=64, sequences=2, max_new_tokens=8, K=3, vocab=MAP,
                           max_prompt_tokens=96, milestones=(100,), val_max_tokens=256, eval_questions=0)


def tiny(tokens: int) -> dd.DistillConfig:
    return dd.DistillConfig(tokens=tokens, layers=(2,), top_k=4, answer_tokens=6, shard_prompts=6,
                            specbench_per_shard=1, gen_batch=6, corpus_windows=2, corpus_len=16, val_every=2)


@pytest.fixture(scope="module")
def course_model():
    from dvi_lite.models.loading import load_model

    model, tok = load_model("course", dtype="float32", device="cpu")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


@pytest.fixture(scope="module")
def built(course_model, tmp_path_factory):
    """A two-shard set: shard 0 (+ the corpus windows) train, shard 1 val."""
    model, tok = course_model
    folder = tmp_path_factory.mktemp("distill")
    card = dd.build(model, tok, tiny(1), folder)
    dd.build(model, tok, tiny(card["answer_tokens"] + 1), folder)
    train = rd.load_as_teacher(folder, "train", layers=(2,), width=64)
    val = rd.load_as_teacher(folder, "val", layers=(2,), width=64, corpus=False)
    return model, tok, train, val


@pytest.fixture(scope="module")
def run_once(built, tmp_path_factory):
    model, tok, train, val = built
    out = tmp_path_factory.mktemp("paper")
    card = paper.train_paper(model, tok, train, val, CFG, RECIPE, out, resume=False)
    return out, card


def test_trained_head_capacity_and_init(course_model):
    model, _ = course_model
    ids = torch.tensor(MAP)
    old = DVIPolicy(model, 2, lora_rank=8, lora_alpha=16.0)
    new = DVIPolicy(model, 2, lora_rank=8, lora_alpha=16.0, head="trained", head_ids=ids)
    d, inter = model.config.hidden_size, model.config.intermediate_size
    n_old = sum(p.numel() for p in old.trainable())
    assert n_old == 8 * (d + inter) * 3 + d + 1  # lora_S on gate/up/down + exit_norm + alpha
    assert sum(p.numel() for p in new.trainable()) == n_old + len(MAP) * d  # + the head's rows
    assert paper.capacity(new)["head_rows"] == len(MAP) * d and paper.capacity(old)["head_rows"] == 0
    # the rows start at the target's (tied embedding) rows, and the head drafts exactly the old head at step 0
    torch.testing.assert_close(new.head_weight, _base(model.lm_head).weight[ids].float(), rtol=0, atol=0)
    h = torch.randn(5, d)
    torch.testing.assert_close(new(h)[:, ids], old(h)[:, ids])
    assert torch.isinf(new(h)[:, 1]).all()  # off the map: q = 0
    with pytest.raises(ValueError, match="head must be one of"):
        DVIConfig(head="big")


def test_committed_heads_load(course_model):
    model, tok = course_model
    pol = load_policy(model, "data/dvi")  # the course model's committed head, written before the option
    assert pol.head == "shared" and pol.head_ids is None
    out = dvi_lite.generate(model, tok, "def add(a, b):", method="dvi", max_new_tokens=8)
    ar = dvi_lite.generate(model, tok, "def add(a, b):", max_new_tokens=8)
    assert out.token_ids == ar.token_ids
    b = torch.load("data/smollm2/dvi/policy.pt", map_location="cpu", weights_only=False)
    # SmolLM2's committed head is the paper's: trained rows, stored as the target's + a low-rank change
    assert b["head"] == "trained" and "head_delta" in b["policy"] and "head_weight" not in b["policy"]
    assert b["policy"]["head_delta"]["U"].dtype == torch.bfloat16


def test_warm_start_lowers_heldout_kl(run_once):
    out, card = run_once
    start = card["curve"][0]
    warm = [p for p in card["curve"] if p["phase"] == "warm"]
    assert start["phase"] == "start" and warm and warm[-1]["tokens"] == 3 * 64
    assert warm[-1]["kl"] < start["kl"]  # the warm-start moves the head towards the target on held-out positions
    assert card["final"]["phase"] == "online" and card["experiences"] > 0
    assert card["capacity"]["head_rows"] == len(MAP) * 256
    assert {p.name for p in (out / "curve").iterdir()} >= {"tokens_192.pt", "tokens_128.pt"}  # milestone 100, end
    snap = torch.load(out / "curve" / "tokens_192.pt", weights_only=False)
    assert snap["policy"]["head_weight"].dtype == torch.float16
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    lam = [r["lambda"] for r in log]
    assert lam == sorted(lam, reverse=True) and lam[0] == 1.0  # lambda_t decays over both phases
    assert [r.get("phase") for r in log][:3] == ["warm"] * 3


def test_stopped_runs_resume_bit_exact(built, run_once, tmp_path):
    model, tok, train, val = built
    ref_dir, ref = run_once
    phases = []
    while True:
        res = paper.train_paper(model, tok, train, val, CFG, dataclasses.replace(RECIPE, max_minutes=0.0), tmp_path)
        if not res.get("stopped"):
            break
        phases.append(res["phase"])
        assert len(phases) < 30
    assert phases.count("warm") == 2 and "online" in phases  # one step per call, in both phases
    a = torch.load(ref_dir / "policy.pt", weights_only=False)["policy"]
    b = torch.load(tmp_path / "policy.pt", weights_only=False)["policy"]
    for key in ("head_weight", "exit_norm", "logit_scale"):
        assert torch.equal(a[key], b[key])
    assert all(torch.equal(a["lora_S"][k], b["lora_S"][k]) for k in a["lora_S"])
    assert [dict(p) for p in res["curve"]] == [dict(p) for p in ref["curve"]]
    with pytest.raises(ValueError, match="another recipe"):
        paper.train_paper(model, tok, train, val, CFG, dataclasses.replace(RECIPE, warm_batch=32), tmp_path)


def test_the_online_phase_may_run_at_its_own_learning_rate(built, tmp_path):
    model, tok, train, val = built
    card = paper.train_paper(model, tok, train, val, CFG, dataclasses.replace(RECIPE, online_lr=1e-5), tmp_path,
                             resume=False)
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    warm, online = [r["lr"] for r in log if r.get("phase") == "warm"], [r["lr"] for r in log if "phase" not in r]
    assert online and max(online) <= 1e-5 < max(warm)
    assert card["config"]["lr"] == CFG.lr and card["recipe"]["online_lr"] == 1e-5
    # a finished run resumes (its checkpoint was saved at the online rate): the same card, nothing retrained
    again = paper.train_paper(model, tok, train, val, CFG, dataclasses.replace(RECIPE, online_lr=1e-5), tmp_path)
    assert again["config"]["lr"] == CFG.lr and again["curve"] == card["curve"]
    with pytest.raises(ValueError, match="online_lr"):
        paper.PaperRecipe(online_lr=0.0).check()


def test_greedy_fp32_dvi_with_the_trained_head_equals_ar(course_model, run_once):
    model, tok = course_model
    out, _ = run_once
    pol = load_policy(model, out)
    assert pol.head == "trained" and pol.head_ids.tolist() == MAP
    for prompt in ("def add(a, b):", "The river", "Question: what is 2 + 3?"):
        ar = dvi_lite.generate(model, tok, prompt, max_new_tokens=16, stop_at_eos=False)
        for threshold in (None, 0.6):
            dv = dvi_lite.generate(model, tok, prompt, method="dvi", state=out, max_new_tokens=16,
                                   threshold=threshold, stop_at_eos=False)
            assert dv.token_ids == ar.token_ids
    with pytest.raises(ValueError, match="trained head scores"):
        dvi_lite.generate(model, tok, "x", method="dvi", state=out, vocab=list(range(64)), max_new_tokens=2)


def test_compact_head_is_the_target_rows_plus_a_low_rank_change(course_model, run_once):
    """A committed head may store U V instead of its rows: loading gives rows + U V, full rank gives the trained
    head back, and greedy DVI with a truncated head still equals AR (any draft is verified)."""
    model, tok = course_model
    out, _ = run_once
    pol = load_policy(model, out)
    full = pol.head_delta(min(pol.head_weight.shape))
    torch.testing.assert_close(pol.target_rows() + full["U"] @ full["V"], pol.head_weight.detach(),
                               atol=1e-4, rtol=0)
    st = pol.trainable_state()
    del st["head_weight"]
    st["head_delta"] = {k: x.half() for k, x in pol.head_delta(2).items()}
    assert st["head_delta"]["U"].shape == (len(MAP), 2) and st["head_delta"]["V"].shape == (2, 256)
    small = DVIPolicy(model, 2, CFG.lora_rank, CFG.lora_alpha, head="trained", head_ids=pol.head_ids)
    small.load_trainable_state(st)
    d = st["head_delta"]
    torch.testing.assert_close(small.head_weight.detach(), pol.target_rows() + d["U"].float() @ d["V"].float())
    ar = dvi_lite.generate(model, tok, "The river", max_new_tokens=12, stop_at_eos=False)
    dv = dvi_lite.generate(model, tok, "The river", method="dvi", state=small, max_new_tokens=12, stop_at_eos=False)
    assert dv.token_ids == ar.token_ids
    with pytest.raises(ValueError, match="rank"):
        pol.head_delta(0)


def test_ablation_ranks_three_arms_over_three_seeds(built, tmp_path):
    model, tok, train, val = built
    recipe = dataclasses.replace(RECIPE, warm_tokens=64, max_new_tokens=6)
    res = paper_ablation(model, tok, train, val, CFG, recipe, seeds=(0, 1, 2), out_dir=tmp_path, command="test")
    assert sorted(res["ranking"]) == ["dvi", "kl", "rl"] and res["seeds"] == [0, 1, 2]
    for arm in ("dvi", "kl", "rl"):
        assert set(res["runs"][arm]) == {"0", "1", "2"}
        assert res["summary"][arm]["agree"]["n"] == 3 and len(res["summary"][arm]["agree"]["ci95"]) == 2
        # equal tokens: the same warm-start positions and the same stream questions per seed in every arm
        assert [r["warm_positions"] for r in res["runs"][arm].values()] == [64, 64, 64]
    assert set(res["paired_vs_dvi"]) == {"kl", "rl"}
    assert res["provenance"]["command"] == "test"
    json.dumps(res)  # JSON-ready


def test_ci95():
    s = ci95([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["sd"] == 1.0
    assert s["ci95"] == pytest.approx([2.0 - 4.303 / 3 ** 0.5, 2.0 + 4.303 / 3 ** 0.5])
    assert ci95([5.0])["ci95"] is None


@pytest.mark.parametrize("argv, words", [
    (["--warm-start-tokens", "-5"], "--warm-start-tokens"),
    (["--max-minutes", "-1"], "--max-minutes"),
    (["--max-minutes", "nan"], "--max-minutes"),
    (["--head", "huge"], "--head"),
    (["--seeds", "0,0"], "--seeds"),
    (["--head-rank", "0", "--save-dtype", "bfloat16"], "--head-rank"),
    (["--head-rank", "8"], "--head-rank"),
])
def test_cli_bad_values_are_one_line_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in err and "error" in err


def test_cli_warm_start_and_online_on_the_set(built, tmp_path, capsys):
    model, tok, train, val = built
    folder = Path(train.card["source"])
    out = tmp_path / "out"
    argv = ["--data", str(folder), "--split", "2", "--warm-start-tokens", "64", "--warm-batch", "64",
            "--sequences", "2", "--max-new-tokens", "16", "--K", "3", "--vocab", "full", "--lora-rank", "2",
            "--eval-prompts", "0", "--out", str(out), "--ckpt-dir", str(tmp_path / "ck"),
            "--json", str(tmp_path / "stream.json")]
    assert cli.main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["warm_positions"] == 64 and card["config"]["head"] == "trained"
    assert card["capacity"]["head_rows"] == 8192 * 256 and (out / "policy.pt").is_file()
    res = json.loads((tmp_path / "stream.json").read_text())  # the run's stream: acceptance over its questions
    assert res["stream"] and all(0 <= b["accept_rate"] <= 1 and b["questions"][1] <= 2 for b in res["stream"])
    assert res["provenance"]["command"] and res["recipe"]["sequences"] == 2
    from dvi_lite.methods.dvi.figure import stream_figure

    assert len(stream_figure(res).data) == 1  # no held-out bench in this run (--eval-prompts 0): the stream alone
    with pytest.raises(ValueError, match="no online stream"):
        stream_figure({**res, "stream": []})
