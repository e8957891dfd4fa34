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

from treepack.core import deprecation
from treepack.core.checks import (positive_int, validate_keys, validate_routes,
                                  validate_sequences)
from treepack.core.forest import (causal_pairs, identities, ragged_arange, route_keys,
                                  sort_and_lcp)
from treepack.core.tree import MAX_PAD_MULTIPLE, TreePack

__all__ = ["plan", "Plan", "PackSpec", "PAIR_COST"]

PAIR_COST = 1.0 / (6 * 4096)


class PackSpec(NamedTuple):
    """One pack of a plan, before it is built."""

    seq_ids: np.ndarray  # indices of its sequences in the planned batch (ascending)
    packed_rows: int  # distinct rows (padding excluded)
    pairs: int  # visible (query, key) pairs
    cost: float  # packed_rows + pair_cost * pairs

    @property
    def rows(self) -> int:
        """Deprecated: :attr:`packed_rows`."""
        deprecation.warn("PackSpec.rows", "PackSpec.packed_rows")
        return self.packed_rows


@dataclasses.dataclass(eq=False)
class Plan:
    """Packs per rank; ``ranks[r]`` is rank r's list of TreePacks (built on first access)."""

    specs: list[list[PackSpec]]  # [rank][pack]
    min_rows: int  # rows of the whole batch as one forest: the lower bound
    max_tokens: int
    pad_to_multiple_of: int | None
    _sequences: list[np.ndarray] = dataclasses.field(repr=False)
    _device: torch.device | str | None = dataclasses.field(default=None, repr=False)
    _keys: list[np.ndarray] | None = dataclasses.field(default=None, repr=False)
    _routes: list[np.ndarray] | None = dataclasses.field(default=None, repr=False)
    _built: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.specs)

    @property
    def packs_per_rank(self) -> int:
        return len(self.specs[0])

    @property
    def built_ranks(self) -> list[int]:
        """The ranks whose packs :meth:`packs` has built so far."""
        return sorted(self._built)

    @property
    def packed_rows(self) -> int:
        """Packed rows over every pack (padding excluded)."""
        return sum(p.packed_rows for rank in self.specs for p in rank)

    @property
    def rows(self) -> int:
        """Deprecated: :attr:`packed_rows`."""
        deprecation.warn("Plan.rows", "Plan.packed_rows")
        return self.packed_rows

    @property
    def efficiency(self) -> float:
        """Packed rows over the one-forest minimum (1.0: no prefix computed twice)."""
        return self.packed_rows / max(self.min_rows, 1)

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
        """Rank ``rank``'s packs, built on first use.

        Args:
            rank: 0 .. ``world_size - 1``.

        Returns:
            ``packs_per_rank`` :class:`TreePack` objects, costliest first; empty packs
            (:meth:`TreePack.empty`) where the rank has fewer real ones. The same list on later
            calls.

        Raises:
            ValueError: a rank outside the plan.
        """
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not (
                0 <= rank < self.world_size):
            raise ValueError(f"rank={rank!r}: this plan has ranks 0 .. {self.world_size - 1}")
        rank = int(rank)
        if rank not in self._built:
            pad = self.pad_to_multiple_of
            self._built[rank] = [
                TreePack.from_sequences(
                    [self._sequences[i] for i in spec.seq_ids], seq_ids=spec.seq_ids,
                    pad_to_multiple_of=pad, device=self._device,
                    keys=None if self._keys is None else [self._keys[i] for i in spec.seq_ids],
                    routes=(None if self._routes is None
                            else [self._routes[i] for i in spec.seq_ids]))
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
                f"<= {self.max_tokens} rows; packed rows {self.packed_rows} = {self.efficiency:.3f} x the "
                f"one-forest minimum {self.min_rows}; rank imbalance {self.imbalance:.3f})")


