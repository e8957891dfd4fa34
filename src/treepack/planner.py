"""Plan a step: split a batch into packs under a row budget, balanced across ranks.

A real batch does not fit one forward, and real training runs on several data-parallel ranks.
``plan`` decides which sequences go into which pack on which rank; packs are built on demand
(each rank builds only its own). The budget counts distinct rows per pack.

1. Sort and take adjacent LCPs once for the whole batch: the prefix forest's trees are the runs
   of sorted sequences between LCPs of zero, and a tree's rows are known without building it.
2. A tree that fits the budget stays whole (every shared prefix computed once). A larger tree
   is cut into runs of consecutive sorted sequences; each run repeats its ancestor path, so a
   cut before sequence k costs ``lcp[k]`` extra rows and cuts go where the LCP is smallest.
   Every sequence lands whole in exactly one pack.
3. The pieces are spread over ranks by estimated cost, largest first onto the least loaded
   rank, then bin-packed into packs per rank (best fit, largest first). The first try keeps
   each rank within the fewest packs that could hold the batch, ``m0``; if a rank then needs
   more, costs are balanced freely and every rank gets as many packs as the fullest needs.
   Ranks with fewer packs get empty ones, so every rank runs the same number of forwards.
   At most two passes of O(P log P) in the pieces P.

Cost of a pack = rows + ``pair_cost`` x visible attention pairs. For a model of hidden size
d, linear layers cost about 24 d^2 FLOPs per row and layer and attention 4 d per visible
pair, so ``pair_cost`` ~ 1 / (6 d); the default assumes d = 4096.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from treepack.forest import sort_and_lcp
from treepack.checks import positive_int
from treepack.tree import MAX_PAD_MULTIPLE, TreePack, validate_sequences

__all__ = ["plan", "Plan", "PackSpec", "PAIR_COST"]

PAIR_COST = 1.0 / (6 * 4096)


class PackSpec(NamedTuple):
    """One pack of a plan, before it is built."""

    seq_ids: np.ndarray  # indices of its sequences in the planned batch (ascending)
    rows: int  # distinct rows (padding excluded)
    pairs: int  # visible (query, key) pairs
    cost: float  # rows + pair_cost * pairs


@dataclasses.dataclass(eq=False)
class Plan:
    """Packs per rank; ``ranks[r]`` is rank r's list of TreePacks (built on first access)."""

    specs: list[list[PackSpec]]  # [rank][pack]
    min_rows: int  # rows of the whole batch as one forest: the lower bound
    max_tokens: int
    pad_to_multiple_of: int | None
    _sequences: list[np.ndarray] = dataclasses.field(repr=False)
    _device: torch.device | str | None = dataclasses.field(default=None, repr=False)
    _built: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.specs)

    @property
    def packs_per_rank(self) -> int:
        return len(self.specs[0])

    @property
    def rows(self) -> int:
        """Rows over every pack (padding excluded)."""
        return sum(p.rows for rank in self.specs for p in rank)

    @property
    def efficiency(self) -> float:
        """Rows over the one-forest minimum (1.0: no prefix computed twice)."""
        return self.rows / max(self.min_rows, 1)

    @property
    def rank_costs(self) -> list[float]:
        return [sum(p.cost for p in rank) for rank in self.specs]

    @property
    def imbalance(self) -> float:
        """The most loaded rank's estimated cost over the mean (1.0: perfect balance)."""
        costs = self.rank_costs
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def packs(self, rank: int) -> list[TreePack]:
        """Rank ``rank``'s packs, built on first use (empty packs where it has fewer)."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not (
                0 <= rank < self.world_size):
            raise ValueError(f"rank={rank!r}: this plan has ranks 0 .. {self.world_size - 1}")
        rank = int(rank)
        if rank not in self._built:
            pad = self.pad_to_multiple_of
            self._built[rank] = [
                TreePack.from_sequences([self._sequences[i] for i in spec.seq_ids],
                                        seq_ids=spec.seq_ids, pad_to_multiple_of=pad,
                                        device=self._device)
                if len(spec.seq_ids) else TreePack.empty(pad or 1, device=self._device)
                for spec in self.specs[rank]
            ]
        return self._built[rank]

    @property
    def ranks(self) -> list[list[TreePack]]:
        """Every rank's packs (each rank usually needs only ``packs(rank)``)."""
        return [self.packs(r) for r in range(self.world_size)]

    def __str__(self) -> str:
        n = sum(len(p.seq_ids) for rank in self.specs for p in rank)
        return (f"Plan({n} sequences -> {self.world_size} ranks x {self.packs_per_rank} packs "
                f"<= {self.max_tokens} rows; rows {self.rows} = {self.efficiency:.3f} x the "
                f"one-forest minimum {self.min_rows}; rank imbalance {self.imbalance:.3f})")


