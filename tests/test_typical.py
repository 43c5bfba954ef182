"""Medusa's typical acceptance (methods/medusa/typical.py): the rule on hand-made trees, its place in the
engine (an opt-in Proposal.accept, unused under greedy decoding), and that it is LOSSY: the chi-square test
of the verified tokens' law fails where the default rule passes (test_medusa.py, test_sampling_law)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import DEEP_PROMPTS, IdTokenizer

import dvi_lite
from dvi_lite.core.engine import Drafter, Proposal, start, verify_step
from dvi_lite.core.registry import default_of
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.medusa.heads import MedusaHeads
from dvi_lite.methods.medusa.typical import TYPICAL_DELTA, TYPICAL_EPSILON, typical_threshold, verify_typical


def test_defaults_are_medusas():
    """epsilon = posterior_threshold = 0.09 and delta = posterior_alpha = 0.3 in Medusa's code."""
    assert (TYPICAL_EPSILON, TYPICAL_DELTA) == (0.09, 0.3)
    assert default_of("medusa", "typical_epsilon") == TYPICAL_EPSILON
    assert default_of("medusa", "typical_delta") == TYPICAL_DELTA
    assert default_of("medusa", "acceptance") == "exact"  # off by default


def test_threshold_is_min_of_epsilon_and_entropy_scaled_delta():
    v = 8
    uniform = torch.full((v,), 1 / v)  # H = log V: delta exp(-H) = delta / V
    one_hot = torch.nn.functional.one_hot(torch.tensor(3), v).float()  # H = 0: delta, capped at epsilon
    two = torch.tensor([0.5, 0.5] + [0.0] * (v - 2))  # H = log 2 (0 log 0 = 0)
    got = typical_threshold(torch.stack([uniform, one_hot, two]), epsilon=0.09, delta=0.3)
    torch.testing.assert_close(got, torch.tensor([0.3 / v, 0.09, 0.09]))
    assert math.isclose(float(typical_threshold(two, epsilon=0.5, delta=0.3)), 0.15, rel_tol=1e-6)


def _rows(*dists: dict[int, float], v: int = 6) -> torch.Tensor:
    """(len, V) distributions from {token: prob} dicts; the rest of the mass spread evenly on other tokens."""
    out = torch.zeros(len(dists), v)
    for r, d in enumerate(dists):
        rest = [t for t in range(v) if t not in d]
        for t, pr in d.items():
            out[r, t] = pr
        out[r, rest] = (1 - sum(d.values())) / len(rest)
    return out


def test_longest_typical_path_wins_and_the_next_token_is_greedy():
    # root children: node 0 (token 1) and node 1 (token 2); node 2 (token 3) under 0, node 3 (token 4) under 1,
    # node 4 (token 5) under 3. Row 0 = after the pending token, row i + 1 = after node i.
    tokens, parents = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, 0, 1, 3])
    p = _rows({1: 0.5, 2: 0.3}, {3: 0.6}, {4: 0.2, 0: 0.5}, {0: 0.7}, {5: 0.05, 1: 0.9}, {2: 0.9})
    thr = typical_threshold(p).tolist()
    assert all(p[r, t] > thr[r] for r, t in [(0, 1), (0, 2), (1, 3), (2, 4)])  # nodes 0..3 pass
    assert p[4, 5] < thr[4]  # node 4 does not: its path stops at node 3
    # two accepted paths of length 2: (0, 2) has likelihood 0.5 * 0.6, (1, 3) 0.3 * 0.2: the first wins
    assert verify_typical(tokens, parents, p) == ([0, 2], int(p[3].argmax()))
    # nothing typical: no node accepted, the next token is p's argmax at the root (greedy, always accepted)
    flat = torch.full((6, 6), 1 / 6)
    flat[:, 0] += 0.01
    flat /= flat.sum(-1, keepdim=True)
    assert verify_typical(tokens, parents, flat, epsilon=0.5, delta=1.0) == ([], 0)
    assert verify_typical(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), p[:1]) == ([], 1)


def test_the_engine_uses_proposal_accept_and_checks_the_runner(target):
    """Proposal.accept replaces the engine's rule (its path and token are what the step keeps); a
    Proposal.runner must drive the target model itself."""
    runner = Runner(target)
    state = start(runner, Drafter(), DEEP_PROMPTS[0], 8, Sampler(1.0), make_generator(0))
    seen = []

    def accept(logits, sampler, gen):
        seen.append(logits.shape)
        return [0, 1], 7
    out = verify_step(state, Proposal(torch.tensor([5, 6]), parents=torch.tensor([-1, 0]), accept=accept))
    assert seen == [(3, target.config.vocab_size)] and (out.path, out.next_token) == ([0, 1], 7)
    assert out.committed == len(state.tokens) - 1 + 3  # pending + both nodes kept in the cache
    other = Runner(type(target)(target.config).eval())
    with pytest.raises(ValueError, match="Proposal.runner must run the target model"):
        verify_step(state, Proposal(torch.tensor([5]), runner=other))


def test_greedy_decoding_ignores_typical_acceptance(target):
    """At T = 0 verification stays the exact greedy match (Medusa's code does the same): AR's tokens."""
    heads = MedusaHeads(target, 2).eval()
    for p in DEEP_PROMPTS[:2]:
        ar = dvi_lite.generate(target, IdTokenizer(), p, max_new_tokens=16, stop_at_eos=False)
        md = dvi_lite.generate(target, IdTokenizer(), p, method="medusa", heads=heads, tree="cartesian", branch=2,
                               K=2, acceptance="typical", max_new_tokens=16, stop_at_eos=False)
        assert md.token_ids == ar.token_ids


def test_typical_accepts_more_when_sampling(target):
    """Why Medusa uses it: at T = 1 deterministic candidates pass rejection sampling with probability p(x)
    only; the typical bar accepts more of them."""
    heads = MedusaHeads(target, 2).eval()
    accepted = {}
    for rule in ("exact", "typical"):
        steps = []
        for seed, p in enumerate(DEEP_PROMPTS):
            out = dvi_lite.generate(target, IdTokenizer(), p, method="medusa", heads=heads, tree="cartesian",
                                    branch=3, K=2, acceptance=rule, temperature=1.0, seed=seed, max_new_tokens=24,
                                    stop_at_eos=False)
            steps += out.stats.steps
        accepted[rule] = sum(s.accepted for s in steps) / len(steps)
    assert accepted["typical"] > accepted["exact"], accepted


@pytest.mark.parametrize("kw, msg", [(dict(acceptance="lossy"), "acceptance"),
                                     (dict(typical_epsilon=0.0), "typical_epsilon"),
                                     (dict(typical_delta=-1.0), "typical_delta"),
                                     (dict(attention="flash"), "attention")])
def test_bad_options(target, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dvi_lite.generate(target, IdTokenizer(), [1, 2], method="medusa", heads=MedusaHeads(target, 2), **kw)
