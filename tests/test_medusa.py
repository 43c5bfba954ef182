"""Medusa heads and trees: lossless decoding (greedy and sampling), the head offset convention,
candidate trees, save/load with clear errors, and a training loop that learns and resumes exactly."""
import itertools
import json
import math

import numpy as np
import pytest
import torch
from helpers import (
    ALPHA,
    DEEP_PROMPTS,
    IdTokenizer,
    assert_lossless_sampling,
    lossless_report,
    perturbed_heads,
    tiny_cfg,
)
from transformers import LlamaForCausalLM

import dvi_lite
from dvi_lite.core.engine import start, step
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.medusa.drafter import MedusaDrafter, medusa_summary
from dvi_lite.methods.medusa.heads import MedusaHeads, heads_path, load_heads, save_heads
from dvi_lite.methods.medusa.train import (
    MedusaTrainConfig,
    greedy_rollout,
    head_accuracy,
    main,
    sanity_check,
    train_loop,
)
from dvi_lite.methods.medusa.trees import (
    CandidateTree,
    best_first_paths,
    cartesian_paths,
    cartesian_tree,
    check_paths,
    entropy_thresholds,
    expected_accept_length,
    head_topk,
    pruned_tree,
    sparse_tree,
    validate_tree_args,
)

ACC3 = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]  # made-up per-rank accuracies (3 heads x 3)



@pytest.fixture(scope="module")
def models(deep_model, target):
    return {"deep_model": deep_model, "target": target}


@pytest.fixture(scope="module")
def ar_outputs(models):
    return {name: [dvi_lite.generate(m, IdTokenizer(), p, max_new_tokens=40, stop_at_eos=False).token_ids
                   for p in DEEP_PROMPTS] for name, m in models.items()}


CONFIGS = [dict(tree="cartesian", branch=2), dict(tree="cartesian", branch=3, K=2), dict(tree="pruned"),
           dict(tree="pruned", threshold=0.2), dict(tree="pruned", threshold=0.05, prune="path", max_nodes=8),
           dict(tree="pruned", threshold=0.3, prune="entropy"),
           dict(tree="sparse", branch=3, accuracies=ACC3, max_nodes=6),
           dict(tree=[(0,), (1,), (0, 0), (0, 0, 0)], branch=2),
           dict(tree="cartesian", branch=2, vocab=list(range(40)))]  # a trimmed draft head: ids 0..39 only


@pytest.mark.parametrize("name", ["deep_model", "target"])
@pytest.mark.parametrize("kw", CONFIGS)
def test_greedy_equals_ar(models, ar_outputs, name, kw):
    model = models[name]
    heads = perturbed_heads(model)
    accepted = rejected = 0
    for p, ar in zip(DEEP_PROMPTS, ar_outputs[name], strict=True):
        md = dvi_lite.generate(model, IdTokenizer(), p, method="medusa", heads=heads, max_new_tokens=40,
                               stop_at_eos=False, **kw)
        assert md.token_ids == ar
        accepted += sum(s.accepted for s in md.stats.steps)
        rejected += sum(s.accepted < s.depth for s in md.stats.steps)
    assert accepted > 0 and rejected > 0  # both the accepted-path cache keep and the rejection path ran


@pytest.mark.parametrize("greedy", [True, False])
def test_heads_read_the_state_that_predicted_the_pending_token(target, greedy):
    """The offset convention, checked against a fresh forward: after prefill and after every step the
    drafter holds the final pre-norm state of the last committed token, whose logits gave the pending one."""
    runner = Runner(target)
    drafter = MedusaDrafter(runner, perturbed_heads(target), branch=2, tree="cartesian")
    sampler = Sampler() if greedy else Sampler(temperature=1.0)
    state = start(runner, drafter, DEEP_PROMPTS[0], 40, sampler, make_generator(0))
    for _ in range(8):
        committed = state.tokens[:-1]
        with torch.no_grad():
            _, h = runner.forward(torch.tensor([committed]), None)
        torch.testing.assert_close(drafter.h[0, -1], h[0, -1], atol=1e-4, rtol=1e-4)
        if greedy:
            assert int(runner.logits(drafter.h)[0, -1].argmax()) == state.pending
        step(state, drafter)
    assert len(drafter.log) == 8


