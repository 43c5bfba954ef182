"""The GPU study's device-side checks (scripts/gpu_study.sh runs them; each writes one JSON and nothing else).

    python scripts/gpu_study.py tree OUT.json       the tree kernel on SmolLM2's real trees: logits and
                                                    timings of one tree verify, sdpa vs Triton, per tree size
    python scripts/gpu_study.py online OUT_DIR      DVI learning online over a stream of the record's prompts,
                                                    from the committed head, under a time budget
    python scripts/gpu_study.py lossless OUT.json   fp32: every method's greedy tokens against AR and HF
                                                    generate; a sampling-law test of DVI's head, with a control

Everything runs on the GPU the machine has (cuda), SmolLM2 in bf16 unless fp32 is named.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script (slow; Triton interpreted)
RECORD = ROOT / "data" / "smollm2" / "distill"


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def device_facts() -> dict:
    from dvi_lite.measure.provenance import provenance

    return provenance("python scripts/gpu_study.py", device=DEV)


def tree(out: Path, sizes=(4, 8, 16, 32, 64), context: int = 512, reps: int = 30,
         dtypes=("float32", "bfloat16")) -> None:
    """One tree verify of n nodes over a real context (SmolLM2, in each dtype): max |logit difference| between
    the sdpa runner (the reference) and the Triton one, whether each node's argmax agrees, and the median time
    of the whole verify forward with each, per tree size. (Triton's CPU interpreter mis-computes bf16: a dry
    run on the CPU uses float32 only.)"""
    rows = []
    for dtype in dtypes:
        rows += _tree_rows(dtype, sizes, context, reps)
        write(out, {"what": "one tree verify of SmolLM2 over a real context: sdpa runner vs the Triton tree kernel; "
                    "logits compared, median ms of the whole forward", "rows": rows, "reps": reps,
                    "provenance": device_facts()})


def _tree_rows(dtype: str, sizes, context: int, reps: int) -> list[dict]:
    from dvi_lite.core.runner import Runner
    from dvi_lite.methods.medusa.tree_attention_check import timeit_us
    from dvi_lite.models.loading import load_model
    from dvi_lite.models.specbench import SPEC_BENCH_DEV, read_prompts

    model, tok = load_model("smollm2", dtype=dtype, device=DEV)
    text = " ".join(r["turns"][0] for r in read_prompts(SPEC_BENCH_DEV)[:40])
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:context]], device=DEV)  # (1, P)
    gen = torch.Generator().manual_seed(0)
    rows = []
    runners = {a: Runner.for_model(model, a) for a in ("sdpa", "triton")}
    caches = {}
    for a, r in runners.items():
        caches[a] = r.new_cache(context + max(sizes) + 8)
        r.forward(ids, caches[a])
    for n in sizes:
        # a tree as the engine verifies it: node 0 the last accepted token (the root), each other node's parent
        # an earlier node, with a chain of three below the root, as drafts grow
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
        parents[1 : min(n, 4)] = torch.arange(0, min(n, 4) - 1)
        new = ids[:, torch.randint(0, ids.shape[1], (n,), generator=gen)]  # (1, n) tokens of the context
        logits, times = {}, {}
        for a, r in runners.items():
            def step(a=a, r=r, new=new, parents=parents):
                out = r.forward(new, caches[a], parents.to(DEV))[0]
                caches[a].crop(ids.shape[1])
                return out
            logits[a] = step().float()
            times[a] = timeit_us(step, torch.device(DEV), reps) / 1e3  # median ms, after a warm-up
        diff = (logits["triton"] - logits["sdpa"]).abs().max().item()
        same = bool((logits["triton"].argmax(-1) == logits["sdpa"].argmax(-1)).all())
        rows.append({"dtype": dtype, "nodes": n, "context": int(ids.shape[1]), "max_abs_logit_diff": diff,
                     "argmax_agree": same,
                     "sdpa_ms": times["sdpa"], "triton_ms": times["triton"],
                     "triton_over_sdpa": times["triton"] / times["sdpa"]})
        print(rows[-1], flush=True)
    return rows


def record_stream(tok, n: int, max_prompt_tokens: int, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """The self-distillation record's own prompts (train shards; not Spec-Bench's), chat-formatted, shuffled."""
    from dvi_lite.core.generate import prompt_ids

    card = json.loads((RECORD / "card.json").read_text())
    rows = []
    for f in sorted(RECORD.glob("shard_*.json.xz")):
        shard = json.loads(lzma.decompress(f.read_bytes()))
        if shard.get("split") == "train" and shard["shard"] not in card.get("val_shards", []):
            rows += [r for r in shard["rows"] if r.get("source") != "specbench"]
    random.Random(seed).shuffle(rows)
    ids, meta = [], []
    for r in rows:
        x = prompt_ids(tok, [{"role": "user", "content": r["text"]}])
        if 0 < len(x) <= max_prompt_tokens:
            ids.append(x)
            meta.append({"group": r["group"], "source": r["source"]})
        if len(ids) >= n:
            break
    return ids, meta


def online(out: Path, seconds: float, n_prompts: int = 2400, max_new_tokens: int = 32) -> None:
    """DVI's online phase continued from the committed head (its config, its λ schedule's step, the online
    learning rate), serving the record's prompts until the stream or the time budget ends; saves the head."""
    from dvi_lite.methods.dvi.learner import OnlineTrainer
    from dvi_lite.methods.dvi.paper import PAPER
    from dvi_lite.methods.dvi.policy import load_policy
    from dvi_lite.methods.dvi.serve import frozen_model
    from dvi_lite.models.loading import load_model

    t_start = time.perf_counter()
    loaded, tok = load_model("smollm2", dtype="bfloat16", device=DEV)
    model, tok = frozen_model(loaded, tokenizer=tok)
    card = json.loads((ROOT / "data" / "smollm2" / "dvi" / "card.json").read_text())
    committed = load_policy(model)
    stream, meta = record_stream(tok, n_prompts, card["recipe"]["max_prompt_tokens"])
    cfg = dataclasses.replace(PAPER, t_lambda=float(card["config"]["t_lambda"]), lr=card["recipe"]["online_lr"])
    tr = OnlineTrainer(model, stream, cfg, max_new_tokens=max_new_tokens, K=card["recipe"]["K"],
                       eos_token_id=tok.eos_token_id, vocab=card["recipe"]["vocab"], progress=False,
                       log_path=out / "log.jsonl")
    tr.policy.load_trainable_state(committed.trainable_state())
    tr.fast_step = int(card["fast_steps"])  # λ_t continues where the committed run stopped
    if tr.log_path.is_file():
        tr.log_path.unlink()
    deadline = t_start + seconds

    class _Stop(Exception):
        pass

    def tick(rec: dict) -> None:
        if rec["step"] % 50 == 0:
            print(f"step {rec['step']}: {rec['sequences']} prompts, acceptance {rec['accept_rate']}", flush=True)
        if time.perf_counter() > deadline:
            raise _Stop

    stopped = False
    try:
        tr.train(10**9, callback=tick, max_sequences=len(stream))
    except _Stop:
        stopped = True
    tr.save_policy(out, dtype=torch.bfloat16, head_rank=64)  # as the committed head is stored
    write(out / "card.json", {
        "what": "DVI's online phase on the GPU, continued from the committed head (data/smollm2/dvi)",
        "stream": {"source": "data/smollm2/distill train shards' prompts (self_instruct + template), chat-formatted, "
                   f"shuffled with seed 0, <= {card['recipe']['max_prompt_tokens']} tokens",
                   "prompts_available": len(stream), "prompts_served": tr.prompt_idx,
                   "groups": {g: sum(m["group"] == g for m in meta[: tr.prompt_idx])
                              for g in {m["group"] for m in meta}}},
        "max_new_tokens": max_new_tokens, "K": tr.K, "config": cfg.to_dict(), "start_fast_step": card["fast_steps"],
        "fast_steps": tr.fast_step, "experiences": tr.buffer.n_seen, "tokens_generated": tr.tokens_generated,
        "train_wall_s": tr.elapsed, "budget_s": seconds, "stopped_by_budget": stopped,
        "provenance": device_facts()})
    print(f"served {tr.prompt_idx} prompts in {tr.elapsed:.0f} s ({tr.fast_step - card['fast_steps']} fast steps)")


