"""Drafters under top-k and top-p together, with a temperature other than 1 (issue 30, item 3).

tests/test_lossless.py gives each method one sampler; before this file top-p never reached kangaroo, dvi or
draft_verify (whose own `propose` was tested at T = 1 only), and top-k never reached sps, early_exit, kangaroo or
dvi. Each of those drafters is tested here under BOTH (T = 1.3, top-k, then top-p), so with test_lossless.py every
one of them is tested under plain temperature, top-k and top-p. A drafter that samples its draft from one law and
reports another as q (a filter applied to one and not the other, a filter before the temperature instead of after)
changes the output law, and the check catches it. pld's drafts are point masses (q is 1 on the copied token), so
what its cases test is the verifier: a copied token that top-k or top-p removes has p = 0 and must always be
rejected, and the residual must be renormalised over the kept tokens. It runs on test_lossless.py's repeating
prompt under top-k and on a prompt of its own under top-p (PLD_TOP_P_PROMPT), each at T = 1.3.

The check is the shared one (helpers.assert_lossless_sampling, on the vocabulary-8 target whose law is enumerated
exactly): helpers.lossless_draws() draws per case (its power calculation), t2 | t1, t3 | t1, t2 and t4 | t1..t3
tested (drafts K = 3 deep, 5 new tokens), and a step that accepted 3 drafts in a row (pld: a 3-deep proposal).
The pieces are those of test_lossless.py: a Kangaroo adapter initialised from layer 1, a DVI policy trained
for 4 fast steps on the model itself, and an EAGLE head initialised from the target (its chain's q, filtered
like p).
"""
from __future__ import annotations

import pytest
from helpers import PROMPT8, assert_lossless_sampling, dvi_on_target8
from test_lossless import PLD_PROMPT

from dvi_lite.core.runner import Skip
from dvi_lite.methods.eagle.head import EagleHead
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter

NEW, K = 5, 3
# At T = 1.3 the target puts 0.64 on t1 = 5 after this prompt, top-p (0.9) keeps 5 and 7, and t1 = 5 finds the
# 3-token copy 6, 1, 2 (test_lossless.PLD_PROMPT's 3-deep copy follows a t1 of probability 0.01, which top-p removes)
PLD_TOP_P_PROMPT = [5, 6, 1, 2, 6, 6, 7, 3]
# T > 1 flattens, top-k keeps 4 of 8 tokens, top-p then keeps the smallest set holding 0.9 of their mass: on the
# vocabulary-8 target top-p binds after most contexts (1 to 3 tokens kept) and top-k after the others (4 kept)
BOTH = dict(temperature=1.3, top_k=4, top_p=0.9)

# case -> (method, options, the chain check: ("run", 3) = a step accepted 3 drafts in a row)
CASES = {
    # sps is covered under top-p and top-k by test_engine.py and test_course_model.py
    "early_exit": ("early_exit", {"split": 1, "K": K}, ("run", 3)),
    "kangaroo_chain": ("kangaroo", {"adapter": "adapter", "K": K, "threshold": None}, ("run", 3)),
    "draft_verify": ("draft_verify", {"skip": Skip(mlp=frozenset({1})), "K": K, "threshold": None,
                                      "adaptive": False}, ("run", 3)),
    "dvi": ("dvi", {"state": "policy", "K": K, "threshold": None}, ("run", 3)),
    "eagle_chain": ("eagle", {"head": "head", "K": K, "tree": "chain"}, ("run", 3)),
    # point-mass drafts: each filter on its own (together they leave too few copies kept for a t5 cell)
    "pld_top_k": ("pld", {"K": K, "max_ngram": 2, "top_p": 1.0}, ("depth", 3)),
    "pld_top_p": ("pld", {"K": K, "max_ngram": 2, "top_k": 0}, ("depth", 3)),
}


PROMPTS = {"pld_top_k": PLD_PROMPT, "pld_top_p": PLD_TOP_P_PROMPT}


@pytest.fixture(scope="module")
def dvi_model(target8):
    """A copy of target8 with a DVI policy trained for 4 fast steps on it (test_lossless.py's recipe)."""
    return dvi_on_target8(target8, K)


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_is_lossless_under_top_k_and_top_p(case, target8, draft8, tok8, request):
    method, opts, chain = CASES[case]
    model, pieces = target8, {"draft8": draft8}
    if method == "kangaroo":
        pieces["adapter"] = KangarooAdapter(target8, 1).eval()
    if method == "dvi":
        model, pieces["policy"] = request.getfixturevalue("dvi_model")
    if method == "eagle":
        pieces["head"] = EagleHead(target8).eval()
    kw = {k: pieces.get(v, v) if isinstance(v, str) else v for k, v in opts.items()}
    need = {"min_run" if chain[0] == "run" else "min_depth": chain[1]}
    sampler = BOTH | kw  # pld's cases switch one filter off
    rep = assert_lossless_sampling(model, tok8, method, max_new_tokens=NEW, prompt=PROMPTS.get(case, PROMPT8), **need,
                                   **sampler)
    print(rep)
