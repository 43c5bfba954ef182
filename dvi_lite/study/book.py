"""The course as a static HTML book: build/book/ from the committed notebooks and their outputs, fully offline.

`python -m dvi_lite.study.book [--out build/book]` (or `make book`) writes index.html plus one NN_name.html per
notebook (nbconvert's HTMLExporter, lab template). Nothing is fetched at build or view time: the lab template's
remote scripts (require.js, MathJax from a CDN, mermaid, the widget manager) are left out. Math is typeset by a
local MathJax 3 (`tex-svg-full.js` from the django-static-mathjax package, copied once): its SVG output draws
glyphs from font data inside the script, so no web font and no extension is fetched; plotly.js is copied once
from the installed plotly package, and every stored plotly figure
(application/vnd.plotly.v1+json) becomes a live `Plotly.newPlot` output in place of its PNG fallback. The lab CSS
is written once (lab.css) instead of inlined into every page, so a page is little more than its notebook's text.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jinja2 import DictLoader
from nbconvert import HTMLExporter

from dvi_lite.commands import prog
from dvi_lite.paths import BUILD_DIR, ROOT

NOTEBOOKS_DIR = ROOT / "notebooks"
DIAGRAMS_DIR = ROOT / "figures" / "diagrams"
DEFAULT_OUT = BUILD_DIR / "book"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TQDM_TEXT = re.compile(r"\d+%\|")  # a tqdm progress bar's text/plain fallback ("bench:   0%|   | 0/10 ...")
# a <script src=...> or <link href=...> that leaves the book (absolute or protocol-relative URL)
REMOTE_REF = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:[a-z][a-z0-9+.-]*:)?//", re.I)
# MathJax 3: TeX in ($...$ inline, as in Jupyter), SVG out, no context menu (it would load more scripts)
MATHJAX_CONFIG = {"tex": {"inlineMath": [["$", "$"], ["\\(", "\\)"]],
                          "displayMath": [["$$", "$$"], ["\\[", "\\]"]],
                          "processEscapes": True, "processEnvironments": True},
                  "svg": {"fontCache": "global"}, "options": {"enableMenu": False}}
MATHJAX_JS = "tex-svg-full.js"
SUMMARY = "A static, offline copy of the course notebooks with their committed outputs"

# The lab template minus everything remote; the stylesheet is linked (written once), the nav bar added.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}
<link rel="icon" href="data:,">
<script src="plotly.min.js"></script>
<script>
{{ resources.mathjax_config }}
</script>
<script src="tex-svg-full.js"></script>
{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block notebook_css %}
<link rel="stylesheet" href="lab.css">
<link rel="stylesheet" href="book.css">
{% endblock notebook_css %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block body_header -%}
<body class="jp-Notebook" data-jp-theme-light="true" data-jp-theme-name="JupyterLab Light">
{{ resources.book_nav }}
<main>
{%- endblock body_header -%}
{% block body_footer %}
</main>
{{ resources.book_nav }}
</body>
{% endblock body_footer %}
"""

# The small rules the lab template inlines with its CSS, plus the nav bar and the index page.
BOOK_CSS = """* { -webkit-print-color-adjust: exact; }
a.anchor-link, .jp-Collapser { display: none; }
.jp-InputArea, .jp-InputArea-editor { overflow: hidden; }
.jp-OutputArea-output pre { line-height: inherit; font-family: inherit; }
.jp-RenderedText pre { color: var(--jp-content-font-color1); font-size: var(--jp-code-font-size); }
.book-nav { display: flex; gap: 1.5em; padding: 0.6em 1em; background: #f3f4f6; border-bottom: 1px solid #ddd;
            font: 14px system-ui, sans-serif; }
.book-nav a { color: #1a56db; text-decoration: none; }
.book-nav .spacer { flex: 1; }
.book-plotly { width: 100%; }
.book-widget-note { color: #666; font-style: italic; }
body.book-index { max-width: 60em; margin: 2em auto; padding: 0 1em; font: 16px/1.5 system-ui, sans-serif; }
body.book-index .book-toc { list-style: none; padding: 0; }
body.book-index li { margin: 0.5em 0; }
body.book-index .meta { color: #666; font-size: 0.9em; }
"""


