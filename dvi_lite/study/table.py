"""Chapter 06 (the study): every method in one benchmark run, the papers' claims beside ours.

What the notebook calls: `method_options` (how each method is configured in the study), `extra_params`
(parameters a method adds to the target), `memory` (what it holds besides the target), `run_study`
(one interleaved bench per sampling setting), `group_speedups` / `group_heatmap` (x AR per task group),
`tau_vs_cost_figure` with `iso_speedup` (the cost model's lines)
and `PAPERS` (headline claims, transcribed from ../shared/REFERENCE.md with their sources).

`check_bench` (with `require` and `finite`) asserts what every notebook's benchmark table claims: a row per
method it benched, with finite, meaningful numbers. Each notebook's last cell calls its chapter's
`check_invariants`, built on these, so a run that produced nonsense stops instead of writing results.
"""
from __future__ import annotations

import math
from pathlib import Path

from dvi_lite.core.kvcache import kv_bytes
from dvi_lite.measure.timing import bench
from dvi_lite.measure.timing import options_for as options_for  # re-exported: the notebooks read it here
from dvi_lite.models.loading import DRAFT_MODEL

# method -> (paper, headline claim as the authors report it, setting); from REFERENCE.md, not measured here
PAPERS: dict[str, dict] = {
    "sps": {"paper": "Leviathan et al. 2023; Chen et al. 2023", "claim": "2–3× (T5-XXL); 2–2.5× (Chinchilla 70B)",
            "speedup": 2.0, "setting": "T5-XXL / Chinchilla 70B, TPU/GPU"},
    "hf_assisted": {"paper": "transformers assisted generation", "claim": "up to 2.7× (dynamic speculation)",
                    "speedup": 2.7, "setting": "various, GPU"},
    "kangaroo": {"paper": "Liu et al. 2024 (arXiv v1; NeurIPS 2024)",
                 "claim": "up to 1.68× (arXiv v1); up to 2.04× (NeurIPS 2024 version)", "speedup": 1.68,
                 "setting": "Vicuna-7B, Spec-Bench, single-sequence verification, exit layer 2, η = 0.6; "
                            "its GPU is not transcribed here"},
    "draft_verify": {"paper": "Zhang et al. ACL 2024", "claim": "up to 1.99× (70B); 1.58× (13B, maintainers)",
                     "speedup": 1.99, "setting": "LLaMA-2-70B CNN/DM"},
    "medusa": {"paper": "Cai et al. 2024; Spec-Bench leaderboard (Xia et al. 2024)",
               "claim": "2.18× (Medusa-1, MT-Bench); Spec-Bench leaderboard 1.78× at τ 2.32 (A100), 1.44× (RTX 3090)",
               "speedup": 1.78,
               "setting": "Vicuna-7B, Spec-Bench, greedy, FP16, A100 (the paper's 2.18× is MT-Bench); "
                          "head top-1 acc. 0.56/0.32/0.20/0.15/0.12"},
    "dvi": {"paper": "Bhansali & Heck 2025", "claim": "2.16×", "speedup": 2.16,
            "setting": "Spec-Bench (target unverified; repo default Llama-2-7b-hf)"},
    "pld": {"paper": "Saxena 2023; Spec-Bench leaderboard (Xia et al. 2024)",
            "claim": "1.64× at τ 1.73 (Spec-Bench leaderboard, Vicuna-7B, RTX 3090)", "speedup": 1.64,
            "setting": "Vicuna-7B, Spec-Bench, greedy, FP16, batch 1, RTX 3090"},
    "eagle": {"paper": "Li et al. 2024 (EAGLE-1, EAGLE-2); Li et al. 2025 (EAGLE-3)",
              "claim": "EAGLE-2: 3.05–4.26× (its own benchmarks); Spec-Bench leaderboard 2.19–2.25× at τ 4.35 "
                       "(Vicuna-7B, RTX 3090); EAGLE-3: up to 6.5×, Spec-Bench 3.02× at τ 5.71 (Vicuna-13B, A100)",
              "speedup": 2.25,
              "setting": "EAGLE-2, Vicuna-7B, Spec-Bench leaderboard, greedy, FP16, RTX 3090 (the leaderboard has "
                         "no EAGLE-2 A100 row)"},
}

