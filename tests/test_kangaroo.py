"""Kangaroo drafter: lossless greedy decoding, consistent adapter cache, clear errors."""
import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer, assert_lossless_sampling
from transformers import LlamaForCausalLM

import dvi_lite
from dvi_lite.core.engine import start, step
from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter, KangarooDrafter, load_adapter, save_adapter


@pytest.fixture(scope="module")
def model(deep_model):
    return deep_model


PROMPTS = DEEP_PROMPTS


@pytest.mark.parametrize("split,threshold,branch", [(1, None, 1), (2, 0.6, 1), (3, 0.95, 1), (1, None, 3), (2, 0.3, 2)])
def test_greedy_equals_ar(model, split, threshold, branch):
    adapter = KangarooAdapter(model, split).eval()
    alphas = []
    for p in PROMPTS:
        ar = dvi_lite.generate(model, IdTokenizer(), p, max_new_tokens=40, stop_at_eos=False)
        kg = dvi_lite.generate(model, IdTokenizer(), p, method="kangaroo", split=split, adapter=adapter,
                               threshold=threshold, branch=branch, max_new_tokens=40, stop_at_eos=False)
        assert kg.token_ids == ar.token_ids
        alphas.append(kg.stats.alpha)
    assert any(a < 1 for a in alphas)


@pytest.mark.parametrize("greedy,branch", [(True, 1), (False, 1), (True, 3), (False, 2)])
def test_adapter_cache_equals_fresh_computation(model, greedy, branch):
    """After any mix of accepts/rejects (incl. the all-accepted 'last draft token' case and accepted
    tree leaves), the adapter's cache + todo equal the adapter run once over every committed position."""
    split = 2
    adapter = KangarooAdapter(model, split).eval()
    runner = Runner(model)
    drafter = KangarooDrafter(runner, adapter, K=4, threshold=None, branch=branch)
    sampler = Sampler() if greedy else Sampler(temperature=1.0)
    state = start(runner, drafter, PROMPTS[0], 40, sampler, make_generator(0))
    all_accepted = False
    for _ in range(8):
        out, st = step(state, drafter)
        all_accepted |= st.accepted == st.depth
    committed = state.tokens[:-1]
    ids = torch.tensor([committed])
    with torch.no_grad():
        hk = runner.layers_forward(runner.embed(ids), None, runner.positions(None, len(committed)), 0, split)
        fresh = KVCache.for_model(model, 64, n_layers=1)
        pos = torch.arange(len(committed))[None]
        adapter(hk, runner.rotary(hk, pos), fresh)
    n = len(drafter.cache)
    todo = sum(t.shape[1] for t in drafter.todo)
    assert n + todo == len(committed)
    k_live, v_live = drafter.cache.layer(0)
    k_ref, v_ref = fresh.layer(0)
    torch.testing.assert_close(k_live, k_ref[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_live, v_ref[:, :, :n], atol=1e-4, rtol=1e-4)
    if todo:
        torch.testing.assert_close(torch.cat(drafter.todo, 1), hk[:, n:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("branch,threshold", [(1, None), (2, 0.3)])
def test_sampling_is_lossless_end_to_end(target8, tok8, branch, threshold):
    """Chain (rejection sampling with q) and tree (top-k point masses) drafts: output law = p's."""
    assert_lossless_sampling(target8, tok8, "kangaroo", split=1, adapter=KangarooAdapter(target8, 1).eval(),
                             K=3, threshold=threshold, branch=branch)


def test_missing_adapter_is_a_clear_error(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no Kangaroo adapter"):
        load_adapter(model, 2, tmp_path / "none.pt")


def test_adapter_for_another_model_is_rejected(model, tmp_path):
    torch.manual_seed(1)
    other = LlamaForCausalLM(model.config).eval()
    save_adapter(KangarooAdapter(other, 2), other, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="another model"):
        load_adapter(model, 2, tmp_path / "a.pt")


@pytest.mark.parametrize("kw,msg", [(dict(split=0), "split"), (dict(split=4), "split"),
                                    (dict(split=2, threshold=0.0), "threshold"),
                                    (dict(split=2, threshold=1.2), "threshold"),
                                    (dict(split=2, branch=0), "branch"), (dict(split=2, K=0), "'K'"),
                                    (dict(split=1), "trained for exit layer 2")])
def test_bad_inputs(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(model, IdTokenizer(), [1, 2], method="kangaroo", adapter=KangarooAdapter(model, 2), **kw)


def test_default_split(model, tmp_path, monkeypatch):
    """split=None: an adapter object's own exit layer, else the one default (default_split), per-split file."""
    from dvi_lite.core.checks import default_split
    from dvi_lite.methods.kangaroo import drafter as kd

    adapter = KangarooAdapter(model, 3).eval()
    assert kd.make_drafter(model, IdTokenizer(), adapter=adapter).split == 3
    torch.manual_seed(0)
    save_adapter(KangarooAdapter(model, default_split(4)), model, kd.adapter_path(default_split(4), tmp_path))
    monkeypatch.setattr(kd, "model_adapter_path", lambda m, split: kd.adapter_path(split, tmp_path))
    d = kd.make_drafter(model, IdTokenizer())
    assert d.split == d.adapter.split == default_split(4) and d.K == 6 and d.threshold == 0.6


def test_distillation_reduces_kl(model):
    from dvi_lite.methods.kangaroo.train import distill_loss

    torch.manual_seed(0)
    adapter = KangarooAdapter(model, 1).train()
    runner = Runner(model)
    opt = torch.optim.AdamW(adapter.parameters(), lr=3e-3)
    x = torch.randint(64, (4, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = distill_loss(adapter, runner, x).item()
    for _ in range(30):
        loss = distill_loss(adapter, runner, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the target stays frozen
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("argv, msg", [(["--steps", "0"], "--steps must be >= 1"), (["--split", "99"], "split")])
def test_train_cli_bad_inputs_are_usage_errors(argv, msg, capsys, tmp_path):
    from dvi_lite.methods.kangaroo.train import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "a.pt")])
    assert e.value.code == 2 and msg in capsys.readouterr().err


# ------------------------------------------------------------------ the teacher-based recipe (real models)

def _teacher(model, n_rows=6, t=20, split=2):
    from dvi_lite.models.teacher import TeacherConfig, teacher_outputs

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(64, (t - i,), generator=g).tolist() for i in range(n_rows)]
    return teacher_outputs(model, rows, TeacherConfig(layers=(split,), top_k=8))


def test_map_targets_drops_and_renormalises_off_map_ids(model):
    from dvi_lite.methods.kangaroo.distill import map_targets
    from dvi_lite.models.teacher import soft_ce
    from dvi_lite.models.vocab import TrimmedHead

    head = TrimmedHead(model.lm_head, torch.tensor([5, 3, 9]))
    top_ids = torch.tensor([[3, 7, 9], [7, 8, 1]])  # row 0: 7 is off the map; row 1: all off
    top_logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    ids, logp, keep = map_targets(head, top_ids, top_logp)
    assert keep.tolist() == [True, False]
    assert ids[0, 0] == 1 and ids[0, 2] == 2  # positions in the map
    logq = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]]))
    ce = soft_ce(logq, ids, logp)[0]
    p = torch.tensor([0.5, 0.2]) / 0.7  # 3 and 9, renormalised
    torch.testing.assert_close(ce, -(p * torch.log(torch.tensor([0.5, 0.3]))).sum())


