"""Saving plotly figures the same way everywhere: offline HTML always, PNG when a browser exists.

HTML uses include_plotlyjs="directory": one plotly.min.js beside the figures instead of 3.5 MB
inlined per file, and no CDN (which fails offline). PNG needs kaleido + a Chromium
(`apt-get install chromium`); without one we say so once and keep the HTML. `png_server` keeps one Chromium
open for the process: kaleido otherwise starts a browser per image (about 2 s each, 0.15 s with one kept open).

`method_color` gives every method one colour, shared by every figure. Nothing here imports plotly: a figure
arrives built, so a method's widget saves its figure without the course's extras (course.plots holds the look:
the template and the notebooks' renderer).
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from dvi_lite.measure.scrub import shrink_file
from dvi_lite.paths import BUILD_DIR, ROOT, output_dir

FIGURES_DIR = ROOT / "figures"
_warned = False
_server: bool | None = None  # png_server's state: None until first asked

# one colour per method (a variant "kangaroo:branch=2" takes its method's), shared by every figure
METHOD_COLORS = {"ar": "#6c757d", "hf": "#adb5bd", "hf_assisted": "#f4a261", "sps": "#e76f51", "pld": "#8ab17d",
                 "hf_pld": "#b5d99c", "early_exit": "#a8dadc", "kangaroo": "#2a9d8f", "draft_verify": "#264653",
                 "medusa": "#9b5de5", "dvi": "#e63946", "eagle": "#ff9f1c"}
RENDERER_ENV = "DVI_PLOTLY_RENDERER"  # e.g. "plotly_mimetype+png": set by `make reproduce`
PNG_SIZE = {"width": 900, "height": 500, "scale": 1}  # the PNG fallback embedded in committed notebooks


def method_color(label: str) -> str:
    """The colour of a method, or of a variant label ("kangaroo:threshold=0.4") by its method."""
    return METHOD_COLORS.get(label.split(":")[0], "#333333")


def figures_dir(smoke: bool) -> Path:
    """figures/ for full runs (committed); build/figures for smoke runs (never committed)."""
    d = BUILD_DIR / "figures" if smoke else output_dir("figures")
    d.mkdir(parents=True, exist_ok=True)
    return d


def browser_available() -> bool:
    return any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "chrome"))


def png_server() -> bool:
    """Start kaleido's shared Chromium once per process, so each PNG (saved, or the notebooks' PNG fallback)
    reuses it; returns whether it runs. Without kaleido or a browser the caller falls back as before."""
    global _server
    if _server is None:
        _server = False
        if browser_available():
            try:
                import kaleido

                kaleido.start_sync_server(silence_warnings=True)
                _server = True
            except Exception:  # an old kaleido or no browser it can drive: one browser per image, as before
                pass
        warnings.filterwarnings("ignore", message="The kopts argument is ignored if using a server")
    return _server


def save_figure(fig, name: str, smoke: bool = False, png: bool = True) -> list[Path]:
    """Write <name>.html (and <name>.png if possible) into the figures folder; return the paths."""
    global _warned
    out = figures_dir(smoke)
    paths = [out / f"{name}.html"]
    fig.write_html(paths[0], include_plotlyjs="directory", full_html=True)
    if png and browser_available():
        png_server()
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