# methods whose draft length per step is decided by a gate (a confidence threshold, D&V's adaptive γ)
GATED = ("kangaroo", "draft_verify", "dvi")


def why(method: str, row: dict, speedup: float | None = None) -> str:
    """Why our number differs from the paper's, computed from the measured row (tau, alpha, c, K, predicted).

    The cost model prices one step at D = tau / predicted = v(nodes + 1) + K c target forwards; the paper's
    speedup S would need tau >= S D at that price, and tau can never exceed K + 1 (every draft accepted), so
    when S D > K + 1 the step itself is too expensive: it must cost <= (K + 1) / S.
    """
    s = PAPERS.get(method, {}).get("speedup") if speedup is None else speedup
    tau, pred, c, k = (row.get(x) for x in ("tau", "predicted_speedup", "c", "draft_depth_per_step"))
    if s is None:
        return "no paper number to compare"
    if not tau or not pred or c is None or k is None:
        return "no tau / c measured in-engine (the method runs its own loop): only its speed compares"
    d = tau / pred  # step cost in target forwards: verify + K c
    alpha = row.get("alpha")
    out = (f"τ {tau:.2f}" + (f" (α {alpha:.2f})" if alpha is not None else "") + f" for a step costing {d:.2f} "
           f"forwards (verify {d - k * c:.2f} + K·c {k * c:.2f}); {s:g}× needs τ ≥ {s * d:.2f}")
    if s * d > k + 1 and method in GATED:  # K is what the gate let through, not a limit
        out += (f", more than K + 1 = {k + 1:.1f} at the measured mean draft length K = {k:.1f}: a draft gated by "
                "confidence stops where its confidence falls, so K is an outcome; a better draft drafts longer "
                "and moves τ and the price together")
    elif s * d > k + 1:
        out += (f", more than K + 1 = {k + 1:.1f}: at this draft length no acceptance suffices (the step must cost "
                f"≤ {(k + 1) / s:.2f})")
    return out


def method_options(split: int | None = None) -> dict[str, dict]:
    """The study's configuration of each method: each method's defaults, which its sizing command sets per model
    (the model's defaults.json: SpS's K, Medusa's tree, the exit layer), else the paper's.

    split None leaves Kangaroo and DVI at the model's default exit layer (core.checks.default_split), the
    layer their committed pieces and `prepare` are trained for.
    """
    exit_layer = {} if split is None else {"split": split}
    # SpS and HF assisted with no K draft at the draft's sized K (defaults.json, where `sps-sizing --apply` put it;
    # methods.sps.drafter.sized_k), else 4
    return {"sps": {}, "hf_assisted": {}, "kangaroo": dict(exit_layer),
            "draft_verify": {}, "medusa": {}, "dvi": dict(exit_layer)}


