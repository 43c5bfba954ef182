"""The one speculative loop. Every method is a `Drafter` plugged into `decode`; AR is the empty drafter.

    prefill(prompt) -> first token, the "pending" token (sampled, not yet in the target's cache)
    repeat:  proposal = drafter.propose(state)          # tokens (a chain or a tree) + their q
             logits   = target([pending] + proposal)   # ONE forward verifies everything
             path, t  = verify(proposal, p, q)          # accepted nodes + correction/bonus token
             cache.keep(pending + path); drafter.feedback(outcome)
             emit path tokens + t;  pending = t

Kept separate, as in transformers' CandidateGenerator: drafting (drafters), verification
(verify.py), the model forward (runner.py) and cache rollback (kvcache.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dvi_lite.core.kvcache import KVCache
from dvi_lite.core.runner import Runner, tree_depths, tree_mask
from dvi_lite.core.sampling import Sampler
from dvi_lite.core.verify import verify_greedy_chain, verify_sampling_chain, verify_tree


@dataclass
class Proposal:
    """What a drafter proposes. A chain when `parents` is None, else a tree."""
    tokens: torch.Tensor  # (N,) long
    q: torch.Tensor | None = None  # (N, V) draft distribution of each node (None: greedy, or point masses)
    parents: torch.Tensor | None = None  # (N,) parents[i] < i, -1 = child of the pending token
    hidden: torch.Tensor | None = None  # (1, m, D) layer-`split` states of the first m of [pending, *tokens], a chain
    split: int = 0  # for the first m of [pending, *tokens]: verification runs only layers [split, L) on them
    # Two opt-in hooks of the verify step (None = the engine's own, the default path):
    runner: Runner | None = None  # the target runner that verifies (the same model, e.g. another attention backend)
    # accept(p_logits (N+1, V), sampler, gen) -> (accepted node indices, next token): a rule replacing the
    # engine's greedy match / rejection sampling. Any other rule than those BREAKS LOSSLESSNESS (the output
    # no longer follows the target's law), so only an explicitly lossy option may set it. For a chain
    # (parents None) the path must be a prefix 0..n-1.
    accept: Callable[[torch.Tensor, Sampler, torch.Generator], tuple[list[int], int]] | None = None
    # capture: keep the states after these many layers of the verify forward (EAGLE's fused features), handed
    # back in Outcome.features for the kept positions; () = none (the default path). Not with `hidden`.
    capture: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclass
class Outcome:
    """What verification decided, handed back to the drafter so it can sync caches and learn."""
    proposal: Proposal
    path: list[int]  # accepted node indices (a chain: 0..n-1)
    next_token: int  # correction (after a rejection) or bonus (all accepted) token: the new pending
    p_logits: torch.Tensor  # (N+1, V) target logits at pending + every node
    hidden: torch.Tensor  # (1, n+1, D) final pre-norm hidden states at pending + accepted path
    committed: int  # target cache length after this step (= tokens known to the target, pending excluded)
    split_hidden: torch.Tensor | None = None  # (1, N+1, D) layer-`split` states of all inputs (self-speculation)
    features: dict = field(default_factory=dict)  # {k: (1, n+1, D)} after k layers at pending + path (Proposal.capture)

    @property
    def n_accepted(self) -> int:
        return len(self.path)


class Drafter:
    """Base drafter: proposes nothing, so decoding is plain autoregressive (the AR baseline)."""
    name = "ar"
    capture_layer: int | None = None  # ask the prefill for the prompt's hidden states after this many layers
    capture_layers: tuple[int, ...] = ()  # ... and after each of these (prefill_hidden; EAGLE's fused features)
    max_draft: int = 0  # the most nodes one proposal can hold: the cache room the engine reserves for it
    # learns: feedback keeps the decode's tensors to train on later (DVI's online learner). The loop then runs
    # under no_grad; otherwise under inference_mode, whose tensors cannot enter autograd but cost less per op
    learns: bool = False

    def __init__(self, model=None, tokenizer=None):
        """The AR factory: `Drafter(model, tokenizer)` builds the empty drafter (the registry calls it so)."""

    def prefill(self, state: "DecodeState", prompt: torch.Tensor) -> None:
        """Called once after the target's prefill (prompt (1, T)); build the drafter's own caches."""

    def propose(self, state: "DecodeState") -> Proposal:
        return Proposal(tokens=torch.empty(0, dtype=torch.long, device=state.device))

    def feedback(self, state: "DecodeState", outcome: Outcome) -> None:
        """Called after every verification: roll own caches back to the accepted path, adapt, learn."""


@dataclass
class StepStats:
    drafted: int  # draft tokens proposed (tree: nodes)
    depth: int  # longest root-to-leaf chain in the proposal (= drafted for a chain)
    accepted: int  # draft tokens accepted (bonus not counted)
    draft_s: float
    verify_s: float
    trim_s: float  # cache rollback of the target (in verify_s) is O(1); this is the drafter's feedback/sync
    bonus: bool = False  # the target's token came after a fully accepted branch (no draft left), not a correction


def acceptance_rate(log: list[tuple[int, int]]) -> float | None:
    """Per-token acceptance rate alpha from (depth, accepted) per step: accepted / tested draft tokens.

    A step tests its draft tokens in order until the first rejection, so it tests accepted + 1 of
    them when one was rejected and `accepted` otherwise. This is the alpha of the speedup formula
    (each tested token accepted independently with probability alpha; the maximum-likelihood
    estimate). accepted / drafted is not: it also counts tokens after a rejection, never tested.
    """
    tested = sum(a + (a < d) for d, a in log)
    return sum(a for _, a in log) / tested if tested else None


def position_counts(log: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(reached, accepted) per draft position i = 0..depth-1: the steps that proposed position i with every
    earlier position accepted, and those that accepted it too. A rate over few events is noise: show the counts."""
    out = []
    for i in range(max((d for d, _ in log), default=0)):
        reached = [a for d, a in log if d > i and a >= i]
        out.append((len(reached), sum(a > i for a in reached)))
    return out