def test_teacher_training_step_reduces_loss_and_keeps_target_frozen(model):
    from dvi_lite.methods.kangaroo.distill import teacher_batch, teacher_loss
    from dvi_lite.models.vocab import TrimmedHead

    data = _teacher(model)
    torch.manual_seed(0)
    adapter = KangarooAdapter(model, 2).train()
    head = TrimmedHead(model.lm_head, torch.arange(0, 64, 2))
    runner = Runner(model)
    b = teacher_batch(data, 2, torch.tensor([0, 3, 5]))
    assert b["h"].shape[:2] == b["mask"].shape and b["h"].shape[1] == 20  # cropped to the longest row
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(adapter.parameters(), lr=3e-3)
    first = teacher_loss(adapter, runner, head, b).item()
    for _ in range(30):
        loss = teacher_loss(adapter, runner, head, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.zero_grad(set_to_none=True)


def test_fit_adapter_resumes_to_the_same_weights(model, tmp_path):
    from dvi_lite.methods.kangaroo.distill import TeacherFitConfig, fit_adapter

    data = _teacher(model)
    cfg = TeacherFitConfig(split=2, steps=4, batch_rows=2, warmup=1, vocab=list(range(0, 64, 2)), bf16=False,
                           val_frac=0.34, ckpt_every_s=0.0)
    a, card = fit_adapter(model, IdTokenizer(), data, cfg, ckpt=tmp_path / "full.pt", progress=False)
    assert card["val_rows"] == 2 and card["train_rows"] == 4 and 0 <= card["val"]["alpha"] <= 1
    fit_adapter(model, IdTokenizer(), data, TeacherFitConfig(**{**cfg.__dict__, "steps": 2}), ckpt=tmp_path / "r.pt",
                progress=False)
    ck = torch.load(tmp_path / "r.pt", weights_only=False)
    ck["step"] = 2
    torch.save(ck, tmp_path / "r.pt")
    b, _ = fit_adapter(model, IdTokenizer(), data, cfg, resume=True, ckpt=tmp_path / "r.pt", progress=False)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, msg=k)
    with pytest.raises(ValueError, match="states after layers"):
        fit_adapter(model, IdTokenizer(), data, TeacherFitConfig(**{**cfg.__dict__, "split": 3}), progress=False)