def _split_tree(a: int, b: int, s_len, new, lcp, budget) -> list[tuple[int, int]]:
    """Cut sorted sequences a..b-1 (one tree) into runs that each fit ``budget`` rows.

    One cumulative sum for the whole tree, then per run a bisection and a scan of the LCPs it
    may cut at: O(b - a) overall, not O(runs x (b - a))."""
    total = np.cumsum(new[a:b])  # total[k - a] = new[a] + ... + new[k]
    runs = []
    i = a
    while i < b:
        # a run starting at i costs its full length, then each next sequence its new rows:
        # sequences i+1 .. k fit while total[k - a] - total[i - a] <= budget - s_len[i]
        limit = total[i - a] + budget - s_len[i]
        reach = i + 1 + int(np.searchsorted(total[i + 1 - a:], limit, side="right"))
        if reach >= b:
            runs.append((i, b))
            break
        window = lcp[i + 1:reach + 1]  # cutting before k repeats lcp[k] rows
        cut = reach - int(np.argmin(window[::-1]))  # the last smallest LCP: longest run
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


class _Pieces(NamedTuple):
    """The units the planner places: whole trees, or runs of a tree too big for the budget,
    as ranges ``[start, end)`` of the sorted sequences, numbered in sorted order."""

    start: np.ndarray  # [P]
    end: np.ndarray  # [P]
    rows: np.ndarray  # [P] packed rows of the piece alone
    pairs: np.ndarray  # [P] visible attention pairs of the piece alone
    tree: np.ndarray  # [P] the tree the piece belongs to


class _Sorted(NamedTuple):
    order: np.ndarray  # [N] sorted position -> sequence
    lcp: np.ndarray  # [N]
    length: np.ndarray  # [N] lengths in sorted order
    new: np.ndarray  # [N] rows each sorted sequence adds to the forest


def plan(sequences, *, max_tokens: int, world_size: int = 1,
         pad_to_multiple_of: int | None = None, pair_cost: float = PAIR_COST,
         min_packs: int = 1, device: torch.device | str | None = None, keys=None,
         routes=None) -> Plan:
    """Split ``sequences`` into packs of at most ``max_tokens`` packed rows over
    ``world_size`` ranks, keeping shared prefixes together and costs balanced.

    Args:
        sequences: token-id sequences, as for :meth:`TreePack.from_sequences`.
        max_tokens: the row budget: packed rows (distinct prefixes) per pack. Every sequence
            must fit (a sequence is never split across packs).
        world_size: data-parallel ranks; every rank gets the same number of packs.
        pad_to_multiple_of: pad every pack's rows to a multiple of this (``max_tokens`` must
            be a multiple of it, so padded packs stay within the budget).
        pair_cost: the cost of a visible attention pair, in rows, for balancing.
        min_packs: at least this many non-empty packs per rank where the rank has that many
            sequences: a rank with fewer splits its largest pack in two, between the two
            sequences that share the shortest prefix, nearest the middle (verl needs as many
            micro-batches on every rank).
        device: where the packs' tensors go when built.
        keys: per-token content keys, as for :meth:`TreePack.from_sequences` (an image
            placeholder's image, ``treepack.hf.Images.keys``): sharing is planned, and the
            packs built, over (id, key) pairs.
        routes: per-token routed experts, as for :meth:`TreePack.from_sequences`: sharing is
            planned where routes agree too, and every pack keeps its rows' routes. A pack is
            the forest of its own sequences, whose last tokens join rows of that pack only,
            so it may have fewer rows than planned, never more.

    Returns:
        A :class:`Plan`: ``plan.packs(r)`` is rank r's list of :class:`TreePack` (built on
        first use); each pack's ``seq_ids`` are the indices of its sequences in
        ``sequences``. Every sequence is in exactly one pack. ``plan.efficiency`` is packed
        rows over the one-forest minimum, ``plan.imbalance`` the most loaded rank's cost
        over the mean.

    Raises:
        ValueError: a sequence longer than the budget, a bad budget / rank count / padding /
            pair cost, or bad sequences (the message names it and the fix).
    """
    max_tokens, world_size, pad_to_multiple_of = _check_budget(
        max_tokens, world_size, pad_to_multiple_of, pair_cost)
    ids = validate_sequences(sequences)
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))
    _check_lengths(lengths, max_tokens)
    if keys is not None:
        keys = validate_keys(keys, ids)
    match = keys
    if routes is not None:
        routes = validate_routes(routes, ids)
        match, _ = route_keys(ids, keys, routes)
    order, lcp = sort_and_lcp(ids if match is None else identities(ids, match))
    srt = _Sorted(order, lcp, lengths[order], lengths[order] - lcp)
    pieces = _pieces(srt, max_tokens)
    bins = _spread_and_pack(pieces, pieces.rows + pair_cost * pieces.pairs, world_size,
                            max_tokens)
    per_rank = max(len(b) for b in bins)
    sizes = (pieces.rows.tolist(), pieces.pairs.tolist())  # once: every rank reads them
    specs = [_specs(srt, pieces, sizes, rank_bins, pair_cost, per_rank) for rank_bins in bins]
    min_packs = positive_int(min_packs, "min_packs", hint=" (packs per rank)")
    if min_packs > 1:
        specs = _at_least(specs, min_packs, srt, pair_cost)
    return Plan(specs=specs, min_rows=int(srt.new.sum()), max_tokens=max_tokens,
                pad_to_multiple_of=pad_to_multiple_of, _sequences=ids, _device=device,
                _keys=keys, _routes=routes)


