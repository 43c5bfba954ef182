"""A real kill-and-resume: each trainer runs in a subprocess, is SIGKILLed mid-run, resumed with --resume,
and must end bit-identical (torch.equal on every tensor, equal logs) to an uninterrupted run.

The three trainers run through the one CLI (`dvi_lite.cli.main(["<command>", ...])`) on a tiny 2-layer model
folder with the course tokenizer, checkpointing after every step. Every run is its own process, forked from
a driver process (DRIVER, `Zygote`) that imported torch and transformers once (most of a fresh interpreter's
start-up; there are three runs per trainer). Before calling the CLI, a run only:
  * pauses PAUSE seconds after each checkpoint file is renamed into place, so that the parent sees
    checkpoint N before the run is over (the kill lands in that pause or in the next step, mid-write);
  * for kangaroo-train and medusa-train, supplies what their command lines lack (reported with this
    test): a checkpoint every step instead of every 120 s, the checkpoint folder (they write under the
    repository's build/ckpt), kangaroo's batch size and window length, medusa's evaluation prefixes,
    and a corpus of the first DOCS documents per split (encoding the whole corpus dwarfs the training).
`python -m dvi_lite dvi` has all of it as flags and runs unpatched apart from the pause.

The checkpoint to kill after, N in [1, STEPS - 3], and the delay after it come from random.Random seeded
with f"{KILL_SEED}-{command}". Single-threaded subprocesses (OMP_NUM_THREADS=1), as the reference run.
"""
from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

STEPS = 6
PAUSE = 0.1
DOCS = 48
KILL_SEED = 19
TIMEOUT = 180

DRIVER = f"""
import dataclasses, json, os, sys, time, traceback
from pathlib import Path
import torch, transformers  # the heavy imports, once: every run is a fork of this process
import dvi_lite.cli, dvi_lite.course_model.train, dvi_lite.methods.dvi.cli
import dvi_lite.methods.kangaroo.train, dvi_lite.methods.medusa.train


def patch(command, home):
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if str(dst).endswith(".pt"):
            time.sleep({PAUSE})

    os.replace = replace
    os.environ["DVI_MODELS_DIR"] = str(home / "models")
    if command == "dvi":
        return
    from dvi_lite.course_model import train as course
    docs = course.load_docs
    course.load_docs = lambda split, domain=None: docs(split, domain)[:{DOCS}]
    if command == "kangaroo-train":
        from dvi_lite.methods.kangaroo import train as mod

        @dataclasses.dataclass
        class Config(mod.AdapterConfig):
            ckpt_every_s: float = 0.0
            batch_size: int = 2
            seq_len: int = 64

        mod.BUILD_DIR, mod.AdapterConfig = home, Config
    else:
        from dvi_lite.methods.medusa import train as mod

        @dataclasses.dataclass
        class Config(mod.MedusaTrainConfig):
            ckpt_every_s: float = 0.0
            eval_prefixes: int = 16

        mod.ROOT, mod.MedusaTrainConfig = home, Config


for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 1
        try:
            patch(req["command"], Path(req["home"]))
            code = dvi_lite.cli.main([req["command"], *req["argv"]])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({{"pid": pid}}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({{"exit": os.waitstatus_to_exitcode(status)}}), flush=True)
"""


class Zygote:
    """A process that imported torch, transformers and the trainers once; each run is a fork of it (a real,
    separate process: its own pid, killed with a real SIGKILL), without paying for the imports per run."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
               "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout] + [self.lines.put("")],
                         daemon=True).start()

    def _read(self) -> dict:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no answer from the run in {TIMEOUT} s") from None
        assert line, f"the driver died (exit {self.proc.wait()})"
        return json.loads(line)

    def launch(self, command: str, home: Path, argv: list[str], log: Path) -> int:
        """Start `python -m dvi_lite <command> <argv>` as a fork; returns its pid."""
        self.proc.stdin.write(json.dumps({"command": command, "home": str(home), "argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return self._read()["pid"]

    def wait(self) -> int:
        """The exit status of the run launched last (negative: killed by that signal)."""
        return self._read()["exit"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def zygote():
    if not hasattr(os, "fork"):
        pytest.fail("the kill-and-resume test forks its runs (os.fork): run it on Linux or macOS")
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama with the course tokenizer (vocabulary 8192), saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dvi_lite.models.loading import COURSE_MODEL

    d = tmp_path_factory.mktemp("kill_resume") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((COURSE_MODEL / f).read_bytes())
    prompts = d.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(6)))
    return d


def argv_for(command: str, model: Path, run: Path) -> tuple[list[str], Path]:
    """The command's arguments for a run in folder `run`, and the checkpoint file it rewrites every step."""
    common = ["--model", str(model), "--steps", str(STEPS)]
    if command == "dvi":
        return common + ["--split", "1", "--ckpt-every", "1", "--ckpt-dir", str(run / "ck"), "--out", str(run / "out"),
                         "--prompts", str(model.parent / "prompts.jsonl"), "--max-new-tokens", "16",
                         "--eval-prompts", "0", "--k", "3"], run / "ck" / "policy.pt"
    if command == "kangaroo-train":
        return common + ["--split", "1", "--out", str(run / "out" / "adapter.pt")], run / "ckpt" / "kangaroo_k1.pt"
    return common + ["--heads", "2", "--batch-size", "2", "--seq-len", "32", "--out", str(run / "out" / "heads.pt")], \
        run / "build" / "ckpt"  # medusa: one file named after --out, found below


