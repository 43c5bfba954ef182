"""Every method under sampling, through dvi_lite.generate: the output law equals the target's.

One case per method and drafter shape (chains, and the trees of kangaroo and of each Medusa tree builder),
on the vocabulary-8 target whose law is enumerated exactly (helpers.exact_joint). The samplers rotate so
that T = 0.7 and T = 1.0, top-k and top-p are each tested on a chain and on a tree. Drafts are K = 3 deep
and max_new_tokens = 5, so the first step verifies a 3-token chain (or a 3-deep tree) and, when it accepts
all three, draws the bonus token t5: the check tests t1 and each of t2|t1, t3|t2, t4|t3 and t5|t4 (output
positions), and, besides, each verifier depth on its own: step 1's decisions at depth 1, 2 and 3 and its bonus
token, each tested on the draws that reached it against the target's law given the whole prefix
(helpers.depth_test). Each case asserts that a step accepted 3 drafts in a row (pld: that 3-token drafts were
verified; its copies are accepted too rarely on a random model for a run of 3).

Why depths and not only positions: t4 is decided by step 1's depth-3 verifier only when step 1 accepted its
first two drafts, in 16-73 % of the draws here (REACH), and by some later step otherwise, so a mistake confined
to depth 3 moves t4|t3's law in only that share of the draws: with the position tests' draws, it was caught
only when about 1 / reach (4-6 times) larger than the stated effect size.

Draws, level and power (helpers.py, "false alarms, power and the draw count"): each case with drafts draws
helpers.planned_depth_draws() (1,250-6,175 here, seeds 0..N-1): the fewest at which its 5 position tests have
99 % power at Cohen's w = 0.25 and alpha = helpers.ALPHA (1 % false alarms over the suite's law-test budget)
and each depth test too, given the share of the draws that reach that depth (REACH, measured; the depth
test expects N * reach draws). test_every_verifier_depth_is_powered states those numbers per case and asserts
them without drawing anything; each report asserts the achieved power of every test, depth tests included
(>= 95 %), and prints it with the p-values and the reach it measured. ar and pld test the positions only
(helpers.planned_draws(), 950-1,025 draws), as test_every_verified_depth_is_powered states.
The trained pieces are small and cheap, untrained or briefly trained, but each gets drafts accepted:
a Kangaroo adapter initialised from layer 1 (KangarooAdapter starts from the first deep layer's
attention), Medusa heads perturbed off the identity (seed 0), and a DVI policy trained for a few fast
steps on the model itself (seed 0), and an EAGLE head initialised from the target (EagleHead's init; its chain's
q is the head's law, its dynamic tree's candidates point masses; tests/test_eagle_sampling.py has more cases).
"""
from __future__ import annotations

import pytest
from helpers import (
    ALPHA,
    DEPTH_TESTS,
    POWER,
    PROMPT8,
    W_DESIGN,
    assert_lossless_sampling,
    depth_design,
    dvi_on_target8,
    exact_joint,
    law_test,
    law_test_names,
    lossless_draws,
    make_draft,
    pair_laws,
    perturbed_heads,
    planned_depth_draws,
    planned_draws,
)

from dvi_lite.core.runner import Skip
from dvi_lite.core.sampling import Sampler
from dvi_lite.methods.eagle.head import EagleHead
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter

NEW = 5  # t1 from the prefill, then a first step that drafts K = min(k, NEW - 2) = 3
K = 3
SAMPLERS = {"T1": dict(temperature=1.0), "T0.7": dict(temperature=0.7),
            "topk": dict(temperature=1.0, top_k=4), "topp": dict(temperature=0.7, top_p=0.8)}
PLD_PROMPT = [5, 1, 2, 6, 3, 5, 1]  # repeats, so that prompt lookup finds 3-token continuations to copy
ACC = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]  # made-up per-rank accuracies for the sparse tree


