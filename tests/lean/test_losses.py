import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import losses
from treepack.losses import MODES, Denominators

from tolerance import FLOAT64_OP, assert_within, within

# float64 losses over at most 35 tokens, against plain-Python references: FLOAT64_OP, relative
# to the value and, where terms of size 1 (ratios near 1 times unit advantages) cancel, to 1.

# ---------------------------------------------------------------------- naive references
# One sequence at a time, one token at a time, in plain Python floats: nothing vectorised,
# nothing shared with treepack.losses.


def naive_aggregate(values, mask, mode, norm_length=None, tokens=None, sequences=None):
    rows = [[(v, m) for v, m in zip(vr, mr)] for vr, mr in zip(values, mask)]
    n_tok = sum(m for r in rows for _, m in r) if tokens is None else tokens
    live = [r for r in rows if any(m for _, m in r)]
    n_seq = len(live) if sequences is None else sequences
    if mode == "token-mean":
        return sum(v for r in rows for v, m in r if m) / max(n_tok, 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(v for v, m in r if m) for r in live) / max(n_seq, 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(v for v, m in r if m) / sum(m for _, m in r) for r in live) / max(n_seq, 1)
    return sum(v for r in rows for v, m in r if m) / norm_length


def naive_ppo_token(logp, old, adv, eps_low, eps_high, dual):
    r = math.exp(logp - old)
    loss = max(-adv * r, -adv * min(max(r, 1 - eps_low), 1 + eps_high))
    if dual is not None and adv < 0:
        loss = min(loss, -adv * dual)
    return loss


