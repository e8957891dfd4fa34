"""Chunked log-softmax of selected rows against torch's own log_softmax in float64."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treepack.core.softmax import Logits, log_softmax_rows, normalise


def reference(logits, rows, temperature, pick, token):
    """Plain autograd: log_softmax of every normalised row, then the picks and entropies."""
    z = logits[torch.as_tensor(rows)].double() / torch.as_tensor(temperature)[:, None]
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(logp.isneginf(), 0)).sum(-1)
    return logp[torch.as_tensor(pick), token], entropy


def case(seed, t_rows=7, vocab=11, repeats=True):
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(t_rows, size=rng.integers(1, t_rows + 1), replace=repeats))
    pick = rng.integers(0, len(rows), size=rng.integers(0, 3 * len(rows) + 1))
    token = torch.as_tensor(rng.integers(0, vocab, size=len(pick)))
    temperature = rng.uniform(0.3, 2.0, size=len(rows))
    logits = torch.as_tensor(rng.normal(size=(t_rows, vocab)) * 3)
    return logits, rows, temperature, pick, token


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([1, 2, 3, 1000]))
def test_values_and_gradients_match_log_softmax(seed, chunk):
    logits, rows, temperature, pick, token = case(seed)
    rng = np.random.default_rng(seed + 1)
    g_logp = torch.as_tensor(rng.normal(size=len(pick)))
    g_ent = torch.as_tensor(rng.normal(size=len(rows)))
    x = logits.clone().requires_grad_()
    logp, entropy = normalise(Logits(x), rows, temperature, pick, token, entropy=True,
                                     chunk_size=chunk)
    ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
    y = logits.clone().requires_grad_()
    ref_logp, ref_entropy = reference(y, rows, temperature, pick, token)
    ((ref_logp * g_logp).sum() + (ref_entropy * g_ent).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_only_one_output_used():
    logits, rows, temperature, pick, token = case(3)
    for use in ("logp", "entropy"):
        x = logits.clone().requires_grad_()
        logp, entropy = normalise(Logits(x), rows, temperature, pick, token, entropy=True,
                                         chunk_size=2)
        (logp if use == "logp" else entropy).sum().backward()
        y = logits.clone().requires_grad_()
        ref = reference(y, rows, temperature, pick, token)[0 if use == "logp" else 1]
        ref.sum().backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_masked_tokens_add_nothing():
    logits, rows, temperature, pick, token = case(5, repeats=False)
    logits[:, 0] = float("-inf")
    token = token.clamp(min=1)
    x = logits.clone().requires_grad_()
    logp, entropy = normalise(Logits(x), rows, temperature, pick, token, entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(entropy).all() and torch.isfinite(x.grad).all()
    y = logits.clone().requires_grad_()
    ref_logp, ref_entropy = reference(y, rows, temperature, pick, token)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(entropy, ref_entropy)
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("repeats", [False, True])
def test_bfloat16_gradient_rounded_once(repeats):
    """A row's gradient is summed in float32 (over its picks and its temperatures) and
    rounded to bfloat16 once: exactly the float32 gradient, cast."""
    logits, _, _, _, _ = case(11, t_rows=9, vocab=64)
    rows = np.array([0, 1, 1, 2, 4, 4, 4, 7]) if repeats else np.array([0, 1, 2, 4, 7, 8])
    pick = np.concatenate([np.arange(len(rows)), np.arange(len(rows))[::2]])  # shared rows too
    token = torch.arange(len(pick)) * 7 % 64
    temperature = np.linspace(0.5, 1.5, len(rows))
    low = logits.to(torch.bfloat16)
    x = low.clone().requires_grad_()
    logp, entropy = normalise(Logits(x), rows, temperature, pick, token, entropy=True,
                                     chunk_size=2)
    (logp.sum() + entropy.sum()).backward()
    assert logp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    y = low.float().requires_grad_()
    ref_logp, ref_entropy = normalise(Logits(y), rows, temperature, pick, token,
                                             entropy=True, chunk_size=2)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert torch.equal(x.grad, y.grad.to(torch.bfloat16))


def test_pack_logprobs_and_entropy_in_one_pass_equal_the_separate_calls():
    from treepack import TreePack

    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8]])
    logits = torch.randn(pack.num_rows, 9, dtype=torch.float64, generator=torch.Generator()
                         .manual_seed(0))
    w = torch.randn(pack.rows.shape, dtype=torch.float64)
    grads, values = [], []
    for both in (True, False):
        x = logits.clone().requires_grad_()
        if both:
            logp, entropy = pack.token_logprobs_and_entropy(x, temperature=0.7)
        else:
            logp = pack.token_logprobs(x, temperature=0.7)
            entropy = pack.token_entropy(x, temperature=0.7)
        ((logp + entropy) * w).sum().backward()
        grads.append(x.grad)
        values.append((logp, entropy))
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_second_order_gradients_are_refused_not_wrong():
    logits, rows, temperature, pick, token = case(7)
    x = logits.clone().requires_grad_()
    logp, _ = normalise(Logits(x), rows, temperature, pick, token)
    (grad,) = torch.autograd.grad(logp.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


def test_the_old_name_warns_and_answers_the_same():
    logits, rows, temperature, pick, token = case(3)
    with pytest.warns(FutureWarning, match="normalise"):
        old, _ = log_softmax_rows(logits, rows, temperature, pick, token)
    new, _ = normalise(Logits(logits), rows, temperature, pick, token)
    torch.testing.assert_close(old, new, rtol=0, atol=0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("world", [2, 3])
def test_a_vocabulary_split_over_ranks_gives_the_whole_heads_values_and_gradients(
        tmp_path, world):
    """Megatron's output layer under tensor parallelism: each rank holds a share of the
    vocabulary; the max, sum, picked logit and entropy all-reduced give the whole head's
    log-probs and entropies, and each rank its share's gradients (float64, to 1e-12)."""
    import dist_workers
    from launch import spawn

    spawn(dist_workers.vocab_parallel_worker, str(tmp_path), world=world)
    for rank in range(world):
        worst = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(v < 1e-12 for v in worst.values()), (rank, worst)