def start(zygote: Zygote, command: str, model: Path, run: Path, resume: bool = False) -> tuple[int, Path, Path]:
    """Launch a run in folder `run`: (pid, the checkpoint it rewrites, its log)."""
    run.mkdir(parents=True, exist_ok=True)
    argv, ckpt = argv_for(command, model, run)
    log = run / f"{'resume' if resume else 'run'}.log"
    return zygote.launch(command, run, argv + (["--resume"] if resume else []), log), ckpt, log


def checkpoint_file(ckpt: Path) -> Path | None:
    if ckpt.suffix == ".pt":
        return ckpt if ckpt.is_file() else None
    found = sorted(ckpt.glob("medusa_*.pt")) if ckpt.is_dir() else []
    return found[0] if found else None


def finish(zygote: Zygote, log: Path, what: str) -> None:
    rc = zygote.wait()
    assert rc == 0, f"{what} exited {rc}:\n{log.read_text()[-3000:]}"


def kill_after_checkpoint(zygote: Zygote, pid: int, ckpt: Path, n: int, delay: float) -> int:
    """SIGKILL the run `delay` s after its n-th checkpoint appears; returns how many were seen."""
    seen, last, t0 = 0, None, time.time()
    while time.time() - t0 < TIMEOUT:
        f = checkpoint_file(ckpt)
        try:
            st = f.stat() if f is not None else None
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_ino, st.st_mtime_ns) != last:
            last, seen = (st.st_ino, st.st_mtime_ns), seen + 1
            if seen == n:
                time.sleep(delay)
                break
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it had already ended: the status below says how
        pass
    rc = zygote.wait()
    assert rc == -signal.SIGKILL, f"the run ended on its own (exit {rc}) before checkpoint {n} was seen ({seen})"
    return seen


# Not compared: wall-clock fields and the command line (they differ by design), and DVI's saved Python and numpy
# global RNG states: nothing seeds them (a fresh process starts them from OS entropy; Python reseeds its own
# after a fork), so two uninterrupted runs already differ there. Nothing draws from them: every tensor, the
# torch RNG state included, must still be equal.
SKIP = re.compile(r"time|elapsed|per_s|provenance")
UNSEEDED = {".trainer.rng.python", ".trainer.rng.numpy"}


def assert_same(a, b, path: str = "") -> None:
    """Equal nested states: tensors bit for bit (torch.equal, same dtype), arrays, and every other leaf."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"tensor {path} differs"
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"array {path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if not SKIP.search(str(k)) and not any(f"{path}.{k}".endswith(u) for u in UNSEEDED):
                assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def final_state(command: str, run: Path, ckpt: Path) -> dict:
    """Everything the run leaves: the last checkpoint (model, optimiser, RNG, counters, log) and its output."""
    state = {"checkpoint": torch.load(checkpoint_file(ckpt), map_location="cpu", weights_only=False)}
    if command == "dvi":
        state["trainer"] = torch.load(ckpt.parent / "trainer.pt", map_location="cpu", weights_only=False)
        state["output"] = torch.load(run / "out" / "policy.pt", map_location="cpu", weights_only=False)
        state["log"] = [json.loads(x) for x in (run / "out" / "log.jsonl").read_text().splitlines()]
    else:
        out = next((run / "out").glob("*.pt"))
        state["output"] = torch.load(out, map_location="cpu", weights_only=False)
    return state


def checkpoint_step(command: str, ckpt: Path) -> int:
    f = checkpoint_file(ckpt)
    if command == "dvi":
        return torch.load(f.parent / "trainer.pt", map_location="cpu", weights_only=False)["counters"]["fast_step"]
    return torch.load(f, map_location="cpu", weights_only=False)["step"]


@pytest.mark.parametrize("command", ["dvi", "kangaroo-train", "medusa-train"])
def test_killed_and_resumed_training_equals_an_uninterrupted_run(command, model_dir, zygote, tmp_path):
    rng = random.Random(f"{KILL_SEED}-{command}")
    n, delay = rng.randint(1, STEPS - 3), rng.uniform(0, 1.5 * PAUSE)
    ref, broken = tmp_path / "uninterrupted", tmp_path / "killed"

    _, ref_ckpt, log = start(zygote, command, model_dir, ref)
    finish(zygote, log, f"{command} (uninterrupted)")
    pid, ckpt, _ = start(zygote, command, model_dir, broken)
    kill_after_checkpoint(zygote, pid, ckpt, n, delay)
    at = checkpoint_step(command, ckpt)
    assert n <= at < STEPS, f"killed after checkpoint {n}, the checkpoint left says step {at} of {STEPS}"
    _, _, log = start(zygote, command, model_dir, broken, resume=True)
    finish(zygote, log, f"{command} --resume (from step {at})")

    want, got = final_state(command, ref, ref_ckpt), final_state(command, broken, ckpt)
    assert_same(want, got, command)
    if command == "dvi":
        assert len(got["log"]) == STEPS and got["trainer"]["counters"]["fast_step"] == STEPS
    else:
        assert got["checkpoint"]["step"] == STEPS and len(got["checkpoint"]["log"]) == STEPS
    print(f"{command}: killed {delay:.2f} s after checkpoint {n}, resumed from step {at}: identical")
