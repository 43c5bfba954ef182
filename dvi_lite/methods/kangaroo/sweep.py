"""Kangaroo's exit-layer sweep on a real model: alpha, the draft cost c, and the speedup the cost model predicts.

For each exit layer k: a short `distill.fit_adapter` run on the model's self-distillation set (by default its
committed token record, data/<model>/distill/: the recipe the committed adapter was trained by, at a smaller equal
budget per layer), then on the set's held-out rows, relabelled with the full model's own fp32 top-1 (`greedy_labels`)
- alpha: the draft's top-1 agreement with the full model's top-1, per token;
- tau(eta, K): a replay of greedy double early exit on the model's own answers. Where a row is the model's own
  greedy text (token t+1 == the teacher's top-1 at t), the drafts the engine would make are exactly the draft's
  top-1 along the row, so a step from position p accepts the leading matches of drafts p, p+1, ... and drafting
  stops after the first draft whose top-1 probability is below eta (that one still proposed) or after K;
- c: one draft step's time (layers [0, k) with a KV cache, the adapter with its cache, the trimmed head and the
  softmax over the vocabulary) over one full 1-token forward (every layer + the full head, with a KV cache), in
  the model's dtype, medians of interleaved repeats;
- predicted speedup = tau / (v(D + 1) + D c) (measure.cost; D = drafted tokens per step), with the measured v(n).
The layer with the best predicted speedup is the one to train longer.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from dvi_lite.commands import check_outputs, require_positive, run_or_usage_error
from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner
from dvi_lite.measure import cost
from dvi_lite.measure.provenance import provenance
from dvi_lite.methods.kangaroo.drafter import KangarooAdapter
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.models.teacher import TeacherData
from dvi_lite.models.vocab import TrimmedHead
from dvi_lite.paths import BUILD_DIR, atomic_write_text

ETAS = (None, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)  # None: no second exit, always K drafts


def greedy_region(row: dict) -> torch.Tensor:
    """(n,) bool: positions t whose next row token is the teacher's top-1 (the row is the model's greedy text
    there); the last position has no next token and is False."""
    ok = torch.zeros_like(row["teacher"], dtype=torch.bool)
    ok[:-1] = row["tokens"][1:] == row["teacher"][:-1]
    return ok


def greedy_runs(row: dict) -> list[tuple[int, int]]:
    """[start, end) stretches of greedy positions to replay: an answer row's trailing run (the answer after its
    prompt), every run of another row (text that happens to be what the model would write)."""
    ok = greedy_region(row).tolist() + [False]
    runs, start = [], None
    for t, g in enumerate(ok):
        if g and start is None:
            start = t
        elif not g and start is not None:
            runs.append((start, t))
            start = None
    return runs[-1:] if row["answer"] else runs


def replay(rows: list[dict], eta: float | None, k_max: int) -> dict:
    """Greedy double early exit replayed on held-out rows: {tau, drafted (per step), steps}.

    Within each greedy run (`greedy_runs`), a step at position p drafts at p, p+1, ... (each draft the adapter's
    top-1 given the true prefix), stops after the first confidence below eta or after k_max (or at the run's
    end), accepts the leading matches, and moves on by accepted + 1. Answer rows only, when there are any.
    """
    if any(r["answer"] for r in rows):
        rows = [r for r in rows if r["answer"]]
    steps = tokens = drafted = 0
    for row in rows:
        match = (row["draft"] == row["teacher"]).tolist()
        conf = row["conf"].tolist()
        for p, end in greedy_runs(row):
            while p < end:
                d = 0
                while d < min(k_max, end - p):
                    d += 1
                    if eta is not None and conf[p + d - 1] < eta:
                        break
                acc = 0
                while acc < d and match[p + acc]:
                    acc += 1
                steps, tokens, drafted = steps + 1, tokens + acc + 1, drafted + d
                p += acc + 1
    return {"tau": tokens / steps if steps else None, "drafted": drafted / steps if steps else None, "steps": steps}


@torch.no_grad()
def draft_cost(model, adapter: KangarooAdapter, head: TrimmedHead | None, context: int = 300, repeats: int = 21,
               seed: int = 0) -> dict:
    """{c, draft_s, forward_s}: one draft step's median time over one 1-token full forward's, both with `context`
    cached positions, in the model's dtype; rounds interleave the two so that drift hits both alike."""
    r = Runner.for_model(model)
    gen = torch.Generator().manual_seed(seed)
    vocab = r.lm_head.weight.shape[0]
    ids = torch.randint(0, vocab, (1, context + 1), generator=gen)
    cache = r.new_cache(context + 2)
    r.forward(ids[:, :context], cache)
    acache = KVCache.for_model(model, context + 2, n_layers=1)
    pos_all = torch.arange(context)[None]
    h0 = r.layers_forward(r.embed(ids[:, :context]), None, pos_all, 0, adapter.split)
    adapter(h0, r.rotary(h0, pos_all), acache)
    x = ids[:, context:]
    pos = torch.tensor([[context]])

    def draft() -> None:
        h = r.layers_forward(r.embed(x), cache, pos, 0, adapter.split)
        out = adapter(h, r.rotary(h, pos), acache)
        logits = r.lm_head(out) if head is None else head(out)
        logits.float().softmax(-1).max()

    def full() -> None:
        r.forward(x, cache)

    times: dict[str, list[float]] = {"draft": [], "full": []}
    for i in range(repeats + 1):  # round 0 warms up
        for name, fn in (("draft", draft), ("full", full)) if i % 2 else (("full", full), ("draft", draft)):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            cache.crop(context)
            acache.crop(context)
            if i:
                times[name].append(t1 - t0)
    d, f = statistics.median(times["draft"]), statistics.median(times["full"])
    return {"c": d / f, "draft_s": d, "forward_s": f, "context": context, "repeats": repeats}


