"""Exercises for the notebooks: a stub to fill in, a check that tests any implementation, a solution.

    from dvi_lite.course.exercises import checks, stubs   # stubs.<name>: the task, in its docstring
    checks.check_expected_tokens(my_expected_tokens)       # "ok: ..." or an AssertionError saying what differs

`stubs` states each task and raises NotImplementedError; `checks.check_<name>(fn)` compares fn with the
package's own code on seeded cases; `solutions` holds worked answers with the same names and signatures.
EXERCISES lists them per chapter (the notebooks' two-digit prefix: 06 prompt lookup, 07 EAGLE, 08 the study):
{chapter: [(name, one-line task)]}.
"""
from __future__ import annotations

from dvi_lite.paths import FILL_EXERCISES_ENV as FILL_ENV  # "1": a learner-sized run fills in the worked solutions

EXERCISES: dict[str, list[tuple[str, str]]] = {
    "00": [("break_even_alpha", "the α at which drafting K tokens per step breaks even, from c and the v(n) table"),
           ("roofline_time", "the least time of one forward, streaming the weights or doing the arithmetic")],
    "01": [("expected_tokens", "derive τ(K) = (1 − α^{K+1}) / (1 − α), the mean tokens per target forward"),
           ("acceptance_from_tv", "α as 1 − TV(p, q), shown equal to Σ min(p, q) and to a simulated rate"),
           ("verify_sampling_chain", "lossless speculative sampling of a K-token chain (accept, residual, bonus)"),
           ("broken_threshold_verify", "accept iff p(x) >= threshold, and watch the χ² test reject it"),
           ("soft_ce", "the distillation loss of every trained draft: cross-entropy against the target's top-k")],
    "02": [("drafted_length", "tokens drafted under Kangaroo's second early exit (threshold η, cap K_max)"),
           ("trim_targets", "the target's top-k mapped into the trimmed draft head, off-map tokens masked")],
    "03": [("adaptive_gamma_step", "one update of Draft & Verify's adaptive draft-exit threshold γ"),
           ("skip_cost", "the draft cost c of a forward that skips sub-layers: what skipping cannot save")],
    "04": [("tree_attention_mask", "the tree-attention mask from a parent list: cache, self and ancestors"),
           ("head_targets", "what Medusa head i is trained on at position t: the target's top-k at t + 1 + i")],
    "05": [("kl_weight", "DVI's KL weight λ_t = max(floor, exp(−t/T))"),
           ("floor_step", "the first step at which λ_t reaches its floor, in closed form"),
           ("reinforce_loss", "DVI's policy-gradient term on the accept bit, -(r − b) log π(token)")],
    "06": [("prompt_lookup", "the prompt-lookup proposer: copy what followed the latest earlier n-gram match"),
           ("lookup_tau", "greedy prompt lookup's τ on a known answer, without running the model")],
    "07": [("ttt_mask", "the attention pattern of EAGLE-3's training-time test at unrolled step s"),
           ("ttt_step_loss", "the training-time-test loss: each step's shifted soft CE, weighted decay^s")],
    "08": [("paired_speedup", "the study's headline: the median over prompts of per-prompt speed ratios to AR")],
}


def names() -> list[str]:
    """Every exercise name, in chapter order."""
    return [name for chapter in sorted(EXERCISES) for name, _ in EXERCISES[chapter]]



class ExerciseToDo(NotImplementedError):
    """An exercise cell still checks the stub: the message says what to write and where."""


def label(name: str) -> str:
    """"Exercise 05.1" for `kl_weight`: the heading the notebook gives it."""
    for chapter, items in EXERCISES.items():
        for i, (n, _) in enumerate(items, 1):
            if n == name:
                return f"Exercise {chapter}.{i}"
    raise ValueError(f"no exercise is called {name!r}; the exercises: {', '.join(names())}")


def yours(fn):
    """The function an exercise cell checks: yours, once you have written it and put its name in the cell.

    While the cell still holds the stub (`stubs.<name>`), a learner's Run All stops here with `ExerciseToDo`,
    saying what to write; a smoke run (CI) and a full run (`make reproduce`) check the worked solution instead,
    so every exercise and its check still run on every build, and the committed outputs show that check.
    """
    import inspect
    import os

    from dvi_lite.course.exercises import solutions, stubs
    from dvi_lite.course.modes import current_mode

    name = getattr(fn, "__name__", "")
    if fn is not getattr(stubs, name, None):
        return fn
    mode = current_mode() or "learner"
    if mode == "learner" and os.environ.get(FILL_ENV) != "1":
        raise ExerciseToDo(
            f"{label(name)} is yours to write: define a function with the stub's signature, "
            f"{name}{inspect.signature(fn)}, as help(stubs.{name}) describes; put its name in place of "
            f"`stubs.{name}` in this cell and run the cell again (a worked answer is in "
            f"dvi_lite/course/exercises/solutions.py). The cells above this one have all run.") from None
    print(f"[{mode} run: checking the worked solution, solutions.{name}]")
    return getattr(solutions, name)
