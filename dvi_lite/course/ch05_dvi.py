"""Chapter 05 helpers (DVI): short online-training runs to compare, so the notebook holds no algorithm."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.drafter import evaluate
from dvi_lite.methods.dvi.learner import OnlineTrainer
from dvi_lite.study.table import check_bench, finite, require

# the notebook's baseline recipe: the paper's objective (forward-KL warm-up decaying to the reward-driven
# policy-gradient term with an EMA baseline, CE anchor, KL floor), 3e-3 (the learning rate that trained the
# exit head fastest in an offline check on course-model experiences)
BASE = DVIConfig(split=2, t_lambda=40.0, kl_floor=0.05, rl_variant="reinforce", ce_weight=0.2, lr=3e-3,
                 fast_every=32, batch_size=32, buffer_size=2048)
ABLATION = "15_dvi_smollm2.json"  # results/: DVI vs KL-only vs pure RL on SmolLM2 (methods/dvi/ablation.py)
ARM_NAMES = {"dvi": "our variant (KL warm-up -> reward PG on every tested draft, CE anchor, KL floor)",
             "reference": "the reference trainers' default (KL warm-up -> reward-masked term on accepted drafts)",
             "kl": "KL-only online distillation", "rl": "pure RL (reward only)"}


def config(**overrides) -> DVIConfig:
    """BASE with some fields changed (validated by DVIConfig)."""
    return replace(BASE, **overrides)


def run(model, prompts_ids: list[list[int]], steps: int, cfg: DVIConfig, slow_updates: bool = False,
        max_new_tokens: int = 48, eos_token_id: int | None = None, log_path: str | Path | None = None,
        progress: bool = True) -> tuple[OnlineTrainer, list[dict]]:
    """One online run of `steps` fast updates from an untrained head; returns (trainer, records)."""
    tr = OnlineTrainer(model, prompts_ids, cfg, slow_updates=slow_updates, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, log_path=log_path, progress=progress)
    return tr, tr.train(steps)


def curve(records: list[dict], key: str, window: int = 5) -> list[float | None]:
    """records[i][key] smoothed by a trailing mean over `window` steps (None values skipped)."""
    out, vals = [], []
    for r in records:
        v = r.get(key)
        if v is not None:
            vals.append(float(v))
        tail = vals[-window:]
        out.append(sum(tail) / len(tail) if tail else None)
    return out


def summary(records: list[dict], last: int = 10) -> dict:
    """Mean acceptance / top-1 agreement / pi_s(v) over the last `last` fast steps, and the gradient norm."""
    tail = records[-last:] if records else []

    def mean(key):
        vals = [r[key] for r in tail if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {"steps": len(records), "accept_rate": mean("accept_rate"), "top1_agree": mean("top1_agree"),
            "pi_s_v": mean("pi_s_v"), "grad_norm": mean("grad_norm"),
            "first_grad_norm": records[0]["grad_norm"] if records else None}


def before_after(model, tok, prompts: list[str], policy_before, policy_after, max_new_tokens: int = 48) -> dict:
    """tau and alpha of method='dvi' on held-out prompts with the untrained and the trained head."""
    kw = dict(max_new_tokens=max_new_tokens, K=6, threshold=None)
    return {"before": evaluate(model, tok, prompts, policy_before, **kw),
            "after": evaluate(model, tok, prompts, policy_after, **kw)}


def scramble_head(trainer: OnlineTrainer, seed: int = 0) -> None:
    """Make the draft head useless before training (random exit-norm gains): the cold start that DVI's
    design note warns about, where pure RL sees (almost) no accepted token and so (almost) no gradient."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = trainer.policy.exit_norm.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=g).to(w) * w.abs().mean())


