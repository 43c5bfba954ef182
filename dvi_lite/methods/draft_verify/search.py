"""Draft & Verify's two model-independent parts: the skipped-layer search and adaptive draft-exiting.

Draft & Verify (Zhang et al., ACL 2024) drafts with the target model itself while skipping a fixed set
of attention and MLP sub-layers, then verifies the draft with the full model in one pass. This module
holds what does not touch a model:

* the skip mask z in {0, 1}^(2L) and its conversion to/from `runner.Skip` (with input checks);
* baselines at a given skip ratio: `uniform_skip` (evenly spaced whole layers) and `random_skips`;
* `search_skip`: Bayesian optimisation (optuna TPE, or GP) of z, minimising an objective the caller
  measures (seconds per verified token on calibration prompts), under an optional skip-count
  constraint, with a trial budget and a wall-clock budget; `SearchResult` saves it as JSON;
* `AdaptiveThreshold`: the paper's feedback rule that moves the draft-exiting threshold gamma so the
  running acceptance rate tracks a target alpha.

Mask layout (forward order): z[2i] = 1 skips layer i's attention, z[2i + 1] = 1 skips layer i's MLP.
(The authors' search code puts all attention bits first and all MLP bits after; interleaving keeps
the two sub-layers of one layer next to each other, which is easier to read and plot.)
"""
from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from tqdm.auto import tqdm

from dvi_lite.core.runner import Skip

SAMPLERS = ("tpe", "gp")


# ----------------------------------------------------------------------------- masks and skip sets

def check_n_layers(n_layers) -> int:
    if not isinstance(n_layers, (int, np.integer)) or isinstance(n_layers, bool) or n_layers < 1:
        raise ValueError(f"n_layers must be an int >= 1, got {n_layers!r}")
    return int(n_layers)


def check_mask(z, n_layers: int) -> list[int]:
    """Validate a skip mask and return it as a list of 0/1 ints.

    Why so strict: a mask of the wrong length silently shifts every bit to another sub-layer, and a
    float like 0.7 (a relaxed BO coordinate) is ambiguous; both must fail loudly, not draft wrongly.
    """
    n_layers = check_n_layers(n_layers)
    try:
        bits = list(z)
    except TypeError:
        raise ValueError(f"skip mask must be a sequence of 0/1 of length 2*n_layers, got {z!r}") from None
    if len(bits) != 2 * n_layers:
        raise ValueError(f"skip mask must have length 2*n_layers = {2 * n_layers} "
                         f"(z[2i] = attention, z[2i+1] = MLP of layer i), got length {len(bits)}")
    out = []
    for j, b in enumerate(bits):
        if isinstance(b, (bool, np.bool_)) or (isinstance(b, (int, np.integer, float, np.floating)) and b in (0, 1)):
            out.append(int(b))
        else:
            raise ValueError(f"skip mask values must be 0 or 1, got {b!r} at position {j}")
    if all(out):
        raise ValueError("skip mask skips every sub-layer: nothing left to draft with")
    return out


def check_skip(skip, n_layers: int) -> Skip:
    """Validate a Skip (layer indices in [0, n_layers), not every sub-layer) and return it normalised.

    Why: an out-of-range index would be ignored silently by the runner's `i not in skip.attn` test,
    so a Skip meant for a deeper model would draft with the full model and look like a perfect draft.
    """
    n_layers = check_n_layers(n_layers)
    if not hasattr(skip, "attn") or not hasattr(skip, "mlp"):
        raise ValueError(f"skip must be a runner.Skip (attn, mlp sets of layer indices), got {skip!r}")
    sets = {}
    for kind in ("attn", "mlp"):
        idx = getattr(skip, kind)
        try:
            items = list(idx)
        except TypeError:
            raise ValueError(f"skip.{kind} must be a set of layer indices, got {idx!r}") from None
        for i in items:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise ValueError(f"skip.{kind} holds a non-integer layer index {i!r}")
            if not 0 <= i < n_layers:
                raise ValueError(f"skip.{kind} layer index {i} is out of range [0, {n_layers}) for a "
                                 f"{n_layers}-layer model")
        sets[kind] = frozenset(int(i) for i in items)
    if len(sets["attn"]) == n_layers and len(sets["mlp"]) == n_layers:
        raise ValueError("skip skips every attention and MLP sub-layer: nothing left to draft with")
    return Skip(attn=sets["attn"], mlp=sets["mlp"])


