"""DVI drafter + online trainer: lossless greedy before/after training, LoRA routing, exact resume,
the bootstrap problem in miniature, the NaN guard, checkpoints, the CLI, clear errors. Tiny models only."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import dvi_lite
from dvi_lite.core.engine import start, step
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.drafter import DVIDrafter, evaluate
from dvi_lite.methods.dvi.learner import NonFiniteError, OnlineTrainer
from dvi_lite.methods.dvi.losses import fast_loss
from dvi_lite.methods.dvi.policy import LORA_D, DVIPolicy, load_policy, verifier_lora_params

BASE = dict(split=2, fast_every=8, batch_size=16, buffer_size=256, t_lambda=10.0, slow_every=2, seed=0)


def fresh(model):
    """An independent copy of the fixture model (slow updates inject lora_D into the model in place).

    Nothing cached travels with the copy: Runner.for_model and models.artifacts.load_cached key on the
    model object itself, so the copy gets its own runner and loads its own pieces."""
    return copy.deepcopy(model)


def trainer(model, cfg=None, **kw):
    kw.setdefault("max_new_tokens", 24)
    return OnlineTrainer(model, DEEP_PROMPTS, DVIConfig(**{**BASE, **(cfg or {})}), progress=False, **kw)


def check_greedy_equals_ar(model, policy, threshold=None, n=30):
    alphas = []
    for p in DEEP_PROMPTS:
        ar = dvi_lite.generate(model, IdTokenizer(), p, max_new_tokens=n, stop_at_eos=False)
        dv = dvi_lite.generate(model, IdTokenizer(), p, method="dvi", state=policy, threshold=threshold,
                               max_new_tokens=n, stop_at_eos=False)
        assert dv.token_ids == ar.token_ids
        alphas.append(dv.stats.alpha)
    return alphas


def snapshot(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


def changed(before: dict, after_named) -> set[str]:
    return {n for n, p in after_named if not torch.allclose(before[n], p.detach(), rtol=0, atol=0, equal_nan=True)}


# ------------------------------------------------------------------------------------ lossless decoding


def test_untrained_policy_is_the_early_exit_head(deep_model):
    """lora_S's branch starts at exactly 0 (zero base down_proj, LoRA B = 0): step 0 of DVI = early exit."""
    runner = Runner(deep_model)
    pol = DVIPolicy(deep_model, 2)
    h = torch.randn(1, 5, 32) * 3
    with torch.no_grad():
        torch.testing.assert_close(pol(h), runner.logits(h), rtol=1e-5, atol=1e-5)
    for p in DEEP_PROMPTS[:2]:
        ee = dvi_lite.generate(deep_model, IdTokenizer(), p, method="early_exit", split=2, max_new_tokens=20,
                               stop_at_eos=False)
        dv = dvi_lite.generate(deep_model, IdTokenizer(), p, method="dvi", state=pol, threshold=None,
                               max_new_tokens=20, stop_at_eos=False)
        assert [s.accepted for s in dv.stats.steps] == [s.accepted for s in ee.stats.steps]
    trainable = set(pol.named_trainable())
    assert {"exit_norm.weight", "logit_scale"} <= trainable
    assert all(n in ("exit_norm.weight", "logit_scale") or ".lora_S." in n for n in trainable)
    assert sum(".lora_S." in n for n in trainable) == 6  # A and B of gate/up/down


@pytest.mark.parametrize("split,threshold", [(1, None), (2, 0.6), (3, None)])
def test_greedy_equals_ar_before_training(deep_model, split, threshold):
    alphas = check_greedy_equals_ar(deep_model, DVIPolicy(deep_model, split), threshold)
    assert any(a < 1 for a in alphas)  # drafts do get rejected: the test is not vacuous


