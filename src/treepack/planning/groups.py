"""Order a batch so that each group of rows lands whole in one rank and one mini-batch.

Trainers such as verl deal a batch out to data-parallel ranks as contiguous equal parts, and
each rank cuts its part into contiguous equal mini-batches. Rows that share a prefix (the n
rollouts of one prompt, the outputs of one agent session: a *group*) are packed together only
when they meet in the same forward, so the order of the batch decides what tree packing
saves. :func:`keep_groups_together` picks that order; it needs nothing but group labels and
per-row workloads.

Groups are dealt onto P parts of exactly C = N / P rows each:

1. A group larger than C fills ``size // C`` empty parts first (the fewest pieces it can
   have); its remainder is then placed like any other group.
2. Groups, heaviest first, go whole onto the least loaded part that still has room for them
   (longest processing time first, under a capacity). With equal group sizes and a group
   count divisible by P, every group finds room.
3. A group that found no part with room is cut, largest first, over the parts with the most
   room left, which gives it the fewest pieces. If any group was cut, steps 2-3 run once more
   with the largest group first (heavy small groups placed first can fragment the room a
   large one needs) and the order with fewer cut groups wins.

Inside each part the same steps run again, with the part's pieces as groups and its
mini-batches as parts. Fitting groups into fixed capacities is bin packing (NP-hard), so with
unequal group sizes a group can still be cut although a whole assignment exists; equal sizes
never are. Cost: one Python step per group with an O(P) numpy choice, at most twice; every
per-row step is vectorised.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from treepack.core.checks import positive_int

__all__ = ["keep_groups_together", "GroupOrder"]


class GroupOrder(NamedTuple):
    """A batch order from :func:`keep_groups_together`."""

    order: np.ndarray  # [N] row indices: part p is order[p*C:(p+1)*C], in mini-batches of M
    part_workload: np.ndarray  # [P] summed row workload per part
    groups_split_across_parts: int  # groups whose rows lie in more than one part
    groups_split_across_minibatches: int  # groups whose rows lie in more than one mini-batch


def keep_groups_together(group_of_row, workload_of_row, parts: int,
                         rows_per_minibatch: int | None = None) -> GroupOrder:
    """An order of the rows in which each group is whole in one part and one mini-batch
    wherever sizes allow, and parts carry similar workloads (algorithm: module docstring).

    Args:
        group_of_row: ``[N]`` labels (ints or strings); rows with equal labels form a group.
        workload_of_row: ``[N]`` finite costs >= 0 to balance (e.g. verl's
            ``calculate_workload(seq_len)``).
        parts: how many contiguous equal parts the order is cut into (data-parallel ranks).
        rows_per_minibatch: rows of each contiguous mini-batch inside a part; ``None``: the
            whole part is one mini-batch.

    Returns:
        A :class:`GroupOrder`: ``order`` lists every row exactly once; read as ``parts``
        contiguous parts of ``N / parts`` rows, each cut into contiguous mini-batches of
        ``rows_per_minibatch`` rows, a group's rows are adjacent inside each mini-batch they
        occupy. The same input gives the same order.

    Raises:
        ValueError: labels or workloads that are not 1-D of one length, a workload that is
            negative or not finite, ``N`` not a multiple of ``parts``, or a part size not a
            multiple of ``rows_per_minibatch`` (each message names the value and the fix).

    Example:
        >>> placed = keep_groups_together(["a", "b", "a", "b", "c", "c"], [1, 5, 1, 5, 2, 2],
        ...                               parts=3)
        >>> placed.order.reshape(3, 2).tolist(), placed.part_workload.tolist()
        ([[1, 3], [4, 5], [0, 2]], [10.0, 4.0, 2.0])
        >>> placed.groups_split_across_parts
        0
    """
    label, workload = _check_rows(group_of_row, workload_of_row)
    capacity, minibatch = _check_sizes(len(label), parts, rows_per_minibatch)
    part = _deal_rows(label, workload, parts, capacity)
    per_part = capacity // minibatch
    local = np.empty_like(part)  # mini-batch of each row inside its part
    for p in range(parts):
        mine = np.flatnonzero(part == p)
        piece = np.unique(label[mine], return_inverse=True)[1].reshape(-1)
        local[mine] = _deal_rows(piece, workload[mine], per_part, minibatch)
    minibatch_of_row = part * per_part + local
    order = np.lexsort((np.arange(len(label)), label, minibatch_of_row))
    return GroupOrder(order=order,
                      part_workload=np.bincount(part, weights=workload, minlength=parts),
                      groups_split_across_parts=_split_groups(label, part, parts),
                      groups_split_across_minibatches=_split_groups(
                          label, minibatch_of_row, parts * per_part))


def _check_rows(group_of_row, workload_of_row) -> tuple[np.ndarray, np.ndarray]:
    """Dense group numbers 0 .. G-1 (by sorted label) and float workloads, both ``[N]``."""
    labels = np.asarray(group_of_row)
    workload = np.asarray(workload_of_row, dtype=np.float64)
    if labels.ndim != 1 or labels.size == 0 or workload.shape != labels.shape:
        raise ValueError(f"group_of_row (shape {labels.shape}) and workload_of_row (shape "
                         f"{workload.shape}) must be 1-D with one entry per row, at least one")
    bad = np.flatnonzero(~np.isfinite(workload) | (workload < 0))
    if bad.size:
        raise ValueError(f"workload_of_row[{bad[0]}] = {workload[bad[0]]}: workloads must be "
                         "finite and >= 0 (e.g. verl's calculate_workload(seq_len))")
    return np.unique(labels, return_inverse=True)[1].reshape(-1), workload


def _check_sizes(rows: int, parts, rows_per_minibatch) -> tuple[int, int]:
    """Rows per part and rows per mini-batch."""
    parts = positive_int(parts, "parts", hint=" (data-parallel ranks)")
    if rows % parts:
        raise ValueError(f"{rows} rows do not split into parts={parts} equal parts: pad the "
                         f"batch to a multiple of {parts} rows first (verl's "
                         "upsample_batch_to_divisible_size does)")
    capacity = rows // parts
    if rows_per_minibatch is None:
        return capacity, capacity
    minibatch = positive_int(rows_per_minibatch, "rows_per_minibatch")
    if capacity % minibatch:
        raise ValueError(f"rows_per_minibatch={minibatch} does not divide the {capacity} rows "
                         f"of each part: use a divisor of {capacity}, or None for one "
                         "mini-batch per part")
    return capacity, minibatch


def _deal_rows(label: np.ndarray, workload: np.ndarray, bins: int, capacity: int) -> np.ndarray:
    """The bin of each row ``[n]``, ``n == bins * capacity``, groups dealt as the module
    docstring's steps 1-3 say; a cut group's rows go to its pieces in ascending row order."""
    size = np.bincount(label)
    by_label = np.argsort(label, kind="stable")
    # an item larger than a bin keeps its last rows (in row order) for the remainder that is
    # dealt like an item: its real workload, not a share of the item's
    whole = np.where(size > capacity, size // capacity * capacity, 0)
    rank = np.arange(len(label)) - np.repeat(np.cumsum(size) - size, size)
    in_rest = rank >= whole[label[by_label]]
    rest_load = np.bincount(label[by_label], weights=workload[by_label] * in_rest,
                            minlength=len(size))
    item, bin_of_piece, rows = _deal(size, rest_load, bins, capacity)
    by_item = np.argsort(item, kind="stable")  # pieces of one item in the order they were cut
    bin_of_row = np.empty(len(label), dtype=np.int64)
    bin_of_row[by_label] = np.repeat(bin_of_piece[by_item], rows[by_item])
    return bin_of_row


def _deal(size: np.ndarray, rest_load: np.ndarray, bins: int,
          capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces ``(item, bin, rows)`` of items of ``size`` rows dealt onto ``bins`` bins of
    exactly ``capacity`` rows each (``size.sum() == bins * capacity``); ``rest_load``: each
    item's workload less that of the whole bins an item larger than a bin fills."""
    free = np.full(bins, capacity, dtype=np.int64)
    pieces: list[tuple[int, int, int]] = []
    rest = size.copy()
    # 1. an item larger than a bin fills whole empty bins (every earlier one did too, so the
    #    empty bins are the next ones in index order)
    filled = 0
    for i in np.flatnonzero(size > capacity).tolist():
        whole = int(size[i]) // capacity
        pieces += [(i, b, capacity) for b in range(filled, filled + whole)]
        free[filled:filled + whole] = 0
        filled += whole
        rest[i] -= whole * capacity
    # 2. + 3. heaviest first; if that leaves an item to cut, largest first, and the fewer cuts
    ids = np.arange(len(size))
    placed = _place(np.lexsort((ids, -rest, -rest_load)), rest, rest_load, free)
    if placed.cut:
        by_size = _place(np.lexsort((ids, -rest_load, -rest)), rest, rest_load, free)
        placed = min(placed, by_size, key=lambda p: p.cut)
    item, bin_, rows = np.array(pieces + placed.pieces, dtype=np.int64).reshape(-1, 3).T
    return item, bin_, rows