@dataclass
class Page:
    """One notebook of the book: its source, output file name and title (the first markdown heading)."""

    source: Path
    html_name: str
    title: str

    @property
    def short_title(self) -> str:
        """The title up to its first colon ("01 · Speculative sampling"), for the nav bar."""
        return self.title.split(":")[0].strip()


def first_heading(nb: nbformat.NotebookNode, default: str) -> str:
    """The text of the notebook's first markdown heading (`# ...`), or `default` when it has none."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.lstrip().startswith("#"):
                    return line.lstrip().lstrip("#").strip()
    return default


def plotly_html(fig: dict, div_id: str) -> str:
    """A div plus the script that draws the stored figure into it with the book's local plotly.min.js."""
    config = {**fig.get("config", {}), "responsive": True}
    args = [fig.get("data", []), fig.get("layout", {}), config]
    # "</" inside a <script> would end it early: JSON allows escaping the slash
    payload = ", ".join(json.dumps(a, separators=(",", ":")).replace("</", "<\\/") for a in args)
    return (f'<div id="{div_id}" class="book-plotly"></div>\n'
            f'<script>Plotly.newPlot(document.getElementById("{div_id}"), {payload});</script>')


def prepare(nb: nbformat.NotebookNode, title: str) -> int:
    """Rewrite the notebook (in memory) for the book; returns its number of interactive figures.

    Plotly outputs become HTML outputs (their PNG fallback dropped); widget outputs cannot run without a kernel,
    so tqdm progress bars (whose stored text is the 0% state) are dropped and other widgets leave a note; the
    saved widget state goes too (it would pull the widget manager from a CDN). Markdown paths into ../figures/
    point at the book's own figures/ copy."""
    nb.metadata.pop("widgets", None)
    nb.metadata["title"] = title
    n_figures = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = cell.source.replace("../figures/", "figures/")
            continue
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                n_figures += 1
                out.data = {"text/html": plotly_html(data[PLOTLY_MIME], f"book-fig-{n_figures}")}
                out.metadata = {}
            elif WIDGET_MIME in data:
                if TQDM_TEXT.search(data.get("text/plain", "")):
                    continue
                out.data = {"text/html": '<p class="book-widget-note">(An interactive widget: open this notebook '
                                         "in JupyterLab, <code>make lab</code>, to use it.)</p>"}
                out.metadata = {}
            outputs.append(out)
        if cell.cell_type == "code":
            cell.outputs = outputs
    return n_figures


def nav_html(pages: list[Page], i: int) -> str:
    """The nav bar of page i: the contents, the previous and the next notebook."""
    links = ['<a href="index.html">Contents</a>', '<span class="spacer"></span>']
    if i > 0:
        links.append(f'<a href="{pages[i - 1].html_name}" rel="prev">&larr; {html.escape(pages[i - 1].short_title)}'
                     "</a>")
    if i + 1 < len(pages):
        links.append(f'<a href="{pages[i + 1].html_name}" rel="next">{html.escape(pages[i + 1].short_title)} '
                     "&rarr;</a>")
    return '<nav class="book-nav">' + "\n".join(links) + "</nav>"


def index_html(pages: list[Page], figures: list[int]) -> str:
    """The book's contents page: one link per notebook, titled with its first heading."""
    items = "\n".join(f'<li><a href="{p.html_name}">{html.escape(p.title)}</a> '
                      f'<span class="meta">({n} interactive figures)</span></li>'
                      for p, n in zip(pages, figures, strict=True))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link rel="icon" href="data:,">