def test_training_improves_draft_and_stays_lossless(deep_model):
    tr = trainer(deep_model, cfg=dict(lr=3e-3), warmup=0)
    before = snapshot(tr.policy.named_trainable().items())
    with torch.no_grad():  # agreement with the verifier's top-1 on a fixed set of experiences
        tr._decode_next()
        tr._decode_next()
        h, t = tr.buffer.h[: len(tr.buffer)], tr.buffer.teacher_logits[: len(tr.buffer)]
        agree0 = (tr.policy(h).argmax(-1) == t.argmax(-1)).float().mean().item()
    recs = tr.train(12)
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert recs[0]["lambda"] == 1.0 and recs[-1]["lambda"] == pytest.approx(math.exp(-11 / 10))
    assert all(math.isfinite(r["loss"]) for r in recs)
    with torch.no_grad():
        agree1 = (tr.policy(h).argmax(-1) == t.argmax(-1)).float().mean().item()
    assert agree1 > agree0 + 0.3
    assert changed(before, tr.policy.named_trainable().items())
    for threshold in (None, 0.6):
        check_greedy_equals_ar(deep_model, tr.policy, threshold)


def test_the_merged_inference_copy_drafts_what_the_policy_drafts(deep_model):
    """MergedExit (lora_S merged, the model's dtype) computes the trained policy's logits: fp32 to rounding, and
    in bf16 the same top-1 nearly always; a learning drafter keeps drafting through the policy itself."""
    from dvi_lite.methods.dvi.merged import MergedExit

    tr = trainer(deep_model, cfg=dict(lr=3e-3), warmup=0)
    tr.train(6)
    pol = tr.policy
    h = torch.randn(1, 20, deep_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = pol(h)  # (1, 20, V) float32
        got = MergedExit(pol, torch.float32).logits(h, deep_model.lm_head, None)
        assert (got - want).abs().max().item() < 1e-4
        head16 = copy.deepcopy(deep_model.lm_head).to(torch.bfloat16)
        half = MergedExit(pol, torch.bfloat16).logits(h.bfloat16(), head16, None)
        assert (half.float().argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert DVIDrafter(Runner.for_model(deep_model), pol, collect=True).merged is None
    first = DVIDrafter(Runner.for_model(deep_model), pol).merged
    assert first is not None and DVIDrafter(Runner.for_model(deep_model), pol).merged is first  # kept
    tr.train(1)  # a training step changes the policy: the next drafter merges it again
    again = DVIDrafter(Runner.for_model(deep_model), tr.policy).merged
    assert again is not first and (again.logits(h, deep_model.lm_head, None) - tr.policy(h)).abs().max() < 1e-4


def test_feedback_records_tested_drafts_with_verifier_logits(deep_model):
    runner = Runner(deep_model)
    drafter = DVIDrafter(runner, DVIPolicy(deep_model, 2), K=4, collect=True)
    state = start(runner, drafter, DEEP_PROMPTS[0], 40, Sampler(), make_generator(0), max_draft=drafter.max_draft)
    n_rec = []
    for _ in range(6):
        pending_pos = len(state.tokens) - 1  # the pending token's position (= committed positions)
        out, st = step(state, drafter)
        h, toks, rew, logits = drafter.drain()
        tested = min(st.drafted, st.accepted + 1)
        n_rec.append(tested)
        assert h.shape[0] == toks.numel() == rew.numel() == logits.shape[0] == tested
        assert rew.tolist() == [1.0] * st.accepted + [0.0] * (tested - st.accepted)
        assert torch.equal(toks, out.proposal.tokens[:tested])
        # reference: the full model and its first 2 layers, no cache, over the tested inputs
        # [pending, d1, ..., d_{tested-1}]: all of them are now in state.tokens (accepted or pending)
        ids = torch.tensor([state.tokens[: pending_pos + tested]])
        with torch.no_grad():
            pos = torch.arange(ids.shape[1])[None]
            hk = runner.layers_forward(runner.embed(ids), None, pos, 0, 2)
            ref = runner.logits(runner.layers_forward(hk, None, pos, 2))
        torch.testing.assert_close(logits, ref[0, pending_pos:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h, hk[0, pending_pos:], rtol=1e-4, atol=1e-4)
    assert drafter.drain() is None and sum(n_rec) > 6


# ------------------------------------------------------------------------------------ LoRA routing


def test_lora_routing_fast_and_slow(deep_model):
    model = fresh(deep_model)
    tr = trainer(model, slow_updates=True)
    base_before = snapshot((n, p) for n, p in model.named_parameters() if LORA_D not in n)
    pristine = dict(deep_model.named_parameters())  # injection only wrapped the deep linears (base_layer)
    assert all(torch.equal(p, pristine[n.replace(".base_layer", "")]) for n, p in base_before.items())
    lora_d = [(n, p) for n, p in model.named_parameters() if f".{LORA_D}." in n]
    assert len(lora_d) == 2 * 7 * 2  # A and B of q/k/v/o/gate/up/down in layers 2 and 3
    assert all(p.requires_grad for _, p in lora_d) and not any(p.requires_grad for n, p in model.named_parameters()
                                                                if LORA_D not in n)
    d0 = snapshot(lora_d)
    pol0 = snapshot(tr.policy.named_parameters())
    tr.train(1)  # one fast update, no slow one (slow_every=2)
    assert tr.slow_step == 0
    moved = changed(pol0, tr.policy.named_parameters())
    assert {"exit_norm.weight", "logit_scale"} <= moved
    assert any(".lora_S." in n for n in moved)
    assert all(n in ("exit_norm.weight", "logit_scale") or ".lora_S." in n for n in moved)  # never the block base
    assert not changed(d0, lora_d)
    assert not changed(base_before, ((n, p) for n, p in model.named_parameters() if LORA_D not in n))
    pol1 = snapshot(tr.policy.named_parameters())
    tr._slow_update()
    assert tr.slow_step == 1
    assert changed(d0, lora_d)  # only lora_D moved
    assert not changed(pol1, tr.policy.named_parameters())
    assert not changed(base_before, ((n, p) for n, p in model.named_parameters() if LORA_D not in n))
    tr.train(1)  # fast step 2 triggers the scheduled slow update
    assert tr.slow_step == 2
    # the verifier changed, and DVI is lossless w.r.t. the UPDATED verifier (AR with lora_D active)
    with torch.no_grad():
        x = torch.tensor([DEEP_PROMPTS[0]])
        assert not torch.equal(model(x).logits, deep_model(x).logits)
    check_greedy_equals_ar(model, tr.policy)


# ------------------------------------------------------------------------------------ resume


def _run(deep_model, tmp_path, split_at: int | None, total=6):
    kw = dict(cfg=dict(rl_variant="reinforce", accepted_only=True, backoff_min=4), slow_updates=True,
              temperature=1.0, total_steps=total, warmup=2)
    tr = trainer(fresh(deep_model), log_path=tmp_path / "log.jsonl", **kw)
    if split_at is None:
        tr.train(total)
        return tr
    tr.train(split_at)
    tr.save_checkpoint(tmp_path / "ck")
    tr.train(1)  # work done after the checkpoint and then lost (a kill): the resume must forget it
    tr2 = trainer(fresh(deep_model), log_path=tmp_path / "log.jsonl", **kw)
    tr2.load_checkpoint(tmp_path / "ck")
    tr2.train(total - split_at)
    return tr2


def test_resume_equals_uninterrupted_run(deep_model, tmp_path):
    a = _run(deep_model, tmp_path / "a", None)
    b = _run(deep_model, tmp_path / "b", 3)
    counters = ("fast_step", "slow_step", "prompt_idx", "unconsumed")
    assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
    assert a.slow_step == 3
    for (n, p), (_, q) in zip(a.policy.named_parameters(), b.policy.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    for p, q in zip(verifier_lora_params(a.model), verifier_lora_params(b.model), strict=True):
        assert torch.equal(p, q)
    assert a.baseline.state_dict() == b.baseline.state_dict()
    sa, sb = a.buffer.state_dict(), b.buffer.state_dict()
    for k in sa:
        assert (torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k]), k
    assert torch.equal(a.gen.get_state(), b.gen.get_state())
    for o1, o2 in ((a.fast_opt, b.fast_opt), (a.slow_opt, b.slow_opt)):
        for s1, s2 in zip(o1.state_dict()["state"].values(), o2.state_dict()["state"].values(), strict=True):
            assert all(torch.equal(s1[k], s2[k]) for k in s1)
    la = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 7))  # the lost step 4 was cut from the log on resume
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]


