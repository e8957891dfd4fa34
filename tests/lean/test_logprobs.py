import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack, logprobs_and_entropy_from_hidden

from reference import naive_entropy, naive_token_logprobs
from strategies import forests
from tolerance import FLOAT32_OP, FLOAT64_OP, assert_within, scale

V = 5
# float64 logits unless said: a log-softmax, an entropy, a head's matmul over at most 8 hidden
# values and their gradients, two ways: FLOAT64_OP of the values' size.


def random_logits(pack, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pack.num_rows, V, generator=g, dtype=dtype) * 3


@settings(max_examples=100, deadline=None)
@given(forests(vocab=V), st.sampled_from([None, 8]))
def test_logprobs_equal_per_occurrence_reference(seqs, multiple):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=multiple)
    logits = random_logits(pack)
    got = pack.token_logprobs(logits)
    assert got.dtype == torch.float64 and got.shape == (len(seqs), max(map(len, seqs)))
    # The reference finds the row of every prefix by walking parent_row and reading the
    # packed ids (fields test_tree checks against a dict trie), never through pack.rows.
    # Mutation check: with rows[s, p - 1] replaced by rows[s, p] as the source, this fails.
    row_of_prefix, prefix_of_row = {}, {}
    for r in range(pack.num_packed_rows):  # DFS pre-order: a parent comes before its children
        parent = int(pack.parent_row[r])
        prefix = prefix_of_row.get(parent, ()) + (int(pack.input_ids[r]),)
        prefix_of_row[r] = prefix
        row_of_prefix[prefix] = r
    ref_rows = [[row_of_prefix[tuple(seq[: p + 1])] for p in range(len(seq))] for seq in seqs]
    ref = naive_token_logprobs(logits, seqs, ref_rows)
    assert_within(got, ref, FLOAT64_OP)
    assert (got[~pack.prediction_mask] == 0).all()


@settings(max_examples=60, deadline=None)
@given(forests(vocab=V))
def test_logprob_gradients_add_every_occurrence(seqs):
    # dL/dz_r = sum over occurrences o read from row r of w_o (onehot(y_o) - softmax(z_r)).
    pack = TreePack.from_sequences(seqs)
    logits = random_logits(pack).requires_grad_()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(pack.rows.shape, generator=g, dtype=torch.float64)  # per-occurrence weights
    (pack.token_logprobs(logits) * w).sum().backward()
    expect = torch.zeros_like(logits)
    probs = logits.detach().softmax(-1)
    for s, seq in enumerate(seqs):
        for p in range(1, len(seq)):
            r = int(pack.rows[s, p - 1])
            expect[r] -= w[s, p] * probs[r]
            expect[r, seq[p]] += w[s, p]
    assert_within(logits.grad, expect, FLOAT64_OP)


def test_gradcheck_with_repeated_rows_and_targets():
    # Row C predicts D and E; rows A and B are read three times; duplicates read all twice.
    seqs = [[1, 2, 3, 4], [1, 2, 3, 0], [1, 2, 4, 4], [1, 2, 3, 4], [1, 2]]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=8)
    logits = random_logits(pack).requires_grad_()
    assert torch.autograd.gradcheck(pack.token_logprobs, (logits,))
    assert torch.autograd.gradcheck(lambda z: pack.token_logprobs(z, temperature=0.7), (logits,))
    assert torch.autograd.gradcheck(pack.token_entropy, (logits,))


def test_seed_abc_fork_gradient_is_sum_of_targets():
    # The seed's rule at the shared row C: G_z = (p_C - e_D) + (p_C - e_E) for L_sum = -sum.
    A, B, C, D, E, F, G = range(1, 8)
    pack = TreePack.from_sequences([[A, B, C, D], [A, B, C, E], [A, B, F, G]])
    logits = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    (-pack.token_logprobs(logits).sum()).backward()
    p_c = logits.detach()[2].softmax(-1)
    expect = 2 * p_c
    expect[D] -= 1
    expect[E] -= 1
    assert_within(logits.grad[2], expect, FLOAT64_OP)
    assert (logits.grad[[3, 4, 6]] == 0).all()  # leaves predict nothing


