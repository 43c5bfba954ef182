"""The course corpus: CPython's standard library (code) and the Python documentation sources (prose).

Why these: both are redistributable (PSF licence), both are on a Debian/Python machine without any
network, and together they give two domains with very different predictability (code repeats
itself; prose less so), which is exactly what makes acceptance rates differ per domain.

`python -m dvi_lite corpus build` makes the committed snapshot in `data/corpus/` (needs the Debian
package python3-doc for the prose); everything else only reads that snapshot, so a fresh clone never
needs the sources again.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dvi_lite.commands import prog
from dvi_lite.paths import DATA_DIR, atomic_write_bytes, atomic_write_text

CORPUS_DIR = DATA_DIR / "corpus"
PROMPTS_DIR = DATA_DIR / "prompts"
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.jsonl.xz"  # the course model's held-out prompts (JSONL, xz-compressed)
DOMAINS = ("code", "prose")
SPLITS = ("train", "val", "test")
DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")


@dataclass
class Doc:
    path: str  # path inside its source tree
    domain: str  # "code" | "prose"
    split: str  # "train" | "val" | "test"
    text: str


def split_of(path: str) -> str:
    """Deterministic split by file: 90 % train, 5 % val, 5 % test (hash of the path, not random)."""
    h = int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100
    return "train" if h < 90 else ("val" if h < 95 else "test")


def _stdlib_files(max_bytes: int = 200_000) -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or any(
            p in ("test", "tests") or p.startswith("test_") for p in parts
        ):
            continue
        if f.stat().st_size > max_bytes or f.stat().st_size < 200:
            continue
        yield rel, f.read_text(encoding="utf-8", errors="replace")


def _doc_files() -> Iterator[tuple[str, str]]:
    if not DOC_SOURCES.is_dir():
        raise FileNotFoundError(
            f"{DOC_SOURCES} not found: install the Debian package python3-doc to rebuild the prose corpus"
        )
    for f in sorted(DOC_SOURCES.rglob("*.rst.txt")):
        yield f.relative_to(DOC_SOURCES).as_posix(), f.read_text(encoding="utf-8", errors="replace")


def build_snapshot(out: Path = CORPUS_DIR) -> dict:
    """Collect both sources, assign splits, write xz-compressed JSONL per domain and a manifest."""
    import platform

    out.mkdir(parents=True, exist_ok=True)
    sources = {
        "code": ("CPython %s standard library (*.py, no tests)" % platform.python_version(), _stdlib_files()),
        "prose": ("Python 3.11 documentation reST sources (Debian python3-doc)", _doc_files()),
    }
    manifest: dict = {"licence": "PSF License Agreement (Python Software Foundation)", "files": {}}
    for domain, (desc, files) in sources.items():
        path = out / f"{domain}.jsonl.xz"
        sizes = {s: {"files": 0, "bytes": 0} for s in SPLITS}
        with lzma.open(path, "wt", encoding="utf-8", preset=9) as fh:
            for rel, text in files:
                s = split_of(rel)
                sizes[s]["files"] += 1
                sizes[s]["bytes"] += len(text.encode())
                fh.write(json.dumps({"path": rel, "domain": domain, "split": s, "text": text}) + "\n")
        manifest["files"][path.name] = {
            "source": desc,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "compressed_bytes": path.stat().st_size,
            "splits": sizes,
        }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify_snapshot(corpus_dir: Path = CORPUS_DIR) -> None:
    """Check each snapshot file against the manifest's sha256 (a corrupted clone fails loudly)."""
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        digest = hashlib.sha256((corpus_dir / name).read_bytes()).hexdigest()
        if digest != info["sha256"]:
            raise ValueError(f"corpus file {name}: sha256 {digest} does not match the manifest")


def load_docs(split: str, domain: str | None = None, corpus_dir: Path = CORPUS_DIR) -> list[Doc]:
    """All documents of one split (optionally one domain) from the committed snapshot."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS} or None, got {domain!r}")
    docs = []
    for d in DOMAINS if domain is None else (domain,):
        with lzma.open(corpus_dir / f"{d}.jsonl.xz", "rt", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                if rec["split"] == split:
                    docs.append(Doc(**rec))
    return docs


def _prose_paragraphs(text: str) -> list[str]:
    """Plain-English paragraphs of a reST file (skip directives, tables, code and headings)."""
    paras = []
    for block in text.split("\n\n"):
        b = block.strip()
        lines = b.splitlines()
        if len(b) < 160 or b.startswith(("..", "::", "|", "+", "=", "-", ">>>", "*")):
            continue
        if any(line.startswith(" ") for line in lines) or set(lines[-1]) <= set("=-~^*#"):
            continue
        paras.append(" ".join(line.strip() for line in lines))
    return paras


def _code_chunks(text: str) -> list[str]:
    """Starts of top-level or method definitions with a few lines of body: natural code prompts."""
    lines = text.splitlines()
    chunks = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("def ", "class ")) and i + 6 < len(lines):
            chunk = "\n".join(lines[i : i + 6])
            if 120 <= len(chunk) <= 600:
                chunks.append(chunk + "\n")
    return chunks


def make_prompts(n_per_domain: int = 150, seed: int = 0, split: str = "test") -> list[dict]:
    """Prompts from held-out files: code = a definition's first lines, prose = a paragraph's start."""
    rng = random.Random(seed)
    prompts = []
    for domain in DOMAINS:
        pool = []
        for doc in load_docs(split, domain):
            pieces = _code_chunks(doc.text) if domain == "code" else _prose_paragraphs(doc.text)
            pool += [(doc.path, p) for p in pieces]
        rng.shuffle(pool)
        for i, (path, piece) in enumerate(pool[:n_per_domain]):
            if domain == "prose":  # cut at a word boundary so the model continues mid-sentence
                cut = piece.rfind(" ", 0, min(len(piece), 240))
                piece = piece[: max(cut, 80)]
            prompts.append({"id": f"{domain}-{i:03d}", "domain": domain, "source": path, "prompt": piece})
    return prompts


def write_prompts(prompts: list[dict], path: Path) -> None:
    """JSON Lines, xz-compressed when the name ends in .xz; written atomically."""
    text = "".join(json.dumps(p) + "\n" for p in prompts).encode()
    atomic_write_bytes(path, lzma.compress(text, preset=9) if path.suffix == ".xz" else text)


def load_prompts(path: str | Path | None = None, domain: str | None = None, n: int | None = None) -> list[dict]:
    """Prompt records ({id, domain, source, prompt}) from a JSONL file (default: the held-out set)."""
    path = Path(path) if path is not None else HELDOUT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist (expected JSONL with a 'prompt' field)")
    try:
        text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    except (lzma.LZMAError, UnicodeDecodeError) as e:
        raise ValueError(f"prompts file {path} is not UTF-8 JSON Lines{' in xz' if path.suffix == '.xz' else ''} "
                         f"({e})") from None
    recs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts file {path}, line {i + 1}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f"prompts file {path}, line {i + 1}: each line needs a string field 'prompt'")
        if domain is None or rec.get("domain") == domain:
            recs.append(rec)
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS} or None, got {domain!r}")
    return recs[:n] if n is not None else recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("corpus"), description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="rebuild data/corpus from the machine's stdlib and python3-doc")
    sub.add_parser("prompts", help="rebuild data/prompts/heldout.jsonl.xz from the test split")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(json.dumps(build_snapshot(), indent=2))
    else:
        prompts = make_prompts()
        write_prompts(prompts, HELDOUT_PROMPTS)
        print(f"wrote {len(prompts)} prompts to {HELDOUT_PROMPTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
