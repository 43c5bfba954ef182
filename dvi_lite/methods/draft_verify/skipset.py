"""Draft & Verify's skip set: which attention and MLP sub-layers the draft skips, checked and stored.

The draft is the target itself with a fixed set of sub-layers skipped (`core.runner.Skip`: skipping
sub-layers is a capability of the runner). This module holds what describes such a set:

* the skip mask z in {0, 1}^(2L) and its conversion to/from `Skip` (with input checks);
* baselines at a given skip ratio: `uniform_skip` (evenly spaced whole layers) and `random_skips`;
* the set on disk: the searched best set of each model (`skip_file`, `load_skip`, `resolve_skip`).

Mask layout (forward order): z[2i] = 1 skips layer i's attention, z[2i + 1] = 1 skips layer i's MLP.
(The authors' search code puts all attention bits first and all MLP bits after; interleaving keeps
the two sub-layers of one layer next to each other, which is easier to read and plot.)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from dvi_lite.core.runner import Skip
from dvi_lite.models.artifacts import artifacts_dir, fingerprint
from dvi_lite.paths import DATA_DIR

SKIP_FILE = DATA_DIR / "draft_verify" / "skip.json"  # the course model's searched set


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


# ----------------------------------------------------------------------------- the skip set on disk

def resolve_skip(model, skip) -> Skip:
    """Skip | {"attn": [...], "mlp": [...]} | 0/1 mask of length 2L | JSON path | None (the saved best)."""
    n = model.config.num_hidden_layers
    if skip is None or isinstance(skip, (str, Path)):
        return load_skip(model, skip)
    if isinstance(skip, dict):
        return check_skip(skip_from_dict(skip), n)
    if isinstance(skip, (list, tuple)):
        return mask_to_skip(check_mask(skip, n), n)
    return check_skip(skip, n)


def skip_file(model) -> Path:
    """The default skip-set file for this model: data/draft_verify/skip.json for the course model."""
    return artifacts_dir(model) / "draft_verify" / SKIP_FILE.name


def load_skip(model, path: str | Path | None = None) -> Skip:
    path = Path(path) if path is not None else skip_file(model)
    if not path.is_file():
        raise FileNotFoundError(f"no Draft & Verify skip set at {path}; search one with "
                                "`python -m dvi_lite draft-verify-search` (or pass skip=...)")
    d = json.loads(path.read_text())
    if d.get("fingerprint") not in (None, fingerprint(model)):
        raise ValueError(f"the skip set in {path} was searched for another model; search one for this model "
                         "with `python -m dvi_lite draft-verify-search --model ...` or pass skip=...")
    return check_skip(skip_from_dict(d["best_skip"]), model.config.num_hidden_layers)