class _Placed(NamedTuple):
    pieces: list[tuple[int, int, int]]  # (item, bin, rows)
    cut: int  # items cut over several bins


def _place(order: np.ndarray, rest: np.ndarray, load_of: np.ndarray,
           free: np.ndarray) -> _Placed:
    """Steps 2 and 3: items in ``order`` whole onto the least loaded bin with room, then
    those that found none cut, largest first, over the bins with the most room left."""
    free, load = free.copy(), np.zeros(len(free))
    pieces, left = [], []
    for i in order.tolist():
        need = int(rest[i])
        if need == 0:
            continue
        room = free >= need
        if not room.any():
            left.append(i)
            continue
        b = int(np.argmin(np.where(room, load, np.inf)))
        pieces.append((i, b, need))
        free[b] -= need
        load[b] += load_of[i]
    for i in sorted(left, key=lambda i: -int(rest[i])):
        need = int(rest[i])
        while need:
            b = int(np.argmax(free))
            take = min(need, int(free[b]))
            pieces.append((i, b, take))
            free[b] -= take
            need -= take
    return _Placed(pieces, len(left))


def _split_groups(label: np.ndarray, bin_of_row: np.ndarray, bins: int) -> int:
    """How many groups have rows in more than one bin."""
    pairs = np.unique(label * bins + bin_of_row)
    return int((np.bincount(pairs // bins) > 1).sum())