def check_invariants(before_after_: dict, records: list[dict], steps: int, res: dict, methods: list[str]) -> list[str]:
    """Notebook 05's claims: the main run took every fast step with finite losses and rates in [0, 1], the
    before/after evaluation has tau >= 1, and the benchmark has every method with meaningful numbers."""
    require(len(records) == steps, f"the main run recorded {len(records)} of {steps} fast steps")
    for r in records:
        finite(r["loss"], f"loss at fast step {r['step']}")
        if r.get("accept_rate") is not None:
            require(0 <= r["accept_rate"] <= 1, f"acceptance {r['accept_rate']} at step {r['step']} is not a rate")
    for when, ev in before_after_.items():
        if ev["tau"] is not None:
            finite(ev["tau"], f"held-out tau {when} training", 1)
        if ev["alpha"] is not None:
            require(0 <= ev["alpha"] <= 1, f"held-out alpha {when} training = {ev['alpha']}")
    return [f"main run: {steps} fast steps, finite losses; held-out tau >= 1 before and after",
            check_bench(res, methods)]


def load_ablation(path: str | Path | None = None) -> dict:
    """The real-model ablation (results/15_dvi_smollm2.json, written by `python -m dvi_lite.methods.dvi.ablation`)."""
    import json

    from dvi_lite.measure.provenance import RESULTS_DIR

    p = Path(path) if path is not None else RESULTS_DIR / ABLATION
    if not p.is_file():
        raise FileNotFoundError(f"no ablation results at {p}; run `python -m dvi_lite.methods.dvi.ablation "
                                f"--json {p}` (about 5 minutes per arm on 2 CPU cores)")
    return json.loads(p.read_text())


def ablation_rows(res: dict) -> list[dict]:
    """One row per arm: fast steps, stream acceptance at the start and the end, held-out tau / alpha after."""
    before = res["heldout_before"]
    rows = [{"arm": "untrained early exit", "fast_steps": 0, "stream_accept_first": None, "stream_accept_last": None,
             "heldout_tau": before["tau"], "heldout_alpha": before["alpha"]}]
    for arm, r in res["arms"].items():
        c = r["curve"]
        rows.append({"arm": ARM_NAMES.get(arm, arm), "fast_steps": r["fast_steps"],
                     "stream_accept_first": c[0]["accept_rate"] if c else None,
                     "stream_accept_last": c[-1]["accept_rate"] if c else None,
                     "heldout_tau": r["heldout"]["tau"], "heldout_alpha": r["heldout"]["alpha"]})
    return rows


def ablation_figure(res: dict):
    """Acceptance over the question stream per arm (left) and the final heads' held-out τ (right). Each arm keeps one
    colour in both panels, each bar carries its value, and the legend sits below so no title overlaps another."""
    from plotly.subplots import make_subplots

    from dvi_lite.course.plots import legend_below, series_color

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=["acceptance over the stream", "held-out τ of the final head"])
    table = ablation_rows(res)
    rows = {r["arm"]: r for r in table}
    start = table[0]  # the untrained head every arm starts from: grey, for reference
    fig.add_bar(x=[start["arm"]], y=[start["heldout_tau"]], marker_color="#999999", name=start["arm"], row=1, col=2,
                text=[f"{start['heldout_tau']:.2f}"], textposition="outside")
    for i, (arm, r) in enumerate(res["arms"].items()):
        name, col = ARM_NAMES.get(arm, arm), series_color(i)
        fig.add_scatter(x=[b["questions"][1] for b in r["curve"]], y=[b["accept_rate"] for b in r["curve"]],
                        mode="lines+markers", name=name, line=dict(color=col), legendgroup=name, row=1, col=1)
        tau = rows[name]["heldout_tau"]
        fig.add_bar(x=[name], y=[tau], marker_color=col, legendgroup=name, showlegend=False, row=1, col=2,
                    text=[f"{tau:.2f}" if tau is not None else "–"], textposition="outside")
    fig.update_xaxes(title_text="questions answered", row=1, col=1)
    fig.update_yaxes(title_text="acceptance (per bin of questions)", row=1, col=1)
    fig.update_yaxes(title_text="τ (greedy, bench questions)", row=1, col=2)
    fig.update_layout(title=f"DVI ablation on {res.get('model')} ({res.get('dtype')}), exit layer "
                            f"{res['recipe']['split']}, the same stream for every arm", title_y=0.97)
    return legend_below(fig)