def mask_to_skip(z, n_layers: int) -> Skip:
    """z in {0,1}^(2L) -> Skip: z[2i] -> attention of layer i, z[2i+1] -> MLP of layer i."""
    bits = check_mask(z, n_layers)
    return Skip(attn=frozenset(i for i in range(n_layers) if bits[2 * i]),
                mlp=frozenset(i for i in range(n_layers) if bits[2 * i + 1]))


def skip_to_mask(skip, n_layers: int) -> list[int]:
    """Skip -> z in {0,1}^(2L), the inverse of `mask_to_skip`."""
    skip = check_skip(skip, n_layers)
    z = [0] * (2 * n_layers)
    for i in skip.attn:
        z[2 * i] = 1
    for i in skip.mlp:
        z[2 * i + 1] = 1
    return z


def n_skipped(skip: Skip) -> int:
    """Number of skipped sub-layers (the paper's skip ratio is this over 2L)."""
    return len(skip.attn) + len(skip.mlp)


def skip_to_dict(skip: Skip) -> dict:
    """JSON-able form: sorted index lists."""
    return {"attn": sorted(int(i) for i in skip.attn), "mlp": sorted(int(i) for i in skip.mlp)}


def skip_from_dict(d: dict) -> Skip:
    return Skip(attn=frozenset(int(i) for i in d["attn"]), mlp=frozenset(int(i) for i in d["mlp"]))


def candidate_sublayers(n_layers: int, keep_first_last: bool = True) -> list[int]:
    """Mask positions the search may set to 1.

    keep_first_last drops both sub-layers of layer 0 and layer L-1: the first layer turns token
    embeddings into the features every later layer reads and the last one writes what the LM head
    reads, so skipping them costs the most acceptance per sub-layer saved. The authors' published
    searched sets (skip_layers.json of their code release: LLaMA-2-13B/-chat, CodeLLaMA-13B) never
    skip the first layers nor the last layer (LLaMA-2-70B's set does skip its last attention), so
    this costs little optimum and saves trials.
    """
    n_layers = check_n_layers(n_layers)
    layers = range(1, n_layers - 1) if keep_first_last else range(n_layers)
    return [2 * i + k for i in layers for k in (0, 1)]


