"""The fidelity table: for each paper's design claim, whether our committed results reproduce it.

A row per claim: the paper's qualitative claim, the paper's number (transcribed from ../shared/REFERENCE.md and
`study.table.PAPERS`, never measured here), our number(s) read from results/*.json by key path, and a status
("yes" / "partial" / "no" / "not measured") COMPUTED from those numbers by the rule the row states, never typed:
a re-run that changes a number changes the verdict. Where a results file or key is missing the status is
"not measured" and the row names the file and key that would back it. Why: the course reports where each paper's
design choice carries over to small models on a CPU, and a verdict typed by hand would outlive the numbers it read.

Key paths are "stem:dotted.path" (stem = the results file's name without .json); a list item is its index. A key
may itself hold dots ("kangaroo:threshold=0.6", "0.0667"): `lookup` matches the longest key first at each level.
Files read: 01_speculative_sampling, 02_kangaroo, 04_medusa, 05_dvi, 08_results, 15_dvi_smollm2, 41_dvi_online_stream,
27_drafts_smollm2_bf16, 41_dvi_ablation, and, once written, 41_draft_verify_seeds
(draft-verify-compare), 41_draft_verify_gamma (draft-verify-gamma) and 41_eagle_ablation (eagle-ablation:
arms.<arm>.tau for the arms full / static_tree, and no_ttt / top_layer against full_small once those heads are
trained).
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

YES, PARTIAL, NO, NOT_MEASURED = "yes", "partial", "no", "not measured"
STATUSES = (YES, PARTIAL, NO, NOT_MEASURED)
Results = dict[str, dict]


class NotMeasured(LookupError):
    """A results file or key a rule needs is absent; the message names it."""


@dataclass(frozen=True)
class Claim:
    """One design claim: who claims it, the paper's number, the keys behind ours, and the rule that decides."""
    method: str
    claim: str
    paper_number: str
    keys: list[str]
    rule: str
    compute: Callable[[Results], tuple[str, str]]  # results -> (status, our numbers as text)


