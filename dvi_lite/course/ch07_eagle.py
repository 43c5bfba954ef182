"""Chapter 07 helpers (EAGLE): what notebook 07 calls, so the notebook holds no algorithm.

    draft_sources()                 -> one row per trained SmolLM2 draft: what it drafts from, its held-out
                                       first-token agreement and the tokens it was trained on (its card)
    curve_rows(card, curve_tau)     -> the EAGLE head's learning curve: agreement of draft steps 1..4 against
                                       tokens seen, with tau decoded at the snapshots (study/curves.py)
    curve_figure(rows)              -> that curve as a plotly figure (log tokens axis, tau on the right)
    ablation_rows(res)              -> one row per arm of `eagle-ablation` (results/41_eagle_ablation.json): what it
                                       changes, what it is compared with, tau, × AR and its interval, c
    ablation_figure(rows)           -> those rows as bars (× AR with its interval) and markers (tau)
    tree_steps(model, tok, prompt)  -> every decoding step's tree: tokens, parents, the accepted path, the
                                       target's own token (core.engine.start / step, the one loop)
    tree_html(tok, step)            -> one step's tree as nested lists, the accepted path marked
    headline(bench, methods)        -> rows of a bench result (decode-phase speedup and its interval, tau, alpha)
    head_for(model)                 -> the model's head (committed: data/eagle for the course model, data/smollm2/eagle
                                       for SmolLM2; or made by `prepare`), else an untrained one initialised from the
                                       target, and which it is
    ttt_on_text(model, head, ids)   -> the training-time-test loss and each draft step's agreement on one text
    tree_stats(steps)               -> tau, nodes and accepted per step of a tree_steps run
    check_invariants(...)           -> notebook 07's claims (correctness only), one line each

Every number comes from a committed card or results file, or from the run the notebook makes.
"""
from __future__ import annotations

import html as _html
import json
from pathlib import Path

import torch

from dvi_lite.core.engine import decode
from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.registry import get_method
from dvi_lite.core.runner import Runner
from dvi_lite.core.sampling import Sampler, make_generator
from dvi_lite.methods.eagle.head import EagleHead, HeadConfig, head_path, load_head
from dvi_lite.methods.eagle.ttt import ttt_loss, ttt_mask
from dvi_lite.paths import DATA_DIR

# method -> (its card under data/smollm2/, what it drafts from)
SOURCES: dict[str, tuple[str, str]] = {
    "sps": ("sps/card.json", "tokens, through the target's first layer (its own small model)"),
    "kangaroo": ("kangaroo/adapter_k2.json", "the target's shallow state after layer k = 2, plus an adapter layer"),
    "medusa": ("medusa/heads.json", "the target's last state, one head per position ahead"),
    "eagle": ("eagle/card.json", "the target's fused features (a low, a middle and a high layer) + the next token"),
}


def _agreement(method: str, card: dict) -> tuple[float, int]:
    """(held-out first-token top-1 agreement, tokens seen) as each recipe's card records them."""
    if method == "sps":
        return card["final"]["val_agreement"], card["tokens_seen"]
    if method == "kangaroo":
        return card["val"]["alpha"], card["tokens_seen"]
    if method == "medusa":
        return card["accuracy"]["top1"][0], card["positions_seen"]
    return card["final"]["val_agreement"], card["train_tokens_seen"]


def draft_sources(root: Path | None = None) -> list[dict]:
    """One row per trained SmolLM2 draft, from its committed card: the first draft token's held-out agreement
    with the target's top-1 (teacher-forced), tokens seen in training, where it was trained."""
    root = Path(root) if root is not None else DATA_DIR / "smollm2"
    rows = []
    for method, (rel, source) in SOURCES.items():
        card = json.loads((root / rel).read_text())
        agree, seen = _agreement(method, card)
        prov = card.get("provenance")
        device = prov.get("device") if isinstance(prov, dict) else card.get("device")
        rows.append({"method": method, "drafts from": source, "first-token agreement": round(float(agree), 3),
                     "tokens seen": int(seen), "trained on": device})
    return rows


