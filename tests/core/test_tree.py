import doctest
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treepack.tree
from treepack import TreePack
from treepack.forest import sort_and_lcp

from reference import NaiveTrie
from strategies import forests
from tolerance import FLOAT64_OP, assert_within

A, B, C, D, E, F, G = range(1, 8)


def test_docstring_walkthrough():
    result = doctest.testmod(treepack.tree, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 10 and result.failed == 0


def test_seed_abcd_abce_abfg():
    pack = TreePack.from_sequences([[A, B, C, D], [A, B, C, E], [A, B, F, G]])
    assert pack.num_packed_rows == 7 and pack.num_original_tokens == 12
    assert pack.input_ids.tolist() == [A, B, C, D, E, F, G]
    assert pack.position_ids.tolist() == [0, 1, 2, 3, 3, 2, 3]
    assert pack.num_predictions == 9 and pack.num_prediction_rows == 4
    assert sorted(set(pack.predictions.source.tolist())) == [0, 1, 2, 5]  # A, B, C, F
    mask = pack.dense_mask()
    assert not mask[4, 3] and not mask[3, 4]  # E never sees D, nor D E
    assert not mask[6, 2:5].any()  # G never sees C, D, E


def test_seed_claw_r1_example():
    pack = TreePack.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 7, 8, 9]])
    assert pack.num_packed_rows == 9 and pack.num_original_tokens == 17
    assert pack.token_ratio == 9 / 17  # a ratio of two counts: one float64 division
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Nodes [1,2,3] [4,5] [6,7] [8,9]: the seed's compressed tree, its packed positions.
    assert pack.segments.start.tolist() == [0, 3, 5, 7]
    assert pack.segments.end.tolist() == [3, 5, 7, 9]
    assert pack.segments.parent.tolist() == [-1, 0, 0, 2]
    # The seed's visibility rows for the three leaves.
    m = pack.dense_mask().int()
    assert m[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert m[6].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0]
    assert m[8].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1]


def check_against_trie(seqs, pack: TreePack):
    """Every structural field of the pack against the naive trie."""
    trie = NaiveTrie(seqs)
    T = pack.num_packed_rows
    assert T == trie.num_nodes  # one row per distinct prefix
    rows = pack.rows
    node_of_row = [None] * T
    for s, seq in enumerate(seqs):
        r = rows[s, : len(seq)]
        assert (rows[s, len(seq):] == -1).all()
        assert pack.input_ids[r].tolist() == [int(t) for t in seq]
        assert pack.position_ids[r].tolist() == list(range(len(seq)))
        for p, node in enumerate(trie.paths[s]):
            row = int(r[p])
            assert node_of_row[row] in (None, node)  # one row <=> one prefix
            node_of_row[row] = node
    assert None not in node_of_row
    assert len(set(node_of_row)) == T

    row_of_node = {node: i for i, node in enumerate(node_of_row)}
    # Parents: the row of the previous token on every path.
    for i, node in enumerate(node_of_row):
        parent = trie.parent[node]
        assert int(pack.parent_row[i]) == (-1 if parent == 0 else row_of_node[parent])

    # The dense mask is exactly the ancestor-or-self relation; siblings never see each other.
    expect = torch.zeros(T, T, dtype=torch.bool)
    for i, node in enumerate(node_of_row):
        for anc in trie.ancestors_or_self(node):
            expect[i, row_of_node[anc]] = True
    dense = pack.dense_mask()
    assert torch.equal(dense[:T, :T], expect)
    for kids in trie.children:
        kid_rows = [row_of_node[k] for k in kids.values()]
        for a in kid_rows:
            for b in kid_rows:
                assert a == b or not dense[a, b]

    # Segments: the compressed trie, DFS order, one subtree_end each, chains inside.
    seg = pack.segments
    starts = {row_of_node[v] for v in range(1, trie.num_nodes + 1) if trie.starts_segment(v)}
    assert seg.start.tolist() == sorted(starts)
    assert torch.equal(seg.end[:-1], seg.start[1:]) and int(seg.end[-1]) == T
    for k, (a, b, par) in enumerate(zip(*(x.tolist() for x in seg))):
        assert len(set(pack.subtree_end[a:b].tolist())) == 1
        for r in range(a + 1, b):
            assert trie.parent[node_of_row[r]] == node_of_row[r - 1]
        owner = int(pack.host.segment_sequence[k])  # a sequence through the whole segment
        depth = int(pack.position_ids[a])
        assert pack.rows[owner, depth:depth + b - a].tolist() == list(range(a, b))
        parent_node = trie.parent[node_of_row[a]]
        if par == -1:
            assert parent_node == 0
        else:
            assert seg.start[par] <= row_of_node[parent_node] < seg.end[par]

    # Predictions: each occurrence once, from the row of its whole preceding context.
    occurrences = sorted(
        (s * pack.max_length + p, row_of_node[trie.paths[s][p - 1]], int(seq[p]))
        for s, seq in enumerate(seqs) for p in range(1, len(seq))
    )
    pred = pack.predictions
    got = sorted(zip(pred.index.tolist(), pred.source.tolist(), pred.target.tolist()))
    assert got == occurrences
    assert pack.prediction_mask.sum() == pack.num_predictions == len(occurrences)
    assert pack.num_prediction_rows == len({src for _, src, _ in occurrences})