def position_acceptance(log: list[tuple[int, int]]) -> list[float]:
    """P(draft position i accepted | positions < i accepted and position i proposed), i = 0..depth-1."""
    return [acc / reached if reached else 0.0 for reached, acc in position_counts(log)]


@dataclass
class Stats:
    """Per-step records and the aggregates every notebook and the bench report."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    @classmethod
    def pool(cls, many: Iterable[Stats]) -> Stats:
        """One record over several generations: steps, tokens and times added, so tau, alpha and tokens/s come
        out pooled (every step and second weighs the same), not as a mean of per-answer ratios."""
        out = cls()
        for s in many:
            out.prompt_tokens += s.prompt_tokens
            out.new_tokens += s.new_tokens
            out.prefill_s += s.prefill_s
            out.total_s += s.total_s
            out.steps += s.steps
        return out

    @property
    def tau(self) -> float | None:
        """Mean tokens per target forward in the decode loop, counting the bonus/correction token."""
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps) if self.steps else None

    @property
    def alpha(self) -> float | None:
        return acceptance_rate([(s.depth, s.accepted) for s in self.steps])

    def position_acceptance(self) -> list[float]:
        return position_acceptance([(s.depth, s.accepted) for s in self.steps])

    def accepted_histogram(self) -> list[int]:
        """Counts of steps by number of accepted draft tokens (0, 1, ..., max)."""
        hist = [0] * (max((s.accepted for s in self.steps), default=0) + 1)
        for s in self.steps:
            hist[s.accepted] += 1
        return hist

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        t = lambda f: sum(getattr(s, f) for s in self.steps)  # noqa: E731
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "target_forwards": len(self.steps),
                "tau": self.tau, "alpha": self.alpha, "tokens_per_s": self.tokens_per_s, "total_s": self.total_s,
                "prefill_s": self.prefill_s, "draft_s": t("draft_s"), "verify_s": t("verify_s"), "trim_s": t("trim_s"),
                "drafted": t("drafted"), "accepted": t("accepted"),
                "position_acceptance": self.position_acceptance(), "accepted_histogram": self.accepted_histogram()}


@dataclass
class DecodeState:
    """Everything a drafter may read: the target, its cache, the tokens so far, the sampler."""
    runner: Runner
    cache: KVCache
    sampler: Sampler
    gen: torch.Generator
    tokens: list[int]  # prompt + generated so far (the last one is the pending token)
    max_new_tokens: int
    n_prompt: int
    prefill_hidden: dict = field(default_factory=dict)  # {k: (1, T, D) after k layers}; k = n_layers: final pre-norm

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def committed(self) -> int:
        """Positions every layer of the target's cache holds for sure: all tokens but the pending one."""
        return len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.n_prompt)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _depth(parents: torch.Tensor | None, n: int) -> int:
    if parents is None:
        return n
    return int(tree_depths(parents).max()) + 1 if n else 0


