"""Chapter 01 (speculative sampling): everything notebook 01 computes, so that it is tested and reusable.

The notebook narrates and draws; these functions do the work. Notation: p = target, q = draft.
The story they support: (1) rejection sampling emits tokens distributed exactly as p, checked exactly
and by simulation on toy distributions; (2) the same check on the course model's real p and q;
(3) alpha = sum min(p, q) sets the mean tokens per step, (1 - alpha^(K+1)) / (1 - alpha), and, with
the draft cost ratio c, the speedup, which peaks at an interior K; (4) losslessness is a statement
about exact arithmetic: low-precision batched verification can flip near-ties (verify parity).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import numpy as np
import torch
from scipy.stats import chisquare

from dvi_lite.core.checks import check_int
from dvi_lite.core.engine import acceptance_rate, position_acceptance
from dvi_lite.core.generate import generate, prompt_ids
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.core.verify import first_token_law, residual, verify_sampling_chain
from dvi_lite.course.ch01_parity import parity_study
from dvi_lite.measure.cost import expected_tau, predicted_speedup
from dvi_lite.measure.timing import bench, leviathan_speedup
from dvi_lite.methods.sps import resolve_draft
from dvi_lite.study.table import check_bench, finite, require

P_MIN = 1e-3  # a chi-square p-value below this rejects "distributed as p" (the tests' threshold)

# --------------------------------------------------------------------------- toy distributions

def toy_pair(v: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float64 distributions on v tokens: p (target) and q, a noisy guess of p (as a draft is).

    q = softmax(log p + noise): correlated with p but wrong in places, so alpha is neither ~0 nor ~1
    and all four bars of the residual picture (p, q, min, residual) are visible. float64 keeps the
    exact-law check at ~1e-16 rather than float32 rounding.
    """
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(v, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, 0)
    q = torch.softmax(logits + 1.2 * torch.randn(v, generator=g, dtype=torch.float64), 0)
    return p, q


def alpha_of(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(one draft x ~ q is accepted) = sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p(x), q(x))."""
    return float(torch.minimum(p, q).sum())


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total variation distance 1/2 sum |p - q|; alpha = 1 - TV(p, q)."""
    return 0.5 * float((p - q).abs().sum())


