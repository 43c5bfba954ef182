"""`make reproduce`: every notebook in full mode (papermill, into build/notebooks), then the README table.

Full-mode notebooks write results/*.json and figures/*; executed copies stay in the ignored build/.
`--smoke` runs the same pipeline with the CI defaults (results then go to build/, nothing committed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dvi_lite.cli import command_line, prog
from dvi_lite.paths import BUILD_DIR, ROOT

NOTEBOOKS_DIR = ROOT / "notebooks"
OUT_DIR = BUILD_DIR / "notebooks"


def notebooks(only: list[str] | None = None) -> list[Path]:
    nbs = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        nbs = [nb for nb in nbs if nb.name[:2] in only]
        if not nbs:
            raise ValueError(f"--only {only}: no notebook with those numbers in {NOTEBOOKS_DIR}")
    return nbs


def run_notebook(nb: Path, smoke: bool, parameters: dict | None = None) -> float:
    """Execute one notebook with papermill; returns its wall time in seconds."""
    import papermill as pm

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    pm.execute_notebook(str(nb), str(OUT_DIR / nb.name), parameters={"SMOKE": smoke, **(parameters or {})},
                        kernel_name="python3", cwd=str(NOTEBOOKS_DIR), progress_bar=True)
    return time.time() - t0


def write_timings(times: dict[str, float], total_s: float, smoke: bool, command: str) -> Path:
    """results/reproduce.json: the measured wall time of each notebook and of the whole run.

    `make` exports DVI_MAKE_START (its own start, epoch seconds), so the total includes the `.venv`
    setup a fresh clone pays; run directly, the total is the notebooks alone.
    """
    from dvi_lite.study.provenance import write_result

    start = os.environ.get("DVI_MAKE_START")
    setup_s = max(0.0, time.time() - total_s - float(start)) if start else None
    payload = {"notebooks_s": {k: round(v, 1) for k, v in times.items()}, "notebooks_total_s": round(total_s, 1),
               "setup_s": None if setup_s is None else round(setup_s, 1),
               "total_s": round(total_s + (setup_s or 0.0), 1), "mode": "smoke" if smoke else "full"}
    return write_result("reproduce", payload, command=command, smoke=smoke)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("reproduce"), description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CI-sized run (results go to build/, not results/)")
    ap.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 00,01")
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
    t0, times = time.time(), {}
    for i, nb in enumerate(nbs):
        print(f"[{i + 1}/{len(nbs)}] {nb.name} ({'smoke' if args.smoke else 'full'})", flush=True)
        times[nb.name] = run_notebook(nb, args.smoke, params)
        print(f"    done in {times[nb.name] / 60:.1f} min", flush=True)
    total = time.time() - t0
    if not args.only and not args.model:  # a complete run: its times are a result (smoke ones go to build/)
        print(f"timings written to {write_timings(times, total, args.smoke, command.strip())}")
    if not args.smoke and not args.model:
        from dvi_lite.study.report import update_readme

        update_readme()
        print("README results section regenerated from results/*.json")
    print("timings: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()) +
          f" | total {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
