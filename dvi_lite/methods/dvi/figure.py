"""The live figure of the DVI widget: the lambda_t schedule above, online-training diagnostics below.

Traces (by key, each trace's `meta`; the legend shows LABELS): row 1 "lambda_t" (the schedule for the current
T_λ / KL floor, over fast steps t = 0 .. horizon-1), "lambda_used" (the lambda each training update actually used)
and "current_step" (a vertical marker at the trainer's next fast step); row 2 "accept_rate" (right axis, [0, 1]),
"loss", "l_kl", "l_rl" (left axis). plotly (the [course] extra) is imported when a figure is built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dvi_lite.methods.dvi.losses import lambda_curve

if TYPE_CHECKING:
    import plotly.graph_objects as go

LAMBDA_TRACE = "lambda_t"
STREAM_TRACES = ("accept_rate", "loss", "l_kl", "l_rl")  # record keys, also the traces' keys (each trace's `meta`)
TRACE_NAMES = (LAMBDA_TRACE, "lambda_used", "current_step") + STREAM_TRACES
# what the legend says for each trace key: a learner reads these, the code finds traces by key
LABELS = {LAMBDA_TRACE: "λ_t, the KL weight's schedule", "lambda_used": "λ an update used",
          "current_step": "the next fast step", "accept_rate": "acceptance rate (right axis)", "loss": "total loss",
          "l_kl": "KL term (distillation)", "l_rl": "reward term (policy gradient)"}


def lambda_figure(horizon: int, t_lambda: float, kl_floor: float) -> go.FigureWidget:
    """A FigureWidget with every trace of TRACE_NAMES: lambda_t drawn over `horizon` steps, the rest empty."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    base = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                         specs=[[{}], [{"secondary_y": True}]],
                         subplot_titles=("KL weight λ_t = max(KL floor, exp(-t / T_λ))",
                                         "online training: acceptance and losses"))
    try:
        fig = go.FigureWidget(base)
    except ImportError as e:  # plotly >= 6 builds FigureWidget on anywidget
        raise ImportError(f"LambdaWidget needs plotly's FigureWidget, which needs anywidget: pip install "
                          f"anywidget (it is a dependency in pyproject.toml) ({e})") from e
    ts = list(range(horizon))
    def key(k: str) -> dict:
        return {"name": LABELS[k], "meta": k}

    fig.add_scatter(x=ts, y=lambda_curve(horizon, t_lambda, kl_floor), mode="lines",
                    line={"color": "#1f77b4", "width": 3}, row=1, col=1, **key(LAMBDA_TRACE))
    fig.add_scatter(x=[], y=[], mode="markers", marker={"color": "#ff7f0e", "size": 6}, row=1, col=1,
                    **key("lambda_used"))
    fig.add_scatter(x=[0, 0], y=[0.0, 1.05], mode="lines", line={"color": "gray", "dash": "dash"}, row=1, col=1,
                    **key("current_step"))
    fig.add_scatter(x=[], y=[], mode="lines+markers", line={"color": "#2ca02c"}, row=2, col=1, secondary_y=True,
                    **key("accept_rate"))
    for k, color in (("loss", "#d62728"), ("l_kl", "#9467bd"), ("l_rl", "#8c564b")):
        fig.add_scatter(x=[], y=[], mode="lines", line={"color": color}, row=2, col=1, **key(k))
    fig.update_yaxes(title_text="KL weight λ_t", range=[0, 1.05], tickformat=".1f", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1, secondary_y=False)
    fig.update_yaxes(title_text="acceptance rate", range=[0, 1], tickformat=".1f", row=2, col=1, secondary_y=True)
    fig.update_xaxes(title_text="fast step t", row=2, col=1)
    fig.update_layout(height=620, margin={"t": 60, "b": 40, "l": 60, "r": 60},
                      legend={"orientation": "h", "y": -0.12})
    return fig


def stream_figure(result: dict) -> go.Figure:
    """Acceptance over a long online stream (a `dvi --data ... --json` result: its "stream", one point per bin of
    questions), with the held-out bench's α after the warm start and at the end of the stream as horizontal lines:
    does serving the stream teach the head, and does what it learns carry to questions it never saw?"""
    import plotly.graph_objects as go

    bins = result.get("stream") or []
    if not bins:
        raise ValueError("the result has no online stream (a run with --sequences 0, or one that was stopped)")
    x = [(b["questions"][0] + b["questions"][1]) / 2 for b in bins]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[b["accept_rate"] for b in bins], mode="lines+markers",
                    name="acceptance of the stream's drafts (mean per bin of questions)")
    for key, label, dash in (("heldout_bench_warm", "held-out α after the warm start", "dot"),
                             ("heldout_bench", "held-out α after the stream", "dash")):
        if (result.get(key) or {}).get("alpha") is not None:
            a = result[key]["alpha"]
            fig.add_scatter(x=[x[0], x[-1]], y=[a, a], mode="lines", line={"dash": dash}, name=f"{label}: {a:.2f}")
    fig.update_layout(title=f"DVI online over {bins[-1]['questions'][1]} questions: acceptance as it serves",
                      xaxis_title="question of the stream", yaxis_title="acceptance rate α",
                      yaxis={"range": [0, 1]}, legend={"orientation": "h", "y": -0.2})
    return fig
