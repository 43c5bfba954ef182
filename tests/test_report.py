"""The README's results section is generated from results/*.json and must match it."""
from dvi_lite.study import report


def test_readme_results_match_json():
    text = report.README.read_text()
    assert report.section(text) == report.render().strip("\n")


def test_readme_names_the_two_commands():
    text = report.README.read_text()
    assert "make reproduce" in text and "make test" in text


def test_reproduce_timings_are_written_and_rendered(tmp_path, monkeypatch):
    """`make reproduce` records its own wall time (setup included) and the README shows it."""
    import json
    import types

    from dvi_lite.measure import provenance
    from dvi_lite.study import reproduce

    monkeypatch.setattr(provenance, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    # a scripted clock, not the wall clock: make started 100 s before "now", so setup took 100 - 90 = 10 s exactly
    monkeypatch.setattr(reproduce, "time", types.SimpleNamespace(time=lambda: 5000.0))
    monkeypatch.setenv("DVI_MAKE_START", "4900.0")
    times = {"00_a.ipynb": 30.0, "01_b.ipynb": 60.0}
    path = reproduce.write_timings(times, 90.0, mode="smoke", command="make reproduce")
    body = json.loads(path.read_text())
    assert body["mode"] == "smoke" and body["notebooks_s"] == {"00_a.ipynb": 30.0, "01_b.ipynb": 60.0}
    assert body["setup_s"] == 10.0 and body["total_s"] == 100.0
    (tmp_path / "reproduce.json").write_text(path.read_text())
    text = report.render(tmp_path)
    assert "| setup | 00_a | 01_b | total |" in text and "| 0.5 | 1.0 |" in text


def test_study_table_shows_held_memory_and_a_measured_peak_only_when_there_is_one():
    mem = {"target_bytes": 2**20, "extra_bytes": 2**20, "kv_bytes": 2**19, "extra_params": 5}
    body = {"study": {"greedy": {"ar": {"tokens_per_s": 10.0, "speedup_vs_ar": 1.0}}}, "memory": {"ar": mem}}
    text = "\n".join(report.render_study(body))
    assert "held MB" in text and "| 5 | 2.5 |" in text and "peak MB" not in text
    body["study"]["greedy"]["ar"]["peak_mem_bytes"] = 3 * 2**20  # a CUDA run measured one
    text = "\n".join(report.render_study(body))
    assert "| held MB | peak MB |" in text and "| 5 | 2.5 | 3.0 |" in text


def test_tau_vs_cost_names_each_method_with_its_measured_speedup_in_the_legend():
    """Methods sit close together on a CPU: a legend entry per method (its colour, its measured × AR), no labels."""
    from dvi_lite.measure.figures import method_color
    from dvi_lite.study.table import tau_vs_cost_figure

    rows = {"sps": {"tau": 1.2, "predicted_speedup": 1.0, "speedup_vs_ar": 0.99},
            "pld": {"tau": 1.3, "predicted_speedup": 1.27, "speedup_vs_ar": 1.33}}
    fig = tau_vs_cost_figure(rows, ["sps", "pld"])
    points = [t for t in fig.data if t.mode == "markers"]
    assert [t.name for t in points] == ["sps: 0.99×", "pld: 1.33×"]
    assert [t.marker.color for t in points] == [method_color("sps"), method_color("pld")]
    assert abs(points[0].x[0] - 1.2) < 1e-9 and fig.layout.showlegend is not False


def test_legend_below_moves_the_legend_under_side_by_side_panels():
    from plotly.subplots import make_subplots

    from dvi_lite.course.plots import legend_below

    fig = legend_below(make_subplots(rows=1, cols=2, subplot_titles=["a", "b"]))
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y < 0 and fig.layout.margin.b >= 100


def test_gpu_column_reads_the_recorded_gpu_run_and_says_when_there_is_none(tmp_path):
    """The study's GPU column comes from results/gpu/43_study_*.json (its GPU named, its size said), never typed."""
    from dvi_lite.study import gpu

    body = gpu.load()
    assert body is not None and body["device"]["gpu"] in gpu.size(body)
    keys = {"speedup", "interval", "pooled", "tau", "c", "tokens_per_s"}
    for runtime in ("hf", "lean"):  # each runtime against its own AR
        col = gpu.column(body, runtime)
        assert col["ar"]["speedup"] == 1.0 and all(set(r) == keys for r in col.values())
        assert f"{runtime} runtime" in gpu.size(body, runtime)
    text = "\n".join(gpu.render(body))
    assert body["device"]["gpu"] in text and "lean runtime" in text and "fp32 on the GPU" in text
    # a bench its cap cut says how many of its questions it finished
    part = {"bench": {"study_hf": {"settings": {"partial": {"prompts_done": 2, "of": 6}, "repeats": 1},
                                   "methods": {}}}, "device": {"gpu": "G"}}
    assert gpu.size(part).startswith("2 of 6 held-out questions")
    assert "Triton ms" in gpu.format_kernel(body) and "medusa:attention=triton" in gpu.format_kernel(body)
    assert "kangaroo" in gpu.format_dvi(body) and "law test" in gpu.format_dvi(body)
    assert "No GPU run" in gpu.format_kernel(None) and "No GPU run" in gpu.format_dvi(None)
    assert gpu.load(tmp_path) is None and gpu.column(None) == {} and gpu.render(None) == []
    assert "No GPU run" in gpu.format_table(None)
