"""Saving plotly figures the same way everywhere: offline HTML always, PNG when a browser exists.

HTML uses include_plotlyjs="directory": one plotly.min.js beside the figures instead of 3.5 MB
inlined per file, and no CDN (which fails offline). PNG needs kaleido + a Chromium
(`apt-get install chromium`); without one we say so once and keep the HTML.

Every figure uses the "dvi_lite" template (`use_slim_template`): plotly's default look without the 3-D, polar, map
and ternary defaults no figure here draws, which are 5 of the 7 KB plotly stores in every saved figure. With
about a hundred figures in the committed notebooks and figures/, that is half a MB of the tracked tree.

`method_color` gives every method one colour, shared by every figure. `notebook_renderer` makes `fig.show()`
emit JupyterLab's native plotly output plus a static PNG (so a code host, which cannot run plotly, shows the
PNG); `make reproduce` turns it on through DVI_PLOTLY_RENDERER for the notebooks it commits.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from dvi_lite.paths import BUILD_DIR, ROOT, output_dir
from dvi_lite.study.scrub import shrink_file

FIGURES_DIR = ROOT / "figures"
_warned = False

# one colour per method (a variant "kangaroo:branch=2" takes its method's), shared by every figure
METHOD_COLORS = {"ar": "#6c757d", "hf": "#adb5bd", "hf_assisted": "#f4a261", "sps": "#e76f51", "pld": "#8ab17d",
                 "hf_pld": "#b5d99c", "early_exit": "#a8dadc", "kangaroo": "#2a9d8f", "draft_verify": "#264653",
                 "medusa": "#9b5de5", "dvi": "#e63946", "eagle": "#ff9f1c"}
RENDERER_ENV = "DVI_PLOTLY_RENDERER"  # e.g. "plotly_mimetype+png": set by `make reproduce`
PNG_SIZE = {"width": 900, "height": 500, "scale": 1}  # the PNG fallback embedded in committed notebooks
SLIM_SKIPS = ("polar", "ternary", "scene", "geo")  # template layout parts no figure here uses
SLIM_TRACES = ("scatter", "bar", "heatmap", "histogram", "box")  # trace types whose template defaults are kept


def use_slim_template() -> str:
    """Register plotly's default template, trimmed to what these figures use, as "dvi_lite" and make it the default."""
    import plotly.graph_objects as go
    import plotly.io as pio

    base = pio.templates["plotly"]
    layout = {k: v for k, v in base.layout.to_plotly_json().items() if k not in SLIM_SKIPS}
    data = {k: v for k, v in base.data.to_plotly_json().items() if k in SLIM_TRACES}
    pio.templates["dvi_lite"] = go.layout.Template(layout=layout, data=data)
    pio.templates.default = "dvi_lite"
    return "dvi_lite"


def method_color(label: str) -> str:
    """The colour of a method, or of a variant label ("kangaroo:threshold=0.4") by its method."""
    return METHOD_COLORS.get(label.split(":")[0], "#333333")


def notebook_renderer() -> str | None:
    """Set plotly's default renderer from DVI_PLOTLY_RENDERER (if set), sizing its PNG; returns it."""
    name = os.environ.get(RENDERER_ENV)
    if name:
        import plotly.io as pio

        pio.renderers.default = name
        if "png" in name:
            for k, v in PNG_SIZE.items():
                setattr(pio.renderers["png"], k, v)
    return name


def figures_dir(smoke: bool) -> Path:
    """figures/ for full runs (committed); build/figures for smoke runs (never committed)."""
    d = BUILD_DIR / "figures" if smoke else output_dir("figures")
    d.mkdir(parents=True, exist_ok=True)
    return d


def browser_available() -> bool:
    return any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "chrome"))


def save_figure(fig, name: str, smoke: bool = False, png: bool = True) -> list[Path]:
    """Write <name>.html (and <name>.png if possible) into the figures folder; return the paths."""
    global _warned
    out = figures_dir(smoke)
    paths = [out / f"{name}.html"]
    fig.write_html(paths[0], include_plotlyjs="directory", full_html=True)
    if png and browser_available():
        try:
            # plotly's default export is 700 px wide, which clips a long title: use the notebooks' PNG width
            fig.write_image(out / f"{name}.png", width=fig.layout.width or PNG_SIZE["width"],
                            height=fig.layout.height or PNG_SIZE["height"], scale=PNG_SIZE["scale"])
            shrink_file(out / f"{name}.png")
            paths.append(out / f"{name}.png")
        except Exception as e:  # kaleido/chromium trouble must not lose the HTML figure
            warnings.warn(f"PNG export of {name} failed ({e}); HTML written", stacklevel=2)
    elif png and not _warned:
        warnings.warn("no Chromium found: figures are written as HTML only (apt-get install chromium for PNG)",
                      stacklevel=2)
        _warned = True
    return paths



def legend_below(fig, height: int = 520):
    """Move the legend under the plot, in a row: side-by-side subplots keep their full width and their titles
    do not collide (a legend on the right squeezes both panels)."""
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0),
                      margin=dict(b=110, t=110), height=height)
    return fig


def series_color(i: int) -> str:
    """The i-th colour of plotly's default sequence: pass it explicitly so a series keeps one colour across
    subplots (a trace hidden from the legend otherwise takes the next default colour)."""
    import plotly.express as px

    seq = px.colors.qualitative.Plotly
    return seq[i % len(seq)]


use_slim_template()  # every notebook imports this module, so every figure a notebook draws uses it
notebook_renderer()  # ... and `make reproduce` reaches each kernel here
