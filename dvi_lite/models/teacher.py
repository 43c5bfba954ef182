"""The teacher's outputs, computed once: the data every draft of a real model is distilled from.

Distilling a draft (Kangaroo's adapter, Medusa's heads, an SpS draft model, a D&V calibration) needs the
full model's next-token distribution p at every position, and the exit-layer states the draft reads.
Running the 30-layer teacher inside every training step costs most of the training time on a CPU, so
this module runs it once over a fixed data set and stores, per position:

- the token ids and a validity mask (rows are right-padded);
- the hidden state after each layer in `layers` (pre-norm, as `Runner.layers_forward(h, ..., 0, k)` returns);
- the final pre-norm state (what Medusa's heads read);
- the teacher's top-k token ids and their log-probabilities under the full softmax (fp32, then fp16).

The data set is the model's own greedy answers to instruction-like prompts (Spec-Bench dev questions
that the bench never measures on: `specbench.training_questions`), prompt and answer together, plus
windows of the course corpus. `python -m dvi_lite teacher --model smollm2` builds it under build/teacher/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi_lite.commands import add_force, check_outputs, command_line, prog, run_or_usage_error
from dvi_lite.core.checks import check_int
from dvi_lite.core.generate import prompt_ids
from dvi_lite.core.runner import Runner
from dvi_lite.models.artifacts import fingerprint
from dvi_lite.paths import BUILD_DIR, atomic_write_text
from dvi_lite.safety import load_torch


@dataclass
class TeacherConfig:
    layers: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 10)  # exit layers whose states are kept (each draft reads one)
    top_k: int = 32  # teacher tokens kept per position (their log-probs under the full softmax)
    answers: int = 192  # own answers generated (Spec-Bench dev questions the bench never measures on)
    answer_tokens: int = 128  # new tokens per answer, greedy
    prompt_tokens: int = 320  # a longer prompt keeps only its last prompt_tokens tokens
    corpus_windows: int = 96  # windows of the course corpus' train split
    seq_len: int = 384  # corpus window length
    gen_batch: int = 16  # answers generated together (left-padded)
    batch_size: int = 8  # rows per teacher forward
    seed: int = 0  # corpus window choice


@dataclass
class TeacherData:
    """What the teacher said, per position; rows are right-padded, `mask` marks real tokens."""

    tokens: torch.Tensor  # (N, T) long
    mask: torch.Tensor  # (N, T) bool
    states: dict[int, torch.Tensor]  # layer k -> (N, T, D) bf16, the state after k layers
    final: torch.Tensor  # (N, T, D) bf16, the last layer's output before the final norm
    top_ids: torch.Tensor  # (N, T, top_k) long: the teacher's most likely next tokens, best first
    top_logp: torch.Tensor  # (N, T, top_k) fp16: their log-probabilities under the full softmax
    card: dict = field(default_factory=dict)  # config, model fingerprint, data sources, provenance

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def width(self, rows: torch.Tensor) -> int:
        """Positions to keep when `rows` are cropped together: through the last scored position of any of them
        (scored positions are a prefix of each row, or only its answer positions in hard-label data)."""
        m = self.mask[rows]  # (B, T)
        return int((m * torch.arange(1, m.shape[1] + 1)).max())

    def state(self, k: int) -> torch.Tensor:
        if k not in self.states:
            raise ValueError(f"the teacher data keeps the states after layers {sorted(self.states)}, not {k}; "
                             f"rebuild it with --layers including {k}")
        return self.states[k]


def teacher_path(model) -> Path:
    return BUILD_DIR / "teacher" / fingerprint(model) / "teacher.pt"


def own_answers(model, tok, questions: list[dict], cfg: TeacherConfig) -> list[list[int]]:
    """prompt + greedy answer ids for each question's first turn (through the chat template when the tokenizer
    has one), generated in left-padded batches."""
    chat = bool(getattr(tok, "chat_template", None))  # a base model (the course model) continues the raw turn
    prompts = [prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}] if chat else q["turns"][0])
               [-cfg.prompt_tokens:] for q in questions]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: dict[int, list[int]] = {}
    dev = next(model.parameters()).device
    for b in tqdm(range(0, len(order), cfg.gen_batch), desc="own answers"):
        idx = order[b:b + cfg.gen_batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=dev)
        att = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=dev)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=cfg.answer_tokens,
                                 do_sample=False, pad_token_id=pad)
        for row, i in zip(gen[:, width:].tolist(), idx, strict=True):
            ans = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            out[i] = prompts[i] + ans
    return [out[i] for i in range(len(prompts))]


def corpus_rows(tok, cfg: TeacherConfig) -> list[list[int]]:
    """cfg.corpus_windows windows of cfg.seq_len tokens from the course corpus' train split."""
    from dvi_lite.models.training import encode_split

    data = torch.as_tensor(encode_split(tok, "train")).long()
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(data) - cfg.seq_len, (cfg.corpus_windows,), generator=gen)
    return [data[s:s + cfg.seq_len].tolist() for s in starts.tolist()]