def test_temperature_scales_logits():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0], [4]])
    logits = random_logits(pack)
    torch.testing.assert_close(pack.token_logprobs(logits, temperature=0.5),  # / 0.5, * 2: exact
                               pack.token_logprobs(logits * 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="temperature"):
        pack.token_logprobs(logits, temperature=0)


def test_low_precision_logits_are_upcast():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0]])
    logits = random_logits(pack, dtype=torch.float32)
    got = pack.token_logprobs(logits.bfloat16())
    assert got.dtype == torch.float32
    expect = pack.token_logprobs(logits.bfloat16().double())
    assert_within(got.double(), expect, FLOAT32_OP)  # the log-softmax in float32


@settings(max_examples=40, deadline=None)
@given(forests(vocab=V))
def test_entropy_equals_reference(seqs):
    pack = TreePack.from_sequences(seqs)
    logits = random_logits(pack)
    got = pack.token_entropy(logits)
    for s, seq in enumerate(seqs):
        for p in range(len(seq)):
            expect = naive_entropy(logits[int(pack.rows[s, p - 1])].tolist()) if p else 0.0
            assert got[s, p].item() == pytest.approx(expect, rel=FLOAT64_OP, abs=FLOAT64_OP)


def test_entropy_with_masked_out_tokens_is_finite():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0]])
    logits = random_logits(pack)
    logits[:, 4] = float("-inf")
    logits.requires_grad_()
    ent = pack.token_entropy(logits)
    ent.sum().backward()
    assert torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()
    expect = naive_entropy(logits[0, :4].tolist())
    assert ent[0, 1].item() == pytest.approx(expect, rel=FLOAT64_OP, abs=FLOAT64_OP)


def test_logits_shape_and_device_errors():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0]], pad_to_multiple_of=8)
    with pytest.raises(ValueError, match=r"out.logits\[0\]"):
        pack.token_logprobs(torch.zeros(1, 8, V))
    with pytest.raises(ValueError, match=r"T'=8"):
        pack.token_logprobs(torch.zeros(pack.num_packed_rows, V))  # forgot the padding rows
    with pytest.raises(ValueError, match="pack.to"):
        pack.token_logprobs(torch.zeros(8, V, device="meta"))
    with pytest.raises(ValueError, match="token id 3 but the logits cover a vocabulary of 3"):
        pack.token_logprobs(torch.zeros(8, 3))


# ---------------------------------------------------------------------- lean log-probs

lean_options = st.fixed_dictionaries({
    "chunk_size": st.sampled_from([1, 3, 16, None]),
    "temperature": st.sampled_from([1.0, 0.6]),
    "softcap": st.sampled_from([None, 2.5]),
    "scale": st.sampled_from([1.0, 0.5]),
    "bias": st.booleans(),
    "pad": st.sampled_from([None, 8]),
})


def full_logits(h, weight, bias, scale, softcap):
    z = h @ weight.T + (0 if bias is None else bias)
    z = z * scale
    return z if softcap is None else torch.tanh(z / softcap) * softcap


@settings(max_examples=60, deadline=None)
@given(forests(vocab=V), lean_options)
def test_lean_logprobs_equal_full_logits_path(seqs, opt):
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(pack.num_rows, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) \
        if opt["bias"] else None
    kw = dict(temperature=opt["temperature"], softcap=opt["softcap"], scale=opt["scale"])
    got = logprobs_and_entropy_from_hidden(pack, h, weight, bias=bias,
                                           chunk_size=opt["chunk_size"], **kw)
    z = full_logits(h, weight, bias, opt["scale"], opt["softcap"])
    ref = pack.token_logprobs(z, temperature=opt["temperature"])
    ref_ent = pack.token_entropy(z, temperature=opt["temperature"])
    assert_within(got.logprobs, ref, FLOAT64_OP)
    assert_within(got.entropy, ref_ent, FLOAT64_OP)
    w1, w2 = torch.randn(ref.shape, generator=g, dtype=ref.dtype), torch.randn(
        ref.shape, generator=g, dtype=ref.dtype)
    inputs = [x for x in (h, weight, bias) if x is not None]
    expect = torch.autograd.grad((ref * w1).sum() + (ref_ent * w2).sum(), inputs)
    grads = torch.autograd.grad((got.logprobs * w1).sum() + (got.entropy * w2).sum(), inputs)
    # a gradient sums a term per prediction: its weight, times the log-probs' size (entropy),
    # times the other input's size (h or the head): as large as those terms together
    terms = ((w1.abs().sum() + w2.abs().sum() * max(1.0, scale(ref)))
             * max(1.0, scale(h), scale(weight)))
    for a, b in zip(grads, expect):
        assert_within(a, b, FLOAT64_OP, size=float(terms))