def test_checkpoint_rejects_other_config(deep_model, tmp_path):
    tr = trainer(deep_model)
    tr.train(1)
    tr.save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="config differs"):
        trainer(deep_model, cfg=dict(lr=5e-3)).load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no DVI trainer checkpoint"):
        trainer(deep_model).load_checkpoint(tmp_path / "none")


# ------------------------------------------------------------------------------------ bootstrap


def test_bootstrap_pure_rl_has_no_signal_kl_warmup_does(deep_model):
    """Cold start in miniature: on rejected drafts with baseline 0, REINFORCE's advantage is 0 - exactly
    zero gradient - while the lambda_0 = 1 KL term (the verifier's full distribution) is a dense signal."""
    tr = trainer(deep_model)
    while len(tr.buffer) < 64:
        tr._decode_next()
    rej = tr.buffer.rewards[: len(tr.buffer)] == 0
    assert rej.float().mean() > 0.5  # an untrained head: mostly rejected
    h, t = tr.buffer.h[: len(tr.buffer)][rej], tr.buffer.teacher_logits[: len(tr.buffer)][rej]
    toks, rew = tr.buffer.tokens[: len(tr.buffer)][rej], tr.buffer.rewards[: len(tr.buffer)][rej]

    def grad_norm(cfg, t_step):
        tr.policy.zero_grad(set_to_none=True)
        s = tr.policy(h)
        batch = {"student_logits": s, "teacher_logits": t, "tokens": toks, "rewards": rew}
        loss, _ = fast_loss(batch, cfg, t_step, 0.0)
        loss.backward()
        g = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in tr.policy.trainable() if p.grad is not None))
        tr.policy.zero_grad(set_to_none=True)
        return g

    pure_rl = DVIConfig(**{**BASE, "rl_variant": "reinforce", "kl_floor": 0.0, "ce_weight": 0.0})
    assert grad_norm(pure_rl, 10**6) == 0.0  # lambda = 0: RL only, nothing accepted, b = 0
    assert grad_norm(pure_rl, 0) > 1e-2  # lambda_0 = 1: KL warm-up