@settings(max_examples=200, deadline=None)
@given(forests())
def test_random_forests_match_naive_trie(seqs):
    check_against_trie(seqs, TreePack.from_sequences(seqs))


@settings(max_examples=50, deadline=None)
@given(forests(vocab=2, max_len=30), st.integers(1, 9))
def test_padding_rows_see_only_themselves(seqs, multiple):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=multiple)
    T, Tp = pack.num_packed_rows, pack.num_rows
    assert Tp % multiple == 0 and T <= Tp < T + multiple
    check_against_trie(seqs, pack)
    dense = pack.dense_mask()
    assert torch.equal(dense[T:, :], torch.eye(Tp, dtype=torch.bool)[T:])
    assert not dense[:, T:].logical_and(~torch.eye(Tp, dtype=torch.bool)[:, T:]).any()
    assert (pack.input_ids[T:] == 0).all() and (pack.position_ids[T:] == 0).all()
    assert (pack.parent_row[T:] == -1).all()
    assert not (pack.rows >= T).any()


def test_sharing_needs_whole_preceding_context():
    # Same token at the same depth but different history: never one row.
    pack = TreePack.from_sequences([[1, 2, 3], [4, 2, 3]])
    assert pack.num_packed_rows == 6
    assert pack.rows[0, 1] != pack.rows[1, 1]


@pytest.mark.parametrize(
    "seqs, rows",
    [
        ([[5]], 1),
        ([[5], [5], [5]], 1),  # exact duplicates
        ([[1, 2, 3], [1, 2], [1]], 3),  # prefixes of others
        ([[1, 2], [3, 4], [5]], 5),  # unrelated: three trees
        ([[7, 7, 7, 7]], 4),
    ],
)
def test_edge_batches(seqs, rows):
    pack = TreePack.from_sequences(seqs)
    assert pack.num_packed_rows == rows
    check_against_trie(seqs, pack)


def test_input_types_agree():
    seqs = [[3, 1, 2, 2], [3, 1, 4], [0], [3, 1, 2]]
    ref = TreePack.from_sequences(seqs)
    variants = [
        [np.array(s, dtype=np.int32) for s in seqs],
        [np.array(s, dtype=np.uint8) for s in seqs],
        [torch.tensor(s) for s in seqs],
        [torch.tensor(s, dtype=torch.int32) for s in seqs],
        tuple(tuple(s) for s in seqs),
        [seqs[0], np.array(seqs[1]), torch.tensor(seqs[2]), seqs[3]],
    ]
    for v in variants:
        pack = TreePack.from_sequences(v)
        for name in ("input_ids", "position_ids", "subtree_end", "rows", "lengths"):
            assert torch.equal(getattr(pack, name), getattr(ref, name)), name
        assert pack.input_ids.dtype == pack.rows.dtype == torch.long


def test_token_ids_beyond_32_bits_sort_correctly():
    big = 2**40
    seqs = [[big + 1, 5], [big, 7], [big + 1, 5, 9], [3]]
    pack = TreePack.from_sequences(seqs)
    check_against_trie(seqs, pack)
    assert pack.num_packed_rows == 6


