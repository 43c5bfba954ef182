"""The notebook-05 DVI widget, driven from Python (no browser): the lambda_t curve follows the sliders at
once, invalid values are reported and never raised, 'train N steps' streams real online-training
records into the figure, the controls reach the trainer on the next click, widgets share nothing.
Tiny 4-layer model only (conftest.deep_model)."""
from __future__ import annotations

import math
import subprocess
import sys

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest
from helpers import DEEP_PROMPTS

from dvi_lite.methods.dvi import widget as dvi_widget
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.figure import LAMBDA_TRACE, STREAM_TRACES, TRACE_NAMES
from dvi_lite.methods.dvi.losses import lambda_curve, lambda_schedule
from dvi_lite.methods.dvi.widget import CSS_CLASSES, LambdaWidget

BASE = dict(split=2, fast_every=8, batch_size=16, buffer_size=256, t_lambda=10.0, kl_floor=0.05, seed=0,
            rl_variant="surrogate")


def make(model, horizon=40, cfg=None, **kw):
    kw.setdefault("trainer_kwargs", {"max_new_tokens": 24, "warmup": 0})
    return LambdaWidget(model, DEEP_PROMPTS, DVIConfig(**{**BASE, **(cfg or {})}), horizon=horizon, **kw)


def ys(w, name=LAMBDA_TRACE):
    return list(w.trace(name).y)


def test_construction_is_cheap_and_findable(deep_model):
    cfg = DVIConfig(**BASE)
    w = LambdaWidget(deep_model, DEEP_PROMPTS, cfg, horizon=40)
    assert w.trainer is None and w.records == []  # nothing trained, no trainer built
    assert [t.meta for t in w.fig.data] == list(TRACE_NAMES)
    assert isinstance(w.fig, go.FigureWidget)
    assert ys(w) == lambda_curve(40, 10.0, 0.05) and list(w.trace(LAMBDA_TRACE).x) == list(range(40))
    for name in STREAM_TRACES + ("lambda_used",):
        assert len(w.trace(name).x or ()) == 0
    # every control: a stable description and its CSS class (what the browser test looks for)
    desc = {"t_lambda": "T_λ", "kl_floor": "KL floor", "ce_weight": "CE weight", "rl_variant": "RL variant", "lr": "lr",
            "steps": "steps", "button": "train N steps"}
    for attr, d in desc.items():
        assert getattr(w, attr).description == d
    for attr, cls in CSS_CLASSES.items():
        assert cls in getattr(w, attr)._dom_classes
    assert CSS_CLASSES["t_lambda"] == "dvi-t-lambda" and CSS_CLASSES["button"] == "dvi-train"
    # the controls start at the config's values; the widget owns a copy of the config
    assert w.t_lambda.value == pytest.approx(10.0) and w.kl_floor.value == pytest.approx(0.05)
    assert w.ce_weight.value == pytest.approx(cfg.ce_weight)
    assert w.rl_variant.value == cfg.rl_variant and w.lr.value == pytest.approx(cfg.lr)
    assert set(w.rl_variant.options) == {"surrogate", "reinforce", "accepted"}
    w.t_lambda.value = 50.0
    assert cfg.t_lambda == 10.0 and w.cfg.t_lambda == 50.0
    ui = w.ui
    assert isinstance(ui, widgets.VBox) and ui is w.ui and "dvi-widget" in ui._dom_classes
    assert w.fig in ui.children
    flat = [c for box in ui.children if isinstance(box, widgets.HBox) for c in box.children]
    assert all(c in flat for c in w.controls + [w.button, w.status])
    assert "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()


