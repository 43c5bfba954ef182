"""An interactive DVI lab for notebook 05: sliders for the fast update's knobs, a live lambda_t curve,
and a button that runs a short, real online-training run and streams its diagnostics into the figure.

    w = LambdaWidget(model, train_prompts(tok, n_per_domain=20), DVIConfig(split=2), horizon=500)  # dvi.cli
    w = LambdaWidget.for_model("smollm2", cfg=DVIConfig(split=5))  # the real model, Spec-Bench dev questions
    w                      # (or w.display()) the controls + the live plotly FigureWidget
    w.train(20)            # the same as the button: 20 fast steps, streamed into the figure
    w.static_figure()      # a plain go.Figure of the current state, for executed notebooks / HTML export

Controls (each has a stable `description` and a CSS class, so a browser test can find it):
    t_lambda     FloatLogSlider  "T_λ"          .dvi-t-lambda   lambda's time constant T_λ (fast steps)
    kl_floor     FloatSlider     "KL floor"     .dvi-kl-floor   lambda never drops below it
    ce_weight    FloatSlider     "CE weight"    .dvi-ce-weight  weight of the CE anchor on the verifier's top-1
    rl_variant   Dropdown        "RL variant"   .dvi-rl-variant "surrogate" | "reinforce" | "accepted"
    lr           FloatLogSlider  "lr"           .dvi-lr         the draft's learning rate
    steps        IntSlider       "steps"        .dvi-steps      N, fast steps per click
    button       Button          "train N steps" .dvi-train
    status       HTML                           .dvi-status     what happened last (errors included)
    fig          FigureWidget                   .dvi-figure
The whole box has class .dvi-widget. ipywidgets and plotly (the [course] extra) are imported when a
widget is built, so importing this module needs neither.

The figure and its traces (TRACE_NAMES) are described in figure.py. Training traces are plotted at
t = record["step"] - 1: the index of the update, the t its lambda_t was computed at, so "lambda_used"
sits on "lambda_t" while t_lambda and the floor are unchanged.

When things apply: t_lambda and the KL floor redraw the lambda_t curve at once; every control (t_lambda, floor,
CE weight, RL variant, lr) reaches the trainer on the NEXT click / train() call, never in the middle of
a run. The trainer keeps counting fast steps across clicks, so a new t_lambda re-times lambda at the current
t (lambda can jump: the dots of "lambda_used" then leave the old curve). The learning rate goes into
the trainer's config (its warm-up schedule scales it) and into the optimiser's param groups.

Callbacks are bound methods of the widget and use no module state: two widgets never share anything.
A callback never raises: an invalid value (e.g. a NaN typed into a slider from Python) is reported in
`status` and the last valid configuration is kept.
"""
from __future__ import annotations

import dataclasses
import html
import math
import re
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dvi_lite.methods.dvi.config import RL_VARIANTS, DVIConfig
from dvi_lite.methods.dvi.figure import LAMBDA_TRACE, STREAM_TRACES, lambda_figure
from dvi_lite.methods.dvi.losses import lambda_curve

if TYPE_CHECKING:  # the [course] extra: imported when a widget is built, so this module imports without it
    import ipywidgets as widgets
    import plotly.graph_objects as go

# read-only: control attribute -> CSS class (what the browser test looks for)
CSS_CLASSES = MappingProxyType({
    "t_lambda": "dvi-t-lambda", "kl_floor": "dvi-kl-floor", "ce_weight": "dvi-ce-weight",
    "rl_variant": "dvi-rl-variant", "lr": "dvi-lr", "steps": "dvi-steps", "button": "dvi-train", "status": "dvi-status",
    "fig": "dvi-figure", "ui": "dvi-widget"})
CONFIG_FIELDS = ("t_lambda", "kl_floor", "ce_weight", "rl_variant", "lr")  # DVIConfig fields the controls set

