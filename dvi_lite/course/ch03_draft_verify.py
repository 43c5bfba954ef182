"""Chapter 03 helpers (Draft & Verify): what notebook 03 calls, so the notebook holds no algorithm."""
from __future__ import annotations

import torch

from dvi_lite.core.engine import decode
from dvi_lite.core.runner import Runner, Skip
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.draft_verify.adaptive import AdaptiveThreshold
from dvi_lite.methods.draft_verify.drafter import DraftVerifyDrafter
from dvi_lite.methods.draft_verify.search import time_per_token
from dvi_lite.methods.draft_verify.skipset import n_skipped, random_skips, skip_to_dict, uniform_skip
from dvi_lite.models.training import TrainConfig, batch, encode_split
from dvi_lite.study.table import check_bench, finite, require


def skip_matrix(skip: Skip, n_layers: int) -> list[list[int]]:
    """2 x L grid for a layer diagram: row 0 attention, row 1 MLP; 1 = skipped while drafting."""
    return [[int(i in skip.attn) for i in range(n_layers)], [int(i in skip.mlp) for i in range(n_layers)]]


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


def random_baseline(model, tok, ratio: float, n: int, prompts: list[dict], max_new_tokens: int, seed: int = 0,
                    progress: bool = True) -> list[dict]:
    """The same objective on n random skip sets of the same ratio (the search's control)."""
    from tqdm.auto import tqdm

    n_layers = model.config.num_hidden_layers
    rows = []
    for s in tqdm(random_skips(n_layers, ratio, n, seed=seed + 1), desc="random skip sets", disable=not progress):
        rows.append({"skip": skip_to_dict(s), "n_skipped": n_skipped(s),
                     "value": time_per_token(model, tok, s, prompts, max_new_tokens)})
    return rows


def uniform_baseline(model, tok, ratio: float, prompts: list[dict], max_new_tokens: int) -> dict:
    s = uniform_skip(model.config.num_hidden_layers, ratio)
    return {"skip": skip_to_dict(s), "n_skipped": n_skipped(s),
            "value": time_per_token(model, tok, s, prompts, max_new_tokens)}


@torch.no_grad()
def gamma_trace(model, tok, prompt: str, skip: Skip, target_alpha: float, max_new_tokens: int = 256,
                gamma0: float = 0.8, K: int = 8, seed: int = 0) -> dict:
    """One long greedy generation with adaptive draft-exiting: the AR and gamma traces per step."""
    ctl = AdaptiveThreshold(target_alpha=target_alpha, gamma0=gamma0)
    runner = Runner.for_model(model)
    drafter = DraftVerifyDrafter(runner, skip, K, gamma0, ctl)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    _, stats = decode(runner, drafter, ids, max_new_tokens, Sampler(), make_generator(seed))
    return {"target_alpha": target_alpha, "ar": ctl.trace_ar, "gamma": ctl.trace_gamma,
            "alpha": stats.alpha, "tau": stats.tau, "steps": len(stats.steps)}


def head_to_head(model, tok, skips: dict[str, Skip], prompts: list[dict], max_new_tokens: int,
                 rounds: int = 3) -> dict:
    """The search objective re-measured fairly: every skip set in each round, order rotated, median.

    One timing per skip set (as in the search and the random baseline) is noisy and taken minutes apart;
    interleaved rounds put the candidates under the same machine state."""
    import statistics

    labels = list(skips)
    vals: dict[str, list[float]] = {k: [] for k in labels}
    for r in range(rounds):
        for k in labels[r % len(labels):] + labels[: r % len(labels)]:
            vals[k].append(time_per_token(model, tok, skips[k], prompts, max_new_tokens))
    return {k: {"median": statistics.median(v), "rounds": v} for k, v in vals.items()}