def predict(rows: list[dict], c: float, v: dict, etas=ETAS, k_max: int = 6) -> list[dict]:
    """For each eta: replayed tau, drafted per step, and tau / (v(D + 1) + D c)."""
    out = []
    for eta in etas:
        rp = replay(rows, eta, k_max)
        if rp["tau"] is None:
            continue
        out.append({"eta": eta, "K": k_max, "tau": rp["tau"], "drafted_per_step": rp["drafted"],
                    "steps": rp["steps"], "predicted_speedup": cost.predicted_speedup(rp["tau"], rp["drafted"], c, v)})
    return out


def needed_tau(target: float, drafted: float, c: float, v: dict) -> float:
    """The tau a step drafting `drafted` tokens at cost c needs for `target` x AR: target (v(D + 1) + D c)."""
    return target * (cost.v_of(v, drafted + 1) + drafted * c)


def bf16_copy(adapter: KangarooAdapter, model) -> KangarooAdapter:
    """The trained adapter in `model`'s dtype (as the drafter loads it: through half precision)."""
    a = KangarooAdapter(model, adapter.split)
    p = next(model.parameters())
    a.load_state_dict({k: v.half().to(p.dtype) for k, v in adapter.state_dict().items()})
    return a.eval()


@torch.inference_mode()
def greedy_labels(model, data: TeacherData, batch_rows: int = 4) -> TeacherData:
    """Relabel `data` in place with the full model's own top-1 at every position (fp32, whole windows, causal, so
    right padding does not matter): the record's labels are the answers it sampled, at T = 0.7 or 1 for two thirds
    of them, while alpha and the greedy replay need what a greedy verifier accepts."""
    data.top_ids = data.top_ids[..., :1].clone()
    data.top_logp = torch.zeros_like(data.top_ids, dtype=torch.float16)
    for b in range(0, data.tokens.shape[0], batch_rows):
        x = data.tokens[b:b + batch_rows]  # (B, T)
        data.top_ids[b:b + batch_rows, :, 0] = model(input_ids=x).logits.argmax(-1)  # (B, T)
    data.card = {**data.card, "labels": "the full model's fp32 top-1 (kangaroo.sweep.greedy_labels)"}
    return data


def sweep(model, fast_model, tok, data: TeacherData, val: TeacherData | None, layers: list[int], steps: int,
          v: dict, seed: int = 0, k_max: int = 6) -> list[dict]:
    """One short fit per exit layer on `data` (held out: `val`, or rows of `data` when None); alpha, replayed tau
    per eta, measured c (in fast_model's dtype), prediction. Each fit checkpoints and resumes (build/ckpt)."""
    from dvi_lite.methods.kangaroo.distill import TeacherFitConfig, fit_adapter
    from dvi_lite.models.loading import bf16_is_fast
    from dvi_lite.models.vocab import resolve_vocab

    table = []
    for k in layers:
        cfg = TeacherFitConfig(split=k, steps=steps, seed=seed, bf16=bf16_is_fast(next(model.parameters()).device))
        ckpt = BUILD_DIR / "ckpt" / f"kangaroo_sweep_k{k}_{fingerprint(model)}.pt"  # one per model and exit layer
        adapter, card = fit_adapter(model, tok, data, cfg, resume=True, ckpt=ckpt, val=val)
        fast = bf16_copy(adapter, fast_model)
        c = draft_cost(fast_model, fast, resolve_vocab(fast_model, tok, cfg.vocab))
        c_full = draft_cost(fast_model, fast, None, repeats=9)
        preds = predict(adapter.val_rows, c["c"], v, k_max=k_max)
        best = max(preds, key=lambda r: r["predicted_speedup"])
        table.append({"k": k, "alpha": card["val"]["alpha"], "alpha_init": card["init"]["alpha"],
                      "val_loss": card["val"]["loss"], "val_positions": card["val"]["positions"], "c": c["c"],
                      "c_full_head": c_full["c"], "draft_s": c["draft_s"], "forward_s": c["forward_s"],
                      "steps": steps, "tokens_seen": card["tokens_seen"], "train_wall_s": card["wall_time_s"],
                      "per_eta": preds, "best_eta": best["eta"], "predicted_speedup": best["predicted_speedup"]})
        print(json.dumps({kk: vv for kk, vv in table[-1].items() if kk != "per_eta"}), flush=True)
    return table


