"""The bench CLI: clean errors for bad input, stable JSON shape (on a tiny saved model)."""
import copy
import json
import statistics

import pytest
import torch

from dvi_lite.measure import paired, summary, timing
from dvi_lite.study import bench


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--methods", "ar,nope"], "unknown method 'nope'"),
    (["--methods", ""], "at least one method"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompts", "/nonexistent.jsonl"], "does not exist"),
    (["--model", "/nonexistent_model"], "does not exist"),
    (["--dtype", "float8", "--n-prompts", "1"], "dtype must be one of"),
])
def test_bench_cli_errors(argv, needle, capsys):
    code, err = run(argv, capsys)
    assert code == 2 and needle in err and "Traceback" not in err


def test_bench_bad_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1}\n')
    code, err = run(["--prompts", str(f)], capsys)
    assert code == 2 and "'prompt'" in err


def test_leviathan_speedup():
    assert timing.leviathan_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert timing.leviathan_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert timing.leviathan_speedup(0.5, 2, 0.5) == pytest.approx((1 - 0.5 ** 3) / 0.5 / 2.0)
    assert not hasattr(bench, "predicted_speedup")  # one prediction: measure.cost's v(n) model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama with the course tokenizer, saved as a local checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dvi_lite.course_model.train import TOKENIZER_DIR

    tok = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny") / "m"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_bench_json_shape(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(tiny_model), "--draft-model", str(tiny_model), "--methods",
                       "ar,hf,sps", "--n-prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
                       "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert {"commit", "device", "torch", "transformers", "command", "date"} <= set(body["provenance"])
    assert {"settings", "verify_cost", "machine", "methods"} <= set(body)
    assert body["provenance"]["command"].startswith("python -m dvi_lite bench --model ")
    for m in ("ar", "hf", "sps"):
        r = body["methods"][m]
        assert {"tokens_per_s", "speedup_vs_ar", "tau", "alpha", "n_prompts", "new_tokens"} <= set(r)
    assert body["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    # the numbers agree with each other, not just exist: median of the rounds, ratios to AR, tau >= 1 (the file
    # keeps 6 significant digits, so the recomputed numbers agree to that)
    ar_tps = body["methods"]["ar"]["tokens_per_s"]
    six = {"rel": 1e-5}
    for m in ("ar", "hf", "sps"):
        r = body["methods"][m]
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_rounds"]), **six)
        assert r["decode_tokens_per_s"] == pytest.approx(statistics.median(r["decode_tokens_per_s_rounds"]), **six)
        # the headline is paired: the median over prompts of each prompt's decode-phase ratio, inside its interval
        per = [x for x in r["speedup_per_prompt"] if x is not None]
        assert r["speedup_vs_ar"] == pytest.approx(statistics.median(per), **six)
        assert r["speedup_interval"] == pytest.approx(list(paired.interval(per)), **six)
        assert r["speedup_confidence"] == 0.9
        assert len(r["speedup_interval_e2e"]) == 2 and r["speedup_vs_ar_e2e"] is not None
        assert r["n_prompts"] == 2 and 0 < r["new_tokens"] <= 2 * 8
    assert body["methods"]["ar"]["speedup_interval"] == [1.0, 1.0] and ar_tps > 0
    v = list(body["verify_cost"].values())  # the steady envelope: v(1) = 1 and never less for more tokens
    assert v[0] == 1.0 and v == sorted(v)
    assert len(body["verify_cost_rounds"]) == 1 and isinstance(body["verify_cost_below_one"], list)
    for m in ("ar", "hf", "sps"):  # fp32 greedy: every method's tokens are AR's
        assert body["methods"][m]["same_tokens_as_ar"] == 1.0 and body["methods"][m]["common_prefix_with_ar"] == 1.0
    sps = body["methods"]["sps"]
    assert 1.0 <= sps["tau"] <= 1 + sps["draft_depth_per_step"] and 0.0 <= sps["alpha"] <= 1.0
    assert sps["c"] > 0 and sps["measured_over_predicted"] == pytest.approx(
        sps["speedup_vs_ar"] / sps["predicted_speedup"], **six)
    # peak memory is an allocator measurement on CUDA only; on CPU it is absent, never a made-up number
    expected_peak = torch.cuda.is_available()
    assert all((r["peak_mem_bytes"] is not None) == expected_peak for r in body["methods"].values())
    # --json measures the machine by default: bandwidth, and the GB/s of weights that AR streams
    mach = body["machine"]
    assert mach["copy_GBps"] > 0 and mach["read_GBps"] > 0 and mach["weight_bytes"] > 0
    for m in ("ar", "hf"):
        r = body["methods"][m]
        assert r["weights_GBps_at_ar"] == pytest.approx(mach["weight_bytes"] * r["tokens_per_s"] / 1e9, **six)
    assert mach["weights_GBps_at_ar"] == body["methods"]["ar"]["weights_GBps_at_ar"]


def test_bench_cut_short_keeps_the_prompts_it_measured(tiny_model, tmp_path, monkeypatch):
    """A run stopped after its first prompt (a GPU lease's cap, Ctrl-C) leaves a results file marked partial."""
    out = tmp_path / "r.json"
    real = timing.run_one
    calls = []

    def stop_on_second_prompt(model, tok, rec, i, *a, **kw):
        calls.append(i)
        if i == 1 and len(calls) > 3:  # the warm-up runs prompt 0; the round's prompt 1 is where the cut comes
            raise KeyboardInterrupt
        return real(model, tok, rec, i, *a, **kw)

    monkeypatch.setattr(timing, "run_one", stop_on_second_prompt)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", str(tiny_model), "--methods", "ar,pld", "--n-prompts", "2", "--max-new-tokens", "6",
                    "--repeats", "1", "--no-machine", "--json", str(out)])
    body = json.loads(out.read_text())
    assert body["settings"]["partial"] == {"prompts_done": 1, "of": 2}
    assert set(body["methods"]) == {"ar", "pld"} and body["methods"]["pld"]["n_prompts"] == 1
    assert body["verify_cost"]["1"] == 1.0  # the v(n) table its predictions used
    assert body["provenance"]["command"].startswith("python -m dvi_lite bench")


