"""EAGLE (methods/eagle): the head's offsets, the features handed over by the verify forward, the dynamic tree,
the options, and greedy fp32 equality with AR on tiny models and the course model (untrained heads: lossless
whatever the head says)."""
from __future__ import annotations

import pytest
import torch
from helpers import make_target

import dvi_lite
from dvi_lite.core.engine import start
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.eagle import drafter as eagle_drafter
from dvi_lite.methods.eagle.drafter import EagleDrafter, make_drafter
from dvi_lite.methods.eagle.head import EagleHead, HeadConfig, default_layers, load_head, save_head


@pytest.fixture(scope="module")
def head(target) -> EagleHead:
    return EagleHead(target).eval()


def test_default_layers_are_eagle3s():
    assert default_layers(30) == (2, 15, 27)  # SmolLM2
    assert default_layers(12) == (2, 6, 9)  # the course model
    assert default_layers(2) == (1, 1, 2)  # tiny models repeat one (the last layer's state is the final one)


def test_runner_capture_keeps_the_states_and_changes_nothing(target):
    r = Runner.for_model(target)
    x = torch.tensor([[1, 5, 9, 2, 7]])
    pos = torch.arange(5)[None]
    plain = r.layers_forward(r.embed(x), None, pos)
    caps = dict.fromkeys((0, 1, 3))
    out = r.layers_forward(r.embed(x), None, pos, capture=caps)
    assert torch.equal(out, plain) and torch.equal(caps[3], plain)
    torch.testing.assert_close(caps[1], r.layers_forward(r.embed(x), None, pos, 0, 1), rtol=0, atol=0)
    assert torch.equal(caps[0], r.embed(x))


@torch.no_grad()
def reference_root_logits(model, head: EagleHead, seq: list[int]) -> torch.Tensor:
    """The head run once over a whole sequence with the features of one full target forward: row j = the draft
    logits of input (F_j, x_{j+1}), which drafts x_{j+2} (what the drafter's root computes at c = j + 1)."""
    r = Runner.for_model(model)
    caps = dict.fromkeys(set(head.layers))
    x = torch.tensor([seq[:-1]])
    r.layers_forward(r.embed(x), None, torch.arange(x.shape[1])[None], capture=caps)
    feats = head.fuse([caps[k] for k in head.layers])  # (1, n-1, D)
    _, logits = head.step(feats, torch.tensor([seq[1:]]), torch.arange(x.shape[1])[None])
    return logits[0]


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_features_from_verification_equal_a_full_forward(target, tok, head, tree, monkeypatch):
    """At every step the head's root (its cache of committed inputs + the fed features) gives the logits that a
    fresh run over the whole sequence gives: the verify forward hands over the right features for the kept
    positions (chain prefix or tree path), and the head's cache is rolled back to the committed inputs."""
    seen: list[tuple[int, torch.Tensor]] = []
    feed = EagleDrafter._feed

    def spy(self):
        g, logits = feed(self)
        seen.append((self.base, logits.clone()))
        return g, logits

    monkeypatch.setattr(EagleDrafter, "_feed", spy)
    prompt = [3, 17, 4, 22, 9]
    out = dvi_lite.generate(target, tok, prompt, method="eagle", max_new_tokens=24, head=head, tree=tree, K=3,
                            stop_at_eos=False)
    assert any(s.accepted for s in out.stats.steps) and any(s.accepted < s.depth for s in out.stats.steps)
    ref = reference_root_logits(target, head, prompt + out.token_ids)
    assert len(seen) >= 5
    for c, logits in seen:
        torch.testing.assert_close(logits, ref[c - 1], atol=1e-4, rtol=1e-4, msg=lambda m, c=c: f"c={c}: {m}")


@pytest.mark.parametrize("tree, opts", [("chain", {"K": 4}), ("dynamic", {"K": 4}),
                                        ("dynamic", {"K": 3, "branch": 2, "max_nodes": 5}),
                                        ("dynamic", {"K": 4, "branch": 2, "max_nodes": 4, "lookup": True}),
                                        ("static", {"paths": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]})])