# ------------------------------------------------------------------------------------ NaN guard


def test_nan_guard_stops_and_keeps_last_good_checkpoint(deep_model, tmp_path):
    tr = trainer(deep_model, ckpt_dir=tmp_path / "ck", ckpt_every=2, log_path=tmp_path / "log.jsonl")
    tr.train(2)
    ck_bytes = (tmp_path / "ck" / "trainer.pt").read_bytes()
    with torch.no_grad():
        tr.policy.exit_norm.weight[0] = float("nan")
    before = snapshot(tr.policy.named_parameters())
    with pytest.raises(NonFiniteError, match=r"non-finite fast loss at fast step 2.*NOT applied.*ck"):
        tr.train(3)
    assert tr.fast_step == 2
    assert not changed(before, tr.policy.named_parameters())
    assert (tmp_path / "ck" / "trainer.pt").read_bytes() == ck_bytes
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    tr2 = trainer(deep_model)
    tr2.load_checkpoint(tmp_path / "ck")
    assert tr2.fast_step == 2 and all(torch.isfinite(p).all() for p in tr2.policy.parameters())


# ------------------------------------------------------------------------------------ saving, the method


def test_saved_policy_drives_the_method(deep_model, tmp_path):
    tr = trainer(deep_model)
    tr.train(3)
    tr.save_policy(tmp_path)
    loaded = load_policy(deep_model, tmp_path)
    for (n, p), (_, q) in zip(tr.policy.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    for p in DEEP_PROMPTS[:2]:
        a = dvi_lite.generate(deep_model, IdTokenizer(), p, method="dvi", state=tr.policy, max_new_tokens=20)
        b = dvi_lite.generate(deep_model, IdTokenizer(), p, method="dvi", state=str(tmp_path), split=2,
                              max_new_tokens=20)
        assert a.token_ids == b.token_ids
        assert [s.accepted for s in a.stats.steps] == [s.accepted for s in b.stats.steps]
    ev = evaluate(deep_model, IdTokenizer(), DEEP_PROMPTS, tmp_path, max_new_tokens=16)
    assert ev["prompts"] == 4 and 1.0 <= ev["tau"] and 0.0 <= ev["alpha"] <= 1.0
    with pytest.raises(ValueError, match="split 3 requested"):
        dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="dvi", state=tmp_path, split=3)
    torch.manual_seed(1)
    other = LlamaForCausalLM(deep_model.config).eval()
    with pytest.raises(ValueError, match="another model"):
        load_policy(other, tmp_path)


