import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treepack import TreePack
from treepack.attention import BACKENDS, TreeAttention, segment

from strategies import forests, random_blocks
from tolerance import FLOAT32_OP, FLOAT64_OP, assert_within, low_precision, scale

# One float64 attention computed two ways (a backend and the reference): a softmax and a
# weighted sum over a sequence's rows (at most 80 here), scores over 8 dims: FLOAT64_OP of the
# values' size, outputs and gradients alike; a gradient that cancels (zero for a key no query
# sees) is as large as its terms, products of unit-normal inputs: size 1 at least.


def close(got, want):
    assert_within(got, want, FLOAT64_OP, size=max(scale(want), 1.0))


def reference_attention(q, k, v, pack, *, scale, softcap=None, window=None, sinks=None,
                        chunk=None, blocks=None):
    """Each sequence alone: causal attention over its own path, nothing shared; with
    ``chunk``, positions i and j see each other only within one chunk (``i // chunk == j //
    chunk``), as Llama 4's chunked attention masks a sequence.

    A row shared by several sequences takes its output from the first sequence through it;
    padding rows attend only themselves. ``sinks`` (one logit per query head, GPT-OSS's
    ``s_aux``) join every softmax as a column that attends to nothing, as transformers'
    eager GPT-OSS attention does. ``blocks`` (a block id per row, -1 outside): positions of
    one block also see each other both ways, within the window's lower bound, as
    transformers composes Gemma 3's image blocks (``AND(window, OR(causal, block))``).
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    rows, vals = [], []
    seen = set()
    for s in range(pack.num_sequences):
        path = pack.rows[s, : int(pack.lengths[s])]
        n = path.shape[0]
        scores = q[0][:, path] @ k[0][:, path].transpose(-1, -2) * scale  # [H, n, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = j <= i
        if blocks is not None:
            b = blocks[path]
            visible = visible | ((b[:, None] == b[None, :]) & (b[:, None] >= 0))
        if window is not None:
            visible &= i - j < window
        if chunk is not None:
            visible &= i // chunk == j // chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks[:, None, None].expand(-1, n, 1)
            probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
        out = probs @ v[0][:, path]
        for p, r in enumerate(path.tolist()):
            if r not in seen:
                seen.add(r)
                rows.append(r)
                vals.append(out[:, p])
    for r in range(pack.num_packed_rows, pack.num_rows):
        rows.append(r)
        vals.append(v[0][:, r])
    assert sorted(rows) == list(range(pack.num_rows))
    result = torch.stack(vals, dim=1)  # [H, T', D] in `rows` order
    return result[:, torch.tensor(rows).argsort()][None]


def qkv(pack, heads=4, kv_heads=2, dim=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = pack.num_rows
    make = lambda h: torch.randn(1, h, T, dim, generator=g, dtype=dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


options = st.fixed_dictionaries({
    "softcap": st.sampled_from([None, 2.0]),
    "window": st.sampled_from([None, 1, 3, 7]),
    "heads": st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    "pad": st.sampled_from([None, 8]),
    # segment: every shape its own call, the default cost model, or one padded call
    "call_cost": st.sampled_from([0, segment.CALL_COST, 1 << 50]),
})


@contextlib.contextmanager
def call_cost(value):
    """The segment backend's grouping with ``value`` as the cost of a call."""
    original = segment.CALL_COST
    segment.CALL_COST = value
    try:
        yield
    finally:
        segment.CALL_COST = original


@settings(max_examples=120, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=14), options,
       st.sampled_from(["segment", "dense", "varlen", "auto"]), st.booleans())
def test_backends_equal_each_sequence_alone(seqs, opt, backend, share):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"], share_prefixes=share)
    q, k, v = qkv(pack, *opt["heads"])
    kw = dict(scale=0.3, softcap=opt["softcap"], window=opt["window"])
    if backend == "varlen" and opt["softcap"]:
        with pytest.raises(RuntimeError, match="no logit soft-capping.*flex.*segment"):
            TreeAttention(pack, backend)(q, k, v, **kw)
        return
    with call_cost(opt["call_cost"]):
        got = TreeAttention(pack, backend)(q, k, v, **kw)
    expect = reference_attention(q, k, v, pack, **kw)
    close(got, expect)