@pytest.fixture(scope="module")
def perm_model():
    """A model whose greedy next token is (almost always) perm[current token]: tiny init, so the residual
    stream is the token's embedding, and an untied LM head whose row perm[x] is embedding x. Head i must
    then learn x_t -> perm^(i+2)[x_t], which a head can (and an untrained head, = perm[x_t], never is)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2, init=0.02)
    cfg.tie_word_embeddings = False
    m = LlamaForCausalLM(cfg).float().eval()
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.lm_head.weight.zero_()
        m.lm_head.weight[perm] = 30 * m.model.embed_tokens.weight
    return m


def greedy_sequences(model, n: int = 64, prompt_len: int = 4, new: int = 28, seed: int = 0) -> np.ndarray:
    """The model's own greedy continuations of random prompts, (n, prompt_len + new): self-distillation data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (n, prompt_len), generator=g)
    _, cont = greedy_rollout(Runner(model), x, new)
    return torch.cat([x, cont], 1).numpy().astype(np.uint16)


def test_self_distilled_heads_get_accepted(perm_model):
    """Training (head i on h_t -> the model at t+1+i) and drafting (head i -> tree depth i) use the same
    offset: heads distilled for 60 steps on the model's own greedy text get most of their drafts accepted,
    untrained heads (= the model's next token, one position early) almost none."""
    cfg = MedusaTrainConfig(heads=3, steps=60, batch_size=16, seq_len=32, lr=3e-2, warmup=5, seed=0)
    heads = MedusaHeads(perm_model, 3)
    log = train_loop(heads, Runner(perm_model), greedy_sequences(perm_model), cfg, progress=False)
    assert log[-1]["loss"] < 0.2 * log[0]["loss"]
    taus = {}
    for name, h in (("trained", heads), ("untrained", MedusaHeads(perm_model, 3))):
        steps = []
        for p in [[3, 9, 27, 1], [60, 2, 33, 17], [11, 12, 13, 14]]:
            out = dvi_lite.generate(perm_model, IdTokenizer(), p, method="medusa", heads=h, branch=2,
                                    tree="cartesian", max_new_tokens=40, stop_at_eos=False)
            steps += out.stats.steps
        taus[name] = sum(s.accepted + 1 for s in steps) / len(steps)
    assert taus["trained"] > 3.0 and taus["untrained"] < 1.3, taus


@pytest.mark.parametrize("acceptance", ["exact", "typical"])
@pytest.mark.parametrize("kw", [dict(tree="cartesian", branch=2, K=2)])
def test_sampling_is_lossless_end_to_end(target8, tok8, kw, acceptance):
    """Deterministic top-k candidates verified as point masses (q = None): the output law is p's.

    The same chi-square test, same draws and seeds, FAILS with acceptance="typical" (Medusa's lossy rule,
    typical.py): the verified tokens no longer follow p."""
    heads = MedusaHeads(target8, 2).eval()  # identity start: each head drafts the model's next-token top-k
    if acceptance == "exact":
        assert_lossless_sampling(target8, tok8, "medusa", heads=heads, **kw)  # the default
        return
    rep = lossless_report(target8, tok8, "medusa", heads=heads, acceptance=acceptance, **kw)
    assert rep.law_failed and rep.pvalues["t2|t1"] <= ALPHA, str(rep)  # t2: the first verified token
    assert rep.pvalues["t1"] > ALPHA, str(rep)  # t1 comes from the prefill, which no verifier touches


# ------------------------------------------------------------------------------------------ heads

def test_untrained_heads_copy_the_model_only_with_the_norm(deep_model):
    """Gorgon's lesson as a test: with the frozen RMSNorm, W = 0 makes every head the model's own head."""
    runner = Runner(deep_model)
    ids = torch.tensor([DEEP_PROMPTS[3]])
    with torch.no_grad():
        logits, h = runner.forward(ids, None)
        heads = MedusaHeads(deep_model, 3)
        out = heads(h)  # (3, 1, T, V)
        assert out.shape == (3, 1, ids.shape[1], deep_model.config.vocab_size)
        for i in range(3):
            torch.testing.assert_close(out[i], logits)
        bare = MedusaHeads(deep_model, 3, norm=False)  # --no-norm constructs, and is not the model's head
        assert bare.norm is None and not torch.allclose(bare(h)[0], logits, atol=1e-2)
    assert all(not p.requires_grad for p in heads.norm.parameters())
    assert all(p.requires_grad for p in heads.trainable_parameters())


