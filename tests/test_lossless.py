"""Every method under sampling, through dvi_lite.generate: the output law equals the target's.

One case per method and drafter shape (chains, and the trees of kangaroo and of each Medusa tree builder),
on the vocabulary-8 target whose law is enumerated exactly (helpers.exact_joint). The samplers rotate so
that T = 0.7 and T = 1.0, top-k and top-p are each tested on a chain and on a tree. Drafts are K = 3 deep
and max_new_tokens = 5, so the first step verifies a 3-token chain (or a 3-deep tree) and, when it accepts
all three, draws the bonus token t5: the check tests t1 and each of t2|t1, t3|t2, t4|t3 and t5|t4, every
position a verifier decides at depth 1, 2 and 3 and the bonus token. Each case asserts that a step
accepted 3 drafts in a row (pld: that 3-token drafts were verified; its copies are accepted too rarely on
a random model for a run of 3).

Draws, level and power (helpers.py, "false alarms, power and the draw count"): each case draws
helpers.planned_draws() (825-1,150 here, seeds 0..N-1), the fewest at which every one of its 5 tests has
99 % power at Cohen's w = 0.25 and alpha = 5e-5 (1 % false alarms over the suite's <= 200 law tests).
Each report asserts the achieved power of every test (>= 95 %) and prints it with the p-values;
test_every_verified_depth_is_powered shows the design numbers without drawing anything.
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
    POWER,
    PROMPT8,
    W_DESIGN,
    assert_lossless_sampling,
    dvi_on_target8,
    exact_joint,
    law_test,
    law_test_names,
    lossless_draws,
    pair_laws,
    perturbed_heads,
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
    "sps": ("sps", "T0.7", {"draft_model": "draft8", "K": K}, ("run", 3)),
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


@pytest.mark.parametrize("case", list(CASES))
def test_every_method_is_lossless_under_sampling(case, target8, draft8, tok8, request):
    method, sampler, opts, chain = CASES[case]
    model = target8
    pieces = {"draft8": draft8}
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
    rep = assert_lossless_sampling(model, tok8, method, max_new_tokens=NEW, drafts=chain is not None,
                                   prompt=PLD_PROMPT if method == "pld" else PROMPT8, **SAMPLERS[sampler], **need, **kw)
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
