"""Bad input gets a clear error: a table of bad inputs across the command line and the API.

Each CLI row runs `python -m dvi_lite ...` in this process (cli.main) and asserts the exit status, that no traceback
was printed, and the words of the one-line message: it names the parameter or file, what was found, what is
allowed. Each API row asserts the exception type and its words. The rows are grouped by what is wrong (CLASSES), so
the table says which kinds of bad input are covered.
"""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest
import torch

from dvi_lite.cli import main
from dvi_lite.paths import DATA_DIR

COURSE = DATA_DIR / "course_model"
CLASSES = ("weights file", "model folder", "piece file", "number out of range", "number that overflows",
           "boolean for a number", "not UTF-8", "too long", "unknown name", "missing file", "malformed file",
           "output path")


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Broken copies of the course model and broken input files, made once."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")

    def folder(name: str, mutate) -> str:
        d = root / name
        shutil.copytree(COURSE, d)
        mutate(d)
        return str(d)

    def weights(d: Path, fn) -> None:
        w = load_file(d / "model.safetensors")
        save_file(fn(w), d / "model.safetensors", metadata={"format": "pt"})

    def nan(w):
        k = next(iter(w))
        w[k] = w[k].clone()
        w[k][0, 0] = float("nan")
        return w

    def inf(w):
        k = sorted(w)[-1]
        w[k] = w[k].clone()
        w[k].view(-1)[0] = float("inf")
        return w

    st = lambda d: d / "model.safetensors"  # noqa: E731
    out = {
        "truncated": folder("truncated", lambda d: st(d).write_bytes(st(d).read_bytes()[:4096])),
        "garbage": folder("garbage", lambda d: st(d).write_bytes(b"not a safetensors file")),
        "empty": folder("empty", lambda d: st(d).write_bytes(b"")),
        "nan": folder("nan", lambda d: weights(d, nan)),
        "inf": folder("inf", lambda d: weights(d, inf)),
        "ints": folder("ints", lambda d: weights(d, lambda w: {k: (v * 100).to(torch.int32) for k, v in w.items()})),
        "bad_config": folder("bad_config", lambda d: (d / "config.json").write_text("{not json")),
        "list_config": folder("list_config", lambda d: (d / "config.json").write_text("[1, 2]")),
        "gpt2": folder("gpt2", lambda d: (d / "config.json").write_text('{"model_type": "gpt2"}')),
        "no_config": folder("no_config", lambda d: (d / "config.json").unlink()),
        "no_tokenizer": folder("no_tokenizer", lambda d: [(d / f).unlink() for f in
                                                          ("tokenizer.json", "tokenizer_config.json")]),
    }
    (root / "file.txt").write_text("x")
    policy = (DATA_DIR / "dvi" / "policy.pt").read_bytes()
    pieces = {"garbage_policy": b"not a torch file", "truncated_policy": policy[:2000]}
    for name, data in pieces.items():
        (root / name).mkdir()
        (root / name / "policy.pt").write_bytes(data)
    (root / "medusa_as_policy").mkdir()  # the wrong kind of piece: Medusa's heads where a DVI policy is expected
    shutil.copy(DATA_DIR / "medusa" / "heads.pt", root / "medusa_as_policy" / "policy.pt")
    (root / "smollm2_policy").mkdir()  # a piece for another model (SmolLM2's vocabulary and width)
    shutil.copy(DATA_DIR / "smollm2" / "dvi" / "policy.pt", root / "smollm2_policy" / "policy.pt")
    (root / "adapter_text.pt").write_text("not an adapter")
    (root / "not_utf8.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "bad_line.jsonl").write_text('{"prompt": "ok"}\n{oops\n')
    (root / "no_prompt.jsonl").write_text('{"text": "no prompt field"}\n')
    (root / "empty.jsonl").write_text("\n")
    (root / "fake.xz").write_bytes(b"not xz at all")
    out.update(file=str(root / "file.txt"), not_utf8=str(root / "not_utf8.jsonl"),
               bad_line=str(root / "bad_line.jsonl"), no_prompt=str(root / "no_prompt.jsonl"),
               empty_jsonl=str(root / "empty.jsonl"), fake_xz=str(root / "fake.jsonl.xz"), root=str(root),
               **{name: str(root / name) for name in ("garbage_policy", "truncated_policy", "medusa_as_policy",
                                                      "smollm2_policy")}, adapter_text=str(root / "adapter_text.pt"))
    shutil.copy(root / "fake.xz", out["fake_xz"])
    return out


G = ["generate", "--prompt", "hi", "--max-new-tokens", "2"]  # a generate call that would work
B = ["bench", "--methods", "ar", "--n-prompts", "1", "--max-new-tokens", "2", "--repeats", "1"]

# (class, argv with {name} placeholders for the `bad` fixture's paths, exit status, words the message must hold)
CLI = [
    ("weights file", G + ["--model", "{truncated}"], 2, ["model.safetensors", "truncated or corrupt"]),
    ("weights file", G + ["--model", "{garbage}"], 2, ["model.safetensors", "not a readable safetensors"]),
    ("weights file", G + ["--model", "{empty}"], 2, ["model.safetensors", "not a readable safetensors"]),
    ("weights file", G + ["--model", "{nan}"], 2, ["NaN or Inf", "must be finite"]),
    ("weights file", G + ["--model", "{inf}"], 2, ["NaN or Inf", "must be finite"]),
    ("weights file", G + ["--model", "{ints}"], 2, ["non-float tensors", "I32", "F16, BF16, F32"]),
    ("model folder", G + ["--model", "{bad_config}"], 2, ["config.json", "not valid JSON"]),
    ("model folder", G + ["--model", "{list_config}"], 2, ["config.json", "JSON object"]),
    ("model folder", G + ["--model", "{gpt2}"], 2, ["model_type 'gpt2'", "supported", "llama"]),
    ("model folder", G + ["--model", "{no_config}"], 2, ["no config.json"]),
    ("model folder", G + ["--model", "{no_tokenizer}"], 2, ["no usable tokenizer"]),
    ("model folder", G + ["--model", "{file}"], 2, ["must be a folder"]),
    ("model folder", G + ["--model", "/nonexistent/model"], 2, ["'/nonexistent/model' does not exist"]),
    ("unknown name", G + ["--model", "gpt5"], 2, ["unknown model 'gpt5'", "course, smollm2"]),
    ("unknown name", G + ["--method", "nope"], 2, ["--method", "unknown method 'nope'", "pld"]),
    ("unknown name", G + ["--method", "sps:bogus=1"], 2, ["no option 'bogus'", "its options"]),
    ("unknown name", G + ["--dtype", "int8"], 2, ["dtype must be one of", "'int8'"]),
    ("unknown name", G + ["--device", "tpu"], 2, ["device must be", "'tpu'"]),
    ("unknown name", G + ["--device", "cuda:0"] if not torch.cuda.is_available() else G + ["--device", "tpu:0"], 2,
     ["device"]),
    ("unknown name", ["nocommand"], 2, ["invalid choice: 'nocommand'", "bench"]),
    ("unknown name", B + ["--runtime", "fast"], 2, ["--runtime", "invalid choice: 'fast'", "lean", "int8"]),
    ("unknown name", B[:2] + ["ar@fast"] + B[3:], 2, ["runtime after '@'", "'hf', 'lean', 'int8'"]),
    ("number out of range", ["runtimes", "--repeats", "0"], 2, ["--repeats must be >= 1"]),
    ("unknown name", ["train", "--preset", "huge"], 2, ["--preset", "invalid choice"]),
    ("unknown name", ["curve-tau", "--method", "nope"], 2, ["--method", "invalid choice"]),
    ("unknown name", ["reproduce", "--only", "99"], 2, ["--only", "no notebook"]),
    ("unknown name", ["generate", "--prompt", "hi", "--bogus"], 2, ["unrecognized arguments: --bogus"]),
    ("number out of range", G + ["--temperature", "-1"], 2, ["temperature must be a number >= 0"]),
    ("number out of range", G + ["--temperature", "nan"], 2, ["temperature", "got nan"]),
    ("number out of range", G + ["--temperature", "inf"], 2, ["temperature", "got inf"]),
    ("number out of range", G + ["--top-p", "0"], 2, ["top_p must be in (0, 1]"]),
    ("number out of range", G + ["--top-p", "1.5"], 2, ["top_p must be in (0, 1]"]),
    ("number out of range", ["generate", "--prompt", "hi", "--max-new-tokens", "0"], 2, ["--max-new-tokens", ">= 1"]),
    ("number out of range", ["generate", "--prompt", "hi", "--max-new-tokens", "abc"], 2, ["--max-new-tokens",
                                                                                            "invalid int"]),
    ("number out of range", G + ["--method", "sps:K=0"], 2, ["'K'", "int >= 1", "got 0"]),
    ("number out of range", G + ["--method", "sps:K=abc"], 2, ["'K'", "got 'abc'"]),
    ("number out of range", G + ["--method", "kangaroo:split=99"], 2, ["exit layer", "0 < k < 12"]),
    ("number out of range", G + ["--method", "medusa:K=99"], 2, ["K=99", "heads"]),
    ("number out of range", ["bench", "--n-prompts", "0"], 2, ["--n-prompts must be >= 1"]),
    ("number out of range", ["bench", "--repeats", "0"], 2, ["--repeats must be >= 1"]),
    ("number out of range", ["bench", "--max-new-tokens", "-3"], 2, ["--max-new-tokens", ">= 1"]),
    ("number out of range", ["kangaroo-train", "--steps", "0"], 2, ["--steps must be >= 1"]),
    ("number out of range", ["medusa-train", "--steps", "-1"], 2, ["--steps must be >= 1"]),
    ("number out of range", ["bench", "--turns", "3"], 2, ["--turns", "invalid choice"]),
    ("number that overflows", G + ["--method", "hf", "--temperature", "1e-45"], 2,
     ["temperature 1e-45", "overflows", "use 0 (greedy)"]),
    ("boolean for a number", G + ["--method", "sps:K=True"], 2, ["'K'", "int >= 1", "got True"]),
    ("not UTF-8", ["generate", "--prompt", "caf\udce9", "--max-new-tokens", "2"], 2, ["prompt is not valid UTF-8",
                                                                                      "xe9"]),
    ("not UTF-8", B + ["--prompts", "{not_utf8}"], 2, ["not_utf8.jsonl", "not UTF-8"]),
    ("too long", ["generate", "--prompt", "hi " * 600, "--max-new-tokens", "2", "--raw"], 2,
     ["exceeds the model's context of 512"]),
    ("too long", ["generate", "--prompt", "hi", "--max-new-tokens", "100000"], 2, ["exceeds the model's context"]),
    ("missing file", B + ["--prompts", "/nonexistent.jsonl"], 2, ["prompts file", "does not exist"]),
    ("missing file", G + ["--method", "dvi:state={root}"], 2, ["no DVI policy", "policy.pt"]),
    ("missing file", ["prepare", "--model", "/nonexistent"], 2, ["'/nonexistent' does not exist"]),
    ("malformed file", B + ["--prompts", "{bad_line}"], 2, ["bad_line.jsonl: line 2"]),
    ("malformed file", B + ["--prompts", "{no_prompt}"], 2, ["no_prompt.jsonl: line 1", "prompt"]),
    ("malformed file", B + ["--prompts", "{empty_jsonl}"], 2, ["no prompts in the file"]),
    ("malformed file", B + ["--prompts", "{fake_xz}"], 2, ["fake.jsonl.xz", "not a readable .xz"]),
    ("piece file", G + ["--method", "dvi:state={garbage_policy}"], 2, ["policy.pt", "not a readable"]),
    ("piece file", G + ["--method", "dvi:state={truncated_policy}"], 2, ["policy.pt", "not a readable"]),
    ("piece file", G + ["--method", "dvi:state={medusa_as_policy}"], 2, ["policy.pt", "is not a"]),
    ("piece file", G + ["--method", "dvi:state={smollm2_policy}"], 2, ["policy.pt"]),
    ("piece file", ["kangaroo-train", "--teacher", "{adapter_text}", "--steps", "1", "--out", "{root}/k.pt"], 2,
     ["adapter_text.pt", "not a readable"]),
    ("output path", B + ["--json", "/proc/x.json"], 2, ["--json /proc/x.json", "cannot write there"]),
    ("output path", B + ["--json", "{root}"], 2, ["is a folder", "give the path of a file"]),
    ("output path", B + ["--json", "{file}/x.json"], 2, ["file.txt is a file", "no folder can be made"]),
    ("output path", B + ["--json", "data/medusa/heads.json"], 2, ["data/medusa/heads.json", "--force"]),
    ("output path", ["kangaroo-train", "--steps", "1", "--out", "{file}/a.pt"], 2, ["no folder can be made"]),
]


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit status, everything printed) of `python -m dvi_lite argv`, run in this process."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    return rc, buf.getvalue()


