"""Draft & Verify (Zhang et al., ACL 2024): the model drafts for itself with some sub-layers skipped.

The draft is the same network with a set of attention and MLP sub-layers skipped (a mask
z in {0,1}^(2L), `runner.Skip`); no extra parameters. Drafting writes KV only into the layers whose
attention it runs; those entries come from draft hidden states, so before verification the engine
crops every layer back to the committed length and the full model verifies the whole draft in one
pass (engine.verify_step with no Proposal.hidden).

Drafting stops when the draft's top-1 probability falls below gamma; with `adaptive=True` gamma
follows the paper's rule (skip_search.AdaptiveThreshold) so the acceptance rate tracks a target.
Sampling uses the shared rejection sampler: q is the skipped model's (processed) distribution.

Which sub-layers to skip is found by Bayesian optimisation (`search`, optuna via skip_search)
minimising measured seconds per generated token on calibration prompts from the corpus' val split;
the best set is saved with its score in data/draft_verify/skip.json (`python -m dvi_lite.methods.draft_verify.drafter`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dvi_lite.course_model.corpus import make_prompts
from dvi_lite.paths import DATA_DIR
from dvi_lite.core.engine import DecodeState, Drafter, Outcome, Proposal
from dvi_lite.models.artifacts import artifacts_dir, fingerprint
from dvi_lite.core.generate import generate
from dvi_lite.core.runner import Runner
from dvi_lite.core.runner import Skip
from dvi_lite.methods.draft_verify.search import (AdaptiveThreshold, SearchConfig, SearchResult, check_mask, check_skip,
                                  mask_to_skip, n_skipped, search_skip, skip_from_dict, skip_to_dict)
from dvi_lite.course_model.train import TrainConfig, batch, encode_split

SKIP_FILE = DATA_DIR / "draft_verify" / "skip.json"


class DraftVerifyDrafter(Drafter):
    name = "draft_verify"

    def __init__(self, runner, skip: Skip, max_steps: int = 8, threshold: float | None = 0.6,
                 adaptive: AdaptiveThreshold | None = None):
        self.runner = runner
        self.skip = check_skip(skip, runner.n_layers)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0):
            raise ValueError(f"threshold (gamma) must be in (0, 1] or None, got {threshold!r}")
        self.max_steps = self.max_draft = max_steps
        self.threshold = threshold
        self.adaptive = adaptive

    @property
    def gamma(self) -> float | None:
        return self.adaptive.gamma if self.adaptive is not None else self.threshold

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> None:
        if self.adaptive is not None:
            self.adaptive.reset()  # per generation, as in the authors' code

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        r, cache = self.runner, state.cache
        past = state.committed
        cache.crop(past)  # drop draft KV of the last round from the layers drafting ran
        steps = max(1, min(self.max_steps, state.remaining - 1))
        gamma = self.gamma
        tok, tokens, qs = state.pending, [], []
        for i in range(steps):
            ids = torch.tensor([[tok]], device=state.device)
            pos = torch.tensor([[past + i]], device=state.device)
            h = r.layers_forward(r.embed(ids), cache, pos, skip=self.skip)  # (1, 1, D)
            logits = r.logits(h)[0, -1]  # (V,)
            q = state.sampler.probs(logits)  # the law drafts are sampled from (one-hot when greedy)
            tok = int(q.argmax()) if state.sampler.greedy else int(torch.multinomial(q, 1, generator=state.gen))
            # stop on the draft's top-1 probability, never on the sampled token's own probability: keeping
            # x ~ q only when q(x) >= gamma would draft from q truncated, not q, and verification (which
            # divides by q) would no longer be lossless. Greedy: the same thing (x is the top-1).
            if gamma is not None and i > 0 and float(state.sampler.confidence(logits).max()) < gamma:
                break  # the draft is unsure here: stop (at least one token is always drafted)
            tokens.append(tok)
            qs.append(q)
        cache.crop(past)  # the draft KV came from skipped-layer states: verification recomputes every layer
        return Proposal(torch.tensor(tokens, device=state.device), None if state.sampler.greedy else torch.stack(qs))

    def feedback(self, state: DecodeState, outcome: Outcome) -> None:
        if self.adaptive is not None:
            n, a = len(outcome.proposal), outcome.n_accepted
            self.adaptive.update(a, a + (a < n), reached_max=n >= self.max_steps)


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
                                "`python -m dvi_lite.methods.draft_verify.drafter` (or pass skip=...)")
    d = json.loads(path.read_text())
    if d.get("fingerprint") not in (None, fingerprint(model)):
        raise ValueError(f"the skip set in {path} was searched for another model; search one for this model "
                         "with `python -m dvi_lite.methods.draft_verify.drafter --model ...` or pass skip=...")
    return check_skip(skip_from_dict(d["best_skip"]), model.config.num_hidden_layers)


def make_drafter(model, tokenizer, skip=None, max_steps: int = 8, threshold: float | None = 0.6,
                  adaptive: bool = True, target_alpha: float = 0.9):
    """Layer-skipping self-speculation; gamma adapts towards target_alpha unless adaptive=False."""
    r = Runner.for_model(model)
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0):
        raise ValueError(f"threshold (gamma, or its start value when adaptive) must be in (0, 1] or None, got {threshold!r}")
    ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=threshold if threshold is not None else 0.8) \
        if adaptive else None
    return DraftVerifyDrafter(r, resolve_skip(model, skip), max_steps, threshold, ctl)


# ----------------------------------------------------------------------------- what the search needs

def calibration_prompts(n: int = 8, seed: int = 0) -> list[dict]:
    """Prompts from the corpus' val split (never the held-out test prompts the results use)."""
    half = max(1, n // 2)
    ps = make_prompts(n_per_domain=half, seed=seed, split="val")
    return ps[:n] if len(ps) >= n else ps


def time_per_token(model, tok, skip: Skip, prompts: list[dict], max_new_tokens: int = 32, **opts) -> float:
    """The paper's objective: wall seconds per generated token of greedy draft_verify on `prompts`."""
    t, n = 0.0, 0
    for p in prompts:
        t0 = time.perf_counter()
        out = generate(model, tok, p["prompt"], "draft_verify", max_new_tokens, skip=skip, **opts)
        t += time.perf_counter() - t0
        n += len(out.token_ids)
    return t / max(n, 1)


def search(model, tok, cfg: SearchConfig, prompts: list[dict], max_new_tokens: int = 32, progress: bool = True,
           **opts) -> SearchResult:
    """Bayesian optimisation of the skip set (skip_search.search_skip) on the measured objective."""
    return search_skip(lambda s: time_per_token(model, tok, s, prompts, max_new_tokens, **opts),
                       model.config.num_hidden_layers, cfg, progress=progress)


def save_search(model, res: SearchResult, path: Path | None = None, **extra) -> Path:
    """The best skip set + its score, the whole trial log and the model fingerprint, as JSON."""
    path = Path(path) if path is not None else skip_file(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": fingerprint(model), "best_skip": skip_to_dict(res.best_skip),
            "best_seconds_per_token": res.best_value, "n_skipped": n_skipped(res.best_skip),
            "n_sublayers": 2 * model.config.num_hidden_layers, **extra, "search": res.to_dict()}
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


@torch.no_grad()
def skip_sensitivity(model, tok, n_windows: int = 4, seq_len: int = 256, seed: int = 1) -> list[dict]:
    """Per sub-layer: greedy agreement with the full model when only that sub-layer is skipped.

    Teacher-forced on val windows: one forward per sub-layer. 1 - agreement is how much that
    sub-layer matters for the next token; the search's job is to find a *set* that costs little.
    """
    r = Runner.for_model(model)
    x, _ = batch(encode_split(tok, "val"), TrainConfig(seq_len=seq_len, batch_size=n_windows),
                 torch.Generator().manual_seed(seed))
    x = x.to(r.device)
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    h0 = r.embed(x)
    full = r.logits(r.layers_forward(h0, None, pos)).argmax(-1)
    rows = []
    for i in range(r.n_layers):
        for kind in ("attn", "mlp"):
            skip = Skip(attn=frozenset({i}) if kind == "attn" else frozenset(),
                        mlp=frozenset({i}) if kind == "mlp" else frozenset())
            pred = r.logits(r.layers_forward(h0, None, pos, skip=skip)).argmax(-1)
            rows.append({"layer": i, "kind": kind, "agreement": float((pred == full).float().mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    from dvi_lite.models.loading import load_model
    from dvi_lite.study.provenance import provenance

    ap = argparse.ArgumentParser(prog="python -m dvi_lite.methods.draft_verify.drafter",
                                 description="Search Draft & Verify's skip set by Bayesian optimisation")
    ap.add_argument("--model", default=None, help="local HF Llama-family checkpoint (default: the course model)")
    ap.add_argument("--trials", type=int, default=60, help="objective evaluations at most")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget in seconds")
    ap.add_argument("--ratio", type=float, default=0.4, help="skip exactly this fraction of the 2L sub-layers")
    ap.add_argument("--n-calib", type=int, default=6, help="calibration prompts (corpus val split)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: data/draft_verify/skip.json (course model), "
                    "build/models/<fingerprint>/draft_verify/skip.json (another model)")
    args = ap.parse_args(argv)
    try:
        cfg = SearchConfig(n_trials=args.trials, time_budget_s=args.budget_s, seed=args.seed, skip_ratio=args.ratio)
        model, tok = load_model(args.model, dtype="float32")
        res = search(model, tok, cfg, calibration_prompts(args.n_calib, args.seed), args.max_new_tokens)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    cmd = "python -m dvi_lite.methods.draft_verify.drafter " + " ".join(sys.argv[1:] if argv is None else argv)
    path = save_search(model, res, args.out, provenance=provenance(cmd))
    print(f"best {skip_to_dict(res.best_skip)}: {res.best_value * 1e3:.2f} ms/token -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