def test_shared_lm_head_is_not_saved_or_trained(deep_model):
    heads = MedusaHeads(deep_model, 2, shared_lm_head=True)
    assert not any("lm_head" in k for k in heads.state_dict())
    d = deep_model.config.hidden_size
    assert sum(p.numel() for p in heads.trainable_parameters()) == 2 * (d * d + d)
    h = torch.randn(1, 3, d)
    torch.testing.assert_close(heads(h)[1], heads.head(1, h))
    heads.head(0, h).sum().backward()
    assert deep_model.lm_head.weight.grad is None and heads.blocks[0].linear.weight.grad is not None


def test_save_load_round_trip(deep_model, tmp_path):
    heads = perturbed_heads(deep_model, 2)
    heads.accuracies = [[0.5, 0.1], [0.3, 0.1]]
    save_heads(heads, deep_model, tmp_path / "h.pt", card={"note": "test"})
    loaded = load_heads(deep_model, tmp_path / "h.pt")
    assert (tmp_path / "h.json").is_file()
    assert loaded.num_heads == 2 and loaded.use_norm and loaded.accuracies == heads.accuracies
    h = torch.randn(1, 4, deep_model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(h), heads(h), atol=0.05, rtol=0.01)  # saved in half precision
    assert load_heads(deep_model, tmp_path / "h.pt") is loaded  # loaded once
    out = dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="medusa", heads=str(tmp_path / "h.pt"),
                            tree="sparse", branch=2, max_new_tokens=8, stop_at_eos=False)
    assert len(out.token_ids) == 8


def test_missing_heads_is_a_clear_error(deep_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no Medusa heads.*python -m dvi_lite medusa-train"):
        load_heads(deep_model, tmp_path / "none.pt")


def test_heads_for_another_model_are_rejected(deep_model, tmp_path):
    torch.manual_seed(1)
    other = LlamaForCausalLM(deep_model.config).eval()
    save_heads(MedusaHeads(other, 2), other, tmp_path / "o.pt")
    with pytest.raises(ValueError, match="another model"):
        load_heads(deep_model, tmp_path / "o.pt")
    with pytest.raises(ValueError, match="another model"):
        dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="medusa", heads=MedusaHeads(other, 2))


# ------------------------------------------------------------------------------------------ trees

def topk_lists(num_heads=3, k=3, vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(num_heads, vocab, generator=g)
    return head_topk(logits, k)


def test_cartesian_tree_shape():
    tokens, probs, _ = topk_lists(3, 3)
    tree = cartesian_tree(tokens, probs, 3)
    assert len(tree) == 3 + 9 + 27 and tree.depth == 3
    par = tree.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(par))
    for i, path in enumerate(tree.paths):
        assert int(tree.tokens[i]) == int(tokens[len(path) - 1, path[-1]])
        assert par[i] == (tree.paths.index(path[:-1]) if len(path) > 1 else -1)
        assert math.isclose(float(tree.path_probs[i]), math.prod(float(probs[d, r]) for d, r in enumerate(path)),
                            rel_tol=1e-5)
    siblings = {}
    for i, p in enumerate(par):
        siblings.setdefault(p, []).append(int(tree.tokens[i]))
    assert all(len(set(s)) == len(s) for s in siblings.values())  # distinct siblings (point masses need it)


def _closed(paths):
    s = set(paths)
    return all(len(p) == 1 or p[:-1] in s for p in paths)


