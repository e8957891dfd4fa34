"""Each part's plans: its attention chains over its context and own rows, its convolution
paths, its scan chains and where each root chain's state comes from, its predictions.

They are functions of the tree and the budget only, built once per pack and budget
(:func:`~treepack.core.derived.derived_from_pack`): the passes of one step, and every step over
the same pack, share them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.attention.chains import Chains, VarlenIndex, index_of, subset_chains
from treepack.attention.segment import ShapeGroups, chain_groups
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack
from treepack.lean import predictions as lean
from treepack.lean.predictions import ForwardPredictions
from treepack.planning.parts import Parts, split
from treepack.recurrent import ancestor_table, row_levels

__all__ = ["PartChains", "part_chains", "part_varlen_index", "part_groups", "ConvPaths", "conv_paths", "ScanPlan",
           "scan_plan", "part_predictions"]


class PartChains(NamedTuple):
    """A part's attention chains, their keys as slots of (context, then own rows), and its
    context rows ``(part, rows of that part)`` in slot order."""

    chains: Chains
    context: list[tuple[int, Tensor]]


@derived_from_pack
def part_chains(pack: TreePack, budget: int, i: int, window, chunk=None) -> PartChains:
    parts = split(pack, budget)
    c = subset_chains(pack, parts.parts[i].rows, window, chunk)
    outside, slot, context, grouped = _outside(parts, i, c.key_rows)
    slot[~outside] += context
    return PartChains(Chains(c.start, c.length, c.context, slot), grouped)


@derived_from_pack
def part_varlen_index(pack: TreePack, budget: int, i: int, window, chunk=None) -> VarlenIndex:
    """Part ``i``'s chains as FlashAttention's varlen arguments: its rows' queries against the
    slots of (its context's keys, then its own); with ``chunk``, chains cut at chunk starts
    and their context from their chunk's first depth (:mod:`treepack.attention.chains`)."""
    rows = split(pack, budget).parts[i].rows
    return index_of(part_chains(pack, budget, i, window, chunk).chains, rows.shape[0],
                    pack.device)


@derived_from_pack
def part_groups(pack: TreePack, budget: int, i: int, window, width: int) -> ShapeGroups:
    """Part ``i``'s chains grouped into attention calls for head width ``width``."""
    rows = split(pack, budget).parts[i].rows
    return chain_groups(part_chains(pack, budget, i, window).chains, rows.shape[0],
                        pack.device, width)


class ConvPaths(NamedTuple):
    """A part's convolution paths: ``[taps, n]`` slots of (own rows, then the ancestors of
    other parts they reach, grouped by part), the sink past them; and those ancestors."""

    index: Tensor
    context: list[tuple[int, Tensor]]


@derived_from_pack
def conv_paths(pack: TreePack, budget: int, i: int, taps: int) -> ConvPaths:
    parts = split(pack, budget)
    rows = parts.parts[i].rows
    n = pack.num_rows
    table = ancestor_table(pack.host.parent_row[:n], taps)[:, rows]
    real = table < n
    outside, slot, context, grouped = _outside(parts, i, table[real])
    slot[outside] += rows.shape[0]
    index = np.full(table.shape, rows.shape[0] + context, dtype=np.int64)  # the sink
    index[real] = slot
    return ConvPaths(torch.from_numpy(index).to(pack.device), grouped)


class ScanPlan(NamedTuple):
    """A part's scan chains (cut after every row a part below continues from), where each
    root chain's state comes from, and where its own exported rows' states are."""

    levels: object  # recurrent.row_levels' plan over the part's rows
    carried: list[tuple[int, Tensor, Tensor]]  # (part, its exported rows' positions, chains)
    roots: int  # root chains
    picks: list[tuple[int, Tensor]]  # (level, chains) ending at this part's exported rows
    reorder: Tensor | None  # those states into the order of the exported rows


@derived_from_pack
def scan_plan(pack: TreePack, budget: int, i: int) -> ScanPlan:
    parts = split(pack, budget)
    rows = parts.parts[i].rows
    device = pack.device
    exported = _exported(pack, budget)
    parent = pack.host.parent_row[rows]
    inside = (parent >= 0) & (parts.part_of[np.maximum(parent, 0)] == i)
    local_parent = np.where(inside, parts.local[np.maximum(parent, 0)], -1)
    levels = row_levels(local_parent, exported[rows], device)
    # root chains start, in order, at the rows whose parent is not in this part
    above = parent[local_parent < 0]
    carried = np.flatnonzero(above >= 0)
    grouped = []
    for j in np.unique(parts.part_of[above[carried]]):
        sel = carried[parts.part_of[above[carried]] == j]
        part_rows = parts.parts[int(j)].rows
        position = np.searchsorted(part_rows[exported[part_rows]], above[sel])
        grouped.append((int(j), torch.from_numpy(position).to(device),
                        torch.from_numpy(sel).to(device)))
    # this part's exported rows: the level and chain whose last row each one is
    exports = parts.local[rows[exported[rows]]]
    picks, order = [], []
    for d, level in enumerate(levels.levels):
        hit = np.flatnonzero(np.isin(level.last, exports))
        if hit.shape[0]:
            picks.append((d, torch.from_numpy(hit).to(device)))
            order.append(level.last[hit])
    reorder = (torch.from_numpy(np.argsort(np.concatenate(order), kind="stable")).to(device)
               if order else None)
    return ScanPlan(levels, grouped, len(above), picks, reorder)


@derived_from_pack
def _exported(pack: TreePack, budget: int) -> np.ndarray:
    """[T'] bool: the rows other parts continue a scan from."""
    parts = split(pack, budget)
    n = pack.num_rows
    parent = pack.host.parent_row[:n]
    handed = (parent >= 0) & (parts.part_of[np.maximum(parent, 0)] != parts.part_of)
    exported = np.zeros(n, dtype=bool)
    exported[parent[handed]] = True
    return exported


def _outside(parts: Parts, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, list]:
    """For ``rows`` (the tree's): which lie in other parts, each one's index among its
    part's rows (own) or among those other rows (ordered by part, then row), how many
    other rows there are, and them grouped by part as ``(part, its local rows)``."""
    outside = parts.part_of[rows] != i
    ctx = np.unique(rows[outside])
    ctx = ctx[np.lexsort((parts.local[ctx], parts.part_of[ctx]))]  # part, then row
    where = np.empty(rows.shape[0], dtype=np.int64)
    where[~outside] = parts.local[rows[~outside]]
    order = np.argsort(ctx, kind="stable")  # ctx is ordered by part, then row: not by row
    where[outside] = order[np.searchsorted(ctx[order], rows[outside])]
    device = parts.pack.device
    grouped = [(int(j), torch.from_numpy(parts.local[ctx[parts.part_of[ctx] == j]]).to(device))
               for j in np.unique(parts.part_of[ctx])]
    return outside, where, ctx.shape[0], grouped


@derived_from_pack
def part_predictions(pack: TreePack, budget: int | None, align: str
                     ) -> list[ForwardPredictions]:
    """The predictions of each part of ``split(pack, budget)`` (``budget`` None: one part,
    the whole pack), sources counted among the part's rows."""
    if budget is None:
        return [lean.forward_predictions(pack, align)]
    where, seq, source, token, real = lean.host_predictions(pack, align)
    parts = split(pack, budget)
    part_of, local, count = parts.part_of, parts.local[source], len(parts.parts)
    order = np.lexsort((local, part_of[source]))  # by part, then source row
    counts = np.bincount(part_of[source], minlength=count)
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(pack.device)  # noqa: E731
    return [ForwardPredictions(move(where[sel]), seq[sel], local[sel], move(token[sel]),
                               None if real[sel].all() else move(real[sel]))
            for sel in np.split(order, np.cumsum(counts)[:-1])]