RAW_PROMPTS = ("Once upon a time, there was a", "My favourite thing to cook is",
               "The city I would most like to visit is")


def law(model, tok, prompt, state, n: int, seed: int = 0) -> dict:
    """DVI under sampling (T = 1, K drafts verified per step): the first two output tokens' laws against the
    target's. Depth 1: all n samples against p(x1); depth 2: the samples whose x1 is the modal one, against
    p(x2 | x1). Control: n draws from a wrong law (the target at T = 1.3) must be rejected; the power of the
    test against that control is simulated from the exact laws."""
    import numpy as np
    from scipy.stats import chisquare

    from dvi_lite.core.generate import generate, prompt_ids

    @torch.no_grad()
    def p_next(prefix: list[int], temperature: float = 1.0) -> torch.Tensor:
        x = (model(torch.tensor([prefix], device=DEV)).logits[0, -1].double() / temperature).softmax(-1).cpu()
        return x / x.sum()

    def entropy(prefix: list[int]) -> float:
        p = p_next(prefix)
        return float(-(p * p.clamp_min(1e-30).log()).sum())

    # the prompt whose next-token law is broadest: a peaked law leaves a chi-square nothing to test
    ids = max([prompt_ids(tok, prompt)] + [prompt_ids(tok, t) for t in RAW_PROMPTS], key=entropy)

    def test(counts: np.ndarray, probs: np.ndarray) -> float:
        keep = probs * counts.sum() >= 5
        o = np.append(counts[keep], counts[~keep].sum())
        e = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
        o, e = (o, e) if e[-1] >= 5 else (o[:-1], e[:-1] * o[:-1].sum() / e[:-1].sum())
        return float(chisquare(o, e).pvalue)

    x = [generate(model, tok, ids, method="dvi", state=state, max_new_tokens=2, temperature=1.0, seed=seed + i,
                  stop_at_eos=False).token_ids[:2] for i in range(n)]
    p1 = p_next(ids).numpy()
    c1 = np.bincount([t[0] for t in x], minlength=len(p1)).astype(float)
    mode = int(c1.argmax())
    p2 = p_next(ids + [mode]).numpy()
    sub = [t[1] for t in x if t[0] == mode and len(t) > 1]
    c2 = np.bincount(sub, minlength=len(p2)).astype(float)
    wrong = p_next(ids, 1.3).numpy()
    rng = np.random.default_rng(seed)
    ctrl = rng.multinomial(n, wrong).astype(float)
    power = float(np.mean([test(rng.multinomial(n, wrong).astype(float), p1) < 0.01
                           for _ in range(200)]))
    return {"prompt": tok.decode(ids)[-200:], "samples": n, "depth1_pvalue": test(c1, p1), "depth2_samples": len(sub),
            "depth2_pvalue": test(c2, p2) if len(sub) >= 20 else None,
            "control_pvalue": test(ctrl, p1), "control_tv": float(0.5 * np.abs(wrong - p1).sum()),
            "power_vs_control_at_0.01": power}