@pytest.mark.parametrize("mode", ["confidence", "path", "entropy"])
def test_pruning_is_monotone_and_gives_trees(mode):
    tokens, probs, ent = topk_lists(3, 4, seed=1)
    prev = None
    for thr in [0.001, 0.01, 0.05, 0.1, 0.3, 0.6]:
        tree = pruned_tree(tokens, probs, thr, mode, entropy=ent)
        paths = set(tree.paths)
        assert _closed(tree.paths) and tree.depth <= 3
        if prev is not None:
            assert paths <= prev  # a higher threshold keeps a subset
        prev = paths
    full = pruned_tree(tokens, probs, 0.001, mode, entropy=ent)
    for n in [1, 3, 7, 20]:
        top = pruned_tree(tokens, probs, 0.001, mode, max_nodes=n, entropy=ent)
        assert len(top) == min(n, len(full)) and _closed(top.paths) and set(top.paths) <= set(full.paths)
        kept = sorted(float(x) for x in top.path_probs)
        dropped = [float(x) for p, x in zip(full.paths, full.path_probs, strict=True) if p not in set(top.paths)]
        assert not dropped or max(dropped) <= kept[0] + 1e-9  # the best nodes by path probability


def test_entropy_thresholds_lower_the_bar_for_flat_heads():
    thr = entropy_thresholds([0.1, 1.0, 3.0], 0.09)  # alpha = 0.3
    assert thr[0] == pytest.approx(0.09) and thr[2] == pytest.approx(0.3 * math.exp(-3.0))
    assert thr[0] >= thr[1] >= thr[2]


def test_sparse_tree_maximises_expected_accepted_length():
    for budget in [1, 2, 4, 6, 9]:
        paths = sparse_tree(ACC3, budget)
        assert len(paths) == budget and _closed(paths) and check_paths(paths, 3, 3) == paths
        best = max(expected_accept_length(c, ACC3) for c in itertools.combinations(cartesian_paths(3, 3), budget)
                   if _closed(list(c))) if budget <= 4 else None
        if best is not None:
            assert expected_accept_length(paths, ACC3) == pytest.approx(best)
    values = [expected_accept_length(sparse_tree(ACC3, b), ACC3) for b in range(1, 15)]
    assert values == sorted(values)
    assert sparse_tree(ACC3, 3) == [(0,), (1,), (0, 0)]


def test_best_first_keeps_ancestors_before_descendants():
    paths = best_first_paths([[0.9, 0.05], [1.0, 0.0]], max_nodes=3)
    assert paths == [(0,), (1,), (0, 0)]


# ------------------------------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("args,msg", [((0, 2), r"^K \(heads used"), ((2, 0), r"^branch \(candidates"),
                                      ((True, 2), r"^K \(heads used"), ((2, 1.5), r"^branch \(candidates")])