@torch.no_grad()
def verify_step(state: DecodeState, prop: Proposal) -> Outcome:
    """One target forward over [pending] + proposal, verification, cache rollback to the accepted path."""
    runner, cache = prop.runner or state.runner, state.cache
    if runner.model is not state.runner.model:
        raise ValueError("Proposal.runner must run the target model itself (another attention backend, say)")
    dev = state.device
    past = state.committed  # committed positions (the pending token is not in the cache yet); not
    # len(cache): a drafter may have written draft positions into every layer (Draft & Verify)
    ids = torch.tensor([[state.pending] + prop.tokens.tolist()], device=dev)  # (1, N+1)
    parents = None
    if prop.parents is not None:  # the pending token is the tree's root: shift node indices by one
        parents = torch.cat([torch.tensor([-1], device=dev), prop.parents.to(dev) + 1])
    offsets = torch.arange(ids.shape[1], device=dev) if parents is None else tree_depths(parents)
    positions = (past + offsets)[None]  # (1, N+1)
    m = 0 if prop.hidden is None else prop.hidden.shape[1]
    # invariant before the verify pass: every layer it runs holds exactly the committed positions
    # (drafters may have written draft positions); reused shallow layers keep the m drafted ones
    cache.crop(past, range(prop.split if m else 0, runner.n_layers))
    split_h = None
    feats: dict[int, torch.Tensor | None] | None = dict.fromkeys(prop.capture) if prop.capture else None
    if feats is not None and m:
        raise ValueError("Proposal.capture cannot be combined with Proposal.hidden (self-speculation)")
    if m == 0:
        h = runner.layers_forward(runner.embed(ids), cache, positions, parents=parents, capture=feats)
    else:  # self-speculation: the first m inputs already went through layers [0, split) while drafting
        cache.crop(past + m, range(0, prop.split))
        h = prop.hidden
        if m < ids.shape[1]:  # inputs the drafter never ran (the last draft token, tree siblings) go through [0, split)
            rest_mask = None
            if parents is not None:  # the first m nodes are a chain already in the shallow cache
                if not torch.equal(parents[:m].cpu(), torch.arange(-1, m - 1)):
                    raise ValueError("Proposal.hidden must cover a chain: the first nodes drafted in order")
                rest_mask = tree_mask(parents, past)[:, :, m:]  # (1, 1, N+1-m, past+N+1)
            rest = runner.layers_forward(runner.embed(ids[:, m:]), cache, positions[:, m:], 0, prop.split,
                                         mask=rest_mask)
            h = torch.cat([h, rest], 1)
        split_h = h
        h = runner.layers_forward(h, cache, positions, prop.split, parents=parents)
    logits = runner.logits(h)[0]  # (N+1, V)
    sampler = state.sampler
    if prop.accept is not None:  # the drafter's own (lossy) rule
        path, nxt = prop.accept(logits, sampler, state.gen)
    elif prop.parents is None:
        if sampler.greedy:
            n, nxt = verify_greedy_chain(prop.tokens, logits)
        else:
            n, nxt = verify_sampling_chain(prop.tokens, prop.q, sampler.probs(logits), state.gen)
        path = list(range(n))
    else:
        path, nxt = verify_tree(prop.tokens, prop.parents, logits, prop.q, sampler.greedy, state.gen,
                                probs=None if sampler.greedy else sampler.probs)  # only visited rows normalised
    if prop.parents is None:  # a chain keeps a prefix: O(1) rollback, a slice instead of a gather
        cache.crop(past + 1 + len(path))
        kept = h[:, : 1 + len(path)]
        feats = {k: f[:, : 1 + len(path)] for k, f in feats.items()} if feats else {}
    else:
        keep = torch.tensor([0] + [i + 1 for i in path], device=dev)
        cache.keep(past, keep)
        kept = h[:, keep]
        feats = {k: f[:, keep] for k, f in feats.items()} if feats else {}
    return Outcome(prop, path, nxt, logits, kept, len(cache), split_h, feats)