def bench_rows(bench: dict, target: float = 1.3) -> list[dict]:
    """The bench's kangaroo rows (one per eta) beside AR: tau, tok/s, speedup, c, predicted, measured/predicted,
    and the tau that target x AR would need at the measured c, v and drafted tokens per step."""
    rows = []
    v = bench["verify_cost"]
    for label, r in bench["methods"].items():
        if not label.startswith("kangaroo"):
            continue
        opts = dict(p.split("=", 1) for p in label.split(":")[1:])
        d = r.get("drafted_per_step")
        rows.append({"label": label, "eta": None if opts.get("threshold", "0.6").lower() == "none"
                     else float(opts.get("threshold", 0.6)), "K": int(opts.get("K", opts.get("k", 6))),
                     **{key: r.get(key) for key in ("tau", "alpha", "tokens_per_s", "speedup_vs_ar", "c",
                                                    "drafted_per_step", "predicted_speedup",
                                                    "measured_over_predicted", "same_tokens_as_ar")},
                     "ar_tokens_per_s": bench["methods"]["ar"]["tokens_per_s"],
                     f"tau_needed_for_{target}x": needed_tau(target, d, r["c"], v) if d and r.get("c") else None})
    return rows


def _shown(path: Path) -> str:
    """A path as a results file keeps it: relative to the repository when inside it (no machine paths)."""
    from dvi_lite.paths import ROOT

    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m dvi_lite.methods.kangaroo.sweep", *map(shlex.quote, args)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dvi_lite.methods.kangaroo.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=None, help="self-distillation set folder (default: the model's committed "
                    "token record, data/<model>/distill/)")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    ap.add_argument("--steps", type=int, default=600, help="optimiser steps per exit layer")
    ap.add_argument("--train-tokens", type=int, default=400_000, help="answer tokens of the set's train split read")
    ap.add_argument("--val-tokens", type=int, default=20_000, help="answer tokens of the set's held-out split read")
    ap.add_argument("--dtype", default="bfloat16", help="dtype c is measured in (the bench's)")
    ap.add_argument("--v-from", default="results/41_study_24x2_smollm2_bf16.json",
                    help="bench JSON with the measured v(n) (the study's)")
    ap.add_argument("--json", default="results/15_kangaroo_smollm2.json")
    ap.add_argument("--pick", default=None, help="write the chosen exit layer to this file")
    ap.add_argument("--bench", nargs="+", default=None, help="bench JSON file(s) (ar + kangaroo rows): add their "
                    "eta runs to --json instead of sweeping")
    args = ap.parse_args(argv)
    for name in ("steps", "train_tokens", "val_tokens"):
        require_positive(ap, args, name)
    check_outputs(ap, (args.json, "file", "--json"))  # before any work
    if args.bench:
        out = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
        runs = [{"bench": f, "settings": (b := json.loads(Path(f).read_text()))["settings"],
                 "verify_cost": b["verify_cost"], "bench_provenance": b["provenance"], "rows": bench_rows(b)}
                for f in args.bench]
        out["eta_runs"] = {"runs": runs, "provenance": provenance(_command(argv))}
        atomic_write_text(Path(args.json), json.dumps(out, indent=1) + "\n")
        for run in runs:
            for r in run["rows"]:
                print(json.dumps(r))
        return 0
    from dvi_lite.models.distill_reader import load_distill
    from dvi_lite.models.distill_record import record_dir
    from dvi_lite.models.loading import load_model

    def run() -> dict:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        model, tok = load_model(args.model, dtype="float32")
        fast_model, _ = load_model(args.model, dtype=args.dtype)
        folder = Path(args.data) if args.data else record_dir(model)
        layers = tuple(sorted(set(args.layers)))
        data = load_distill(model, folder, "train", layers=layers, max_tokens=args.train_tokens)
        val = load_distill(model, folder, "val", layers=layers, max_tokens=args.val_tokens)
        greedy_labels(model, val)
        v = json.loads(Path(args.v_from).read_text())["verify_cost"]
        table = sweep(model, fast_model, tok, data, val, list(layers), args.steps, v)
        pick = max(table, key=lambda r: r["predicted_speedup"])
        out = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
        out.update({"sweep": {"table": table, "chosen_k": pick["k"], "rule": "max predicted speedup (K=6, best eta)",
                              "v": v, "v_from": args.v_from, "data": _shown(folder),
                              "train": {k: data.card.get(k) for k in ("n_rows", "n_tokens", "labels")},
                              "val": {k: val.card.get(k) for k in ("n_rows", "n_tokens", "labels")},
                              "provenance": provenance(_command(argv))}})
        atomic_write_text(Path(args.json), json.dumps(out, indent=1) + "\n")
        if args.pick:
            atomic_write_text(Path(args.pick), f"{pick['k']}\n")
        return pick

    pick = run_or_usage_error(ap, run)
    print(f"chosen exit layer k = {pick['k']} (predicted {pick['predicted_speedup']:.3f}x at eta {pick['best_eta']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