@torch.no_grad()
def teacher_outputs(model, rows: list[list[int]], cfg: TeacherConfig) -> TeacherData:
    """One forward of the full model per batch of rows; keeps states, final state and top-k log-probs."""
    runner = Runner.for_model(model)
    bad = [k for k in cfg.layers if not 1 <= k < runner.n_layers]
    if bad:
        raise ValueError(f"layers must lie in [1, {runner.n_layers - 1}] for this model, got {bad}")
    n, t = len(rows), max(len(r) for r in rows)
    d = model.config.hidden_size
    tokens = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    states = {k: torch.zeros(n, t, d, dtype=torch.bfloat16) for k in cfg.layers}
    final = torch.zeros(n, t, d, dtype=torch.bfloat16)
    top_ids = torch.zeros(n, t, cfg.top_k, dtype=torch.long)
    top_logp = torch.zeros(n, t, cfg.top_k, dtype=torch.float16)
    stops = sorted(set(cfg.layers)) + [runner.n_layers]
    for b in tqdm(range(0, n, cfg.batch_size), desc="teacher"):
        x = tokens[b:b + cfg.batch_size].to(runner.device)  # (B, T)
        pos = torch.arange(t, device=x.device)[None].expand(x.shape[0], -1)
        h, start = runner.embed(x), 0
        for k in stops:
            h = runner.layers_forward(h, None, pos, start, k)  # (B, T, D)
            start = k
            if k in states:
                states[k][b:b + cfg.batch_size] = h.to("cpu", torch.bfloat16)
        final[b:b + cfg.batch_size] = h.to("cpu", torch.bfloat16)
        logp = runner.logits(h).float().log_softmax(-1)  # (B, T, V)
        v, i = logp.topk(cfg.top_k, dim=-1)
        top_ids[b:b + cfg.batch_size], top_logp[b:b + cfg.batch_size] = i.cpu(), v.cpu().half()
    return TeacherData(tokens, mask, states, final, top_ids, top_logp)


@torch.no_grad()
def fill_states(model, data: TeacherData, layers: tuple[int, ...], batch_rows: int = 16,
                cache: bool = False) -> TeacherData:
    """Add the states after `layers` to `data` (hard-label data from the token record has none): a forward through
    the first max(layers) layers only, so an exit layer k costs k / n_layers of a full forward (k = n_layers: the
    last layer's pre-norm state, a full forward). Rows are right-padded, and attention is causal, so a row's
    states do not depend on its padding.

    cache: keep each layer's states in build/cache/, keyed by the model, the rows' tokens and the layer (a pure
    function of the three), so the arms of an ablation, each its own command, pay the pass once."""
    runner = Runner.for_model(model)
    bad = [k for k in layers if not 1 <= k <= runner.n_layers]
    if bad:
        raise ValueError(f"layers must lie in [1, {runner.n_layers}] for this model, got {bad}")
    paths = {k: cache_path(f"states_L{k}", model, data.tokens) for k in layers}
    for k in sorted(set(layers) - set(data.states)) if cache else ():
        kept = read_cache(paths[k], f"states after layer {k}", ("states",))
        if kept is not None:
            data.states[k] = kept["states"]
    need = sorted(set(layers) - set(data.states))
    n, t = data.tokens.shape
    for k in need:
        data.states[k] = torch.zeros(n, t, model.config.hidden_size, dtype=torch.bfloat16)
    for b in tqdm(range(0, n, batch_rows), desc=f"states after layers {need}") if need else ():
        x = data.tokens[b:b + batch_rows].to(runner.device)  # (B, T)
        pos = torch.arange(t, device=x.device)[None].expand(x.shape[0], -1)
        h, start = runner.embed(x), 0
        for k in need:
            h = runner.layers_forward(h, None, pos, start, k)  # (B, T, D)
            start = k
            data.states[k][b:b + batch_rows] = h.to("cpu", torch.bfloat16)
    for k in need if cache else ():
        write_cache(paths[k], {"states": data.states[k]})
    return data


