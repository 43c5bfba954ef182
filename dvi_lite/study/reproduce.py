"""`make reproduce`: every notebook in full mode (papermill, into build/notebooks), then the README table.

Full-mode notebooks write results/*.json and figures/*, but during a run they write them into a stage
(build/reproduce/stage, `paths.output_dir`). Only when every notebook has run and every prose tag of every notebook
resolves against the new results are the results, the figures and the executed notebooks put in place together:
each executed notebook goes back to notebooks/ with its outputs (plotly's native output plus a PNG fallback),
stamped with the hash of the code it ran (`source_hash`), its tagged numbers refreshed (course/prose.py), and the
README's results section is regenerated. A failed step changes nothing under notebooks/, results/, figures/ or
README.md, and says what failed.

A run resumes by itself: `make reproduce` after an interruption or a failure skips the notebooks that run already
finished (build/reproduce/progress.json) while their code and the package are unchanged; `--fresh` starts over.
`--smoke` runs the same pipeline with the CI defaults, and `--learner` with the learner sizes (what Run All
uses, about 2 min per notebook): their results and executed copies stay in build/, and the timings of a
learner run are build/results/reproduce.json's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from dvi_lite.commands import command_line, prog
from dvi_lite.measure.scrub import scrub
from dvi_lite.paths import BUILD_DIR, FILL_EXERCISES_ENV, ROOT, STAGE_ENV, atomic_write_text

NOTEBOOKS_DIR = ROOT / "notebooks"
OUT_DIR = BUILD_DIR / "notebooks"
RUN_DIR = BUILD_DIR / "reproduce"  # a run in progress: its progress file and its stage
PROGRESS = RUN_DIR / "progress.json"
STAGE = RUN_DIR / "stage"
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
    atomic_write_text(target, text)


def package_hash() -> str:
    """sha256 of the package's source: a run resumed after the package changed would mix two codes' results."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "dvi_lite").rglob("*.py")):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def read_progress(mode: str, run_key: str) -> dict:
    """The notebooks an interrupted run of this mode and package already finished; {} when there is none, when it
    was another mode or package, or when the file is torn (it is then redone, with a note)."""
    if not PROGRESS.is_file():
        return {}
    try:
        state = json.loads(PROGRESS.read_text())
        ok = isinstance(state, dict) and isinstance(state.get("notebooks"), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        ok = False
    if not ok:
        print(f"note: {PROGRESS.relative_to(ROOT)} is unreadable (a torn write?): starting the run over", flush=True)
        return {}
    if state.get("mode") != mode or state.get("run_key") != run_key:
        print("note: the interrupted run was of another mode or an older package: starting over", flush=True)
        return {}
    return state["notebooks"]


def write_progress(mode: str, run_key: str, done: dict) -> None:
    atomic_write_text(PROGRESS, json.dumps({"mode": mode, "run_key": run_key, "notebooks": done}, indent=1))


def put_in_place(stage: Path) -> list[Path]:
    """Move every staged result and figure over its committed place (one rename each); returns the targets."""
    moved = []
    for kind in ("results", "figures"):
        for f in sorted((stage / kind).rglob("*")) if (stage / kind).is_dir() else []:
            if f.is_file():
                target = ROOT / kind / f.relative_to(stage / kind)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(f, target)
                moved.append(target)
    return moved


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


def finish_full_run(ran: list[Path], times: dict[str, float]) -> int:
    """After every notebook of a full run has run: check every prose tag against the staged results (then the
    committed ones); if any fails, change nothing and say what to do. Else put the results, figures and the executed
    notebooks in place together, refresh the prose and regenerate the README."""
    from dvi_lite.study.prose import check_notebook, refresh_notebooks, unresolved_tags
    from dvi_lite.study.report import update_readme

    bad = unresolved_tags(notebooks(), [STAGE / "results", ROOT / "results"])
    if bad:
        print("The run finished, but these prose tags do not resolve against its results, so nothing under notebooks/, "
              "results/, figures/ or README.md was changed:\n  " + "\n  ".join(bad) +
              "\nFix each tag (or the notebook code that writes its key), then run `make reproduce` again: it keeps "
              f"the {len(ran)} notebooks that finished ({PROGRESS.relative_to(ROOT)}) and reruns only those whose "
              "code changed.", flush=True)
        return 1
    moved = put_in_place(STAGE)
    for nb in ran:
        write_back(OUT_DIR / nb.name, nb, times[nb.name])
    for nb, changed in refresh_notebooks(notebooks(), ROOT / "results").items():
        for old, new in changed:
            print(f"prose {nb.name}: {old.split('<!--')[0]} -> {new.split('<!--')[0]}")
    update_readme()
    print(f"{len(moved)} results and figures and {len(ran)} notebooks put in place; README results section "
          "regenerated from results/*.json", flush=True)
    false = [f"{nb.name} {p}" for nb in notebooks() for p in check_notebook(nb) if "claim" in p.why]
    if false:  # the numbers moved under a comparison the prose makes: the author re-reads it (make test fails)
        print("These claims in the prose no longer hold against the new results; re-read and rewrite each:\n  " +
              "\n  ".join(false), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("reproduce"), description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CI-sized run (results go to build/, not results/)")
    ap.add_argument("--learner", action="store_true",
                    help="the learner sizes Run All uses (about 2 min per notebook; results go to build/)")
    ap.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 00,01")
    ap.add_argument("--fresh", action="store_true",
                    help="start over: forget the notebooks an interrupted run finished (by default a run resumes)")
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old commands
    ap.add_argument("--model", default=None, help="local HF checkpoint folder passed as MODEL_PATH to every notebook")
    args = ap.parse_args(argv)
    try:
        nbs = notebooks(args.only.split(",") if args.only else None)
    except ValueError as e:
        ap.error(str(e))
    if args.smoke and args.learner:
        ap.error("--smoke and --learner: choose one mode")
    if args.model and not Path(args.model).is_dir():
        ap.error(f"--model {args.model}: no such folder (give a local Hugging Face Llama-family checkpoint folder)")
    params = {"MODEL_PATH": str(Path(args.model).resolve())} if args.model else {}
    command = "make reproduce" if os.environ.get("DVI_MAKE_START") else command_line("reproduce", argv)
    mode = "smoke" if args.smoke else "learner" if args.learner else "full"
    committed = mode == "full" and not args.model  # a full run of the committed course: its outputs go in place
    if committed:
        from dvi_lite.measure.figures import browser_available

        if not browser_available():  # the committed notebooks need their PNG fallbacks (tests/test_notebooks.py)
            ap.error("a full run writes the committed notebooks, whose figures need a PNG fallback, and kaleido needs "
                     "Chromium: apt-get install chromium (make reproduce installs it when it is missing)")
    if args.model:  # another model needs its own adapter, heads, skip set and DVI head first
        from dvi_lite.study.prepare import PrepareConfig, prepare

        print(f"[0/{len(nbs)}] training the methods' pieces for {args.model} (python -m dvi_lite prepare)", flush=True)
        prepare(params["MODEL_PATH"], PrepareConfig.smoke() if args.smoke else PrepareConfig(),
                command=command)
    # full runs write into a stage; another model's full run keeps its results there (never over the course's)
    stage = STAGE if not args.model else RUN_DIR / "models" / Path(args.model).resolve().name
    if mode == "full":
        os.environ[STAGE_ENV] = str(stage)
    if mode == "learner":  # Run All's sizes, timed through to the end: the exercises get their worked solutions
        os.environ[FILL_EXERCISES_ENV] = "1"
    run_key = hashlib.sha256(f"{package_hash()} {sorted(params.items())}".encode()).hexdigest()
    if args.fresh:
        shutil.rmtree(RUN_DIR, ignore_errors=True)
    progress = read_progress(mode, run_key)
    if not progress and mode == "full":
        shutil.rmtree(stage, ignore_errors=True)  # a stage left by another run's code is not this run's
    times, resumed = {}, []
    for i, nb in enumerate(nbs):
        done = progress.get(nb.name, {})
        if done.get("source_sha256") == source_hash(json.loads(nb.read_text())) and (OUT_DIR / nb.name).is_file():
            times[nb.name] = done["seconds"]
            resumed.append(nb.name)
            print(f"[{i + 1}/{len(nbs)}] {nb.name}: finished earlier in this run ({done['seconds'] / 60:.1f} min)")
            continue
        print(f"[{i + 1}/{len(nbs)}] {nb.name} ({mode})", flush=True)
        times[nb.name] = run_notebook(nb, mode, params)
        print(f"    done in {times[nb.name] / 60:.1f} min", flush=True)
        progress[nb.name] = {"seconds": round(times[nb.name], 1),
                             "source_sha256": source_hash(json.loads(nb.read_text()))}
        write_progress(mode, run_key, progress)
    total = sum(times.values())
    if not args.only and not args.model:  # a complete run: its times are a result (smoke ones go to build/)
        print(f"timings written to {write_timings(times, total, mode, command.strip(), resumed)}")
    if committed and finish_full_run(nbs, times) != 0:
        return 1
    PROGRESS.unlink(missing_ok=True)  # the run is complete: the next one starts over
    print("timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()) +
          f" | total {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