def test_parse_spec_reads_variant_options():
    from dvi_lite.measure.timing import parse_spec

    assert parse_spec("kangaroo") == ("kangaroo", {})
    assert parse_spec("kangaroo:branch=2:threshold=0.4:adapter=none") == (
        "kangaroo", {"branch": 2, "threshold": 0.4, "adapter": None})
    assert parse_spec("draft_verify:label=uniform") == ("draft_verify", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("kangaroo:branch")


def test_a_labels_options_merge_method_then_label_then_its_own():
    """One merge rule for the bench and the study's tables: options[method], then options[label], then the
    label's own; a runtime after '@' is not an option."""
    from dvi_lite.study.table import options_for

    opts = {"eagle": {"K": 4, "lookup": False}, "eagle:lookup=true": {"K": 5}, "ar@lean": {"x": 1}}
    assert options_for(opts, "eagle") == ("eagle", {"K": 4, "lookup": False})
    assert options_for(opts, "eagle:lookup=true") == ("eagle", {"K": 5, "lookup": True})
    assert options_for(opts, "ar@lean") == ("ar", {"x": 1})
    assert options_for({}, "sps:K=2@int8") == ("sps", {"K": 2})
    with pytest.raises(ValueError, match="runtime after '@'"):
        options_for({}, "ar@fast")


def test_step_log_is_the_per_step_record_behind_tau(tiny_model):
    """A model drafting for itself (sps, greedy) has every draft token accepted; AR drafts nothing."""
    from dvi_lite.models.loading import load_model

    model, tok = load_model(str(tiny_model), dtype="float32", device="cpu")
    prompts = [{"prompt": "def f(x):"}, {"prompt": "The module"}]
    log = timing.step_log(model, tok, prompts, "sps", max_new_tokens=8, draft_model=model, K=3)
    assert log and all(isinstance(d, int) and 0 <= a <= d <= 3 for d, a in log)
    assert all(a == d for d, a in log)
    assert all(d == 0 for d, _ in timing.step_log(model, tok, prompts, "ar", max_new_tokens=8))


# --------------------------------------------------------------------------- Spec-Bench prompts, v(n), bad input

SPEC_LINES = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.", "Now make it rhyme."]},
    {"question_id": 90, "category": "translation", "turns": ["Translate to French: good morning, my friend."]},
    {"question_id": 91, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 92, "category": "math_reasoning", "turns": ["What is 12 times 7? Think step by step."]},
]


def spec_file(tmp_path, lines=SPEC_LINES):
    f = tmp_path / "spec.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return f


