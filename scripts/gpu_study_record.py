"""Record what the GPU study's calls brought back (scripts/gpu_study.sh): results/gpu/43_study_<device>.json.

    python scripts/gpu_study_record.py FOLDER [FOLDER ...] --calls CALLS.json --commit SHA

Each FOLDER is one call's files (the device tool's files_at): device_*.txt, log_*.txt, study_*.json (bench),
tree_real.json, dvi_gpu.tgz (the online run's head folder: card.json and log.jsonl are kept, not the head),
dvi_bench.json, lossless.json, log_probe.txt (scripts/gpu_ar_probe.py's output). A bench cut by its cap keeps
the questions it finished (settings.partial). An earlier file for the same GPU is merged: its benches stay beside
the new ones (by name), and its tree, online and lossless sections stay where this run has none, each with its own
provenance. CALLS.json lists each call as the device tool reported it ({"command", "wall_s", "rc", "timed_out"}),
so the file says what each call cost and what did not fit.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dvi_lite.measure.provenance import results_json  # noqa: E402
from dvi_lite.paths import atomic_write_text  # noqa: E402

BENCH_KEEP = ("decode_tokens_per_s", "tokens_per_s", "speedup_vs_ar", "speedup_interval", "speedup_vs_ar_e2e",
              "speedup_interval_e2e", "speedup_pooled", "speedup_pooled_interval", "tau", "alpha", "c",
              "predicted_speedup", "n_prompts", "new_tokens", "peak_mem_bytes", "speedup_per_prompt")
CARRIED = ("tree_real", "tree_attention", "dvi_online", "lossless")  # kept from an earlier run when this one has none


def device(folder: Path) -> dict | None:
    for f in sorted(folder.glob("device_*.txt")):
        lines = f.read_text().splitlines()
        gpu = lines[1].split(", ")
        m = re.search(r"torch (\S+) cuda (\S+) (.+) transformers (\S+) triton (\S+)", lines[2])
        return {"started": lines[0].removeprefix("started "), "gpu": gpu[0], "gpu_memory": gpu[1],
                "driver": gpu[2], "torch": m.group(1), "transformers": m.group(4), "triton": m.group(5)}
    return None


def stages(folder: Path) -> list[str]:
    out = []
    for log in sorted(folder.glob("log_*.txt")):
        out += re.findall(r"== [^\r\n]*?: (?:up to|rc=|skipped)[^\r\n]*", log.read_text(errors="replace"))
    return out


def bench(path: Path) -> dict:
    body = json.loads(path.read_text())
    st = body["settings"]
    keys = ("n_prompts_used", "repeats", "max_new_tokens", "dtype", "device", "runtime", "prompts", "partial")
    settings = {k: st.get(k) for k in keys if k in st}
    if "partial" in st:  # a capped bench: its first round's first questions (bench writes them after each one)
        settings["n_prompts_used"] = st["partial"]["prompts_done"]
    return {"settings": settings, "verify_cost": body.get("verify_cost"), "provenance": body["provenance"],
            "methods": {m: {k: r.get(k) for k in BENCH_KEEP if k in r} for m, r in body["methods"].items()}}


def probe(log: Path) -> dict:
    """scripts/gpu_ar_probe.py's printed lines: ms per token of each decoding loop, CUDA runtime calls per token."""
    text = log.read_text()
    ms = {m: float(x) for m, x in re.findall(r"^(\w+) ([\d.]+) ms/token$", text, re.M)}
    calls = {m: json.loads(x) for m, x in re.findall(r"^(\w+) (\{.*\})$", text, re.M)}
    return {"what": "where an AR token's time goes on the GPU: our AR (HF and lean runtimes), HF generate and a bare "
            "HF forward loop, on the course model (12 layers, fp32), 96 tokens, median of 3",
            "ms_per_token": ms, "cuda_calls_per_token": calls, "source": log.name}


def online(tgz: Path) -> dict:
    with tarfile.open(tgz) as t:
        card = json.loads(t.extractfile("dvi_gpu/card.json").read())
        log = [json.loads(x) for x in io.TextIOWrapper(t.extractfile("dvi_gpu/log.jsonl"))]
    curve = [{k: r.get(k) for k in ("step", "sequences", "tokens_generated", "accept_rate", "tau", "elapsed_s")}
             for r in log[:: max(1, len(log) // 50)]]  # at most about 50 points: the tracked tree has a budget
    return {**{k: v for k, v in card.items() if k != "config"}, "config": card["config"], "curve": curve}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--calls", type=Path, required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--not-fitted", default="", help="what did not fit, in words")
    args = ap.parse_args(argv)
    dev = next(d for d in map(device, args.folders) if d)
    res: dict = {"device": dev, "calls": json.loads(args.calls.read_text()),
                 "stages": [s for f in args.folders for s in stages(f)]}
    for f in args.folders:
        for p in sorted(f.glob("study*.json")) + sorted(f.glob("dvi_bench.json")):
            res.setdefault("bench", {})[p.stem] = bench(p)
        for name in ("tree_real", "tree_attention", "lossless"):
            if (f / f"{name}.json").is_file():
                res[name] = json.loads((f / f"{name}.json").read_text())
        if (f / "log_probe.txt").is_file():
            res["ar_probe"] = probe(f / "log_probe.txt")
        if (f / "dvi_gpu.tgz").is_file():
            res["dvi_online"] = online(f / "dvi_gpu.tgz")
    res["not_fitted"] = args.not_fitted
    out = ROOT / "results" / "gpu" / f"43_study_{dev['gpu'].lower().replace(' ', '_')}.json"
    if out.is_file():  # an earlier run on this GPU: its benches and the checks this run did not redo stay, each
        old = json.loads(out.read_text())  # with its own provenance
        res["bench"] = {**old.get("bench", {}), **res.get("bench", {})}
        res.update({k: old[k] for k in CARRIED if k in old and k not in res})
        res["earlier"] = {k: old[k] for k in ("device", "calls", "not_fitted") if k in old}
    cmd = "python scripts/gpu_study_record.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res["provenance"] = {"command": cmd, "commit": args.commit, "device": dev["gpu"], "torch": dev["torch"],
                         "transformers": dev["transformers"], "date": dev["started"],
                         "scripts": "scripts/gpu_carry.sh, scripts/gpu_study.sh, scripts/gpu_study.py"}
    atomic_write_text(out, results_json(res))
    print(out.relative_to(ROOT), sorted(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