def check_invariants(search, randoms: list[dict], uniform: dict, h2h: dict, traces: list[dict], res: dict,
                     methods: list[str]) -> list[str]:
    """Notebook 03's claims: the search ran and its best is the minimum of its trials, every timing is a positive
    number, the gamma traces stay in [0, 1], and the benchmark has every method with meaningful numbers."""
    require(len(search.trials) >= 1, "the skip-set search ran no trial")
    finite(search.best_value, "best seconds per token", 0, strict=True)
    require(search.best_value == min(t["value"] for t in search.trials), "the search's best is not its minimum")
    for r in [*randoms, uniform]:
        finite(r["value"], f"seconds per token of skip set {r['skip']}", 0, strict=True)
    for name, v in h2h.items():
        finite(v["median"], f"head-to-head median of {name}", 0, strict=True)
    for t in traces:
        require(all(0 <= g <= 1 for g in t["gamma"]), f"gamma left [0, 1] for target {t['target_alpha']}")
        if t["tau"] is not None:
            finite(t["tau"], f"tau of the gamma trace for target {t['target_alpha']}", 1)
    return [f"search: {len(search.trials)} trials, best = min; {len(randoms)} random + uniform timings > 0",
            f"gamma traces: {len(traces)} in [0, 1]", check_bench(res, methods)]


ARMS = {"bo": "Bayesian optimisation", "random": "best random set", "uniform_layers": "uniform layers",
        "uniform_sublayers": "uniform sub-layers"}


def real_search_figure(rec: dict):
    """The SmolLM2 recipe's comparison (results/15_draft_verify_smollm2.json): the predicted speedup and the
    teacher-forced acceptance of each arm's skip set on held-out rows, per skip ratio."""
    from plotly.subplots import make_subplots

    ratios = sorted(rec["comparison"], key=float)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["predicted speedup (held-out rows)",
                                                        "acceptance α̂ (held-out rows)"], horizontal_spacing=0.12)
    for i, (arm, name) in enumerate(ARMS.items()):
        color = ["#2a9d8f", "#e76f51", "#8d99ae", "#b5838d"][i]
        for col, key in ((1, "heldout_speedup"), (2, "heldout_alpha_hat")):
            fig.add_bar(x=[f"{float(r):.3f}" for r in ratios], y=[rec["comparison"][r][arm][key] for r in ratios],
                        name=name, marker_color=color, legendgroup=arm, showlegend=col == 1, row=1, col=col)
    fig.update_xaxes(title_text="fraction of sub-layers skipped")
    fig.update_layout(title="SmolLM2 skip sets at equal ratios: the search against random and uniform sets",
                      barmode="group", legend=dict(orientation="h", y=-0.25))
    return fig


def seeds_table(rec: dict) -> str:
    """BO against random and uniform skip sets over seeds (results/41_draft_verify_seeds.json): per arm, the mean
    predicted speedup on calibration and held-out rows and the held-out acceptance α̂, with 95% intervals over
    seeds (a uniform pattern is one set, no interval); then BO − random on held-out rows, and the no-skip check."""
    s = rec["summary"]

    def cell(metric: str, arm: str) -> str:
        d = s[metric][arm]
        return f"{d['value']:.3f}" if "value" in d else f"{d['mean']:.3f} [{d['ci95'][0]:.3f}, {d['ci95'][1]:.3f}]"

    lines = [f"skip ratio {rec['ratio']}, {rec['trials']} trials per seed, seeds {rec['seeds']}; "
             f"{rec['positions']['calibration']} calibration and {rec['positions']['heldout']} held-out positions",
             f"{'arm':<22}{'predicted × AR, calib.':>26}{'predicted × AR, held-out':>26}{'held-out α̂':>26}"]
    for arm, name in ARMS.items():
        lines.append(f"{name:<22}" + "".join(f"{cell(m, arm):>26}" for m in
                                              ("calibration_speedup", "heldout_speedup", "heldout_alpha_hat")))
    d = s["heldout_speedup"]["bo_minus_random"]
    lines.append(f"BO − random, predicted × AR on held-out rows: {d['mean']:+.3f} "
                 f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
    lines.append(f"skipping nothing scores α̂ {rec['no_skip']['heldout']['alpha_hat']:.3f} on held-out rows")
    return "\n".join(lines)
