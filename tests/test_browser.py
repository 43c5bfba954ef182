"""End-to-end: JupyterLab + headless Chromium (Playwright) run notebook 05 and move the λ widget's T_λ slider.

Run with `make test-browser` (it apt-installs Debian's chromium if missing and sets DVI_BROWSER_REQUIRED=1,
so a missing browser or Playwright fails loudly there). A plain `pytest -m browser` skips when they are missing.
The default `make test` deselects the test (pyproject addopts: -m 'not browser').

What it does:
  * starts JupyterLab from this venv on a free 127.0.0.1 port with a random token and throw-away
    config / data / runtime / settings / workspace dirs (autosave off, so notebooks/05_dvi.ipynb is never
    written: the test asserts its bytes are unchanged);
  * opens notebooks/05_dvi.ipynb in Chromium, Run > Run All Cells (the committed learner default, MODE = "learner"),
    waits until Run All stops at the first exercise left to write (ExerciseToDo; any other stop fails);
  * in section 7's LambdaWidget, drags the T_λ slider's handle with the mouse and checks that the tau
    readout, the status line and the plotted "lambda_t" trace (its SVG path and the figure's y data,
    which must equal max(floor, exp(-t / tau)) for the new readout tau) all changed;
  * screenshots into build/browser/: notebook.png (the whole executed notebook), before.png / after.png
    (the widget before and after the slider move); jupyter.log is the server's log.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# not also marked slow: `pytest -m slow` replaces the addopts' -m 'not browser' and would then select this test
pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "notebooks/05_dvi.ipynb"
OUT = REPO / "build" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
REQUIRED = os.environ.get("DVI_BROWSER_REQUIRED") == "1"  # set by `make test-browser`
RUN_ALL_TIMEOUT_S = 900  # learner run of notebook 05: about 2 min on 2 cores
SERVER_START_TIMEOUT_S = 120

# JupyterLab user settings for the test session (a fresh settings dir, nothing of the user's own).
LAB_SETTINGS = {
    # never write the notebook back to disk; the test opens the committed (output-stripped) file
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    # no "receive Jupyter news?" toast over the page
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
    # render every cell (no virtual scrolling) and no blank "scroll past the end" space, so the
    # whole-notebook screenshot shows all outputs and nothing else
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "scrollPastEnd": False},
}


def _missing_reason() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (Debian's chromium: `apt-get install chromium`, or run `make test-browser`)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET", timeout: float = 5.0):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
        return json.loads(body) if body else None


class LabServer:
    """A JupyterLab server process with its own throw-away Jupyter dirs; stop() always tears it down."""

    def __init__(self, home: Path):
        self.port = _free_port()
        self.token = secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.log_path = OUT / "jupyter.log"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        settings = self.home / "lab-settings"
        for rel, value in LAB_SETTINGS.items():
            f = settings / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(value))
        env = dict(os.environ)
        for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.home / sub)
        env.pop("JUPYTER_PATH", None)
        env.pop("JUPYTER_PREFER_ENV_PATH", None)
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.open_browser=False",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={REPO}",
               f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={self.home / 'workspaces'}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
               # JupyterLab checkpoints a notebook when it opens it: keep that out of notebooks/
               f"--FileCheckpoints.checkpoint_dir={self.home / 'checkpoints'}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers / CI often run as root
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                _api(self.base, self.token, "/api/status", timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer on {self.base} within {SERVER_START_TIMEOUT_S} s:\n"
                                   f"{self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Shut the kernels and the server down through the API, then SIGTERM / SIGKILL the process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                for k in _api(self.base, self.token, "/api/kernels") or []:
                    _api(self.base, self.token, f"/api/kernels/{k['id']}", method="DELETE", timeout=30)
            except Exception:
                pass
            try:
                _api(self.base, self.token, "/api/shutdown", method="POST", timeout=10)
            except Exception:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _missing_reason()
    if reason:
        if REQUIRED:
            pytest.fail(f"make test-browser cannot run: {reason}")
        pytest.skip(reason)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.png"):
        old.unlink()
    server = LabServer(tmp_path_factory.mktemp("jupyter"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


# ------------------------------------------------------------------ page helpers (JS run in the page)

# The lambda_t trace of the widget's plotly figure: plotly binds each trace's calcdata to its <g class="trace">,
# so the SVG group is found by trace key (its meta); the figure's own data (gd.data) gives the plotted y values.
LAMBDA_JS = """([fig, name]) => {
    // LambdaWidget puts its CSS class on the FigureWidget's own element, plotly's graph div
    const gd = fig.classList.contains('js-plotly-plot') ? fig : fig.querySelector('.js-plotly-plot');
    if (!gd || !gd.data) return null;
    const g = Array.from(gd.querySelectorAll('g.trace.scatter'))
        .find(g => g.__data__ && g.__data__[0] && g.__data__[0].trace && g.__data__[0].trace.meta === name);
    const path = g ? g.querySelector('path.js-line') : null;
    const tr = gd.data.find(t => t.meta === name);
    return {d: path ? path.getAttribute('d') : null, y: tr ? Array.from(tr.y).slice(0, 50) : null,
            ymin: tr ? Math.min(...tr.y) : null, n: tr ? tr.y.length : 0};
}"""

PROMPTS_JS = """(nb) => Array.from(nb.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt'))
    .map(e => e.textContent.trim())"""


def _lambda_state(page, fig):
    return page.evaluate(LAMBDA_JS, [fig.element_handle(), "lambda_t"])


def _wait_kernel_ready(page, lab, timeout_s: float = 120.0) -> None:
    """The notebook's kernel (metadata: python3, this venv) is started, connected and idle, and stays so.

    JupyterLab may start a kernel, replace it while the session settles, and only then connect: cells
    run before that are silently lost, so wait for one idle, connected kernel, stable for 3 s."""
    page.locator("#jp-main-statusbar", has_text="Idle").first.wait_for(state="visible", timeout=timeout_s * 1000)
    deadline, stable, kernels = time.monotonic() + timeout_s, 0, []
    while time.monotonic() < deadline:
        kernels = _api(lab.base, lab.token, "/api/kernels") or []
        ok = len(kernels) == 1 and kernels[0].get("execution_state") == "idle" and kernels[0].get("connections", 0) >= 1
        stable = stable + 1 if ok else 0
        if stable >= 4:
            return
        time.sleep(1)
    pytest.fail(f"the notebook's kernel did not become ready: {kernels}")


def _run_all(page, nb) -> list[str]:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    n_code = nb.locator(".jp-CodeCell").count()
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    prompts: list[str] = []
    stalled = 0  # polls in a row with nothing running or queued but cells left unexecuted
    while time.monotonic() < deadline:
        prompts = page.evaluate(PROMPTS_JS, nb.element_handle())
        done = [p for p in prompts if p.startswith("[") and p[1:-2].isdigit()]
        running = [p for p in prompts if "*" in p]  # running or queued
        if len(done) == n_code and not running:
            return prompts
        stalled = stalled + 1 if not running else 0
        if stalled >= 5:  # Run All clears the queue at the first error: report the outputs
            outs = nb.locator(".jp-OutputArea-output")
            text = "\n".join(outs.nth(i).inner_text()[-1500:] for i in range(outs.count()))
            if "ExerciseToDo" in text and "is yours to write" in text:  # the learner's stop: the first exercise
                return prompts
            pytest.fail(f"Run All stopped before the end: prompts {prompts}\n{text[-6000:]}")
        time.sleep(2)
    pytest.fail(f"notebook 05 did not finish within {RUN_ALL_TIMEOUT_S} s; prompts: {prompts}")


NOTEBOOK_HEIGHT_JS = """(nb) => {
    // JupyterLab 4 scrolls the notebook inside .jp-WindowedPanel-outer, not the .jp-Notebook element
    const scroller = nb.querySelector('.jp-WindowedPanel-outer') || nb;
    return {scroll: scroller.scrollHeight, client: scroller.clientHeight};
}"""


def _screenshot_notebook(page, nb, path: Path, max_height: int = 32000) -> None:
    """The whole executed notebook in one image: grow the viewport until the notebook needs no scrolling."""
    size = dict(page.viewport_size)
    try:
        for _ in range(3):  # outputs may reflow (plotly figures resize with their container): repeat
            h = page.evaluate(NOTEBOOK_HEIGHT_JS, nb.element_handle())
            if h["scroll"] <= h["client"] + 2:
                break
            extra = h["scroll"] - h["client"]
            height = min(page.viewport_size["height"] + extra + 50, max_height)
            page.set_viewport_size({"width": size["width"], "height": height})
            page.wait_for_timeout(1500)
        nb.screenshot(path=str(path))
    finally:
        page.set_viewport_size(size)
        page.wait_for_timeout(1000)


def move_tau_slider_and_check_plot(page, widget, out: Path, tau_start: float | None = None) -> dict:
    """Drag the LambdaWidget's T_λ slider to the right with the mouse; check the readout, the status line and
    the plotted lambda_t curve followed; screenshots out/before.png and out/after.png. Returns the states."""
    widget.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    fig = widget.locator(".dvi-figure").first
    readout = widget.locator(".dvi-t-lambda .widget-readout").first
    status = widget.locator(".dvi-status").first
    before = _lambda_state(page, fig)
    tau0, status0 = readout.inner_text().strip(), status.inner_text().strip()
    assert before and before["d"] and before["y"], f"no lambda_t trace drawn: {before}"
    if tau_start is not None:
        assert float(tau0) == pytest.approx(tau_start, rel=0.02), tau0
    widget.screenshot(path=str(out / "before.png"))

    # drag the handle to the right (a larger tau: a slower decay of λ_t), as a user would
    handle = widget.locator(".dvi-t-lambda .noUi-handle").first
    box = handle.bounding_box()
    assert box, "tau slider handle not visible"
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for dx in range(10, 91, 10):
        page.mouse.move(x + dx, y)
        page.wait_for_timeout(50)
    page.mouse.up()

    # the kernel-side observer redraws lambda_t; wait for the new path to arrive in the browser, then for
    # the trailing updates of the drag (continuous_update) to settle
    deadline = time.monotonic() + 60
    while (after := _lambda_state(page, fig))["d"] == before["d"] and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    last = None
    while time.monotonic() < deadline:
        page.wait_for_timeout(1000)
        after = _lambda_state(page, fig)
        state = (after["d"], readout.inner_text().strip(), status.inner_text().strip())
        if state == last:
            break
        last = state
    tau1, status1 = readout.inner_text().strip(), status.inner_text().strip()
    widget.screenshot(path=str(out / "after.png"))

    assert after["d"] != before["d"], "the lambda_t path did not change after moving the T_λ slider"
    assert after["y"] != before["y"]
    assert float(tau1) > float(tau0) * 1.2, (tau0, tau1)
    assert status1 != status0 and tau1 in status1, (status0, status1)
    # the plotted curve is the schedule for the new tau: y_t = max(floor, exp(-t / tau))
    ys = after["y"]
    assert ys[0] == pytest.approx(1.0)
    tau_from_curve = -1.0 / math.log(ys[1])
    assert tau_from_curve == pytest.approx(float(tau1), rel=0.02), (tau_from_curve, tau1)
    for t in (1, 5, 10, 20):
        assert ys[t] == pytest.approx(max(after["ymin"], math.exp(-t / tau_from_curve)), rel=1e-6)
    return {"tau_before": tau0, "tau_after": tau1, "status_before": status0, "status_after": status1}


def test_notebook_05_lambda_widget_in_jupyterlab(lab, browser):
    nb_file = REPO / NOTEBOOK
    digest = hashlib.sha256(nb_file.read_bytes()).hexdigest()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console_errors.append(f"pageerror: {e}"))
    page.set_default_timeout(60_000)
    try:
        page.goto(f"{lab.base}/lab/tree/{NOTEBOOK}?token={lab.token}", wait_until="domcontentloaded")
        nb = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first
        nb.wait_for(state="visible", timeout=120_000)
        _wait_kernel_ready(page, lab)

        t0 = time.monotonic()
        prompts = _run_all(page, nb)
        run_s = time.monotonic() - t0
        print(f"\nRun All Cells: {len(prompts)} code cells in {run_s:.0f} s")
        assert len(prompts) > 10, f"notebook 05 should have many code cells: {prompts}"

        widget = nb.locator(".dvi-widget").first
        widget.wait_for(state="visible", timeout=60_000)
        widget.locator(".dvi-figure g.trace.scatter path.js-line").first.wait_for(state="attached", timeout=60_000)
        widget.scroll_into_view_if_needed()
        page.wait_for_timeout(1000)
        _screenshot_notebook(page, nb, OUT / "notebook.png")

        move_tau_slider_and_check_plot(page, widget, OUT, tau_start=30.0)  # the notebook sets T_λ = 30

        for name in ("notebook.png", "before.png", "after.png"):
            f = OUT / name
            assert f.exists() and f.stat().st_size > 10_000, f"screenshot {f} missing or empty"
        assert console_errors == [], f"the browser console reported errors: {console_errors}"
    finally:
        try:
            page.screenshot(path=str(OUT / "last_page.png"))
        except Exception:
            pass
        page.close()
    assert hashlib.sha256(nb_file.read_bytes()).hexdigest() == digest, f"{NOTEBOOK} was modified"