def random_layout(seed, n=5, L=7, p_mask=0.7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, L, generator=g) < p_mask
    mask[0] = False  # a sequence with nothing supervised
    logps = (-torch.rand(n, L, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(n, L, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, L, generator=g, dtype=torch.float64)
    return logps, old, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_equals_naive(mode):
    values, _, _, mask = random_layout(0)
    got = losses.aggregate(values, mask, mode, norm_length=11.0)
    expect = naive_aggregate(values.tolist(), mask.tolist(), mode, 11.0)
    assert got.item() == pytest.approx(expect, rel=FLOAT64_OP, abs=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(MODES), st.sampled_from([(0.2, None), (0.2, 0.28)]),
       st.sampled_from([None, 3.0]), st.booleans())
def test_policy_loss_token_ratio_equals_naive(seed, mode, clips, dual, per_sequence_adv):
    logps, old, adv, mask = random_layout(seed)
    if per_sequence_adv:
        adv = adv[:, 0]
    eps_low, eps_high = clips
    out = losses.policy_loss(logps, old, adv, mask, clip=eps_low, clip_high=eps_high,
                             dual_clip=dual, mode=mode, norm_length=9.0)
    adv_tok = adv[:, None].expand_as(logps) if per_sequence_adv else adv
    per_token = [[naive_ppo_token(lp, o, a, eps_low, eps_high or eps_low, dual)
                  for lp, o, a in zip(*rows)]
                 for rows in zip(logps.tolist(), old.tolist(), adv_tok.tolist())]
    expect = naive_aggregate(per_token, mask.tolist(), mode, 9.0)
    assert out.loss.item() == pytest.approx(expect, rel=FLOAT64_OP, abs=FLOAT64_OP)
    # gradients by central differences of the naive loss: h^2 / 6 x its third derivative (at
    # most one token's |advantage| x ratio) and its float64 rounding (FLOAT64_OP of terms of
    # size 1) over h
    (grad,) = torch.autograd.grad(out.loss, logps)
    h = 1e-6
    third = float((adv_tok.abs() * (logps.detach() - old).exp()).max())
    allowed = h * h / 6 * third + FLOAT64_OP / h

    def naive_loss(s, p, bump):
        bumped = [row[:] for row in logps.tolist()]
        bumped[s][p] += bump
        return naive_aggregate([[naive_ppo_token(lp, o, a, eps_low, eps_high or eps_low, dual)
                                 for lp, o, a in zip(*rows)]
                                for rows in zip(bumped, old.tolist(), adv_tok.tolist())],
                               mask.tolist(), mode, 9.0)

    for s, p in [(1, 1), (2, 3), (4, 6), (3, 0)]:
        slope = (naive_loss(s, p, h) - naive_loss(s, p, -h)) / (2 * h)
        assert within(abs(grad[s, p].item() - slope), allowed), (s, p)


def test_gspo_sequence_ratio():
    logps, old, adv, mask = random_layout(3)
    seq_adv = adv[:, 0]
    out = losses.policy_loss(logps, old, seq_adv, mask, ratio="sequence",
                             mode="seq-mean-token-mean", clip=0.1)
    # GSPO: s_i = exp(mean over i's masked tokens of (logp - old)), the same on every token
    expect, live = 0.0, 0
    for s in range(logps.shape[0]):
        toks = [p for p in range(logps.shape[1]) if mask[s, p]]
        if not toks:
            continue
        live += 1
        r = math.exp(sum(logps[s, p].item() - old[s, p].item() for p in toks) / len(toks))
        a = seq_adv[s].item()
        expect += max(-a * r, -a * min(max(r, 0.9), 1.1))
        for p in toks:
            assert out.ratio[s, p].item() == pytest.approx(r, rel=FLOAT64_OP, abs=0)
    assert out.loss.item() == pytest.approx(expect / live, rel=FLOAT64_OP, abs=FLOAT64_OP)
    # The gradient flows through every token: d s_i / d logp_t = s_i / n_i, times the
    # derivative of the sequence's term in s_i: -a where the unclipped branch is the max or
    # the ratio is inside the clip range, 0 where a clipped constant is the max.
    (grad,) = torch.autograd.grad(out.loss, logps)
    expect_grad = torch.zeros_like(grad)
    branches = set()
    for s in range(logps.shape[0]):
        toks = mask[s].nonzero()[:, 0]
        if not len(toks):
            continue
        r, a = out.ratio[s, toks[0]].item(), seq_adv[s].item()
        inside = 0.9 < r < 1.1
        unclipped_wins = -a * r >= -a * min(max(r, 0.9), 1.1)
        branches.add((inside, unclipped_wins))
        d_loss_d_r = -a if (inside or unclipped_wins) else 0.0
        expect_grad[s, toks] = d_loss_d_r * r / len(toks) / live
    assert_within(grad, expect_grad, FLOAT64_OP)
    assert len(branches) > 1  # the seed reaches more than one branch of the clip


def test_policy_loss_statistics():
    logps = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.05]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = losses.policy_loss(logps, old, adv, mask, clip=0.2, dual_clip=3.0)
    # ratios 1, 2, 1, 10: token 1 is clipped (A > 0, r > 1.2), token 3 hits the dual clip
    assert out.ratio[0].tolist() == pytest.approx([1.0, 2.0, 1.0, 10.0], rel=FLOAT64_OP, abs=0)
    assert out.clip_fraction.item() == 0.25 and out.dual_clip_fraction.item() == 0.25
    assert out.loss.item() == pytest.approx((-1.0 - 1.2 + 1.0 + 3.0) / 4, rel=FLOAT64_OP, abs=0)


def test_sft_loss_weights_and_modes():
    logps, _, _, mask = random_layout(1)
    w = torch.rand(logps.shape[0], dtype=torch.float64)
    for mode in MODES:
        got = losses.sft_loss(logps, mask, weights=w, mode=mode, norm_length=5.0)
        expect = naive_aggregate((-logps * w[:, None]).tolist(), mask.tolist(), mode, 5.0)
        assert got.item() == pytest.approx(expect, rel=FLOAT64_OP, abs=0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_estimators(kind):
    logps, ref, _, _ = random_layout(2)
    got = losses.kl_penalty(logps, ref, kind)
    for lp, rf, g in zip(logps.flatten().tolist(), ref.flatten().tolist(), got.flatten()):
        d = lp - rf
        expect = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[kind]
        # k3 = exp(-d) + d - 1 cancels terms of size 1: FLOAT64_OP of 1 as well
        assert g.item() == pytest.approx(expect, rel=FLOAT64_OP, abs=FLOAT64_OP)
    if kind == "k3":
        assert (got >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    # E_{x ~ p}[k3] = KL(p || q) for a categorical p, q
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    k3 = losses.kl_penalty(p.log()[None], q.log()[None], "k3")[0]
    assert (p * k3).sum().item() == pytest.approx((p * (p / q).log()).sum().item(),
                                                  rel=FLOAT64_OP, abs=FLOAT64_OP)


def test_entropy_bonus_is_the_aggregated_entropy():
    ent, _, _, mask = random_layout(4)
    assert losses.entropy_bonus(ent.abs(), mask).item() == pytest.approx(
        naive_aggregate(ent.abs().tolist(), mask.tolist(), "token-mean"), rel=FLOAT64_OP,
        abs=0)


def test_global_denominators_make_packs_add_up():
    logps, old, adv, mask = random_layout(5, n=9)
    parts = [slice(0, 3), slice(3, 7), slice(7, 9)]
    den = losses.global_denominators([mask[p] for p in parts])
    assert den == Denominators(tokens=float(mask.sum()), sequences=float(mask.any(-1).sum()))
    for mode in MODES:
        whole = losses.policy_loss(logps, old, adv, mask, mode=mode, norm_length=7.0).loss
        split = sum(losses.policy_loss(logps[p], old[p], adv[p], mask[p], mode=mode,
                                       denominators=den, norm_length=7.0).loss for p in parts)
        assert split.item() == pytest.approx(whole.item(), rel=FLOAT64_OP, abs=FLOAT64_OP)


def test_world_size_undoes_gradient_averaging():
    logps, _, _, mask = random_layout(6)
    den = Denominators.of(mask)
    single = losses.sft_loss(logps, mask, denominators=den)
    two_ranks = losses.sft_loss(logps, mask, denominators=den._replace(world_size=2))
    assert two_ranks.item() == pytest.approx(2 * single.item(), rel=FLOAT64_OP, abs=0)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda x, m: losses.aggregate(x, m, "mean"), "choose one of"),
        (lambda x, m: losses.aggregate(x, m, "seq-mean-token-sum-norm"), "norm_length"),
        (lambda x, m: losses.aggregate(x[:, :3], m), "shape"),
        (lambda x, m: losses.aggregate(x, m.float()), "bool"),
        (lambda x, m: losses.policy_loss(x, x, x[:, :2], m), "advantages"),
        (lambda x, m: losses.policy_loss(x, x, x, m, ratio="seq"), "sequence"),
        (lambda x, m: losses.policy_loss(x, x, x, m, dual_clip=0.5), "dual_clip"),
        (lambda x, m: losses.kl_penalty(x, x, "k4"), "k1"),
        (lambda x, m: losses.global_denominators([]), "masks"),
    ],
)
def test_bad_arguments_say_what_to_do(call, words):
    x, _, _, m = random_layout(0)
    with pytest.raises((ValueError, TypeError), match=words):
        call(x, m)


def test_losses_refuse_nonsense_constants():
    import re

    logps = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for norm_length in (0, -4, float("inf")):
        with pytest.raises(ValueError, match=re.escape(f"norm_length={norm_length!r} must be")):
            losses.aggregate(logps, mask, "seq-mean-token-sum-norm", norm_length=norm_length)
    for kwargs in ({"clip": -0.2}, {"clip_high": -0.1}, {"clip": float("nan")}):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            losses.policy_loss(logps, logps, torch.ones(2), mask, **kwargs)
