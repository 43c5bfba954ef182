"""`make reproduce`: every notebook in full mode (papermill, into build/notebooks), then the README table.

Full-mode notebooks write results/*.json and figures/*. Each executed notebook is then written back to
notebooks/ with its outputs (plotly's native output plus a PNG fallback), stamped with the hash of the code it
ran (`source_hash`), so a reader sees the last full run and a test can tell when the code has changed since.
`--smoke` runs the same pipeline with the CI defaults, and `--learner` with the learner sizes (what Run All
uses, about 2 min per notebook): their results and executed copies stay in build/, and the timings of a
learner run are build/results/reproduce.json's.
`--resume` skips notebooks this run already finished (build/notebooks/progress.json) if their code is unchanged.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from dvi_lite.commands import command_line, prog
from dvi_lite.measure.scrub import scrub
from dvi_lite.paths import BUILD_DIR, ROOT

NOTEBOOKS_DIR = ROOT / "notebooks"
OUT_DIR = BUILD_DIR / "notebooks"


PROGRESS = OUT_DIR / "progress.json"
INJECTED_NOTE = "# make reproduce ran this notebook with these parameters (commented out: Run All uses the defaults)\n"
MAX_NOTEBOOK_BYTES = 3 * 2**20  # a committed notebook, outputs included


def source_hash(nb: dict) -> str:
    """sha256 of a notebook's code cells, without papermill's injected-parameters cell: what a run executed."""
    code = [c["source"] if isinstance(c["source"], str) else "".join(c["source"]) for c in nb["cells"]
            if c["cell_type"] == "code" and "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    return hashlib.sha256("\n# -- cell --\n".join(code).encode()).hexdigest()


def write_back(executed: Path, target: Path, seconds: float) -> None:
    """Copy a full run's executed notebook over its source, stamped with the hash of the code it ran."""
    nb = scrub(json.loads(executed.read_text()), ROOT)  # no machine paths, frozen progress bars or deprecations
    nb["metadata"].pop("widgets", None)  # ipywidgets' saved state (MBs); a live kernel rebuilds the widgets
    for cell in nb["cells"]:  # papermill's MODE = "full" stays visible but inert: Run All keeps the learner default
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            cell["source"] = INJECTED_NOTE + "".join(f"# {line}\n" for line in src.splitlines()
                                                     if line.strip() and not line.startswith("#"))
    nb["metadata"]["dvi_lite"] = {"source_sha256": source_hash(nb), "mode": "full", "seconds": round(seconds, 1)}
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if len(text.encode()) > MAX_NOTEBOOK_BYTES:
        print(f"    warning: {target.name} is {len(text.encode()) / 2**20:.1f} MiB with outputs (limit 3)")
    target.write_text(text)


def _progress() -> dict:
    return json.loads(PROGRESS.read_text()) if PROGRESS.is_file() else {}


def notebooks(only: list[str] | None = None) -> list[Path]:
    nbs = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        nbs = [nb for nb in nbs if nb.name[:2] in only]
        if not nbs:
            raise ValueError(f"--only {only}: no notebook with those numbers in {NOTEBOOKS_DIR}")
    return nbs


def run_notebook(nb: Path, mode: str, parameters: dict | None = None) -> float:
    """Execute one notebook with papermill in `mode` (course.modes); returns its wall time in seconds."""
    import papermill as pm

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if mode == "full":  # fig.show() -> plotly's native output + a PNG fallback (plots.notebook_renderer)
        from dvi_lite.measure.figures import RENDERER_ENV, browser_available

        os.environ[RENDERER_ENV] = "plotly_mimetype+png" if browser_available() else "plotly_mimetype"
    t0 = time.time()
    pm.execute_notebook(str(nb), str(OUT_DIR / nb.name), parameters={"MODE": mode, **(parameters or {})},
                        kernel_name="python3", cwd=str(NOTEBOOKS_DIR), progress_bar=True)
    return time.time() - t0