def test_lean_gradcheck_with_shared_rows():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 3, 0], [1, 2, 4, 4], [1, 2]])
    g = torch.Generator().manual_seed(3)
    h = torch.randn(pack.num_rows, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)

    def f(h, weight, bias):
        out = logprobs_and_entropy_from_hidden(pack, h, weight, bias=bias, chunk_size=2,
                                               softcap=2.0, temperature=0.8)
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(f, (h, weight, bias))


def test_lean_logprobs_in_bfloat16_stay_within_its_rounding():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3, 4] * 5, [1, 2, 3, 0] * 5, [4, 4, 2]])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(pack.num_rows, 16, generator=g)
    weight = torch.randn(V, 16, generator=g) * 0.3
    exact = pack.token_logprobs(h.double() @ weight.double().T)
    lean = logprobs_from_hidden(pack, h.bfloat16(), weight.bfloat16())
    full = pack.token_logprobs(h.bfloat16() @ weight.bfloat16().T)
    assert lean.dtype == torch.float32
    mask = pack.prediction_mask
    lean_err = (lean.double() - exact)[mask].abs().max()
    full_err = (full.double() - exact)[mask].abs().max()
    assert lean_err <= 2 * full_err  # both round the matmul to bfloat16 the same way


@pytest.mark.parametrize("chunk_size", [3, None])
def test_lean_gradients_in_bfloat16_are_as_good_as_full_logits(chunk_size):
    # Against a float64 reference, the lean bfloat16 gradients (accumulated over chunks in
    # float32) err at most as much as autograd through bfloat16 full logits, within 2x.
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3, 4] * 9, [1, 2, 3, 0] * 9, [4, 4, 2, 11] * 4])
    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(pack.num_rows, 32, generator=g)
    w0 = torch.randn(50, 32, generator=g) * 0.3
    upstream = torch.randn(pack.rows.shape, generator=g)

    def grads(dtype, lean):
        h, w = (x.to(dtype).requires_grad_() for x in (h0, w0))
        logps = (logprobs_from_hidden(pack, h, w, chunk_size=chunk_size) if lean else
                 pack.token_logprobs(h @ w.T))
        (logps * upstream).sum().backward()
        return h.grad.double(), w.grad.double()

    exact = grads(torch.float64, lean=False)
    lean, full = grads(torch.bfloat16, True), grads(torch.bfloat16, False)
    for got, ref, e in zip(lean, full, exact):
        assert got.dtype == torch.float64 and (got - e).norm() <= 2 * (ref - e).norm()


def test_lean_logprobs_bad_input():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=8)
    h, weight = torch.randn(8, 4), torch.randn(V, 4)
    with pytest.raises(ValueError, match=r"last_hidden_state\[0\]"):
        logprobs_from_hidden(pack, h[None], weight)
    with pytest.raises(ValueError, match=r"\[V, H=4\]"):
        logprobs_from_hidden(pack, h, weight.T)
    with pytest.raises(ValueError, match="bias"):
        logprobs_from_hidden(pack, h, weight, bias=torch.zeros(3))
    for chunk in (0, -1, 2.5):
        with pytest.raises(ValueError, match="chunk_size"):
            logprobs_from_hidden(pack, h, weight, chunk_size=chunk)
    with pytest.raises(ValueError, match="pack.to"):
        logprobs_from_hidden(pack, h.to("meta"), weight.to("meta"))
    with pytest.raises(ValueError, match="vocabulary of 2"):
        logprobs_from_hidden(pack, h, weight[:2])