def curve_rows(card: dict, curve_tau: dict | None = None) -> list[dict]:
    """The head's curve: tokens seen, held-out agreement of draft steps 1..n, and tau / alpha at the snapshots
    that curve-tau decoded (None between them)."""
    tau = {r["tokens"]: r for r in (curve_tau or {}).get("rows", [])}
    rows = []
    for p in card["curve"]:
        t = tau.get(p["tokens_seen"], {})
        rows.append({"tokens_seen": p["tokens_seen"], "agreement": p["val_agreement"],
                     "steps": p.get("val_agreement_steps", [p["val_agreement"]]),
                     "tau": t.get("tau"), "alpha": t.get("alpha"), "first_acceptance": t.get("first_acceptance")})
    return rows


def curve_figure(rows: list[dict], title: str = "EAGLE head: held-out agreement and tau against tokens seen"):
    """Agreement of each draft step (lines, left axis) and decoded tau (markers, right axis); tokens on a log axis."""
    import plotly.graph_objects as go

    from dvi_lite.course.plots import series_color

    fig = go.Figure()
    x = [r["tokens_seen"] for r in rows]
    for s in range(max(len(r["steps"]) for r in rows)):
        fig.add_scatter(x=x, y=[r["steps"][s] if s < len(r["steps"]) else None for r in rows], mode="lines",
                        name=f"draft step {s + 1}: agreement", line={"color": series_color(s)})
    pts = [r for r in rows if r["tau"] is not None]
    fig.add_scatter(x=[r["tokens_seen"] for r in pts], y=[r["tau"] for r in pts], mode="markers+lines",
                    name="τ (greedy, held-out questions)", yaxis="y2", marker={"size": 9, "color": "black"},
                    line={"dash": "dot", "color": "black"})
    fig.update_layout(title=title, xaxis={"title": "tokens seen in training", "type": "log"},
                      yaxis={"title": "held-out top-1 agreement with the target", "rangemode": "tozero"},
                      yaxis2={"title": "τ (tokens per target forward)", "overlaying": "y", "side": "right"},
                      legend={"orientation": "h", "y": -0.25}, height=480, margin={"r": 80})
    return fig


ABLATION = "41_eagle_ablation"  # results/: `python -m dvi_lite eagle-ablation` (methods/eagle/ablation.py)
ARMS = {  # arm -> (what it changes, the arm it is compared with)
    "full": ("the committed head, dynamic tree", None),
    "static_tree": ("the committed head, a static tree of the same node budget", "full"),
    "full_small": ("a head trained on fewer tokens, all of EAGLE's design", None),
    "no_ttt": ("the same tokens, no training-time test", "full_small"),
    "top_layer": ("the same tokens, the top layer's state only (no fusion)", "full_small"),
}


def ablation_rows(res: dict) -> list[dict]:
    """One row per arm of the ablation: what it changes, its reference arm, tau, × AR [interval], c."""
    return [{"arm": arm, "what": ARMS.get(arm, ("", None))[0], "against": ARMS.get(arm, ("", None))[1],
             "tau": r["tau"], "speedup": r["speedup_vs_ar"], "interval": r["speedup_interval"], "c": r.get("c")}
            for arm, r in res["arms"].items()]


def ablation_figure(rows: list[dict], title: str = "EAGLE's design ablated: × AR (bars, 90% interval) and τ"):
    """× AR per arm as bars with their intervals (left axis) and τ as markers (right axis)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    x = [r["arm"] for r in rows]
    fig.add_bar(x=x, y=[r["speedup"] for r in rows], name="× AR (decode phase, median over questions)",
                error_y={"type": "data", "symmetric": False, "array": [r["interval"][1] - r["speedup"] for r in rows],
                         "arrayminus": [r["speedup"] - r["interval"][0] for r in rows]})
    fig.add_scatter(x=x, y=[r["tau"] for r in rows], mode="markers", name="τ (tokens per target forward)",
                    yaxis="y2", marker={"size": 11, "color": "black", "symbol": "diamond"})
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "grey"})
    fig.update_layout(title=title, xaxis={"title": "arm"}, yaxis={"title": "× AR", "rangemode": "tozero"},
                      yaxis2={"title": "τ", "overlaying": "y", "side": "right", "rangemode": "tozero"},
                      legend={"orientation": "h", "y": -0.25}, height=460, margin={"r": 80})
    return fig


def tree_steps(model, tok, prompt, max_new_tokens: int = 32, seed: int = 0, **options) -> list[dict]:
    """Greedy EAGLE decoding of `prompt` by the one loop (core.engine.decode), keeping every step's proposal as the
    drafter's feedback receives it: its tokens and parents (-1: child of the pending token), the accepted path and
    the target's own next token. options: eagle's (tree, lookup, ...)."""
    drafter = get_method("eagle").build(model, tok, **options)
    steps, feedback = [], drafter.feedback

    def record(state, out) -> None:
        prop = out.proposal
        steps.append({"tokens": prop.tokens.tolist(),
                      "parents": prop.parents.tolist() if prop.parents is not None else list(range(-1, len(prop) - 1)),
                      "path": list(out.path), "next_token": out.next_token})
        feedback(state, out)

    drafter.feedback = record  # the engine calls it once per step, after verification
    decode(Runner.for_model(model), drafter, prompt_ids(tok, prompt), max_new_tokens, Sampler(), make_generator(seed),
           tok.eos_token_id)
    return steps


def _shown(tok, token_id: int) -> str:
    """A token's text, escaped, with newlines and spaces visible."""
    return _html.escape(repr(tok.decode([token_id]))[1:-1])


