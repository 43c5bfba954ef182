"""Bayesian optimisation over Draft & Verify's skip mask: the model-independent search engine.

`search_skip` minimises any objective skip -> float over the mask z in {0,1}^(2L) (optuna TPE or GP), with a
skip-count constraint, a trial budget and a wall-clock budget; `SearchConfig` is its budget and search space,
`SearchResult` its trial log (JSON round trip). Two searches use it: the paper's timed objective on the course
model (`search`) and the low-noise SmolLM2 recipe (`recipe`). It lives in its own module so that both import
it from here and neither imports the other (the recipe and the timed search were an import circle when it
lived in `search`, which also forwards to the recipe). optuna is imported only when a search runs; tests run
it on synthetic objectives.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from dvi_lite.core.runner import Skip
from dvi_lite.methods.draft_verify.skipset import (
    _exact_count,
    candidate_sublayers,
    check_n_layers,
    check_skip,
    mask_to_skip,
    n_skipped,
    skip_from_dict,
    skip_to_dict,
    skip_to_mask,
)
from dvi_lite.paths import atomic_write_text

if TYPE_CHECKING:
    import optuna

SAMPLERS = ("tpe", "gp")


@dataclass
class SearchConfig:
    """Budget and search space of `search_skip`. Both optuna samplers need nothing beyond the course's
    dependencies (GPSampler uses torch and scipy, which dvi_lite already requires)."""

    n_trials: int = 100  # objective evaluations at most (each one times the drafter on the calibration prompts)
    time_budget_s: float | None = None  # wall-clock budget: no new trial starts once it is spent (None = no limit)
    seed: int = 0  # seeds the sampler and the count repair: same seed + deterministic objective = same search
    skip_ratio: float | None = None  # skip exactly round(ratio * 2L) sub-layers (BO vs random at equal ratio);
    # None = a free count in [min_ratio, max_ratio]
    min_ratio: float = 0.0  # free count only: skip at least ceil(min_ratio * 2L) sub-layers
    max_ratio: float = 1.0  # free count only: skip at most floor(max_ratio * 2L) (and never all of them)
    keep_first_last: bool = True  # never skip layer 0 or layer L-1 (see candidate_sublayers)
    sampler: str = "tpe"  # "tpe" (TPESampler: cheap per trial) or "gp" (GPSampler: fewer trials, more CPU per trial)
    n_startup_trials: int = 10  # random proposals before the sampler's model is used (optuna's default for both)
    reuse_duplicates: bool = True  # a mask already measured is not re-timed: its first value is reused

    def __post_init__(self):
        if not isinstance(self.n_trials, int) or isinstance(self.n_trials, bool) or self.n_trials < 1:
            raise ValueError(f"n_trials must be an int >= 1, got {self.n_trials!r}")
        budget, ratio = self.time_budget_s, self.skip_ratio
        if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
            raise ValueError(f"time_budget_s must be > 0 seconds or None, got {self.time_budget_s!r}")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 < ratio < 1.0):
            raise ValueError(f"skip_ratio must be in (0, 1) or None, got {self.skip_ratio!r}")
        for name in ("min_ratio", "max_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.min_ratio > self.max_ratio:
            raise ValueError(f"min_ratio ({self.min_ratio}) must be <= max_ratio ({self.max_ratio})")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if not isinstance(self.n_startup_trials, int) or self.n_startup_trials < 0:
            raise ValueError(f"n_startup_trials must be an int >= 0, got {self.n_startup_trials!r}")

    def count_bounds(self, n_layers: int) -> tuple[int, int]:
        """[lo, hi] on the number of skipped sub-layers for this model (lo == hi with skip_ratio)."""
        n_layers = check_n_layers(n_layers)
        n_cand = len(candidate_sublayers(n_layers, self.keep_first_last))
        if n_cand == 0:
            raise ValueError(f"keep_first_last leaves no sub-layer to search in a {n_layers}-layer model")
        if self.skip_ratio is not None:
            m = _exact_count(self.skip_ratio, n_layers, self.keep_first_last, "skip_ratio")
            return m, m
        two_l = 2 * n_layers
        lo = math.ceil(self.min_ratio * two_l - 1e-9)
        hi = min(math.floor(self.max_ratio * two_l + 1e-9), n_cand, two_l - 1)
        if lo > hi:
            raise ValueError(f"min_ratio/max_ratio allow no skip count in [{lo}, {hi}] for n_layers={n_layers} "
                             f"({n_cand} searchable sub-layers)")
        return lo, hi


@dataclass
class SearchResult:
    n_layers: int
    best_skip: Skip
    best_value: float  # objective at best_skip (seconds per verified token when the lead's objective is used)
    trials: list[dict] = field(default_factory=list)  # number, value, attn, mlp, n_skipped, elapsed_s, cached
    config: dict = field(default_factory=dict)  # asdict(SearchConfig) of the run
    stopped: str = "n_trials"  # "n_trials" or "time_budget"

    @property
    def best_mask(self) -> list[int]:
        return skip_to_mask(self.best_skip, self.n_layers)

    def best_so_far(self) -> list[float]:
        """Running minimum of the objective over trials (the usual BO convergence curve)."""
        out, best = [], math.inf
        for t in self.trials:
            best = min(best, t["value"])
            out.append(best)
        return out

    def to_dict(self) -> dict:
        """JSON-able: non-finite values (invalid masks) become null, since JSON has no Infinity."""
        fin = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {"n_layers": self.n_layers, "best_value": fin(self.best_value),
                "best_skip": skip_to_dict(self.best_skip), "best_mask": self.best_mask,
                "n_skipped": n_skipped(self.best_skip), "stopped": self.stopped, "config": dict(self.config),
                "trials": [{**t, "value": fin(t["value"])} for t in self.trials]}

    @classmethod
    def from_dict(cls, d: dict) -> SearchResult:
        inf = lambda v: math.inf if v is None else float(v)  # noqa: E731
        return cls(n_layers=int(d["n_layers"]), best_skip=skip_from_dict(d["best_skip"]),
                   best_value=inf(d["best_value"]), trials=[{**t, "value": inf(t["value"])} for t in d["trials"]],
                   config=dict(d.get("config", {})), stopped=d.get("stopped", "n_trials"))

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path) -> SearchResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _make_sampler(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
    import optuna

    if cfg.sampler == "gp":
        return optuna.samplers.GPSampler(seed=cfg.seed, n_startup_trials=cfg.n_startup_trials)
    return optuna.samplers.TPESampler(seed=cfg.seed, n_startup_trials=cfg.n_startup_trials)


def _repair(bits: np.ndarray, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """Bring the number of ones into [lo, hi] by flipping uniformly chosen bits (fewest flips)."""
    bits = bits.copy()
    on, off = np.flatnonzero(bits == 1), np.flatnonzero(bits == 0)
    if len(on) > hi:
        bits[rng.choice(on, size=len(on) - hi, replace=False)] = 0
    elif len(on) < lo:
        bits[rng.choice(off, size=lo - len(on), replace=False)] = 1
    return bits


def search_skip(objective: Callable[[Skip], float], n_layers: int, cfg: SearchConfig | None = None,
                progress: bool = True, initial: Sequence[Skip] = ()) -> SearchResult:
    """Find the Skip minimising objective(skip) (e.g. seconds per verified token on calibration prompts).

    Each trial: the sampler proposes one 0/1 bit per searchable sub-layer; if the number of ones is
    outside the allowed [lo, hi] (an exact count with cfg.skip_ratio), uniformly chosen bits are
    flipped until it is inside ("repair"); the objective is measured on the repaired mask, and the
    sampler is told that *repaired* mask with its value (the proposal itself is recorded as FAIL,
    which optuna's samplers ignore). A non-finite objective value (inf, NaN) marks an invalid mask: inf.
    (The authors' code runs a GP (bayes_opt) on a relaxation x in [0, 1]^(2L), skipping where x > 0.5;
    here the bits are categorical, which both optuna samplers model natively.)

    Why repair: every trial is feasible and the sampler learns from exactly the mask that was measured
    ("bit j is on in good masks"). A penalty for a wrong count wastes most proposals on infeasible masks
    (TPE models per-bit marginals, not the count), and a float score per sub-layer with "skip the top m"
    makes the value depend on the ranks of all scores jointly, which per-dimension estimators model badly.
    With the default free count (min_ratio=0, max_ratio=1) the repair only fires on the all-skip mask
    (possible with keep_first_last=False): this is the paper's plain z in {0,1}^(2L) search.

    Stops after cfg.n_trials trials or, if cfg.time_budget_s is set, before the first trial that
    would start after the budget (so the last trial can overrun it by one objective call).
    Reproducible: the same seed and a deterministic objective give the same trials (timings are not
    deterministic, so with the real objective only the first n_startup_trials proposals repeat).
    `initial` Skips are measured first (a warm start, e.g. `uniform_skip`), counted in n_trials.
    """
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    cfg = SearchConfig() if cfg is None else cfg
    n_layers = check_n_layers(n_layers)
    lo, hi = cfg.count_bounds(n_layers)
    cand = candidate_sublayers(n_layers, cfg.keep_first_last)
    names = [f"z{j}" for j in cand]  # z{position in the full mask}: z{2i} attention, z{2i+1} MLP of layer i
    dists = {name: CategoricalDistribution((0, 1)) for name in names}
    fixed = [j for j in range(2 * n_layers) if j not in set(cand)]  # positions that must stay 0
    warm = []
    for s in initial:
        z = np.array(skip_to_mask(check_skip(s, n_layers), n_layers))
        if z[fixed].any() or not lo <= int(z.sum()) <= hi:
            raise ValueError(f"initial skip {skip_to_dict(s)} is outside the search space (keep_first_last="
                             f"{cfg.keep_first_last}, skipped count must be in [{lo}, {hi}])")
        warm.append(z[cand])

    rng = np.random.default_rng(cfg.seed)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials: list[dict] = []
    seen: dict[tuple, float] = {}
    stopped = "n_trials"
    bar = tqdm(total=cfg.n_trials, desc="skip search", disable=not progress, leave=False)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # GPSampler warns when it clips inf values (invalid masks) to the worst finite one: expected here
            warnings.filterwarnings("ignore", message="Clip non-finite values")
            study = optuna.create_study(direction="minimize", sampler=_make_sampler(cfg))
            for k in range(cfg.n_trials):
                if cfg.time_budget_s is not None and time.perf_counter() - t0 >= cfg.time_budget_s:
                    stopped = "time_budget"
                    break
                if k < len(warm):
                    proposal, bits = None, warm[k]
                else:
                    proposal = study.ask(dists)
                    proposed = np.array([proposal.params[name] for name in names])
                    bits = _repair(proposed, lo, hi, rng)
                z = np.zeros(2 * n_layers, dtype=int)
                z[cand] = bits
                skip = mask_to_skip(z.tolist(), n_layers)
                key = tuple(z.tolist())
                cached = cfg.reuse_duplicates and key in seen
                if cached:
                    value = seen[key]
                else:
                    value = float(objective(skip))
                    value = value if math.isfinite(value) else math.inf  # NaN or -inf: invalid, never "best"
                    seen.setdefault(key, value)
                params = {name: int(b) for name, b in zip(names, bits, strict=True)}
                if proposal is not None and np.array_equal(bits, proposed):
                    study.tell(proposal, value)
                else:
                    if proposal is not None:
                        study.tell(proposal, state=TrialState.FAIL)
                    study.add_trial(create_trial(params=params, distributions=dists, value=value))
                trials.append({"number": k, "value": value, **skip_to_dict(skip), "n_skipped": n_skipped(skip),
                               "elapsed_s": time.perf_counter() - t0, "cached": bool(cached)})
                bar.update(1)
                best = min(t["value"] for t in trials)
                bar.set_postfix(best=f"{best:.4g}", skipped=trials[-1]["n_skipped"])
    finally:
        bar.close()
        optuna.logging.set_verbosity(verbosity)
    if not trials:
        raise RuntimeError("search_skip ran no trial: the time budget was spent before the first one")
    best = min(trials, key=lambda t: t["value"])  # first of equal minima: stable
    return SearchResult(n_layers=n_layers, best_skip=skip_from_dict(best), best_value=best["value"], trials=trials,
                        config=asdict(cfg), stopped=stopped)