def test_lean_logprobs_under_autocast_backpropagate_the_forward_they_computed():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3, 4] * 3, [1, 2, 3, 0] * 3, [4, 4, 2, 1]])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(pack.num_rows, 16, generator=g, requires_grad=True)
    weight = (torch.randn(V, 16, generator=g) * 0.3).requires_grad_()
    w = torch.randn(pack.rows.shape, generator=g)

    def loss(lp, ent):
        return (lp * w).sum() + (ent * w).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logprobs_and_entropy_from_hidden(pack, h, weight)
        z = h @ weight.T  # what the lean forward computes under autocast (bfloat16)
        lean = torch.autograd.grad(loss(*out), (h, weight))
        auto = torch.autograd.grad(loss(pack.token_logprobs(z), pack.token_entropy(z)),
                                   (h, weight))
    z64 = h.double() @ weight.double().T
    exact = torch.autograd.grad(loss(pack.token_logprobs(z64), pack.token_entropy(z64)),
                                (h, weight))
    for a, b, e in zip(lean, auto, exact):
        # the lean gradient is autograd's of the same bfloat16 forward, to within the
        # rounding that separates autograd's own from the exact one
        assert (a - b).norm() <= (b.double() - e).norm().float()
    # bfloat16 hidden states and a float32 head under autocast: backward must not break
    hb = h.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs_from_hidden(pack, hb, weight).sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_lean_logprobs_with_a_float32_head_and_bfloat16_hidden_states():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0]])
    h = torch.randn(pack.num_rows, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, 8, requires_grad=True)  # e.g. TRL's cast_lm_head_to_fp32
    out = logprobs_from_hidden(pack, h, weight)
    expect = pack.token_logprobs(h.float() @ weight.T)
    assert_within(out, expect, FLOAT32_OP)  # a float32 head and log-softmax, two ways
    out.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_lean_entropy_with_masked_out_tokens_is_finite():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 0]])
    h = torch.randn(pack.num_rows, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(V, dtype=torch.float64)
    bias[4] = float("-inf")  # token 4 masked out through the bias
    out = logprobs_and_entropy_from_hidden(pack, h, weight, bias=bias)
    ref = pack.token_entropy(h @ weight.T + bias)
    assert_within(out.entropy, ref, FLOAT64_OP)
    out.entropy.sum().backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(weight.grad).all()


def test_lean_logprobs_treat_softcap_zero_as_no_cap_and_refuse_bad_numbers():
    # softcap=0.0 used to give log(1/V) everywhere (tanh(z / 0) * 0).
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 0]])
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(pack.num_rows, 6, generator=g), torch.randn(V, 6, generator=g)
    plain = logprobs_from_hidden(pack, h, weight)
    torch.testing.assert_close(logprobs_from_hidden(pack, h, weight, softcap=0.0), plain,
                               rtol=0, atol=0)  # no cap: the same computation
    assert_within(plain, pack.token_logprobs(h @ weight.T), FLOAT32_OP)  # float32, two ways
    for kwargs, message in (({"softcap": -1.0}, "softcap=-1.0 must be a finite number > 0"),
                            ({"temperature": float("inf")}, "temperature=inf must be a finite"),
                            ({"temperature": 0}, "temperature=0 must be a finite"),
                            ({"scale": float("nan")}, "scale=nan must be a finite"),
                            ({"chunk_size": True}, "chunk_size=True must be a positive int")):
        with pytest.raises(ValueError, match=re.escape(message)):
            logprobs_from_hidden(pack, h, weight, **kwargs)
    import numpy as np

    assert_within(logprobs_from_hidden(pack, h, weight, chunk_size=np.int64(2)), plain,
                  FLOAT32_OP)  # float32 in chunks of 2 rows


def test_non_floating_heads_and_logits_are_refused():
    # An integer head used to cast the hidden states to integers.
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3]])
    h = torch.randn(pack.num_rows, 4)
    with pytest.raises(TypeError, match="weight .the LM head. has dtype torch.int64"):
        logprobs_from_hidden(pack, h, torch.ones(V, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="hidden has dtype torch.int32"):
        logprobs_from_hidden(pack, h.int(), torch.ones(V, 4))
    for bad in (torch.zeros(pack.num_rows, V, dtype=torch.bool),
                torch.zeros(pack.num_rows, V, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="logits has dtype"):
            pack.token_logprobs(bad)
    with pytest.raises(ValueError, match="temperature=inf"):
        pack.token_logprobs(torch.zeros(pack.num_rows, V), temperature=float("inf"))


def test_deprecated_with_entropy_warns_and_still_answers():
    from treepack import logprobs_from_hidden

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    h = torch.randn(pack.num_rows, 4, dtype=torch.float64)
    weight = torch.randn(7, 4, dtype=torch.float64)
    with pytest.warns(FutureWarning, match="logprobs_and_entropy_from_hidden"):
        old = logprobs_from_hidden(pack, h, weight, with_entropy=True)
    new = logprobs_and_entropy_from_hidden(pack, h, weight)
    torch.testing.assert_close(old.entropy, new.entropy, rtol=0, atol=0)  # the same call