def cache_path(kind: str, model, tokens: torch.Tensor, *extra) -> Path:
    """build/cache/<kind>_<fingerprint>_<key>.pt, key = a hash of the rows' tokens, their shape and `extra`."""
    key = hashlib.sha256(tokens.numpy().tobytes() + str((tuple(tokens.shape), *extra)).encode()).hexdigest()[:16]
    return BUILD_DIR / "cache" / f"{kind}_{fingerprint(model)}_{key}.pt"


def read_cache(path: Path, what: str, keys: tuple[str, ...]) -> dict | None:
    """What `write_cache` kept at `path`, or None (nothing kept, or a torn file: the caller computes it again)."""
    if not path.is_file():
        return None
    try:
        return load_torch(path, what, keys=keys)
    except (OSError, ValueError, RuntimeError):
        return None


def write_cache(path: Path, body: dict) -> None:
    """Through a temporary name and a rename: a kill leaves no half file to read back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two processes filling one cache never share a tmp
    torch.save(body, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def soft_targets(model, data: TeacherData, top_k: int = 32, batch_rows: int = 4, cache: bool = True) -> TeacherData:
    """Replace hard labels (the token record's: the next token, probability 1) by the target's own soft top-k:
    one full forward over every row in prefill batches, then the `top_k` most likely next tokens and their
    log-probabilities under the full softmax at every scored position. What a KL warm start distils is then the
    target's distribution, not the one token it happened to sample. Rows are right-padded and attention is causal:
    a row's targets do not depend on its padding. The card records what the targets are.

    cache: keep the result in build/cache/, keyed by the model's fingerprint, the rows' tokens and top_k (a pure
    function of the three), so a second run (another exit layer, a resumed ablation) skips the teacher pass."""
    check_int("top_k", top_k, 1)
    check_int("batch_rows", batch_rows, 1)
    n, t = data.tokens.shape
    path = cache_path(f"soft_top{top_k}", model, data.tokens, top_k)
    kept = read_cache(path, "soft top-k targets", ("ids", "logp")) if cache else None
    if kept is not None:
        ids, logp = kept["ids"], kept["logp"]
    else:
        runner = Runner.for_model(model)
        ids = torch.zeros(n, t, top_k, dtype=torch.long)
        logp = torch.full((n, t, top_k), float("-inf"), dtype=torch.float16)
        for b in tqdm(range(0, n, batch_rows), desc=f"soft top-{top_k} targets"):
            x = data.tokens[b:b + batch_rows].to(runner.device)  # (B, T)
            pos = torch.arange(t, device=x.device)[None].expand(x.shape[0], -1)
            h = runner.layers_forward(runner.embed(x), None, pos)  # (B, T, D)
            lp = runner.logits(h).float().log_softmax(-1)  # (B, T, V)
            top = lp.topk(top_k, dim=-1)
            ids[b:b + batch_rows], logp[b:b + batch_rows] = top.indices.cpu(), top.values.to("cpu", torch.float16)
        if cache:
            write_cache(path, {"ids": ids, "logp": logp})
    data.top_ids, data.top_logp = ids, logp
    data.card = {**data.card, "targets": f"soft: the target's top-{top_k} log-probabilities by a teacher forward "
                 "over the record (teacher.soft_targets)"}
    return data


def build_teacher(model, tok, cfg: TeacherConfig, path: str | Path | None = None, command: str = "") -> TeacherData:
    """Generate the own answers, run the teacher over them and the corpus windows, save to `path`."""
    from dvi_lite.measure.provenance import provenance
    from dvi_lite.models import specbench

    check_int("answers", cfg.answers, 0)
    check_int("corpus_windows", cfg.corpus_windows, 0)
    check_int("top_k", cfg.top_k, 1)
    if cfg.answers + cfg.corpus_windows == 0:
        raise ValueError("answers + corpus_windows must be >= 1: the teacher data would be empty")
    t0 = time.time()
    questions = specbench.training_questions(specbench.read_prompts(specbench.SPEC_BENCH_DEV))
    questions = questions[: cfg.answers]
    rows = own_answers(model, tok, questions, cfg) if questions else []
    rows += corpus_rows(tok, cfg) if cfg.corpus_windows else []
    data = teacher_outputs(model, rows, cfg)
    data.card = {"config": asdict(cfg), "model": fingerprint(model), "n_rows": len(rows), "n_tokens": data.n_tokens,
                 "questions": [q["id"] for q in questions], "wall_time_s": round(time.time() - t0, 1),
                 "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "provenance": provenance(command)}
    path = Path(path) if path is not None else teacher_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(asdict(data), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    atomic_write_text(path.with_suffix(".json"), json.dumps(data.card, indent=1))
    return data


def load_teacher(path: str | Path) -> TeacherData:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no teacher data at {p}: build it with `python -m dvi_lite teacher --model ...`")
    keys = ("tokens", "mask", "states", "final", "top_ids", "top_logp")
    return TeacherData(**load_torch(p, "teacher data file", keys=keys))


def teacher_for(model, tok, cfg: TeacherConfig | None = None, path: str | Path | None = None) -> TeacherData:
    """The model's teacher data: loaded when built before (and built with `cfg` otherwise)."""
    p = Path(path) if path is not None else teacher_path(model)
    if p.is_file():
        return load_teacher(p)
    return build_teacher(model, tok, cfg or TeacherConfig(), p)


def soft_ce(logq: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q against the teacher's top-k distribution (renormalised), per position.

    logq: (..., V) log-probs of the draft; top_ids/top_logp: (..., k). Returns (...). Minimising it over q
    is minimising KL(p_top || q): the constant entropy of p_top is left out.
    """
    p = top_logp.float().softmax(-1)  # (..., k), renormalised over the kept tokens
    return -(p * logq.gather(-1, top_ids)).sum(-1)


def one_pass_steps(data: TeacherData, batch_rows: int) -> int:
    """Steps that draw as many rows as the data holds (one pass on average): every set recipe's default."""
    return max(1, -(-data.tokens.shape[0] // batch_rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("teacher"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'course', 'smollm2' or a local HF checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16", help="the teacher's dtype (bf16 on a CPU: twice as fast)")
    ap.add_argument("--answers", type=int, default=TeacherConfig.answers)
    ap.add_argument("--answer-tokens", type=int, default=TeacherConfig.answer_tokens)
    ap.add_argument("--corpus-windows", type=int, default=TeacherConfig.corpus_windows)
    ap.add_argument("--layers", type=int, nargs="+", default=list(TeacherConfig.layers))
    ap.add_argument("--out", default=None, help="file (default: build/teacher/<fingerprint>/teacher.pt)")
    add_force(ap)
    args = ap.parse_args(argv)
    check_outputs(ap, (args.out, "file", "--out"), force=args.force)
    from dvi_lite.models.loading import load_model

    def run() -> TeacherData:
        model, tok = load_model(args.model, dtype=args.dtype)
        cfg = TeacherConfig(layers=tuple(args.layers), answers=args.answers, answer_tokens=args.answer_tokens,
                            corpus_windows=args.corpus_windows)
        return build_teacher(model, tok, cfg, args.out, command_line("teacher", argv))

    data = run_or_usage_error(ap, run)
    print(json.dumps({k: data.card[k] for k in ("n_rows", "n_tokens", "wall_time_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