_TIPS = MappingProxyType({
    "t_lambda": "T_λ, the time constant of lambda_t = max(KL floor, exp(-t / T_λ)), in fast steps",
    "kl_floor": "lambda never drops below this: a residual KL keeps the draft near the verifier",
    "ce_weight": "weight of the CE anchor on the verifier's top-1 (applies on the next training click)",
    "rl_variant": "surrogate: -log q(top1 of p), low variance; reinforce: -(r - b) log q(token) on every tested draft; "
                  "accepted: the same on accepted drafts only (the reference default)",
    "lr": "the draft's learning rate (applies on the next training click)",
    "steps": "N: fast updates per click of 'train N steps'",
})


def _log_range(lo: float, hi: float, value: float, step: float) -> tuple[float, float]:
    """Exponents (base 10) of a log slider spanning [lo, hi] and `value` (so a config value is never clamped),
    with the lower end shifted onto value's grid: the browser snaps a slider to min + n * step and sends the
    snapped value back, so an off-grid start would silently change the config (lr 3e-3 -> 3.16e-3)."""
    if not (math.isfinite(value) and value > 0):
        return math.log10(lo), math.log10(hi)
    lo, hi = min(lo, value), max(hi, value)
    v = math.log10(value)
    lo_e = v - step * math.ceil((v - math.log10(lo)) / step - 1e-9)
    hi_e = v + step * math.ceil((math.log10(hi) - v) / step - 1e-9)
    return lo_e, hi_e


