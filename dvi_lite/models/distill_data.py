"""The self-distillation set at scale: the target's own answers, with its outputs stored once, in shards.

A draft is only as good as the data it imitates. `models/teacher.py` keeps one small in-memory set (87k
tokens); this module builds millions of tokens on a CPU in resumable shards under build/distill/<fingerprint>/:

    python -m dvi_lite distill-data --model smollm2 --tokens 2000000

Each prompt shard holds about `shard_prompts` prompts (models/prompt_pool.py: the training half of the
Spec-Bench dev questions, questions the model writes itself, and corpus-passage templates), answered by the
model in batches, greedy or sampled (temperatures cycle over `temperatures`), up to `answer_tokens` each.
The generating pass itself (forward hooks, no second forward) stores, at every position of prompt + answer:

- `ids` (N,) int32, the tokens; rows are concatenated, `offsets` (R + 1,) says where each starts and
  `prompt_len` (R,) where its answer begins;
- `top_ids` / `top_logp` (N, top_k): the target's most likely next tokens and their log-probs (full softmax);
- `h{k}` (N, D) bf16: the state after k layers, for every k in `layers` and for the last layer (pre-norm).

The costly part, on a CPU, is the answers themselves; the states are one forward pass away from them. So every
shard's token ids (and its JSON) are also kept, compressed, in a committed record, `data/<model>/distill/`
(models/artifacts.artifacts_dir): about 4 MB per million answer tokens. A later run on another machine reads the
record, never regenerates a recorded shard, rebuilds its states with one teacher forward (`teacher_pass`) when it
needs them, and generates only the shards that come after it. `--no-states` keeps the record alone (an AVX2 CPU
takes hours over a million tokens' forward); `--shards 0 1 19` rebuilds the states of a few shards only.

A shard is written to a temporary file and renamed, its JSON last: a shard is done when its JSON exists, and a
killed run resumes at the first shard without one. `card.json` (counts per source and group, duplicates
removed, throughput) is rebuilt after every shard. Shards `val_every - 1` mod `val_every` are held out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int
from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.runner import Runner
from dvi_lite.models import prompt_pool as pool
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.models.batch_decode import decode_with_states
from dvi_lite.models.distill_reader import done_shards
from dvi_lite.models.distill_record import read_meta, read_record, record_dir, save_record
from dvi_lite.paths import BUILD_DIR


@dataclass
class DistillConfig:
    tokens: int = 2_000_000  # answer tokens to reach (the corpus windows come on top)
    layers: tuple[int, ...] = (2, 4, 6, 8, 15, 27)  # exit layers (Kangaroo/DVI sweep) and EAGLE's fused layers
    top_k: int = 32  # target tokens kept per position
    answer_tokens: int = 256  # new tokens per answer at most
    prompt_chars: int = 2000  # a longer user message keeps its head and tail (pool.shorten) within this many chars
    shard_prompts: int = 96  # prompts per shard
    specbench_per_shard: int = 4  # Spec-Bench training questions per shard, until they run out
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # 0 = greedy; cycled over generation batches
    gen_batch: int = 48  # answers generated together (left-padded)
    forward_tokens: int = 2048  # padded tokens per teacher forward (the corpus shard)
    corpus_windows: int = 96  # windows of the corpus' train split (a shard of their own, one teacher forward)
    corpus_len: int = 256
    val_every: int = 20  # every val_every-th shard is held out
    seed: int = 0
    states: bool = True  # keep the states and top-k under build/ (False: the committed token record only)

    def check(self) -> None:
        check_int("tokens", self.tokens, 1)
        check_int("top_k", self.top_k, 1)
        check_int("answer_tokens", self.answer_tokens, 1)
        check_int("shard_prompts", self.shard_prompts, 6, what="at least one per task group")
        check_int("gen_batch", self.gen_batch, 1)
        check_int("corpus_windows", self.corpus_windows, 0)
        check_int("val_every", self.val_every, 2)
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values in [0, 2], got {self.temperatures}")


def distill_dir(model) -> Path:
    return BUILD_DIR / "distill" / fingerprint(model)


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _chat(tok, text: str, cfg: DistillConfig) -> list[int]:
    """Prompt ids for one user message (a raw continuation for a model without a chat template)."""
    text = pool.shorten(text, cfg.prompt_chars)
    chat = bool(getattr(tok, "chat_template", None))
    return prompt_ids(tok, [{"role": "user", "content": text}] if chat else text)


@torch.no_grad()
def teacher_pass(model, rows: list[list[int]], cfg: DistillConfig) -> dict[str, torch.Tensor]:
    """One full forward per batch of rows (right-padded): the flat per-position outputs of the shard."""
    runner = Runner.for_model(model)
    bad = [k for k in cfg.layers if not 1 <= k < runner.n_layers]
    if bad:
        raise ValueError(f"layers must lie in [1, {runner.n_layers - 1}] for this model, got {bad}")
    stops = sorted(set(cfg.layers)) + [runner.n_layers]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    per_row: dict[int, dict[str, torch.Tensor]] = {}
    b = 0
    while b < len(order):
        t = len(rows[order[b]])
        n = max(1, cfg.forward_tokens // max(t, 1))
        idx = order[b:b + n]
        t = max(len(rows[i]) for i in idx)
        x = torch.zeros(len(idx), t, dtype=torch.long)
        for j, i in enumerate(idx):
            x[j, : len(rows[i])] = torch.tensor(rows[i])
        x = x.to(runner.device)  # (B, T)
        pos = torch.arange(t, device=x.device)[None].expand(len(idx), -1)
        h, start, states = runner.embed(x), 0, {}
        for k in stops:
            h = runner.layers_forward(h, None, pos, start, k)  # (B, T, D)
            start = k
            states[f"h{k}"] = h.to("cpu", torch.bfloat16)
        logp = runner.logits(h).float().log_softmax(-1)  # (B, T, V)
        v, top = logp.topk(cfg.top_k, dim=-1)  # (B, T, top_k)
        for j, i in enumerate(idx):
            n_i = len(rows[i])
            per_row[i] = {key: s[j, :n_i] for key, s in states.items()}
            per_row[i]["top_ids"] = top[j, :n_i].to("cpu", torch.int32)
            per_row[i]["top_logp"] = v[j, :n_i].to("cpu", torch.float16)
            per_row[i]["ids"] = torch.tensor(rows[i], dtype=torch.int32)
        b += len(idx)
    return flatten([per_row[i] for i in range(len(rows))])


def flatten(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-row outputs (each (n_i, ...)) -> the shard's flat tensors (N, ...) and `offsets` (R + 1,)."""
    out = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    out["offsets"] = torch.tensor([0] + torch.tensor([len(r["ids"]) for r in rows]).cumsum(0).tolist())
    return out