def write_timings(times: dict[str, float], total_s: float, mode: str, command: str,
                  resumed: list[str] | None = None) -> Path:
    """results/reproduce.json: the measured wall time of each notebook and of the whole run.

    `make` exports DVI_MAKE_START (its own start, epoch seconds), so the total includes the `.venv`
    setup a fresh clone pays; run directly, the total is the notebooks alone.
    """
    from dvi_lite.measure.provenance import write_result

    start = os.environ.get("DVI_MAKE_START")
    # a resumed run's notebooks ran in several invocations: its setup time is not measured
    setup_s = max(0.0, time.time() - total_s - float(start)) if start and not resumed else None
    payload = {"notebooks_s": {k: round(v, 1) for k, v in times.items()}, "notebooks_total_s": round(total_s, 1),
               "setup_s": None if setup_s is None else round(setup_s, 1),
               "total_s": round(total_s + (setup_s or 0.0), 1), "mode": mode,
               "resumed": resumed or []}
    return write_result("reproduce", payload, command=command, smoke=mode != "full")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("reproduce"), description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CI-sized run (results go to build/, not results/)")
    ap.add_argument("--learner", action="store_true",
                    help="the learner sizes Run All uses (about 2 min per notebook; results go to build/)")
    ap.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 00,01")
    ap.add_argument("--resume", action="store_true",
                    help="skip notebooks this run already finished in the same mode with unchanged code")
    ap.add_argument("--model", default=None, help="local HF checkpoint folder passed as MODEL_PATH to every notebook")
    args = ap.parse_args(argv)
    try:
        nbs = notebooks(args.only.split(",") if args.only else None)
    except ValueError as e:
        ap.error(str(e))
    params = {"MODEL_PATH": str(Path(args.model).resolve())} if args.model else {}
    command = "make reproduce" if os.environ.get("DVI_MAKE_START") else command_line("reproduce", argv)
    if args.model:  # another model needs its own adapter, heads, skip set and DVI head first
        from dvi_lite.study.prepare import PrepareConfig, prepare

        print(f"[0/{len(nbs)}] training the methods' pieces for {args.model} (python -m dvi_lite prepare)", flush=True)
        prepare(params["MODEL_PATH"], PrepareConfig.smoke() if args.smoke else PrepareConfig(),
                command=command)
    if args.smoke and args.learner:
        ap.error("--smoke and --learner: choose one mode")
    mode = "smoke" if args.smoke else "learner" if args.learner else "full"
    if mode == "full" and not args.model:
        from dvi_lite.measure.figures import browser_available

        if not browser_available():  # the committed notebooks need their PNG fallbacks (tests/test_notebooks.py)
            ap.error("a full run writes the committed notebooks, whose figures need a PNG fallback, and kaleido needs "
                     "Chromium: apt-get install chromium (make reproduce installs it when it is missing)")
    progress = _progress() if args.resume else {}
    times, resumed = {}, []
    for i, nb in enumerate(nbs):
        done = progress.get(nb.name, {})
        if done.get("mode") == mode and done.get("source_sha256") == source_hash(json.loads(nb.read_text())):
            times[nb.name] = done["seconds"]
            resumed.append(nb.name)
            print(f"[{i + 1}/{len(nbs)}] {nb.name}: finished earlier in this run ({done['seconds'] / 60:.1f} min)")
            continue
        print(f"[{i + 1}/{len(nbs)}] {nb.name} ({mode})", flush=True)
        times[nb.name] = run_notebook(nb, mode, params)
        print(f"    done in {times[nb.name] / 60:.1f} min", flush=True)
        if mode == "full" and not args.model:  # a full run of the committed course: its outputs go back
            write_back(OUT_DIR / nb.name, nb, times[nb.name])
        progress[nb.name] = {"mode": mode, "seconds": round(times[nb.name], 1),
                             "source_sha256": source_hash(json.loads(nb.read_text()))}
        PROGRESS.write_text(json.dumps(progress, indent=1))
    total = sum(times.values())
    if not args.only and not args.model:  # a complete run: its times are a result (smoke ones go to build/)
        print(f"timings written to {write_timings(times, total, mode, command.strip(), resumed)}")
    if mode == "full" and not args.model:
        from dvi_lite.study.prose import refresh_notebook
        from dvi_lite.study.report import update_readme

        for nb in notebooks():  # the prose's tagged numbers follow the new results (study/prose.py)
            for old, new in refresh_notebook(nb):
                print(f"prose {nb.name}: {old.split('<!--')[0]} -> {new.split('<!--')[0]}")

        update_readme()
        print("README results section regenerated from results/*.json")
    print("timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()) +
          f" | total {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