@pytest.fixture(scope="module")
def dvi_model(target8):
    """A copy of target8 with a DVI policy trained for 4 fast steps on it (the trainer leaves the model as is)."""
    return dvi_on_target8(target8, K)


# case -> (method, sampler, options, the chain check: ("run", 3) = a step accepted 3 drafts, ("depth", 3))
CASES = {
    "ar": ("ar", "topk", {}, None),
    "sps": ("sps", "T0.7", {"draft_model": "close_draft8", "K": K}, ("run", 3)),
    "pld": ("pld", "T1", {"K": K, "max_ngram": 2}, ("depth", 3)),
    "early_exit": ("early_exit", "topp", {"split": 1, "K": K}, ("run", 3)),
    "kangaroo_chain": ("kangaroo", "T1", {"adapter": "adapter", "K": K, "threshold": None}, ("run", 3)),
    "kangaroo_tree": ("kangaroo", "T0.7", {"adapter": "adapter", "K": K, "threshold": None, "branch": 2}, ("run", 3)),
    "draft_verify": ("draft_verify", "topk", {"skip": Skip(mlp=frozenset({1})), "K": K, "threshold": None,
                                              "adaptive": False}, ("run", 3)),
    "medusa_cartesian": ("medusa", "topp", {"heads": "heads", "K": K, "branch": 2, "tree": "cartesian"}, ("run", 3)),
    "medusa_pruned": ("medusa", "T1", {"heads": "heads", "K": K, "branch": 3, "tree": "pruned", "max_nodes": 8},
                      ("run", 3)),
    "medusa_sparse": ("medusa", "topk", {"heads": "heads", "K": K, "branch": 3, "tree": "sparse", "accuracies": ACC,
                                         "max_nodes": 8}, ("run", 3)),
    "dvi": ("dvi", "T0.7", {"state": "policy", "K": K, "threshold": None}, ("run", 3)),
    "eagle_chain": ("eagle", "T0.7", {"head": "head", "K": K, "tree": "chain"}, ("run", 3)),
    "eagle_dynamic": ("eagle", "topp", {"head": "head", "K": K, "tree": "dynamic", "branch": 2, "max_nodes": 6},
                      ("depth", 3)),
}


# Step 1's reach: the share of draws in which step 1's verifier decided at depth 1, 2, 3 and drew the bonus
# token (depth j decides t_{j+1}; the bonus follows a fully accepted branch), measured on 300 draws (seeds
# 0..299) and rounded down; each run prints the reach it measured. A mistake confined to one depth moves its
# output position's law in only that share of the draws (an effect of about reach * w there), so the position
# tests alone would need 1 / reach^2 times the draws; the depth tests test the draws that reached each depth
# instead, and the draw count is chosen so that each has 99 % power at w = W_DESIGN (planned_depth_draws).
# ar never drafts and pld's copies start in only ~1 % of the draws (its prompt offers few matches): their
# depths are not tested here (pld's verifier is the chain verifier every chain case tests at each depth).
REACH = {
    "sps": (1.0, 0.70, 0.60, 0.52),
    "early_exit": (1.0, 0.80, 0.43, 0.24),
    "kangaroo_chain": (1.0, 0.84, 0.61, 0.50),
    "kangaroo_tree": (1.0, 0.78, 0.73, 0.66),
    "draft_verify": (1.0, 0.86, 0.65, 0.54),
    "medusa_cartesian": (1.0, 0.19, 0.16, 0.13),
    "medusa_pruned": (1.0, 0.34, 0.23, 0.16),
    "medusa_sparse": (1.0, 0.46, 0.24, 0.17),
    "dvi": (1.0, 0.81, 0.48, 0.33),
}