def test_validate_tree_args(args, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tree_args(*args)


@pytest.mark.parametrize("parents", [[0], [-2], [-1, 5], [-1, 1], [[-1, 0]], [-1.0]])
def test_malformed_parents_are_rejected(parents):
    par = torch.tensor(parents)
    with pytest.raises(ValueError, match="parents"):
        CandidateTree(torch.zeros(par.shape, dtype=torch.long), par)


@pytest.mark.parametrize("kw,msg", [(dict(K=0), "option 'K'"), (dict(K=4), "K=4 but the heads have only 3"),
                                    (dict(branch=0), "branch"), (dict(branch=65), "branch=65 exceeds the vocabulary"),
                                    (dict(tree="bogus"), "tree"), (dict(tree="cartesian", threshold=0.3), "threshold"),
                                    (dict(tree="cartesian", max_nodes=4), "max_nodes"),
                                    (dict(threshold=0.0), "threshold"),
                                    (dict(max_nodes=0), "max_nodes"), (dict(prune="nope"), "prune"),
                                    (dict(tree="sparse"), "accuracies"), (dict(tree=[(1, 0)]), "parent"),
                                    (dict(tree=[(0,), (0, 5)], branch=2), "rank"),
                                    (dict(tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), "deeper"),
                                    (dict(tree="cartesian", branch=20), "nodes"), (dict(heads=3), "heads")])
def test_bad_options(deep_model, kw, msg):
    kw = {"heads": MedusaHeads(deep_model, 3), **kw}
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(deep_model, IdTokenizer(), [1, 2], method="medusa", max_new_tokens=4, **kw)


def test_tree_depth_respects_the_token_budget(deep_model):
    """Near max_new_tokens the tree only reaches depths that can still be emitted."""
    runner = Runner(deep_model)
    drafter = MedusaDrafter(runner, perturbed_heads(deep_model), branch=2, tree="cartesian")
    state = start(runner, drafter, [1, 2, 3], 3, Sampler(), make_generator(0))
    assert state.remaining == 2  # the pending token is the first of the 3: one draft + the bonus token left
    assert drafter.propose(state).parents is not None and drafter._tree.depth == 1 and len(drafter._tree) == 2


# ------------------------------------------------------------------------------------------ training

def test_training_reduces_the_loss_and_keeps_the_model_frozen(target):
    torch.manual_seed(0)
    data = torch.randint(64, (4000,)).numpy().astype(np.uint16)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cfg = MedusaTrainConfig(heads=2, steps=30, batch_size=4, seq_len=16, lr=1e-2, warmup=3)
    log = train_loop(MedusaHeads(target, 2), Runner(target), data, cfg, progress=False)
    mean = lambda xs: sum(x["loss"] for x in xs) / len(xs)  # noqa: E731  (one batch is noisy)
    assert mean(log[-5:]) < 0.8 * mean(log[:5])
    assert log[-1]["lr"] >= cfg.lr * cfg.min_lr_frac * 0.999  # cosine to a floor, never to zero
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert all(p.grad is None for p in target.parameters())  # no gradient ever reached the model


def test_resume_continues_exactly(deep_model, tmp_path):
    data = torch.randint(64, (3000,), generator=torch.Generator().manual_seed(0)).numpy().astype(np.uint16)
    cfg = MedusaTrainConfig(heads=2, steps=6, batch_size=2, seq_len=12, lr=1e-2, warmup=2, ckpt_every_s=1e9)
    runner = Runner(deep_model)
    whole = MedusaHeads(deep_model, 2)
    log_whole = train_loop(whole, runner, data, cfg, progress=False)
    part = MedusaHeads(deep_model, 2)
    train_loop(part, runner, data, cfg, tmp_path / "c.pt", stop_after=3, progress=False)
    resumed = MedusaHeads(deep_model, 2)
    log_resumed = train_loop(resumed, runner, data, cfg, tmp_path / "c.pt", resume=True, progress=False)
    assert [x["loss"] for x in log_resumed] == [x["loss"] for x in log_whole]
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)
    other = MedusaTrainConfig(heads=2, steps=6, batch_size=2, seq_len=12, lr=1e-2, warmup=2, norm=False)
    with pytest.raises(ValueError, match="delete it or drop --resume"):
        train_loop(MedusaHeads(deep_model, 2, norm=False), runner, data, other, tmp_path / "c.pt", resume=True)


def test_head_accuracy_and_sanity_check(perm_model):
    data = greedy_sequences(perm_model, n=16).flatten()
    heads = MedusaHeads(perm_model, 2)
    acc = head_accuracy(perm_model, None, heads, n_windows=24, ctx=8, branch=3, data=data, chunk=10)
    assert acc["n"] == 24 and len(acc["heads_greedy"]) == 2 and np.shape(acc["rank_accuracy"]) == (2, 3)
    assert acc["heads_vs_next"] == [1.0, 1.0]  # untrained heads = the model's own next-token prediction
    assert acc["model_next"] > 0.7  # the data is the model's own greedy text (but for sequence boundaries)
    assert max(acc["heads_greedy"]) < 0.2  # ... which is not the token after next
    assert all(sum(r) <= 1 + 1e-6 for r in acc["rank_accuracy"])
    res = sanity_check(perm_model, None, steps=4, num_heads=2, data=data, n_windows=8, ctx=8, branch=2)
    assert len(res["log"]) == 4 and set(res["before"]) == set(res["after"])


def test_summary_matches_engine_stats(target):
    runner = Runner(target)
    drafter = MedusaDrafter(runner, perturbed_heads(target), branch=2, tree="cartesian")
    from dvi_lite.core.engine import decode
    _, stats = decode(runner, drafter, DEEP_PROMPTS[1], 30, Sampler(), make_generator(0))
    s = medusa_summary(drafter.log, 3, 2)
    assert s["steps"] == len(stats.steps) and s["tau"] == pytest.approx(stats.tau)
    assert s["head_acceptance_given_previous"][:2] == pytest.approx(stats.position_acceptance()[:2])
    assert sum(s["rank_hits"][0]) == sum(st.accepted > 0 for st in stats.steps)