def ratio_to_count(ratio, n_layers: int) -> int:
    """Sub-layers to skip for a ratio of all 2L: round half up (not Python's round-half-even), so the
    same ratio gives the same count in `random_skips`, `SearchConfig.skip_ratio` and reports."""
    n_layers = check_n_layers(n_layers)
    if not isinstance(ratio, (int, float, np.floating)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio (fraction of the 2*n_layers sub-layers to skip) must be in [0, 1], got {ratio!r}")
    return int(math.floor(ratio * 2 * n_layers + 0.5))


def uniform_skip(n_layers: int, ratio: float, keep_first_last: bool = True) -> Skip:
    """Skip attention and MLP of k = round(ratio * L) evenly spaced whole layers (sub-layer ratio k/L).

    The no-search baseline: what a layer-dropping heuristic would pick. Layers are spread over the
    middle [1, L-2] (first and last kept, see `candidate_sublayers`) at the centres of k equal bins,
    so they are as far apart as possible. The achieved ratio is k/L, the nearest whole-layer ratio.
    """
    n_layers = check_n_layers(n_layers)
    ratio_to_count(ratio, n_layers)  # validates ratio
    k = int(math.floor(ratio * n_layers + 0.5))  # whole layers (2 sub-layers each), round half up
    lo, span = (1, n_layers - 2) if keep_first_last else (0, n_layers)
    if k > span:
        raise ValueError(f"ratio {ratio!r} needs {k} whole layers skipped but only {max(span, 0)} can be "
                         f"(n_layers={n_layers}, keep_first_last={keep_first_last})")
    if k == n_layers:
        raise ValueError(f"ratio {ratio!r} skips every layer: nothing left to draft with")
    layers = frozenset(lo + int((j + 0.5) * span / k) for j in range(k))
    return Skip(attn=layers, mlp=layers)


def random_skips(n_layers: int, ratio: float, n: int, seed: int = 0, keep_first_last: bool = True) -> list[Skip]:
    """n random Skips, each skipping exactly ratio_to_count(ratio) sub-layers among the candidates.

    The baseline for "does BO beat chance at the same skip ratio": same candidates and same count as
    `search_skip` with `SearchConfig(skip_ratio=ratio)`. Draws are independent (a repeat is possible
    when few masks exist). Seeded: same arguments, same list.
    """
    n_layers = check_n_layers(n_layers)
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n (number of random skip sets) must be an int >= 0, got {n!r}")
    m = _exact_count(ratio, n_layers, keep_first_last, "ratio")
    cand = np.array(candidate_sublayers(n_layers, keep_first_last))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        z = np.zeros(2 * n_layers, dtype=int)
        z[rng.choice(cand, size=m, replace=False)] = 1
        out.append(mask_to_skip(z.tolist(), n_layers))
    return out


def _exact_count(ratio, n_layers: int, keep_first_last: bool, name: str) -> int:
    m = ratio_to_count(ratio, n_layers)
    n_cand = len(candidate_sublayers(n_layers, keep_first_last))
    if m < 1:
        raise ValueError(f"{name} {ratio!r} skips round({ratio!r} * {2 * n_layers}) = 0 sub-layers; use a larger ratio")
    if m > n_cand or m == 2 * n_layers:
        raise ValueError(f"{name} {ratio!r} needs {m} sub-layers skipped but only {n_cand} of {2 * n_layers} can be "
                         f"(keep_first_last={keep_first_last}; at least one sub-layer must stay to draft with)")
    return m


# ----------------------------------------------------------------------------- search

@dataclass
class SearchConfig:
    """Budget and search space of `search_skip`. Both optuna samplers need nothing beyond the course's
    dependencies (GPSampler uses torch and scipy, which dvi_lite already requires)."""

    n_trials: int = 100  # objective evaluations at most (each one times the drafter on the calibration prompts)
    time_budget_s: float | None = None  # wall-clock budget: no new trial starts once it is spent (None = no limit)
    seed: int = 0  # seeds the sampler and the count repair: same seed + deterministic objective = same search
    skip_ratio: float | None = None  # skip exactly round(ratio * 2L) sub-layers (BO vs random at equal ratio); None = free count
    min_ratio: float = 0.0  # free count only: skip at least ceil(min_ratio * 2L) sub-layers
    max_ratio: float = 1.0  # free count only: skip at most floor(max_ratio * 2L) (and never all of them)
    keep_first_last: bool = True  # never skip layer 0 or layer L-1 (see candidate_sublayers)
    sampler: str = "tpe"  # "tpe" (TPESampler, ms per trial) or "gp" (GPSampler: fewer trials, ~0.3 s/trial of CPU)
    n_startup_trials: int = 10  # random proposals before the sampler's model is used (optuna's default for both)
    reuse_duplicates: bool = True  # a mask already measured is not re-timed: its first value is reused (False = re-measure)

    def __post_init__(self):
        if not isinstance(self.n_trials, int) or isinstance(self.n_trials, bool) or self.n_trials < 1:
            raise ValueError(f"n_trials must be an int >= 1, got {self.n_trials!r}")
        if self.time_budget_s is not None and not (isinstance(self.time_budget_s, (int, float)) and self.time_budget_s > 0):
            raise ValueError(f"time_budget_s must be > 0 seconds or None, got {self.time_budget_s!r}")
        if self.skip_ratio is not None and not (isinstance(self.skip_ratio, (int, float)) and 0.0 < self.skip_ratio < 1.0):
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
        return {"n_layers": self.n_layers, "best_value": fin(self.best_value), "best_skip": skip_to_dict(self.best_skip),
                "best_mask": self.best_mask, "n_skipped": n_skipped(self.best_skip), "stopped": self.stopped,
                "config": dict(self.config), "trials": [{**t, "value": fin(t["value"])} for t in self.trials]}

    @classmethod
    def from_dict(cls, d: dict) -> SearchResult:
        inf = lambda v: math.inf if v is None else float(v)  # noqa: E731
        return cls(n_layers=int(d["n_layers"]), best_skip=skip_from_dict(d["best_skip"]), best_value=inf(d["best_value"]),
                   trials=[{**t, "value": inf(t["value"])} for t in d["trials"]], config=dict(d.get("config", {})),
                   stopped=d.get("stopped", "n_trials"))

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path) -> SearchResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _make_sampler(cfg: SearchConfig) -> optuna.samplers.BaseSampler:
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

    Why repair rather than the alternatives. Measured on a synthetic 12-layer cost (per-sub-layer
    time saved vs acceptance lost, K = 4 drafts), exact count m of the 20 searchable sub-layers,
    mean best value of 5 seeds after 150 trials (lower is better; m = 8: optimum 0.805):
      * penalty for a wrong count (inf, or optuna's trial.set_constraint): most proposals are
        infeasible (C(20, 8) / 2^20 = 12 % at random; ~2.4 proposals per feasible one even after
        TPE learns) and TPE models per-bit marginals, not the count: 0.837 (inf) / 0.844
        (constraint) after 150 *feasible* evaluations;
      * a float score per sub-layer, skip the top m: always feasible, but the value depends on the
        ranks of all scores jointly, which TPE's per-dimension estimators model badly: 0.855,
        barely better than random masks (0.868);
      * repair (this): every trial is feasible and the sampler sees exactly the mask that was
        measured, so "bit j is on in good masks" is learnt directly: 0.816; m = 4: 0.867 vs random
        0.905 (optimum 0.863); m = 12: 0.771 vs random 0.823 (optimum 0.769). With sampler="gp"
        the m = 8 optimum was reached within 60 trials (2 seeds) at ~0.3 s of sampler time per
        trial, which is small next to timing a drafter on calibration prompts.
    With the default free count (min_ratio=0, max_ratio=1) the repair only fires on the all-skip mask
    (possible with keep_first_last=False): this is the paper's plain z in {0,1}^(2L) search.

    Stops after cfg.n_trials trials or, if cfg.time_budget_s is set, before the first trial that
    would start after the budget (so the last trial can overrun it by one objective call).
    Reproducible: the same seed and a deterministic objective give the same trials (timings are not
    deterministic, so with the real objective only the first n_startup_trials proposals repeat).
    `initial` Skips are measured first (a warm start, e.g. `uniform_skip`), counted in n_trials.
    """
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
                params = {name: int(b) for name, b in zip(names, bits)}
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


# ----------------------------------------------------------------------------- adaptive draft-exiting

class AdaptiveThreshold:
    """Draft & Verify's adaptive draft-exiting: stop drafting when the draft's top probability < gamma,
    and move gamma after each verification so the running acceptance rate AR tracks target_alpha.

    Update after verification step e, with AR_e = accepted / drafted_tested:
        AR      <- beta1 * AR + (1 - beta1) * AR_e
        gamma~  =  gamma + eps  if AR < target_alpha  else  gamma - eps
        gamma   <- beta2 * gamma + (1 - beta2) * gamma~          (then clamped to [0, 1])
    A higher gamma exits earlier, so drafts are shorter and more of them are accepted: AR rises with
    gamma, which is what makes this negative feedback converge (AR too low -> raise gamma). The rule
    uses only the sign of AR - alpha, so with noisy per-step rates it settles where AR is below alpha
    half of the time: AR's median, not its mean, tracks alpha (tests/test_skip_search.py simulates it).

    Defaults, from the authors' code release (decoding.py, `auto_parameters=[1, 0.5, 0.9, 1e-2, 0.9]`
    = update every verification, beta1, alpha, eps, beta2; initial threshold `th_stop_draft=0.8` for
    exact greedy decoding, 0.5 in their sampling variant; running rate starts at 0): beta1 = 0.5,
    target_alpha = 0.9, eps = 0.01, beta2 = 0.9, gamma0 = 0.8, ar0 = 0. The paper writes the test as
    AR <= alpha; the code (and this class) uses AR < alpha, a difference only at exact equality.
    The code also holds gamma (gamma~ = gamma) when AR >= alpha but the draft already ran to its
    maximum length: the threshold did not end that draft, so lowering it would only drift gamma
    down without lengthening drafts. Pass reached_max=True to `update` for that rule (it only
    suppresses decreases, so it biases AR somewhat above alpha).
    """

    def __init__(self, target_alpha: float = 0.9, beta1: float = 0.5, beta2: float = 0.9, eps: float = 0.01,
                 gamma0: float = 0.8, ar0: float = 0.0):
        if not isinstance(target_alpha, (int, float)) or isinstance(target_alpha, bool) or not 0.0 < target_alpha < 1.0:
            raise ValueError(f"target alpha (target acceptance rate) must be in (0, 1), got {target_alpha!r}")
        for name, v in (("beta1", beta1), ("beta2", beta2)):
            if not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise ValueError(f"{name} (EMA decay) must be in [0, 1), got {v!r}")
        if not isinstance(eps, (int, float)) or not 0.0 < eps <= 1.0:
            raise ValueError(f"eps (threshold step) must be in (0, 1], got {eps!r}")
        for name, v in (("gamma0", gamma0), ("ar0", ar0)):
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        self.target_alpha, self.beta1, self.beta2, self.eps = float(target_alpha), float(beta1), float(beta2), float(eps)
        self.gamma0, self.ar0 = float(gamma0), float(ar0)
        self.reset()

    def reset(self) -> None:
        """Back to gamma0 / ar0 with empty traces (the authors' code restarts per generate call)."""
        self.gamma = self.gamma0
        self.ar = self.ar0
        self.trace_ar: list[float] = []
        self.trace_gamma: list[float] = []

    def should_stop(self, prob: float) -> bool:
        """Stop drafting: the draft's probability of its own token is below the threshold."""
        return float(prob) < self.gamma

    def update(self, accepted: int, drafted_tested: int, reached_max: bool = False) -> float:
        """Feed one verification (accepted of drafted_tested draft tokens); returns the new gamma.

        drafted_tested == 0 (nothing was drafted, so nothing verified) carries no acceptance
        information: the state is left unchanged and nothing is traced.
        """
        for name, v in (("accepted", accepted), ("drafted_tested", drafted_tested)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if accepted > drafted_tested:
            raise ValueError(f"accepted ({accepted}) cannot exceed drafted_tested ({drafted_tested})")
        if drafted_tested == 0:
            return self.gamma
        ar_e = accepted / drafted_tested
        self.ar = self.beta1 * self.ar + (1.0 - self.beta1) * ar_e
        if self.ar < self.target_alpha:
            target = self.gamma + self.eps
        else:
            target = self.gamma if reached_max else self.gamma - self.eps
        self.gamma = min(1.0, max(0.0, self.beta2 * self.gamma + (1.0 - self.beta2) * target))
        self.trace_ar.append(self.ar)
        self.trace_gamma.append(self.gamma)
        return self.gamma

    def state_dict(self) -> dict:
        return {"gamma": self.gamma, "ar": self.ar, "trace_ar": list(self.trace_ar), "trace_gamma": list(self.trace_gamma)}