def test_greedy_equals_ar_on_tiny_models(target, tok, prompts, head, tree, opts):
    accepted = 0
    for p in prompts[:6]:
        ref = dvi_lite.generate(target, tok, p, method="ar", max_new_tokens=20, stop_at_eos=False).token_ids
        out = dvi_lite.generate(target, tok, p, method="eagle", max_new_tokens=20, stop_at_eos=False, head=head,
                                tree=tree, **opts)
        assert out.token_ids == ref, (tree, opts, p)
        accepted += sum(s.accepted for s in out.stats.steps)
    assert accepted > 0


def test_greedy_equals_ar_with_a_trimmed_draft_vocabulary(target, tok, prompts):
    head = EagleHead(target, vocab_ids=torch.arange(0, 64, 2)).eval()  # even ids only: q = 0 off the map
    assert head.lm_head.weight.shape[0] == 32
    for p in prompts[:4]:
        ref = dvi_lite.generate(target, tok, p, method="ar", max_new_tokens=16, stop_at_eos=False).token_ids
        for tree in ("chain", "dynamic"):
            out = dvi_lite.generate(target, tok, p, method="eagle", max_new_tokens=16, stop_at_eos=False, head=head,
                                    tree=tree)
            assert out.token_ids == ref
    for tree in ("chain", "dynamic"):  # every draft is on the map
        d = make_drafter(target, None, head=head, tree=tree)
        prop = d.propose(start(d.runner, d, prompts[0], 16, Sampler(), make_generator(0)))
        assert len(prop) and all(t % 2 == 0 for t in prop.tokens.tolist())


@pytest.fixture(scope="module")
def course():
    return dvi_lite.load_model("course", dtype="float32")


@pytest.mark.slow
def test_greedy_equals_ar_on_the_course_model(course):
    model, tok = course
    head = EagleHead(model, HeadConfig(vocab=None)).eval()  # initialised from the target: lossless anyway
    assert head.layers == (2, 6, 9)
    for prompt in ("def fibonacci(n):",):
        ref = dvi_lite.generate(model, tok, prompt, method="ar", max_new_tokens=24).token_ids
        for tree in ("chain", "dynamic"):
            out = dvi_lite.generate(model, tok, prompt, method="eagle", max_new_tokens=24, head=head, tree=tree)
            assert out.token_ids == ref, (prompt, tree)
            assert sum(s.drafted for s in out.stats.steps) > 0


def test_dynamic_tree_is_a_reranked_tree(target, head):
    """The proposal is a valid tree (parents first) of at most max_nodes nodes, at most k deep, and it holds the
    best candidates by cumulative draft log-probability (EAGLE-2's rerank): every node's path score is at least
    that of any candidate left out."""
    d = make_drafter(target, None, head=head, K=3, tree="dynamic", branch=3, max_nodes=7)
    state = start(d.runner, d, [3, 17, 4, 22], 20, Sampler(), make_generator(0))
    prop = d.propose(state)
    n = len(prop)
    assert n == 7 and prop.q is None
    par = prop.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(par))
    depth = [0] * n
    for i, p in enumerate(par):
        depth[i] = 0 if p < 0 else depth[p] + 1
    assert max(depth) <= 2 and max(depth) >= 1
    for i, p in enumerate(par):  # siblings are distinct tokens
        assert sum(1 for j, q in enumerate(par) if q == p and prop.tokens[j] == prop.tokens[i]) == 1