def test_bench_spec_bench_turns_2_on_the_course_model(tmp_path):
    """The course model has no chat template: Spec-Bench turns are raw string prompts; the JSON has per-group
    results, the v(n) table (v(1) == 1), and predictions computed from that table."""
    from dvi_lite.measure.cost import v_of

    out = tmp_path / "r.json"
    assert bench.main(["--model", "course", "--dtype", "float32", "--prompts", str(spec_file(tmp_path)),
                       "--n-prompts", "4", "--turns", "2", "--max-new-tokens", "6", "--repeats", "1",
                       "--methods", "ar,pld,sps", "--no-machine", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    prov, settings = body["provenance"], body["settings"]
    assert prov["model"] == "course" and prov["dtype"] == "float32" and len(prov["fingerprint"]) == 16
    assert settings["turns"] == 2 and settings["second_turn_prompts"] == 1 and settings["n_prompts_used"] == 4
    assert settings["chat_template"] is False
    groups = {"multi-turn", "translation", "qa", "math_reasoning"}
    for m in ("ar", "pld", "sps"):
        r = body["methods"][m]
        assert set(r["domains"]) == groups and set(r["groups"]) == groups
        assert all({"tokens_per_s", "speedup_vs_ar", "tau", "n_prompts", "new_tokens"} <= set(g)
                   for g in r["groups"].values())
        assert sum(g["n_prompts"] for g in r["groups"].values()) == 4
    v = body["verify_cost"]
    assert v["1"] == 1.0 and len(v) > 1 and all(x > 0 for x in v.values())
    assert body["machine"]["copy_GBps"] is None  # --no-machine
    r = body["methods"]["sps"]
    expected = r["tau"] / (v_of(v, r["drafted_per_step"] + 1) + r["draft_depth_per_step"] * r["c"])
    six = {"rel": 1e-5}  # the file keeps 6 significant digits: recomputed numbers agree to that
    assert r["predicted_speedup"] == pytest.approx(expected, **six)
    assert r["verify_cost_per_step"] == pytest.approx(v_of(v, r["drafted_per_step"] + 1), **six)
    assert r["measured_over_predicted"] == pytest.approx(r["speedup_vs_ar"] / expected, **six)
    assert "predicted_speedup" not in body["methods"]["ar"]  # AR drafts nothing: no formula


@pytest.fixture(scope="module")
def course():
    from dvi_lite.models.loading import load_model

    return load_model("course", dtype="float32", device="cpu")


def test_prepare_raw_and_chat(course):
    """Without a chat template a turn is a raw string (turn 2: first turn, own answer, second turn); with one,
    chat messages (turn 2: user, assistant = the model's first answer, user). Our records stay as they are."""
    from dvi_lite.models.specbench import parse_line

    model, tok = course
    recs = [parse_line(x, i) for i, x in enumerate(SPEC_LINES[:2], 1)] + [{"prompt": "def f(x):", "domain": "code"}]
    one = bench.prepare(model, tok, recs, 1, 4)
    assert [p["prompt"] for p in one] == [SPEC_LINES[0]["turns"][0], SPEC_LINES[1]["turns"][0], "def f(x):"]
    two = bench.prepare(model, tok, recs, 2, 4)
    assert two[0]["turn"] == 2 and two[1]["turn"] == 1 and two[2] == recs[2]
    first, second = SPEC_LINES[0]["turns"]
    assert two[0]["prompt"].startswith(first + "\n") and two[0]["prompt"].endswith("\n" + second)
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = bench.prepare(model, chat_tok, recs, 2, 4)
    assert [m["role"] for m in chat[0]["prompt"]] == ["user", "assistant", "user"]
    assert chat[0]["prompt"][2]["content"] == second and chat[1]["prompt"] == recs[1]["prompt"]


def test_bench_spread_keeps_domain_records():
    recs = [{"prompt": f"p{i}", "domain": d} for i, d in enumerate(["code", "code", "prose", "prose"])]
    assert [p["prompt"] for p in bench.spread(recs, 3)] == ["p0", "p2", "p1"]
    assert bench.spread(recs, 0) == []


def test_bench_error_unknown_model_lists_names(capsys):
    code, err = run(["--model", "nope", "--n-prompts", "1"], capsys)
    assert code == 2 and "unknown model 'nope'" in err and "course, smollm2" in err and "Traceback" not in err


def test_bench_error_dtype_the_device_cannot_run(monkeypatch, capsys):
    from dvi_lite.models import loading

    monkeypatch.setattr(loading, "dtype_works", lambda dt, device: dt == torch.float32)
    code, err = run(["--dtype", "bfloat16", "--n-prompts", "1"], capsys)
    assert code == 2 and "dtype bfloat16 is not supported on device 'cpu'" in err and "Traceback" not in err


def test_bench_error_malformed_spec_bench_line(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(SPEC_LINES[0]) + "\n\n" + json.dumps({"category": "qa", "turns": []}) + "\n")
    code, err = run(["--prompts", str(f)], capsys)
    assert code == 2 and "line 3" in err and "'turns'" in err and "Traceback" not in err


@pytest.mark.parametrize("turns", ["0", "3"])
def test_bench_error_turns(turns, capsys):
    code, err = run(["--turns", turns], capsys)
    assert code == 2 and "--turns" in err and "invalid choice" in err


def test_agreement_with_ar_counts_prompts_and_prefixes():
    a = summary.agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert a["same_tokens_as_ar"] == pytest.approx(1 / 3)
    assert a["common_prefix_with_ar"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    with pytest.raises(ValueError):
        summary.agreement([[1]], [[1], [2]])


def test_why_they_differ_is_computed_from_the_measured_row():
    from dvi_lite.study.table import why

    row = {"tau": 1.5, "predicted_speedup": 1.0, "c": 0.1, "draft_depth_per_step": 2.0, "alpha": 0.3}
    text = why("kangaroo", row, 2.0)  # step = 1.5 forwards: verify 1.3 + K c 0.2; 2x needs tau 3.0 = K + 1
    assert "step costing 1.50 forwards (verify 1.30 + K·c 0.20)" in text and "needs τ ≥ 3.00" in text
    assert "no acceptance suffices" in why("sps", row, 2.5)  # 3.75 > K + 1 = 3, at a fixed draft length
    gated = why("kangaroo", row, 2.5)  # a confidence gate: the measured K is an outcome, not a limit
    assert "K is an outcome" in gated and "no acceptance suffices" not in gated
    assert "in-engine" in why("hf_assisted", {"tokens_per_s": 10.0})