@settings(max_examples=40, deadline=None)
@given(forests(vocab=3, max_sequences=5, max_len=10), options, st.sampled_from(["segment",
                                                                               "varlen"]))
def test_gradients_equal_reference(seqs, opt, backend):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    if backend == "varlen":
        opt["softcap"] = None
    q, k, v = (x.requires_grad_() for x in qkv(pack, *opt["heads"]))
    kw = dict(scale=0.3, softcap=opt["softcap"], window=opt["window"])
    weight = torch.randn(1, q.shape[1], pack.num_rows, q.shape[-1], dtype=q.dtype)
    with call_cost(opt["call_cost"]):
        got = torch.autograd.grad((TreeAttention(pack, backend)(q, k, v, **kw) * weight).sum(),
                                  (q, k, v))
    expect = torch.autograd.grad((reference_attention(q, k, v, pack, **kw) * weight).sum(),
                                 (q, k, v))
    for a, b in zip(got, expect):
        close(a, b)


@settings(max_examples=60, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=14), options,
       st.sampled_from(["segment", "dense", "auto", "varlen"]))
def test_attention_sinks_equal_each_sequence_alone(seqs, opt, backend):
    """A sink logit per query head (GPT-OSS, Granite-SWA, MiMo-V2-Flash, Flint) in every
    softmax, windows included: outputs and the gradients of q, k, v and the sinks equal
    each sequence alone (its padding rows, which nothing reads, left out)."""
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    q, k, v = (x.requires_grad_() for x in qkv(pack, *opt["heads"]))
    sinks = torch.randn(q.shape[1], dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    sinks.requires_grad_()
    kw = dict(scale=0.3, window=opt["window"])
    with call_cost(opt["call_cost"]):
        got = TreeAttention(pack, backend)(q, k, v, sinks=sinks, **kw)
    expect = reference_attention(q, k, v, pack, sinks=sinks, **kw)
    real = pack.num_packed_rows
    close(got[:, :, :real], expect[:, :, :real])
    weight = torch.randn(got.shape, dtype=q.dtype)
    weight[:, :, real:] = 0
    for a, b in zip(torch.autograd.grad((got * weight).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((expect * weight).sum(), (q, k, v, sinks))):
        close(a, b)


def assert_equal_to_each_alone(got, q, k, v, pack, **kw):
    """``got`` and the gradients of ``q``, ``k``, ``v`` through it equal each sequence alone
    (:func:`reference_attention` with ``kw``), its padding rows, which nothing reads, left
    out."""
    expect = reference_attention(q, k, v, pack, **kw)
    real = pack.num_packed_rows
    close(got[:, :, :real], expect[:, :, :real])
    weight = torch.randn(got.shape, dtype=q.dtype)
    weight[:, :, real:] = 0
    for a, b in zip(torch.autograd.grad((got * weight).sum(), (q, k, v)),
                    torch.autograd.grad((expect * weight).sum(), (q, k, v))):
        close(a, b)


@settings(max_examples=80, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=14), options,
       st.sampled_from(["segment", "dense", "auto", "varlen"]), st.sampled_from([1, 2, 3, 5]),
       st.booleans())
def test_chunked_attention_equals_each_sequence_alone(seqs, opt, backend, chunk, sinks):
    """Llama 4's chunked attention: a query sees the keys of its own chunk of depths only,
    on any forest, with windows, GQA, padded groups and sinks: outputs and the gradients of
    q, k, v equal each sequence alone (on varlen: chains cut at chunk starts)."""
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    q, k, v = (x.requires_grad_() for x in qkv(pack, *opt["heads"]))
    kw = dict(scale=0.3, window=opt["window"], chunk=chunk)
    if sinks:
        kw["sinks"] = torch.randn(q.shape[1], dtype=q.dtype,
                                  generator=torch.Generator().manual_seed(1))
    with call_cost(opt["call_cost"]):
        got = TreeAttention(pack, backend)(q, k, v, **kw)
    assert_equal_to_each_alone(got, q, k, v, pack, **kw)


@settings(max_examples=80, deadline=None)
@given(forests(vocab=3, max_sequences=6, max_len=14), options,
       st.sampled_from(["segment", "dense", "auto", "varlen"]), st.integers(0, 1000),
       st.booleans())
def test_blocks_equal_each_sequence_alone(seqs, opt, backend, seed, small_chunks):
    """Rows of one block (Gemma 3's image tokens) see each other both ways, on any forest,
    with windows, soft-capping, GQA, padded groups and masked groups run a few queries at a
    time (a chunk's keys reach past its last query, to the block's end): outputs and the
    gradients of q, k, v equal each sequence alone with the same blocks. On varlen: two
    calls, the rows outside blocks causally and each block both ways."""
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    q, k, v = (x.requires_grad_() for x in qkv(pack, *opt["heads"]))
    blocks = random_blocks(pack, seed)
    if backend == "varlen":
        opt["softcap"] = None  # varlen has none (refused by name elsewhere)
    kw = dict(scale=0.3, window=opt["window"], softcap=opt["softcap"], blocks=blocks)
    original = segment.CHUNK_ELEMENTS
    segment.CHUNK_ELEMENTS = 16 if small_chunks else original
    try:
        with call_cost(opt["call_cost"]):
            got = TreeAttention(pack, backend)(q, k, v, **kw)
    finally:
        segment.CHUNK_ELEMENTS = original
    assert_equal_to_each_alone(got, q, k, v, pack, **kw)


def test_blocks_change_the_output_and_are_refused_where_not_run():
    pack = TreePack.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6]])
    q, k, v = qkv(pack)
    blocks = torch.tensor([-1, 0, 0, 0, -1, -1, -1])[:pack.num_rows]
    both_ways = TreeAttention(pack, "segment")(q, k, v, blocks=blocks)
    assert (both_ways - TreeAttention(pack, "segment")(q, k, v)).abs()[:, :, 1:3].min() > 1e-6
    with pytest.raises(ValueError, match="blocks with attention sinks or chunked"):
        TreeAttention(pack, "segment")(q, k, v, blocks=blocks, chunk=2)
    with pytest.raises(ValueError, match="int64 \\[T'=6\\]"):
        TreeAttention(pack, "segment")(q, k, v, blocks=blocks[:3])