def case_design(case, target8) -> tuple[int, dict[str, tuple[int, float, float]] | None]:
    """(draws, {depth test: (df, expected draws reaching it, design power)}) of a case: planned_depth_draws from
    its stated REACH when its depths are tested, else planned_draws (the position tests alone)."""
    method, sampler, _, _ = CASES[case]
    laws = pair_laws(exact_joint(target8, Sampler(**SAMPLERS[sampler]), PLD_PROMPT if method == "pld" else PROMPT8,
                                 NEW))
    if case not in REACH:
        return planned_draws(laws), None
    reach = dict(zip(DEPTH_TESTS, REACH[case], strict=True))
    n = planned_depth_draws(laws, reach)
    return n, depth_design(laws, reach, n)


@pytest.mark.parametrize("case", list(REACH))
def test_every_verifier_depth_is_powered(case, target8):
    """The draws of each case give every depth test (depth 1, 2, 3 and the bonus) design power >= POWER at
    w = W_DESIGN and level ALPHA, from the case's stated reach: e.g. medusa_pruned (reach 0.16 for the bonus) needs
    about 6,175 draws, where its position tests alone need about 1,000."""
    n, design = case_design(case, target8)
    stated = ", ".join(f"{k}: df {df}, {m:.0f} draws, power {pw:.4f}" for k, (df, m, pw) in design.items())
    assert all(pw >= POWER for _, _, pw in design.values()), f"{case}: {n} draws: {stated}"
    print(f"{case}: {n} draws, alpha {ALPHA:g}, w {W_DESIGN}: {stated}")


@pytest.mark.parametrize("case", list(CASES))
def test_every_method_is_lossless_under_sampling(case, target8, draft8, tok8, request):
    method, sampler, opts, chain = CASES[case]
    model = target8
    pieces = {"draft8": draft8}
    if opts.get("draft_model") == "close_draft8":  # half draft8's noise: a step reaches depth 3 in half the draws
        pieces["close_draft8"] = make_draft(target8, seed=3, noise=0.15)
    if method == "kangaroo":
        pieces["adapter"] = KangarooAdapter(target8, 1).eval()
    if method == "medusa":
        pieces["heads"] = perturbed_heads(target8)
    if method == "dvi":
        model, pieces["policy"] = request.getfixturevalue("dvi_model")
    if method == "eagle":
        pieces["head"] = EagleHead(target8).eval()
    kw = {k: pieces.get(v, v) if isinstance(v, str) else v for k, v in opts.items()}
    need = {} if chain is None else {"min_run" if chain[0] == "run" else "min_depth": chain[1]}
    n, _ = case_design(case, target8)
    rep = assert_lossless_sampling(model, tok8, method, max_new_tokens=NEW, drafts=chain is not None, n=n,
                                   depths=case in REACH, prompt=PLD_PROMPT if method == "pld" else PROMPT8,
                                   **SAMPLERS[sampler], **need, **kw)
    print(rep)



@pytest.mark.parametrize("sampler, prompt", [(s, PROMPT8) for s in SAMPLERS] + [("T1", PLD_PROMPT)])
def test_every_verified_depth_is_powered(target8, sampler, prompt):
    """The power calculation behind each case's draw count, stated: at planned_draws() every test (t1, the
    depths t2|t1, t3|t2, t4|t3 and the bonus token t5|t4) has design power >= POWER at w = W_DESIGN and level
    ALPHA, on the cells law_test fixes from the expected counts (no test is left without a testable cell)."""
    laws = pair_laws(exact_joint(target8, Sampler(**SAMPLERS[sampler]), prompt, NEW))
    n = planned_draws(laws)
    assert n <= lossless_draws()
    tests = [law_test(n * law, law, n, name) for name, law in zip(law_test_names(NEW), laws, strict=True)]
    stated = ", ".join(f"{t.name}: df {t.df}, {t.n} draws, power {t.power:.4f}" for t in tests)
    assert all(t.testable and t.power >= POWER for t in tests), f"{sampler}: {n} draws, alpha {ALPHA:g}: {stated}"
    print(f"{sampler}: {n} draws, alpha {ALPHA:g}, w {W_DESIGN}: {stated}")