def _pairs(length: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Visible pairs a sequence adds: its rows at depths shared .. length-1 see depth + 1 keys."""
    return (length * (length + 1) - shared * (shared + 1)) // 2


def _split_tree(a: int, b: int, s_len, new, lcp, budget) -> list[tuple[int, int]]:
    """Cut sorted sequences a..b-1 (one tree) into runs that each fit ``budget`` rows."""
    runs = []
    i = a
    while i < b:
        # a run starting at i costs its full length, then each next sequence its new rows
        rest = np.cumsum(new[i + 1:b])
        reach = i + 1 + int(np.searchsorted(rest, budget - s_len[i], side="right"))
        if reach >= b:
            runs.append((i, b))
            break
        window = lcp[i + 1:reach + 1]  # cutting before k repeats lcp[k] rows
        cut = i + 1 + int(np.flatnonzero(window == window.min())[-1])
        runs.append((i, cut))
        i = cut
    return runs


def _best_fit_decreasing(rows: np.ndarray, budget: int) -> list[list[int]]:
    """Items (largest first) into the fullest bin they fit, bins of ``budget`` rows.

    Open bins are kept by their free rows: a sorted list of the distinct free-row values
    (at most ``min(budget + 1, bins)`` of them) and a stack of bins per value, so each item
    costs one bisection over the distinct values, never a pass over the bins.
    """
    bins: list[list[int]] = []
    rooms: list[int] = []  # distinct free-row values of open bins, ascending
    at_room: dict[int, list[int]] = {}  # free rows -> bins with exactly that room
    for item in np.argsort(-rows, kind="stable").tolist():
        size = int(rows[item])
        i = bisect.bisect_left(rooms, size)
        if i < len(rooms):
            room = rooms[i]
            b = at_room[room].pop()
            if not at_room[room]:
                del at_room[room], rooms[i]
        else:
            room, b = budget, len(bins)
            bins.append([])
        bins[b].append(item)
        left = room - size
        if left not in at_room:
            at_room[left] = []
            bisect.insort(rooms, left)
        at_room[left].append(b)
    return bins


def _assign(rows: np.ndarray, costs: np.ndarray, ranks: int, room: int | None) -> np.ndarray | None:
    """The rank of each piece: costliest first onto the least loaded rank (longest processing
    time first), among ranks with ``room`` rows still free if given; None if a piece finds
    no rank with room."""
    owner = np.empty(len(rows), dtype=np.int64)
    heap = [(0.0, r) for r in range(ranks)]  # (load, rank)
    free = [room] * ranks
    for k in np.argsort(-costs, kind="stable").tolist():
        size, skipped = int(rows[k]), []
        while heap:
            load, r = heapq.heappop(heap)
            if room is None or free[r] >= size:
                break
            skipped.append((load, r))
        else:
            return None
        owner[k] = r
        if room is not None:
            free[r] -= size
        heapq.heappush(heap, (load + float(costs[k]), r))
        for item in skipped:
            heapq.heappush(heap, item)
    return owner


def plan(sequences, *, max_tokens: int, world_size: int = 1,
         pad_to_multiple_of: int | None = None, pair_cost: float = PAIR_COST,
         device: torch.device | str | None = None) -> Plan:
    """Split ``sequences`` into packs of at most ``max_tokens`` distinct rows over
    ``world_size`` ranks, keeping shared prefixes together and costs balanced.

    Returns a :class:`Plan`: ``plan.ranks[r]`` (or ``plan.packs(r)``) is rank r's list of
    :class:`TreePack`, every rank the same length; each pack's ``seq_ids`` are the indices of
    its sequences in ``sequences``. Every sequence is in exactly one pack. ``plan.efficiency``
    is rows over the one-forest minimum and ``plan.imbalance`` the most loaded rank's cost over
    the mean. With ``pad_to_multiple_of``, ``max_tokens`` must be a multiple of it (padded
    packs stay within the budget).
    """
    max_tokens = positive_int(max_tokens, "max_tokens", hint=" (rows per pack)")
    world_size = positive_int(world_size, "world_size", hint=" (data-parallel ranks)")
    if isinstance(pair_cost, bool) or not isinstance(pair_cost, numbers.Real) or not (
            math.isfinite(pair_cost) and pair_cost >= 0):
        raise ValueError(f"pair_cost={pair_cost!r} must be a finite number >= 0 (the cost of "
                         "a visible attention pair in rows; default 1 / (6 x 4096))")
    if pad_to_multiple_of is not None:
        pad_to_multiple_of = positive_int(pad_to_multiple_of, "pad_to_multiple_of",
                                          maximum=MAX_PAD_MULTIPLE)
        if max_tokens % pad_to_multiple_of:
            raise ValueError(
                f"max_tokens={max_tokens} is not a multiple of pad_to_multiple_of="
                f"{pad_to_multiple_of}: a padded pack could exceed the budget; use "
                f"max_tokens={max_tokens // pad_to_multiple_of * pad_to_multiple_of or pad_to_multiple_of}"
            )
    ids = validate_sequences(sequences)
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}: a "
            "sequence is never split across packs (its predictions need its whole prefix); "
            f"raise max_tokens to at least {int(lengths.max())} or truncate it"
            + (f" ({too_long.size} sequences are too long)" if too_long.size > 1 else "")
        )
    order, lcp = sort_and_lcp(ids)
    s_len = lengths[order]
    new = s_len - lcp
    seq_pairs = _pairs(s_len, lcp)

    # Pieces: whole trees, or runs of a tree too big for the budget.
    tree_start = np.flatnonzero(lcp == 0)
    tree_end = np.append(tree_start[1:], len(ids))
    tree_rows = np.add.reduceat(new, tree_start)
    starts, ends = [tree_start[tree_rows <= max_tokens]], [tree_end[tree_rows <= max_tokens]]
    for t in np.flatnonzero(tree_rows > max_tokens):
        runs = np.array(_split_tree(tree_start[t], tree_end[t], s_len, new, lcp, max_tokens))
        starts.append(runs[:, 0])
        ends.append(runs[:, 1])
    start, end = np.concatenate(starts), np.concatenate(ends)
    by_start = np.argsort(start, kind="stable")  # number the pieces in sorted order
    start, end = start[by_start], end[by_start]
    first = lcp[start]  # a run's first sequence repeats its shared prefix
    piece_rows = np.add.reduceat(new, start) + first
    piece_pairs = np.add.reduceat(seq_pairs, start) + first * (first + 1) // 2
    piece_cost = piece_rows + pair_cost * piece_pairs

    # Pieces onto ranks by cost (largest first onto the least loaded rank), then each rank's
    # pieces into packs (best fit, largest first). First try the fewest packs per rank that
    # could hold the rows, m0, keeping each rank within m0 packs' rows; if some rank then needs
    # more packs, balance costs freely and give every rank as many packs as the fullest needs.
    m0 = max(1, -(-int(piece_rows.sum()) // (world_size * max_tokens)))
    for room in (m0 * max_tokens, None):
        owner = _assign(piece_rows, piece_cost, world_size, room)
        if owner is None:
            continue
        mine = [np.flatnonzero(owner == r) for r in range(world_size)]
        bins = [[mine[r][b] for b in _best_fit_decreasing(piece_rows[mine[r]], max_tokens)]
                for r in range(world_size)]
        m = max(len(b) for b in bins)
        if room is None or m <= m0:
            break

    tree_of = np.searchsorted(tree_start, start, side="right") - 1
    rows_of, pairs_of = piece_rows.tolist(), piece_pairs.tolist()
    specs = []
    for r in range(world_size):
        rank_specs = []
        for members in bins[r]:
            if len(members) == 1:  # the common case under a tight budget: no numpy per pack
                (p,) = members
                rows, pairs = rows_of[p], pairs_of[p]
                rank_specs.append(PackSpec(np.sort(order[start[p]:end[p]]), rows, pairs,
                                           rows + pair_cost * pairs))
                continue
            pieces = np.sort(members)  # pieces are numbered in sorted order
            rows, pairs = int(piece_rows[pieces].sum()), int(piece_pairs[pieces].sum())
            # Two runs of one split tree in the same pack share their common prefix again.
            for p, q in zip(pieces[:-1], pieces[1:]):
                if tree_of[p] == tree_of[q]:
                    shared = int(lcp[end[p]:start[q] + 1].min())
                    rows -= shared
                    pairs -= shared * (shared + 1) // 2
            sorted_pos = np.concatenate([np.arange(start[p], end[p]) for p in pieces])
            rank_specs.append(PackSpec(seq_ids=np.sort(order[sorted_pos]), rows=rows,
                                       pairs=pairs, cost=rows + pair_cost * pairs))
        rank_specs.sort(key=lambda p: -p.cost)  # micro-step j of every rank: similar costs
        empty = PackSpec(np.zeros(0, dtype=np.int64), 0, 0, 0.0)
        specs.append(rank_specs + [empty] * (m - len(rank_specs)))
    return Plan(specs=specs, min_rows=int(new.sum()), max_tokens=max_tokens,
                pad_to_multiple_of=pad_to_multiple_of, _sequences=ids, _device=device)