def test_cli_builds_the_config(monkeypatch):
    import dvi_lite.methods.medusa.train as mt

    seen = {}
    monkeypatch.setattr(mt, "train_heads", lambda cfg, *a, **k: seen.update(cfg=cfg))
    assert main(["--heads", "3", "--steps", "7", "--no-norm"]) == 0
    cfg = seen["cfg"]
    assert (cfg.heads, cfg.steps, cfg.norm) == (3, 7, False)
    assert mt.default_out(cfg).name == "heads_nonorm_ownhead.pt"  # the Gorgon variant never overwrites heads.pt
    assert mt.default_out(mt.MedusaTrainConfig(shared_lm_head=True)).name == "heads.pt"  # the course recipe
    assert mt.default_out(mt.MedusaTrainConfig()).name == "heads_ownhead.pt"  # Medusa-1's own head copies


def test_cli_rejects_bad_steps(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--heads", "0"])
    assert e.value.code == 2 and "--heads must be >= 1, got 0" in capsys.readouterr().err


# ------------------------------------------------------------------ distillation from the teacher's stored outputs

def _toy_teacher(rows_len=(10, 7), k=4):
    """Teacher data whose top id at (n, s) encodes the position: 100 * n + s (rank r adds 1000 * r)."""
    from dvi_lite.models.teacher import TeacherData

    n, t = len(rows_len), max(rows_len)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i, L in enumerate(rows_len):
        mask[i, :L] = True
    pos = 100 * torch.arange(n)[:, None, None] + torch.arange(t)[None, :, None]
    top_ids = pos + 1000 * torch.arange(k)[None, None]  # (n, t, k)
    top_logp = torch.log_softmax(-torch.arange(k, dtype=torch.float), -1).expand(n, t, k).half()
    return TeacherData(torch.zeros(n, t, dtype=torch.long), mask, {}, torch.zeros(n, t, 8, dtype=torch.bfloat16),
                       top_ids, top_logp)


def test_teacher_targets_align_head_i_at_t_with_the_teacher_at_t_plus_1_plus_i():
    from dvi_lite.methods.medusa.teacher_train import head_targets, positions

    data = _toy_teacher()
    n, t = positions(data.mask, torch.tensor([0, 1]))
    assert int((n == 1).sum()) == 6 and int(t[n == 1].max()) == 5  # t and t+1 real: t <= len - 2
    for i in range(3):
        ids, logp, ok = head_targets(data, n, t, i)
        assert ids.shape == (len(n), 4) and logp.shape == (len(n), 4)
        s = t + 1 + i  # head i on h_t predicts x_{t+2+i}: the teacher's prediction made at t+1+i
        assert torch.equal(ok, s < torch.tensor([10, 7])[n])
        assert torch.equal(ids[ok, 0], (100 * n + s)[ok]) and torch.equal(ids[ok, 2], (100 * n + s + 2000)[ok])


def test_trimmed_targets_drop_off_map_tokens_and_renormalise():
    from dvi_lite.methods.medusa.teacher_train import trim_targets
    from dvi_lite.models.teacher import soft_ce

    index_of = torch.full((10,), -1, dtype=torch.long)
    index_of[torch.tensor([3, 5, 7])] = torch.tensor([0, 1, 2])
    ids = torch.tensor([[5, 4, 7], [1, 2, 4]])
    j, lp, kept = trim_targets(ids, torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])), index_of)
    assert kept.tolist() == [True, False] and j[0].tolist() == [1, 0, 2] and lp[0, 1] == float("-inf")
    logq = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    want = -(0.5 / 0.7 * math.log(0.5) + 0.2 / 0.7 * math.log(0.3))  # the kept mass 0.7, renormalised
    assert soft_ce(logq, j[:1], lp[:1]).item() == pytest.approx(want, rel=1e-5)


def _deep_teacher(model):
    from dvi_lite.models.teacher import TeacherConfig, teacher_outputs

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(64, (int(L),), generator=g).tolist() for L in torch.randint(12, 24, (12,), generator=g)]
    return teacher_outputs(model, rows, TeacherConfig(layers=(1,), top_k=8, batch_size=4))


