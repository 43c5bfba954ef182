"""The static HTML book (`make book`, dvi_lite.study.book): built from the committed notebooks, offline, interactive.

The unit tests build the book into a temporary folder and read the HTML; the browser test (`make test-browser`,
deselected by default) serves build/book on 127.0.0.1, opens every page in headless Chromium with every request
off that server refused, and checks that the plotly figures render and the math is typeset (local MathJax)
without console errors; full-page
screenshots go to build/book_screens/NN.png.
"""
from __future__ import annotations

import functools
import html
import os
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest

from dvi_lite.study import book

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SCREENS = REPO / "build" / "book_screens"
CHROMIUM = Path("/usr/bin/chromium")
REQUIRED = os.environ.get("DVI_BROWSER_REQUIRED") == "1"  # set by `make test-browser`
# every <script src=...> and <link href=...> of a page: none may leave the book
REFS = re.compile(r"<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*[\"']?([^\"'\s>]*)", re.I)


def _n_plotly(path: Path) -> int:
    nb = nbformat.read(path, as_version=4)
    return sum(book.PLOTLY_MIME in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("book")
    book.build(out, verbose=False)
    return out


def test_prepare_rewrites_outputs():
    """Plotly outputs become HTML without their PNG, progress bars go, other widgets leave a note, paths move."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 07 · Title: more\n![d](../figures/diagrams/x.svg)"),
        nbformat.v4.new_code_cell("fig", outputs=[
            nbformat.v4.new_output("display_data", data={book.PLOTLY_MIME: {"data": [{"y": [1, 2]}],
                                                                            "layout": {"title": {"text": "</s>"}}},
                                                         "image/png": "iVBORw0KGgo="}),
            nbformat.v4.new_output("display_data", data={book.WIDGET_MIME: {"model_id": "a"},
                                                         "text/plain": "bench:   0%|          | 0/4 [00:00<?]"}),
            nbformat.v4.new_output("display_data", data={book.WIDGET_MIME: {"model_id": "b"},
                                                         "text/plain": "VBox(children=(...))"}),
        ]),
    ]
    assert book.first_heading(nb, "x") == "07 · Title: more"
    assert book.prepare(nb, "07 · Title: more") == 1
    assert "widgets" not in nb.metadata and nb.metadata["title"] == "07 · Title: more"
    assert "](figures/diagrams/x.svg)" in nb.cells[0].source
    fig, note = nb.cells[1].outputs
    assert set(fig.data) == {"text/html"} and "Plotly.newPlot" in fig.data["text/html"]
    assert "<\\/s>" in fig.data["text/html"] and "</s>" not in fig.data["text/html"]
    assert set(note.data) == {"text/html"} and "JupyterLab" in note.data["text/html"]


def test_book_from_committed_notebooks(built: Path):
    assert len(NOTEBOOKS) >= 7
    index = (built / "index.html").read_text(encoding="utf-8")
    assert (built / "plotly.min.js").stat().st_size > 1_000_000
    assert (built / book.MATHJAX_JS).stat().st_size > 1_000_000
    for nb_path in NOTEBOOKS:
        name = f"{nb_path.stem}.html"
        title = book.first_heading(nbformat.read(nb_path, as_version=4), nb_path.stem)
        assert f'href="{name}">{html.escape(title)}</a>' in index, name
        page = (built / name).read_text(encoding="utf-8")
        n_fig = page.count("Plotly.newPlot")
        assert n_fig >= 1 and n_fig == _n_plotly(nb_path), (name, n_fig)
        assert "data:image/png;base64" not in page, f"{name} still carries a PNG fallback"
        assert 'href="index.html"' in page
        # plotly.min.js, MathJax's config and MathJax.js, and one script per figure: nothing else
        assert page.count("<script") == n_fig + 3
        assert "window.MathJax = " in page and f'<script src="{book.MATHJAX_JS}">' in page
        assert len(page) < 1_000_000, f"{name} is {len(page)} bytes"
    for page in [index, *(p.read_text(encoding="utf-8") for p in built.glob("*.html"))]:
        for ref in REFS.findall(page):
            assert not re.match(r"(?:[a-z][a-z0-9+.-]*:)?//", ref, re.I), f"remote resource {ref}"
            assert ref.startswith("data:") or (built / ref.split("?")[0]).is_file(), f"missing local resource {ref}"
    # prev / next chain the pages in order
    first, second = (f"{p.stem}.html" for p in NOTEBOOKS[:2])
    assert f'href="{second}" rel="next"' in (built / first).read_text(encoding="utf-8")
    assert f'href="{first}" rel="prev"' in (built / second).read_text(encoding="utf-8")


# ------------------------------------------------------------------ browser


def _missing_reason() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (Debian's chromium: `apt-get install chromium`, or run `make test-browser`)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the base class signature; the book test wants no access log
        pass


@pytest.mark.browser
def test_book_pages_render_in_chromium():
    reason = _missing_reason()
    if reason:
        if REQUIRED:
            pytest.fail(f"make test-browser cannot run: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    out = book.DEFAULT_OUT
    pages = book.build(out, verbose=False)
    SCREENS.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                        args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(60_000)
                errors: list[str] = []
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
                page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)

                def only_local(route):  # the book must work offline: refuse and record anything else
                    if route.request.url.startswith(base):
                        route.continue_()
                    else:
                        errors.append(f"remote request {route.request.url}")
                        route.abort()

                page.route("**/*", only_local)
                page.goto(base + "index.html", wait_until="load")
                assert page.locator("ul.book-toc li a").count() == len(pages)
                page.screenshot(path=str(SCREENS / "index.png"), full_page=True)
                for path in pages:
                    errors.clear()
                    page.goto(base + path.name, wait_until="load")
                    n_expected = page.locator(".book-plotly").count()
                    assert n_expected >= 1, path.name
                    page.wait_for_function(
                        "n => document.querySelectorAll('.book-plotly.js-plotly-plot .main-svg').length >= n",
                        arg=n_expected)
                    rendered = page.locator(".js-plotly-plot .plot-container").count()
                    assert rendered == n_expected, (path.name, rendered, n_expected)
                    # MathJax typesets after load: wait for its startup promise, then count the SVG formulas
                    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
                    page.evaluate("() => MathJax.startup.promise")
                    n_math = page.locator("mjx-container[jax='SVG'] svg").count()
                    assert n_math > 0, f"{path.name}: no formula typeset"
                    errs = page.locator("[data-mjx-error]").count()
                    assert errs == 0, f"{path.name}: {errs} formulas MathJax could not typeset"
                    assert page.locator("nav.book-nav a[href='index.html']").count() >= 1
                    page.wait_for_timeout(300)
                    page.screenshot(path=str(SCREENS / f"{path.name[:2]}.png"), full_page=True)
                    assert errors == [], f"{path.name}: {errors}"
                    print(f"\n{path.name}: {rendered} plotly figures rendered, {n_math} formulas typeset")
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
    for path in pages:
        shot = SCREENS / f"{path.name[:2]}.png"
        assert shot.exists() and shot.stat().st_size > 10_000, shot
