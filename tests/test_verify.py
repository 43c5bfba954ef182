"""dvi_lite.core.verify: exact identities, hand-checked greedy cases, and statistical losslessness.

Statistical tests: every generator is seeded, so each test is deterministic (it either always passes or
always fails). We still use a p-value threshold (helpers.ALPHA = 2.5e-5, the suite's Bonferroni level) rather
than asserting exact counts: it leaves room for the one fixed draw being a bit unusual, while a real bias in
the rejection rule (e.g. a wrong residual, a wrong acceptance ratio) gives p-values around 1e-20 or less at
20 000 trials.
"""
from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, binom_pvalue, chi2_pvalue, random_dist

from dvi_lite.core.verify import first_token_law, residual, verify_greedy_chain, verify_sampling_chain, verify_tree

V = 8
N_TRIALS = 20_000
P_MIN = ALPHA  # see module docstring


def _pairs():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(200):
        p = random_dist(V, g, zeros=i % 4)
        q = random_dist(V, g, zeros=(i // 4) % 4)
        out.append((p, q))
    p = random_dist(V, g)
    out.append((p, p.clone()))  # identical: residual is 0/0
    out.append((torch.eye(V)[3], torch.eye(V)[5]))  # disjoint point masses
    out.append((torch.eye(V)[3], torch.full((V,), 1 / V)))
    return out


def test_first_token_law_equals_p_exactly():
    for p, q in _pairs():
        torch.testing.assert_close(first_token_law(p, q), p, atol=1e-6, rtol=0)


def test_residual_is_a_distribution_supported_where_p_exceeds_q():
    for p, q in _pairs():
        r = residual(p, q)
        assert (r >= 0).all()
        torch.testing.assert_close(r.sum(), torch.tensor(1.0), atol=1e-6, rtol=0)
        if not torch.allclose(p, q):
            assert (r[q >= p] == 0).all()
            expected = torch.clamp(p - q, min=0)
            torch.testing.assert_close(r, expected / expected.sum(), atol=1e-6, rtol=0)


def test_residual_of_identical_distributions_falls_back_to_p():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert torch.equal(residual(p, p), p)


# ---------------------------------------------------------------- greedy chain

def _logits_with_argmax(rows: list[int], v: int = V) -> torch.Tensor:
    x = torch.zeros(len(rows), v)
    x[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return x


def test_greedy_chain_all_accepted_gives_bonus_from_last_row():
    draft = torch.tensor([3, 1, 4])
    n, nxt = verify_greedy_chain(draft, _logits_with_argmax([3, 1, 4, 6]))
    assert (n, nxt) == (3, 6)


@pytest.mark.parametrize("rows, n, nxt", [
    ([2, 1, 4, 6], 0, 2),  # first draft wrong: correction = argmax of row 0
    ([3, 7, 4, 6], 1, 7),  # second wrong (a later match at position 2 must not count)
    ([3, 1, 5, 6], 2, 5),
])
def test_greedy_chain_stops_at_first_mismatch(rows, n, nxt):
    assert verify_greedy_chain(torch.tensor([3, 1, 4]), _logits_with_argmax(rows)) == (n, nxt)


def test_greedy_chain_with_no_draft():
    assert verify_greedy_chain(torch.empty(0, dtype=torch.long), _logits_with_argmax([5])) == (0, 5)


# ---------------------------------------------------------------- sampling chain

def _chain_problem(k: int, seed: int):
    """p (K+1, V), q (K, V) with p > 0 = q and q > 0 = p cells in row 0."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([random_dist(V, g) for _ in range(k + 1)])
    q = torch.stack([random_dist(V, g) for _ in range(k)])
    p[0, 0] = 0.0  # q proposes token 0, which p never emits: always rejected
    q[0, 1] = 0.0  # p needs token 1, which q never proposes: only the residual can emit it
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _alpha(p, q):
    return torch.minimum(p, q).sum(-1)


def _run_chain(fn, p, q, k, seed):
    """Draw drafts i.i.d. from the rows of q (context-free p and q), verify; returns emitted prefixes and n."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], N_TRIALS, replacement=True, generator=g) for i in range(k)], 1)
    emitted, ns = [], []
    for d in drafts:
        n, nxt = fn(d, q, p, g)
        emitted.append(d[:n].tolist() + [nxt])
        ns.append(n)
    return emitted, torch.tensor(ns)


def _chain_fn(d, q, p, g):
    return verify_sampling_chain(d, q, p, g)


def _tree_chain_fn(d, q, p, g):  # the same chain, given to verify_tree as parents [-1, 0, 1, ...]
    path, nxt = verify_tree(d, torch.arange(d.numel()) - 1, p, q, greedy=False, gen=g)
    assert path == list(range(len(path)))
    return len(path), nxt


def _n_law(p, q, k):
    """Exact law of the number of accepted drafts when rows are context-free: P(n >= j) = prod alpha_i."""
    a = _alpha(p[:k], q)
    reach = torch.cat([torch.ones(1), torch.cumprod(a, 0)])  # P(n >= j), j = 0..K
    return torch.cat([reach[:-1] - reach[1:], reach[-1:]])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sampling_chain_first_token_follows_p(k):
    p, q = _chain_problem(k, seed=10 + k)
    emitted, ns = _run_chain(_chain_fn, p, q, k, seed=20 + k)
    first = torch.tensor([e[0] for e in emitted])
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) > P_MIN
    # the first draft is accepted with probability alpha = sum min(p, q)
    assert binom_pvalue(int((ns >= 1).sum()), N_TRIALS, float(_alpha(p[0], q[0]))) > P_MIN
    assert chi2_pvalue(torch.bincount(ns, minlength=k + 1), _n_law(p, q, k)) > P_MIN
    if k == 2:  # given the first draft was accepted, the second emitted token follows p[1]
        second = torch.tensor([e[1] for e, n in zip(emitted, ns.tolist(), strict=True) if n >= 1])
        assert len(second) > 1000
        assert chi2_pvalue(torch.bincount(second, minlength=V), p[1]) > P_MIN


def test_chain_given_to_verify_tree_has_the_same_law():
    """The K=3 problem of test_sampling_chain_first_token_follows_p[3], verified by verify_tree as parents
    [-1, 0, 1]: the same law of the first token (p[0]) and of the number accepted (exact, see _n_law)."""
    k = 3
    p, q = _chain_problem(k, seed=10 + k)
    emitted, ns = _run_chain(_tree_chain_fn, p, q, k, seed=33)
    first = torch.tensor([e[0] for e in emitted])
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) > P_MIN
    assert chi2_pvalue(torch.bincount(ns, minlength=k + 1), _n_law(p, q, k)) > P_MIN


def test_sampling_chain_with_point_mass_draft_and_no_draft():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # p(0) = 0: always rejected, the residual is p itself
        n, nxt = verify_sampling_chain(torch.tensor([0]), q, p, g)
        assert n == 0 and nxt in (1, 2)
    n, nxt = verify_sampling_chain(torch.empty(0, dtype=torch.long), q[:0], p[1:], g)
    assert (n, nxt) == (0, 3)


# ---------------------------------------------------------------- trees, greedy

TREE_PARENTS = torch.tensor([-1, -1, 0, 0, 1])  # 0 and 1 under the root; 2, 3 under 0; 4 under 1
TREE_TOKENS = torch.tensor([3, 5, 2, 7, 1])


@pytest.mark.parametrize("argmax_rows, path, nxt", [
    # row r = target logits after node r-1 (row 0: at the root)
    ([5, 0, 1, 0, 0, 6], [1, 4], 6),  # branch 1 -> 4 matches, bonus from row 5
    ([3, 7, 0, 0, 4, 0], [0, 3], 4),  # branch 0 -> 3 matches, bonus from row 4
    ([3, 6, 0, 0, 0, 0], [0], 6),  # node 0 matches, none of its children
    ([6, 7, 1, 2, 4, 0], [], 6),  # nothing matches: bonus = argmax of row 0
])
def test_tree_greedy(argmax_rows, path, nxt):
    logits = _logits_with_argmax(argmax_rows)
    assert verify_tree(TREE_TOKENS, TREE_PARENTS, logits, None, greedy=True) == (path, nxt)


# ---------------------------------------------------------------- trees, sampling

def test_tree_sampling_iid_children_is_lossless():
    """Two children per node drawn i.i.d. from q (SpecInfer-style multi-draft), two levels."""
    g = torch.Generator().manual_seed(40)
    p_root, p_a, p_b = (random_dist(V, g) for _ in range(3))
    q_root, q_a, q_b = random_dist(V, g), random_dist(V, g, zeros=2), random_dist(V, g, zeros=2)
    p_root[q_root.argmax()] = 0.0  # the likeliest draft is never right
    p_root /= p_root.sum()
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    q = torch.stack([q_root, q_root, q_a, q_a, q_b, q_b])
    p = torch.stack([p_root, p_a, p_b] + [random_dist(V, g) for _ in range(4)])  # rows 3..6: after leaves
    draws = torch.stack([torch.multinomial(q[i], N_TRIALS, replacement=True, generator=g) for i in range(6)], 1)
    first, second = [], {0: [], 1: []}
    for tokens in draws:
        path, nxt = verify_tree(tokens, parents, p, q, greedy=False, gen=g)
        out = [int(tokens[i]) for i in path] + [nxt]
        first.append(out[0])
        if path:
            assert parents[path[0]] == -1 and all(parents[b] == a for a, b in zip(path[:-1], path[1:], strict=True))
            second[path[0]].append(out[1])
    assert chi2_pvalue(torch.bincount(torch.tensor(first), minlength=V), p_root) > P_MIN
    # given the path went through node 0 (resp. 1), the next token follows the target after it
    for node, law in [(0, p_a), (1, p_b)]:
        assert len(second[node]) > 1000
        assert chi2_pvalue(torch.bincount(torch.tensor(second[node]), minlength=V), law) > P_MIN


def test_tree_sampling_deterministic_children_is_lossless():
    """q=None: the root's children are the top-2 tokens of some q (point masses)."""
    g = torch.Generator().manual_seed(51)
    p_root, q_root = random_dist(V, g), random_dist(V, g)
    top2 = torch.topk(q_root, 2).indices
    p_root[top2[0]] = 0.0  # the first candidate is one the target never emits (ratio 0), the second is not
    p_root /= p_root.sum()
    assert p_root[top2[1]] > 0.05
    p = torch.stack([p_root, random_dist(V, g), random_dist(V, g)])
    first = []
    for _ in range(N_TRIALS):
        path, nxt = verify_tree(top2, torch.tensor([-1, -1]), p, None, greedy=False, gen=g)
        first.append(int(top2[path[0]]) if path else nxt)
    assert chi2_pvalue(torch.bincount(torch.tensor(first), minlength=V), p_root) > P_MIN
