"""Naive early-exit self-speculation: the target's first `split` layers draft, the remaining layers verify.

The draft distribution is the target's own head on the exit layer's hidden state h_s (s = split),
q = softmax(lm_head(norm(h_s))). No extra parameters: it is the baseline that Kangaroo's adapter and
DVI's trained exit head improve on. What it shares with them is the mechanics this module shows: the
shallow layers' KV cache and hidden states computed while drafting are *reused* by verification
(Proposal.hidden), so verification only runs layers [s, L) on those positions.

Drafting stops when the draft's top-1 probability falls below `threshold` (Kangaroo's second "early
exit"), or after `K` tokens. The token drafted from that low-confidence distribution is still proposed:
drafting stops *after* it, as Kangaroo's inference code, the Draft & Verify authors' decoding and DVI's
`spec_decode` all do (its logits are computed anyway; dropping it would bias tau down for nothing).
The default exit layer is `models.artifacts.default_split_for(model)`, the same for every self-speculative method.

`vocab` (models.vocab): a trimmed draft head that scores only the N most frequent tokens (q = 0 elsewhere);
verification keeps the full head, so the output is unchanged (lossless) and only the draft gets cheaper.

Tree drafts (branch > 1, beyond the Kangaroo repo): drafting still runs one chain (the top-1 tokens)
through the shallow layers, and at every step also proposes the next `branch - 1` most likely tokens
as leaf siblings of the chain token. They cost nothing to draft; verification runs them through
layers [0, s) with a tree mask (engine.verify_step) and accepts the longest matching path. Tree
candidates are deterministic (top-branch picks), so under sampling they are verified as point masses
(q = None in verify_tree), which keeps the output distribution exactly p.
"""
from __future__ import annotations

import torch

from dvi_lite.core.checks import check_int, check_prob, check_split, reject_renamed
from dvi_lite.core.engine import DecodeState, Drafter, Proposal
from dvi_lite.core.runner import Runner
from dvi_lite.models.artifacts import default_split_for
from dvi_lite.models.vocab import TrimmedHead, resolve_vocab


class EarlyExitDrafter(Drafter):
    name = "early_exit"

    def __init__(self, runner: Runner, split: int, K: int = 6, threshold: float | None = None, branch: int = 1,
                 vocab: TrimmedHead | None = None):
        self.runner = runner
        self.vocab = vocab  # None: the model's full LM head drafts
        self.split = check_split(split, runner.n_layers)
        self.K = check_int("K (draft tokens per step)", K, 1)
        self.branch = check_int("branch (candidates per draft step; 1 = a chain)", branch, 1)
        self.max_draft = self.K * self.branch  # cache room the engine reserves for one proposal
        self.threshold = None if threshold is None else check_prob("threshold (eta)", threshold)
        self._ids = None if vocab is None else vocab.ids.tolist()  # map column -> token id (greedy_pick)

    def head_scores(self, x: torch.Tensor) -> torch.Tensor:
        """The draft's projection of normalised states (..., D) -> (..., N): the trimmed head's N rows, or the
        model's LM head (N = V) without one. Column j is token `vocab.ids[j]` (token j without a map)."""
        return self.runner.lm_head(x) if self.vocab is None else self.vocab.small(x)

    def exit_scores(self, h: torch.Tensor) -> torch.Tensor:
        """Draft scores of exit-layer hidden states (1, n, D) -> (1, n, N) on the draft's map. Subclasses
        (Kangaroo, DVI) override this one method."""
        return self.head_scores(self.runner.norm(h))

    def exit_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(1, n, D) -> (1, n, V): the scores scattered into the full vocabulary, -inf off the map (q = 0 there)."""
        small = self.exit_scores(h)
        return small if self.vocab is None else self.vocab.expand(small)

    def greedy_pick(self, h: torch.Tensor) -> tuple[int, float]:
        """A greedy chain's draft token and its confidence (top-1 probability at temperature 1), read in the map's
        N columns: softmax over the map equals softmax over the expanded logits (exp(-inf) = 0), so nothing of
        size V is built per draft token."""
        s = self.exit_scores(h)[0, -1].float()  # (N,)
        j = int(s.argmax())
        conf = float(1.0 / (s - s[j]).exp().sum())  # max softmax = 1 / sum exp(s - max)
        return (j if self.vocab is None else self._ids[j]), conf

    def extra_params(self) -> int:
        """Values this drafter adds to the target: none, but a trimmed head's selected rows (subclasses add theirs)."""
        return 0 if self.vocab is None else self.vocab.numel

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        r, cache = self.runner, state.cache
        past = state.committed
        cache.crop(past, range(0, self.split))
        steps = max(1, min(self.K, state.remaining - 1))
        tree = self.branch > 1
        tok, hs, tokens, qs, leaves = state.pending, [], [], [], []
        for i in range(steps):
            pos = torch.tensor([[past + i]], device=state.device)
            h = r.layers_forward(r.embed(torch.tensor([[tok]], device=state.device)), cache, pos, 0, self.split)
            hs.append(h)
            if state.sampler.greedy and not tree:  # the argmax and its probability, in the map's space
                tok, top = self.greedy_pick(h)
                tokens.append(tok)
                if self.threshold is not None and top < self.threshold:
                    break
                continue
            logits = self.exit_logits(h)[0, -1]  # (V,)
            q = state.sampler.probs(logits)  # the law drafts are sampled from (one-hot when greedy)
            conf = state.sampler.confidence(logits)  # what the exit rule and the tree read (never one-hot)
            if tree:  # top-1 continues the chain, the next branch-1 become leaves under the same parent
                top = torch.topk(conf, min(self.branch, int((conf > 0).sum()))).indices.tolist()
                tok = top[0]
                leaves += [(t, i - 1) for t in top[1:]]
            else:
                tok = int(q.argmax()) if state.sampler.greedy else int(torch.multinomial(q, 1, generator=state.gen))
            tokens.append(tok)
            qs.append(q)
            if self.threshold is not None and float(conf.max()) < self.threshold:
                break  # not confident: this token is proposed, the next is not drafted
        # shallow states of [pending, d1, ..., d_{n-1}]: the last draft d_n is never fed (verification runs it)
        hidden = torch.cat(hs, 1)
        dev = state.device
        if not tree:
            return Proposal(torch.tensor(tokens, device=dev), None if state.sampler.greedy else torch.stack(qs),
                            hidden=hidden, split=self.split)
        n = len(tokens)  # chain d1..dn first (node i's parent is i-1), then the leaves
        parents = list(range(-1, n - 1)) + [p for _, p in leaves]
        return Proposal(torch.tensor(tokens + [t for t, _ in leaves], device=dev), None,
                        torch.tensor(parents, device=dev), hidden=hidden, split=self.split)


def make_drafter(model, tokenizer, split: int | None = None, K: int = 6, threshold: float | None = None,
                 branch: int = 1, vocab=None, **old) -> EarlyExitDrafter:
    """Self-speculation with the target's own first `split` layers (None: default_split) and its own head
    (vocab: a trimmed head, models.vocab.resolve_vocab)."""
    reject_renamed(old, "early_exit.make_drafter")
    r = Runner.for_model(model)
    return EarlyExitDrafter(r, default_split_for(model) if split is None else split, K, threshold, branch,
                            resolve_vocab(model, tokenizer, vocab))