def exact_output_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact law of the first emitted token (accepted draft or residual sample): equals p."""
    return first_token_law(p, q)


def residual_parts(p: torch.Tensor, q: torch.Tensor) -> dict[str, list[float]]:
    """p, q, min(p, q) (mass accepted as-is) and the residual norm(max(0, p - q)), for the bar chart."""
    return {"p": p.tolist(), "q": q.tolist(), "min(p,q)": torch.minimum(p, q).tolist(),
            "residual": residual(p, q).tolist()}


def first_emitted_counts(p: torch.Tensor, q: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """Run one K=1 draft-and-verify round n times through the real `verify_sampling_chain`; count tokens.

    The first emitted token is the draft x if accepted, else the residual sample. Row 1 of the p
    matrix (the bonus position) is only used after an acceptance, for the *second* token, so p is
    repeated there. For K > 1 the first token's law is the same: it only involves position 0.
    """
    gen = make_generator(seed)
    counts = torch.zeros(p.numel(), dtype=torch.long)
    q1, pp = q[None], torch.stack([p, p])
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=gen)  # the draft, x ~ q
        n_acc, nxt = verify_sampling_chain(x, q1, pp, gen)
        counts[int(x) if n_acc else nxt] += 1
    return counts


def simulate_output_law(p: torch.Tensor, q: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """Empirical law of the first emitted token over n simulated rounds (float64, sums to 1)."""
    return first_emitted_counts(p, q, n, seed).double() / n


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> dict:
    """Pearson chi-square of observed counts against probs, pooling bins with expected count < 5.

    The chi-square approximation needs expected counts >= 5, so rare tokens are pooled into one bin
    (merged into the smallest kept bin if the pool itself is still too small). A token with p = 0
    that was emitted anyway gives p-value 0: that would be a real bug (e.g. top-p ignored).

    When pooling leaves fewer than two bins (too few draws, or a law with one likely token) nothing is
    testable: the result says so ("testable": False, a "note") and its p-value and statistic are NaN, so it
    fails every comparison -- neither `pvalue > threshold` ("consistent with p") nor `pvalue < threshold`
    ("rejected") holds -- instead of passing with p = 1, a test that cannot fail. The notebooks print and
    save it as it is; ch01's check_invariants stops on it.
    """
    obs = counts.double().cpu().numpy()
    n = obs.sum()
    exp = probs.double().cpu().numpy() * n
    if (obs[exp == 0] > 0).any():
        return {"statistic": math.inf, "pvalue": 0.0, "dof": 0, "bins": 0, "testable": True}
    big = exp >= min_expected
    o, e = list(obs[big]), list(exp[big])
    rest_o, rest_e = obs[~big].sum(), exp[~big].sum()
    if rest_e > 0:
        if rest_e >= min_expected or not e:
            o.append(rest_o)
            e.append(rest_e)
        else:
            j = int(np.argmin(e))
            o[j] += rest_o
            e[j] += rest_e
    if len(o) < 2:
        return {"statistic": math.nan, "pvalue": math.nan, "dof": 0, "bins": len(o), "testable": False,
                "note": f"nothing testable: {int(n)} draws pool into {len(o)} bin(s) of expected count >= "
                        f"{min_expected:g}; more draws (or a flatter law) are needed"}
    e_arr = np.asarray(e) * (n / np.sum(e))  # float32 probs sum to 1 +- 1e-7: rescale for scipy's check
    res = chisquare(np.asarray(o), e_arr)
    return {"statistic": float(res.statistic), "pvalue": float(res.pvalue), "dof": len(o) - 1, "bins": len(o),
            "testable": True}


def expected_tokens(alpha: float, K: int) -> float:
    """Mean tokens per target forward with K drafts, i.i.d. acceptance alpha: 1 + alpha + ... + alpha^K."""
    return expected_tau(alpha, K)


def formula_curve(alpha: float, c: float, ks: list[int], v: Mapping | None = None) -> dict[str, list[float]]:
    """Predicted tokens per step and speedup for each K, and the best K: tau(K) / (v(K+1) + K c) with the measured
    verify-cost table v {n: v(n)} (measure.cost), or Leviathan et al.'s v = 1 (timing.leviathan_speedup) when v is None.

    tau saturates at 1 / (1 - alpha) while the drafting cost K c grows linearly: the optimum is interior.
    """
    speed = [leviathan_speedup(alpha, k, c) if v is None else predicted_speedup(expected_tokens(alpha, k), k, c, v)
             for k in ks]
    return {"K": list(ks), "tokens": [expected_tokens(alpha, k) for k in ks], "speedup": speed,
            "alpha": alpha, "c": c, "v": None if v is None else dict(v), "best_K": list(ks)[speed.index(max(speed))]}

# --------------------------------------------------------------------------- the course model

def _ids(tok, prompt) -> list[int]:
    return prompt_ids(tok, prompt["prompt"] if isinstance(prompt, dict) else prompt)


def _records(prompts: list) -> list[dict]:
    return [p if isinstance(p, dict) else {"prompt": p} for p in prompts]


@torch.no_grad()
def _last_logits(model, ids: list[int]) -> torch.Tensor:
    dev = model.get_output_embeddings().weight.device
    return model(torch.tensor([ids], device=dev)).logits[0, -1].float().cpu()


def token_histograms(model, tok, prompt, n_samples: int = 20000, temperature: float = 1.0, top_p: float = 1.0,
                     draft_model=None, seed: int = 0, top_k: int = 0, n_show: int = 20) -> dict:
    """Losslessness on the real models: law of the first verified token vs the target's p, with chi-square.

    Why not histogram whole `generate(method="sps")` runs: the first new token comes from the prefill
    (no verification), and sampling thousands of generations is slow. Instead we fix a context
    (prompt + the target's greedy first token), compute the *processed* p (target) and q (draft) there
    with the engine's `Sampler`, and run the engine's `verify_sampling_chain` n_samples times. Plain
    target samples (multinomial from p) are histogrammed alongside as the control.
    """
    sampler = Sampler(temperature, top_k, top_p)
    draft = resolve_draft(model, draft_model)
    ids = _ids(tok, prompt)
    ctx = ids + [int(_last_logits(model, ids).argmax())]
    p = sampler.probs(_last_logits(model, ctx))
    q = sampler.probs(_last_logits(draft, ctx))
    spec = first_emitted_counts(p, q, n_samples, seed)
    gen = make_generator(seed + 1)
    plain = torch.multinomial(p, n_samples, replacement=True, generator=gen).bincount(minlength=p.numel())
    rows = []
    for t in p.topk(min(n_show, int((p > 0).sum()))).indices.tolist():  # the most likely tokens of p
        text = tok.decode([t])
        rows.append({"token": t, "text": text, "label": f"{text!r} #{t}", "p": float(p[t]), "q": float(q[t]),
                     "spec": int(spec[t]) / n_samples, "target": int(plain[t]) / n_samples})
    rest = torch.ones(p.numel(), dtype=torch.bool)
    rest[[r["token"] for r in rows]] = False
    rows.append({"token": -1, "text": "(other)", "label": "(all other tokens)", "p": float(p[rest].sum()),
                 "q": float(q[rest].sum()), "spec": int(spec[rest].sum()) / n_samples,
                 "target": int(plain[rest].sum()) / n_samples})
    return {"temperature": temperature, "top_p": top_p, "n": n_samples, "context_tail": tok.decode(ctx[-12:]),
            "alpha": alpha_of(p, q), "tv": tv(p, q), "support_p": int((p > 0).sum()),
            "spec_vs_p": chi_square(spec, p), "target_vs_p": chi_square(plain, p), "rows": rows}


@torch.no_grad()
def measure_alpha(model, draft_model, tok, prompts: list, temperature: float = 1.0, top_p: float = 1.0,
                  max_new_tokens: int = 32, seed: int = 0) -> dict:
    """alpha as the mean over positions of sum_x min(p, q), along target-sampled continuations.

    Chosen over counting acceptances because it is the exact per-position acceptance probability
    (no Bernoulli noise), it is defined for every position (a counted rate only sees positions the
    chain reached), and since sps is lossless its continuations have the same law as these. Greedy
    (temperature 0) gives one-hot p and q, so alpha = P(argmax q = argmax p).
    """
    sampler = Sampler(temperature, 0, top_p)
    draft = resolve_draft(model, draft_model)
    dev = model.get_output_embeddings().weight.device
    per_prompt, by_domain, all_a = [], {}, []
    for i, rec in enumerate(_records(prompts)):
        ids = _ids(tok, rec)
        new = generate(model, tok, ids, "ar", max_new_tokens, temperature, top_p=top_p, seed=seed + i).token_ids
        x = torch.tensor([ids + new], device=dev)
        sl = slice(len(ids) - 1, len(ids) - 1 + len(new))  # the contexts each new token was drawn in
        p = sampler.probs(model(x).logits[0, sl].float())
        q = sampler.probs(draft(x).logits[0, sl].float())
        a = torch.minimum(p, q).sum(-1).cpu().tolist()
        all_a += a
        per_prompt.append(statistics.mean(a))
        by_domain.setdefault(rec.get("domain", "all"), []).extend(a)
    return {"alpha": statistics.mean(all_a), "positions": len(all_a), "per_prompt": per_prompt,
            "per_domain": {d: statistics.mean(v) for d, v in by_domain.items()}, "temperature": temperature}


def _check_k(K) -> int:
    return check_int("K (draft tokens per step)", K, 1)


def position_stats(log: list[tuple[int, int]], K: int) -> dict:
    """Per draft position i: survival P(accepted > i), and the engine's conditional acceptance and alpha.

    alpha_hat (engine.acceptance_rate) = accepted / tested tokens is the per-position acceptance the
    formula assumes; accepted / drafted is not: for K > 1 it also counts never-tested positions.
    """
    surv = []
    for i in range(K):
        proposed = [a for d, a in log if d > i]
        surv.append(sum(a > i for a in proposed) / len(proposed) if proposed else None)
    return {"survival": surv, "conditional": position_acceptance(log), "alpha_hat": acceptance_rate(log)}


def k_sweep(model, tok, prompts: list, ks: list[int], max_new_tokens: int = 64, repeats: int = 3,
            temperature: float = 1.0, top_p: float = 1.0, draft_model=None, seed: int = 0) -> list[dict]:
    """Speedup vs draft length K: AR and sps for every K in ONE interleaved bench, one row per K.

    Each row: measured alpha (bench's accepted/drafted), alpha_hat (per position), tau, tokens/s,
    speedup vs AR, c (draft cost ratio), the formula's predicted speedup tau(alpha_hat) / (v(K+1) + K c) with the
    v(n) this bench measured in its rounds (`v`, the same table in every row; we do not reuse bench's prediction,
    which plugs accepted/drafted into the formula and so under-predicts for K > 1), and acceptance per draft
    position.
    """
    ks = [_check_k(k) for k in ks]
    labels = [f"sps:K={k}" for k in ks]  # bench labels: one row per K, the same draft model for all
    logs: dict[str, list] = {}  # label -> (depth, accepted) per step of every timed round
    calib: dict = {}  # the v(n) table the bench measured inside its rounds
    res = bench(model, tok, _records(prompts), ["ar", *labels], max_new_tokens, repeats, temperature, top_p, seed,
                {"sps": {"draft_model": resolve_draft(model, draft_model)}}, logs=logs, calibration=calib)
    rows = []
    for k, label in zip(ks, labels, strict=True):
        r, pos = res[label], position_stats(logs[label], k)
        a = pos["alpha_hat"] if pos["alpha_hat"] is not None else 0.0
        pred = predicted_speedup(expected_tokens(a, k), k, r["c"], calib["v"]) if r.get("c") is not None else None
        rows.append({"K": k, "alpha": r["alpha"], "alpha_hat": pos["alpha_hat"], "tau": r["tau"],
                     "expected_tokens": expected_tokens(a, k), "tokens_per_s": r["tokens_per_s"],
                     "ar_tokens_per_s": res["ar"]["tokens_per_s"], "speedup_vs_ar": r["speedup_vs_ar"],
                     "c": r.get("c"), "predicted_speedup": pred,
                     "measured_over_predicted": r["speedup_vs_ar"] / pred if pred else None,
                     "position_acceptance": pos["conditional"], "position_survival": pos["survival"],
                     "v": dict(calib["v"])})
    return rows


def compare_with_hf_assisted(model, tok, prompts: list, draft_model=None, K: int = 4, max_new_tokens: int = 64,
                             repeats: int = 3, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> dict:
    """ar, hf, hf_assisted and sps on the same target/draft pair and K, in one interleaved bench."""
    draft = resolve_draft(model, draft_model)
    opts = {m: {"draft_model": draft, "K": _check_k(K)} for m in ("sps", "hf_assisted")}
    return bench(model, tok, _records(prompts), ["ar", "hf", "hf_assisted", "sps"], max_new_tokens, repeats,
                 temperature, top_p, seed, opts)


def parity_table(model, tok, prompts: list, new_tokens: int = 32, K: int = 4,
                 dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> dict:
    """Argmax mismatches of batched verify vs one-by-one decode logits per dtype, plus near-tie examples
    (course/ch01_parity.parity_study, the same lesson on any model)."""
    return parity_study(model, tok, prompts, dtypes, new_tokens, _check_k(K))


def check_invariants(exact_err: float, toy_chi: dict, control_chi: dict, hists: dict, alphas: list[dict],
                     rows: list[dict], ks: list[int], cmp: dict, parity: dict) -> list[str]:
    """Notebook 01's claims: the exact law is p, the chi-square test accepts speculative sampling and rejects
    the unverified draft (the negative control), the sweep and the comparison have every row with meaningful
    numbers, and the parity counts are consistent, with no fp32 argmax flip."""
    require(exact_err < 1e-9, f"exact output law differs from p by {exact_err}")
    for name, chi in [("toy", toy_chi), ("control", control_chi)] + [
            (f"{k} {w}", h[w]) for k, h in hists.items() for w in ("spec_vs_p", "target_vs_p")]:
        require(chi.get("testable", True), f"{name}: the chi-square test had nothing to test: {chi.get('note')}")
    require(toy_chi["pvalue"] > P_MIN, f"toy chi-square rejects speculative sampling: {toy_chi}")
    require(control_chi["pvalue"] < P_MIN, f"negative control (law q) passes the chi-square test: {control_chi}")
    for name, h in hists.items():
        require(h["spec_vs_p"]["pvalue"] > P_MIN, f"{name}: chi-square rejects speculative sampling {h['spec_vs_p']}")
        require(h["target_vs_p"]["pvalue"] > P_MIN, f"{name}: chi-square rejects plain sampling {h['target_vs_p']}")
    for a in [h["alpha"] for h in hists.values()] + [a["alpha"] for a in alphas]:
        finite(a, "alpha", 0)
        require(a <= 1, f"alpha {a} > 1")
    require([r["K"] for r in rows] == list(ks), f"K sweep rows {[r['K'] for r in rows]} != {ks}")
    out = [f"exact law = p (max err {exact_err:.1e}); chi-square p-values > {P_MIN} for sps, < {P_MIN} for the "
           f"control", check_bench({f"sps:K={r['K']}": r for r in rows}, [f"sps:K={k}" for k in ks], "K sweep"),
           check_bench(cmp, ["ar", "hf", "hf_assisted", "sps"], "vs HF assisted")]
    for r in parity["rows"]:
        require(0 <= r["mismatches"] <= r["positions"] and r["positions"] > 0, f"parity counts inconsistent: {r}")
        if r["dtype"] == "float32":
            require(r["mismatches"] == 0, f"fp32 verify flipped {r['mismatches']} argmaxes")
    return out + [f"parity: mismatches <= positions for {len(parity['rows'])} dtypes, 0 in fp32"]
