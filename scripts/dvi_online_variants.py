"""Which online objective keeps what DVI's KL warm start taught? One experiment, from the committed recipe's snapshot.

The paper's recipe on SmolLM2 (`prepare --only "dvi head"`) keeps an fp16 snapshot of the head at every milestone
(data/smollm2/dvi/curve/tokens_<n>.pt). From the snapshot at the end of the 1M-token warm start, this runs the same
online phase (36 stream questions, 64 new tokens each, K = 6, fp32) under each variant of the objective, then
decodes 12 held-out Spec-Bench questions (48 tokens each, greedy) and counts tau and alpha. alpha is a count, so
the machine's load does not move it. Variants: the paper's (REINFORCE at the lambda floor 0.05, lr 1e-3), KL only,
accepted experiences only, the surrogate policy term, a tenth of the learning rate, and a lambda floor of 0.5.

    python scripts/dvi_online_variants.py [SNAPSHOT] [--variants paper kl ...] \
        [--json results/27_dvi_online_variants.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

VARIANTS = {"paper": {}, "kl": {"kl_floor": 1.0, "ce_weight": 0.0}, "accepted": {"accepted_only": True},
            "surrogate": {"rl_variant": "surrogate"}, "lowlr": {"lr": 1e-4}, "floor50": {"kl_floor": 0.5}}


def main() -> None:
    from dvi_lite.measure.provenance import write_result
    from dvi_lite.methods.dvi.drafter import evaluate
    from dvi_lite.methods.dvi.paper import PAPER, PaperRecipe, make_trainer
    from dvi_lite.methods.dvi.serve import heldout_questions
    from dvi_lite.models.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", nargs="?", default="data/smollm2/dvi/curve/tokens_1000192.pt")
    ap.add_argument("--warm-steps", type=int, default=3907, help="fast steps the snapshot's warm start took")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = load_model("smollm2", dtype="float32")
    held, ids = heldout_questions(tok, 12)
    snap = torch.load(args.snapshot, weights_only=False)
    state = {k: ({n: x.float() for n, x in v.items()} if isinstance(v, dict) else v.float())
             for k, v in snap["policy"].items()}
    out = {}
    for name in ["warm", *args.variants]:
        cfg = dataclasses.replace(PAPER, t_lambda=args.warm_steps / 3, **VARIANTS.get(name, {}))
        d = Path("build/dvi_online_variants") / name
        tr = make_trainer(model, tok, cfg, PaperRecipe(warm_tokens=0, sequences=36, eval_questions=0), d, d / "ckpt")
        tr.policy.load_trainable_state(state)
        tr.fast_step = args.warm_steps  # lambda_t continues from the warm start's end: at the floor
        t = time.time()
        if name != "warm":
            tr.train(10**9, max_sequences=36, progress=False)
        r = evaluate(model, tok, held, tr.policy, max_new_tokens=48, K=6, threshold=None)
        out[name] = {"changes": VARIANTS.get(name, {}), "tau": r["tau"], "alpha": r["alpha"],
                     "online_fast_steps": tr.fast_step - args.warm_steps, "online_s": round(time.time() - t),
                     "stream_accept_last": tr.recent.get("accept_rate")}
        print(name, out[name], flush=True)
    if args.json:
        write_result(Path(args.json).stem, {"what": __doc__.splitlines()[0], "snapshot": args.snapshot,
                                            "heldout_question_ids": ids, "eval_tokens": 48, "variants": out},
                     command="python scripts/dvi_online_variants.py --json " + args.json,
                     out_dir=Path(args.json).parent)


if __name__ == "__main__":
    main()
