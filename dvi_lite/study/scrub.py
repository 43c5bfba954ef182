"""What a committed notebook must not show a learner: machine paths, frozen progress bars, library deprecations.

`make reproduce` writes each full run back into notebooks/ (study.reproduce.write_back), and this cleans the
outputs first. It never touches code, so the stamp of the code a run executed stays valid:
- a progress bar saved in a notebook is frozen at its first frame (a tqdm widget's text is "0%|"), so it goes;
- a library's deprecation notice on stderr says nothing about the lesson, so its lines go;
- an absolute path of this checkout ("/home/.../dvi_lite/results/x.json") becomes relative ("results/x.json"),
  and so do papermill's input and output paths.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

WIDGET = "application/vnd.jupyter.widget-view+json"
BAR = re.compile(r"\d+%\|")  # tqdm's bar: " 37%|███▋      | 37/100 [00:01<00:02, ...]"
NOISE = re.compile(r"is deprecated|will be removed in|DeprecationWarning|FutureWarning")


def _text(x) -> str:
    return x if isinstance(x, str) else "".join(x)


def _keep_output(o: dict) -> dict | None:
    """The output with progress bars and deprecation lines removed; None when nothing is left."""
    data = o.get("data", {})
    if WIDGET in data and BAR.search(_text(data.get("text/plain", ""))):
        return None
    if o.get("output_type") == "stream":
        lines = [ln for ln in _text(o.get("text", "")).splitlines(True)
                 if not BAR.search(ln) and not (o.get("name") == "stderr" and NOISE.search(ln))]
        if not lines:
            return None
        o = {**o, "text": lines}
    return o


def scrub(nb: dict, root: Path) -> dict:
    """The notebook with its outputs cleaned (see the module's docstring); code cells' sources unchanged."""
    prefix = str(Path(root).resolve()) + "/"
    for cell in nb.get("cells", []):
        if "outputs" in cell:
            kept = (_keep_output(o) for o in cell["outputs"])
            cell["outputs"] = [json.loads(json.dumps(o).replace(prefix, "")) for o in kept if o is not None]
    pm = nb.get("metadata", {}).get("papermill", {})
    for key in ("input_path", "output_path"):
        if isinstance(pm.get(key), str):
            pm[key] = pm[key].replace(prefix, "")
    return nb