def test_distillation_learns_resumes_exactly_and_measures_ranks(deep_model, tmp_path):
    from dvi_lite.methods.medusa.teacher_train import DistillConfig, distill, split_rows, teacher_accuracy
    from dvi_lite.models.vocab import TrimmedHead

    data = _deep_teacher(deep_model)
    train, val = split_rows(12, 0.25, 0)
    assert len(val) == 3 and not set(train.tolist()) & set(val.tolist())
    trimmed = TrimmedHead(deep_model.get_output_embeddings(), torch.arange(48))
    cfg = DistillConfig(heads=2, steps=30, batch_size=32, lr=1e-2, warmup=3, ckpt_every_s=1e9)
    log = distill(MedusaHeads(deep_model, 2, shared_lm_head=True), data, trimmed, cfg, train, progress=False)
    mean = lambda xs: sum(x["loss"] for x in xs) / len(xs)  # noqa: E731
    assert mean(log[-5:]) < mean(log[:5])
    short = DistillConfig(heads=2, steps=6, batch_size=8, lr=1e-2, warmup=2, ckpt_every_s=1e9)
    whole = MedusaHeads(deep_model, 2, shared_lm_head=True)
    log_whole = distill(whole, data, trimmed, short, train, progress=False)
    distill(MedusaHeads(deep_model, 2, shared_lm_head=True), data, trimmed, short, train, tmp_path / "c.pt",
            stop_after=3, progress=False)
    resumed = MedusaHeads(deep_model, 2, shared_lm_head=True)
    log_resumed = distill(resumed, data, trimmed, short, train, tmp_path / "c.pt", resume=True, progress=False)
    assert [x["loss"] for x in log_resumed] == [x["loss"] for x in log_whole]
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)
    acc = teacher_accuracy(whole, data, val, branch=3, answer_rows=1)
    assert np.shape(acc["rank_accuracy"]) == (2, 3) and acc["top1"] == [r[0] for r in acc["rank_accuracy"]]
    assert all(sum(r) <= 1 + 1e-6 for r in acc["rank_accuracy"]) and acc["n"][0] > acc["n"][1] > 0


def test_prepare_smoke_on_the_course_model(tmp_path):
    from dvi_lite.methods.medusa.teacher_recipe import PAPER_TOP1, prepare_smollm2
    from dvi_lite.models.loading import load_model

    card = prepare_smollm2("course", tmp_path, "python -m dvi_lite prepare --smoke", smoke=True)
    assert (tmp_path / "heads.pt").is_file() and (tmp_path / "heads.json").is_file()
    assert card["steps"] == 3 and card["device"].startswith("cpu") and card["command"].endswith("--smoke")
    assert [r["paper"] for r in card["top1_vs_paper"]] == list(PAPER_TOP1[:2])
    model, _ = load_model("course", dtype="bfloat16")
    heads = load_heads(model, tmp_path / "heads.pt")
    assert heads.shared_lm_head and heads.accuracies == card["accuracy"]["rank_accuracy"]
    assert next(heads.parameters()).dtype == torch.bfloat16


def test_smollm2_heads_are_found_in_any_dtype():
    from dvi_lite.paths import DATA_DIR

    path = DATA_DIR / "smollm2" / "medusa" / "heads.pt"
    if not path.is_file():
        pytest.skip("SmolLM2's Medusa heads are not trained here")
    from test_smollm2 import smollm2

    for dtype in ("float32", "bfloat16"):
        model, _ = smollm2(dtype)
        assert heads_path(model) == path
        heads = load_heads(model)
        assert next(heads.parameters()).dtype == model.dtype and heads.accuracies is not None



def test_loss_vocab_puts_the_teachers_own_tokens_first():
    from dvi_lite.methods.medusa.teacher_train import loss_vocab
    from dvi_lite.models.teacher import TeacherData

    top = torch.tensor([[7, 7, 3, 9], [3, 5, 5, 5]])[..., None]  # (rows, T, 1): the teacher's argmax
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # the 9 is padding
    data = TeacherData(torch.zeros(2, 4, dtype=torch.long), mask, {}, torch.zeros(2, 4, 1), top, top.half())
    assert loss_vocab(data, torch.tensor([0, 1]), torch.tensor([1, 3, 2, 0]), 5).tolist() == [5, 3, 7, 1, 2]
    assert loss_vocab(data, torch.tensor([0]), torch.tensor([1, 3, 2, 0]), 3).tolist() == [7, 3, 1]  # train rows only