def lossless(out: Path, gpu_head: Path | None, questions: int = 3, tokens: int = 48, law_samples: int = 600) -> None:
    """fp32 on the GPU: each method's greedy tokens equal AR's (and HF generate's) on a few held-out questions."""
    from dvi_lite.core.generate import generate
    from dvi_lite.methods.dvi.serve import heldout_questions
    from dvi_lite.models.loading import load_model

    model, tok = load_model("smollm2", dtype="float32", device=DEV)
    prompts, qids = heldout_questions(tok, questions)
    methods = {"hf": {}, "pld": {}, "sps": {}, "kangaroo": {}, "draft_verify": {}, "medusa": {},
               "medusa_triton": {"attention": "triton"}, "dvi": {}, "eagle": {}, "eagle_lookup": {"lookup": True}}
    if gpu_head is not None and (gpu_head / "policy.pt").is_file():
        methods["dvi_gpu_head"] = {"state": str(gpu_head)}
    rows = {}
    for q, p in zip(qids, prompts, strict=True):
        ref = generate(model, tok, p, method="ar", max_new_tokens=tokens).token_ids
        for label, opts in methods.items():
            name = label.removesuffix("_triton").removesuffix("_lookup").removesuffix("_gpu_head")
            try:
                got = generate(model, tok, p, method=name, max_new_tokens=tokens, **opts).token_ids
                first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
                ok = list(got) == list(ref)
                rows.setdefault(label, []).append({"question": q, "equal": ok, "first_difference": first,
                                                   "tokens": len(got)})
            except Exception as e:  # noqa: BLE001 - a method that cannot run here is reported, not fatal
                rows.setdefault(label, []).append({"question": q, "error": f"{type(e).__name__}: {e}"[:300]})
        print(q, {k: v[-1].get("equal", v[-1].get("error")) for k, v in rows.items()}, flush=True)
        write(out, {"greedy_fp32": rows, "questions": qids, "tokens": tokens, "provenance": device_facts()})
    res = {"greedy_fp32": rows, "questions": qids, "tokens": tokens,
           "all_equal": all(r.get("equal") for v in rows.values() for r in v)}
    try:
        state = str(gpu_head) if "dvi_gpu_head" in methods else None
        res["law"] = {"head": "gpu" if state else "committed",
                      **law(model, tok, prompts[0], state, law_samples)}
    except Exception as e:  # noqa: BLE001
        res["law"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    res["provenance"] = device_facts()
    write(out, res)
    print(json.dumps({k: res[k] for k in ("all_equal", "law")}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("tree", "online", "lossless"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seconds", type=float, default=150.0, help="online: the time budget")
    ap.add_argument("--prompts", type=int, default=2400, help="online: the stream's length")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="online: tokens per prompt")
    ap.add_argument("--gpu-head", type=Path, default=None, help="lossless: the online run's head folder")
    ap.add_argument("--law-samples", type=int, default=600)
    ap.add_argument("--questions", type=int, default=3, help="lossless: held-out questions")
    ap.add_argument("--tokens", type=int, default=48, help="lossless: new tokens per question")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of the script on the CPU")
    args = ap.parse_args()
    if args.what == "tree":
        tree(args.out, *(((4, 8), 64, 2, ("float32",)) if args.quick else ()))
    elif args.what == "online":
        online(args.out, args.seconds, args.prompts, args.max_new_tokens)
    else:
        lossless(args.out, args.gpu_head, *((1, 8) if args.quick else (args.questions, args.tokens)),
                 law_samples=args.law_samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
