"""The course's plotly look: one template, the notebooks' renderer, legends and series colours.

Saving a figure (offline HTML always, PNG when a browser exists) and each method's colour live below the methods,
in measure.figures, so a method's widget and the study's tables save and colour figures the same way.

Every figure uses the "dvi_lite" template (`use_slim_template`): plotly's default look without the 3-D, polar, map
and ternary defaults no figure here draws, which are 5 of the 7 KB plotly stores in every saved figure. With
about a hundred figures in the committed notebooks and figures/, that is half a MB of the tracked tree.

`notebook_renderer` makes `fig.show()` emit JupyterLab's native plotly output plus a static PNG (so a code host,
which cannot run plotly, shows the PNG); `make reproduce` turns it on through DVI_PLOTLY_RENDERER for the notebooks
it commits.
"""
from __future__ import annotations

import os

from dvi_lite.measure.figures import PNG_SIZE, RENDERER_ENV, png_server

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


def notebook_renderer() -> str | None:
    """Set plotly's default renderer from DVI_PLOTLY_RENDERER (if set), sizing its PNG; returns it."""
    name = os.environ.get(RENDERER_ENV)
    if name:
        import plotly.io as pio

        pio.renderers.default = name
        if "png" in name:
            png_server()  # every fig.show() renders a PNG: one browser for the whole kernel
            for k, v in PNG_SIZE.items():
                setattr(pio.renderers["png"], k, v)
    return name


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
