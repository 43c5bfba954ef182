"""Saving plotly figures the same way everywhere: offline HTML always, PNG when a browser exists.

HTML uses include_plotlyjs="directory": one plotly.min.js beside the figures instead of 3.5 MB
inlined per file, and no CDN (which fails offline). PNG needs kaleido + a Chromium
(`apt-get install chromium`); without one we say so once and keep the HTML.
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from dvi_lite.paths import BUILD_DIR, ROOT

FIGURES_DIR = ROOT / "figures"
_warned = False


def figures_dir(smoke: bool) -> Path:
    """figures/ for full runs (committed); build/figures for smoke runs (never committed)."""
    d = BUILD_DIR / "figures" if smoke else FIGURES_DIR
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
            fig.write_image(out / f"{name}.png", scale=2)
            paths.append(out / f"{name}.png")
        except Exception as e:  # kaleido/chromium trouble must not lose the HTML figure
            warnings.warn(f"PNG export of {name} failed ({e}); HTML written", stacklevel=2)
    elif png and not _warned:
        warnings.warn("no Chromium found: figures are written as HTML only (apt-get install chromium for PNG)",
                      stacklevel=2)
        _warned = True
    return paths
