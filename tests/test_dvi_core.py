"""DVI's losses, config, replay buffer and RNG state against hand-computed numbers: logits are logs of chosen
probabilities, so every expected value below is a few math.log / math.exp calls on those probabilities, never
the function under test."""
from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch

from dvi_lite.methods.dvi.buffer import ReplayBuffer, rng_state, set_rng_state
from dvi_lite.methods.dvi.config import DVIConfig
from dvi_lite.methods.dvi.losses import (
    EMABaseline,
    ce_anchor,
    fast_loss,
    kl_loss,
    lambda_curve,
    lambda_schedule,
    reinforce_loss,
    slow_loss,
    surrogate_loss,
)

E = math.e


def logits_of(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given probabilities (rows sum to 1)."""
    return torch.tensor([[math.log(p) for p in row] for row in rows], dtype=torch.float32)


def kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


# ---------------------------------------------------------------------------------------------- lambda


def test_lambda_schedule_points():
    assert lambda_schedule(0, 200.0, 0.05) == 1.0
    assert lambda_schedule(200, 200.0, 0.05) == pytest.approx(1 / E)
    assert lambda_schedule(100, 200.0, 0.05) == pytest.approx(math.exp(-0.5))
    assert lambda_schedule(10_000, 200.0, 0.05) == 0.05  # e^-50 << floor
    assert lambda_schedule(1000, 200.0, 0.0) == pytest.approx(math.exp(-5))  # no floor: pure exponential
    assert lambda_schedule(10, 1.0, 1.0) == 1.0  # floor 1: KL only, forever


def test_lambda_curve():
    c = lambda_curve(50, 10.0, 0.1)
    assert len(c) == 50 and c[0] == 1.0 and c[10] == pytest.approx(1 / E)
    assert all(a >= b for a, b in zip(c, c[1:], strict=False)) and min(c) == 0.1  # non-increasing, floored
    assert lambda_curve([0, 5, 1000], 5.0, 0.0) == pytest.approx([1.0, 1 / E, math.exp(-200)])
    assert lambda_curve(0, 5.0, 0.0) == []


@pytest.mark.parametrize("t,t_lambda,floor,name", [(0, 0.0, 0.05, "t_lambda"), (0, -1.0, 0.05, "t_lambda"),
                                              (0, 1.0, -0.1, "kl_floor"), (0, 1.0, 1.5, "kl_floor"),
                                              (-1, 1.0, 0.05, "t")])
def test_lambda_schedule_rejects(t, t_lambda, floor, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        lambda_schedule(t, t_lambda, floor)


# ---------------------------------------------------------------------------------------------- KL


def test_kl_zero_when_equal():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 3.0]])
    assert kl_loss(x, x.clone()).item() == pytest.approx(0.0, abs=1e-7)


def test_kl_two_class_hand_computed():
    p1, q1, p2, q2 = [0.25, 0.75], [0.5, 0.5], [0.5, 0.5], [0.2, 0.8]
    t, s = logits_of(p1, p2), logits_of(q1, q2)
    want = (0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
            + 0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)) / 2
    assert kl_loss(t, s).item() == pytest.approx(want, rel=1e-6)
    # forward direction: KL(p||q) != KL(q||p) here
    assert kl_loss(s, t).item() != pytest.approx(want, rel=1e-3)
    # temperature softens the teacher only: logits [0, 2 ln 3] at T=2 are p = [1/4, 3/4]
    t2 = torch.tensor([[0.0, 2 * math.log(3)]])
    assert kl_loss(t2, logits_of(q1), temperature=2.0).item() == pytest.approx(kl(p1, q1), rel=1e-6)


def test_kl_gradient_only_to_student():
    t = logits_of([0.25, 0.75]).requires_grad_(True)
    s = logits_of([0.5, 0.5]).requires_grad_(True)
    kl_loss(t, s).backward()
    assert t.grad is None
    # d KL(p||softmax(s)) / ds = q - p
    assert s.grad.tolist()[0] == pytest.approx([0.5 - 0.25, 0.5 - 0.75], abs=1e-6)


def test_kl_masked_teacher_logits_are_finite():
    t = torch.tensor([[0.0, float("-inf"), 0.0]])  # p = [.5, 0, .5]
    s = logits_of([0.25, 0.25, 0.5])
    assert kl_loss(t, s).item() == pytest.approx(kl([0.5, 0, 0.5], [0.25, 0.25, 0.5]), rel=1e-6)


# ---------------------------------------------------------------------------------------------- policy terms


def test_reinforce_hand_computed():
    s = logits_of([0.2, 0.3, 0.5], [0.6, 0.3, 0.1])
    tokens, rewards, b = torch.tensor([2, 0]), torch.tensor([1.0, 0.0]), 0.25
    want = -((1 - 0.25) * math.log(0.5) + (0 - 0.25) * math.log(0.6)) / 2
    assert reinforce_loss(s, tokens, rewards, b).item() == pytest.approx(want, rel=1e-6)
    assert reinforce_loss(s, tokens, rewards, torch.tensor(0.25)).item() == pytest.approx(want, rel=1e-6)
    # b = r everywhere: no advantage, no loss
    assert reinforce_loss(s, tokens, torch.tensor([1.0, 1.0]), 1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_accepted_only_policy_term_is_the_reference_default():
    """The reference trainer's default: the accepted drafts' -(r - b) log pi only; a rejected draft adds nothing."""
    from dvi_lite.methods.dvi.losses import accepted_reinforce_loss

    s = logits_of([0.2, 0.3, 0.5], [0.6, 0.3, 0.1])
    tokens, rewards, b = torch.tensor([2, 0]), torch.tensor([1.0, 0.0]), 0.25
    want = -(1 - 0.25) * math.log(0.5)  # the accepted row alone, averaged over the one accepted draft
    assert accepted_reinforce_loss(s, tokens, rewards, b).item() == pytest.approx(want, rel=1e-6)
    g = s.clone().requires_grad_(True)
    accepted_reinforce_loss(g, tokens, torch.zeros(2), b).backward()  # nothing accepted: zero loss, zero gradient
    assert float(g.grad.abs().sum()) == 0.0


def test_reinforce_gradient_sign():
    s = logits_of([0.2, 0.3, 0.5], [0.6, 0.3, 0.1]).requires_grad_(True)
    tokens, rewards, b = torch.tensor([2, 0]), torch.tensor([1.0, 0.0]), 0.25
    reinforce_loss(s, tokens, rewards, b).backward()
    g = s.grad
    # accepted with r > b: dL/dz_t = -(r-b)(1-pi_t)/B < 0, so descent raises its logit
    assert g[0, 2].item() == pytest.approx(-(0.75) * (1 - 0.5) / 2, rel=1e-5) and g[0, 2] < 0
    # rejected with r < b: pushed down
    assert g[1, 0].item() == pytest.approx(0.25 * (1 - 0.6) / 2, rel=1e-5) and g[1, 0] > 0
    # one SGD step raises log pi(accepted token)
    with torch.no_grad():
        before = s[0].log_softmax(-1)[2].item()
        after = (s - 0.5 * g)[0].log_softmax(-1)[2].item()
    assert after > before


def test_surrogate_and_ce_anchor_hand_computed():
    s = logits_of([0.2, 0.3, 0.5], [0.6, 0.3, 0.1])
    top1 = torch.tensor([1, 0])
    want = -(math.log(0.3) + math.log(0.6)) / 2
    assert surrogate_loss(s, top1).item() == pytest.approx(want, rel=1e-6)
    assert ce_anchor(s, top1).item() == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------------------------- fast / slow


Q = [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]  # student (draft) probabilities
P = [[0.1, 0.2, 0.7], [0.5, 0.4, 0.1]]  # teacher (verifier) probabilities: top-1 = [2, 0]


def _batch():
    return {"student_logits": logits_of(*Q), "teacher_logits": logits_of(*P),
            "tokens": torch.tensor([2, 1]), "rewards": torch.tensor([1.0, 0.0])}


L_KL = (kl(P[0], Q[0]) + kl(P[1], Q[1])) / 2
L_CE = -(math.log(0.5) + math.log(0.6)) / 2  # -log q(top1 of p)
L_REINFORCE = -((1 - 0.5) * math.log(0.5) + (0 - 0.5) * math.log(0.3)) / 2  # b = 0.5


def test_fast_loss_step0_is_kl_plus_anchor():
    cfg = DVIConfig(t_lambda=10.0, kl_floor=0.05, ce_weight=0.2, rl_variant="reinforce")
    loss, parts = fast_loss(_batch(), cfg, step=0, baseline=0.5)
    assert parts["lambda"] == 1.0 and parts["ce_weight"] == pytest.approx(0.2)
    assert parts["l_kl"] == pytest.approx(L_KL, rel=1e-5)
    assert parts["l_ce"] == pytest.approx(L_CE, rel=1e-5)
    assert parts["l_rl"] == pytest.approx(L_REINFORCE, rel=1e-5)
    assert loss.item() == pytest.approx(L_KL + 0.2 * L_CE, rel=1e-5)  # (1 - lambda) = 0: no RL yet
    assert parts["total"] == pytest.approx(loss.item())
    assert set(parts) >= {"lambda", "l_rl", "l_kl", "l_ce", "total"}


def test_fast_loss_later_step_reinforce():
    cfg = DVIConfig(t_lambda=10.0, kl_floor=0.05, ce_weight=0.2, ce_decay=0.9, rl_variant="reinforce")
    batch = _batch()
    batch["student_logits"].requires_grad_(True)
    loss, parts = fast_loss(batch, cfg, step=5, baseline=EMABaseline(value=0.5))
    lam, cw = math.exp(-0.5), 0.2 * 0.9 ** 5
    assert parts["lambda"] == pytest.approx(lam) and parts["ce_weight"] == pytest.approx(cw)
    assert parts["baseline"] == 0.5
    assert loss.item() == pytest.approx((1 - lam) * L_REINFORCE + lam * L_KL + cw * L_CE, rel=1e-5)
    loss.backward()
    assert batch["student_logits"].grad is not None and batch["teacher_logits"].grad is None


def test_fast_loss_surrogate_and_floor():
    cfg = DVIConfig(t_lambda=10.0, kl_floor=0.05, ce_weight=0.2, rl_variant="surrogate")
    loss, parts = fast_loss(_batch(), cfg, step=1000)  # e^-100: lambda sits on the floor
    assert parts["lambda"] == 0.05
    assert parts["l_rl"] == pytest.approx(L_CE, rel=1e-5)  # surrogate = -log q(top1 of p)
    assert loss.item() == pytest.approx(0.95 * L_CE + 0.05 * L_KL + 0.2 * L_CE, rel=1e-5)


def _grad(cfg: DVIConfig, rewards: list[float], step: int = 5) -> torch.Tensor:
    batch = {**_batch(), "rewards": torch.tensor(rewards)}
    batch["student_logits"].requires_grad_(True)
    fast_loss(batch, cfg, step=step, baseline=0.5)[0].backward()
    return batch["student_logits"].grad


def test_default_objective_reads_the_rewards_surrogate_does_not():
    """The default (the paper's objective): KL warm-up, then a reward-driven policy-gradient term. After the
    warm-up (lambda < 1) flipping the accept bits changes the gradient; the surrogate never reads them."""
    cfg = DVIConfig(t_lambda=10.0, kl_floor=0.05, ce_weight=0.2)  # the default variant
    assert cfg.rl_variant == "reinforce"
    g, flipped = _grad(cfg, [1.0, 0.0]), _grad(cfg, [0.0, 1.0])
    assert not torch.allclose(g, flipped)
    # by hand: only the RL term differs, -(1 - lambda) (r - b) d log q(token) / d logits, mean over 2 rows
    lam = math.exp(-0.5)
    onehot = torch.nn.functional.one_hot(torch.tensor([2, 1]), 3).float()
    dlogq = onehot - torch.tensor(Q)  # d log softmax(s)[token] / d s
    adv = torch.tensor([1.0, -1.0])[:, None]  # (r - b) - (r' - b) for r = [1, 0], r' = [0, 1]
    torch.testing.assert_close(g - flipped, -(1 - lam) * adv * dlogq / 2, atol=1e-6, rtol=1e-5)
    assert torch.equal(_grad(cfg, [1.0, 0.0], step=0), _grad(cfg, [0.0, 1.0], step=0))  # warm-up: lambda = 1
    sur = DVIConfig(t_lambda=10.0, kl_floor=0.05, ce_weight=0.2, rl_variant="surrogate")
    assert torch.equal(_grad(sur, [1.0, 0.0]), _grad(sur, [0.0, 1.0]))


def test_fast_loss_shape_mismatch():
    b = _batch()
    b["teacher_logits"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="shape"):
        fast_loss(b, DVIConfig(), 0)


def test_slow_loss_hand_computed():
    new, old = [[0.2, 0.3, 0.5], [0.5, 0.25, 0.25]], [[0.25, 0.25, 0.5], [0.5, 0.5 - 1e-9, 1e-9]]
    logits = logits_of(*new).requires_grad_(True)
    old_logits = logits_of(*old).requires_grad_(True)
    targets = torch.tensor([1, 0])
    ce = -(math.log(0.3) + math.log(0.5)) / 2
    rev_kl = (kl(new[0], old[0]) + kl(new[1], old[1])) / 2  # KL(pi_new || pi_old)
    loss = slow_loss(logits, old_logits, targets, beta_kl=0.1)
    assert loss.item() == pytest.approx(ce + 0.1 * rev_kl, rel=1e-4)
    assert slow_loss(logits, old_logits, targets, 0.0).item() == pytest.approx(ce, rel=1e-6)
    loss.backward()
    assert old_logits.grad is None and logits.grad is not None
    # KL term vanishes when new == old: pure CE
    same = slow_loss(logits_of(*new), logits_of(*new), targets, beta_kl=5.0)
    assert same.item() == pytest.approx(ce, rel=1e-6)


# ---------------------------------------------------------------------------------------------- baseline


def test_ema_baseline_updates_and_round_trip():
    b = EMABaseline(beta=0.9)
    assert b.value == 0.0
    assert b.update(torch.tensor([1.0, 0.0, 1.0, 1.0])) == pytest.approx(0.1 * 0.75)
    assert b.update(torch.tensor([0.0, 0.0])) == pytest.approx(0.9 * 0.075)
    assert b.update(torch.tensor([])) == pytest.approx(0.0675)  # empty batch: unchanged
    assert b.update(torch.tensor([1.0])) == pytest.approx(0.9 * 0.0675 + 0.1)
    assert b.n_updates == 3
    c = EMABaseline(beta=0.5)
    c.load_state_dict(b.state_dict())
    assert c.state_dict() == b.state_dict()
    assert c.update(torch.tensor([1.0, 0.0])) == b.update(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="^beta"):
        EMABaseline(beta=1.0)


# ---------------------------------------------------------------------------------------------- replay buffer

D, V = 4, 6


def _exp(tokens: list[int], rewards: list[int] | None = None):
    """n experiences whose h and logits encode the token, so slots are easy to check."""
    t = torch.tensor(tokens)
    r = torch.tensor(rewards if rewards is not None else [1] * len(tokens), dtype=torch.float32)
    return t.float()[:, None].expand(-1, D).clone(), t, r, t.float()[:, None] * torch.ones(len(tokens), V)


def test_buffer_wraps_around():
    buf = ReplayBuffer(5)
    buf.add(*_exp([0, 1, 2]))
    assert len(buf) == 3 and buf.next == 3
    buf.add(*_exp([3, 4, 5, 6]))
    assert len(buf) == 5 and buf.next == 2 and buf.n_seen == 7
    assert buf.tokens.tolist() == [5, 6, 2, 3, 4]  # 0 and 1, the oldest, were overwritten
    assert buf.h[:, 0].tolist() == [5.0, 6.0, 2.0, 3.0, 4.0]
    assert buf.teacher_logits[:, -1].tolist() == [5.0, 6.0, 2.0, 3.0, 4.0]


def test_buffer_bulk_add_larger_than_capacity_matches_one_by_one():
    bulk, single = ReplayBuffer(3), ReplayBuffer(3)
    bulk.add(*_exp(list(range(7))))
    for i in range(7):
        single.add(*_exp([i]))
    assert bulk.tokens.tolist() == single.tokens.tolist() == [6, 4, 5]
    assert bulk.next == single.next == 1 and len(bulk) == 3 and bulk.n_seen == 7


def test_buffer_add_rejects_bad_input():
    buf = ReplayBuffer(4)
    h, t, r, lg = _exp([1, 2])
    with pytest.raises(ValueError, match="disagree"):
        buf.add(h, t[:1], r, lg)
    with pytest.raises(ValueError, match="rewards"):
        buf.add(h, t, torch.tensor([0.5, 1.0]), lg)
    buf.add(h, t, r, lg)
    with pytest.raises(ValueError, match="V="):
        buf.add(h, t, r, torch.zeros(2, V + 1))
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(2).sample(1)


def test_buffer_sample_shapes_and_determinism():
    buf = ReplayBuffer(16)
    buf.add(*_exp(list(range(10))))
    s = buf.sample(4, torch.Generator().manual_seed(0))
    assert s["h"].shape == (4, D) and s["tokens"].shape == (4,) and s["rewards"].shape == (4,)
    assert s["teacher_logits"].shape == (4, V) and s["teacher_logits"].dtype == torch.float32
    assert s["backoff"] is False and len(set(s["index"].tolist())) == 4  # without replacement
    assert torch.equal(s["h"][:, 0].long(), s["tokens"])  # rows stay aligned
    s2 = buf.sample(4, torch.Generator().manual_seed(0))
    assert all(torch.equal(s[k], s2[k]) for k in ("h", "tokens", "rewards", "teacher_logits"))
    others = [buf.sample(4, torch.Generator().manual_seed(k))["tokens"].tolist() for k in range(1, 6)]
    assert any(o != s["tokens"].tolist() for o in others)
    assert len(buf.sample(50)["tokens"]) == 10  # more than stored: every experience once


def test_buffer_accepted_only_and_backoff():
    buf = ReplayBuffer(16)
    buf.add(*_exp(list(range(10)), rewards=[1, 0, 1, 1, 0, 1, 0, 1, 1, 0]))  # 6 accepted
    g = torch.Generator().manual_seed(0)
    s = buf.sample(4, g, accepted_only=True)
    assert s["backoff"] is False and s["rewards"].tolist() == [1.0] * 4
    s = buf.sample(8, g, accepted_only=True)  # 6 < 8 accepted: back off to the whole buffer
    assert s["backoff"] is True and len(s["tokens"]) == 8 and 0.0 in s["rewards"].tolist()
    s = buf.sample(8, g, accepted_only=True, min_accepted=2)  # lower threshold: the 6 accepted only
    assert s["backoff"] is False and sorted(s["tokens"].tolist()) == [0, 2, 3, 5, 7, 8]
    none = ReplayBuffer(4)
    none.add(*_exp([0, 1], rewards=[0, 0]))
    s = none.sample(2, g, accepted_only=True, min_accepted=1)  # nothing accepted: always back off
    assert s["backoff"] is True and len(s["tokens"]) == 2


def test_buffer_state_dict_round_trip():
    buf = ReplayBuffer(5, logits_dtype=torch.float16)
    buf.add(*_exp([0, 1, 2, 3]))
    buf.add(*_exp([4, 5, 6], rewards=[0, 1, 0]))  # wrapped: next = 2
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    loaded = ReplayBuffer.from_state_dict(torch.load(f, weights_only=True))
    a, b = buf.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    for k in range(3):
        x, y = (r.sample(3, torch.Generator().manual_seed(k), accepted_only=True) for r in (buf, loaded))
        assert torch.equal(x["index"], y["index"]) and torch.equal(x["teacher_logits"], y["teacher_logits"])
    buf.add(*_exp([7]))
    loaded.add(*_exp([7]))  # a resumed buffer keeps writing into the same slot
    assert buf.tokens.tolist() == loaded.tokens.tolist() == [5, 6, 7, 3, 4]
    empty = ReplayBuffer.from_state_dict(ReplayBuffer(3).state_dict())
    assert len(empty) == 0 and empty.h is None and empty.capacity == 3


# ---------------------------------------------------------------------------------------------- RNG


def test_rng_state_round_trip():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    st = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 100, (2,)))
    set_rng_state(st)
    again = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 100, (2,)))
    assert first[0] == again[0] and first[1] == again[1]
    assert torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_valid():
    cfg = DVIConfig()
    assert cfg.validate(n_layers=4) is cfg
    assert cfg.rl_variant == "reinforce" and cfg.teacher_temperature == 1.0 and cfg.kl_floor == 0.05
    assert DVIConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize("name,value", [
    ("t_lambda", 0.0), ("t_lambda", -5.0), ("kl_floor", -0.1), ("kl_floor", 1.5), ("lora_rank", 0),
    ("split", 0), ("rl_variant", "ppo"), ("teacher_temperature", 0.0), ("lr", 0.0), ("slow_lr", -1e-4),
    ("fast_every", 0), ("batch_size", 0), ("buffer_size", 0), ("slow_every", 0), ("ce_weight", -0.1),
    ("ce_decay", 0.0), ("ce_decay", 1.1), ("baseline_beta", 1.0), ("beta_kl", -1.0), ("lora_rank", 2.5),
    ("t_lambda", float("nan")), ("backoff_min", 0),
])
def test_config_rejects(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be") as e:
        DVIConfig(**{name: value})
    assert repr(value) in str(e.value)


def test_config_batch_larger_than_buffer():
    with pytest.raises(ValueError, match="^batch_size"):
        DVIConfig(batch_size=64, buffer_size=32)


def test_config_split_against_n_layers():
    DVIConfig(split=3).validate(n_layers=4)
    for n_layers in (3, 2):  # split == n_layers and split > n_layers
        with pytest.raises(ValueError, match=r"^split .*0 < split < " + str(n_layers)):
            DVIConfig(split=3).validate(n_layers=n_layers)
