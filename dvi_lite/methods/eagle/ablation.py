"""EAGLE's design claims, ablated on held-out questions: `python -m dvi_lite eagle-ablation`.

Each arm changes one thing against `full` (the committed head drafting EAGLE-2's dynamic tree):

- static_tree: the same head drafting a fixed tree of the same node budget (static_tree.py shapes it from the
  dynamic tree's accepted ranks on the training questions): does following each step's confidence pay?
- no_ttt / top_layer: a head trained without the training-time test (`eagle-train --ttt-steps 1`), or on the top
  layer's state alone (`--layers 30 30 30`); each is compared with a `full_small` head trained by the same
  command on the same tokens, since the committed head saw more of them (`--arm NAME=HEAD_FILE`).

All arms run in one paired, interleaved bench against AR (measure.timing.bench): τ per arm, and × AR with its
interval over questions. Written to results/41_eagle_ablation.json under `arms.<name>`, which the fidelity table
reads (study/fidelity.py).

    python -m dvi_lite eagle-ablation --model smollm2 --questions 24 --repeats 2 --json results/41_eagle_ablation.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dvi_lite.commands import check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int

BUILT_IN = {"full": "eagle", "static_tree": "eagle:tree=static"}  # arms of the committed head
TRAINED = ("full_small", "no_ttt", "top_layer")  # arms that bring their own head file
NEEDS = {name: f"a head trained by `eagle-train --max-tokens N --out DIR{flag}` on the same N tokens as the others, "
                f"then --arm {name}=DIR/head.pt" for name, flag in
         (("full_small", ""), ("no_ttt", " --ttt-steps 1"), ("top_layer", " --layers 30 30 30"))}
KEEP = ("tau", "alpha", "speedup_vs_ar", "speedup_interval", "speedup_vs_ar_e2e", "speedup_interval_e2e",
        "decode_tokens_per_s", "c", "draft_depth_per_step", "predicted_speedup", "same_tokens_as_ar")


def arm_labels(trained: dict[str, str]) -> dict[str, str]:
    """{arm: bench label}: the built-in arms, then each trained arm's head file as the eagle `head` option."""
    bad = sorted(set(trained) - set(TRAINED))
    if bad:
        raise ValueError(f"--arm {bad[0]}: a trained arm is one of {', '.join(TRAINED)}")
    for name, path in trained.items():
        if ":" in path or not Path(path).is_file():
            raise ValueError(f"--arm {name}={path}: give an existing head file (eagle-train's head.pt), no colons")
    return {**BUILT_IN, **{name: f"eagle:head={path}" for name, path in trained.items()}}


def parse_arms(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--arm {item!r}: write NAME=HEAD_FILE, NAME one of {', '.join(TRAINED)}")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("eagle-ablation"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--questions", type=int, default=24, help="held-out Spec-Bench questions, spread over the groups")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=HEAD_FILE",
                    help=f"a trained arm ({', '.join(TRAINED)}) and its head file; repeatable")
    ap.add_argument("--json", default=None, help="results file (checked before any work)")
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"))

    def run() -> dict:
        from dvi_lite.core.generate import has_chat_template
        from dvi_lite.measure.provenance import write_result
        from dvi_lite.measure.timing import bench
        from dvi_lite.models import specbench
        from dvi_lite.models.loading import load_model
        labels = arm_labels(parse_arms(args.arm))
        n = check_int("questions", args.questions, 1, specbench.EVAL_QUESTIONS)
        check_int("repeats", args.repeats, 1)
        model, tok = load_model(args.model, dtype=args.dtype)
        records = specbench.spread(specbench.read_prompts(specbench.SPEC_BENCH_DEV), n)
        prompts = specbench.first_turns(records, has_chat_template(tok))
        methods = bench(model, tok, prompts, ["ar", *labels.values()], args.max_new_tokens, args.repeats)
        arms = {name: {"label": label, **{k: methods[label].get(k) for k in KEEP}} for name, label in labels.items()}
        for name in TRAINED:  # an arm whose head is not trained yet stays in the file, null, saying what it needs
            arms.setdefault(name, {"label": None, "tau": None, "not_run": NEEDS[name]})
        out = {"model": args.model, "dtype": args.dtype, "questions": n, "repeats": args.repeats,
               "max_new_tokens": args.max_new_tokens, "arms": arms, "ar": methods["ar"]}
        if args.json:
            path = Path(args.json)
            write_result(path.stem, out, command_line("eagle-ablation", argv), out_dir=path.parent)
        return out

    out = run_or_usage_error(ap, run)
    print(json.dumps({name: {k: a.get(k) for k in ("tau", "speedup_vs_ar")} for name, a in out["arms"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