def load_results(results_dir: Path) -> Results:
    """Every results/*.json (not results/gpu/) by file stem."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(results_dir).glob("*.json"))}


def lookup(results: Results, ref: str) -> Any:
    """The value at "stem:dotted.path", walking dicts by the longest matching key (keys may hold dots) and lists
    by index; raises NotMeasured naming the missing file or key."""
    stem, _, path = ref.partition(":")
    if stem not in results:
        raise NotMeasured(f"results/{stem}.json missing")
    node, parts, i = results[stem], path.split(".") if path else [], 0
    while i < len(parts):
        if isinstance(node, dict):
            j = next((j for j in range(len(parts), i, -1) if ".".join(parts[i:j]) in node), None)
            if j is None:
                raise NotMeasured(f"results/{stem}.json has no {path}")
            node, i = node[".".join(parts[i:j])], j
        elif isinstance(node, list) and parts[i].isdigit() and int(parts[i]) < len(node):
            node, i = node[int(parts[i])], i + 1
        else:
            raise NotMeasured(f"results/{stem}.json has no {path}")
    if node is None:
        raise NotMeasured(f"results/{stem}.json: {path} is null")
    return node


def combine(parts: list[tuple[str, str]]) -> tuple[str, str]:
    """Several sources' (status, text): all yes -> yes, all no -> no, a mix -> partial; sources not measured are
    left out (their text says so), and none measured -> not measured."""
    measured = [s for s, _ in parts if s != NOT_MEASURED]
    status = (NOT_MEASURED if not measured else YES if all(s == YES for s in measured)
              else NO if all(s == NO for s in measured) else PARTIAL)
    return status, "; ".join(t for _, t in parts)


Rule = Callable[[Results], tuple[str, str]]


def each(**sources: Rule) -> Rule:
    """A rule over several sources (label=rule): each run alone, a missing key making it "not measured", then
    `combine`d. Why: one claim is often measured on the course model and on SmolLM2, and both should count."""
    def rule(results: Results) -> tuple[str, str]:
        out = []
        for label, f in sources.items():
            try:
                status, text = f(results)
                out.append((status, f"{label}: {text}"))
            except NotMeasured as e:
                out.append((NOT_MEASURED, f"{label}: not measured ({e})"))
        return combine(out)
    return rule


def _grade(*conditions: bool) -> str:
    """Every condition holds -> yes, some -> partial, none -> no."""
    return YES if all(conditions) else PARTIAL if any(conditions) else NO


def _interval(d: dict, good_below: bool) -> str:
    """A paired difference {mean, ci95}: its 95% interval on the good side of 0 -> yes, on the bad side or its
    mean on the bad side -> no, else (straddling 0, or one seed without an interval) partial."""
    lo_hi, sign = d.get("ci95"), -1.0 if good_below else 1.0
    if lo_hi and min(sign * lo_hi[0], sign * lo_hi[1]) > 0:
        return YES
    return NO if (lo_hi and max(sign * lo_hi[0], sign * lo_hi[1]) < 0) or sign * d["mean"] <= 0 else PARTIAL


def _ci(d: dict) -> str:
    lo_hi = d.get("ci95")
    return f"{d['mean']:+.3f}" + (f" [{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]" if lo_hi else " (no interval)")


def _beats(a_ref: str, b_ref: str, what: str = "") -> Rule:
    """yes when the number at a_ref exceeds the one at b_ref, else no."""
    def rule(r: Results) -> tuple[str, str]:
        a, b = lookup(r, a_ref), lookup(r, b_ref)
        return (YES if a > b else NO), f"{what}{a:.2f} vs {b:.2f}"
    return rule


def _sps_sweep(ref: str) -> Rule:
    """A K sweep (01's k_sweep list, or 08's sps:K=k methods): τ strictly rising in K, best × AR below the longest K."""
    def rule(r: Results) -> tuple[str, str]:
        s = lookup(r, ref)
        rows = sorted((x["K"], x["tau"], x["speedup_vs_ar"]) for x in s) if isinstance(s, list) else sorted(
            (int(k.split("K=")[1]), m["tau"], m["speedup_vs_ar"]) for k, m in s.items() if k.startswith("sps:K="))
        if len(rows) < 2:
            raise NotMeasured(f"{ref} has fewer than 2 K")
        taus, best = [t for _, t, _ in rows], max(rows, key=lambda x: x[2])[0]
        rises = all(a < b for a, b in zip(taus, taus[1:], strict=False))
        return _grade(rises, best < rows[-1][0]), \
            f"τ {'/'.join(f'{t:.2f}' for t in taus)} at K {'/'.join(str(k) for k, *_ in rows)}, best × AR at K={best}"
    return rule


def _kangaroo_adapter(results: Results) -> tuple[str, str]:
    split = lookup(results, "02_kangaroo:settings.split")
    row = next((r for r in lookup(results, "02_kangaroo:agreement") if r.get("k") == split and "adapter" in r), None)
    if row is None:
        raise NotMeasured(f"results/02_kangaroo.json has no agreement row with k={split} and an adapter")
    return (YES if row["adapter"] > row["naive"] else NO), \
        f"exit layer {split}: α adapter {row['adapter']:.3f} vs plain early exit {row['naive']:.3f}"


def _kangaroo_eta(ref: str) -> Rule:
    """Best kangaroo:threshold=η row's × AR against the best kangaroo:threshold=none:K=k row's."""
    def rule(r: Results) -> tuple[str, str]:
        rows = {k: m["speedup_vs_ar"] for k, m in lookup(r, ref).items() if k.startswith("kangaroo:threshold=")}
        gated = {k: v for k, v in rows.items() if ":k=" not in k.lower()}
        fixed = {k: v for k, v in rows.items() if "threshold=none:k=" in k.lower()}
        if not gated or not fixed:
            raise NotMeasured(f"{ref} lacks kangaroo:threshold=η or kangaroo:threshold=none:K=k rows")
        g, x = max(gated, key=gated.__getitem__), max(fixed, key=fixed.__getitem__)
        return (YES if gated[g] > fixed[x] else NO), f"{gated[g]:.2f}× ({g}) vs {fixed[x]:.2f}× ({x})"
    return rule


def _dv_bo(results: Results) -> tuple[str, str]:
    d = lookup(results, "41_draft_verify_seeds:summary.heldout_speedup.bo_minus_random")
    sep = results["41_draft_verify_seeds"].get("bo_separates_from_random_heldout")
    return _interval(d, good_below=False), f"BO − random held-out × AR {_ci(d)}, {d['n']} seeds (separated: {sep})"


def _dv_gamma(results: Results) -> tuple[str, str]:
    runs = sorted(lookup(results, "41_draft_verify_gamma:runs"), key=lambda r: r["target_alpha"])
    last = [statistics.fmean(w["acceptance"] for w in r["windows"][-3:] if w["acceptance"] is not None)
            for r in runs]
    ordered = all(a < b for a, b in zip(last, last[1:], strict=False))
    close = all(abs(a - r["target_alpha"]) <= 0.1 for a, r in zip(last, runs, strict=True))
    text = ", ".join(f"target {r['target_alpha']} -> {a:.3f}" for r, a in zip(runs, last, strict=True))
    return (YES if ordered and close else PARTIAL if ordered else NO), f"last 3 windows' acceptance: {text}"


def _decays(ref: str, field: str | None = None) -> Rule:
    """A per-head series (numbers, or dicts' `field`): strictly falling -> yes, head 1 best -> partial, else no."""
    def rule(r: Results) -> tuple[str, str]:
        xs = [x if field is None else x[field] for x in lookup(r, ref)]
        falls = all(a > b for a, b in zip(xs, xs[1:], strict=False))
        return (YES if falls else PARTIAL if xs[0] == max(xs) else NO), "/".join(f"{x:.2f}" for x in xs)
    return rule


def _medusa_tree(results: Results) -> tuple[str, str]:
    chain = lookup(results, "04_medusa:ablation.medusa:tree=cartesian:branch=1:K=4")
    trees = {k: m for k, m in lookup(results, "04_medusa:ablation").items()
             if k.startswith(("medusa:tree=sparse", "medusa:tree=pruned"))}
    if not trees:
        raise NotMeasured("results/04_medusa.json has no ablation.medusa:tree=sparse/pruned rows")
    t, s = (max(trees, key=lambda k, x=x: trees[k][x]) for x in ("tau", "speedup_vs_ar"))
    return _grade(trees[t]["tau"] > chain["tau"], trees[s]["speedup_vs_ar"] > chain["speedup_vs_ar"]), \
        f"chain τ {chain['tau']:.2f}, {chain['speedup_vs_ar']:.2f}×; best tree τ {trees[t]['tau']:.2f} ({t}), " \
        f"{trees[s]['speedup_vs_ar']:.2f}× ({s})"


def _dvi_stream(r: Results) -> tuple[str, str]:
    c = lookup(r, "15_dvi_smollm2:arms.dvi.curve")
    a, b = c[0]["accept_rate"], c[-1]["accept_rate"]
    return (YES if b > a else NO), f"stream acceptance {a:.3f} -> {b:.3f} over {len(c)} windows"


def _dvi_long_stream(r: Results) -> tuple[str, str]:
    """The committed recipe served 500 questions while learning: the stream's first bin against its last; the
    held-out α before and after is printed beside it (the claim is about the stream the learner serves)."""
    bins = lookup(r, "41_dvi_online_stream:stream")
    a, b = bins[0]["accept_rate"], bins[-1]["accept_rate"]
    warm, end = (lookup(r, f"41_dvi_online_stream:{k}.alpha") for k in ("heldout_bench_warm", "heldout_bench"))
    return (YES if b > a else NO), f"stream acceptance {a:.3f} -> {b:.3f} (questions 1-{bins[0]['questions'][1]} " \
        f"vs the last {bins[-1]['questions'][1] - bins[-1]['questions'][0] + 1}); held-out α {warm:.3f} -> {end:.3f}"


def _dvi_online(r: Results) -> tuple[str, str]:
    """The paper's own objective (the reference trainers' default arm; our variant where that arm was not run)."""
    runs = lookup(r, "41_dvi_ablation:runs")
    arm = "reference" if "reference" in runs else "dvi"
    gains = [[p["agree"] for p in run["curve"] if p["phase"] in ("warm", "online")]
             for run in lookup(r, f"41_dvi_ablation:runs.{arm}").values()]
    if not gains or min(map(len, gains)) < 2:
        raise NotMeasured(f"results/41_dvi_ablation.json runs.{arm} lack warm and online curve points")
    return _grade(*[g[-1] > g[0] for g in gains]), \
        f"{arm} arm, held-out agreement after warm start -> after online, per seed: " + \
        ", ".join(f"{g[0]:.3f}->{g[-1]:.3f}" for g in gains)


def _dvi_vs_kl(results: Results) -> tuple[str, str]:
    """KL-only against the paper's own objective in 41_dvi_ablation: the reference trainers' default arm when that run
    exists (paired by seed), else our variant ("dvi")."""
    runs = lookup(results, "41_dvi_ablation:runs")
    if "reference" in runs and "kl" in runs:
        from dvi_lite.measure.paired import ci95

        metric = lookup(results, "41_dvi_ablation:metric")
        seeds = sorted(set(runs["reference"]) & set(runs["kl"]))
        d = ci95([runs["kl"][s]["final"][metric] - runs["reference"][s]["final"][metric] for s in seeds])
        parts = [(_interval(d, good_below=True), f"held-out {metric} {_ci(d)}")]
        taus = [(runs["kl"][s].get("heldout_bench") or {}).get("tau") for s in seeds] + \
               [(runs["reference"][s].get("heldout_bench") or {}).get("tau") for s in seeds]
        if None not in taus:  # what decoding gets: held-out τ, paired by seed
            t = ci95([a - b for a, b in zip(taus[:len(seeds)], taus[len(seeds):], strict=True)])
            parts.append((_interval(t, good_below=True), f"held-out τ {_ci(t)}"))
        status = parts[0][0] if len({p[0] for p in parts}) == 1 else PARTIAL
        return status, "KL-only − the reference's default objective: " + "; ".join(p[1] for p in parts) + \
            f" ({d['n']} seeds)"
    metric = lookup(results, "41_dvi_ablation:metric")
    d = lookup(results, f"41_dvi_ablation:paired_vs_dvi.kl.{metric}")  # KL-only minus our variant, paired by seed
    ranking = " > ".join(lookup(results, "41_dvi_ablation:ranking"))
    return _interval(d, good_below=True), f"KL-only − DVI held-out {metric} {_ci(d)}, {d['n']} seeds; {ranking}"


def _parity(results: Results) -> tuple[str, str]:
    rows = {r["dtype"]: r["mismatches"] for r in lookup(results, "01_speculative_sampling:parity.rows")}
    if "float32" not in rows or "bfloat16" not in rows:
        raise NotMeasured("results/01_speculative_sampling.json parity.rows lacks float32 or bfloat16")
    steps = lookup(results, "01_speculative_sampling:parity.flip_steps.bfloat16")
    status = NO if rows["float32"] else YES if rows["bfloat16"] and all(s <= 2 for s in steps) else PARTIAL
    return status, f"flips: fp32 {rows['float32']}, bf16 {rows['bfloat16']} (bf16 flips' gaps {steps} bf16 steps)"


def _eagle_arm(arm: str, base: str = "full") -> Rule:
    """An EAGLE arm against its base: the committed head for the tree arm, a head trained on the same tokens by the
    same command (full_small) for the training arms."""
    return _beats(f"41_eagle_ablation:arms.{base}.tau", f"41_eagle_ablation:arms.{arm}.tau", f"τ {base} vs {arm} ")


SPEC = "Spec-Bench leaderboard, Vicuna-7B"
CLAIMS: list[Claim] = [
    Claim("SpS", "τ rises with the draft length K while the best speedup is at a short K",
          "2–3× (T5-XXL), 2–2.5× (Chinchilla 70B); τ = (1 − α^(K+1)) / (1 − α) ≤ K + 1",
          ["01_speculative_sampling:k_sweep", "08_results:sps_k.methods"],
          "per sweep: τ strictly rises with K and the best × AR is below the longest K → yes, one of the two → "
          "partial; sweeps combined (all yes → yes, all no → no, else partial)",
          each(course=_sps_sweep("01_speculative_sampling:k_sweep"), SmolLM2=_sps_sweep("08_results:sps_k.methods"))),
    Claim("Kangaroo", "the trained adapter is accepted more often than the plain early exit of the same layer",
          "up to 1.68× (Vicuna-7B, Spec-Bench; adapter 67M params, exit layer 2)",
          ["02_kangaroo:settings.split", "02_kangaroo:agreement"],
          "at the exit layer k = settings.split: adapter's α (greedy agreement) > plain early exit's → yes, else no",
          _kangaroo_adapter),
    Claim("Kangaroo", "the second early exit (confidence threshold η) is faster than drafting to a fixed length",
          "η = 0.6, ≤ 6 steps; up to 1.68×", ["02_kangaroo:sweep", "02_kangaroo:real_model.methods"],
          "per sweep: best kangaroo:threshold=η × AR > best kangaroo:threshold=none:K=k → yes, else no; combined",
          each(course=_kangaroo_eta("02_kangaroo:sweep"), SmolLM2=_kangaroo_eta("02_kangaroo:real_model.methods"))),
    Claim("Draft & Verify", "Bayesian optimisation finds a better skip set than random search at the same budget",
          "up to 1.99× (70B), 1.58× (13B, maintainers); match rate ≈ 0.93 (70B CNN/DM)",
          ["41_draft_verify_seeds:summary.heldout_speedup.bo_minus_random",
           "41_draft_verify_seeds:bo_separates_from_random_heldout"],
          "BO − random held-out × AR: 95% interval above 0 → yes, below 0 or mean ≤ 0 → no, else partial",
          _dv_bo),
    Claim("Draft & Verify", "the adaptive threshold γ tracks its target acceptance",
          "not transcribed (REFERENCE.md: match rate ≈ 0.93, 70B CNN/DM)", ["41_draft_verify_gamma:runs"],
          "mean acceptance of each run's last 3 windows orders like the targets and lies within 0.1 of each → yes; "
          "orders like them → partial; else no", _dv_gamma),
    Claim("Medusa", "head accuracy decays with the head index",
          "head top-1 accuracy 0.56 / 0.32 / 0.20 / 0.15 / 0.12 (Vicuna-7B)",
          ["04_medusa:head_accuracy.heads_greedy", "04_medusa:smollm2_top1_vs_paper.heads"],
          "per series: strictly falling → yes, head 1 best but not monotone → partial, else no; combined",
          each(course=_decays("04_medusa:head_accuracy.heads_greedy"),
               SmolLM2=_decays("04_medusa:smollm2_top1_vs_paper.heads", "ours"))),
    Claim("Medusa", "a tree beats a chain at the same heads",
          f"2.18× (Medusa-1, MT-Bench); {SPEC} 1.78× at τ 2.32 (A100)",
          ["04_medusa:ablation.medusa:tree=cartesian:branch=1:K=4", "04_medusa:ablation"],
          "best 4-head tree (sparse / pruned rows) vs the 4-head chain: higher τ and higher × AR → yes, one → partial, "
          "none → no", _medusa_tree),
    Claim("DVI", "acceptance rises over the online stream", "2.16× (Spec-Bench; target unverified)",
          ["05_dvi:main_run.before_after", "15_dvi_smollm2:arms.dvi.curve", "41_dvi_online_stream:stream",
           "41_dvi_ablation:runs.reference"],
          "per source: the later acceptance (held-out α after the online phase; last stream window; last of the 500 "
          "questions' bins; held-out agreement after online vs after the KL warm start, every seed) above the "
          "earlier → yes; combined",
          each(course=_beats("05_dvi:main_run.before_after.after.alpha", "05_dvi:main_run.before_after.before.alpha",
                              "held-out α after vs before the online phase "),
               **{"SmolLM2 cold stream": _dvi_stream, "SmolLM2 500 questions": _dvi_long_stream,
                  "SmolLM2 paper recipe": _dvi_online})),
    Claim("DVI", "reward-driven learning beats KL-only distillation", "2.16× (Spec-Bench; target unverified)",
          ["41_dvi_ablation:runs.kl", "41_dvi_ablation:runs.reference", "41_dvi_ablation:ranking",
           "41_dvi_ablation:paired_vs_dvi.kl"],
          "KL-only − the paper's objective on the ablation's metric (paired by seed; the reference trainer's default "
          "arm where run, else our variant): 95% interval below 0 → yes, above 0 or mean ≥ 0 → no, else partial",
          _dvi_vs_kl),
    Claim("bf16 parity", "batched verification flips near-ties in bf16 but never in fp32",
          "fp16/bf16 drift breaks equality (Medusa #56, transformers #39421); xserv: 0 mismatches only by per-row GEMV",
          ["01_speculative_sampling:parity.rows", "01_speculative_sampling:parity.flip_steps.bfloat16"],
          "fp32 flips > 0 → no; fp32 0 and bf16 > 0 with every flip within 2 bf16 steps of a tie → yes; else partial",
          _parity),
    Claim("EAGLE", "EAGLE is accepted more often than Medusa (higher τ) on the same questions",
          f"{SPEC}: EAGLE-2 τ 4.35 vs Medusa 2.32 (RTX 3090); EAGLE 3.61 vs Medusa 2.32 (A100)",
          ["08_results:methods.eagle.tau", "08_results:methods.medusa.tau",
           "27_drafts_smollm2_bf16:methods.eagle:tree=dynamic.tau", "27_drafts_smollm2_bf16:methods.medusa.tau"],
          "per bench: EAGLE's τ > Medusa's → yes, else no; combined",
          each(**{"08_results": _beats("08_results:methods.eagle.tau", "08_results:methods.medusa.tau", "τ "),
                  "27_drafts": _beats("27_drafts_smollm2_bf16:methods.eagle:tree=dynamic.tau",
                                      "27_drafts_smollm2_bf16:methods.medusa.tau", "τ ")})),
    Claim("EAGLE", "training-time test helps", "EAGLE-3: removing the feature-regression loss (for training-time test) "
          "+1.3 τ", ["41_eagle_ablation:arms.full_small.tau", "41_eagle_ablation:arms.no_ttt.tau"],
          "τ with training-time test > τ without → yes, else no", _eagle_arm("no_ttt", "full_small")),
    Claim("EAGLE", "a dynamic tree beats a static tree of the same node budget",
          f"{SPEC}, RTX 3090: EAGLE-2 τ 4.35–4.36 vs EAGLE-1 τ 3.57",
          ["41_eagle_ablation:arms.full.tau", "41_eagle_ablation:arms.static_tree.tau"],
          "dynamic tree's τ > static tree's at the same nodes → yes, else no (28_eagle_budget has dynamic rows only)",
          _eagle_arm("static_tree")),
    Claim("EAGLE", "fusing low / mid / high features helps over the top layer only",
          "EAGLE-3 ablation: multi-layer fusion +0.76 τ",
          ["41_eagle_ablation:arms.full_small.tau", "41_eagle_ablation:arms.top_layer.tau"],
          "fused head's τ > top-layer-only head's → yes, else no", _eagle_arm("top_layer", "full_small")),
]


def fidelity_table(results: Results, claims: list[Claim] | None = None) -> list[dict]:
    """A row per claim: {method, claim, paper, ours, status, rule, keys}; a missing key -> "not measured"."""
    rows = []
    for c in CLAIMS if claims is None else claims:
        try:
            status, ours = c.compute(results)
        except NotMeasured as e:
            status, ours = NOT_MEASURED, f"not measured: {e}"
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:  # a file of another shape
            status, ours = NOT_MEASURED, f"not measured: unreadable ({type(e).__name__}: {e})"
        rows.append({"method": c.method, "claim": c.claim, "paper": c.paper_number, "ours": ours, "status": status,
                     "rule": c.rule, "keys": list(c.keys)})
    return rows


def format_table(rows: list[dict], cols: list[str] | None = None) -> str:
    """The rows as a markdown table (pipes in cells escaped); cols: the columns shown (default: every one)."""
    cols = cols or ["method", "claim", "paper", "ours", "status", "rule", "keys"]

    def cell(v: Any) -> str:
        return (", ".join(v) if isinstance(v, list) else str(v)).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows])
