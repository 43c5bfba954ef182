"""Issue 39, safe by default: no code from data, nothing committed overwritten, outputs checked first, a fingerprint
over every weight (the course model)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch

from dvi_lite.cli import main as cli_main
from dvi_lite.models.artifacts import COURSE_FINGERPRINT as COURSE
from dvi_lite.models.artifacts import artifacts_dir, ckpt_path, embedding_probe_id, fingerprint, weights_hash
from dvi_lite.paths import BUILD_DIR, DATA_DIR, ROOT
from dvi_lite.safety import BadFileError, OutputError, check_output, load_torch, tracked_files


def _pwn(path: str) -> None:
    Path(path).write_text("code ran")


class Evil:  # unpickled with weights_only=False, it calls _pwn(marker)
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (_pwn, (self.marker,))


@pytest.fixture(scope="module")
def course():
    from dvi_lite import load_model

    return load_model()


@pytest.fixture
def evil(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    f = tmp_path / "evil" / "policy.pt"
    f.parent.mkdir()
    torch.save({"fingerprint": COURSE, "split": 2, "lora_rank": 4, "lora_alpha": 8.0,
                "policy": Evil(marker), "state": Evil(marker), "tokens": Evil(marker), "adapter": Evil(marker)}, f)
    return f, marker


# 1. no code from data

def test_no_module_calls_torch_load_but_the_safe_loader():
    found = [f"{p}:{i}" for p in (ROOT / "dvi_lite").rglob("*.py") if p.name != "safety.py"
             for i, ln in enumerate(p.read_text().splitlines(), 1) if "torch.load(" in ln]
    assert not found, found


def _loaders(model, f: Path):
    from dvi_lite.methods.dvi.policy import load_policy
    from dvi_lite.methods.eagle.head import load_head
    from dvi_lite.methods.kangaroo.drafter import load_adapter
    from dvi_lite.methods.medusa import sizing
    from dvi_lite.methods.medusa.heads import load_heads
    from dvi_lite.methods.medusa.train import MedusaTrainConfig, load_checkpoint
    from dvi_lite.methods.sps.draft import load_draft
    from dvi_lite.models.teacher import load_teacher
    from dvi_lite.models.vocab import load_vocab_ids

    return {
        "dvi policy (state dir)": lambda: load_policy(model, f.parent),
        "teacher file": lambda: load_teacher(f),
        "kangaroo adapter": lambda: load_adapter(model, 2, f),
        "medusa heads": lambda: load_heads(model, f),
        "medusa sizing": lambda: sizing.apply({"heads": 1}, f, f.parent / "defaults.json", "x"),
        "medusa checkpoint": lambda: load_checkpoint(f, None, None, None, MedusaTrainConfig()),
        "eagle head": lambda: load_head(model, f),
        "sps draft": lambda: load_draft(model, f),
        "vocabulary map": lambda: load_vocab_ids(model, f),
    }


def test_a_crafted_file_runs_no_code_through_any_loader(course, evil):
    model, _ = course
    f, marker = evil
    for name, load in _loaders(model, f).items():
        with pytest.raises(BadFileError) as e:
            load()
        assert str(f) in str(e.value) and "could run code" in str(e.value), (name, str(e.value))
        assert not marker.exists(), f"{name} ran code from the file"


def test_a_crafted_file_runs_no_code_through_the_commands(evil, capsys):
    f, marker = evil
    for argv in (["generate", "--prompt", "def f(x):", "--method", f"dvi:state={f.parent}", "--max-new-tokens", "2"],
                 ["kangaroo-train", "--teacher", str(f), "--steps", "1", "--out", str(f.parent / "a.pt")]):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert str(f) in err and "Traceback" not in err, err
        assert not marker.exists(), argv


def test_a_crafted_resume_checkpoint_runs_no_code(course, tmp_path, monkeypatch, capsys):
    from dataclasses import asdict

    from dvi_lite.methods.kangaroo import train as ktrain

    model, _ = course
    monkeypatch.setattr(ktrain, "BUILD_DIR", tmp_path / "build")
    ck = tmp_path / "build" / "ckpt" / ckpt_path("kangaroo_k2", model, asdict(ktrain.AdapterConfig(split=2))).name
    ck.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"adapter": Evil(marker), "opt": {}, "gen": torch.zeros(1)}, ck)
    with pytest.raises(SystemExit):
        cli_main(["kangaroo-train", "--split", "2", "--steps", "1", "--resume", "--out", str(tmp_path / "a.pt")])
    assert "Kangaroo training checkpoint" in capsys.readouterr().err
    assert not marker.exists()


def test_files_that_are_not_what_they_claim(course, tmp_path):
    from dvi_lite.methods.dvi.policy import load_policy

    model, _ = course
    heads = DATA_DIR / "medusa" / "heads.pt"  # another kind of piece where a DVI policy is expected
    with pytest.raises(BadFileError, match=r"is not a DVI policy: it lacks \['split'"):
        load_policy(model, heads)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a torch file\n")
    with pytest.raises(BadFileError, match=r"junk.pt is not a readable DVI policy"):
        load_policy(model, junk)
    cut = tmp_path / "cut" / "policy.pt"
    cut.parent.mkdir()
    cut.write_bytes((DATA_DIR / "dvi" / "policy.pt").read_bytes()[:2000])
    with pytest.raises(BadFileError, match="truncated"):
        load_policy(model, cut.parent)
    assert sorted(load_torch(DATA_DIR / "dvi" / "policy.pt", "DVI policy"))  # the committed pieces still load


# 2. nothing committed overwritten

def _stamps(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("argv, committed", [
    (["kangaroo-train", "--steps", "1"], "data/kangaroo/adapter_k2.pt"),
    (["dvi", "--steps", "1"], "data/dvi/policy.pt"),
    (["bench", "--methods", "ar", "--json", "data/medusa/heads.json"], "data/medusa/heads.json"),
])
def test_a_command_stops_before_overwriting_a_committed_file(argv, committed, capsys, monkeypatch):
    before = _stamps(DATA_DIR)

    def no_training(*args, **kwargs):
        raise AssertionError("an optimiser was built: the command started training before checking its output")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)  # stopped before any training (a load, nothing more)
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert committed in err and "--force" in err and "PATH" in err, err
    assert _stamps(DATA_DIR) == before


def test_smoke_runs_write_under_build_only(capsys):
    before = _stamps(DATA_DIR)
    for argv in (["draft-verify-recipe", "--model", "course", "--smoke", "--out", "data/smollm2/draft_verify"],):
        with pytest.raises(SystemExit):
            cli_main(argv)
        assert "never writes under data/" in capsys.readouterr().err
    from dvi_lite.methods.medusa import teacher_recipe

    with pytest.raises(SystemExit):
        teacher_recipe.main(["--model", "course", "--smoke", "--out", str(DATA_DIR / "smollm2" / "medusa")])
    assert "never writes under data/" in capsys.readouterr().err
    assert _stamps(DATA_DIR) == before


def test_medusa_teacher_recipe_smoke_defaults_to_build(monkeypatch):
    from dvi_lite.methods.medusa import teacher_recipe

    seen = {}
    monkeypatch.setattr(teacher_recipe, "prepare_smollm2", lambda m, out, *a, **k: seen.setdefault("out", out) and {
        "top1_vs_paper": 0, "final_loss_per_head": 0, "tokens_seen": 0, "wall_time_s": 0})
    teacher_recipe.main(["--model", "course", "--smoke"])
    assert Path(seen["out"]).resolve().is_relative_to(BUILD_DIR.resolve())


def test_default_outputs_follow_the_model(course, tmp_path):
    model, _ = course
    assert artifacts_dir(model) == DATA_DIR
    other = _finetuned(model)
    assert artifacts_dir(other).is_relative_to(ROOT / "build")
    from dvi_lite.methods.kangaroo.drafter import load_adapter

    with pytest.raises(FileNotFoundError, match="build/models/"):
        load_adapter(other, 2)  # its own folder: the course model's adapter is not served to it
    with pytest.raises(ValueError, match="trained for another model"):
        load_adapter(other, 2, DATA_DIR / "kangaroo" / "adapter_k2.pt")


def test_tracked_files_without_git(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("git")))
    f = DATA_DIR / "dvi" / "policy.pt"
    assert tracked_files(f) == [f.resolve()] and tracked_files(f.with_name("x.pt")) == tracked_files(BUILD_DIR) == []


def test_gitignore_covers_checkpoints_in_data():
    for name in ("data/smollm2/medusa/distill_ckpt.pt", "data/kangaroo/ckpt_smoke.pt", "data/dvi/ckpt/policy.pt"):
        res = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT)
        assert res.returncode == 0, name


# 3. outputs checked before work

def test_bench_json_to_an_unwritable_place_fails_at_once(capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr("dvi_lite.study.bench.load_model", no_model)  # fails before any work
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--methods", "ar", "--json", "/proc/x.json"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--json /proc/x.json: cannot write there" in err and "Traceback" not in err


def test_check_output_refuses_bad_places(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "d", kind="file")
    with pytest.raises(OutputError, match="is a file"):
        check_output(tmp_path / "f", kind="dir")
    with pytest.raises(OutputError, match="no folder can be made"):
        check_output(tmp_path / "f" / "out.json", kind="file", flag="--json")
    with pytest.raises(OutputError, match="would overwrite committed files"):
        check_output(DATA_DIR / "kangaroo", kind="dir")
    assert check_output(DATA_DIR / "kangaroo", kind="dir", force=True) == DATA_DIR / "kangaroo"
    assert check_output(tmp_path / "new" / "deep" / "out.json") == tmp_path / "new" / "deep" / "out.json"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="cannot write there"):
            check_output(ro / "out.json")


# the fingerprint

def _finetuned(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[-1].mlp.down_proj.weight[0, 0] += 1e-2
    return other


def test_the_fingerprint_covers_every_weight_is_cached_and_keys_checkpoints(course):
    import copy

    from dvi_lite.methods.dvi.policy import attach_verifier_lora

    model, other = course[0], _finetuned(course[0])
    assert fingerprint(model) == COURSE and embedding_probe_id(other) == embedding_probe_id(model)  # old id: equal
    assert fingerprint(other) != COURSE and fingerprint(other) == weights_hash(other)
    with mock.patch("dvi_lite.models.artifacts.hashlib.sha256", side_effect=AssertionError("hashed again")):
        assert fingerprint(other) == weights_hash(other)  # cached on the model: no second pass over the weights
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight.mul_(2)
    assert weights_hash(other) != fingerprint(_finetuned(model))  # changed in place: a new hash
    m = copy.deepcopy(model).to(torch.bfloat16)
    attach_verifier_lora(m, 2)  # DVI's lora_D, injected in place, is a piece: the base weights name the model
    assert any("lora_" in k for k in m.state_dict()) and fingerprint(m) == COURSE  # whatever the dtype, too
    a = ckpt_path("kangaroo_k2", model, {"lr": 1e-3, "steps": 10})
    assert a == ckpt_path("kangaroo_k2", model, {"lr": 1e-3, "steps": 20})  # a longer run resumes a shorter one
    assert a != ckpt_path("kangaroo_k2", other, {"lr": 1e-3, "steps": 10})
    assert a != ckpt_path("kangaroo_k2", model, {"lr": 2e-3, "steps": 10})
    assert a.resolve().is_relative_to(BUILD_DIR.resolve())


# 4. atomic writes

WRITES_ALLOWED = {"dvi_lite/study/book.py": "the static book, under build/book and rebuilt whole by `make book`",
                  "dvi_lite/models/smollm2.py": "the converted checkpoint is written in a temporary folder, swapped in"}


def test_every_write_of_a_users_work_is_atomic():
    """Pieces, cards, results, README and notebooks are written through a temporary file and a rename
    (paths.atomic_write_*, artifacts.save_piece): a `.write_text`, `.write_bytes` or `torch.save` may only target
    a temporary (a name with "tmp" in it, renamed into place after), or sit in a module listed above."""
    import ast

    found = []
    for path in sorted((ROOT / "dvi_lite").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WRITES_ALLOWED:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr in ("write_text", "write_bytes"):
                target = ast.get_source_segment(source, node.func.value)
            elif node.func.attr == "save" and ast.get_source_segment(source, node.func.value) == "torch":
                target = ast.get_source_segment(source, node.args[1]) if len(node.args) > 1 else "?"
            else:
                continue
            if "tmp" not in target:
                found.append(f"{rel}:{node.lineno}: {node.func.attr} to {target}")
    assert not found, "writes that a kill could leave half done:\n" + "\n".join(found)


def test_the_cold_start_ablation_keeps_the_committed_dvi_head_without_force(tmp_path, capsys):
    """`--save-head data/smollm2/dvi` (the command 15_dvi_smollm2.json records) would replace the committed head:
    refused before any model loads, naming --force."""
    from dvi_lite.methods.dvi import ablation
    from dvi_lite.paths import DATA_DIR

    head = DATA_DIR / "smollm2" / "dvi"
    before = (head / "policy.pt").read_bytes()
    with pytest.raises(SystemExit) as e:
        ablation.main(["--save-head", str(head), "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--save-head" in err and "--force" in err and "Traceback" not in err, err
    assert (head / "policy.pt").read_bytes() == before