def configurations(model, methods: list[str]) -> dict[str, str]:
    """method -> what it runs at in the study and where that comes from: the model's defaults.json (each sizing
    command writes its pick there, with the results file behind it), else the method's own defaults (read from its
    factory's signature, so this cannot drift from what runs). Printed under the table and kept in the results."""
    import inspect
    import re

    from dvi_lite.core.registry import get_method
    from dvi_lite.methods.sps.drafter import sized_k
    from dvi_lite.models.artifacts import artifacts_dir, default_split_for, model_defaults
    from dvi_lite.paths import ROOT

    d = model_defaults(model)
    def src(entry: dict | None) -> str:  # " (results/X.json)": the sizing result an entry's "why" names
        m = re.search(r"results/[\w.]+\.json", (entry or {}).get("why", ""))
        return f" ({m.group(0)})" if m else ""

    def dflt(method: str, name: str):
        return inspect.signature(get_method(method).load()).parameters[name].default

    split, k = default_split_for(model), sized_k(model)
    skip = artifacts_dir(model) / "draft_verify" / "skip.json"
    med = d.get("medusa", {})
    skip_set = ("no skip set" if not skip.is_file() else
                f"the searched skip set ({skip.relative_to(ROOT)})" if skip.is_relative_to(ROOT) else "its skip set")
    text = {
        "ar": "one token per target forward",
        "hf": "transformers' generate",
        "hf_assisted": f"the SpS draft at K = {k}, in transformers' assisted generation",
        "sps": f"K = {k}" + (f", sps-sizing's pick{src(d['sps'])}" if "sps" in d else ", the default"),
        "pld": f"K = {dflt('pld', 'K')}, n-grams up to {dflt('pld', 'max_ngram')} (the paper's defaults, not sized)",
        "kangaroo": f"exit layer {split} {_kangaroo_exit(model, split)}, K = {dflt('kangaroo', 'K')}, "
                    f"η = {dflt('kangaroo', 'threshold')}",
        "draft_verify": f"{skip_set}, K = {dflt('draft_verify', 'K')}, "
                        f"γ toward α = {dflt('draft_verify', 'target_alpha')}",
        "medusa": (f"{len(med['tree'])}-node tree, {med.get('K')} heads, medusa-sizing's pick{src(med)}"
                   if med.get("tree") else "the default tree"),
        "dvi": f"exit layer {split} (its committed head's), K = {dflt('dvi', 'K')}, threshold "
               f"{dflt('dvi', 'threshold')} (the reference's defaults, not sized)",
        "eagle": f"{dflt('eagle', 'tree')} tree (EAGLE-2's expansion), depth {dflt('eagle', 'K')}, "
                 f"{_eagle_nodes(model)}",
    }
    out = {}
    for m in methods:
        base, *opts = m.split(":")
        out[m] = text.get(base, "its defaults") + "".join(f", {o}" for o in opts)
    return out


def _kangaroo_exit(model, split: int) -> str:
    """Where the study's exit layer comes from: the model's exit sweep's pick (results/15_kangaroo_<model>.json),
    or the committed adapter's when the sweep (re-run since) ranks another layer first: the printout says so rather
    than claim the sweep chose it."""
    import json

    from dvi_lite.models.artifacts import artifacts_dir
    from dvi_lite.paths import ROOT

    sweep = f"results/15_kangaroo_{artifacts_dir(model).name}.json"
    path = ROOT / sweep
    chosen = json.loads(path.read_text()).get("sweep", {}).get("chosen_k") if path.is_file() else None
    if chosen is None:
        return "(the committed adapter's)"
    if chosen == split:
        return f"(the exit sweep's pick, {sweep})"
    return f"(the committed adapter's; the exit sweep, {sweep}, ranks k = {chosen} first)"


def _eagle_nodes(model) -> str:
    """EAGLE's verified-node budget, and eagle-budget's result behind it when that file sized this model to it."""
    import json

    from dvi_lite.methods.eagle.drafter import DEFAULT_MAX_NODES
    from dvi_lite.models.artifacts import artifacts_dir
    from dvi_lite.paths import ROOT

    budget = ROOT / "results" / "28_eagle_budget.json"
    found = json.loads(budget.read_text()) if budget.is_file() else {}
    sized = found.get("model") == artifacts_dir(model).name and found.get("best_nodes") == DEFAULT_MAX_NODES
    return f"{DEFAULT_MAX_NODES} nodes" + (" (eagle-budget's pick, results/28_eagle_budget.json)" if sized else "")


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def extra_params(model, method: str, options: dict | None = None) -> int:
    """Parameters a method adds on top of the target: every module it really holds (methods.params)."""
    from dvi_lite.methods.params import added_parameters

    return added_parameters(model, method, None, **(options or {}))