@torch.no_grad()
def start(runner: Runner, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler,
          gen: torch.Generator, max_draft: int | None = None) -> DecodeState:
    """Prefill the target (and the drafter) on the prompt and pick the first new token."""
    room = drafter.max_draft if max_draft is None else max_draft
    cache = runner.new_cache(len(prompt_ids) + max_new_tokens + room + 2)
    prompt = torch.tensor([prompt_ids], device=runner.device)
    pos = runner.positions(cache, prompt.shape[1])
    k = drafter.capture_layer if drafter.capture_layer is not None else runner.n_layers
    feats: dict[int, torch.Tensor | None] | None = dict.fromkeys(drafter.capture_layers) or None
    hk = runner.layers_forward(runner.embed(prompt), cache, pos, 0, k, capture=feats)
    h = runner.layers_forward(hk, cache, pos, k, capture=feats) if k < runner.n_layers else hk
    logits = runner.logits(h[:, -1:])  # only the last position's logits are needed
    state = DecodeState(runner, cache, sampler, gen, list(prompt_ids), max_new_tokens, len(prompt_ids),
                        prefill_hidden={**(feats or {}), k: hk, runner.n_layers: h})
    state.tokens.append(sampler.pick(logits[0, -1], gen))
    drafter.prefill(state, prompt)
    return state


@torch.no_grad()
def step(state: DecodeState, drafter: Drafter, eos_token_id: int | None = None) -> tuple[Outcome, StepStats]:
    """One draft -> verify -> feedback round; appends the accepted tokens + next token to state.tokens."""
    dev = state.device
    t1 = _now(dev)
    prop = drafter.propose(state)
    t2 = _now(dev)
    out = verify_step(state, prop)
    t3 = _now(dev)
    drafter.feedback(state, out)
    t4 = _now(dev)
    new = [int(prop.tokens[i]) for i in out.path] + [out.next_token]
    if eos_token_id is not None and eos_token_id in new:
        new = new[: new.index(eos_token_id) + 1]
    state.tokens += new[: state.remaining]
    return out, StepStats(len(prop), _depth(prop.parents, len(prop)), out.n_accepted, t2 - t1, t3 - t2, t4 - t3,
                          _bonus(prop, out.path))


def _bonus(prop: Proposal, path: list[int]) -> bool:
    """Whether verification accepted a whole branch: the path ends at a node with no child (a chain: all of it)."""
    if not len(prop):
        return False
    if prop.parents is None:
        return len(path) == len(prop)
    return not bool((prop.parents == (path[-1] if path else -1)).any())


def grad_free(drafter: Drafter | None = None):
    """The context a decode runs in: `torch.inference_mode()` (no autograd bookkeeping at all: 1.1 to 1.9 ms less per
    SmolLM2 decoding forward on the 2-core CPU, on every runtime: `runtimes --kernels`, results/40_kernels_*.json),
    or `torch.no_grad()` for a drafter that learns."""
    return torch.no_grad() if drafter is not None and drafter.learns else torch.inference_mode()


def decode(runner: Runner, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler,
           gen: torch.Generator, eos_token_id: int | None = None,
           max_draft: int | None = None) -> tuple[list[int], Stats]:
    """Generate up to max_new_tokens after prompt_ids with `drafter`; returns (new token ids, stats)."""
    with grad_free(drafter):
        return _decode(runner, drafter, prompt_ids, max_new_tokens, sampler, gen, eos_token_id, max_draft)


def _decode(runner: Runner, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler,
            gen: torch.Generator, eos_token_id: int | None, max_draft: int | None) -> tuple[list[int], Stats]:
    dev = runner.device
    stats = Stats(prompt_tokens=len(prompt_ids))
    t0 = _now(dev)
    state = start(runner, drafter, prompt_ids, max_new_tokens, sampler, gen, max_draft)
    stats.prefill_s = _now(dev) - t0
    while state.remaining > 0 and state.pending != eos_token_id:
        stats.steps.append(step(state, drafter, eos_token_id)[1])
    stats.total_s = _now(dev) - t0
    new_ids = state.tokens[len(prompt_ids):]
    stats.new_tokens = len(new_ids)
    return new_ids, stats