def test_chunked_attention_changes_the_output_and_is_refused_where_not_run():
    pack = TreePack.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8]])
    q, k, v = qkv(pack, 4, 2)
    chunked = TreeAttention(pack, "segment")(q, k, v, chunk=2)
    assert (chunked - TreeAttention(pack, "segment")(q, k, v)).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match="backend='flex' cannot run here: chunked "
                                           "attention.*segment / dense / varlen"):
        TreeAttention(pack, "flex")(q, k, v, chunk=2)
    with pytest.raises(ValueError, match="chunk"):
        TreeAttention(pack, "segment")(q, k, v, chunk=0)


def test_attention_sinks_change_the_output_and_are_refused_where_not_run():
    """A negative control (without the sink the outputs differ), and the backends that do
    not run sinks yet say so, naming the one that does; a sink per head is checked."""
    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6, 7]])
    q, k, v = qkv(pack, 4, 2)
    sinks = torch.zeros(4, dtype=q.dtype)
    with_sink = TreeAttention(pack, "segment")(q, k, v, sinks=sinks)
    assert (with_sink - TreeAttention(pack, "segment")(q, k, v)).abs().max() > 1e-3
    with torch.no_grad(), pytest.raises(RuntimeError, match="backend='flex' cannot run here: "
                                        ".*CPU kernel returns no log-sum-exp.*'segment'"):
        TreeAttention(pack, "flex")(q, k, v, sinks=sinks)
    with pytest.raises(ValueError, match=r"one logit per query head \(4,\)"):
        TreeAttention(pack, "segment")(q, k, v, sinks=torch.zeros(2, dtype=q.dtype))
    with pytest.raises(ValueError, match="softcap=2.0 with attention sinks"):
        TreeAttention(pack, "segment")(q, k, v, sinks=sinks, softcap=2.0)


@pytest.mark.parametrize("backend, softcap", [("segment", 1.5), ("varlen", None)])
def test_gradcheck_with_shared_rows(backend, softcap):
    pack = TreePack.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 2], [7, 8]],
                                   pad_to_multiple_of=4)
    q, k, v = (x.requires_grad_() for x in qkv(pack, 2, 1, 4))
    attend = TreeAttention(pack, backend)
    assert torch.autograd.gradcheck(lambda q, k, v: attend(q, k, v, window=3, softcap=softcap),
                                    (q, k, v))