def _at_least(specs: list[list[PackSpec]], count: int, srt: _Sorted,
              pair_cost: float) -> list[list[PackSpec]]:
    """Every rank's packs, its largest split in two until it has ``count`` non-empty packs
    (or one sequence per pack); ranks padded with empty packs to the same number again."""
    rank_of = np.empty(len(srt.order), dtype=np.int64)
    rank_of[srt.order] = np.arange(len(srt.order))  # sequence -> its sorted position
    out = []
    for rank in specs:
        real = [s for s in rank if len(s.seq_ids)]
        while len(real) < count:
            i = max(range(len(real)), key=lambda k: (len(real[k].seq_ids) > 1,
                                                    real[k].packed_rows), default=None)
            if i is None or len(real[i].seq_ids) < 2:
                break
            positions = np.sort(rank_of[real[i].seq_ids])
            real[i:i + 1] = [_spec(srt, half, pair_cost) for half in _halves(srt, positions)]
        out.append(sorted(real, key=lambda s: -s.cost))
    per_rank = max(len(r) for r in out)
    empty = PackSpec(np.zeros(0, dtype=np.int64), 0, 0, 0.0)
    return [r + [empty] * (per_rank - len(r)) for r in out]


def _shared(srt: _Sorted, positions: np.ndarray) -> np.ndarray:
    """The prefix each sorted sequence at ``positions`` (ascending) shares with the one before
    it among them (0 for the first): the least LCP between them in the full sorted order."""
    lcp = np.append(srt.lcp, 0)  # a sentinel: reduceat's indices must be in range
    bounds = np.column_stack([positions[:-1] + 1, positions[1:] + 1]).reshape(-1)
    return np.append(0, np.minimum.reduceat(lcp, bounds)[::2]) if len(positions) > 1 else \
        np.zeros(len(positions), dtype=np.int64)


