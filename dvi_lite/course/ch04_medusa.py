"""Chapter 04 helpers (Medusa): what notebook 04 calls, so the notebook holds no algorithm."""
from __future__ import annotations

import torch

from dvi_lite.core.engine import decode
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner, ancestor_matrix, tree_depths
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.measure.timing import bench
from dvi_lite.methods.medusa.drafter import medusa_summary
from dvi_lite.methods.medusa.heads import MedusaHeads
from dvi_lite.methods.medusa.train import MedusaTrainConfig, head_accuracy, train_loop, val_losses
from dvi_lite.models.training import encode_split
from dvi_lite.study.table import check_bench, finite, require


def norm_lesson(model, tok, steps: int, batch_size: int = 4, seq_len: int = 128, num_heads: int = 4,
                seed: int = 0) -> dict:
    """Train heads briefly with and without the frozen final RMSNorm (same data, same seed).

    Without the norm a head reads the raw residual stream, whose scale (large, growing with depth)
    is not what the LM head was trained on: the loss starts far higher and trains slower (Project
    Gorgon's failure). Returns {variant: {"log", "val_loss", "accuracy"}}.
    """
    data, val = encode_split(tok, "train"), encode_split(tok, "val")
    runner = Runner.for_model(model)
    out = {}
    for name, norm in (("with frozen RMSNorm", True), ("without RMSNorm", False)):
        cfg = MedusaTrainConfig(heads=num_heads, steps=steps, batch_size=batch_size, seq_len=seq_len, norm=norm,
                                shared_lm_head=True, warmup=max(1, min(20, steps // 5)), seed=seed)
        torch.manual_seed(seed)
        heads = MedusaHeads(model, num_heads, norm=norm, shared_lm_head=True)
        before = val_losses(heads, runner, val, cfg, n_batches=1)
        log = train_loop(heads, runner, data, cfg, progress=True)
        out[name] = {"log": log, "val_loss_before": before,
                     "val_loss": val_losses(heads, runner, val, cfg, n_batches=1),
                     "accuracy": head_accuracy(model, tok, heads, n_windows=64, seed=seed)}
    return out


def tree_picture(parents: list[int]) -> dict:
    """What the mask figure draws: the ancestor matrix of [root] + nodes, and each node's depth."""
    p = torch.tensor([-1] + [x + 1 for x in parents])
    return {"mask": ancestor_matrix(p).int().tolist(), "depth": tree_depths(p).tolist()}


def per_head(model, tok, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             **opts) -> dict:
    """Run the medusa drafter over prompts and aggregate its log (per-head acceptance, tree size, tau)."""
    drafter = get_method("medusa").build(model, tok, **opts)
    r = Runner.for_model(model)
    for i, p in enumerate(prompts):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        decode(r, drafter, ids, max_new_tokens, Sampler(temperature), make_generator(seed + i), tok.eos_token_id)
    return medusa_summary(drafter.log, drafter.K, drafter.branch)


def ablation_labels(grid: list[dict]) -> dict[str, dict]:
    """Bench labels for a grid of medusa options ({"K", "branch", "tree", "max_nodes", ...})."""
    return {"medusa:" + ":".join(f"{k}={v}" for k, v in g.items()): {} for g in grid}


def ablation(model, tok, prompts: list[dict], grid: list[dict], max_new_tokens: int, repeats: int = 1,
             seed: int = 0) -> dict:
    """One interleaved bench of AR + every grid point; rows get the mean tree size (nodes per step)."""
    labels = ablation_labels(grid)
    return bench(model, tok, prompts, ["ar", *labels], max_new_tokens, repeats, seed=seed)


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (cost, gain, label) not dominated by one with lower-or-equal cost and higher gain."""
    front, best = [], float("-inf")
    for c, g, lab in sorted(points, key=lambda t: (t[0], -t[1])):
        if g > best:
            front.append((c, g, lab))
            best = g
    return front


def peaked_prompt(model, tok, prompts: list[str]) -> str:
    """The prompt whose next token the target is surest of: its first token (sampled from the prefill, which no
    verifier touches) is then nearly fixed, so the verified token after it can be compared with one p."""
    best, best_p = prompts[0], -1.0
    with torch.no_grad():
        for pr in prompts:
            ids = tok(pr, add_special_tokens=False)["input_ids"]
            top = float(model(torch.tensor([ids], device=model.device)).logits[0, -1].float().softmax(-1).max())
            if top > best_p:
                best, best_p = pr, top
    return best


def typical_vs_exact(model, tok, prompt: str, n_samples: int, temperature: float = 1.0, seed: int = 0,
                     n_show: int = 12, **opts) -> dict:
    """The law of Medusa's first verified token under exact and under typical acceptance, against p.

    `n_samples` seeded four-token generations per rule (so the first step can draft). The first token comes
    from the prefill (no verifier touches it), so the second is compared, among the draws whose first token is
    the most frequent one, with the target's exact p at that context (chi-square, ch01's `chi_square`).
    Exact verification keeps p; typical acceptance accepts any candidate p finds typical enough, so its law
    drifts from p.
    """
    from collections import Counter

    from dvi_lite import generate
    from dvi_lite.course.ch01_speculative_sampling import chi_square

    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    draws = {rule: [generate(model, tok, ids, method="medusa", max_new_tokens=4, temperature=temperature,
                             stop_at_eos=False, seed=seed + i, acceptance=rule, **opts).token_ids
                    for i in range(n_samples)] for rule in ("exact", "typical")}
    first = Counter(t[0] for t in draws["exact"]).most_common(1)[0][0]
    with torch.no_grad():
        logits = model(torch.tensor([ids + [first]], device=model.device)).logits[0, -1].float()  # (V,)
    p = Sampler(temperature).probs(logits).cpu()
    out = {"first_token": first, "temperature": temperature, "n_samples": n_samples, "rules": {}}
    show = p.topk(n_show).indices.tolist()
    for rule, ts in draws.items():
        second = torch.tensor([t[1] for t in ts if t[0] == first], dtype=torch.long)
        counts = second.bincount(minlength=p.numel())
        n = int(counts.sum())
        out["rules"][rule] = {"n": n, "chi2": chi_square(counts, p),
                              "freq": [int(counts[t]) / max(n, 1) for t in show]}
    out["tokens"] = [tok.decode([t]) for t in show]
    out["p"] = [float(p[t]) for t in show]
    return out


def check_invariants(kernel: dict, abl: dict, grid: list[dict], front: list[tuple[float, float, str]], ph: dict,
                     res: dict, methods: list[str], kernel_tol: float = 1e-4) -> list[str]:
    """Notebook 04's claims: the Triton kernel matches the reference in fp32, the ablation and the comparison
    have every method with meaningful numbers, the Pareto front is made of ablation rows, and the per-head
    acceptances are rates."""
    fp32 = kernel["max_abs_err"]["torch.float32"]
    require(fp32 < kernel_tol, f"Triton kernel vs reference: fp32 max error {fp32} >= {kernel_tol}")
    labels = ["ar", *ablation_labels(grid)]
    out = [f"kernel: {kernel['trees']} trees, fp32 max error {fp32:.1e} < {kernel_tol}",
           check_bench(abl, labels, "ablation")]
    require(bool(front) and all(lab in abl for _, _, lab in front), f"Pareto front {front} not from the ablation")
    require(all(0 <= a <= 1 for a in ph["head_acceptance"] + ph["head_acceptance_given_previous"]),
            f"per-head acceptance is not a rate: {ph['head_acceptance']}")
    if ph["tau"] is not None:
        finite(ph["tau"], "per-head run tau", 1)
    return out + [f"Pareto front: {len(front)} ablation rows; per-head acceptance in [0, 1]",
                  check_bench(res, methods, "methods")]


def sizing_figure(rows: list[dict], best: dict):
    """The cost model's choice of heads and tree (methods.medusa.sizing.grid rows): predicted speedup over AR
    against the tree's nodes, one line per number of heads, the best configuration marked."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for h in sorted({r["heads"] for r in rows}):
        pts = sorted({(r["nodes"], r["predicted_speedup"]) for r in rows if r["heads"] == h})
        fig.add_scatter(x=[n for n, _ in pts], y=[s for _, s in pts], mode="lines+markers", name=f"{h} head(s)")
    fig.add_scatter(x=[best["nodes"]], y=[best["predicted_speedup"]], mode="markers", name="the cost model's pick",
                    marker={"size": 14, "symbol": "star"})
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title="SmolLM2's Medusa sized by the cost model: τ(H, N) / (v(N + 1) + H·c_head)",
                      xaxis_title="tree nodes N", yaxis_title="predicted × AR", xaxis_type="log")
    return fig