def test_schedule_sliders_redraw_lambda_immediately(deep_model):
    w = make(deep_model)
    w.t_lambda.value = 25.0
    assert ys(w) == lambda_curve(40, 25.0, 0.05)
    assert "25" in w.status_text
    before = ys(w)
    w.kl_floor.value = 0.3
    after = ys(w)
    assert after == lambda_curve(40, 25.0, 0.3)
    assert min(after) == pytest.approx(0.3) and min(before) < 0.3
    assert all(a >= b for a, b in zip(after, before, strict=True)) and after[0] == 1.0
    w.kl_floor.value = 0.0
    assert ys(w) == lambda_curve(40, 25.0, 0.0)
    assert w.trainer is None  # redrawing never trains


def test_invalid_values_are_reported_not_raised(deep_model):
    w = make(deep_model)
    good = ys(w)
    w.kl_floor.value = float("nan")  # a slider lets a NaN through from Python; DVIConfig rejects it
    assert "kl_floor" in w.status_text and "invalid" in w.status_text
    assert "color:#b00020" in w.status.value
    assert ys(w) == good and w.cfg.kl_floor == 0.05  # the last valid curve and config are kept
    assert w.train(1) == [] and w.trainer is None and "kl_floor" in w.status_text
    w.kl_floor.value = 0.1
    assert ys(w) == lambda_curve(40, 10.0, 0.1) and "invalid" not in w.status_text
    w.lr.value = float("nan")
    assert "lr" in w.status_text and w.cfg.lr == pytest.approx(1e-3)
    w.t_lambda.value = float("nan")
    assert "invalid" in w.status_text and ys(w) == lambda_curve(40, 10.0, 0.1)
    # a config that does not fit the model (split 4 of 4 layers): the click reports, never raises
    bad = make(deep_model, cfg=dict(split=4))
    bad.button.click()
    assert "split" in bad.status_text and bad.records == [] and not bad.button.disabled
    assert bad.train(0) == [] and "steps" in bad.status_text


def test_button_trains_and_streams_into_the_figure(deep_model):
    w = make(deep_model, horizon=3)
    w.steps.value = 2
    disabled = []
    w.button.observe(lambda ch: disabled.append(ch["new"]), names="disabled")
    seen = []
    w.trace("loss").on_change(lambda tr, y: seen.append(len(y)), "y")  # FigureWidget change events
    w.button.click()
    assert disabled == [True, False]  # disabled while training, enabled again after
    assert len(w.records) == 2 and w.trainer.fast_step == 2
    recs = w.train(3)  # the same path, called from Python
    assert len(recs) == 3 and w.records[-3:] == recs and len(w.records) == 5
    assert [r["step"] for r in w.records] == [1, 2, 3, 4, 5]
    for name in STREAM_TRACES:
        assert list(w.trace(name).x) == [0, 1, 2, 3, 4]  # t = step - 1
    assert list(w.trace("loss").y) == pytest.approx([r["loss"] for r in w.records])
    assert list(w.trace("l_kl").y) == pytest.approx([r["l_kl"] for r in w.records])
    assert all(0 <= a <= 1 for a in w.trace("accept_rate").y)
    assert seen and seen[-1] == 5
    # the lambda the updates used lies on the lambda_t curve; the curve grew past the horizon of 3
    assert list(w.trace("lambda_used").y) == pytest.approx([lambda_schedule(t, 10.0, 0.05) for t in range(5)])
    assert list(w.trace(LAMBDA_TRACE).x) == list(range(6)) and ys(w) == lambda_curve(6, 10.0, 0.05)
    assert list(w.trace("current_step").x) == [5, 5]
    assert "done" in w.status_text and all(math.isfinite(r["loss"]) for r in w.records)


