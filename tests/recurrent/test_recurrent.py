"""treepack.recurrent: the short causal convolution and the level-by-level scan on a tree,
against each sequence run alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack
from treepack.recurrent import level_scan, levels, row_levels, scan_levels, tree_conv1d

from reference import naive_gated_delta_rule
from strategies import forests
from tolerance import FLOAT64_OP, assert_within, negative_control

# float64 throughout; a convolution of at most 4 taps, a scan of at most 20 steps of a few sums
# each, and their gradients, computed on a tree and alone: FLOAT64_OP of the values' size.


def per_row(pack, sequences, fn):
    """``fn(sequence s)`` [len, ...] placed at each sequence's packed rows (shared rows must
    agree: the assertion compares every occurrence)."""
    out = {}
    for s, seq in enumerate(sequences):
        rows = (pack.rows[s, :len(seq)] if pack.layout == "dense"
                else pack.rows[pack.offsets[s]:pack.offsets[s] + len(seq)])
        for r, value in zip(rows.tolist(), fn(s)):
            out.setdefault(r, []).append(value)
    return out


@settings(max_examples=40, deadline=None)
@given(forests(), st.integers(1, 4), st.sampled_from(["dense", "flat"]))
def test_tree_conv1d_equals_conv1d_on_each_sequence(sequences, taps, layout):
    pack = TreePack.from_sequences(sequences, layout=layout, pad_to_multiple_of=8)
    g = torch.Generator().manual_seed(len(sequences))
    channels = 3
    table = torch.randn(4, channels, generator=g, dtype=torch.float64)  # a vector per token
    weight = torch.randn(channels, taps, generator=g, dtype=torch.float64)
    bias = torch.randn(channels, generator=g, dtype=torch.float64)
    got = tree_conv1d(pack, table[pack.input_ids], weight, bias)

    def alone(s):
        x = table[torch.tensor(sequences[s])].T[None]  # [1, C, len]
        y = torch.nn.functional.conv1d(x, weight[:, None], bias, padding=taps - 1,
                                       groups=channels)[0, :, :x.shape[-1]]
        return y.T

    for r, values in per_row(pack, sequences, alone).items():
        for v in values:
            assert_within(got[r], v, FLOAT64_OP)
    pad = pack.input_ids[pack.num_packed_rows:]  # padding rows read themselves only
    assert_within(got[pack.num_packed_rows:], table[pad] * weight[:, -1] + bias, FLOAT64_OP)


def gated_delta_inputs(pack, g, heads=2, dk=3, dv=2):
    """Per-token random q, k, v, g, beta (one draw per token id: shared rows agree)."""
    vocab = int(pack.input_ids.max()) + 1
    table = {n: torch.randn(vocab, *shape, generator=g, dtype=torch.float64)
             for n, shape in dict(q=(heads, dk), k=(heads, dk), v=(heads, dv), g=(heads,),
                                  b=(heads,)).items()}
    table["g"] = -table["g"].abs()  # decays in log space
    table["b"] = table["b"].sigmoid()
    return table


def scan(table, ids, state=None):
    return naive_gated_delta_rule(table["q"][ids][None], table["k"][ids][None],
                                  table["v"][ids][None], table["g"][ids][None],
                                  table["b"][ids][None], initial_state=state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)


@settings(max_examples=40, deadline=None)
@given(forests(vocab=4), st.sampled_from(["dense", "flat"]))
def test_level_scan_equals_the_scan_of_each_sequence(sequences, layout):
    """Each segment starts from its parent segment's final state; padded positions of a
    level's batch leave states unchanged. Reference: the scan of each sequence alone."""
    pack = TreePack.from_sequences(sequences, layout=layout, pad_to_multiple_of=8)
    table = gated_delta_inputs(pack, torch.Generator().manual_seed(len(sequences)))

    def kernel(batch, state):
        return naive_gated_delta_rule(batch["q"], batch["k"], batch["v"], batch["g"],
                                      batch["b"], initial_state=state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    ids = pack.input_ids
    got = level_scan(pack, kernel, {n: t[ids] for n, t in table.items()})
    expected = per_row(pack, sequences, lambda s: scan(table, torch.tensor(sequences[s]))[0][0])
    for r, values in expected.items():
        for v in values:
            assert_within(got[r], v, FLOAT64_OP)
    assert not got[pack.num_packed_rows:].any()


@settings(max_examples=40, deadline=None)
@given(forests(vocab=4), st.data())
def test_row_levels_cut_anywhere_scan_alike_and_end_chains_at_the_cuts(sequences, data):
    """Chains built row by row, cut after any rows: the same outputs as the pack's own
    levels, and every cut row the last row of a chain, whose final state is the state after
    that row (the scan of the row's sequence alone up to it)."""
    pack = TreePack.from_sequences(sequences)
    n = pack.num_rows
    cut = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    table = gated_delta_inputs(pack, torch.Generator().manual_seed(n))

    def kernel(batch, state):
        return naive_gated_delta_rule(batch["q"], batch["k"], batch["v"], batch["g"],
                                      batch["b"], initial_state=state, output_final_state=True)

    inputs = {k: t[pack.input_ids] for k, t in table.items()}
    plan = row_levels(pack.host.parent_row, cut, pack.device)
    got, finals = scan_levels(plan, kernel, inputs)
    assert_within(got, level_scan(pack, kernel, inputs), FLOAT64_OP)
    for row in np.flatnonzero(cut):
        (d, b), = [(d, b) for d, lv in enumerate(plan.levels)
                   for b in np.flatnonzero(lv.last == row)]
        s, p = map(int, np.argwhere(pack.host.rows == row)[0])
        ids = torch.tensor(sequences[s][:p + 1])
        want = naive_gated_delta_rule(*(table[k][ids][None] for k in "qkvgb"),
                                      output_final_state=True)[1][0]
        assert_within(finals[d][b], want, FLOAT64_OP)


def test_level_scan_gradients_reach_every_ancestor_once_per_descendant():
    """A GRPO-like tree: gradients of the outputs equal those of each sequence alone."""
    g = torch.Generator().manual_seed(0)
    sequences = [[1, 2, 3, 0, 1, 2], [1, 2, 3, 0, 2], [1, 2, 3], [1, 2, 3, 0, 1, 3, 3, 1]]
    pack = TreePack.from_sequences(sequences)
    table = {n: t.requires_grad_() for n, t in gated_delta_inputs(pack, g).items()}
    w = torch.randn(pack.num_rows, 2, 2, generator=g, dtype=torch.float64)

    def kernel(batch, state):
        return naive_gated_delta_rule(batch["q"], batch["k"], batch["v"], batch["g"],
                                      batch["b"], initial_state=state, output_final_state=True)

    out = level_scan(pack, kernel, {n: t[pack.input_ids] for n, t in table.items()})
    # each row's loss counted once per sequence through it, as the unpacked loss counts it
    mult = torch.bincount(pack.rows[pack.rows >= 0], minlength=pack.num_rows).double()
    (out * w * mult[:, None, None]).sum().backward()
    got = {n: t.grad.clone() for n, t in table.items()}
    for t in table.values():
        t.grad = None
    total = 0
    for s, seq in enumerate(sequences):
        rows = pack.rows[s, :len(seq)]
        out_s = naive_gated_delta_rule(*(table[n][torch.tensor(seq)][None] for n in "qkvgb"),
                                       output_final_state=False)[0][0]
        total = total + (out_s * w[rows]).sum()
    total.backward()
    for n, t in table.items():
        assert_within(got[n], t.grad, FLOAT64_OP, msg=n)


def test_levels_of_a_grpo_tree_and_an_agent_trajectory():
    grpo = TreePack.from_sequences([[1] * 5 + [2, 3], [1] * 5 + [4], [1] * 5 + [5, 6, 7]])
    assert len(levels(grpo).levels) == 2
    assert levels(grpo).levels[1].rows.shape == (3, 3)  # three answers, padded to the longest
    steps = [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]  # each step extends the one before
    assert len(levels(TreePack.from_sequences(steps)).levels) == 1  # one chain: one call
    forked = steps + [[1, 2, 3, 9]]  # a fork after the second step's first token
    assert [lv.rows.shape[0] for lv in levels(TreePack.from_sequences(forked)).levels] == [1, 2]
    assert levels(TreePack.empty(4)).levels == []


def test_a_scan_from_zero_states_at_forks_is_caught():
    """A negative control: segments that start from zeros instead of their parent's state."""
    sequences = [[1, 2, 3, 0, 1], [1, 2, 3, 2]]
    pack = TreePack.from_sequences(sequences)
    table = gated_delta_inputs(pack, torch.Generator().manual_seed(1))

    def forgetful(batch, state):
        return naive_gated_delta_rule(batch["q"], batch["k"], batch["v"], batch["g"],
                                      batch["b"], initial_state=None, output_final_state=True)

    got = level_scan(pack, forgetful, {n: t[pack.input_ids] for n, t in table.items()})
    want = scan(table, torch.tensor(sequences[0]))[0][0]
    with pytest.raises(AssertionError), negative_control():  # off by far more than 1e-6
        torch.testing.assert_close(got[pack.rows[0, :5]], want, rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([1, 4, 16]), st.booleans(), st.integers(0, 1000))
def test_decayed_linear_attention_equals_the_recurrence(length, chunk, from_state, seed):
    """MiniMax's lightning attention, chunked, against ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``
    token by token, from zeros or a given state; zero steps (a level's padding) keep it."""
    from treepack.recurrent import decayed_linear_attention

    g = torch.Generator().manual_seed(seed)
    B, H, Dk, Dv = 2, 3, 4, 5
    q, k = (torch.randn(B, length, H, Dk, generator=g, dtype=torch.float64) for _ in "qk")
    v = torch.randn(B, length, H, Dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, length, H, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64) if from_state else None
    out, final = decayed_linear_attention(q, k, v, decay, state, chunk=chunk)
    s = torch.zeros(B, H, Dk, Dv, dtype=torch.float64) if state is None else state
    want = []
    for t in range(length):
        s = s * decay[:, t].exp()[..., None, None] + k[:, t, ..., None] * v[:, t, :, None, :]
        want.append((q[:, t, ..., None] * s).sum(-2))
    assert_within(out, torch.stack(want, 1), FLOAT64_OP)
    assert_within(final, s, FLOAT64_OP)
    zeros = [torch.zeros(B, 3, H, d, dtype=torch.float64) for d in (Dk, Dk, Dv)]
    _, kept = decayed_linear_attention(*zeros, torch.zeros(B, 3, H, dtype=torch.float64),
                                       final, chunk=chunk)
    torch.testing.assert_close(kept, final, rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([1, 4, 16]), st.booleans(), st.booleans(),
       st.integers(0, 1000))
def test_ssd_scan_equals_mamba2s_recurrence(length, chunk, from_state, per_channel, seed):
    """Mamba2's SSD in chunks against ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``,
    ``y_t = C_t h_t + D x_t`` token by token (two heads per group of B and C), from zeros or
    a given state; zero steps (a level's padding) keep it."""
    from treepack.recurrent import ssd_scan

    from reference import naive_ssd

    g = torch.Generator().manual_seed(seed)
    b, heads, groups, P, N = 2, 4, 2, 3, 5
    x = torch.randn(b, length, heads, P, generator=g, dtype=torch.float64)
    dt = torch.rand(b, length, heads, generator=g, dtype=torch.float64)
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    B, C = (torch.randn(b, length, groups, N, generator=g, dtype=torch.float64) for _ in "BC")
    D = torch.randn(*((heads, P) if per_channel else (heads,)), generator=g,
                    dtype=torch.float64)
    start = torch.randn(b, heads, P, N, generator=g, dtype=torch.float64) if from_state \
        else None
    out, final = ssd_scan(x, dt, A, B, C, D, None if start is None else start.transpose(-1, -2),
                          chunk=chunk)
    want, last = naive_ssd(x, dt, A, B, C, D, start)
    assert_within(out, want, FLOAT64_OP)
    assert_within(final.transpose(-1, -2), last, FLOAT64_OP)
    zeros = torch.zeros(b, 3, heads, P, dtype=torch.float64)
    _, kept = ssd_scan(zeros, zeros[..., 0], A, *(torch.zeros(b, 3, groups, N,
                                                              dtype=torch.float64),) * 2,
                       D, final, chunk=chunk)
    torch.testing.assert_close(kept, final, rtol=0, atol=0)