def test_segment_groups_equal_shapes_into_one_call():
    # 8 rollouts of one prompt with equal lengths: the first rollout continues the prompt's
    # chain (10 rows, no context); the other 7 read the prompt as context, one call for them.
    # A call is worth about 8k scores at 8 heads of 64: the two shapes run as one padded call.
    from treepack.attention import segment

    seqs = [[1] * 6 + [10 + i] * 4 for i in range(8)]
    pack = TreePack.from_sequences(seqs)
    groups = segment.shape_groups(pack, None, width=8 * 64).groups
    assert [(g.q, g.kv, g.size, g.padding is None) for g in groups] == [(10, 10, 8, False)]
    big = TreePack.from_sequences([[1] * 600 + [10 + i] * 400 for i in range(8)])
    groups = segment.shape_groups(big, None, width=8 * 64).groups  # padding would cost more
    assert sorted((g.q, g.kv, g.size, g.padding) for g in groups) == [(400, 1000, 7, None),
                                                                       (1000, 1000, 1, None)]


def test_merge_shapes_is_the_cheapest_partition_into_runs():
    import itertools

    from treepack.attention.segment import merge_shapes

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 7))
        kv = rng.integers(1, 60, n)  # any order: runs are contiguous in the order given
        q = np.minimum(rng.integers(1, 60, n), kv)
        count = rng.integers(1, 5, n)
        call_cost = float(rng.choice([0, 10, 300, 5000]))
        best = np.inf
        for cuts in itertools.product([False, True], repeat=n - 1):  # every run partition
            ends = [i + 1 for i, c in enumerate(cuts) if c] + [n]
            cost, a = 0.0, 0
            for b in ends:
                cost += call_cost + count[a:b].sum() * q[a:b].max() * kv[a:b].max()
                a = b
            best = min(best, cost)
        call, cost = merge_shapes(q, kv, count, call_cost)
        assert np.all(np.diff(call) <= 0) or np.all(np.diff(call) >= 0)  # runs
        got = sum(call_cost + count[call == r].sum() * q[call == r].max() * kv[call == r].max()
                  for r in np.unique(call))
        assert got == best and cost == best  # integer costs below 2^53: float64 holds them


@pytest.fixture(scope="module")
def cpu_flex_forward():
    return lambda pack, q, k, v, **kw: TreeAttention(pack, "flex", block_size=16)(q, k, v, **kw)


@pytest.mark.parametrize("softcap, window, heads", [(None, None, (4, 2)), (2.0, 5, (2, 2))])
def test_flex_forward_on_cpu_equals_segment(cpu_flex_forward, softcap, window, heads):
    seqs = [[1, 2, 3] * 5 + [4] * i + [5] * 7 for i in range(6)] + [[9] * 20, [1, 2, 8] * 6]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=16)
    q, k, v = qkv(pack, *heads, dim=16, dtype=torch.float32)
    kw = dict(scale=0.25, softcap=softcap, window=window)
    with torch.no_grad():
        got = cpu_flex_forward(pack, q, k, v, **kw)
    expect = TreeAttention(pack, "segment")(q.double(), k.double(), v.double(), **kw)
    assert_within(got.double(), expect, FLOAT32_OP)  # one attention in float32