def test_options_are_checked_and_named(target, head):
    m = get_method("eagle")
    assert m.resolve() == {"head": None, "K": 5, "tree": "dynamic", "branch": None, "max_nodes": None,
                           "lookup": False, "paths": None}
    with pytest.raises(ValueError, match=r"lookup merges a prompt-lookup branch into the tree"):
        make_drafter(target, None, head=head, tree="chain", lookup=True)
    with pytest.raises(ValueError, match=r"eagle option 'tree' must be one of \['chain', 'dynamic', 'static'\]"):
        m.resolve(tree="beam")
    with pytest.raises(ValueError, match=r"eagle option 'max_nodes' .* must be an int >= 1"):
        m.resolve(max_nodes=0)
    with pytest.raises(ValueError, match=r"branch and max_nodes apply to tree='dynamic' only"):
        make_drafter(target, None, head=head, tree="chain", branch=2)
    with pytest.raises(ValueError, match=r"built for another model"):
        make_drafter(make_target(seed=5), None, head=head)
    with pytest.raises(ValueError, match=r"layers must be 3 layer counts in \[1, 3\]"):
        EagleHead(target, HeadConfig(layers=(1, 2)))
    with pytest.raises(ValueError, match=r"layers must be 3 layer counts in \[1, 3\]"):
        EagleHead(target, HeadConfig(layers=(1, 2, 4)))
    with pytest.raises(ValueError, match="head must be an EagleHead"):
        EagleDrafter(Runner.for_model(target), object())  # type: ignore[arg-type]
    assert eagle_drafter.TREES == ("chain", "dynamic", "static")


def test_save_and_load_round_trip(target, head, tmp_path, tok, prompts):
    path = save_head(head, tmp_path / "head.pt")
    back = load_head(target, path)
    assert back.layers == head.layers and torch.equal(back.ids, head.ids)
    assert "lm_head.weight" not in torch.load(path, weights_only=False)["state"]  # frozen: the target's rows
    for k, v in head.state_dict().items():  # stored in half precision, the frozen LM head rebuilt exactly
        want = v.half().to(v.dtype) if v.is_floating_point() and k != "lm_head.weight" else v
        torch.testing.assert_close(back.state_dict()[k], want)
    ref = dvi_lite.generate(target, tok, prompts[0], method="ar", max_new_tokens=12, stop_at_eos=False).token_ids
    out = dvi_lite.generate(target, tok, prompts[0], method="eagle", max_new_tokens=12, stop_at_eos=False, head=path)
    assert out.token_ids == ref
    with pytest.raises(ValueError, match="trained for the model"):
        load_head(make_target(seed=5), path)
    with pytest.raises(FileNotFoundError, match="eagle-train"):
        load_head(target, tmp_path / "absent.pt")


def test_the_tree_budget_is_chosen_by_the_cost_model():
    """eagle-budget's core on the course model with an untrained head, v and c given (no timing): a row per N
    with tau in [1, 1 + K], the prediction tau / (v(N + 1) + K c), and the best N the one predicting most."""
    import dvi_lite
    from dvi_lite.measure.cost import predicted_speedup
    from dvi_lite.methods.eagle.budget import budget_rows
    from dvi_lite.methods.eagle.head import EagleHead
    from dvi_lite.models.corpus import load_prompts

    model, tok = dvi_lite.load_model("course", dtype="float32")
    v = {1: 1.0, 5: 1.1, 9: 1.3, 17: 2.0}
    out = budget_rows(model, tok, load_prompts()[:2], v, 0.05, nodes=(2, 8), K=3, head=EagleHead(model).eval(),
                      max_new_tokens=8)
    assert [r["nodes"] for r in out["rows"]] == [2, 8]
    for r in out["rows"]:
        assert 1.0 <= r["tau"] <= 1 + 3
        assert r["predicted_speedup"] == pytest.approx(predicted_speedup(r["tau"], 3, 0.05, v, nodes=r["nodes"]),
                                                       abs=1e-4)
    assert out["best_nodes"] == max(out["rows"], key=lambda r: r["predicted_speedup"])["nodes"]
    with pytest.raises(ValueError, match="nodes"):
        budget_rows(model, tok, load_prompts()[:1], v, 0.05, nodes=(0,), K=3)