def tree_html(tok, step: dict) -> str:
    """One step's tree as nested lists: each node's token; the accepted path in green, then the target's token."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(step["parents"]):
        children.setdefault(p, []).append(i)
    on_path, last = set(step["path"]), (step["path"][-1] if step["path"] else -1)
    target = f' → <span style="background:#f9c49a">{_shown(tok, step["next_token"])}</span> (target)'

    def node(i: int) -> str:
        style = "background:#b7e4b0;font-weight:bold" if i in on_path else "color:#666"
        kids = "".join(node(c) for c in children.get(i, []))
        return (f'<li><span style="{style}">{_shown(tok, step["tokens"][i])}</span>{target if i == last else ""}'
                f'{f"<ul>{kids}</ul>" if kids else ""}</li>')

    kids = "".join(node(c) for c in children.get(-1, []))
    return (f'<div style="font-family:monospace;font-size:13px">{len(step["tokens"])} nodes, '
            f'{len(step["path"])} accepted<ul><li>pending token{target if last < 0 else ""}<ul>{kids}</ul></li>'
            "</ul></div>")


def headline(bench: dict, methods: list[str] | None = None) -> list[dict]:
    """Rows of a bench result: decode-phase speedup over AR with its 90% interval, end-to-end, tau, alpha, c."""
    out = []
    for name, m in bench["methods"].items():
        if name == "ar" or (methods is not None and name not in methods):
            continue
        out.append({"method": name, "× AR (decode)": m.get("speedup_vs_ar"),
                    "90% interval": m.get("speedup_interval"), "× AR (end to end)": m.get("speedup_vs_ar_e2e"),
                    "τ": m.get("tau"), "α": m.get("alpha"), "c": m.get("c"), "=AR": m.get("same_tokens_as_ar")})
    return out


def head_for(model) -> tuple[EagleHead, str]:
    """(head, what it is): the model's head (data/eagle for the course model, data/smollm2/eagle for SmolLM2, or
    the one `prepare --model <folder>` trained), else an untrained head
    initialised from the target (its layer after the high fused state, the target's LM head rows): lossless
    anyway, a poor drafter."""
    if head_path(model).is_file():
        return load_head(model), f"committed head ({head_path(model).parent.name}/{head_path(model).name})"
    return EagleHead(model, HeadConfig(vocab=None)).eval(), "untrained head initialised from the target (no head " \
        "is committed for this model)"


@torch.no_grad()
def ttt_on_text(model, head: EagleHead, ids: list[int], steps: int = 4, decay: float = 0.8, top_k: int = 8) -> dict:
    """The training-time test on one token row, as training evaluates it: the target's states after the head's
    layers and its top-k next tokens (models.teacher.teacher_outputs), then ttt_loss. Returns the loss and, per
    unrolled step s, the positions scored and the share whose draft top-1 equals the target's top-1."""
    from dvi_lite.methods.eagle.train import fused_states
    from dvi_lite.models.teacher import TeacherConfig, teacher_outputs

    n_layers = model.config.num_hidden_layers
    data = teacher_outputs(model, [list(ids)], TeacherConfig(layers=tuple(k for k in head.layers if k < n_layers),
                                                             top_k=top_k, batch_size=1))
    dev, dtype = head.fc.weight.device, head.fc.weight.dtype
    states = [s.to(dev, dtype) for s in fused_states(data, head.layers, n_layers)]
    loss, stats = ttt_loss(head, states, data.tokens.to(dev), data.mask.to(dev), data.top_ids.to(dev),
                           data.top_logp.to(dev), steps, decay)
    return {"loss": float(loss), "steps": [{"step": s, "n": st["n"], "agreement": st["agree"] / st["n"]}
                                           for s, st in enumerate(stats)]}


def tree_stats(steps: list[dict]) -> dict:
    """tau (tokens per target forward, the target's own token counted), mean nodes and accepted per step, and the
    index of the step that accepted the most (the one worth drawing)."""
    n = max(1, len(steps))
    accepted = [len(s["path"]) for s in steps]
    return {"steps": len(steps), "tau": (sum(accepted) + len(steps)) / n,
            "mean_nodes": sum(len(s["tokens"]) for s in steps) / n, "mean_accepted": sum(accepted) / n,
            "busiest": max(range(len(steps)), key=lambda i: accepted[i]) if steps else None}


def rebuilt(steps: list[dict], first: int) -> list[int]:
    """The text a tree_steps run wrote: the prefill's token, then each step's accepted path and the target's token."""
    return [first] + [t for s in steps for t in [s["tokens"][i] for i in s["path"]] + [s["next_token"]]]


def check_invariants(steps: list[dict], result, ar_ids: list[int], fp32: bool, mask_t: int, mask_steps: int,
                     ttt: dict, bench_res: dict, methods: list[str], committed: dict[str, dict]) -> list[str]:
    """Notebook 07's claims, correctness only (never timing): every drawn tree is a tree whose accepted path follows
    its parent links, and the steps rebuild the run's output; in fp32 greedy EAGLE writes AR's tokens; the
    training-time-test mask is causal then diagonal; its agreements are rates and its loss finite; the benchmark
    and the committed files have their rows, with tau >= 1."""
    from dvi_lite.study.table import check_bench, finite, require

    for s in steps:
        par = s["parents"]
        require(all(-1 <= p < i for i, p in enumerate(par)), f"parents {par} are not a tree (parents[i] < i)")
        require(all(par[a] == (s["path"][j - 1] if j else -1) for j, a in enumerate(s["path"])),
                f"accepted path {s['path']} does not follow the parent links {par}")
    got = rebuilt(steps, result.token_ids[0]) if result.token_ids else []
    require(got[: len(result.token_ids)] == result.token_ids, "the recorded trees do not rebuild EAGLE's output")
    out = [f"{len(steps)} trees: parents[i] < i, each accepted path follows its parent links, and the steps rebuild "
           "the output"]
    if fp32:
        require(result.token_ids == ar_ids, "fp32 greedy EAGLE differs from AR")
        out.append("fp32: greedy EAGLE writes AR's tokens")
    else:
        out.append(f"bf16: EAGLE's output equals AR's: {result.token_ids == ar_ids} (not claimed: batched "
                   "verification flips near-ties)")
    m = ttt_mask(mask_t, mask_steps)[0, 0]
    eye = torch.eye(mask_t, dtype=torch.bool)
    require(torch.equal(m[:, :mask_t], torch.ones_like(eye).tril()) and all(
        torch.equal(m[:, s * mask_t:(s + 1) * mask_t], eye) for s in range(1, mask_steps + 1)),
        "the training-time-test mask is not causal then diagonal")
    finite(ttt["loss"], "training-time-test loss", 0)
    require(all(0 <= r["agreement"] <= 1 for r in ttt["steps"]), f"agreements are not rates: {ttt['steps']}")
    out += [f"ttt mask ({mask_t} slots, {mask_steps} later steps): causal block, then one diagonal per step; "
            "ttt loss finite, agreements in [0, 1]", check_bench(bench_res, methods)]
    for name, res in committed.items():
        rows = {m: r for m, r in res["methods"].items() if m.startswith("eagle")}
        require(bool(rows) and all(r["tau"] >= 1 for r in rows.values()), f"{name}: no EAGLE row with tau >= 1")
        out.append(f"{name}: {len(rows)} EAGLE rows, tau >= 1")
    return out
