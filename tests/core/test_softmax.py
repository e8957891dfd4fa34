"""Chunked log-softmax of selected rows against torch's own log_softmax in float64."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treepack.core.softmax import Logits, log_softmax_rows, normalise

from tolerance import FLOAT32_OP, FLOAT64_OP, assert_within, within

# float64 logits: a log-softmax, an entropy and their gradients over rows of at most 64, two
# ways (chunked, and torch's own): FLOAT64_OP of the values' size, which for a log-prob and an
# entropy (a sum of p log p) is that of the normalised logits and their log-sum-exp, however
# small the entropy of a peaked row.


def size_of(logits, temperature) -> float:
    """max |z / T| + log V: bounds every log-prob (and log-sum-exp) of the rows."""
    z = logits[logits.isfinite()].abs().max() / float(np.min(temperature))
    return float(z) + float(np.log(logits.shape[-1]))


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
    size = size_of(logits, temperature)
    assert_within(logp, ref_logp, FLOAT64_OP, size=size)
    assert_within(entropy, ref_entropy, FLOAT64_OP, size=size)
    # a row's gradient sums a term per pick and per entropy, each of size |weight| x (up to
    # the row's log-probs' size, for an entropy): as large as those terms together
    terms = (g_logp.abs().sum() + g_ent.abs().sum()) * size
    assert_within(x.grad, y.grad, FLOAT64_OP, size=float(terms))


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
        # a term per pick (entropy: times the log-probs' size), weights of 1
        terms = max(len(pick), len(rows)) * size_of(logits, temperature)
        assert_within(x.grad, y.grad, FLOAT64_OP, size=terms)


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
    size = size_of(logits, temperature)
    assert_within(entropy, ref_entropy, FLOAT64_OP, size=size)
    assert_within(x.grad, y.grad, FLOAT64_OP, size=(len(pick) + len(rows)) * size)


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
    assert_within(grads[0], grads[1], FLOAT64_OP)  # the same gradients, summed in another order


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
    log-probs and entropies, and each rank its share's gradients (float64: FLOAT64_OP of
    each one's size)."""
    import softmax_workers
    from launch import spawn

    spawn(softmax_workers.vocab_parallel_worker, str(tmp_path), world=world)
    for rank in range(world):
        worst = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(within(v, FLOAT64_OP) for v in worst.values()), (rank, worst)


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("temperature", [1.0, "per sequence"])
def test_fused_gpu_kernels_give_the_eager_values_and_gradients(monkeypatch, bias, temperature):
    """The compiled log-sum-exp and softmax gradient a plain bfloat16 head runs on a GPU
    (Head.fusable), run here on the CPU: log-probs within float32 rounding of the eager
    chunks, every gradient equal after its one bfloat16 rounding; chunks of 3 rows, so the
    last chunk's row count differs (no recompile per count) and a row's picks can span
    chunks' boundaries."""
    from treepack import TreePack
    from treepack.core import softmax
    from treepack.lean.logprobs import outputs_from_hidden

    torch.manual_seed(0)
    pack = TreePack.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 11, 12],
                                    [5, 6, 7], [5, 6, 7, 1]])
    temps = 1.0 if temperature == 1.0 else [0.7, 1.0, 1.3, 0.5, 0.9]
    h = torch.randn(pack.num_rows, 16, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(64, 16) * 0.5).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(64) * 0.1).to(torch.bfloat16).requires_grad_() if bias else None
    params = [t for t in (h, w, b) if t is not None]
    upstream = torch.randn(pack.rows.shape)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(softmax, "FUSED_DEVICES", {"cpu"} if fused else set())
        assert softmax.Head(h, w, b).fusable(False) is fused
        for t in params:
            t.grad = None
        out = outputs_from_hidden(pack, h, w, bias=b, temperature=temps, chunk_size=3)
        (out.logprobs * upstream).sum().backward()
        runs[fused] = out.logprobs.detach(), [t.grad.clone() for t in params]
    (eager, eager_grads), (fused, fused_grads) = runs[False], runs[True]
    assert_within(fused, eager, FLOAT32_OP)  # a log-sum-exp in float32, compiled and eager
    for got, want in zip(fused_grads, eager_grads):
        assert torch.equal(got, want)


def test_a_fused_kernel_that_fails_to_compile_warns_and_runs_eagerly(monkeypatch):
    """A GPU without a working compiler must not stop training: the kernel warns once and
    runs the same function eagerly, with the same values."""
    from treepack.core import softmax

    def broken(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no triton here")
        return compiled

    monkeypatch.setattr(softmax, "_KERNELS", {})
    monkeypatch.setattr(torch, "compile", broken)
    z = torch.randn(4, 7, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no triton here"):
        lse = softmax._fused("lse", z, None, None)
    assert_within(lse, torch.logsumexp(z.float(), -1), FLOAT32_OP)  # float32, two ways
    assert softmax._KERNELS["lse"] is softmax._chunk_lse  # eager from then on
