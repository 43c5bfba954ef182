"""Committed notebook outputs are cleaned of machine paths, frozen progress bars and deprecation notices."""
from pathlib import Path

from dvi_lite.measure.scrub import scrub

ROOT = Path("/somewhere/dvi_lite").resolve()


def nb(outputs: list[dict]) -> dict:
    return {"cells": [{"cell_type": "code", "source": "print(1)", "outputs": outputs}],
            "metadata": {"papermill": {"input_path": f"{ROOT}/notebooks/x.ipynb", "output_path": f"{ROOT}/build/x"}}}


def test_scrub_removes_bars_and_deprecations_and_relativises_paths():
    outs = [
        {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "a"},
                                                 "text/plain": ["bench:   0%|          | 0/13 [00:00<?, ?it/s]"]}},
        {"output_type": "stream", "name": "stderr", "text": ["[transformers] Passing x is deprecated and will be "
                                                             "removed in future versions.\n"]},
        {"output_type": "stream", "name": "stdout", "text": [f"wrote {ROOT}/results/00_foundations.json\n",
                                                             "τ 1.84\n"]},
        {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "b"},
                                                 "text/plain": ["VBox(children=(FloatLogSlider(...),))"]}},
    ]
    out = scrub(nb(outs), ROOT)
    cell = out["cells"][0]
    assert cell["source"] == "print(1)"  # code untouched: the stamp of what ran stays valid
    assert [o["output_type"] for o in cell["outputs"]] == ["stream", "display_data"]  # bar and notice gone
    assert cell["outputs"][0]["text"] == ["wrote results/00_foundations.json\n", "τ 1.84\n"]
    assert "VBox" in cell["outputs"][1]["data"]["text/plain"][0]  # a real widget stays
    assert out["metadata"]["papermill"] == {"input_path": "notebooks/x.ipynb", "output_path": "build/x"}


def test_embedded_pngs_get_a_palette_and_stay_the_same_picture():
    import base64
    import io

    from PIL import Image

    from dvi_lite.measure.scrub import shrink_png

    im = Image.new("RGB", (300, 120), "white")
    for x in range(300):  # a chart-like picture: a few flat colours and a gradient line
        im.putpixel((x, 60 + x % 7), (31, 119, 180))
        im.putpixel((x, 20), (255 - x % 200, 127, 14))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    png = buf.getvalue()
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "display_data", "data": {"image/png": base64.b64encode(png).decode()}}]}], "metadata": {}}
    out = scrub(nb, Path("/nowhere"))["cells"][0]["outputs"][0]["data"]["image/png"]
    small = base64.b64decode(out)
    assert len(small) <= len(png) and small == shrink_png(png)
    back = Image.open(io.BytesIO(small)).convert("RGB")
    assert back.size == im.size and back.tobytes() == im.tobytes()  # few colours: nothing lost


def test_a_latex_copy_beside_html_goes_and_a_lone_one_stays():
    both = {"output_type": "execute_result", "data": {"text/html": ["<pre>def f(): ...</pre>"],
                                                      "text/latex": ["\\begin{Verbatim}..."], "text/plain": ["f"]}}
    alone = {"output_type": "display_data", "data": {"text/latex": ["$x^2$"], "text/plain": ["x**2"]}}
    out = scrub(nb([both, alone]), ROOT)["cells"][0]["outputs"]
    assert set(out[0]["data"]) == {"text/html", "text/plain"} and "text/latex" in out[1]["data"]


def test_a_cells_run_timestamps_go_and_its_tags_stay():
    meta = {"papermill": {"duration": 0.1, "start_time": "2026-11-28T07:13:48Z", "status": "completed"},
            "execution": {"iopub.status.busy": "2026-11-28T07:01:47Z"}, "tags": ["parameters"]}
    book = {"cells": [{"cell_type": "code", "source": "", "metadata": meta, "outputs": []},
                      {"cell_type": "markdown", "source": "x", "metadata": {"papermill": {"duration": 0.0}}}],
            "metadata": {}}
    out = scrub(book, Path("/nowhere"))
    assert out["cells"][0]["metadata"] == {"tags": ["parameters"]} and out["cells"][1]["metadata"] == {}