def test_controls_apply_on_the_next_click(deep_model):
    w = make(deep_model)
    w.train(1)
    tr = w.trainer
    assert tr.fast_opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    w.lr.value = 1e-2
    w.ce_weight.value = 0.5
    w.rl_variant.value = "reinforce"
    w.t_lambda.value = 100.0
    assert "100" in w.status_text  # the last change was T_λ: its schedule text
    cfg_now = (tr.cfg.lr, tr.cfg.ce_weight, tr.cfg.rl_variant, tr.cfg.t_lambda)
    assert cfg_now == (1e-3, 0.2, "surrogate", 10.0)  # not yet
    recs = w.train(2)
    assert w.trainer is tr  # one trainer across clicks: it keeps counting fast steps
    assert tr.cfg.lr == pytest.approx(1e-2) and tr.cfg.rl_variant == "reinforce" and tr.cfg.t_lambda == 100.0
    assert all(g["lr"] == pytest.approx(1e-2) for g in tr.fast_opt.param_groups)
    assert [r["lr"] for r in recs] == pytest.approx([1e-2, 1e-2])
    assert [r["ce_weight"] for r in recs] == pytest.approx([0.5, 0.5])
    assert recs[0]["lambda"] == pytest.approx(lambda_schedule(1, 100.0, 0.05))  # the new T_λ at t = 1


def test_static_figure_copies_the_state(deep_model):
    w = make(deep_model)
    w.kl_floor.value = 0.2
    w.train(2)
    s = w.static_figure()
    assert type(s) is go.Figure
    assert [t.meta for t in s.data] == [t.meta for t in w.fig.data]
    for a, b in zip(s.data, w.fig.data, strict=True):
        assert list(a.x) == list(b.x) and list(a.y) == list(b.y)
    assert "2 fast steps" in s.layout.title.text
    w.train(1)  # a copy: later streaming does not touch it
    assert len(s.data[TRACE_NAMES.index("loss")].x) == 2 and len(w.trace("loss").x) == 3


def test_widgets_are_independent_no_globals(deep_model):
    a, b = make(deep_model), make(deep_model)
    a.t_lambda.value = 6.0
    a.kl_floor.value = 0.5
    assert ys(a) == lambda_curve(40, 6.0, 0.5)
    assert ys(b) == lambda_curve(40, 10.0, 0.05) and b.cfg.t_lambda == 10.0
    assert "invalid" not in b.status_text and a.status_text != b.status_text
    a.train(1)
    assert b.trainer is None and b.records == [] and len(b.trace("loss").x or ()) == 0
    # no module-level mutable state the callbacks could share
    for name, v in vars(dvi_widget).items():
        if not name.startswith("__"):
            assert not isinstance(v, (list, dict, set, bytearray)), name


def test_dvi_modules_import_without_the_course_extra():
    """ipywidgets, plotly and anywidget are imported only when a widget is built: every dvi module imports
    in an interpreter where they are blocked."""
    code = ("import sys\n"
            "for m in ('ipywidgets', 'plotly', 'anywidget'):\n"
            "    sys.modules[m] = None  # an import of it now raises ImportError\n"
            "import importlib\n"
            "for m in ('config', 'losses', 'buffer', 'policy', 'drafter', 'learner', 'checkpoint', 'cli', "
            "          'figure', 'widget'):\n"
            "    importlib.import_module('dvi_lite.methods.dvi.' + m)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_for_model_drives_a_real_run_on_a_named_model():
    """LambdaWidget.for_model: a model name (here the course model; the notebook passes "smollm2"), the Spec-Bench
    dev training stream, the model's eos; a click runs real online training on that model."""
    w = LambdaWidget.for_model("course", dtype="float32", cfg=DVIConfig(**{**BASE, "fast_every": 4, "batch_size": 4}),
                               questions=3, vocab=None, max_new_tokens=8, horizon=20, steps_per_click=1)
    assert len(w.prompts_ids) == 3 and w.trainer_kwargs["eos_token_id"] == w.tokenizer.eos_token_id
    recs = w.train(1)
    assert len(recs) == 1 and w.trainer.fast_step == 1 and math.isfinite(recs[0]["loss"])
    with pytest.raises(ValueError, match="tokenizer"):
        LambdaWidget.for_model(w.model)  # a loaded model needs its tokenizer