def test_a_copy_merges_into_the_tree_as_distinct_siblings(target, head):
    """The prompt-lookup copy follows the tree's nodes while tokens agree, then grows a chain of new nodes; no node
    gets two children with one token (the recursive rejection needs distinct siblings)."""
    from dvi_lite.core.engine import Proposal

    tree = Proposal(torch.tensor([5, 7, 9, 3]), None, torch.tensor([-1, -1, 0, 0]))  # 5 -> {9, 3}; 7
    merged = EagleDrafter._merge_copy(tree, [5, 3, 8, 1])  # follows 5 -> 3, then new 8 -> 1
    assert merged.tokens.tolist() == [5, 7, 9, 3, 8, 1] and merged.parents.tolist() == [-1, -1, 0, 0, 3, 4]
    assert EagleDrafter._merge_copy(tree, [6]).parents.tolist() == [-1, -1, 0, 0, -1]  # a new root child
    assert EagleDrafter._merge_copy(tree, []) is tree
    for p in (merged.parents.tolist(),):
        kids = [(pa, t) for pa, t in zip(p, merged.tokens.tolist(), strict=True)]
        assert len(kids) == len(set(kids))


def test_the_lookup_branch_adds_nodes_and_stays_lossless(target, tok, head):
    """On a repeating prompt the copy adds nodes beyond the head's max_nodes, and greedy tokens are still AR's."""
    prompt = [5, 1, 2, 6, 3, 5, 1, 2, 6, 3, 5, 1]
    ref = dvi_lite.generate(target, tok, prompt, method="ar", max_new_tokens=16, stop_at_eos=False).token_ids
    out = dvi_lite.generate(target, tok, prompt, method="eagle", max_new_tokens=16, stop_at_eos=False, head=head,
                            K=4, branch=2, max_nodes=3, lookup=True)
    assert out.token_ids == ref
    assert max(s.drafted for s in out.stats.steps) > 3  # some proposal held copied nodes beyond the tree's 3


def test_a_trained_lm_head_is_stored_and_a_frozen_one_is_not(target, tmp_path):
    frozen = EagleHead(target, HeadConfig(vocab=None))
    trained = EagleHead(target, HeadConfig(vocab=None, train_lm_head=True))
    assert not frozen.lm_head.weight.requires_grad and trained.lm_head.weight.requires_grad
    assert trained.extra_params() - frozen.extra_params() == frozen.lm_head.weight.numel()
    with torch.no_grad():
        trained.lm_head.weight.add_(0.5)
    back = load_head(target, save_head(trained, tmp_path / "trained.pt"))
    assert back.cfg.train_lm_head
    torch.testing.assert_close(back.lm_head.weight, trained.lm_head.weight.half().float())


STATIC = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_static_tree_is_its_rank_paths(target, tok, head):
    """Whatever the head's scores, the proposal has exactly the fixed shape: node i is the rank-r_i child of its
    parent, so the parents and depths follow the rank paths; and the accepted node's rank path is logged."""
    d = make_drafter(target, None, head=head, tree="static", paths=list(reversed(STATIC)))
    assert (d.K, d.branch, d.max_nodes) == (3, 3, 7)
    for ctx in ([3, 17, 4, 22], [5, 5, 5, 9, 30]):
        state = start(d.runner, d, ctx, 20, Sampler(), make_generator(0))
        prop = d.propose(state)
        assert d._ranks == STATIC  # shallow first, as listed
        par = prop.parents.tolist()
        assert par == [STATIC.index(q[:-1]) if len(q) > 1 else -1 for q in STATIC]
        siblings = [prop.tokens[i] for i, q in enumerate(STATIC) if len(q) == 1]
        assert len(set(int(t) for t in siblings)) == 3
    out = dvi_lite.generate(target, tok, [3, 17, 4, 22], method="eagle", max_new_tokens=12, stop_at_eos=False,
                            head=head, tree="static", paths=STATIC)
    assert len(out.token_ids) == 12


@pytest.mark.parametrize("paths, match", [([], "non-empty rank tuples"), ([(0,), (-1,)], "ranks >= 0"),
                                          ([(0,), (1, 0)], r"\(1, 0\) has no \(1,\)"), ("ab", "rank tuples like")])
def test_static_paths_are_checked(target, head, paths, match):
    with pytest.raises(ValueError, match=match):
        make_drafter(target, None, head=head, tree="static", paths=paths)


