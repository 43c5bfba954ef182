"""A low-noise objective for Draft & Verify's skip-set search: acceptance measured, cost from a model.

Timing the drafter per candidate (the paper's seconds per token) is too noisy on a shared CPU to rank
skip sets whose true costs differ by a few percent. This objective has no timing noise at all:

* alpha_hat(skip): teacher-forced agreement of the skipped model's argmax with the full model's argmax
  (the teacher's top-1) at the scored positions of calibration rows. Each position t is scored as the
  drafter would see it in its first draft step: its query runs through the kept sub-layers and attends
  to the FULL model's keys and values of positions < t (the committed prefix, `PrefixKV`) plus its own
  skipped-state key. One batched forward per candidate; the prefix KV is computed once.
* c(skip): a linear cost model of one draft forward relative to one full 1-token forward, from the
  measured cost of an attention sub-layer, an MLP sub-layer and the rest (embedding, final norm, LM
  head, per-forward overhead) (`SublayerCosts`, measured once).
* the value: the cost model's predicted speedup tau / (v(K + 1) + K c) with the measured v(n) and the
  expected tau of a fixed-length draft whose tokens are accepted independently with probability
  alpha_hat, tau = (1 - alpha^(K + 1)) / (1 - alpha), at the best K in [1, k_max].

alpha_hat is the first draft token's acceptance; later draft tokens also attend to earlier draft tokens'
skipped-state KV, so the real per-token acceptance can be a little lower.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from dvi_lite.core.checks import check_int
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.measure.cost import best_speedup, expected_tau

# ----------------------------------------------------------------------------- c: the cost model

@dataclass
class SublayerCosts:
    """Seconds of the parts of one 1-token forward at `context` cached positions (medians)."""

    n_layers: int
    attn: float  # one attention sub-layer (norm + attention + residual)
    mlp: float  # one MLP sub-layer (norm + MLP + residual)
    head: float  # final norm + the full LM head
    full: float  # a whole forward: embedding, every layer, final norm, LM head
    trimmed_head: float | None = None  # final norm + the trimmed draft head, when one was timed
    context: int = 0

    @property
    def fixed(self) -> float:
        """What every forward pays whatever it skips: embedding, final norm, LM head, overhead."""
        return max(0.0, self.full - self.n_layers * (self.attn + self.mlp))

    def c(self, skip: Skip, trimmed: bool = False) -> float:
        """A draft forward with `skip` relative to a full forward (trimmed: with the trimmed head).

        The full forward is priced as the sum of its parts (fixed + every sub-layer): when timing noise makes
        the sub-layers add up to more than the timed whole, skipping nothing still costs exactly 1 and no draft
        costs more than the target."""
        if trimmed and self.trimmed_head is None:
            raise ValueError("trimmed=True: these costs were measured without a trimmed head (pass vocab=...)")
        fixed = self.fixed - (self.head - self.trimmed_head if trimmed else 0.0)
        kept_attn, kept_mlp = self.n_layers - len(skip.attn), self.n_layers - len(skip.mlp)
        whole = self.fixed + self.n_layers * (self.attn + self.mlp)  # = max(full, the sub-layers' sum)
        return (fixed + kept_attn * self.attn + kept_mlp * self.mlp) / whole

    def to_dict(self) -> dict:
        return {**asdict(self), "fixed": self.fixed}


@torch.no_grad()
def measure_sublayer_costs(model, context: int = 256, repeats: int = 15, vocab=None, seed: int = 0) -> SublayerCosts:
    """Time, interleaved round by round (a slow spell hits every variant alike), one 1-token forward that
    runs everything, one that skips every attention, one that skips every MLP, and the final norm + head
    (and + the trimmed head `vocab`, a models.vocab.TrimmedHead); medians after one warm-up round."""
    check_int("context", context, 1)
    check_int("repeats", repeats, 1)
    r = Runner.for_model(model)
    n = r.n_layers
    every = frozenset(range(n))
    gen = torch.Generator().manual_seed(seed)
    vsize = r.lm_head.weight.shape[0]
    cache = r.new_cache(context + 1)
    r.layers_forward(r.embed(torch.randint(0, vsize, (1, context), generator=gen).to(r.device)), cache,
                     torch.arange(context, device=r.device)[None])
    ids = torch.randint(0, vsize, (1, 1), generator=gen).to(r.device)
    pos = torch.tensor([[context]], device=r.device)
    h_last = r.embed(ids)  # (1, 1, D): any state will do for timing the head

    def forward(skip: Skip | None) -> None:
        r.logits(r.layers_forward(r.embed(ids), cache, pos, skip=skip))
        cache.crop(context)

    variants = {"full": lambda: forward(None), "no_attn": lambda: forward(Skip(attn=every)),
                "no_mlp": lambda: forward(Skip(mlp=every)), "head": lambda: r.logits(h_last)}
    if vocab is not None:
        variants["trimmed_head"] = lambda: vocab.small(r.norm(h_last))
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rnd in range(repeats + 1):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            if rnd:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    attn, mlp = max(0.0, (med["full"] - med["no_attn"]) / n), max(0.0, (med["full"] - med["no_mlp"]) / n)
    scale = min(1.0, med["full"] / max(n * (attn + mlp), 1e-12))  # timing noise never makes the layers > the whole
    return SublayerCosts(n_layers=n, attn=attn * scale, mlp=mlp * scale, head=med["head"], full=med["full"],
                         trimmed_head=med.get("trimmed_head"), context=context)


# ----------------------------------------------------------------------------- alpha_hat: acceptance measured

class PrefixKV:
    """A read-only cache for the scoring forward: every layer holds the full model's (B, H, T, D) keys and
    values of the rows; `update` returns them followed by the new positions' own (B, H, n, D), and stores
    nothing (duck-types the one method HF attention calls)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v
        self.lens = [t.shape[2] for t in k]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        return torch.cat([self.k[layer_idx], k], dim=2), torch.cat([self.v[layer_idx], v], dim=2)


