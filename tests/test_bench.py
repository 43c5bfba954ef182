"""The bench CLI: clean errors for bad input, stable JSON shape (on a tiny saved model)."""
import json

import pytest
import torch

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


def test_predicted_speedup():
    assert bench.predicted_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert bench.predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert bench.predicted_speedup(0.5, 2, 0.5) == pytest.approx((1 - 0.5 ** 3) / 0.5 / 2.0)


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
    assert body["provenance"]["command"].startswith("python -m dvi_lite bench --model ")
    for m in ("ar", "hf", "sps"):
        r = body["methods"][m]
        assert {"tokens_per_s", "speedup_vs_ar", "tau", "alpha", "n_prompts", "new_tokens"} <= set(r)
    assert body["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert body["methods"]["sps"]["tau"] is not None
    # peak memory is an allocator measurement on CUDA only; on CPU it is absent, never a made-up number
    expected_peak = torch.cuda.is_available()
    assert all((r["peak_mem_bytes"] is not None) == expected_peak for r in body["methods"].values())


def test_parse_spec_reads_variant_options():
    from dvi_lite.study.bench import parse_spec

    assert parse_spec("kangaroo") == ("kangaroo", {})
    assert parse_spec("kangaroo:branch=2:threshold=0.4:adapter=none") == (
        "kangaroo", {"branch": 2, "threshold": 0.4, "adapter": None})
    assert parse_spec("draft_verify:label=uniform") == ("draft_verify", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("kangaroo:branch")


def test_step_log_is_the_per_step_record_behind_tau(tiny_model):
    """A model drafting for itself (sps, greedy) has every draft token accepted; AR drafts nothing."""
    from dvi_lite.models.loading import load_model

    model, tok = load_model(str(tiny_model), dtype="float32", device="cpu")
    prompts = [{"prompt": "def f(x):"}, {"prompt": "The module"}]
    log = bench.step_log(model, tok, prompts, "sps", max_new_tokens=8, draft_model=model, k=3)
    assert log and all(isinstance(d, int) and 0 <= a <= d <= 3 for d, a in log)
    assert all(a == d for d, a in log)
    assert all(d == 0 for d, _ in bench.step_log(model, tok, prompts, "ar", max_new_tokens=8))