PAPER_ABLATION = "41_dvi_ablation.json"  # results/: the paper's recipe (soft KL warm start, then online), 3 seeds
LATER_EXIT = "41_dvi_later_exit.json"  # results/: the same recipe (reference objective, seed 0), exit at layer 15
STREAM = "41_dvi_online_stream.json"  # results/: the committed recipe with a 500-question online phase (dvi --json)
PHASES = {"start": "untrained", "warm": "after the KL warm start", "online": "after the online phase"}


def paper_ablation_rows(res: dict) -> list[dict]:
    """One row per arm of the paper-recipe ablation (`python -m dvi_lite dvi --ablation --seeds ...`): held-out
    top-1 agreement after the warm start and after the online phase (mean over seeds), the final agreement's and
    held-out τ's mean with its 95% interval over seeds, and the arm's rank."""
    rows = []
    for arm, runs in res["runs"].items():
        warm = [next(c["agree"] for c in r["curve"] if c["phase"] == "warm") for r in runs.values()]
        s = res["summary"][arm]
        rows.append({"arm": ARM_NAMES.get(arm, arm), "seeds": len(runs), "agree_after_warm": sum(warm) / len(runs),
                     "agree_final": s["agree"]["mean"], "agree_final_ci95": s["agree"]["ci95"],
                     "tau": s["tau"]["mean"], "tau_ci95": s["tau"]["ci95"],
                     "rank": res["ranking"].index(arm) + 1 if arm in res["ranking"] else None})
    return rows


def paper_ablation_figure(res: dict):
    """Held-out top-1 agreement of each arm's head at the three checkpoints (untrained, after the KL warm start,
    after the online phase), one line per seed in the arm's colour: where each objective takes the head."""
    import plotly.graph_objects as go

    from dvi_lite.course.plots import legend_below, series_color

    fig = go.Figure()
    for i, (arm, runs) in enumerate(res["runs"].items()):
        name = ARM_NAMES.get(arm, arm)
        for j, (seed, r) in enumerate(runs.items()):
            fig.add_scatter(x=[PHASES[c["phase"]] for c in r["curve"]], y=[c["agree"] for c in r["curve"]],
                            mode="lines+markers", line_color=series_color(i), name=name, legendgroup=name,
                            showlegend=j == 0, hovertext=f"seed {seed}")
    fig.update_layout(title=f"DVI as the paper trains it: held-out top-1 agreement per arm ({len(res['seeds'])} seeds)",
                      yaxis_title="held-out top-1 agreement", xaxis_title="checkpoint")
    return legend_below(fig)


def head_curve_figure(card: dict):
    """The committed head's learning curve (its card, `prepare --only "dvi head"`): held-out top-1 agreement against
    tokens seen, through the KL warm start and the online phase; held-out decoding's alpha after each phase."""
    import plotly.graph_objects as go

    from dvi_lite.course.plots import legend_below

    pts = card["curve"]
    fig = go.Figure()
    fig.add_scatter(x=[max(p["tokens"], 1) for p in pts], y=[p["agree"] for p in pts], mode="lines+markers",
                    text=[PHASES[p["phase"]] for p in pts], name="held-out top-1 agreement (teacher-forced)")
    for key, label in (("heldout_bench_warm", "after the warm start"), ("heldout_bench", "after the online phase")):
        b = card.get(key)
        if b:
            at = next(p["tokens"] for p in pts if p["phase"] == ("warm" if key.endswith("warm") else "online"))
            fig.add_scatter(x=[at], y=[b["alpha"]], mode="markers", marker={"size": 12, "symbol": "diamond"},
                            name=f"α decoding held-out questions, {label}")
    fig.update_layout(title="SmolLM2's committed DVI head: what the warm start and the online phase buy",
                      xaxis_title="tokens seen", xaxis_type="log", yaxis_title="agreement / α")
    return legend_below(fig)
