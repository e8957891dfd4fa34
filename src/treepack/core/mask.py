"""Tree attention masks from the interval form ``j <= i < subtree_end[j]``.

Everything here is O(T) in the rows, except :func:`dense_mask` (the T x T reference) and the
block tables of :func:`block_mask`, which are (T / block_size)^2 as FlexAttention's format is.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.checks import positive_int

__all__ = ["dense_mask", "tree_mask_mod", "block_mask"]


def dense_mask(subtree_end: Tensor) -> Tensor:
    """BoolTensor [T, T], True where query row i may attend key row j.

    The slow reference for tests and small packs (T^2 booleans).
    """
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    q, kv = idx[:, None], idx[None, :]
    return (kv <= q) & (q < subtree_end[None, :])


def tree_mask_mod(subtree_end: Tensor, position_ids: Tensor | None = None,
                  window: int | None = None, blocks: Tensor | None = None):
    """FlexAttention ``mask_mod`` for a packed forest: ancestors and self only, and with a
    sliding ``window`` only keys fewer than ``window`` positions (depths) back. With
    ``blocks`` (``[T]`` block ids, -1 outside any block) the rows of one block also see each
    other both ways, within the window's lower bound (Gemma 3's image tokens)."""

    def tree_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    if window is not None and position_ids is None:
        raise ValueError("a sliding-window mask needs the pack's position_ids")

    def near(q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return position_ids[q_idx] - position_ids[kv_idx] < window

    def tree_window_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return tree_mask(b, h, q_idx, kv_idx) & near(q_idx, kv_idx)

    base = tree_mask if window is None else tree_window_mask
    if blocks is None:
        return base

    def tree_block_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (blocks[q_idx] == blocks[kv_idx]) & (blocks[q_idx] >= 0)
        if window is not None:
            same = same & near(q_idx, kv_idx)
        return base(b, h, q_idx, kv_idx) | same

    return tree_block_mask


class _BlockRanges(NamedTuple):
    """Per key block: the query blocks that see it, and those that see it whole."""

    seen_until: np.ndarray  # [nb] query blocks c .. seen_until - 1 see key block c
    full_until: np.ndarray  # [nb] query blocks c+1 .. full_until - 1 see every pair
    diag_full: np.ndarray  # [nb] a diagonal block is full only when it holds one row
    pos_min: np.ndarray | None  # [nb] with a window: depth extremes of each block
    pos_max: np.ndarray | None


def block_mask(subtree_end: np.ndarray, *, block_size: int, device, mask_mod,
               position_ids: np.ndarray | None = None, window: int | None = None,
               blocks: np.ndarray | None = None):
    """A FlexAttention ``BlockMask`` for the rows whose subtree ends are ``subtree_end``.

    With per-block ``max_end`` / ``min_end`` of ``subtree_end`` and block size B, the key
    block c is seen by query blocks ``c .. ceil(max_end[c] / B) - 1`` and is full (every
    pair visible, no ``mask_mod`` needed) for query blocks ``c+1 .. f[c] - 1`` where
    ``f[c] = floor(min_end[c] / B)``, or all later ones when ``min_end[c] = T``; a diagonal
    block is full only when it holds a single row. Both the key-side tables (forward) and
    the query-side tables (backward) come straight from these ranges.

    With a sliding ``window`` (and the rows' ``position_ids``), a block is also skipped when
    even its closest pair is ``window`` or more positions apart, and full only when even its
    farthest pair is closer; blocks in between are partial and ``mask_mod`` decides.

    With ``blocks`` (``[T]`` ids of row blocks that see each other both ways, -1 outside;
    each block's rows contiguous), every pair of table blocks a row block spans is also
    partial (unless already full): ``mask_mod`` (:func:`tree_mask_mod` with the same
    ``blocks``) decides inside.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = positive_int(block_size, "block_size", hint=" (e.g. 128)")
    t = int(subtree_end.shape[0])
    ranges = _block_ranges(subtree_end, position_ids, block_size, window)
    nb = ranges.seen_until.shape[0]
    cols = np.arange(nb)
    part, full = _block_flags(ranges, cols[:, None], cols[None, :], window)  # forward
    part_t, full_t = _block_flags(ranges, cols[None, :], cols[:, None], window)  # backward
    if blocks is not None:  # rows seeing later rows of their block: partial there
        both = _spanned_pairs(blocks, block_size, nb)
        part |= both & ~full
        part_t |= both.T & ~full_t
    kv_num, kv_idx = _ordered(part, device)
    full_kv_num, full_kv_idx = _ordered(full, device)
    q_num, q_idx = _ordered(part_t, device)
    full_q_num, full_q_idx = _ordered(full_t, device)
    return BlockMask(
        seq_lengths=(t, t),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
    )


def _block_ranges(subtree_end: np.ndarray, position_ids: np.ndarray | None, block_size: int,
                  window: int | None) -> _BlockRanges:
    t = int(subtree_end.shape[0])
    nb = -(-t // block_size)
    tail = nb * block_size - t
    ends = subtree_end.reshape(-1)
    max_end = np.pad(ends, (0, tail), constant_values=0).reshape(nb, block_size).max(1)
    min_end = np.pad(ends, (0, tail), constant_values=t).reshape(nb, block_size).min(1)
    rows = np.minimum(block_size, t - np.arange(nb) * block_size)
    pos_min = pos_max = None
    if window is not None:
        pos = np.pad(position_ids.reshape(-1), (0, tail), mode="edge").reshape(nb, block_size)
        pos_min, pos_max = pos.min(1), pos.max(1)
    return _BlockRanges(seen_until=-(-max_end // block_size),
                        full_until=np.where(min_end >= t, nb, min_end // block_size),
                        diag_full=rows == 1, pos_min=pos_min, pos_max=pos_max)


def _block_flags(r: _BlockRanges, q: np.ndarray, k: np.ndarray, window: int | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Dense [partial, full] flags of (query block q, key block k), broadcast."""
    full = (k < q) & (q < r.full_until[k]) | (k == q) & r.diag_full[k]
    seen = (k <= q) & (q < r.seen_until[k])
    if window is not None:
        full &= r.pos_max[q] - r.pos_min[k] < window
        seen &= r.pos_min[q] - r.pos_max[k] < window
    return seen & ~full, full


def _spanned_pairs(row_blocks: np.ndarray, block_size: int, nb: int) -> np.ndarray:
    """Dense [nb, nb] flags: table blocks (q, k) that both hold rows of one row block. Each
    row block spans table blocks ``lo .. hi``; the squares ``[lo, hi]^2`` are summed as a 2-D
    difference array, so the work is O(blocks + nb^2), no loop."""
    rows = np.flatnonzero(row_blocks >= 0)
    ids = row_blocks[rows]
    count = int(ids.max()) + 1 if ids.size else 0
    lo = np.full(count, nb, dtype=np.int64)
    hi = np.full(count, -1, dtype=np.int64)
    np.minimum.at(lo, ids, rows // block_size)
    np.maximum.at(hi, ids, rows // block_size)
    used = hi >= 0
    lo, hi = lo[used], hi[used] + 1
    diff = np.zeros((nb + 1, nb + 1), dtype=np.int64)
    np.add.at(diff, (lo, lo), 1)
    np.add.at(diff, (lo, hi), -1)
    np.add.at(diff, (hi, lo), -1)
    np.add.at(diff, (hi, hi), 1)
    return diff.cumsum(0).cumsum(1)[:nb, :nb] > 0


def _ordered(dense: np.ndarray, device) -> tuple[Tensor, Tensor]:
    """FlexAttention's ordered format: per row, the listed columns ascending, then the rest
    ascending. A stable sort of booleans is a radix sort in numpy."""
    count = dense.sum(-1, dtype=np.int32)
    cols = np.argsort(~dense, axis=-1, kind="stable").astype(np.int32)
    return (torch.from_numpy(count)[None, None].to(device),
            torch.from_numpy(cols)[None, None].to(device))