def test_sort_and_lcp_against_python():
    rng = random.Random(0)
    seqs = [[rng.randint(0, 3) for _ in range(rng.randint(1, 20))] for _ in range(300)]
    order, lcp = sort_and_lcp([np.array(s) for s in seqs])
    assert [seqs[i] for i in order] == sorted(seqs)
    for k in range(1, len(seqs)):
        a, b = seqs[order[k - 1]], seqs[order[k]]
        expect = os.path.commonprefix([a, b])
        assert lcp[k] == len(expect)


@pytest.mark.parametrize(
    "bad, error, words",
    [
        ([], ValueError, ["empty", "at least one"]),
        ([[1, 2], []], ValueError, ["sequence 1", "empty"]),
        ([[1, 2], [3, -100, 4]], ValueError, ["sequence 1", "-100", "position 1"]),
        ([[1.0, 2.0]], TypeError, ["sequence 0", "float64", "integers"]),
        ([torch.tensor([1.0, 2.0])], TypeError, ["sequence 0", "torch.float32"]),
        ([torch.tensor([True, False])], TypeError, ["sequence 0", "torch.bool"]),
        ([[[1, 2], [3, 4]]], ValueError, ["sequence 0", "1-D"]),
        (torch.ones(2, 3, dtype=torch.long), TypeError, ["2-D", "padding"]),
        ([["a", "b"]], TypeError, ["sequence 0", "integers"]),
        (5, TypeError, ["list"]),
    ],
)
def test_bad_input_names_value_rule_and_fix(bad, error, words):
    with pytest.raises(error) as info:
        TreePack.from_sequences(bad)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("multiple", [0, -4, 2.5])
def test_bad_padding_multiple(multiple):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        TreePack.from_sequences([[1, 2]], pad_to_multiple_of=multiple)


def test_to_device_moves_every_tensor_and_is_immutable():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=8)
    meta = pack.to("meta")
    tensors = [meta.input_ids, meta.position_ids, meta.subtree_end, meta.rows, meta.lengths,
               meta.prediction_mask, *meta.segments, *meta.predictions]
    assert all(t.device.type == "meta" for t in tensors)
    assert meta.num_packed_rows == pack.num_packed_rows and meta.host is pack.host
    assert pack.input_ids.device.type == "cpu"  # the original is untouched
    with pytest.raises(AttributeError):
        pack.num_packed_rows = 3
    built = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], device="meta")
    assert built.rows.device.type == "meta"


@pytest.mark.parametrize("args, kwargs", [
    ((torch.float32,), {}),  # Tensor.to would read this as a dtype
    (("cpu", torch.float64), {}),
    (("cpu",), {"dtype": torch.float16}),
    ((torch.zeros(1),), {}),  # Tensor.to would copy the dtype (and device) of a tensor
    (("float32",), {}),
])
def test_to_refuses_anything_but_a_device_and_keeps_integer_tables(args, kwargs):
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    dtypes = [t.dtype for t in (pack.input_ids, pack.position_ids, pack.parent_row, pack.rows)]
    with pytest.raises(TypeError) as info:
        pack.to(*args, **kwargs)
    message = str(info.value)
    assert message.startswith("TreePack.to(") and "integer tables" in message
    assert "device" in message
    if isinstance(args[0], torch.dtype):
        assert "TreePack.to(torch.float32)" in message
    assert [t.dtype for t in (pack.input_ids, pack.position_ids, pack.parent_row,
                              pack.rows)] == dtypes
    assert pack.to(torch.device("cpu")).input_ids.dtype == torch.int64


def test_unpack_maps_rows_to_original_layout():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [9]]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=16)
    ids = pack.unpack(pack.input_ids)
    for s, seq in enumerate(seqs):
        assert ids[s, : len(seq)].tolist() == seq
        assert (ids[s, len(seq):] == 0).all()
    hidden = torch.randn(pack.num_rows, 3, 2)
    out = pack.unpack(hidden)
    assert out.shape == (4, 4, 3, 2)
    assert torch.equal(out[1, 2], hidden[pack.rows[1, 2]])
    assert (out[2, 3] == 0).all()
    with pytest.raises(ValueError, match=r"out\[0\]"):
        pack.unpack(hidden[None])