def test_sizing_grid_prices_heads_and_nodes():
    """medusa-sizing's arithmetic: tau from the accuracies, cost v(N + 1) + H c_head, and the best row."""
    from dvi_lite.methods.medusa.sizing import best, grid

    acc = [[0.5, 0.2], [0.4, 0.1]]
    v = {1: 1.0, 3: 1.0, 5: 2.0}
    rows = grid(acc, v, c_head=0.1, budgets=(1, 2))
    assert [(r["heads"], r["nodes"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    one = rows[0]
    assert one["tau_model"] == 1.5 and one["cost"] == pytest.approx(1.1)
    assert rows[1]["tau_model"] == pytest.approx(1.7)  # ranks 0 and 1 of head 0: exclusive events add
    assert rows[3]["paths"] == [[0], [0, 0]] and rows[3]["tau_model"] == pytest.approx(1.7)  # 0.5 + 0.5 * 0.4
    assert best(rows) == max(rows, key=lambda r: r["predicted_speedup"])
    with pytest.raises(ValueError, match="c_head"):
        grid(acc, v, c_head=-1.0)
    with pytest.raises(ValueError, match="rows"):
        best([])


def test_the_models_committed_choice_is_the_default_tree(monkeypatch):
    """With no tree given, medusa drafts the model's committed choice (defaults.json "medusa"); a given tree wins."""
    from dvi_lite.methods.medusa import drafter as md

    model, tok = dvi_lite.load_model("course")
    monkeypatch.setattr(md, "model_defaults", lambda m: {"medusa": {"K": 1, "tree": "cartesian", "branch": 3}})
    d = md.make_drafter(model, tok)
    assert (d.K, d.tree, d.branch, len(d.static.paths)) == (1, "cartesian", 3, 3)
    assert md.make_drafter(model, tok, tree="pruned").tree == "pruned"
    monkeypatch.setattr(md, "model_defaults", lambda m: {})
    d = md.make_drafter(model, tok)
    assert (d.tree, d.branch) == ("pruned", 4)


def test_sizing_apply_keeps_the_picked_heads_and_writes_the_default_tree(tmp_path):
    import shutil

    from dvi_lite.methods.medusa.sizing import apply

    model, _ = dvi_lite.load_model("course")
    src = heads_path(model)
    f = tmp_path / "heads.pt"
    shutil.copy(src, f)
    shutil.copy(src.with_suffix(".json"), f.with_suffix(".json"))
    (tmp_path / "defaults.json").write_text(json.dumps({"split": 3}))
    pick = {"heads": 1, "nodes": 2, "tau_model": 1.5, "cost": 1.1, "predicted_speedup": 1.36, "paths": [[0], [1]]}
    entry = apply(pick, f, tmp_path / "defaults.json", "results/x.json")
    assert entry["K"] == 1 and entry["branch"] == 2 and entry["tree"] == [[0], [1]]
    assert json.loads((tmp_path / "defaults.json").read_text())["split"] == 3  # other defaults kept
    heads = load_heads(model, f)
    assert heads.num_heads == 1 and json.loads(f.with_suffix(".json").read_text())["stored_heads"] == 1
    full = load_heads(model)
    h = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(heads(h), full(h, 1))  # the kept head is the trained head 0
    with pytest.raises(ValueError, match="heads"):
        apply({**pick, "heads": 9}, f, tmp_path / "defaults.json", "results/x.json")


def test_the_heads_cost_line():
    """Two measured head counts give the shared part and the per-head part; one point is split over its heads."""
    from dvi_lite.methods.medusa.sizing import cost_line, grid

    shared, per = cost_line({4: 0.17, 1: 0.14})
    assert per == pytest.approx(0.01) and shared == pytest.approx(0.13)
    assert cost_line({4: 0.2}) == (0.0, 0.05)
    rows = grid([[0.5]], {1: 1.0, 2: 1.0}, c_head=0.01, c_shared=0.13, budgets=(1,))
    assert rows[0]["cost"] == pytest.approx(1.14)
    with pytest.raises(ValueError, match="points"):
        cost_line({})
