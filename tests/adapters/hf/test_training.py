"""Losses through a real model: packed vs every sequence alone, values and gradients."""

import pytest
import torch

pytest.importorskip("transformers")

from treepack import TreePack, hf, losses, zoo  # noqa: E402
from treepack.losses import MODES  # noqa: E402
from treepack.verification import verification_batch  # noqa: E402

from tolerance import FLOAT32_RELATIVE, assert_within, inside  # noqa: E402

SEQS = verification_batch(zoo.VOCAB)
N, L = len(SEQS), max(len(s) for s in SEQS)
NORM = 64.0  # the constant of seq-mean-token-sum-norm
# A float64 Qwen2 whose norms compute in float32: its log-probs and losses are float32-accurate
# (tolerance.inside: FLOAT32_INSIDE) and its gradients too (the backward of the norms' casts
# rounds them; see test_hf), each relative to its tensor's largest
GRAD_TOL = FLOAT32_RELATIVE


def alone(model, seqs):
    """(logps, entropy) [N, L] label-aligned, every sequence run alone."""
    logps = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.float64)
    ent = torch.zeros_like(logps)
    for s, seq in enumerate(seqs):
        logits = model(input_ids=seq[None], use_cache=False).logits[0]
        logp = logits.log_softmax(-1)
        logps = logps.index_put((torch.tensor([s]), torch.arange(1, len(seq))),
                                logp[:-1].gather(-1, seq[1:, None])[:, 0])
        ent = ent.index_put((torch.tensor([s]), torch.arange(1, len(seq))),
                            -(logp.exp() * logp).sum(-1)[:-1])
    return logps, ent


def packed(model, pack):
    logits = hf.forward(model, pack).logits[0]
    return pack.token_logprobs(logits), pack.token_entropy(logits)


def step_inputs(seed=0):
    """Per-occurrence data that differs between sequences sharing rows."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(N, L, dtype=torch.bool)
    for s, seq in enumerate(SEQS):
        mask[s, min(6, len(seq) - 1):len(seq)] = True  # the "response": past a 6-token prompt
    mask[:, 0] = False
    return dict(
        mask=mask,
        old=torch.randn(N, L, generator=g, dtype=torch.float64) * 0.2,  # added to logps below
        ref=torch.randn(N, L, generator=g, dtype=torch.float64) * 0.2,
        adv=torch.randn(N, L, generator=g, dtype=torch.float64),
        seq_adv=torch.randn(N, generator=g, dtype=torch.float64),
        weights=torch.rand(N, generator=g, dtype=torch.float64),
    )


def loss_fn(name, mode, logps, ent, x, base, den=None, rows=slice(None)):
    """``base``: the unpacked run's log-probs, detached; old and reference log-probs are
    ``base`` plus noise in BOTH runs, so a packed log-prob that is off changes the value."""
    mask = x["mask"][rows]
    kw = dict(mode=mode, denominators=den, norm_length=NORM)
    if name == "sft":
        return losses.sft_loss(logps, mask, weights=x["weights"][rows], **kw)
    if name == "ppo":
        return losses.policy_loss(logps, base + x["old"][rows], x["adv"][rows], mask, clip=0.2,
                                  clip_high=0.28, dual_clip=3.0, **kw).loss
    if name == "gspo":
        return losses.policy_loss(logps, base + x["old"][rows], x["seq_adv"][rows], mask,
                                  ratio="sequence", clip=0.05, **kw).loss
    if name == "kl":
        return losses.aggregate(losses.kl_penalty(logps, base + x["ref"][rows], "k3"), mask, **kw)
    if name == "entropy":
        return -losses.entropy_bonus(ent, mask, **kw)
    raise AssertionError(name)


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(got, expect):
    assert got.keys() == expect.keys()
    for k in expect:
        assert_within(got[k], expect[k], GRAD_TOL)


@pytest.fixture(scope="module")
def model():
    return hf.prepare(zoo.tiny_model("qwen2", dtype=torch.float64))  # sliding + full layers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sft", "ppo", "gspo", "kl", "entropy"])
def test_loss_packed_equals_each_sequence_alone(model, name, mode):
    x = step_inputs()
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=16)
    # Old and reference log-probs come from the unpacked run, for both runs: the packed
    # ratios equal the unpacked ones only if the packed log-probs do. Mutation check: with
    # token_logprobs off by +1e-3, 16 of these 20 cases fail (all but entropy's four); when
    # each run built its old log-probs from its own, only sft's four did.
    ref_logps, ref_ent = alone(model, SEQS)
    base = ref_logps.detach()
    expect_loss = loss_fn(name, mode, ref_logps, ref_ent, x, base)
    expect = grads_of(model, expect_loss)
    logps, ent = packed(model, pack)
    got_loss = loss_fn(name, mode, logps, ent, x, base)
    torch.testing.assert_close(got_loss, expect_loss.detach(), rtol=inside(model), atol=0)
    assert_close_grads(grads_of(model, got_loss), expect)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_over_packs_equals_one_unpacked_batch(model, mode):
    x = step_inputs(1)
    parts = [slice(0, 4), slice(4, 11), slice(11, N)]
    packs = [TreePack.from_sequences(SEQS[p]) for p in parts]
    den = losses.global_denominators([x["mask"][p] for p in parts])
    ref_logps, ref_ent = alone(model, SEQS)
    base = ref_logps.detach()
    model.zero_grad(set_to_none=True)
    total = 0.0
    for pack, rows in zip(packs, parts):
        logps, ent = packed(model, pack)
        # each pack's [N_k, L_k] layout: cut the step inputs' columns to this pack's width
        width = pack.max_length
        sub = {k: (v[rows][..., :width] if v.dim() == 2 else v[rows]) for k, v in x.items()}
        loss = loss_fn("ppo", mode, logps, ent, sub, base[rows][:, :width], den)
        loss.backward()
        total += loss.item()
    accumulated = {k: p.grad.clone() for k, p in model.named_parameters()}
    expect_loss = loss_fn("ppo", mode, ref_logps, ref_ent, x, base)
    # a loss of terms of size 1 (ratios near 1 times unit advantages) that cancel: relative to 1
    assert total == pytest.approx(expect_loss.item(), rel=inside(model), abs=inside(model))
    assert_close_grads(accumulated, grads_of(model, expect_loss))


def test_advantages_are_not_averaged_across_a_shared_row(model):
    # Two rollouts share a prompt; opposite advantages on the first response token must not
    # cancel into the shared prompt row: its gradient carries both, through each occurrence.
    prompt = SEQS[0][:8]
    a = torch.cat((prompt, torch.tensor([5, 6, 7])))
    b = torch.cat((prompt, torch.tensor([9, 10, 11])))
    pack = TreePack.from_sequences([a, b])
    logps, _ = packed(model, pack)
    mask = torch.zeros_like(pack.prediction_mask)
    mask[:, 8:] = True
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    ref_logps, _ = alone(model, [a, b])
    old = ref_logps.detach()
    loss = losses.policy_loss(logps, old, adv, mask, clip=0.2).loss
    got = grads_of(model, loss)
    expect_loss = losses.policy_loss(ref_logps, old, adv, mask, clip=0.2).loss
    # a mean of terms of size 1 (ratios 1 times advantages +-1) that cancel: relative to 1
    torch.testing.assert_close(loss.detach(), expect_loss.detach(), rtol=0, atol=inside(model))
    expect = grads_of(model, expect_loss)
    assert_close_grads(got, expect)
    assert any(g.abs().max() > 0 for g in got.values())
