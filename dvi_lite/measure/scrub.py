"""What a committed notebook must not show a learner: machine paths, frozen progress bars, library deprecations.

`make reproduce` writes each full run back into notebooks/ (study.reproduce.write_back), and this cleans the
outputs first. It never touches code, so the stamp of the code a run executed stays valid:
- a progress bar saved in a notebook is frozen at its first frame (a tqdm widget's text is "0%|"), so it goes;
- a library's deprecation notice on stderr says nothing about the lesson, so its lines go;
- an absolute path of this checkout ("/home/.../dvi_lite/results/x.json") becomes relative ("results/x.json"),
  and so do papermill's input and output paths;
- an embedded PNG is stored with a 256-colour palette (`shrink_png`): a plotly chart has few colours, so it looks
  the same at about a quarter of the bytes, and every committed MB is one the GPU machine's copy cannot carry;
- a LaTeX copy of an output that also has HTML (IPython's `Code` display of a function's source) goes: JupyterLab
  and GitHub show the HTML, and the LaTeX is only for PDF export;
- each cell's run timestamps (papermill's start, end and duration, the kernel's `execution` times) go: they say when
  the machine ran the cell, not what the lesson shows (reproduce.json keeps each notebook's wall time).
"""
from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

from dvi_lite.paths import atomic_write_bytes

WIDGET = "application/vnd.jupyter.widget-view+json"
BAR = re.compile(r"\d+%\|")  # tqdm's bar: " 37%|███▋      | 37/100 [00:01<00:02, ...]"
CELL_TIMES = ("papermill", "execution")  # a cell's run timestamps
NOISE = re.compile(r"is deprecated|will be removed in|DeprecationWarning|FutureWarning")


def _text(x) -> str:
    return x if isinstance(x, str) else "".join(x)


def shrink_png(data: bytes) -> bytes:
    """The PNG with a 256-colour palette (no dithering), when that is smaller; unchanged without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return data
    im = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    im.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, "PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


def shrink_file(path: str | Path) -> None:
    """A PNG file rewritten by `shrink_png`, in place (atomically)."""
    path = Path(path)
    atomic_write_bytes(path, shrink_png(path.read_bytes()))


def _shrink_images(o: dict) -> dict:
    png = o.get("data", {}).get("image/png")
    if not isinstance(png, str):
        return o
    small = base64.b64encode(shrink_png(base64.b64decode(png))).decode()
    return {**o, "data": {**o["data"], "image/png": small}}


def _keep_output(o: dict) -> dict | None:
    """The output with progress bars and deprecation lines removed; None when nothing is left."""
    data = o.get("data", {})
    if "text/latex" in data and "text/html" in data:
        o = {**o, "data": {k: v for k, v in data.items() if k != "text/latex"}}
    if WIDGET in data and BAR.search(_text(data.get("text/plain", ""))):
        return None
    if o.get("output_type") == "stream":
        lines = [ln for ln in _text(o.get("text", "")).splitlines(True)
                 if not BAR.search(ln) and not (o.get("name") == "stderr" and NOISE.search(ln))]
        if not lines:
            return None
        o = {**o, "text": lines}
    return _shrink_images(o)


def scrub(nb: dict, root: Path) -> dict:
    """The notebook with its outputs cleaned (see the module's docstring); code cells' sources unchanged."""
    prefix = str(Path(root).resolve()) + "/"
    for cell in nb.get("cells", []):
        for key in CELL_TIMES:
            cell.get("metadata", {}).pop(key, None)
        if "outputs" in cell:
            kept = (_keep_output(o) for o in cell["outputs"])
            cell["outputs"] = [json.loads(json.dumps(o).replace(prefix, "")) for o in kept if o is not None]
    pm = nb.get("metadata", {}).get("papermill", {})
    for key in ("input_path", "output_path"):
        if isinstance(pm.get(key), str):
            pm[key] = pm[key].replace(prefix, "")
    return nb