def test_missing_state_is_a_clear_error(deep_model, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no DVI policy.*python -m dvi_lite dvi"):
        dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="dvi", state=tmp_path / "none")


@pytest.mark.parametrize("cfg,msg", [(dict(t_lambda=0.0), "t_lambda"), (dict(t_lambda=-1.0), "t_lambda"),
                                     (dict(kl_floor=1.5), "kl_floor"), (dict(kl_floor=-0.1), "kl_floor"),
                                     (dict(lora_rank=0), "lora_rank"), (dict(split=0), "split"),
                                     (dict(split=4), "split")])
def test_bad_config(deep_model, cfg, msg):
    with pytest.raises(ValueError, match=f"^{msg}"):
        trainer(deep_model, cfg=cfg)


@pytest.mark.parametrize("kw,msg", [(dict(split=0), "split"), (dict(split=4), "split"),
                                    (dict(threshold=1.5), "threshold"),
                                    (dict(K=0), "option 'K'")])
def test_bad_method_options(deep_model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="dvi", state=DVIPolicy(deep_model, 2), **kw)


def test_bad_trainer_inputs(deep_model):
    with pytest.raises(ValueError, match="prompts"):
        OnlineTrainer(deep_model, [], DVIConfig(**BASE))
    with pytest.raises(ValueError, match="max_new_tokens"):
        trainer(deep_model, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompts\[1\].*context"):
        OnlineTrainer(deep_model, [[1, 2], [3] * 250], DVIConfig(**BASE), max_new_tokens=10)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids"):
        OnlineTrainer(deep_model, [[1, 64]], DVIConfig(**BASE))
    with pytest.raises(ValueError, match="lora_rank"):
        DVIPolicy(deep_model, 2, lora_rank=0)
    with pytest.raises(ValueError, match="split"):
        DVIPolicy(deep_model, 4)


def test_bf16_training_runs(deep_model):
    """dtype-generic: a bf16 model trains (policy and adapters in fp32) with finite losses."""
    m = fresh(deep_model).to(torch.bfloat16)
    tr = trainer(m, slow_updates=True)
    before = [p.detach().clone() for p in tr.policy.trainable() + verifier_lora_params(m)]
    recs = tr.train(2)
    assert tr.slow_step == 1 and all(math.isfinite(r["loss"]) for r in recs)
    after = tr.policy.trainable() + verifier_lora_params(m)
    assert all(p.dtype == torch.float32 for p in after)
    assert all(torch.isfinite(p).all() for p in after)
    moved = [not torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True)]
    assert any(moved[: len(tr.policy.trainable())]), "the fast updates changed no policy weight"
    assert any(moved[len(tr.policy.trainable()):]), "the slow update changed no verifier LoRA weight"
    out = dvi_lite.generate(m, IdTokenizer(), DEEP_PROMPTS[0], method="dvi", state=tr.policy, max_new_tokens=10)
    assert len(out.token_ids) == 10


