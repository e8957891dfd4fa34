import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack

from reference import block_tables
from strategies import forests, random_blocks
from tolerance import FLOAT32_OP, assert_within


def pooled(mask: torch.Tensor, block: int):
    """(any, all) of each block of a dense [T, T] mask; pairs beyond T do not count."""
    T = mask.shape[0]
    nb = -(-T // block)
    pad = nb * block - T
    m = F.pad(mask, (0, pad, 0, pad)).view(nb, block, nb, block)
    inside = F.pad(torch.ones(T, T, dtype=torch.bool), (0, pad, 0, pad)).view(nb, block, nb, block)
    return m.any(3).any(1), (m | ~inside).all(3).all(1)


def check_block_mask(pack: TreePack, block: int):
    bm = pack.block_mask(block)
    assert bm.seq_lengths == (pack.num_rows, pack.num_rows)
    assert bm.BLOCK_SIZE == (block, block)
    anyb, allb = pooled(pack.dense_mask(), block)
    partial, full, q_partial, q_full = block_tables(bm)
    assert torch.equal(full, anyb & allb)
    assert torch.equal(partial, anyb & ~allb)
    assert torch.equal(q_partial, partial.T) and torch.equal(q_full, full.T)
    # Ordered format: listed blocks first, ascending, as create_block_mask lays them out.
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_q_num_blocks, bm.full_q_indices)):
        for r in range(idx.shape[-2]):
            listed = idx[0, 0, r, : num[0, 0, r]].tolist()
            assert listed == sorted(listed)
            assert sorted(idx[0, 0, r].tolist()) == list(range(idx.shape[-1]))


@settings(max_examples=60, deadline=None)
@given(forests(vocab=2, max_sequences=10, max_len=40), st.sampled_from([1, 2, 3, 5, 8, 16, 128]),
       st.sampled_from([None, 4, 7]))
def test_block_mask_occupancy_equals_dense(seqs, block, multiple):
    check_block_mask(TreePack.from_sequences(seqs, pad_to_multiple_of=multiple), block)


@settings(max_examples=40, deadline=None)
@given(forests(vocab=3, max_len=20))
def test_mask_mod_equals_dense_mask(seqs):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=4)
    idx = torch.arange(pack.num_rows)
    got = pack.mask_mod()(None, None, idx[:, None], idx[None, :])
    assert torch.equal(got, pack.dense_mask())


@settings(max_examples=60, deadline=None)
@given(forests(vocab=2, max_sequences=8, max_len=30), st.sampled_from([1, 2, 3, 8, 128]),
       st.sampled_from([None, 2, 5]), st.integers(0, 1000))
def test_block_mask_with_blocks_covers_every_visible_pair(seqs, block, window, seed):
    """Blocks of rows that see each other both ways (Gemma 3's image tokens): the mask_mod
    is the dense rule, full tables are all visible, every visible pair lies in a listed
    block; without a window every listed block holds a visible pair. (A block that only
    images make all visible stays partial: mask_mod runs there, still exact.)"""
    from treepack.core import mask as _mask

    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=4)
    blocks = random_blocks(pack, seed)
    idx = torch.arange(pack.num_rows)
    pos = pack.position_ids
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    dense = pack.dense_mask() | same
    if window is not None:
        dense &= pos[:, None] - pos[None, :] < window
    mask_mod = _mask.tree_mask_mod(pack.subtree_end, pos, window, blocks)
    assert torch.equal(mask_mod(None, None, idx[:, None], idx[None, :]), dense)
    bm = _mask.block_mask(pack.host.subtree_end, block_size=block, device="cpu",
                          mask_mod=mask_mod, position_ids=pack.host.position_ids,
                          window=window, blocks=blocks.numpy())
    anyb, allb = pooled(dense, block)
    partial, full, q_partial, q_full = block_tables(bm)
    assert not (full & ~allb).any() and not (partial & full).any()
    assert not (anyb & ~(partial | full)).any()
    if window is None:
        assert torch.equal(partial | full, anyb)
    assert torch.equal(q_partial, partial.T) and torch.equal(q_full, full.T)


def test_block_mask_of_a_large_pack_stays_small():
    # 262,144 rows: a T x T bool would need 64 GiB, the block tables need a few MB.
    seqs = [torch.arange(4096) + 5000 * i for i in range(64)]
    pack = TreePack.from_sequences(seqs)
    assert pack.num_rows == 2**18
    bm = pack.block_mask(128)
    nb = 2**18 // 128
    assert bm.kv_indices.shape == (1, 1, nb, nb)
    # 64 independent chains of 32 blocks: each query block sees its chain's earlier blocks
    # in full and its diagonal block partially.
    within = torch.arange(nb) % 32
    assert torch.equal(bm.full_kv_num_blocks[0, 0], within.int())
    assert torch.equal(bm.kv_num_blocks[0, 0], torch.ones(nb, dtype=torch.int32))


def test_bad_block_size():
    pack = TreePack.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="block_size"):
        pack.block_mask(0)


@pytest.fixture(scope="module")
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@pytest.mark.parametrize("multiple, block", [(None, 128), (64, 64)])
def test_flex_forward_on_cpu_equals_sdpa_with_dense_mask(compiled_flex, multiple, block):
    rng = random.Random(multiple)
    seqs = [[rng.randint(0, 2) for _ in range(rng.randint(1, 90))] for _ in range(10)]
    seqs += [seqs[0][:40] + [7] * 30, [8] * 50]  # a long fork and a second tree
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=multiple)
    T = pack.num_rows
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, T, 16, generator=g) for _ in range(3))
    out = compiled_flex(q, k, v, block_mask=pack.block_mask(block))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=pack.dense_mask())
    assert_within(out, ref, FLOAT32_OP)  # one float32 attention, two kernels
    # Siblings really are invisible: perturbing one branch's values leaves the others alone.
    d_row = int(pack.rows[-1, 10])  # a row of the [8] * 50 tree
    v2 = v.clone()
    v2[:, :, d_row] += 100.0
    out2 = compiled_flex(q, k, v2, block_mask=pack.block_mask(block))
    changed = (out2 - out).abs().amax(dim=(0, 1, 3)) > 0
    assert torch.equal(changed, pack.dense_mask()[:, d_row])