@pytest.mark.parametrize("window, heads, seed", [(None, (4, 2), 0), (5, (2, 2), 1)])
def test_flex_blocks_forward_on_cpu_equals_segment(cpu_flex_forward, window, heads, seed):
    """Blocks (Gemma 3's image rows) on flex: one more mask_mod rule, and the block tables
    list every pair of 16-row blocks an image spans (several images cross block edges
    here), through the compiled CPU kernel."""
    seqs = [[1, 2, 3] * 5 + [4] * i + [5] * 7 for i in range(6)] + [[9] * 20, [1, 2, 8] * 6]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=16)
    q, k, v = qkv(pack, *heads, dim=16, dtype=torch.float32)
    blocks = random_blocks(pack, seed)
    b, edge = blocks.numpy(), np.arange(15, pack.num_rows - 1, 16)
    assert np.any((b[edge] >= 0) & (b[edge] == b[edge + 1]))  # an image across a block edge
    kw = dict(scale=0.25, window=window, blocks=blocks)
    with torch.no_grad():
        got = cpu_flex_forward(pack, q, k, v, **kw)
    expect = TreeAttention(pack, "segment")(q.double(), k.double(), v.double(), **kw)
    assert_within(got.double(), expect, FLOAT32_OP)


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention uncompiled: the same BlockMask, mask_mod and log-sum-exp, computed as
    dense scores (float64 works; the compiled CPU kernel returns no log-sum-exp). Forward
    only: PyTorch refuses a CPU flex backward either way."""
    from torch.nn.attention import flex_attention as module

    from treepack.attention import flex

    monkeypatch.setattr(module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # no warning
    monkeypatch.setattr(flex, "compiled_flex", lambda: module.flex_attention)
    monkeypatch.setattr(flex, "unsupported", lambda *args, **kwargs: [])


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forests(vocab=3, max_sequences=6, max_len=14), options, st.booleans(),
       st.integers(0, 1000))
def test_flex_sinks_and_blocks_equal_each_sequence_alone(eager_flex, seqs, opt, off_by_one,
                                                         seed):
    """Sinks on flex (the log-sum-exp renormalised: out * sigmoid(lse - sink)), off-by-one
    sinks (a zero logit) among them, and blocks, on any forest with windows and GQA, float64
    through the uncompiled kernel: equal to each sequence alone."""
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=opt["pad"])
    q, k, v = qkv(pack, *opt["heads"])
    sinks = torch.zeros(q.shape[1], dtype=q.dtype) if off_by_one else torch.randn(
        q.shape[1], dtype=q.dtype, generator=torch.Generator().manual_seed(seed))
    attend = TreeAttention(pack, "flex", block_size=8)
    for kw in (dict(sinks=sinks), dict(blocks=random_blocks(pack, seed))):
        kw.update(scale=0.3, window=opt["window"])
        with torch.no_grad():
            got = attend(q, k, v, **kw)
        real = pack.num_packed_rows  # padding rows: nothing reads them
        close(got[:, :, :real], reference_attention(q, k, v, pack, **kw)[:, :, :real])


def test_sinks_through_a_differentiable_log_sum_exp_train_as_a_sink_key():
    """What flex's sinks rely on: ``out * sigmoid(lse - sink)`` over any attention that
    differentiates its log-sum-exp (FlexAttention does, on a GPU) has the gradients of the
    softmax with a sink column, for q, k, v and the sink. Here the attention is a dense
    float64 one; on a GPU bench/gpu.py checks flex itself."""
    from treepack.attention.flex import with_sinks

    pack = TreePack.from_sequences([[1, 2, 3, 4, 5], [1, 2, 6, 7], [8, 9]])
    q, k, v = (x.requires_grad_() for x in qkv(pack, 4, 2))
    sinks = torch.randn(4, dtype=q.dtype, requires_grad=True)

    def dense_with_lse(q, k, v):
        kr, vr = (x.repeat_interleave(2, 1) for x in (k, v))
        scores = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~pack.dense_mask(), float("-inf"))
        return scores.softmax(-1) @ vr, scores.logsumexp(-1)

    got = with_sinks(*dense_with_lse(q, k, v), sinks)
    want = TreeAttention(pack, "segment")(q, k, v, scale=0.3, sinks=sinks)
    close(got, want)
    weights = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad((got * weights).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((want * weights).sum(), (q, k, v, sinks))):
        close(g, w)


def test_flex_refuses_cpu_backward_and_dropout():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=16)
    q, k, v = qkv(pack, dtype=torch.float32)
    attend = TreeAttention(pack, "flex")
    with pytest.raises(RuntimeError, match="no FlexAttention backward on CPU.*segment"):
        attend(q.requires_grad_(), k, v)
    with torch.no_grad(), pytest.raises(RuntimeError, match="dropout=0.1"):
        attend(q, k, v, dropout=0.1)


def test_window_block_mask_lists_every_visible_block():
    from reference import block_tables

    seqs = [[1] * 30 + [2] * i + [3] * 25 for i in range(0, 40, 7)] + [[4] * 50]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=8)
    T = pack.num_rows
    pos = pack.position_ids
    for window, block in [(1, 4), (5, 8), (17, 16), (100, 8)]:
        visible = pack.dense_mask() & (pos[:, None] - pos[None, :] < window)
        idx = torch.arange(T)
        assert torch.equal(pack.mask_mod(window=window)(None, None, idx[:, None], idx[None, :]),
                           visible)
        partial, full, q_partial, q_full = block_tables(pack.block_mask(block, window=window))
        nb = -(-T // block)
        v = torch.nn.functional.pad(visible, (0, nb * block - T, 0, nb * block - T))
        v = v.view(nb, block, nb, block)
        inside = torch.nn.functional.pad(torch.ones(T, T, dtype=torch.bool),
                                         (0, nb * block - T, 0, nb * block - T))
        inside = inside.view(nb, block, nb, block)
        any_visible = v.any(3).any(1)
        all_visible = (v | ~inside).all(3).all(1)
        assert not (partial & full).any()
        assert torch.equal(any_visible & ~(partial | full), torch.zeros_like(any_visible))
        assert not (full & ~all_visible).any()  # a full block never needs the mask
        assert torch.equal(q_partial, partial.T) and torch.equal(q_full, full.T)


def test_input_errors():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    q, k, v = qkv(pack)
    with pytest.raises(ValueError, match="choose one of"):
        TreeAttention(pack, "flash_attention_2")
    attend = TreeAttention(pack, "segment")
    with pytest.raises(ValueError, match="T'=4"):
        attend(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="multiple"):
        attend(q[:, :3], k, v)
    with pytest.raises(ValueError, match="window"):
        attend(q, k, v, window=0)
    assert sorted(BACKENDS) == ["dense", "flex", "segment", "varlen"]


def test_flex_refuses_to_fall_back_to_the_unfused_path(monkeypatch):
    from treepack.attention import flex

    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 2)
    flex.compiled_flex.cache_clear()  # a fresh compiled function, no shapes yet
    rng = __import__("random").Random(5)
    try:
        with pytest.raises(RuntimeError, match="compiled 2 times in this process.*segment"):
            for length in (48, 64, 80):
                seqs = [[rng.randint(0, 2) for _ in range(rng.randint(1, 6))] for _ in range(4)]
                pack = TreePack.from_sequences(seqs, pad_to_multiple_of=length)
                q, k, v = qkv(pack, 2, 2, 16, dtype=torch.float32)
                with torch.no_grad():
                    out = TreeAttention(pack, "flex", block_size=16)(q, k, v, scale=0.25)
                ref = TreeAttention(pack, "dense")(q, k, v, scale=0.25)
                assert_within(out, ref, FLOAT32_OP)  # one attention in float32, two ways
    finally:
        flex.compiled_flex.cache_clear()


@settings(max_examples=30, deadline=None)
@given(forests(vocab=2, max_sequences=5, max_len=20), st.sampled_from([(None, 3), (2.0, None),
                                                                       (1.5, 4)]))
def test_segment_masked_groups_in_small_chunks_equal_the_reference(seqs, cap_window):
    from treepack.attention import segment

    softcap, window = cap_window
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=4)
    q, k, v = (x.requires_grad_() for x in qkv(pack, 4, 2))
    kw = dict(scale=0.3, softcap=softcap, window=window)
    original = segment.CHUNK_ELEMENTS
    segment.CHUNK_ELEMENTS = 16  # a handful of queries per chunk
    try:
        got = TreeAttention(pack, "segment")(q, k, v, **kw)
    finally:
        segment.CHUNK_ELEMENTS = original
    expect = reference_attention(q, k, v, pack, **kw)
    close(got, expect)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)),
                    torch.autograd.grad(expect.sum(), (q, k, v))):
        close(a, b)


def test_auto_runs_segment_on_cpu_and_logs_its_choice_once(caplog):
    import logging

    from treepack import attention

    attention._LOGGED.clear()
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    q, k, v = qkv(pack)
    with caplog.at_level(logging.INFO, logger="treepack"):
        for _ in range(3):
            got = TreeAttention(pack)(q, k, v)
    assert TreeAttention(pack).backend == "auto"
    torch.testing.assert_close(got, TreeAttention(pack, "segment")(q, k, v), rtol=0, atol=0)
    assert [r.getMessage() for r in caplog.records].count(
        "treepack attention backend='auto' runs 'segment' (on cpu, where varlen and flex cannot "
        "train)") == 1


@pytest.mark.parametrize("dtype, head_dim, softcap, dropout, expect, why", [
    (torch.bfloat16, 64, None, 0.0, "varlen", "applies"),
    (torch.float16, 128, None, 0.0, "varlen", "applies"),
    (torch.float32, 64, None, 0.0, "flex", "float16 / bfloat16, not torch.float32"),
    (torch.bfloat16, 64, 50.0, 0.0, "flex", "no logit soft-capping"),
    (torch.bfloat16, 100, None, 0.0, "flex", "head_dim=100"),
    (torch.bfloat16, 64, None, 0.1, "segment", "FlexAttention has no attention dropout"),
])
def test_auto_on_cuda_prefers_varlen_then_flex_then_segment(monkeypatch, dtype, head_dim,
                                                            softcap, dropout, expect, why):
    # The decision alone, on stand-ins for CUDA tensors (this machine has no GPU).
    from types import SimpleNamespace

    from treepack.attention import choose_backend, varlen

    monkeypatch.setattr(varlen, "_capability", lambda index: (9, 0))
    fake = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0), dtype=dtype,
                           shape=(1, 8, 128, head_dim), requires_grad=True)
    backend, reason = choose_backend(fake, fake, fake, softcap=softcap, dropout=dropout)
    assert backend == expect and why in reason


@pytest.mark.parametrize("feature, dtype, expect, why", [
    ("chunk", torch.bfloat16, "varlen", "applies"),
    ("chunk", torch.float32, "segment", "flex has no chunked attention"),
    ("sinks", torch.bfloat16, "flex", "sinks on varlen are not yet checked on a GPU"),
    ("blocks", torch.bfloat16, "flex", "blocks on varlen are not yet checked on a GPU"),
    ("blocks", torch.float32, "flex", "float16 / bfloat16"),
])
def test_auto_on_cuda_picks_per_layer_kind(monkeypatch, feature, dtype, expect, why):
    """Chunks on varlen; sinks and blocks on flex until a GPU run checks them on varlen."""
    from types import SimpleNamespace

    from treepack.attention import choose_backend, varlen

    monkeypatch.setattr(varlen, "_capability", lambda index: (9, 0))
    fake = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0), dtype=dtype,
                           shape=(1, 8, 128, 64), requires_grad=True)
    backend, reason = choose_backend(fake, fake, fake, softcap=None, dropout=0.0,
                                     **{feature: object()})
    assert backend == expect and why in reason


def test_varlen_refuses_what_flash_cannot_do_and_says_why():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    q, k, v = qkv(pack)
    with pytest.raises(RuntimeError, match="varlen.*dropout=0.1.*segment"):
        TreeAttention(pack, "varlen")(q, k, v, dropout=0.1)


def test_flex_refuses_float64_on_cpu_with_its_reason():
    # It used to end in a 100-line InductorError from the compiled CPU template.
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=16)
    q, k, v = qkv(pack, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="backend='flex' cannot run here: "
                                                            ".*does not take float64.*segment"):
        TreeAttention(pack, "flex")(q, k, v)


@pytest.mark.parametrize("backend", ["segment", "dense"])
def test_mixed_dtypes_under_cpu_autocast_attend_as_autocast_casts(backend):
    """What a model's rotary embedding hands over under autocast: float32 queries and keys,
    bfloat16 values. Chains of one exact shape below a fork take SDPA's bottom-right causal
    bias, which checks dtypes before autocast casts them; the result is the reference on
    bfloat16 inputs."""
    g = np.random.default_rng(0)
    prompt = g.integers(0, 50, 100).tolist()  # long chains at 16 x 64 wide heads: padding
    pack = TreePack.from_sequences([prompt + g.integers(0, 50, 100).tolist() for _ in "ab"])
    assert not any(grp.padding for grp in segment.shape_groups(pack, None, 16 * 64).groups)
    q, k, v = qkv(pack, heads=16, kv_heads=16, dim=64, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = TreeAttention(pack, backend)(q, k, v.bfloat16(), scale=0.3)
    assert out.dtype == torch.bfloat16
    inputs = [t.bfloat16() for t in (q, k, v)]
    want = reference_attention(*(t.double() for t in inputs), pack, scale=0.3)
    # the rule for low precision: within twice PyTorch's own bfloat16 error (the reference
    # itself in bfloat16) against float64 on the same bfloat16 inputs
    own = float((reference_attention(*inputs, pack, scale=0.3).double() - want).abs().max())
    error = float((out.double() - want).abs().max())
    assert low_precision(error, own), (error, own)
