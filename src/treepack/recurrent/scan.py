"""Recurrent scans over a pack's segments, level by level in fork depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.forest import ragged_arange
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["Level", "Levels", "levels", "row_levels", "level_scan", "scan_levels", "level_chunk"]


class Level(NamedTuple):
    """The chains at one fork depth, as one padded batch."""

    rows: Tensor  # [B, L] row of each position; ``Levels.size`` (a sink row) where padded
    real: Tensor  # [B, L] bool: a real row
    parent: Tensor | None  # [B] each chain's parent among the previous level's, None at 0
    real_index: Tensor  # [R] the real positions of ``rows.reshape(-1)``, in order
    last: np.ndarray  # [B] each chain's last row (host): its final state is the state there


class Levels(NamedTuple):
    """Every chain of a forest by depth (:func:`levels`, :func:`row_levels`)."""

    levels: list[Level]
    rows: Tensor  # [R] every chain row, level after level (real positions in order)
    size: int  # rows of the inputs (the sink row's index)


@derived_from_pack
def levels(pack: TreePack) -> Levels:
    """The pack's scan chains grouped by depth (roots first), each level a padded batch of
    row indices (cached per pack).

    A chain is a run of segments each of which has exactly one child: nothing reads the state
    between them but that child, so one kernel call scans them all. A chain ends at a fork or
    a leaf. An agent trajectory whose steps extend each other is one chain; a GRPO group is a
    prompt chain and one chain per response.

    Args:
        pack: the pack.

    Returns:
        :class:`Levels`.
    """
    h = pack.host
    parent = h.segment_parent
    count = len(parent)
    children = np.bincount(parent[parent >= 0], minlength=count)
    # pre-order: a segment's only child is the next segment, so chains are index runs
    head = (parent < 0) | (children[np.maximum(parent, 0)] != 1)
    heads = np.flatnonzero(head)
    chain_of = np.cumsum(head) - 1
    last = np.append(heads[1:] - 1, count - 1) if count else heads
    up = np.where(parent[heads] >= 0, chain_of[np.maximum(parent[heads], 0)], -1)
    return _by_depth(h.segment_start[heads], h.segment_end[last], up, pack.num_rows,
                     pack.device)


def row_levels(parent: np.ndarray, cut_after: np.ndarray, device) -> Levels:
    """The scan chains of a forest given row by row: what :func:`levels` gives for a pack,
    for any rows in pre-order (one part of a tree, :mod:`treepack.planning.parts`).

    A chain ends at a row with other than one child, whose child is not the next row, or
    where ``cut_after`` asks for the state (a row other forwards continue from).

    Args:
        parent: ``[n]`` each row's parent among these rows, -1 at a root (pre-order: a
            parent comes before its children).
        cut_after: ``[n]`` bool, rows whose state must be a chain's final state.
        device: where the index tensors go.

    Returns:
        :class:`Levels` over the ``n`` rows (the sink row is ``n``).
    """
    n = parent.shape[0]
    children = np.bincount(parent[parent >= 0], minlength=n)
    idx = np.arange(n)
    follows = np.zeros(n, dtype=bool)  # row j continues row j - 1's chain
    follows[1:] = ((parent[1:] == idx[:-1]) & (children[:-1] == 1) & ~cut_after[:-1])
    heads = np.flatnonzero(~follows)
    chain_of = np.cumsum(~follows) - 1
    ends = np.append(heads[1:], n)
    up = np.where(parent[heads] >= 0, chain_of[np.maximum(parent[heads], 0)], -1)
    return _by_depth(heads, ends, up, n, device)


def _by_depth(start: np.ndarray, end: np.ndarray, up: np.ndarray, size: int, device) -> Levels:
    """Chains ``[start, end)`` with parent chains ``up`` (-1 at roots; a chain's parent ends
    at the row above its start) as one padded batch per depth."""
    depth = np.zeros(len(start), dtype=np.int64)
    hop = up.copy()
    while (hop >= 0).any():  # one vectorised step per level of the chain tree
        depth += hop >= 0
        hop = np.where(hop >= 0, up[np.maximum(hop, 0)], -1)
    out, all_rows, previous = [], [], None
    for d in range(int(depth.max()) + 1 if len(depth) else 0):
        chains = np.flatnonzero(depth == d)
        length = end[chains] - start[chains]
        width = int(length.max())
        pos = np.arange(width)
        real = pos[None, :] < length[:, None]
        rows = np.where(real, start[chains][:, None] + pos[None, :], size)
        parent_of = None if previous is None else torch.from_numpy(
            np.searchsorted(previous, up[chains])).to(device)
        out.append(Level(torch.from_numpy(rows).to(device), torch.from_numpy(real).to(device),
                         parent_of, torch.from_numpy(np.flatnonzero(real)).to(device),
                         end[chains] - 1))
        all_rows.append(ragged_arange(start[chains], length))
        previous = chains
    flat = np.concatenate(all_rows) if all_rows else np.zeros(0, dtype=np.int64)
    return Levels(out, torch.from_numpy(flat).to(device), size)


Kernel = Callable[[dict, Tensor | None], tuple[Tensor, Tensor]]


def level_scan(pack: TreePack, kernel: Kernel, inputs: dict[str, Tensor]) -> Tensor:
    """A recurrent scan over every path of the tree, exact at each branch point.

    For each level of :func:`levels`, the level's chains of segments are gathered from
    ``inputs`` into one padded batch and ``kernel(batch, initial_state)`` runs them, each from
    its parent chain's final state (zeros, ``None``, at the roots). Padded positions hold zeros: the
    kernel must leave a state unchanged over zero inputs (a zero gate / step / key), which
    the adapters arrange per family.

    Args:
        pack: the pack the inputs belong to.
        kernel: ``(batch {name: [B, L, ...]}, initial_state [B, ...] or None) -> (out
            [B, L, ...], final_state [B, ...])``, the family's own scan.
        inputs: ``{name: [T', ...]}`` per-row inputs, one row per row of the pack.

    Returns:
        ``[T', ...]`` outputs per row (zeros at the pack's padding rows); autograd flows to the
        inputs through every level and every parent's final state.
    """
    return scan_levels(levels(pack), kernel, inputs)[0]


def scan_levels(plan: Levels, kernel: Kernel, inputs: dict[str, Tensor],
                initial: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
    """:func:`level_scan` over any chain plan, its roots starting from ``initial``.

    Args:
        plan: the chains (:func:`levels` or :func:`row_levels`).
        kernel: as :func:`level_scan`.
        inputs: ``{name: [plan.size, ...]}`` per-row inputs.
        initial: ``[B0, ...]`` the first level's starting states (zeros where a chain starts
            a sequence), or None for zeros everywhere.

    Returns:
        ``([plan.size, ...]`` outputs, each level's ``[B, ...]`` final states).
    """
    padded = {k: torch.cat([v, v.new_zeros((1, *v.shape[1:]))]) for k, v in inputs.items()}
    values, finals, states = [], [], initial
    # index_select, not advanced indexing: its backward is an index_add, where indexing's
    # is an accumulating index_put, 11x slower on a CPU (measured at [2k, 1k] float32)
    for level in plan.levels:
        shape = tuple(level.rows.shape)
        batch = {k: v.index_select(0, level.rows.reshape(-1)).view(*shape, *v.shape[1:])
                 for k, v in padded.items()}
        start = states if level.parent is None else states.index_select(0, level.parent)
        out, states = kernel(batch, start)
        finals.append(states)
        values.append(out.reshape(-1, *out.shape[2:]).index_select(0, level.real_index))
    first = next(iter(inputs.values()))
    if not values:
        return first.new_zeros((plan.size, *first.shape[1:])), finals
    out = torch.cat(values)
    return out.new_zeros((plan.size, *out.shape[1:])).index_put((plan.rows,), out), finals


def level_chunk(chunk_size: int, width: int) -> int:
    """The chunk size a tree level of ``width`` rows scans with: the layer's own, or, for a
    level shorter than it, the power of two (at least 16) that holds the level.

    The chunked scans are exact for any chunk size (it sets how the sum is split, not what it
    sums), and the torch forms (transformers', megatron-core's) pad every call to whole
    chunks: a tree's short levels (a GRPO group's prompt chain, an agent's tool steps) would
    otherwise each pay a whole chunk per chain (Falcon-H1's 256), more than the run of every
    sequence alone pays.
    """
    if width >= chunk_size:
        return chunk_size
    return min(chunk_size, max(16, 1 << max(width - 1, 0).bit_length()))