def memory(model, method: str, options: dict, positions: int) -> dict:
    """Memory a method holds: the target's weights + its extra parameters + the KV cache (bytes).

    On CUDA, `bench` also measures each method's peak (torch.cuda.max_memory_allocated, reset before
    every method's run: "peak_mem_bytes"); on CPU there is no allocator counter for torch tensors, so
    this accounting is the comparable number there.
    """
    el = next(model.parameters()).element_size()
    extra = extra_params(model, method, options)
    return {"target_bytes": _count(model) * el, "extra_params": extra, "extra_bytes": extra * el,
            "kv_bytes": kv_bytes(model.config, positions, el)}


def run_study(model, tok, prompts: list[dict], methods: list[str], settings: list[dict], max_new_tokens: int,
              repeats: int, seed: int = 0, options: dict | None = None) -> dict[str, dict]:
    """One paired, interleaved bench per sampling setting ({"name", "temperature", "top_p"?, "repeats"?,
    "greedy_only"?: methods left out when sampling, "n_prompts"?: the first n prompts only})."""
    options = options or method_options()
    out = {}
    for s in settings:
        ms = [m for m in methods if s["temperature"] == 0 or m not in s.get("greedy_only", ())]
        ps = prompts[: s["n_prompts"]] if s.get("n_prompts") else prompts
        out[s["name"]] = bench(model, tok, ps, ms, max_new_tokens, s.get("repeats", repeats),
                               s["temperature"], s.get("top_p", 1.0), seed, options)
    return out


def group_speedups(results: dict) -> dict[str, dict[str, float | None]]:
    """method -> {task group (or domain): x AR in that group}: the bench's paired per-group speedup (the median of
    the group's per-prompt decode-phase ratios)."""
    return {m: {d: g.get("speedup_vs_ar") for d, g in r.get("groups", {}).items()} for m, r in results.items()}


def group_heatmap(groups: dict[str, dict], title: str):
    """Methods x task groups, coloured by x AR around 1 (red slower, blue faster), each cell labelled."""
    import plotly.graph_objects as go

    methods, cols = list(groups), list(next(iter(groups.values())))
    z = [[groups[m][d] for d in cols] for m in methods]
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=methods, zmid=1.0, colorscale="RdBu", colorbar=dict(title="× AR"),
                               text=[[("–" if v is None else f"{v:.2f}") for v in row] for row in z],
                               texttemplate="%{text}"))
    fig.update_layout(title=title, xaxis_title="task group", yaxis=dict(autorange="reversed"),
                      height=120 + 36 * len(methods))
    return fig


def iso_speedup(speedups: list[float], x_max: float = 2.0, n: int = 50) -> dict[float, dict]:
    """For the tau-vs-cost plot. A step costs D = v(K+1) + K c target forwards and yields tau tokens, so
    speedup = tau / D: for a fixed speedup s the methods lie on the line tau = s D."""
    xs = [x_max * i / (n - 1) for i in range(n)]
    return {s: {"x": xs, "tau": [s * x for x in xs]} for s in speedups}