<title>dvi_lite: a course on speculative decoding</title>
<link rel="stylesheet" href="book.css">
</head>
<body class="book-index">
<h1>dvi_lite: a course on speculative decoding</h1>
<p>{SUMMARY}: speculative sampling, Kangaroo, Draft &amp; Verify, Medusa and DVI, on a small course model
and SmolLM2. The figures are interactive (plotly.js is bundled); to run the code, open the notebooks in
JupyterLab (<code>make lab</code>).</p>
<ul class="book-toc">
{items}
</ul>
</body>
</html>
"""


def mathjax_dir() -> Path:
    """MathJax 3's browser builds (es5/), shipped by the django-static-mathjax package (a course dependency;
    it installs a plain `mathjax` folder and needs no Django)."""
    try:
        import mathjax
    except ImportError as e:
        raise ImportError("the book typesets math with MathJax from django-static-mathjax: "
                          "pip install -e '.[course]' (or `make setup`)") from e
    es5 = Path(next(iter(mathjax.__path__))) / "static" / "mathjax" / "es5"
    if not (es5 / MATHJAX_JS).is_file():
        raise FileNotFoundError(f"{MATHJAX_JS} not found in {es5}")
    return es5


def _lab_css(exporter: HTMLExporter) -> str:
    """The lab template's stylesheets (index.css and the light theme), read from its static/ folder."""
    for folder in exporter.template_paths:
        static = Path(folder) / "static"
        if (static / "index.css").is_file():
            return "\n".join((static / name).read_text(encoding="utf-8") for name in ("index.css", "theme-light.css"))
    raise FileNotFoundError(f"nbconvert's lab template static/index.css not found in {exporter.template_paths}")


def build(out: Path = DEFAULT_OUT, notebooks_dir: Path = NOTEBOOKS_DIR, diagrams_dir: Path = DIAGRAMS_DIR,
          verbose: bool = True) -> list[Path]:
    """Build the book into `out` (created if missing, files overwritten); returns the notebook pages written."""
    import plotly

    sources = sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no NN_*.ipynb notebooks in {notebooks_dir}")
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab", template_file="book.html.j2",
                            extra_loaders=[DictLoader({"book.html.j2": TEMPLATE})])
    shutil.copyfile(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", out / "plotly.min.js")
    shutil.copyfile(mathjax_dir() / MATHJAX_JS, out / MATHJAX_JS)
    (out / "lab.css").write_text(_lab_css(exporter), encoding="utf-8")
    (out / "book.css").write_text(BOOK_CSS, encoding="utf-8")
    if diagrams_dir.is_dir():
        shutil.copytree(diagrams_dir, out / "figures" / diagrams_dir.name, dirs_exist_ok=True)

    nbs = [nbformat.read(src, as_version=4) for src in sources]
    pages = [Page(src, f"{src.stem}.html", first_heading(nb, src.stem)) for src, nb in zip(sources, nbs, strict=True)]
    written, figures = [], []
    for i, (page, nb) in enumerate(zip(pages, nbs, strict=True)):
        n_figures = prepare(nb, page.title)
        resources = {"book_nav": nav_html(pages, i),
                     "mathjax_config": "window.MathJax = " + json.dumps(MATHJAX_CONFIG) + ";"}
        body, _ = exporter.from_notebook_node(nb, resources=resources)
        if bad := REMOTE_REF.search(body):
            raise RuntimeError(f"{page.html_name} would load a remote resource: {bad.group(0)}")
        path = out / page.html_name
        path.write_text(body, encoding="utf-8")
        written.append(path)
        figures.append(n_figures)
        if verbose:
            print(f"  {page.html_name:<34} {path.stat().st_size / 1024:8.1f} KB  {n_figures:2d} interactive figures")
    (out / "index.html").write_text(index_html(pages, figures), encoding="utf-8")
    if verbose:
        print(f"book: {len(written)} pages + index.html in {out}")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("book"), description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: build/book)")
    args = ap.parse_args(argv)
    build(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
