"""tau along a learning curve: every snapshot a recipe kept, decoded greedily on held-out questions.

The recipes (sps-train, kangaroo-train, the Medusa recipe, dvi --data) measure held-out top-1 agreement at
each milestone of tokens seen and keep an fp16 snapshot of the piece there (`<out>/curve/tokens_<n>.pt`).
Agreement is teacher-forced; what decoding gets is tau (tokens per target forward) and alpha. This module loads
each snapshot as the method's piece and runs the engine greedily on Spec-Bench dev evaluation questions (never
trained on), so the curve shows both against tokens seen:

    python -m dvi_lite curve-tau --model smollm2 --method kangaroo --curve <out>/kangaroo/curve/adapter_k2 \
        --card data/smollm2/kangaroo/adapter_k2.json --json build/curve_kangaroo.json

tau and alpha are counts, not timings: they do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tqdm.auto import tqdm

from dvi_lite.commands import check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int
from dvi_lite.measure.timing import decode_counts

# method -> the option that takes its piece (a snapshot file is the piece's own file format)
PIECE_OPTION = {"sps": "draft_model", "kangaroo": "adapter", "medusa": "heads", "eagle": "head", "dvi": "state"}
SNAPSHOT = re.compile(r"tokens_(\d+)\.pt$")


def snapshots(folder: str | Path) -> list[tuple[int, Path]]:
    """(tokens seen, file) of every snapshot in `folder`, by tokens seen."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("tokens_*.pt") if (m := SNAPSHOT.search(p.name))]
    if not found:
        raise FileNotFoundError(f"no learning-curve snapshot (tokens_<n>.pt) in {folder}")
    return sorted(found)


def piece(model, method: str, path: Path):
    """The snapshot as the value of the method's piece option (the SpS draft is built on `model`)."""
    if method not in PIECE_OPTION:
        raise ValueError(f"method must be one of {sorted(PIECE_OPTION)}, got {method!r}")
    if method == "sps":
        from dvi_lite.methods.sps.draft import load_draft

        return load_draft(model, path)
    return path


def curve_tau(model, tok, method: str, folder: str | Path, prompts: list[dict], max_new_tokens: int = 128,
              options: dict | None = None, progress: bool = True) -> list[dict]:
    """One row per snapshot: tokens seen and decode_counts with that snapshot as the method's piece."""
    check_int("max_new_tokens", max_new_tokens, 1)
    rows = []
    for tokens, path in tqdm(snapshots(folder), desc=f"{method} curve", disable=not progress):
        opts = dict(options or {}) | {PIECE_OPTION[method]: piece(model, method, path)}
        rows.append({"tokens": tokens, "snapshot": path.name,
                     **decode_counts(model, tok, prompts, method, max_new_tokens, opts)})
    return rows


def join_card(rows: list[dict], card: dict) -> list[dict]:
    """Each row with the recipe's held-out agreement at the same tokens seen (its card's curve), when there."""
    by_tokens = {p.get("tokens", p.get("tokens_seen")): p for p in card.get("curve", [])}
    return [r | {k: v for k, v in by_tokens.get(r["tokens"], {}).items() if k.startswith("val_")} for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("curve-tau"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'course', 'smollm2' or a local HF checkpoint folder")
    ap.add_argument("--method", required=True, choices=sorted(PIECE_OPTION))
    ap.add_argument("--curve", required=True, help="the folder of snapshots (tokens_<n>.pt)")
    ap.add_argument("--card", default=None, help="the recipe's card (JSON with its curve): agreement beside tau")
    ap.add_argument("--questions", type=int, default=12, help="Spec-Bench dev evaluation questions (spread)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--options", default="{}", help="the method's other options, as JSON (e.g. '{\"split\": 4}')")
    ap.add_argument("--json", default=None, help="write the rows with their provenance here (results/...)")
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"))  # before any work

    def run() -> dict:
        from dvi_lite.measure.provenance import write_result
        from dvi_lite.models.loading import load_model
        from dvi_lite.models.specbench import EVAL_QUESTIONS, SPEC_BENCH_DEV, read_prompts, spread

        check_int("questions", args.questions, 1, EVAL_QUESTIONS)
        model, tok = load_model(args.model, dtype=args.dtype)
        prompts = spread(read_prompts(SPEC_BENCH_DEV), EVAL_QUESTIONS)[: args.questions]
        rows = curve_tau(model, tok, args.method, args.curve, prompts, args.max_new_tokens, json.loads(args.options))
        if args.card:
            rows = join_card(rows, json.loads(Path(args.card).read_text()))
        out = {"method": args.method, "model": args.model, "dtype": args.dtype, "questions": args.questions,
               "max_new_tokens": args.max_new_tokens, "greedy": True, "rows": rows}
        if args.json:
            write_result(Path(args.json).stem, out, command_line("curve-tau", argv), out_dir=Path(args.json).parent)
        return out

    out = run_or_usage_error(ap, run)
    for r in out["rows"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
