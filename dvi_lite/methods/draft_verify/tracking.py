"""Does Draft & Verify's adaptive threshold track its target? gamma and acceptance over a long stream.

`python -m dvi_lite draft-verify-gamma --questions 40 --targets 0.5,0.7,0.9 --json results/41_draft_verify_gamma.json`

The rule moves gamma by at most (1 - beta2) * eps = 0.001 per verification (adaptive.py), so over a few hundred
steps it cannot leave its start value: a short run shows three targets giving the same acceptance, which says
nothing about tracking. Here one threshold per target is carried across a stream of held-out questions (as the
authors' harness carries it from prompt to prompt), long enough for gamma to move, and each target's acceptance
(accepted / drafted, the rule's own matchness) is recorded step by step with gamma.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, check_outputs, command_line, prob_list, prog, run_or_usage_error
from dvi_lite.core.engine import decode
from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.draft_verify.drafter import DraftVerifyDrafter
from dvi_lite.methods.draft_verify.skipset import Skip, skip_to_dict
from dvi_lite.paths import atomic_write_text


@torch.no_grad()
def stream(model, tok, prompts: list, skip: Skip, target_alpha: float, max_new_tokens: int, K: int = 8,
           gamma0: float = 0.8, progress: bool = True) -> dict:
    """Greedy D&V over every prompt in turn with one carried threshold: per step drafted and accepted, per update
    gamma and the running AR, per prompt the step it began at."""
    ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=gamma0, carry=True)
    runner = Runner.for_model(model)
    drafted, accepted, starts = [], [], []
    for p in tqdm(prompts, desc=f"gamma stream, target {target_alpha}", disable=not progress):
        drafter = DraftVerifyDrafter(runner, skip, K, gamma0, ctl)
        starts.append(len(drafted))
        _, stats = decode(runner, drafter, prompt_ids(tok, p), max_new_tokens, Sampler(), make_generator(0),
                          eos_token_id=tok.eos_token_id)
        drafted += [s.drafted for s in stats.steps]
        accepted += [s.accepted for s in stats.steps]
    # gamma and AR are traced per update (a step that drafted nothing updates nothing): about one per step
    return {"target_alpha": target_alpha, "gamma0": gamma0, "K": K, "gamma": ctl.trace_gamma, "ar": ctl.trace_ar,
            "drafted": drafted, "accepted": accepted, "prompt_starts": starts, "steps": len(drafted)}


def windows(run: dict, size: int = 100) -> list[dict]:
    """Acceptance (accepted / drafted) and mean gamma per window of `size` steps: the figure's points."""
    out = []
    for s in range(0, len(run["drafted"]), size):
        d, a = sum(run["drafted"][s:s + size]), sum(run["accepted"][s:s + size])
        g = run["gamma"][s:s + size]
        out.append({"step": s + size // 2, "acceptance": a / d if d else None, "gamma": sum(g) / len(g) if g else None})
    return out


def summarise(run: dict, size: int = 100) -> dict:
    """In place: the run's windows and halves (acceptance in the first and second half of the stream, gamma's
    last and lowest value) replace the per-step lists, which would make the results file 150 kB."""
    n = len(run["drafted"])
    halves = [(run["accepted"][a:b], run["drafted"][a:b]) for a, b in ((0, n // 2), (n // 2, n))]
    run["windows"] = windows(run, size)
    run.update(acceptance_first_half=sum(halves[0][0]) / max(1, sum(halves[0][1])),
               acceptance_second_half=sum(halves[1][0]) / max(1, sum(halves[1][1])),
               gamma_last=run["gamma"][-1] if run["gamma"] else None,
               gamma_min=min(run["gamma"]) if run["gamma"] else None, window=size)
    for key in ("drafted", "accepted", "gamma", "ar"):
        del run[key]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("draft-verify-gamma"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--questions", type=int, default=40, help="held-out Spec-Bench questions in the stream")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--targets", type=prob_list, default=[0.5, 0.7, 0.9],
                    help="target acceptance rates, comma-separated (default 0.5,0.7,0.9)")
    ap.add_argument("--json", required=True)
    add_force(ap)
    args = ap.parse_args(argv)
    check_outputs(ap, (args.json, "file", "--json"), force=args.force)
    if args.questions < 1 or args.max_new_tokens < 1:
        ap.error(f"--questions and --max-new-tokens must be >= 1, got {args.questions} and {args.max_new_tokens}")
    targets = args.targets
    from dvi_lite.measure.provenance import provenance, results_json
    from dvi_lite.methods.draft_verify.skipset import resolve_skip
    from dvi_lite.models import specbench
    from dvi_lite.models.loading import load_model

    model, tok = run_or_usage_error(ap, load_model, args.model, dtype="bfloat16")
    skip = resolve_skip(model, None)  # the committed skip set
    records = specbench.spread(specbench.read_prompts(specbench.SPEC_BENCH_DEV), args.questions)
    prompts = [r["prompt"] for r in records]
    runs = [stream(model, tok, prompts, skip, t, args.max_new_tokens) for t in targets]
    for r in runs:
        summarise(r)
        last = r["windows"][-3:]
        print(f"target {r['target_alpha']}: {r['steps']} steps, gamma {r['gamma0']} -> {r['gamma'][-1]:.3f}, "
              f"acceptance over the last windows {[round(w['acceptance'] or 0, 3) for w in last]}")
    body = {"provenance": provenance(command_line("draft-verify-gamma", argv)), "skip": skip_to_dict(skip),
            "questions": [r["id"] for r in records], "max_new_tokens": args.max_new_tokens, "runs": runs}
    atomic_write_text(Path(args.json), results_json(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
