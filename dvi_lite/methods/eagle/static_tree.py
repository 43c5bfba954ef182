"""EAGLE-1's static tree, shaped from where EAGLE-2's dynamic tree is accepted: `python -m dvi_lite eagle-static-tree`.

EAGLE-2's claim is that a tree whose shape follows each step's draft confidence beats a fixed tree of the same
size. To test it fairly, the fixed tree must be the best fixed one we can make for this head, not a guess. So
the dynamic tree decodes the Spec-Bench training questions (never the ones the bench measures) and every step
records the rank path of its last accepted node: (0, 2) = the best root token, then its third-best child. That
gives, per depth d and rank r, how often the accepted token at depth d was the head's rank-r child given that
depth d was reached:

    acc[d][r] = #(accepted node at depth d has rank r) / #(steps that accepted a node at depth d - 1)

Under the same independence model as Medusa's sparse tree (methods/medusa/trees.py), a rank path lies on the
accepted path with probability prod_j acc[j][r_j], and the best-first tree of `max_nodes` nodes maximises the
expected accepted length. Its rank paths are written beside the head (data/<model>/eagle/static_tree.json, with
their provenance) and `eagle:tree=static` drafts with them.

    python -m dvi_lite eagle-static-tree --model smollm2 --questions 24 --force
"""
from __future__ import annotations

import argparse
import json

from dvi_lite.commands import add_force, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int
from dvi_lite.methods.eagle.drafter import DEFAULT_BRANCH, DEFAULT_MAX_NODES, EagleDrafter
from dvi_lite.methods.eagle.head import static_tree_path
from dvi_lite.methods.medusa.trees import expected_accept_length, sparse_tree


def rank_acceptance(ranks: list[list[int]], K: int, branch: int) -> list[list[float]]:
    """acc[d][r] (K, branch) from the rank paths of each step's last accepted node ([] when none was accepted)."""
    counts = [[0] * branch for _ in range(K)]
    reached = [0] * K  # steps that tested depth d: all of them at depth 0, those that accepted depth d-1 after
    for path in ranks:
        for d in range(min(len(path) + 1, K)):
            reached[d] += 1
        for d, r in enumerate(path[:K]):
            counts[d][r] += 1
    return [[c / reached[d] if reached[d] else 0.0 for c in counts[d]] for d in range(K)]


def calibrate(model, tok, prompts: list[str], max_new_tokens: int = 128, K: int = 5,
              branch: int = DEFAULT_BRANCH, max_nodes: int = DEFAULT_MAX_NODES, head=None) -> dict:
    """Decode `prompts` greedily with the dynamic tree, then shape the static tree of `max_nodes` nodes:
    {"paths", "acc", "steps", "expected_accept_length", "K", "branch", "max_nodes"}."""
    from dvi_lite.core.engine import decode
    from dvi_lite.core.generate import prompt_ids
    from dvi_lite.core.runner import Runner
    from dvi_lite.core.sampling import Sampler, make_generator
    from dvi_lite.methods.eagle.head import load_head

    check_int("max_nodes (the static tree's nodes)", max_nodes, 1)
    runner = Runner.for_model(model)
    drafter = EagleDrafter(runner, head if head is not None else load_head(model), K, "dynamic", branch, max_nodes)
    for i, p in enumerate(prompts):
        decode(runner, drafter, prompt_ids(tok, p), max_new_tokens, Sampler(0.0), make_generator(i), tok.eos_token_id)
    ranks = [s["ranks"] for s in drafter.log]
    acc = rank_acceptance(ranks, K, branch)
    paths = sparse_tree(acc, max_nodes)
    return {"paths": [list(q) for q in paths], "acc": [[round(a, 4) for a in row] for row in acc],
            "steps": len(ranks), "expected_accept_length": round(expected_accept_length(paths, acc), 4),
            "K": K, "branch": branch, "max_nodes": max_nodes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("eagle-static-tree"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", help="the dtype the drafts are served in")
    ap.add_argument("--questions", type=int, default=24, help="Spec-Bench training questions decoded")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--K", type=int, default=5, help="the trees' depth")
    ap.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES, help="nodes of both trees")
    ap.add_argument("--out", default=None, help="the rank paths' file (default: beside the model's EAGLE head; "
                    "a committed one needs --force)")
    add_force(ap)
    args = ap.parse_args(argv)

    def run() -> dict:
        from dvi_lite.core.generate import has_chat_template
        from dvi_lite.measure.provenance import provenance
        from dvi_lite.models import specbench
        from dvi_lite.models.loading import load_model
        from dvi_lite.paths import atomic_write_text
        from dvi_lite.safety import check_output
        n = check_int("questions", args.questions, 1)
        model, tok = load_model(args.model, dtype=args.dtype)
        out = check_output(args.out or static_tree_path(model), force=args.force)
        records = specbench.training_questions(specbench.read_prompts(specbench.SPEC_BENCH_DEV))[:n]
        prompts = [r["prompt"] for r in specbench.first_turns(records, has_chat_template(tok))]
        body = calibrate(model, tok, prompts, args.max_new_tokens, args.K, max_nodes=args.max_nodes)
        body = {"what": "EAGLE static tree: rank paths shaped from the dynamic tree's accepted ranks",
                "data": {"source": "Spec-Bench dev training questions (models.specbench.training_questions)",
                         "questions": n, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype},
                **body, "provenance": provenance(command_line("eagle-static-tree", argv))}
        atomic_write_text(out, json.dumps(body, indent=1) + "\n")
        return body

    body = run_or_usage_error(ap, run)
    print(json.dumps({k: body[k] for k in ("steps", "expected_accept_length", "paths")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