def test_unpack_gradient_accumulates_shared_rows():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2]])
    x = torch.randn(pack.num_rows, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(pack.unpack, (x,))
    pack.unpack(x).sum().backward()
    uses = torch.bincount(pack.rows[pack.rows >= 0], minlength=pack.num_rows)
    assert torch.equal(x.grad, uses[:, None].double().expand(-1, 2))
    assert uses[0] == 4  # the root row is read by all four sequences


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(forests(vocab=2, max_sequences=40, max_len=80))
def test_large_random_forests_match_naive_trie(seqs):
    check_against_trie(seqs, TreePack.from_sequences(seqs, pad_to_multiple_of=16))


@pytest.mark.parametrize(
    "bad, words",
    [
        (torch.tensor([1, 2, 3]), ["one 1-D Tensor", "[ids]"]),
        ([1, 2, 3], ["sequence 0 is a single value (1)", "[[1, 2, 3]]"]),
        (["hello world"], ["sequence 0 is text ('hello world')", "tokenize it first"]),
    ],
)
def test_a_single_flat_sequence_is_told_to_wrap_it(bad, words):
    with pytest.raises(TypeError) as info:
        TreePack.from_sequences(bad)
    for w in words:
        assert w in str(info.value)


@settings(max_examples=60, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=10), st.sampled_from([None, 8]))
def test_padding_free_layout_is_the_sequences_back_to_back(seqs, pad):
    pack = TreePack.from_sequences(seqs, share_prefixes=False, pad_to_multiple_of=pad)
    lengths = [len(s) for s in seqs]
    offsets = np.cumsum([0] + lengths)
    T = offsets[-1]
    assert pack.num_packed_rows == pack.num_original_tokens == T and pack.token_ratio == 1.0
    assert pack.input_ids[:T].tolist() == [t for s in seqs for t in s]
    assert pack.position_ids[:T].tolist() == [p for n in lengths for p in range(n)]
    for s, n in enumerate(lengths):
        assert pack.rows[s, :n].tolist() == list(range(offsets[s], offsets[s] + n))
    # Each sequence sees itself causally, nothing else: block-diagonal causal.
    seq_of = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(pack.dense_mask()[:T, :T], causal & (seq_of[:, None] == seq_of[None, :]))
    shared = TreePack.from_sequences(seqs)
    assert torch.equal(pack.prediction_mask, shared.prediction_mask)
    assert torch.equal(pack.predictions.target, shared.predictions.target)
    assert torch.equal(pack.predictions.index, shared.predictions.index)
    with pytest.raises(TypeError, match="share_prefixes=1 must be True or False"):
        TreePack.from_sequences(seqs, share_prefixes=1)


@pytest.mark.parametrize("sequences, error, message", [
    ([[1, True, 3]], TypeError, "holds True at position 1"),
    ([[2**63, 1]], ValueError, "token id 9223372036854775808 beyond int64"),
    ([[2**64, 1]], ValueError, "token id 18446744073709551616 beyond int64"),
])
def test_bools_and_ids_beyond_int64_are_refused_by_name(sequences, error, message):
    with pytest.raises(error, match=message):
        TreePack.from_sequences(sequences)


def test_padding_multiple_is_bounded_and_numpy_integers_are_welcome():
    seqs = [[1, 2, 3], [1, 2, 4]]
    with pytest.raises(ValueError, match="pad_to_multiple_of=100000000 is more than 1,048,576"):
        TreePack.from_sequences(seqs, pad_to_multiple_of=10**8)
    assert TreePack.from_sequences(seqs, pad_to_multiple_of=np.int64(8)).num_rows == 8
    assert TreePack.empty(np.int32(4)).num_rows == 4
    with pytest.raises(ValueError, match="seq_ids holds 18446744073709551615, beyond int64"):
        TreePack.from_sequences(seqs, seq_ids=np.array([1, 2**64 - 1], dtype=np.uint64))