def test_evaluate_keeps_only_the_scored_positions_of_each_row(model):
    """A record window scores its answer part only (the mask starts after the prompt): the per-row detail the sweep
    replays holds exactly those positions, so a draft's token sits beside the label of the same position."""
    from dvi_lite.methods.kangaroo.distill import evaluate
    from dvi_lite.models.vocab import TrimmedHead

    data = _teacher(model)
    data.mask[:, :5] = False  # a prompt of 5 positions in every row
    head = TrimmedHead(model.lm_head, torch.arange(64))
    ev = evaluate(KangarooAdapter(model, 2).eval(), Runner(model), head, data, torch.arange(6))
    for r in ev["per_row"]:
        m = data.mask[r["row"]]
        assert len(r["draft"]) == int(m.sum()) == len(r["tokens"])
        assert torch.equal(r["tokens"], data.tokens[r["row"]][m])
        assert torch.equal(r["teacher"], data.top_ids[r["row"], :, 0][m])
    assert ev["positions"] == int(data.mask.sum())


def test_greedy_labels_are_the_models_own_top1(model):
    from dvi_lite.methods.kangaroo.sweep import greedy_labels

    data = _teacher(model)
    greedy_labels(model, data)
    with torch.no_grad():
        want = model(input_ids=data.tokens).logits.argmax(-1)  # (N, T)
    assert data.top_ids.shape[-1] == 1 and torch.equal(data.top_ids[..., 0], want)
    assert float(data.top_logp.abs().max()) == 0.0  # one-hot targets


@pytest.mark.parametrize("argv, msg", [(["--steps", "0"], "--steps must be >= 1"),
                                       (["--train-tokens", "0"], "--train-tokens must be >= 1")])
def test_sweep_cli_bad_inputs_are_usage_errors(argv, msg, capsys, tmp_path):
    from dvi_lite.methods.kangaroo.sweep import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--json", str(tmp_path / "s.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_replay_follows_double_early_exit():
    from dvi_lite.methods.kangaroo.sweep import needed_tau, predict, replay

    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7])  # the row; the teacher's top-1 at t is tokens[t + 1]
    teacher = torch.tensor([8, 2, 3, 4, 5, 6, 7, 0])  # position 0 is the prompt (not greedy)
    draft = torch.tensor([8, 2, 3, 0, 5, 6, 7, 0])  # wrong at 3
    conf = torch.tensor([1.0, 0.9, 0.9, 0.9, 0.9, 0.4, 0.9, 0.9])
    row = {"answer": True, "tokens": tokens, "teacher": teacher, "draft": draft, "conf": conf}
    # greedy run [1, 7): from 1: drafts 1..4 (K=4), accepts 2 (1, 2), tau 3; from 4: drafts 4, 5 (conf 0.4 < 0.6,
    # still proposed) -> 2 accepted, tau 3; from 7: the run's end
    assert replay([row], 0.6, 4) == {"tau": 3.0, "drafted": 3.0, "steps": 2}
    assert replay([row], None, 4)["drafted"] == 3.5  # from 4: 3 drafts to the run's end
    pred = predict([row], c=0.1, v={1: 1.0, 5: 1.0}, etas=(0.6,), k_max=4)[0]
    assert pred["predicted_speedup"] == pytest.approx(3.0 / (1.0 + 3 * 0.1))
    assert needed_tau(1.3, 3.0, 0.1, {1: 1.0, 5: 1.0}) == pytest.approx(1.3 * 1.3)