def test_static_tree_options_are_named(target, head, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="paths .* go with tree='static'"):
        make_drafter(target, None, head=head, tree="dynamic", paths=STATIC)
    with pytest.raises(ValueError, match="branch and max_nodes apply to tree='dynamic' only"):
        make_drafter(target, None, head=head, tree="static", paths=STATIC, max_nodes=4)
    import dvi_lite.methods.eagle.head as head_mod

    monkeypatch.setattr(head_mod, "artifacts_dir", lambda model: tmp_path)
    with pytest.raises(ValueError, match="eagle-static-tree"):
        make_drafter(target, None, head=head, tree="static")


def test_rank_acceptance_and_the_shaped_tree():
    """acc[d][r] counts the accepted node's rank at depth d over the steps that reached depth d."""
    from dvi_lite.methods.eagle.static_tree import rank_acceptance
    from dvi_lite.methods.medusa.trees import sparse_tree

    acc = rank_acceptance([[0, 1], [0], [], [1, 0, 0], [0, 0]], K=3, branch=2)
    assert acc[0] == [3 / 5, 1 / 5]  # every step tested depth 0
    assert acc[1] == [2 / 4, 1 / 4]  # four steps accepted a depth-0 node
    assert acc[2] == [1 / 3, 0.0]
    assert sorted(sparse_tree(acc, 3)) == [(0,), (0, 0), (1,)]  # (1,) at 0.2 beats (0, 1) at 0.15


def test_calibrate_shapes_a_static_tree_of_the_budget(target, tok, prompts, head):
    from dvi_lite.methods.eagle.drafter import check_paths
    from dvi_lite.methods.eagle.static_tree import calibrate

    body = calibrate(target, tok, prompts[:3], max_new_tokens=12, K=3, branch=2, max_nodes=5, head=head)
    assert len(body["paths"]) == 5 and body["steps"] > 0 and len(body["acc"]) == 3
    assert check_paths(body["paths"]) == sorted(map(tuple, body["paths"]), key=lambda q: (len(q), q))


@pytest.mark.slow
def test_static_tree_command_on_the_course_model(tmp_path, capsys):
    """The command writes the rank paths where asked; the course model's static tree is lossless greedy; bad input
    and a committed file are refused by name."""
    from dvi_lite.methods.eagle.static_tree import main

    out = tmp_path / "static_tree.json"
    assert main(["--model", "course", "--dtype", "float32", "--questions", "2", "--max-new-tokens", "16",
                 "--max-nodes", "6", "--out", str(out)]) == 0
    import json

    body = json.loads(out.read_text())
    assert len(body["paths"]) == 6 and body["provenance"]["command"].startswith("python -m dvi_lite eagle-static-tree")
    model, tok = dvi_lite.load_model("course", dtype="float32")
    ref = dvi_lite.generate(model, tok, "def fibonacci(n):", method="ar", max_new_tokens=24).token_ids
    got = dvi_lite.generate(model, tok, "def fibonacci(n):", method="eagle", max_new_tokens=24, tree="static",
                            paths=[tuple(q) for q in body["paths"]]).token_ids
    assert got == ref
    with pytest.raises(SystemExit):
        main(["--model", "course", "--questions", "0", "--out", str(out)])
    assert "questions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "course", "--out", "data/eagle/head.pt"])
    assert "--force" in capsys.readouterr().err


def test_ablation_arms_are_named_and_checked(tmp_path):
    from dvi_lite.methods.eagle.ablation import arm_labels, parse_arms

    head_file = tmp_path / "head.pt"
    head_file.write_bytes(b"")
    labels = arm_labels(parse_arms([f"no_ttt={head_file}"]))
    assert labels == {"full": "eagle", "static_tree": "eagle:tree=static", "no_ttt": f"eagle:head={head_file}"}
    with pytest.raises(ValueError, match="NAME=HEAD_FILE"):
        parse_arms(["no_ttt"])
    with pytest.raises(ValueError, match="a trained arm is one of full_small, no_ttt, top_layer"):
        arm_labels({"wide": str(head_file)})
    with pytest.raises(ValueError, match="give an existing head file"):
        arm_labels({"no_ttt": str(tmp_path / "missing.pt")})