@pytest.mark.parametrize("kind,argv,status,words", CLI, ids=[f"{r[0]}:{' '.join(r[1])[:60]}" for r in CLI])
def test_cli_bad_input_gets_a_clear_error(bad: dict, kind: str, argv: list[str], status: int, words: list[str]):
    assert kind in CLASSES
    rc, out = run_cli([a.format(**bad) if "{" in a else a for a in argv])
    assert "Traceback" not in out, out[-2000:]
    assert rc == status, f"exit {rc}, printed:\n{out[-1500:]}"
    message = out.strip().splitlines()[-1] if out.strip() else ""
    assert "error" in message or "invalid" in message, message
    missing = [w for w in words if w not in out]
    assert not missing, f"message lacks {missing}: {message}"


@pytest.fixture(scope="module")
def course():
    from dvi_lite.models.loading import load_model

    return load_model("course")


def _api_cases():
    from dvi_lite.core.checks import check_int
    from dvi_lite.core.generate import generate
    from dvi_lite.core.sampling import Sampler
    from dvi_lite.models.loading import load_model

    def gen(**kw):
        def call(model, tok):
            args = {"prompt": "hi", "max_new_tokens": 2} | kw
            return generate(model, tok, args.pop("prompt"), **args)
        return call

    return [
        ("boolean for a number", gen(max_new_tokens=True), ValueError, "max_new_tokens must be an int >= 1"),
        ("boolean for a number", gen(temperature=True), ValueError, "temperature must be a number"),
        ("boolean for a number", gen(top_k=True), ValueError, "top_k must be an int"),
        ("boolean for a number", gen(top_p=True), ValueError, "top_p must be in (0, 1]"),
        ("boolean for a number", gen(seed=True), ValueError, "seed must be an int or None"),
        ("boolean for a number", gen(stop_at_eos="no"), ValueError, "stop_at_eos must be True or False"),
        ("boolean for a number", lambda m, t: check_int("steps", False, 1), ValueError, "steps must be an int"),
        ("number out of range", gen(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        ("number out of range", gen(max_new_tokens=2.5), ValueError, "max_new_tokens must be an int >= 1"),
        ("number out of range", gen(top_k=-1), ValueError, "top_k must be an int >= 0"),
        ("number out of range", lambda m, t: Sampler(float("nan")), ValueError, "temperature must be a number"),
        ("number out of range", gen(prompt=[10 ** 9]), ValueError, "prompt token ids must be in [0,"),
        ("number out of range", gen(prompt=[-1]), ValueError, "prompt token ids must be in [0,"),
        ("too long", gen(prompt=[1] * 600), ValueError, "exceeds the model's context of 512"),
        ("not UTF-8", gen(prompt="caf\udce9"), ValueError, "prompt is not valid UTF-8"),
        ("not UTF-8", gen(prompt=[{"role": "user", "content": "\udcff"}]), ValueError, "content is not valid UTF-8"),
        ("unknown name", gen(method="nope"), ValueError, "method must be one of"),
        ("unknown name", gen(method="sps", bogus=1), ValueError, "no option 'bogus'"),
        ("unknown name", gen(prompt=[{"role": "robot", "content": "hi"}]), ValueError, "the allowed roles"),
        ("unknown name", lambda m, t: load_model("gpt5"), ValueError, "unknown model 'gpt5'"),
        ("unknown name", lambda m, t: load_model("course", dtype="int4"), ValueError, "dtype must be one of"),
        ("malformed file", gen(prompt=[{"content": "hi"}]), ValueError, "has no 'role'"),
        ("malformed file", gen(prompt=[]), ValueError, "prompt is empty"),
        ("malformed file", gen(prompt=123), TypeError, "prompt must be a str, a list of token ids"),
    ]


API = _api_cases()


@pytest.mark.parametrize("case", range(len(API)), ids=[f"{c[0]}:{c[3][:40]}" for c in API])
def test_api_bad_input_gets_a_clear_error(course, case: int):
    kind, call, exc, words = API[case]
    assert kind in CLASSES
    with pytest.raises(exc) as info:
        call(*course)
    assert words in str(info.value), str(info.value)


def test_a_tiny_temperature_is_valid_in_our_loop(course):
    """1e-45 is a valid temperature: the loop takes the limit T -> 0+ (the argmax) instead of dividing into NaN."""
    from dvi_lite.core.generate import generate

    model, tok = course
    tiny = generate(model, tok, "def add(a, b):", max_new_tokens=6, temperature=1e-45, seed=1)
    greedy = generate(model, tok, "def add(a, b):", max_new_tokens=6, temperature=0.0)
    assert tiny.token_ids == greedy.token_ids


def test_the_table_covers_every_class_and_is_large():
    seen = {r[0] for r in CLI} | {c[0] for c in API}
    assert seen == set(CLASSES), set(CLASSES) - seen
    assert len(CLI) + len(API) >= 60