def answers_with_states(model, tok, prompts: list[list[int]], cfg: DistillConfig, temperature: float,
                        seed: int) -> list[dict[str, torch.Tensor]]:
    """The model's answers and, from the same pass, its states and top-k at every position of prompt + answer
    (models/batch_decode.py: no second teacher forward, finished rows leave the batch). The last token of a row
    has no state (its forward never runs), so a row keeps prompt + answer without it; the last kept position's
    top-k still predicts that token."""
    n_layers = model.config.num_hidden_layers
    bad = [k for k in cfg.layers if not 1 <= k < n_layers]
    if bad:
        raise ValueError(f"layers must lie in [1, {n_layers - 1}] for this model, got {bad}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = decode_with_states(model, prompts, cfg.answer_tokens, temperature, seed, tok.eos_token_id, cfg.layers,
                              cfg.top_k, pad, states=cfg.states)
    return rows


def _save_shard(folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Tensors first (temporary file, then rename), the JSON last: the JSON marks the shard as done."""
    from safetensors.torch import save_file

    tmp = folder / f"{name}.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, folder / f"{name}.safetensors")
    _atomic_json(folder / f"{name}.json", meta)


def states_from_record(model, record: Path, i: int, cfg: DistillConfig, folder: Path) -> dict:
    """Shard i's states and top-k from its recorded ids (one teacher forward, no generation), into `folder`."""
    name = f"shard_{i:05d}"
    meta = read_meta(record, name)
    t0 = time.time()
    rows, plen = read_record(record, name, whole=False)
    tensors = teacher_pass(model, rows, cfg)
    tensors["prompt_len"] = plen
    meta["seconds"] = meta["seconds"] | {"teacher": round(time.time() - t0, 1)}
    _save_shard(folder, name, tensors, meta)
    return meta


def shard_prompts(model, tok, i: int, cfg: DistillConfig, train: list[dict], passages: pool.Passages,
                  seen: set[str]) -> tuple[list[dict], dict]:
    """Shard i's prompts (deduplicated against `seen`, which grows) and the self-instruct counts."""
    rng = random.Random(cfg.seed * 1_000_003 + i)
    rows = [{"group": q["group"], "category": q["category"], "source": "specbench", "text": q["turns"][0],
             "id": q["id"]} for q in train[i * cfg.specbench_per_shard:(i + 1) * cfg.specbench_per_shard]]
    per_group = max(1, (cfg.shard_prompts - len(rows)) // 6)
    requests = [r for g in pool.SELF_INSTRUCT_SEEDS for r in pool.self_instruct_requests(g, per_group, train, rng)]
    asked = [_chat(tok, r["messages"][0]["content"], cfg) for r in requests]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    replies = [r["answer"].tolist() for r in decode_with_states(model, asked, 64, 1.0, cfg.seed * 7919 + i,
                                                                 tok.eos_token_id, (), 1, pad, states=False)]
    n_rejected = 0
    for r, reply in zip(requests, replies, strict=True):
        q = pool.clean_question(tok.decode(reply, skip_special_tokens=True))
        if q is None:
            n_rejected += 1
            continue
        rows.append({"group": r["group"], "category": r["category"], "source": "self_instruct", "text": q})
    rows += [pool.template_prompt(g, passages, rng) for g in pool.TEMPLATE_GROUPS for _ in range(per_group)]
    kept, dups = [], 0
    for r in rows:
        key = pool.normalise(r["text"])
        if key in seen:
            dups += 1
            continue
        seen.add(key)
        kept.append(r)
    return kept, {"self_instruct_asked": len(requests), "self_instruct_rejected": n_rejected, "duplicates": dups}


def build_shard(model, tok, i: int, cfg: DistillConfig, train, passages, seen: set[str], folder: Path,
                bar: tqdm, record: Path | None = None) -> dict:
    """Prompts, then answers with the target's outputs, for shard i; returns its meta (also written as its JSON)."""
    t0 = time.time()
    prompts, counts = shard_prompts(model, tok, i, cfg, train, passages, seen)
    t_prompts = time.time() - t0
    ids = [_chat(tok, p["text"], cfg) for p in prompts]
    order = sorted(range(len(ids)), key=lambda j: len(ids[j]))  # similar lengths batch together
    rows: dict[int, dict[str, torch.Tensor]] = {}
    temps: dict[int, float] = {}
    t1 = time.time()
    for b in range(0, len(order), cfg.gen_batch):
        idx = order[b:b + cfg.gen_batch]
        temp = cfg.temperatures[(i * 7 + b // cfg.gen_batch) % len(cfg.temperatures)]
        out = answers_with_states(model, tok, [ids[j] for j in idx], cfg, temp, seed=cfg.seed * 31 + i * 101 + b)
        for j, r in zip(idx, out, strict=True):
            rows[j], temps[j] = r, temp
        bar.update(sum(len(r["answer"]) for r in out))
    t_gen = time.time() - t1
    answers = [rows[j].pop("answer") for j in range(len(ids))]
    last = torch.stack([a[-1] for a in answers])  # (R,): each row's last token, which no state follows
    tensors = flatten([rows[j] for j in range(len(ids))])
    tensors["prompt_len"] = torch.tensor([len(x) for x in ids], dtype=torch.int32)
    n_ans = {j: len(answers[j]) for j in range(len(ids))}  # tokens generated (the states stop one before the end)
    meta = {"shard": i, "split": "val" if i % cfg.val_every == cfg.val_every - 1 else "train",
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "rows": [{k: p[k] for k in ("group", "category", "source", "text")} | {"temperature": temps[j],
                      "prompt_tokens": len(ids[j]), "answer_tokens": n_ans[j]} for j, p in enumerate(prompts)],
            "answer_tokens": sum(n_ans.values()), "positions": int(tensors["ids"].numel()), **counts,
            "seconds": {"prompts": round(t_prompts, 1), "generate": round(t_gen, 1), "teacher": 0.0}}
    if record is not None:
        save_record(record, f"shard_{i:05d}", tensors, last, meta)
    if cfg.states:
        _save_shard(folder, f"shard_{i:05d}", tensors, meta)
    return meta


def build_corpus_shard(model, tok, cfg: DistillConfig, folder: Path) -> dict | None:
    """cfg.corpus_windows windows of the corpus' train split, through the teacher (no answers: all positions)."""
    if cfg.corpus_windows == 0 or (folder / "corpus.json").is_file():
        return None
    from dvi_lite.models.training import encode_split

    t0 = time.time()
    data = torch.as_tensor(encode_split(tok, "train").astype("int64"))
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(data) - cfg.corpus_len, (cfg.corpus_windows,), generator=gen).tolist()
    rows = [data[s:s + cfg.corpus_len].tolist() for s in starts]
    tensors = teacher_pass(model, rows, cfg)
    tensors["prompt_len"] = torch.zeros(len(rows), dtype=torch.int32)
    meta = {"shard": "corpus", "split": "train", "rows": len(rows), "positions": int(tensors["ids"].numel()),
            "seconds": {"teacher": round(time.time() - t0, 1)}}
    _save_shard(folder, "corpus", tensors, meta)
    return meta


def write_card(model, folder: Path, cfg: DistillConfig, command: str) -> dict:
    """card.json from every finished shard: counts per source and task group, duplicates, tokens, throughput."""
    from dvi_lite.measure.provenance import provenance

    metas = done_shards(folder)
    corpus = json.loads((folder / "corpus.json").read_text()) if (folder / "corpus.json").is_file() else None
    by_source: dict[str, dict[str, int]] = {}
    by_group: dict[str, dict[str, int]] = {}
    for m in metas:
        for r in m["rows"]:
            for table, key in ((by_source, r["source"]), (by_group, r["group"])):
                c = table.setdefault(key, {"prompts": 0, "answer_tokens": 0})
                c["prompts"] += 1
                c["answer_tokens"] += r["answer_tokens"]
    gen_s = sum(m["seconds"]["generate"] for m in metas)
    answer = sum(m["answer_tokens"] for m in metas)
    card = {"model": fingerprint(model), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "config": asdict(cfg), "shards": len(metas),
            "val_shards": [m["shard"] for m in metas if m["split"] == "val"],
            "answer_tokens": answer, "positions": sum(m["positions"] for m in metas),
            "val_answer_tokens": sum(m["answer_tokens"] for m in metas if m["split"] == "val"),
            "corpus_positions": corpus["positions"] if corpus else 0,
            "by_source": by_source, "by_group": by_group,
            "duplicates_removed": sum(m["duplicates"] for m in metas),
            "self_instruct": {"asked": sum(m["self_instruct_asked"] for m in metas),
                              "rejected": sum(m["self_instruct_rejected"] for m in metas)},
            "seconds": {k: round(sum(m["seconds"][k] for m in metas), 1) for k in ("prompts", "generate", "teacher")}
            | {"corpus": corpus["seconds"]["teacher"] if corpus else 0.0},
            "generation_tokens_per_s": round(answer / gen_s, 1) if gen_s else None,
            "provenance": provenance(command)}
    _atomic_json(folder / "card.json", card)
    return card


def build(model, tok, cfg: DistillConfig, folder: str | Path | None = None, command: str = "",
          record: str | Path | None = None, only: list[int] | None = None) -> dict:
    """Build (or resume) the set until it holds cfg.tokens answer tokens; returns the card (the record's when
    cfg.states is off). `record` (None: none) keeps every shard's ids: a recorded shard is never generated again,
    only its states are rebuilt when cfg.states asks. `only`: the states of these recorded shards alone."""
    from dvi_lite.models import specbench

    cfg.check()
    folder = Path(folder) if folder is not None else distill_dir(model)
    record = Path(record) if record is not None else None
    if not cfg.states and record is None:
        raise ValueError("states=False keeps only the token record: pass a record folder")
    for where in (folder, record):
        if where is not None and where.is_dir():
            for stale in where.glob("*.tmp"):  # a write the last run was killed in
                stale.unlink()
    if cfg.states:
        folder.mkdir(parents=True, exist_ok=True)
        build_corpus_shard(model, tok, cfg, folder)
    metas = {m["shard"]: m for where in (record, folder if cfg.states else None) if where and where.is_dir()
             for m in done_shards(where)}
    if only is not None:  # no generation: the prompt pools are not needed
        return states_of(model, cfg, folder, record, metas, only, command)
    train = specbench.training_questions(specbench.read_prompts(specbench.SPEC_BENCH_DEV))
    passages = pool.Passages.from_corpus("train")
    seen = {pool.normalise(r["text"]) for m in metas.values() for r in m["rows"]}
    have = sum(m["answer_tokens"] for m in metas.values())
    bar = tqdm(total=cfg.tokens, initial=min(have, cfg.tokens), unit="tok", unit_scale=True, desc="answer tokens",
               smoothing=0.05)
    i, done = 0, 0
    while done < cfg.tokens:
        fresh = True
        if i not in metas:  # a new shard: generated, recorded, and its states kept when asked
            meta = build_shard(model, tok, i, cfg, train, passages, seen, folder, bar, record)
        elif cfg.states and not (folder / f"shard_{i:05d}.json").is_file():  # recorded: rebuild its states only
            meta = states_from_record(model, record, i, cfg, folder)
        else:
            meta, fresh = metas[i], False
        for where in (folder if cfg.states else None, record):
            if fresh and where is not None:
                write_card(model, where, cfg, command)
        done += meta["answer_tokens"]
        i += 1
    bar.close()
    return write_card(model, folder if cfg.states else record, cfg, command)


def states_of(model, cfg: DistillConfig, folder: Path, record: Path | None, metas: dict[int, dict],
              only: list[int], command: str) -> dict:
    """The states of the recorded shards `only` (skipping those already built), then the states set's card."""
    if (missing := [i for i in only if i not in metas or record is None]) or not cfg.states:
        raise ValueError(f"shards must be recorded (0..{max(metas, default=-1)}), states kept; not: {missing}")
    for i in tqdm([i for i in only if not (folder / f"shard_{i:05d}.json").is_file()], desc="states", unit="shard"):
        states_from_record(model, record, i, cfg, folder)
    return write_card(model, folder, cfg, command)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("distill-data"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'course', 'smollm2' or a local HF checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype while generating (bf16: twice as fast)")
    ap.add_argument("--tokens", type=int, default=DistillConfig.tokens, help="answer tokens to reach")
    ap.add_argument("--answer-tokens", type=int, default=DistillConfig.answer_tokens)
    ap.add_argument("--shard-prompts", type=int, default=DistillConfig.shard_prompts)
    ap.add_argument("--gen-batch", type=int, default=DistillConfig.gen_batch)
    ap.add_argument("--corpus-windows", type=int, default=DistillConfig.corpus_windows)
    ap.add_argument("--layers", type=int, nargs="+", default=list(DistillConfig.layers))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder of the states (default: build/distill/<fingerprint>/)")
    ap.add_argument("--record", default=None, help="the committed token record (default: data/<model>/distill/)")
    ap.add_argument("--no-states", action="store_true",
                    help="keep only the token record (a CPU's choice: states are one teacher forward away)")
    ap.add_argument("--shards", type=int, nargs="+", help="only the states of these recorded shards (e.g. 0 1 19)")
    add_force(ap)
    args = ap.parse_args(argv)
    check_outputs(ap, (args.out, "dir", "--out"), force=args.force)  # the record grows by design: not checked

    def run() -> dict:
        from dvi_lite.models.loading import load_model

        cfg = DistillConfig(tokens=args.tokens, answer_tokens=args.answer_tokens, shard_prompts=args.shard_prompts,
                            gen_batch=args.gen_batch, corpus_windows=args.corpus_windows, layers=tuple(args.layers),
                            seed=args.seed, states=not args.no_states)
        cfg.check()
        model, tok = load_model(args.model, dtype=args.dtype)
        record = args.record if args.record is not None else record_dir(model)
        return build(model, tok, cfg, args.out, command_line("distill-data", argv), record, args.shards)

    card = run_or_usage_error(ap, run)
    print(json.dumps({k: card[k] for k in ("shards", "answer_tokens", "positions", "generation_tokens_per_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
