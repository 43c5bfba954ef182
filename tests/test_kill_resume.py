"""A real kill-and-resume: each trainer runs in a subprocess, is SIGKILLed mid-run several times, resumed with
--resume after each kill, and must end bit-identical (torch.equal on every tensor, equal logs) to an uninterrupted
run.

The three trainers run through the one CLI (`dvi_lite.cli.main(["<command>", ...])`) on a tiny 2-layer model
folder with the course tokenizer, checkpointing after every step. Every run is its own process, forked from
a driver process (DRIVER, `Zygote`) that imported torch and transformers once (most of a fresh interpreter's
start-up). Before calling the CLI, a run only:
  * installs the kill point it is asked for (KILLS): the run announces that it reached the point by writing a
    marker file, then sleeps until the parent's SIGKILL lands, so the kill provably lands there:
      - "write": inside the n-th checkpoint write (counting every torch.save to a temporary ".tmp" name): a
        random fraction of the file's bytes is on disk, the rest never comes. The trainers write to a
        temporary name and rename, so the last complete checkpoint must survive and be what the resume reads;
      - "slow" (DVI): inside the n-th slow update of lora_D, after a random number of its inner AdamW steps;
      - "time": a random delay (0 to 2 PAUSE) after the run's n-th checkpoint appears; the run pauses PAUSE
        after every checkpoint file it renames into place, so the kill lands in that pause or in the next step
        (decode, updates, log and checkpoint writes), and at least 3 more pauses remain, so it cannot end first;
  * for `dvi`: slow updates every 2 fast steps (`--slow`; the CLI has no flag for slow_every);
  * for kangaroo-train and medusa-train, supplies what their command lines lack (reported with this
    test): a checkpoint every step instead of every 120 s, the checkpoint folder (they write under the
    repository's build/ckpt), kangaroo's batch size and window length, medusa's evaluation prefixes,
    and a corpus of the first DOCS documents per split (encoding the whole corpus dwarfs the training).

Each trainer's chain of kills (KILLS: mid-write, for DVI mid-slow-update, then at a random time) is drawn from
random.Random seeded with f"{KILL_SEED}-{command}". Single-threaded subprocesses (OMP_NUM_THREADS=1), as the
reference run. Nothing here asserts a time: the delays only place the kills.
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
import dataclasses, io, json, os, sys, time, traceback
from pathlib import Path
import torch, transformers  # the heavy imports, once: every run is a fork of this process
import dvi_lite.cli, dvi_lite.models.training, dvi_lite.methods.dvi.cli
import dvi_lite.methods.kangaroo.train, dvi_lite.methods.medusa.train


def at_kill_point(marker, info):
    # tell the parent (a marker file, written atomically) that this run is at its kill point; wait for the kill
    tmp = marker + ".part"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(info))
    REAL_REPLACE(tmp, marker)
    time.sleep({TIMEOUT})
    os._exit(97)  # never reached when the parent kills: a run that outlives its kill point fails


REAL_REPLACE = os.replace


def patch(command, home, kill, marker):
    counts = {{"write": 0, "slow": 0}}
    kind = kill["kind"] if kill else None

    def replace(src, dst, *args, **kwargs):
        REAL_REPLACE(src, dst, *args, **kwargs)
        if str(dst).endswith(".pt"):
            time.sleep({PAUSE})

    if kind == "time":
        os.replace = replace
    if kind == "write":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if not str(f).endswith(".tmp"):
                return real_save(obj, f, *args, **kwargs)
            counts["write"] += 1
            if counts["write"] == kill["n"]:  # write a part of the bytes, then stop inside the write
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                data = buf.getvalue()
                cut = max(1, int(len(data) * kill["frac"]))
                with open(f, "wb") as fh:
                    fh.write(data[:cut])
                    fh.flush()
                    os.fsync(fh.fileno())
                at_kill_point(marker, {{"kind": "write", "n": counts["write"], "file": str(f), "bytes": cut,
                                       "of": len(data)}})
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    os.environ["DVI_MODELS_DIR"] = str(home / "models")
    if command == "dvi":
        from dvi_lite.methods.dvi import cli as dvi_cli, learner

        @dataclasses.dataclass
        class DVIConfig(dvi_cli.DVIConfig):
            slow_every: int = 2

        dvi_cli.DVIConfig = DVIConfig
        if kind == "slow":
            real_slow = learner.OnlineTrainer._slow_update

            def slow_update(self):
                counts["slow"] += 1
                if counts["slow"] == kill["n"]:
                    real_step, inner = self.slow_opt.step, [0]

                    def step(*args, **kwargs):
                        out = real_step(*args, **kwargs)
                        inner[0] += 1
                        if inner[0] == kill["inner"]:
                            at_kill_point(marker, {{"kind": "slow", "n": counts["slow"], "inner": inner[0],
                                                   "fast_step": self.fast_step, "slow_step": self.slow_step}})
                        return out

                    self.slow_opt.step = step
                return real_slow(self)

            learner.OnlineTrainer._slow_update = slow_update
        return
    from dvi_lite.models import training  # the shared training pieces read the corpus through load_docs
    docs = training.load_docs
    training.load_docs = lambda split, domain=None: docs(split, domain)[:{DOCS}]
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
            patch(req["command"], Path(req["home"]), req.get("kill"), req.get("marker"))
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

    def launch(self, command: str, home: Path, argv: list[str], log: Path, kill: dict | None = None,
               marker: Path | None = None) -> int:
        """Start `python -m dvi_lite <command> <argv>` as a fork, with its kill point (see KILLS); returns its pid."""
        req = {"command": command, "home": str(home), "argv": argv, "log": str(log), "kill": kill,
               "marker": None if marker is None else str(marker)}
        self.proc.stdin.write(json.dumps(req) + "\n")
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
                         "--eval-prompts", "0", "--K", "3", "--slow"], run / "ck" / "policy.pt"
    if command == "kangaroo-train":
        return common + ["--split", "1", "--out", str(run / "out" / "adapter.pt")], run / "ckpt"  # kangaroo_k1_*
    return common + ["--heads", "2", "--batch-size", "2", "--seq-len", "32", "--out", str(run / "out" / "heads.pt")], \
        run / "build" / "ckpt"  # medusa: one file named after --out, found below


def start(zygote: Zygote, command: str, model: Path, run: Path, resume: int = 0, kill: dict | None = None
          ) -> tuple[int, Path, Path, Path]:
    """Launch a run in folder `run` (resume: the how-manieth resume, 0 = a fresh run), to be killed at `kill`:
    (pid, the checkpoint it rewrites, its log, its kill-point marker)."""
    run.mkdir(parents=True, exist_ok=True)
    argv, ckpt = argv_for(command, model, run)
    name = f"resume{resume}" if resume else "run"
    log, marker = run / f"{name}.log", run / f"{name}.kill-point.json"
    return zygote.launch(command, run, argv + (["--resume"] if resume else []), log, kill, marker), ckpt, log, marker


def checkpoint_file(ckpt: Path) -> Path | None:
    if ckpt.suffix == ".pt":
        return ckpt if ckpt.is_file() else None
    found = sorted(ckpt.glob("*.pt")) if ckpt.is_dir() else []  # named after the model and recipe (or --out)
    return found[0] if found else None


def finish(zygote: Zygote, log: Path, what: str) -> None:
    rc = zygote.wait()
    assert rc == 0, f"{what} exited {rc}:\n{log.read_text()[-3000:]}"


def _stamp(ckpt: Path) -> tuple[int, int] | None:
    f = checkpoint_file(ckpt)
    try:
        st = f.stat() if f is not None else None
    except FileNotFoundError:
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns)


def _killed(zygote: Zygote, pid: int, log: Path, what: str) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it had already ended: the status below says how
        pass
    rc = zygote.wait()
    assert rc == -signal.SIGKILL, f"the run ended on its own (exit {rc}) before {what}:\n{log.read_text()[-3000:]}"


def kill_at_marker(zygote: Zygote, pid: int, marker: Path, log: Path) -> dict:
    """SIGKILL the run as soon as it announces its kill point (it sleeps there); returns what it announced."""
    t0 = time.monotonic()
    while not marker.is_file() and time.monotonic() - t0 < TIMEOUT:
        time.sleep(0.005)
    assert marker.is_file(), f"the run never reached its kill point in {TIMEOUT} s:\n{log.read_text()[-3000:]}"
    _killed(zygote, pid, log, "its kill point")
    return json.loads(marker.read_text())


def kill_after_checkpoint(zygote: Zygote, pid: int, ckpt: Path, n: int, delay: float, before, log: Path) -> int:
    """SIGKILL the run `delay` s after its n-th checkpoint appears (`before`: the file's stamp at the launch, a
    resumed run's old checkpoint, not counted); returns how many were seen."""
    seen, last, t0 = 0, before, time.monotonic()
    while time.monotonic() - t0 < TIMEOUT:
        st = _stamp(ckpt)
        if st is not None and st != last:
            last, seen = st, seen + 1
            if seen == n:
                time.sleep(delay)
                break
        time.sleep(0.005)
    _killed(zygote, pid, log, f"checkpoint {n} was seen ({seen})")
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
    """The step of the last complete checkpoint (DVI resumes from trainer.pt alone: its policy.pt may be older)."""
    if command == "dvi":
        return torch.load(ckpt.parent / "trainer.pt", map_location="cpu", weights_only=False)["counters"]["fast_step"]
    return torch.load(checkpoint_file(ckpt), map_location="cpu", weights_only=False)["step"]


def kill_chain(command: str) -> list[dict]:
    """The kill points of one killed run and its resumes, in order (see the module docstring), seeded per command.

    A fresh run writes checkpoint n (n >= 1) with the n-th torch.save to a ".tmp" name; DVI writes two files per
    checkpoint (trainer.pt, then policy.pt), so its writes 2..4 are checkpoint 1's policy.pt and checkpoint 2's
    two files. The later kills come after at least one more checkpoint, so every resume makes progress.
    """
    rng = random.Random(f"{KILL_SEED}-{command}")
    dvi = command == "dvi"
    chain = [{"kind": "write", "n": rng.randint(2, 4 if dvi else 3), "frac": round(rng.uniform(0.05, 0.95), 3)}]
    if dvi:  # slow_inner = 4 AdamW steps per slow update: stop after 1..3 of them
        chain.append({"kind": "slow", "n": 1, "inner": rng.randint(1, 3)})
    chain.append({"kind": "time", "n": 1, "delay": round(rng.uniform(0, 2 * PAUSE), 3)})
    return chain


@pytest.mark.parametrize("command", ["dvi", "kangaroo-train", "medusa-train"])
def test_killed_and_resumed_training_equals_an_uninterrupted_run(command, model_dir, zygote, tmp_path):
    ref, broken = tmp_path / "uninterrupted", tmp_path / "killed"
    _, ref_ckpt, log, _ = start(zygote, command, model_dir, ref)
    finish(zygote, log, f"{command} (uninterrupted)")

    story, at = [], 0
    for i, kill in enumerate(kill_chain(command)):
        before = _stamp(argv_for(command, model_dir, broken)[1])  # a resumed run's old checkpoint is not news
        pid, ckpt, log, marker = start(zygote, command, model_dir, broken, resume=i, kill=kill)
        if kill["kind"] == "time":
            kill_after_checkpoint(zygote, pid, ckpt, kill["n"], kill["delay"], before, log)
        else:
            got = kill_at_marker(zygote, pid, marker, log)
            assert got["kind"] == kill["kind"] and got["n"] == kill["n"], got
        left = checkpoint_step(command, ckpt)  # the last complete checkpoint loads (torch.load), whatever the kill
        if kill["kind"] == "write":  # a part of the file was on disk under its temporary name, never the real one
            tmp = Path(got["file"])
            assert tmp.suffix == ".tmp" and tmp.stat().st_size == got["bytes"] < got["of"], got
            assert left == (kill["n"] // 2 if command == "dvi" else kill["n"] - 1), (kill, left)
        elif kill["kind"] == "slow":  # killed inside the slow update of fast step f: f's checkpoint is not written
            assert got["inner"] == kill["inner"] and left == got["fast_step"] - 1, (got, left)
        assert at <= left < STEPS, f"after kill {kill} the checkpoint left says step {left} (before: {at})"
        story.append(f"{kill['kind']} {({k: v for k, v in kill.items() if k != 'kind'})} -> step {left}")
        at = left
    _, ckpt, log, _ = start(zygote, command, model_dir, broken, resume=len(story))
    finish(zygote, log, f"{command} --resume (from step {at})")

    want, got = final_state(command, ref, ref_ckpt), final_state(command, broken, ckpt)
    assert_same(want, got, command)
    if command == "dvi":
        assert len(got["log"]) == STEPS and got["trainer"]["counters"]["fast_step"] == STEPS
        assert got["trainer"]["counters"]["slow_step"] == STEPS // 2  # the slow path ran, and was resumed into
    else:
        assert got["checkpoint"]["step"] == STEPS and len(got["checkpoint"]["log"]) == STEPS
    print(f"{command}: killed {'; '.join(story)}; resumed to the end: identical")