def test_completion_mask_marks_the_predictions_of_completion_tokens():
    pack = TreePack.from_sequences([[1, 2, 3, 4, 5], [1, 2, 6], [7, 8, 9, 9]])
    mask = pack.completion_mask([3, 2, 1])
    assert mask.tolist() == [[False, False, False, True, True],
                             [False, False, True, False, False],
                             [False, True, True, True, False]]
    assert torch.equal(pack.completion_mask(torch.zeros(3, dtype=torch.long)),
                       pack.prediction_mask)  # a zero prompt: every prediction
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\] = 4 but sequence 1 has 3"):
        pack.completion_mask([1, 4, 1])
    with pytest.raises(ValueError, match="must be 3 integers"):
        pack.completion_mask([1.0, 2.0, 1.0])


@settings(max_examples=60, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=10), st.sampled_from([None, 8]))
def test_flat_layout_holds_the_dense_layouts_valid_entries_in_order(seqs, pad):
    from treepack import logprobs_from_hidden
    from treepack.attention import TreeAttention

    dense = TreePack.from_sequences(seqs, pad_to_multiple_of=pad)
    flat = TreePack.from_sequences(seqs, pad_to_multiple_of=pad, layout="flat")
    assert (dense.layout, flat.layout) == ("dense", "flat") and "layout=flat" in repr(flat)
    valid = dense.rows >= 0  # row-major: sequence after sequence
    lengths = [len(s) for s in seqs]
    assert flat.offsets.tolist() == np.cumsum([0] + lengths).tolist()
    assert torch.equal(flat.offsets, dense.offsets)
    for name in ("input_ids", "position_ids", "subtree_end", "parent_row", "lengths"):
        assert torch.equal(getattr(flat, name), getattr(dense, name)), name
    assert torch.equal(flat.rows, dense.rows[valid])
    assert torch.equal(flat.prediction_mask, dense.prediction_mask[valid])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(dense.num_rows, 3, generator=g, dtype=torch.float64)
    for fn in ("token_logprobs", "token_entropy", "unpack"):
        assert torch.equal(getattr(flat, fn)(logits), getattr(dense, fn)(logits)[valid]), fn
    plens = torch.tensor([min(2, n) for n in lengths])
    assert torch.equal(flat.completion_mask(plens), dense.completion_mask(plens)[valid])
    h = torch.randn(dense.num_rows, 4, generator=g, dtype=torch.float64)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    # the same rows' log-softmax in another layout, float64
    assert_within(logprobs_from_hidden(flat, h, w), logprobs_from_hidden(dense, h, w)[valid],
                  FLOAT64_OP)
    q = torch.randn(1, 2, dense.num_rows, 8, generator=g, dtype=torch.float64)
    for backend in ("segment", "varlen"):
        assert torch.equal(TreeAttention(flat, backend)(q, q, q, window=3),
                           TreeAttention(dense, backend)(q, q, q, window=3)), backend


def test_flat_layout_never_pays_n_times_the_longest_sequence():
    # One 100,000-token sequence and 5,000 one-token ones: [N, L] tables would be 5,001 x
    # 100,000 (4.5 GB of int64 rows and bool masks; measured at 5.0 GB before the flat layout).
    import tracemalloc

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 1000, 100_000)] + [[int(t)] for t in rng.integers(1, 1000, 5000)]
    tracemalloc.start()
    pack = TreePack.from_sequences(seqs, layout="flat")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"
    assert pack.rows.shape == (105_000,) and pack.num_predictions == 99_999
    logps = pack.token_logprobs(torch.zeros(pack.num_rows, 1000))
    assert logps.shape == (105_000,)


def test_renamed_quantities_keep_their_old_names_for_one_release():
    import treepack
    from treepack.planner import plan

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=8)
    with pytest.warns(FutureWarning, match="num_packed_rows"):
        assert pack.num_tokens == pack.num_packed_rows == 4 and pack.num_rows == 8
    with pytest.warns(FutureWarning, match="packed_rows"):
        assert treepack.forest_stats([[1, 2, 3], [1, 2, 4]]).packed_tokens == 4
    p = plan([[1, 2, 3], [1, 2, 4]], max_tokens=8)
    with pytest.warns(FutureWarning, match="packed_rows"):
        assert p.rows == p.packed_rows == 4
    with pytest.warns(FutureWarning, match="packed_rows"):
        assert p.specs[0][0].rows == 4