def _halves(srt: _Sorted, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted sequences at ``positions`` in two parts, cut between the two that share the
    shortest prefix, the cut nearest the middle in packed rows among those: a prefix shared
    across the cut is computed twice, so the cut crosses as little of one as possible."""
    shared = _shared(srt, positions)
    rows = np.cumsum(srt.length[positions] - shared)
    cut = np.arange(1, len(positions))  # before member k
    k = cut[np.lexsort((np.abs(rows[cut - 1] - rows[-1] / 2), shared[cut]))[0]]
    return positions[:k], positions[k:]


def _spec(srt: _Sorted, positions: np.ndarray, pair_cost: float) -> PackSpec:
    """The pack of the sorted sequences at ``positions`` (ascending), its sizes counted."""
    shared = _shared(srt, positions)
    length = srt.length[positions]
    rows = int((length - shared).sum())
    pairs = int((causal_pairs(length) - causal_pairs(shared)).sum())
    return PackSpec(np.sort(srt.order[positions]), rows, pairs, rows + pair_cost * pairs)


def _check_budget(max_tokens, world_size, pad_to_multiple_of, pair_cost):
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
            fit = max_tokens // pad_to_multiple_of * pad_to_multiple_of or pad_to_multiple_of
            raise ValueError(
                f"max_tokens={max_tokens} is not a multiple of pad_to_multiple_of="
                f"{pad_to_multiple_of}: a padded pack could exceed the budget; use "
                f"max_tokens={fit}"
            )
    return max_tokens, world_size, pad_to_multiple_of


def _check_lengths(lengths: np.ndarray, max_tokens: int) -> None:
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}: a "
            "sequence is never split across packs (its predictions need its whole prefix); "
            f"raise max_tokens to at least {int(lengths.max())} or truncate it"
            + (f" ({too_long.size} sequences are too long)" if too_long.size > 1 else "")
        )


def _pieces(srt: _Sorted, max_tokens: int) -> _Pieces:
    """Whole trees where they fit, else runs cut where the LCP is smallest."""
    tree_start = np.flatnonzero(srt.lcp == 0)
    tree_end = np.append(tree_start[1:], len(srt.order))
    tree_rows = np.add.reduceat(srt.new, tree_start)
    fits = tree_rows <= max_tokens
    starts, ends = [tree_start[fits]], [tree_end[fits]]
    for t in np.flatnonzero(~fits):
        runs = np.array(_split_tree(tree_start[t], tree_end[t], srt.length, srt.new, srt.lcp,
                                    max_tokens))
        starts.append(runs[:, 0])
        ends.append(runs[:, 1])
    start, end = np.concatenate(starts), np.concatenate(ends)
    by_start = np.argsort(start, kind="stable")  # number the pieces in sorted order
    start, end = start[by_start], end[by_start]
    first = srt.lcp[start]  # a run's first sequence repeats its shared prefix
    seq_pairs = causal_pairs(srt.length) - causal_pairs(srt.lcp)  # depths lcp.. see depth + 1
    return _Pieces(start, end, rows=np.add.reduceat(srt.new, start) + first,
                   pairs=np.add.reduceat(seq_pairs, start) + causal_pairs(first),
                   tree=np.searchsorted(tree_start, start, side="right") - 1)


def _spread_and_pack(pieces: _Pieces, cost: np.ndarray, world_size: int,
                     max_tokens: int) -> list[list[list[int]]]:
    """Per rank, its packs as lists of pieces. Pieces go onto ranks by cost (largest first
    onto the least loaded rank), then each rank's pieces into packs (best fit, largest
    first). The first try keeps every rank within the fewest packs that could hold the rows,
    m0; if some rank then needs more, costs are balanced freely."""
    m0 = max(1, -(-int(pieces.rows.sum()) // (world_size * max_tokens)))
    for room in (m0 * max_tokens, None):
        owner = _assign(pieces.rows, cost, world_size, room)
        if owner is None:
            continue
        by_rank = np.argsort(owner, kind="stable")  # each rank's pieces, in one pass
        mine = np.split(by_rank, np.searchsorted(owner[by_rank], np.arange(1, world_size)))
        bins = [[mine[r][b] for b in _best_fit_decreasing(pieces.rows[mine[r]], max_tokens)]
                for r in range(world_size)]
        if room is None or max(len(b) for b in bins) <= m0:
            return bins
    raise AssertionError("unreachable: the unconstrained pass always places every piece")


def _specs(srt: _Sorted, pieces: _Pieces, sizes: tuple[list, list], bins: list,
           pair_cost: float, per_rank: int) -> list[PackSpec]:
    """One rank's pack specs, costliest first, padded with empty packs to ``per_rank``
    (``sizes``: every piece's rows and pairs as Python lists)."""
    rows_of, pairs_of = sizes
    specs = []
    for members in bins:
        if len(members) == 1:  # the common case under a tight budget: no numpy per pack
            (p,) = members
            rows, pairs = rows_of[p], pairs_of[p]
            ids = np.sort(srt.order[pieces.start[p]:pieces.end[p]])
        else:
            members = np.sort(members)  # pieces are numbered in sorted order
            rows = int(pieces.rows[members].sum())
            pairs = int(pieces.pairs[members].sum())
            # Two runs of one split tree in the same pack share their common prefix again.
            for p, q in zip(members[:-1], members[1:]):
                if pieces.tree[p] == pieces.tree[q]:
                    shared = int(srt.lcp[pieces.end[p]:pieces.start[q] + 1].min())
                    rows -= shared
                    pairs -= causal_pairs(shared)
            ids = np.sort(srt.order[ragged_arange(pieces.start[members],
                                                  pieces.end[members] - pieces.start[members])])
        specs.append(PackSpec(ids, rows, pairs, rows + pair_cost * pairs))
    specs.sort(key=lambda p: -p.cost)  # micro-step j of every rank: similar costs
    empty = PackSpec(np.zeros(0, dtype=np.int64), 0, 0, 0.0)
    return specs + [empty] * (per_rank - len(specs))