class LambdaWidget:
    """Sliders for t_lambda, KL floor, CE weight, RL variant and lr; a live lambda_t plot; 'train N steps'.

    model, prompts_ids: what OnlineTrainer gets (token-id lists, e.g. dvi.cli.train_prompts(tok, ...)).
    cfg: the starting DVIConfig (copied; default DVIConfig()); the controls start at its values.
    horizon: fast steps shown by the lambda_t curve (it grows when training goes past it).
    steps_per_click: the steps slider's start value. trainer_kwargs: extra OnlineTrainer keywords
    (max_new_tokens, warmup, total_steps, ...; progress defaults to False).

    Constructing the widget is cheap: the OnlineTrainer (the DVI policy, optimiser, buffer) is built
    on the first train() / click. `records` holds every training record so far (OnlineTrainer.train's dicts).
    """

    def __init__(self, model, prompts_ids: Sequence[Sequence[int]], cfg: DVIConfig | None = None,
                 horizon: int = 500, steps_per_click: int = 10, trainer_kwargs: dict[str, Any] | None = None):
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 2:
            raise ValueError(f"horizon must be an int >= 2, got {horizon!r}")
        if not isinstance(steps_per_click, int) or isinstance(steps_per_click, bool) or steps_per_click < 1:
            raise ValueError(f"steps_per_click must be an int >= 1, got {steps_per_click!r}")
        import ipywidgets as widgets

        self.model = model
        self.prompts_ids = [list(p) for p in prompts_ids]
        self.cfg = dataclasses.replace(cfg if cfg is not None else DVIConfig())  # own copy (validated)
        self.horizon = horizon
        self.trainer_kwargs = {"progress": False, **(trainer_kwargs or {})}
        self.trainer = None  # OnlineTrainer, built lazily by train()
        self.records: list[dict[str, Any]] = []
        self._busy = False
        self._stream: dict[str, tuple[list[float], list[float | None]]] = {
            n: ([], []) for n in ("lambda_used",) + STREAM_TRACES}
        c = self.cfg
        style = {"description_width": "initial"}
        t_lo, t_hi = _log_range(5.0, 1000.0, c.t_lambda, 0.01)
        self.t_lambda = widgets.FloatLogSlider(value=c.t_lambda, base=10, min=t_lo, max=t_hi, step=0.01,
                                               description="T_λ", readout_format=".3g", style=style,
                                               tooltip=_TIPS["t_lambda"])
        self.kl_floor = widgets.FloatSlider(value=c.kl_floor, min=0.0, max=1.0, step=0.01, description="KL floor",
                                            readout_format=".2f", style=style, tooltip=_TIPS["kl_floor"])
        self.ce_weight = widgets.FloatSlider(value=c.ce_weight, min=0.0, max=max(1.0, c.ce_weight), step=0.01,
                                             description="CE weight", readout_format=".2f", style=style,
                                             tooltip=_TIPS["ce_weight"])
        self.rl_variant = widgets.Dropdown(options=list(RL_VARIANTS[::-1]), value=c.rl_variant,
                                           description="RL variant", style=style, tooltip=_TIPS["rl_variant"])
        l_lo, l_hi = _log_range(1e-4, 1e-1, c.lr, 0.05)
        self.lr = widgets.FloatLogSlider(value=c.lr, base=10, min=l_lo, max=l_hi, step=0.05, description="lr",
                                         readout_format=".1e", style=style, tooltip=_TIPS["lr"])
        self.steps = widgets.IntSlider(value=steps_per_click, min=1, max=max(200, steps_per_click), step=1,
                                       description="steps", style=style, tooltip=_TIPS["steps"])
        self.button = widgets.Button(description="train N steps", button_style="primary", icon="play",
                                     tooltip="run N (the steps slider) fast updates of real online DVI training")
        self.status = widgets.HTML(value="")
        self.fig = lambda_figure(horizon, c.t_lambda, c.kl_floor)
        for name in CSS_CLASSES:
            if name != "ui":
                getattr(self, name).add_class(CSS_CLASSES[name])
        for w in (self.t_lambda, self.kl_floor):
            w.observe(self._on_schedule_change, names="value")
        for w in (self.ce_weight, self.rl_variant, self.lr):
            w.observe(self._on_config_change, names="value")
        self.button.on_click(self._on_click)
        self._ui: widgets.VBox | None = None
        self._say(self._schedule_text())

    @classmethod
    def for_model(cls, model: Any = "smollm2", dtype: str | None = "bfloat16", cfg: DVIConfig | None = None,
                  questions: int = 16, vocab: Any = 8192, max_new_tokens: int = 32, **kwargs: Any) -> LambdaWidget:
        """A widget that trains on a real model: a name / folder (loaded with models.loading.load_model in
        `dtype`) or a loaded model, the first `questions` of the Spec-Bench dev training stream
        (serve.question_stream, chat-formatted), the trimmed draft head `vocab` (None = full) and the
        model's eos. kwargs go to LambdaWidget (horizon, steps_per_click, trainer_kwargs; tokenizer with a
        loaded model)."""
        from dvi_lite.methods.dvi.serve import frozen_model, question_stream

        model, tok = frozen_model(model, dtype, kwargs.pop("tokenizer", None))
        tk = {"max_new_tokens": max_new_tokens, "eos_token_id": tok.eos_token_id, "vocab": vocab,
              **kwargs.pop("trainer_kwargs", {})}
        stream, _ = question_stream(tok, n=questions)
        w = cls(model, stream, cfg, trainer_kwargs=tk, **kwargs)
        w.tokenizer = tok
        return w

    # ------------------------------------------------------------------ figure
    def trace(self, name: str):
        """The FigureWidget's trace with key `name` (see figure.TRACE_NAMES; the legend shows figure.LABELS)."""
        for tr in self.fig.data:
            if tr.meta == name:
                return tr
        raise KeyError(f"no trace {name!r}; traces: {[t.meta for t in self.fig.data]}")

    def _curve_len(self) -> int:
        step = self.trainer.fast_step if self.trainer is not None else 0
        return max(self.horizon, step + 1)

    def _redraw_lambda(self, t_lambda: float, kl_floor: float) -> None:
        n = self._curve_len()
        ys = lambda_curve(n, t_lambda, kl_floor)  # raises ValueError on a bad t_lambda / floor: nothing drawn then
        step = self.trainer.fast_step if self.trainer is not None else 0
        with self.fig.batch_update():
            lam = self.trace(LAMBDA_TRACE)
            lam.x, lam.y = tuple(range(n)), tuple(ys)
            self.trace("current_step").x = (step, step)

    # ------------------------------------------------------------------ status
    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "inherit"
        self.status.value = f'<span style="color:{color}">{html.escape(text)}</span>'

    @property
    def status_text(self) -> str:
        """The status line as plain text (what the HTML label shows)."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.status.value))

    def _schedule_text(self) -> str:
        c = self.cfg
        if c.kl_floor <= 0:
            return (f"λ_t = exp(-t/T_λ), T_λ = {c.t_lambda:.3g}: λ falls to 0.05 by t ≈ "
                    f"{c.t_lambda * math.log(20):.0f}")
        if c.kl_floor >= 1:
            return "KL floor = 1: λ_t = 1 forever (pure distillation, no RL term)"
        return (f"λ_t = max({c.kl_floor:.2f}, exp(-t/{c.t_lambda:.3g})): reaches the floor at "
                f"t = T_λ·ln(1/floor) ≈ {c.t_lambda * math.log(1 / c.kl_floor):.0f}")

    # ------------------------------------------------------------------ config from the controls
    def _candidate(self) -> DVIConfig:
        """The config the controls describe now (ValueError if invalid); self.cfg is not touched."""
        vals = {"t_lambda": float(self.t_lambda.value), "kl_floor": float(self.kl_floor.value),
                "ce_weight": float(self.ce_weight.value), "rl_variant": self.rl_variant.value,
                "lr": float(self.lr.value)}
        return dataclasses.replace(self.cfg, **vals)  # DVIConfig.__post_init__ validates

    def _on_schedule_change(self, change: dict) -> None:
        """t_lambda / KL floor moved: validate, then redraw lambda_t at once. Never raises."""
        try:
            cand = self._candidate()
            self._redraw_lambda(cand.t_lambda, cand.kl_floor)
            self.cfg = cand
            self._say(self._schedule_text())
        except Exception as e:  # a callback must not raise into the kernel's comm handler
            self._say(f"invalid setting, kept the last valid one: {e}", error=True)

    def _on_config_change(self, change: dict) -> None:
        """CE weight / RL variant / lr moved: validate; used by the NEXT training click. Never raises."""
        try:
            self.cfg = self._candidate()
            c = self.cfg
            self._say(f"next run: rl_variant={c.rl_variant}, ce_weight={c.ce_weight:.2f}, lr={c.lr:.1e}")
        except Exception as e:
            self._say(f"invalid setting, kept the last valid one: {e}", error=True)

    # ------------------------------------------------------------------ training
    def _ensure_trainer(self):
        if self.trainer is None:
            from dvi_lite.methods.dvi.learner import OnlineTrainer  # heavy (peft); only when training is asked for

            self.trainer = OnlineTrainer(self.model, self.prompts_ids, dataclasses.replace(self.cfg),
                                         **self.trainer_kwargs)
        return self.trainer

    def _apply_config(self, trainer, cfg: DVIConfig) -> None:
        """Copy the control-driven fields into the trainer's config; lr also into the optimiser now."""
        cfg.validate(trainer.runner.n_layers)
        for f in CONFIG_FIELDS:
            setattr(trainer.cfg, f, getattr(cfg, f))
        lr = trainer.lr(trainer.fast_step)  # the trainer's schedule (warm-up) of the new base lr
        for g in trainer.fast_opt.param_groups:
            g["lr"] = lr

    def train(self, n: int | None = None) -> list[dict[str, Any]]:
        """Run n (default: the steps slider) fast updates of real online DVI training; returns their records.

        The current control values are applied first. Invalid control values: the error goes to the
        status line and nothing runs (returns []). Errors during training (e.g. a NaN loss) are shown
        in the status line and raised (the button's handler only shows them).
        """
        if self._busy:
            self._say("training is already running", error=True)
            return []
        if n is None:
            n = int(self.steps.value)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            self._say(f"steps must be an int >= 1, got {n!r}", error=True)
            return []
        try:
            cand = self._candidate()
            trainer = self._ensure_trainer()
            self._apply_config(trainer, cand)
        except ValueError as e:
            self._say(f"cannot train with these settings: {e}", error=True)
            return []
        self.cfg = cand
        self._busy, self.button.disabled = True, True
        self._say(f"training {n} fast steps from t = {trainer.fast_step} ...")
        try:
            recs = trainer.train(n, callback=self._on_record)
        except Exception as e:
            self._say(f"training stopped: {type(e).__name__}: {e}", error=True)
            raise
        finally:
            self._busy, self.button.disabled = False, False
            try:
                self._redraw_lambda(self.cfg.t_lambda, self.cfg.kl_floor)  # the curve follows t past the horizon
            except ValueError:
                pass
        last = recs[-1] if recs else None
        if last is not None:
            self._say(f"done: {n} steps, t = {trainer.fast_step}; " + self._record_text(last))
        return recs

    @staticmethod
    def _record_text(rec: dict[str, Any]) -> str:
        acc = rec.get("accept_rate")
        acc_s = "n/a" if acc is None else f"{acc:.2f}"
        return (f"λ = {rec['lambda']:.3f}, accept rate = {acc_s}, loss = {rec['loss']:.3f} "
                f"(KL {rec['l_kl']:.3f}, RL {rec['l_rl']:.3f})")

    def _on_record(self, rec: dict[str, Any]) -> None:
        """OnlineTrainer's per-step callback: keep the record, append its points to the streaming traces."""
        self.records.append(rec)
        t = rec["step"] - 1  # the update's index: the t its lambda_t was computed at
        for name, key in (("lambda_used", "lambda"),) + tuple((k, k) for k in STREAM_TRACES):
            xs, ys = self._stream[name]
            xs.append(t)
            v = rec.get(key)
            ys.append(None if v is None or not math.isfinite(v) else float(v))
        with self.fig.batch_update():
            for name, (xs, ys) in self._stream.items():
                tr = self.trace(name)
                tr.x, tr.y = tuple(xs), tuple(ys)
            self.trace("current_step").x = (rec["step"], rec["step"])
        self._say(f"step {rec['step']}: " + self._record_text(rec))

    def _on_click(self, _button=None) -> None:
        """The button's handler: train(steps slider); never raises (errors are in the status line)."""
        try:
            self.train()
        except Exception:
            pass  # train() already put the error into the status line

    # ------------------------------------------------------------------ display
    def static_figure(self) -> go.Figure:
        """A plain go.Figure copy of the current state (lambda curve + training traces): renders without
        a widget manager, so an executed notebook / exported HTML shows the result."""
        import plotly.graph_objects as go

        fig = go.Figure(self.fig)
        c = self.cfg
        # the steps trained and the schedule's decay (by t = 3 T_λ, exp(-t / T_λ) < 0.05), not the whole horizon
        span = min(self._curve_len(), max(4 * len(self.records), 3 * c.t_lambda, 10))
        fig.update_xaxes(range=[-0.5, span])
        fig.update_layout(title={"text": f"DVI λ_t (T_λ = {c.t_lambda:.3g}, KL floor = {c.kl_floor:.2f}) after "
                                         f"{len(self.records)} fast steps ({c.rl_variant}, lr = {c.lr:.1e})",
                                 "font": {"size": 14}}, margin={"t": 90})
        return fig

    def save_static(self, name: str = "05_dvi_lambda_widget", smoke: bool = False) -> list:
        """Write static_figure() with figures.save_figure (HTML, PNG when a browser exists)."""
        from dvi_lite.measure.figures import save_figure

        return save_figure(self.static_figure(), name, smoke=smoke)

    @property
    def controls(self) -> list[widgets.Widget]:
        return [self.t_lambda, self.kl_floor, self.ce_weight, self.rl_variant, self.lr, self.steps]

    @property
    def ui(self) -> widgets.VBox:
        """VBox(controls, button + status, figure); the same box every time."""
        if self._ui is None:
            import ipywidgets as widgets

            self._ui = widgets.VBox([widgets.HBox([self.t_lambda, self.kl_floor, self.ce_weight]),
                                     widgets.HBox([self.rl_variant, self.lr, self.steps]),
                                     widgets.HBox([self.button, self.status]), self.fig])
            self._ui.add_class(CSS_CLASSES["ui"])
        return self._ui

    def display(self) -> None:
        from IPython.display import display

        display(self.ui)

    def _repr_mimebundle_(self, **kwargs):
        return self.ui._repr_mimebundle_(**kwargs)