# ------------------------------------------------------------------------------------ CLI


def test_cli_trains_saves_and_resumes(tmp_path, capsys):
    from dvi_lite.methods.dvi.cli import main
    from dvi_lite.models.loading import COURSE_MODEL

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    mdir = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(mdir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (mdir / f).write_bytes((COURSE_MODEL / f).read_bytes())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(6)))
    args = ["--split", "1", "--model", str(mdir), "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"),
            "--prompts", str(prompts), "--max-new-tokens", "16", "--eval-prompts", "2", "--ckpt-every", "1"]
    out = tmp_path / "out"
    assert main(args + ["--steps", "2"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["fast_steps"] == 2 and card["eval_before"]["prompts"] == 2 and card["eval_after"]["tau"] >= 1
    assert {"commit", "command", "date", "device"} <= set(card["provenance"])
    assert (out / "policy.pt").is_file() and card["split"] == 1
    assert len((out / "log.jsonl").read_text().splitlines()) == 2
    assert main(args + ["--steps", "3", "--resume"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["fast_steps"] == 3 and len((out / "log.jsonl").read_text().splitlines()) == 3
    with pytest.raises(SystemExit) as e:
        main(args + ["--steps", "2", "--split", "5"])
    assert e.value.code == 2 and "split must be an int with 0 < split < 2" in capsys.readouterr().err


def test_cli_help_and_module_entry_point(capsys):
    from dvi_lite.methods.dvi.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "python -m dvi_lite dvi" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "dvi_lite.methods.dvi.cli", "--help"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "--K" in r.stdout and not r.stderr.strip()


def test_added_parameters_count_the_modules_each_method_really_adds(deep_model):
    """Fix f: each method's added parameters, from the modules it holds (trainable or frozen), by hand."""
    from conftest import make_target

    from dvi_lite.core.runner import Skip
    from dvi_lite.methods.kangaroo.drafter import KangarooAdapter
    from dvi_lite.methods.medusa.heads import MedusaHeads
    from dvi_lite.methods.params import added_parameters

    m, tok = deep_model, IdTokenizer()
    c = m.config
    d, i, v, hd = c.hidden_size, c.intermediate_size, c.vocab_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    adapter = d * q + 2 * d * kv + q * d + 2 * d  # q, k, v, o projections + in / out RMSNorm
    assert added_parameters(m, "kangaroo", tok, adapter=KangarooAdapter(m, 2)) == adapter
    heads = MedusaHeads(m, num_heads=2)
    medusa = 2 * (d * d + d) + 2 * v * d + d  # ResBlocks (W, b), own LM-head copies, the norm copy
    assert sum(p.numel() for mod in (heads.blocks, heads.lm_heads, heads.norm) for p in mod.parameters()) == medusa
    assert added_parameters(m, "medusa", tok, heads=heads) == medusa
    r = 8
    with torch.random.fork_rng():
        policy = DVIPolicy(m, 2, lora_rank=r)
    dvi = 3 * d * i + 3 * r * (d + i) + 2 * d + 1  # exit MLP copy (frozen) + lora_S + block / exit norms + alpha
    assert added_parameters(m, "dvi", tok, state=policy) == dvi
    assert 3 * d * i > sum(p.numel() for p in policy.trainable())  # what the old count saw was the small part
    assert added_parameters(m, "draft_verify", tok, skip=Skip(mlp=frozenset({1}))) == 0
    assert added_parameters(m, "early_exit", tok) == 0
    assert added_parameters(m, "early_exit", tok, vocab=list(range(10))) == 10 * d  # a trimmed head's rows
    assert added_parameters(m, "dvi", tok, state=policy, vocab=list(range(10))) == dvi + 10 * d
    draft = make_target(vocab=v, layers=1)
    assert added_parameters(m, "sps", tok, draft_model=draft) == sum(p.numel() for p in draft.parameters())
    assert added_parameters(m, "ar", tok) == added_parameters(m, "hf", tok) == 0