class _Recorder:
    """Collects the keys and values of a full causal forward from position 0 (nothing cached)."""

    def __init__(self, n_layers: int):
        self.lens = [0] * n_layers
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


@dataclass
class _Batch:
    prefix: PrefixKV  # the full model's KV of the rows (B, H, T, D) per layer
    ids: torch.Tensor  # (B, n) the token at each scored position
    pos: torch.Tensor  # (B, n) its position
    mask: torch.Tensor  # (B, 1, n, T + n) bool: prefix keys before the position, and itself
    target: torch.Tensor  # (B, n) the full model's argmax there, -1 = padding


class Calibration:
    """Scored positions of some rows, with the full model's prefix KV computed once (`agreement` reads it).

    rows: token id lists; spans: per row, the (start, end) positions scored (position t predicts t + 1);
    targets: per row, the label at every position; None (the default, and what the search uses): the full
    model's own argmax on the same row, from the forward that records the prefix KV. Labels taken elsewhere (a
    teacher that saw a longer context than the row) would be missed by the full model itself, and skipping nothing
    would score below 1: the noise would then swamp the differences between skip sets.
    max_positions: at most this many scored positions per row, evenly spaced over its span.
    """

    @torch.no_grad()
    def __init__(self, model, rows: list[list[int]], spans: list[tuple[int, int]],
                 targets: list[list[int]] | None = None, batch_size: int = 8, max_positions: int | None = None):
        if not rows or len(rows) != len(spans) or (targets is not None and len(rows) != len(targets)):
            raise ValueError("rows, spans and targets must be non-empty lists of the same length")
        self.runner = r = Runner.for_model(model)
        check_int("batch_size", batch_size, 1)
        self.batches: list[_Batch] = []
        self.n_positions = 0
        for b in range(0, len(rows), batch_size):
            chunk = list(range(b, min(b + batch_size, len(rows))))
            picks = []
            for i in chunk:
                s, e = spans[i]
                if not 0 <= s < e <= len(rows[i]):
                    raise ValueError(f"span {spans[i]} of row {i} is outside its {len(rows[i])} tokens")
                ts = list(range(s, e))
                if max_positions is not None and len(ts) > max_positions:
                    ts = [ts[round(j * (len(ts) - 1) / (max_positions - 1))] if max_positions > 1 else ts[0]
                          for j in range(max_positions)]
                picks.append(ts)
            t = max(len(rows[i]) for i in chunk)
            n = max(len(p) for p in picks)
            toks = torch.zeros(len(chunk), t, dtype=torch.long)
            for j, i in enumerate(chunk):
                toks[j, : len(rows[i])] = torch.tensor(rows[i])
            toks = toks.to(r.device)  # (B, T), right-padded: a causal forward never reads the padding
            rec = _Recorder(r.n_layers)
            h = r.layers_forward(r.embed(toks), rec, torch.arange(t, device=r.device)[None].expand(len(chunk), -1))
            pos = torch.zeros(len(chunk), n, dtype=torch.long)
            target = torch.full((len(chunk), n), -1, dtype=torch.long)
            for j, (i, ts) in enumerate(zip(chunk, picks, strict=True)):
                pos[j, : len(ts)] = torch.tensor(ts)
                if targets is not None:
                    target[j, : len(ts)] = torch.tensor([targets[i][q] for q in ts])
            pos, target = pos.to(r.device), target.to(r.device)
            if targets is None:  # the full model's own argmax at the picked positions (only those rows' logits)
                own = r.logits(h.gather(1, pos[..., None].expand(-1, -1, h.shape[-1]))).argmax(-1)  # (B, n)
                target = torch.where(torch.arange(n, device=r.device)[None] < torch.tensor(
                    [len(p) for p in picks], device=r.device)[:, None], own, target)
            before = torch.arange(t, device=r.device)[None, None, :] < pos[:, :, None]  # (B, n, T)
            self_ = torch.eye(n, dtype=torch.bool, device=r.device)[None].expand(len(chunk), -1, -1)  # (B, n, n)
            mask = torch.cat([before, self_], dim=-1)[:, None]  # (B, 1, n, T + n)
            self.batches.append(_Batch(PrefixKV(rec.k, rec.v), toks.gather(1, pos), pos, mask, target))
            self.n_positions += int((target >= 0).sum())

    @torch.no_grad()
    def predictions(self, skip: Skip | None, vocab=None) -> list[torch.Tensor]:
        """Per batch, the skipped model's argmax (B, n) at the scored positions (over the trimmed head's tokens
        when `vocab`, a models.vocab.TrimmedHead, is given); padding entries are meaningless."""
        r, out = self.runner, []
        for b in self.batches:
            h = r.layers_forward(r.embed(b.ids), b.prefix, b.pos, skip=skip, mask=b.mask)  # (B, n, D)
            out.append(r.logits(h).argmax(-1) if vocab is None else vocab.ids[vocab.small(r.norm(h)).argmax(-1)])
        return out

    def agreement(self, skip: Skip | None, vocab=None) -> float:
        """alpha_hat: the fraction of scored positions where the skipped model's argmax is the full model's."""
        hits = sum(int(((p == b.target) & (b.target >= 0)).sum())
                   for p, b in zip(self.predictions(skip, vocab), self.batches, strict=True))
        return hits / max(self.n_positions, 1)


# ----------------------------------------------------------------------------- the value

class SkipObjective:
    """skip -> minus the predicted speedup (search_skip minimises), logging alpha_hat, c, K per skip set."""

    def __init__(self, calib: Calibration, costs: SublayerCosts, v, k_max: int = 8, vocab=None):
        self.calib, self.costs, self.v, self.k_max, self.vocab = calib, costs, v, k_max, vocab
        self.log: dict[tuple, dict] = {}

    def evaluate(self, skip: Skip) -> dict:
        key = (tuple(sorted(skip.attn)), tuple(sorted(skip.mlp)))
        if key not in self.log:
            alpha = self.calib.agreement(skip, self.vocab)
            c = self.costs.c(skip, trimmed=self.vocab is not None)
            s, k = best_speedup(alpha, c, self.v, self.k_max)
            self.log[key] = {"alpha_hat": alpha, "c": c, "K": k, "tau": expected_tau(alpha, k), "speedup": s}
        return self.log[key]

    def __call__(self, skip: Skip) -> float:
        return -self.evaluate(skip)["speedup"]