def tau_vs_cost_figure(results: dict, methods: list[str]):
    """tau against the step's cost D = tau / predicted (verify + K c, in target forwards, from the measured v(n)
    and c), with the cost model's iso-speedup lines tau = s D. A point's position is the prediction; its legend
    entry gives the measured speedup, so the gap between the two is visible. Methods sit close together on a
    CPU, so they are named in the legend (one colour each) rather than by text labels that would overlap."""
    import plotly.graph_objects as go

    from dvi_lite.measure.figures import method_color

    d = {m: results[m]["tau"] / results[m]["predicted_speedup"] for m in methods}
    x_max = max([1.5, *d.values()]) * 1.15
    fig = go.Figure()
    for s, line in iso_speedup([0.5, 0.75, 1.0, 1.5, 2.0], x_max=x_max).items():
        fig.add_scatter(x=line["x"], y=line["tau"], mode="lines", line=dict(dash="dot", width=1, color="#999"),
                        name=f"{s}× predicted", showlegend=False)
        fig.add_annotation(x=x_max, y=s * x_max, text=f"{s}×", showarrow=False, xanchor="left", font_size=10)
    for m in methods:
        fig.add_scatter(x=[d[m]], y=[results[m]["tau"]], mode="markers", marker=dict(size=12, color=method_color(m),
                        line=dict(width=1, color="white")), name=f"{m}: {results[m]['speedup_vs_ar']:.2f}×",
                        hovertemplate=f"{m}<br>step cost %{{x:.2f}}<br>τ %{{y:.2f}}<extra></extra>")
    fig.update_layout(title="τ against the cost of a step, v(K+1) + K·c (dotted: the cost model's iso-speedup lines)",
                      xaxis_title="step cost (target forwards)", yaxis_title="τ (tokens per target forward)",
                      xaxis_range=[0, x_max * 1.08], legend_title_text="method (measured × AR)")
    return fig


def draft_model_path() -> Path:
    return DRAFT_MODEL


def require(ok: bool, what: str) -> None:
    """An invariant a notebook claims; raised (not `assert`, which -O strips) so a run stops on it."""
    if not ok:
        raise AssertionError(what)


def finite(x, what: str, low: float | None = None, strict: bool = False) -> None:
    """x is a finite real (and >= low, or > low if strict)."""
    require(isinstance(x, (int, float)) and math.isfinite(x), f"{what} is not finite: {x!r}")
    if low is not None:
        require(x > low if strict else x >= low, f"{what} = {x} is not {'>' if strict else '>='} {low}")


def check_bench(res: dict, methods, what: str = "bench") -> str:
    """Every benched method has a row with meaningful numbers: tokens/s > 0, speedup > 0, and where defined
    (something was drafted) tau >= 1 (the bonus token), alpha in [0, 1], draft cost c >= 0."""
    missing = [m for m in methods if m not in res]
    require(not missing, f"{what}: no row for {missing}")
    for m in methods:
        r = res[m]
        finite(r["tokens_per_s"], f"{what}[{m}] tokens_per_s", 0, strict=True)
        if r.get("speedup_vs_ar") is not None:
            finite(r["speedup_vs_ar"], f"{what}[{m}] speedup_vs_ar", 0, strict=True)
        for i, x in enumerate(r.get("speedup_interval") or []):  # the paired interval, where the bench gave one
            finite(x, f"{what}[{m}] speedup_interval[{i}]", 0, strict=True)
        if r.get("tau") is not None:
            finite(r["tau"], f"{what}[{m}] tau", 1)
        if r.get("alpha") is not None:
            finite(r["alpha"], f"{what}[{m}] alpha", 0)
            require(r["alpha"] <= 1, f"{what}[{m}] alpha = {r['alpha']} > 1")
        if r.get("c") is not None:
            finite(r["c"], f"{what}[{m}] c", 0)
    return f"{what}: {len(methods)} methods, every tokens/s > 0, tau >= 1 and alpha in [0, 1] where defined"


def check_invariants(runs: dict[str, dict], methods: list[str], settings: list[dict], mem: dict) -> list[str]:
    """Notebook 08's claims: every setting's table has every method it benched, with meaningful numbers
    (tokens/s > 0, tau >= 1 where defined), and the memory accounting is non-negative."""
    out = []
    for s in settings:
        require(s["name"] in runs, f"no study run for setting {s['name']}")
        ms = [m for m in methods if s["temperature"] == 0 or m not in s.get("greedy_only", ())]
        out.append(check_bench(runs[s["name"]], ms, s["name"]))
    for m in methods:
        require(mem[m]["extra_params"] >= 0 and mem[m]["target_bytes"] > 0 and mem[m]["kv_bytes"] > 0,
                f"memory accounting of {m}: {mem[m]}")
    return out + [f"memory: {len(methods)} methods accounted"]
