"""The method registry: one explicit table of name -> drafter factory + the options it takes.

Why a table and not decorators: importing a method must not change what exists (no registration by
side effect), listing the methods must not import torch-heavy modules, and every method declares its
options the same way so that they are validated in one place, with an error that names the option
and what is allowed. Factories are "module:function" strings, imported on first use.

The draft length has one name everywhere: `K`, draft tokens per step, as in the course's notation (k is the exit
layer there); the old name `k` fails with that message (core.checks.RENAMED).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from dvi_lite.core.checks import RENAMED, check_choice, check_int, check_prob, check_real, reject_renamed

KINDS = ("any", "int", "prob", "real", "bool", "choice")


@dataclass(frozen=True)
class Option:
    """One option of a method: its default, what it means, and what values are allowed."""
    name: str
    default: Any
    help: str
    kind: str = "any"  # how `check` validates: one of KINDS ("any" = the factory validates it)
    low: float | None = None  # int / real: smallest allowed value
    high: float | None = None  # int / real: largest allowed value
    choices: tuple = ()  # choice: the allowed values
    optional: bool = False  # None is allowed too (it then means what `help` says)

    def check(self, method: str, value: Any) -> Any:
        if value is None and (self.optional or self.default is None):
            return None
        name = f"{method} option {self.name!r}"
        if self.kind == "int":
            return check_int(name, value, self.low, self.high, what=self.help)
        if self.kind == "prob":
            return check_prob(name, value, what=self.help)
        if self.kind == "real":
            return check_real(name, value, self.low, self.high, what=self.help)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{name} ({self.help}) must be True or False, got {value!r}")
            return value
        if self.kind == "choice":
            return check_choice(name, value, self.choices)
        return value


@dataclass(frozen=True)
class Method:
    """A decoding method: `engine` methods build a Drafter for the one loop; the others wrap HF generate."""
    name: str
    factory: str  # "module:function"; called as factory(model, tokenizer, **options)
    summary: str
    options: tuple[Option, ...] = ()
    engine: bool = True  # False: a transformers `generate` baseline (its factory returns an HFBaseline)
    paper: str = ""  # where the idea comes from

    def option(self, name: str) -> Option:
        return {o.name: o for o in self.options}[name]

    def resolve(self, **kwargs: Any) -> dict[str, Any]:
        """Defaults filled in, every value checked; an unknown option lists the allowed ones."""
        known = {o.name: o for o in self.options}
        reject_renamed({n: v for n, v in kwargs.items() if n in RENAMED and n not in known}, f"method {self.name!r}")
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            allowed = ", ".join(known) or "none"
            raise ValueError(f"method {self.name!r} has no option {unknown[0]!r}; its options: {allowed}")
        return {n: o.check(self.name, kwargs[n]) if n in kwargs else o.default for n, o in known.items()}

    def load(self) -> Callable[..., Any]:
        module, fn = self.factory.split(":")
        return getattr(importlib.import_module(module), fn)

    def build(self, model, tokenizer, **kwargs: Any) -> Any:
        return self.load()(model, tokenizer, **self.resolve(**kwargs))


# Options shared by several methods: declared once.
K = lambda default: Option("K", default, "draft tokens per step", "int", low=1)  # noqa: E731
# None: the model's sized K (defaults.json, written by `sps-sizing --apply`), else 4
SIZED_K = Option("K", None, "draft tokens per step", "int", low=1)
SPLIT = Option("split", None, "exit layer: the first `split` layers draft; None = the method's default", "int",
               low=1, optional=True)
BRANCH = Option("branch", 1, "candidates per draft step: 1 = a chain, more = top-branch tree leaves", "int", low=1)
THRESHOLD = lambda default: Option("threshold", default, "stop drafting after the first token whose top-1 "  # noqa: E731
                                   "probability is below it (eta); None = always draft K", "prob", optional=True)
VOCAB = Option("vocab", None, "trimmed draft head (FR-Spec): None = the full vocabulary; an int N = the N tokens "
               "most frequent on the corpus; or a saved map's file (verification keeps the full head)")
DRAFT_MODEL = Option("draft_model", None, "the draft model (object or folder); None = this model's committed draft")

_M = "dvi_lite.methods"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "dvi_lite.core.engine:Drafter", "plain autoregressive decoding: the empty drafter"),
    Method("hf", f"{_M}.hf:hf_generate", "transformers' own generate: the reference baseline", engine=False),
    Method("hf_assisted", f"{_M}.hf:hf_assisted", "transformers' assisted generation with the sps draft",
           (DRAFT_MODEL, SIZED_K), engine=False),
    Method("hf_pld", f"{_M}.hf:hf_prompt_lookup", "transformers' prompt lookup decoding",
           (K(6),), engine=False, paper="Saxena 2023"),
    Method("pld", f"{_M}.pld:make_drafter", "prompt lookup: copy what followed the last n-gram's earlier match",
           (K(6), Option("max_ngram", 3, "longest n-gram matched against the prompt and the text so far "
                         "(shorter ones are tried next)", "int", low=1)), paper="Saxena 2023"),
    Method("sps", f"{_M}.sps.drafter:make_drafter", "speculative sampling with a small draft model",
           (DRAFT_MODEL, SIZED_K), paper="Leviathan et al. 2023; Chen et al. 2023"),
    Method("early_exit", f"{_M}.early_exit:make_drafter", "the target's first layers + its own head draft",
           (SPLIT, K(6), THRESHOLD(None), BRANCH, VOCAB)),
    Method("kangaroo", f"{_M}.kangaroo.drafter:make_drafter", "early exit + a trained adapter (double early exit)",
           (SPLIT, K(6), THRESHOLD(0.6), BRANCH,
            Option("adapter", None, "a KangarooAdapter or its file; None = this model's committed adapter"),
            Option("vocab", None, "trimmed draft head (FR-Spec): None = the one the adapter was trained through "
                   "(its card says; the full vocabulary if none); 'full'; an int N = the N tokens most frequent on "
                   "the corpus; or a saved map's file (verification keeps the full head)")),
           paper="Liu et al. 2024"),
    Method("draft_verify", f"{_M}.draft_verify.drafter:make_drafter", "the target with skipped sub-layers drafts",
           (Option("skip", None, "a Skip, a dict or a file; None = this model's committed skip set"),
            K(8), Option("threshold", 0.8, "stop drafting after the first token whose top-1 probability is below "
                         "it (gamma; with adaptive, its start value; the authors' 0.8); None = always draft K "
                         "(adaptive: start at 0.8)", "prob", optional=True),
            Option("adaptive", True, "adapt gamma after every verification (the authors' rule)", "bool"),
            Option("target_alpha", 0.9, "the accepted / drafted rate adaptive gamma aims at", "prob"), VOCAB,
            Option("carry", True, "adaptive gamma continues across prompts from the last drafter with the same "
                   "settings (the authors' harness); False = start from threshold at every prompt", "bool")),
           paper="Zhang et al. 2024"),
    Method("medusa", f"{_M}.medusa.drafter:make_drafter", "extra decoding heads draft a tree, verified at once",
           (Option("heads", None, "MedusaHeads or their file; None = this model's committed heads"),
            Option("K", None, "draft tokens per step along a path (heads used); None = every head", "int",
                   low=1, optional=True),
            Option("branch", None, "candidates per head (top-branch tokens); None = the model's committed tree's, "
                   "else 4", "int", low=1, optional=True),
            Option("tree", None, "cartesian, pruned, sparse, or a list of rank paths; None = the model's committed "
                   "tree (its defaults.json, chosen by medusa-sizing), else pruned"),
            Option("threshold", None, "pruned trees: drop nodes below this confidence", "prob", optional=True),
            Option("max_nodes", None, "pruned / sparse trees: the node budget (None = 16)", "int", low=1,
                   optional=True),
            Option("prune", "confidence", "how pruned trees score nodes", "choice",
                   choices=("confidence", "path", "entropy")),
            Option("accuracies", None, "sparse trees: per-head, per-rank accuracies (None = the heads' own)"),
            Option("attention", "sdpa", "how the target attends the tree: sdpa (dense mask, the reference) or "
                   "triton (the tree kernel: CUDA, or Triton's interpreter on CPU)", "choice",
                   choices=("sdpa", "triton")),
            Option("acceptance", "exact", "exact (lossless) or typical (Medusa's LOSSY rule when sampling)",
                   "choice", choices=("exact", "typical")),
            Option("vocab", None, "trimmed draft head (FR-Spec): None = the committed heads' map in the model's "
                   "defaults.json (the full vocabulary if none); 'full'; an int N = the N tokens most frequent on the "
                   "corpus; or a saved map's file (verification keeps the full head)"),
            Option("typical_epsilon", 0.09, "typical acceptance: p(x) > min(epsilon, delta exp(-H(p)))", "prob"),
            Option("typical_delta", 0.3, "typical acceptance: the entropy-scaled bar's factor delta", "real", low=0)),
           paper="Cai et al. 2024"),
    Method("eagle", f"{_M}.eagle.drafter:make_drafter", "a one-layer head drafts from the target's fused features",
           (Option("head", None, "an EagleHead or its file; None = this model's committed head"),
            K(5),
            Option("tree", "dynamic", "chain (K tokens in a row), dynamic (EAGLE-2's tree, K deep) or static "
                   "(EAGLE-1's fixed tree: `paths`, shaped by eagle-static-tree)", "choice",
                   choices=("chain", "dynamic", "static")),
            Option("branch", None, "dynamic tree: nodes expanded per depth and children per node (None = 4)", "int",
                   low=1, optional=True),
            Option("max_nodes", None, "dynamic tree: candidates kept after reranking and verified (None = 24)",
                   "int", low=1, optional=True),
            Option("lookup", False, "dynamic tree: merge a prompt-lookup copy (up to K tokens) into the tree",
                   "bool"),
            Option("paths", None, "static tree: its rank paths, e.g. [(0,), (1,), (0, 0)] (None = this model's, "
                   "measured by eagle-static-tree)")),
           paper="Li et al. 2024 (EAGLE-2); Li et al. 2025 (EAGLE-3)"),
    Method("dvi", f"{_M}.dvi.drafter:make_drafter", "early exit + a head learned online from the verifier",
           (SPLIT, Option("state", None, "a DVIPolicy or a folder with policy.pt; None = this model's committed head"),
            K(6), THRESHOLD(0.6),
            Option("load_verifier", False, "also load the slow verifier LoRA (lora_D) into the model", "bool"),
            Option("vocab", None, "trimmed draft head (FR-Spec): None = the one the head was trained on (its "
                   "file says; the full vocabulary if none); 'full'; an int N = the N tokens most frequent on the "
                   "corpus; or a saved map's file (verification keeps the full head)"),
            Option("merged", True, "draft through a copy of the policy with lora_S merged, in the model's dtype "
                   "(False: through the float32 policy itself, as it trains)", "bool")),
           paper="Bhansali & Heck 2025"),
)}


def get_method(name: Any) -> Method:
    """The registered method `name`, or an error listing every name."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    return METHODS[name]


def default_of(method: str, option: str) -> Any:
    return get_method(method).option(option).default