def test_prepare_smollm2_smoke_on_the_course_model(tmp_path):
    """The SmolLM2 recipe end to end in smoke mode (a tiny teacher, 3 steps) on the course model."""
    from dvi_lite.methods.kangaroo.drafter import load_adapter
    from dvi_lite.methods.kangaroo.train import SMOLLM2_SPLIT, prepare_smollm2
    from dvi_lite.models.loading import load_model

    out = prepare_smollm2("course", tmp_path, "pytest", smoke=True)
    path = tmp_path / "kangaroo" / f"adapter_k{SMOLLM2_SPLIT}.pt"
    assert out["kangaroo adapter"] == str(path) and out["split"] == SMOLLM2_SPLIT
    card = __import__("json").loads(path.with_suffix(".json").read_text())
    assert card["steps"] == 3 and card["command"] == "pytest" and card["device"].startswith("cpu")
    assert {"data", "commit", "wall_time_s", "val", "init"} <= set(card)
    for dtype in ("float32", "bfloat16"):  # found whatever dtype the model is loaded in
        m, _ = load_model("course", dtype=dtype)
        a = load_adapter(m, SMOLLM2_SPLIT, path)
        assert next(a.parameters()).dtype == next(m.parameters()).dtype


def test_train_cli_from_teacher(tmp_path, capsys):
    """`kangaroo-train --teacher FILE`: the teacher-based recipe from the command line, with its card."""
    import json
    from dataclasses import asdict

    from dvi_lite.methods.kangaroo.train import main
    from dvi_lite.models.loading import load_model
    from dvi_lite.models.teacher import TeacherConfig, teacher_outputs
    from dvi_lite.models.vocab import save_vocab_map

    m, tok = load_model("course")
    texts = ("def f(x):\n    return x", "The cat sat on the mat.", "for i in range(3)")
    rows = [tok(t)["input_ids"][:24] for t in texts]
    data = teacher_outputs(m, rows, TeacherConfig(layers=(2,), top_k=8))
    torch.save(asdict(data), tmp_path / "t.pt")
    save_vocab_map(torch.arange(300), m, tmp_path / "v.pt")
    assert main(["--teacher", str(tmp_path / "t.pt"), "--split", "2", "--steps", "2", "--vocab", str(tmp_path / "v.pt"),
                 "--out", str(tmp_path / "a.pt")]) == 0
    card = json.loads((tmp_path / "a.json").read_text())
    assert card["steps"] == 2 and card["split"] == 2 and card["vocab_n"] == 300
    assert card["command"].startswith("python -m dvi_lite kangaroo-train --teacher")
    capsys.readouterr()


def test_vocab_defaults_to_the_head_the_adapter_was_trained_through(tmp_path):
    """None reads the adapter card's trimmed-head size (as DVI reads its head's); 'full' overrides it."""
    import json

    from dvi_lite.methods.kangaroo.drafter import trained_vocab

    path = tmp_path / "adapter_k4.pt"
    assert trained_vocab(path) is None  # no card: the full head
    path.with_suffix(".json").write_text(json.dumps({"vocab_n": 8192}))
    assert trained_vocab(path) == 8192
    path.with_suffix(".json").write_text(json.dumps({"config": {"vocab": 4096}}))
    assert trained_vocab(path) == 4096
    from dvi_lite.paths import DATA_DIR

    assert trained_vocab(DATA_DIR / "smollm2" / "kangaroo" / "adapter_k2.pt") == 8192  # SmolLM2's committed one
    assert trained_vocab(DATA_DIR / "kangaroo" / "adapter_k2.pt") is None  # the course model's: the full head


def test_smollm2_pieces_and_recipes_share_one_exit_layer():
    """defaults.json's exit is the one the committed adapter and DVI head were trained at, and the one both recipes
    and `prepare` would retrain them at: a piece moved to another exit without the rest fails here."""
    import json

    from dvi_lite.methods.dvi import cli as dvi_cli
    from dvi_lite.methods.kangaroo import train as kangaroo_train
    from dvi_lite.paths import DATA_DIR
    from dvi_lite.study.prepare import SMOLLM2_RECIPES

    home = DATA_DIR / "smollm2"
    split = json.loads((home / "defaults.json").read_text())["split"]
    assert kangaroo_train.SMOLLM2_SPLIT == dvi_cli.SMOLLM2_SPLIT == split
    assert json.loads((home / "dvi" / "card.json").read_text())["split"] == split
    adapter = dict((name, f) for name, _, _, f in SMOLLM2_RECIPES)["kangaroo adapter"]
    assert adapter == f"kangaroo/adapter_k{split}.pt" and (home / adapter).is_file()
    assert json.loads((home / adapter).with_suffix(".json").read_text())["split"] == split
    # the tables that read the adapter's card name the same file
    from dvi_lite.course.ch07_eagle import SOURCES
    from dvi_lite.paths import ROOT
    from dvi_lite.study.scaling import PIECES

    card = f"kangaroo/adapter_k{split}.json"
    assert SOURCES["kangaroo"][0] == PIECES["kangaroo"][0] == card
    assert f'"kangaroo adapter": "{card}"' in (ROOT / "scripts" / "gpu_record.py").read_text()
