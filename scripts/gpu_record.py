"""Record what a GPU run of scripts/gpu_prepare.sh measured: results/gpu/<name>_<device>.json.

    python scripts/gpu_record.py OUT_FOLDER [OUT_FOLDER ...] --name 27_training

Reads each folder's device.txt (what the machine reported about itself), log*.txt (the stage timings the
script printed) and the cards of the pieces now in data/smollm2/ that say they were trained there. A piece
whose card lacks the device's provenance (an EAGLE card written before cards carried it) gets it from device.txt.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARDS = {"eagle head": "eagle/card.json", "sps draft": "sps/card.json", "medusa heads": "medusa/heads.json",
         "kangaroo adapter": "kangaroo/adapter_k2.json", "dvi head": "dvi/card.json"}
KEEP = ("init", "final", "steps", "train_tokens_seen", "tokens_seen", "wall_time_s", "train_time_s", "command",
        "accuracy", "curve", "bytes_fp16", "params")


def device_report(folder: Path) -> dict:
    lines = (folder / "device.txt").read_text().splitlines()
    gpu = lines[1].split(", ")
    m = re.search(r"torch (\S+) cuda (\S+) (.+) transformers (\S+)", lines[2])
    return {"started": lines[0].removeprefix("started "), "gpu": gpu[0], "gpu_memory": gpu[1], "driver": gpu[2],
            "torch": m.group(1), "transformers": m.group(4)}


def stages(folder: Path) -> list[str]:
    out = []
    for log in sorted(folder.glob("log*.txt")):
        text = log.read_text(errors="replace")  # a stage line can follow a progress bar's last frame
        out += re.findall(r"(?:== [^\r\n]*?: (?:up to|rc=|skipped)[^\r\n=]*|record: [^\r\n]*)", text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--commit", required=True, help="the commit the run's code was (its cards say +dirty)")
    ap.add_argument("--sweep", nargs="*", type=Path, default=[],
                    help="cards of Kangaroo adapters trained beside the pieces (the exit sweep), kept in the result")
    args = ap.parse_args(argv)
    dev = device_report(args.folders[0])
    pieces = {}
    for piece, rel in CARDS.items():
        path = ROOT / "data" / "smollm2" / rel
        if not path.is_file():
            continue
        card = json.loads(path.read_text())
        prov = card.get("provenance", {})
        if prov.get("device", "").startswith("cpu: x86_64, 2") or "05e6709" in str(card.get("commit")):
            continue  # made on this repo's CPU machine, not in this run
        if "provenance" not in card:  # the EAGLE card of this run: trained on the GPU (its log says so)
            card["provenance"] = {"commit": args.commit, "device": dev["gpu"], "torch": dev["torch"],
                                  "transformers": dev["transformers"], "command": card.get("command"),
                                  "date": dev["started"]}
            card.update(commit=args.commit, device=dev["gpu"])
            path.write_text(json.dumps(card, indent=1, default=str) + "\n")
        pieces[piece] = {k: card[k] for k in KEEP if k in card} | {"device": card["provenance"]["device"]}
    sweep = [{k: c.get(k) for k in ("split", "steps", "tokens_seen", "val", "curve", "command", "wall_time_s")}
             for c in (json.loads(p.read_text()) for p in args.sweep)]
    res = {"device": dev, "stages": [s for f in args.folders for s in stages(f)], "pieces": pieces,
           **({"kangaroo_exit_sweep": sorted(sweep, key=lambda c: (c["steps"], c["split"]))} if sweep else {}),
           "provenance": {"command": "python scripts/gpu_record.py " + " ".join(sys.argv[1:] if argv is None else argv),
                          "commit": args.commit}}
    out = ROOT / "results" / "gpu" / f"{args.name}_{dev['gpu'].lower().replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(out.relative_to(ROOT), sorted(pieces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
