"""What a tree's parts carry to the parts below them, and each part's plans: the code every
adapter that runs a tree in parts shares (transformers' :mod:`treepack.adapters.hf.parts`,
megatron-core's :mod:`treepack.adapters.megatron.parts`).

Per layer, a part keeps what the parts below it need of its rows: an attention layer's keys
and values, a short convolution's inputs, a recurrent scan's state after each row a part
below continues from (its scan chains end at every such row). In training these go below as
detached leaves; each part below adds its gradient into them, and the part's own backward
runs once, after all of them, with its loss and those gradients (:meth:`Carried.
backward_inputs`).

A part's plans (its attention chains over its context and own rows, its convolution paths,
its scan chains and where each root chain's state comes from, its predictions) are functions
of the tree and the budget only, built once per pack and budget (:func:`~treepack.core.
derived.derived_from_pack`): the passes of one step, and every step over the same pack, share
them.
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.attention import sink_channel
from treepack.attention.chains import Chains, subset_chains
from treepack.attention.segment import ShapeGroups, attend_groups, chain_groups
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack
from treepack.lean import predictions as lean
from treepack.lean.predictions import Predictions
from treepack.planning.parts import Parts, split
from treepack.recurrent import ancestor_table, row_levels

__all__ = ["Carried", "Walk", "attend_part", "PartChains", "part_chains", "part_groups", "ConvPaths", "conv_paths",
           "ScanPlan", "scan_plan", "part_predictions"]


class Carried:
    """What the parts run so far carry to the parts below them, per part and layer."""

    def __init__(self, parts: Parts, train: bool, refuse_no_grad):
        """``refuse_no_grad()``: the error to raise when a layer of a training step runs its
        forward without gradients (a reentrant activation checkpoint: its backward would
        not see the gradients the parts below add to what the part carries)."""
        self.parts, self.train, self.refuse_no_grad = parts, train, refuse_no_grad
        self.leaves: dict = collections.defaultdict(dict)  # part -> layer key -> leaves
        self.own: dict = collections.defaultdict(dict)  # part -> layer key -> with graph
        self.first = self.second = None  # the part in its first / second of two forwards

    @contextlib.contextmanager
    def recomputed(self, i: int, which: str):
        """Part ``i``'s ``"first"`` forward, without gradients (what it hands below, no
        graph), or its ``"second"``, with gradients: its tensors replace the first's (the
        same values) as what the leaves' gradients flow back through; the leaves stay."""
        setattr(self, which, i)
        try:
            yield
        finally:
            setattr(self, which, None)

    def put(self, i: int, key, *tensors: Tensor) -> None:
        """Part ``i``'s tensors for the layer ``key`` (an attention module, or a
        convolution's / scan's key), kept for the parts below it."""
        if key in self.own[i]:
            if i == self.second and not self.own[i][key][0].requires_grad:
                self.own[i][key] = tensors
            return  # an activation-checkpointing recompute: the forward's are kept
        if self.train and not torch.is_grad_enabled() and i != self.first:
            raise self.refuse_no_grad()
        self.own[i][key] = tensors
        if self.train:
            tensors = tuple(t.detach().requires_grad_() for t in tensors)
        self.leaves[i][key] = tensors

    def gather(self, key, grouped: list[tuple[int, Tensor]], dim: int) -> list[Tensor] | None:
        """The tensors of ``key`` at the rows ``grouped`` (``(part, its rows)``), concatenated
        along ``dim`` in that order; None without rows."""
        if not grouped:
            return None
        pieces = zip(*[[t.index_select(dim, rows) for t in self.leaves[j][key]]
                       for j, rows in grouped])
        return [torch.cat(p, dim) for p in pieces]

    def backward_inputs(self, i: int) -> tuple[list[Tensor], list[Tensor]]:
        """The part's carried tensors whose leaves got gradients from parts below it."""
        tensors, grads = [], []
        for key, own in self.own[i].items():
            for t, leaf in zip(own, self.leaves[i][key]):
                if leaf.grad is not None and t.requires_grad:  # frozen below (LoRA): none
                    tensors.append(t)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self, i: int) -> None:
        self.leaves.pop(i, None)
        self.own.pop(i, None)


class Walk:
    """The order of a pass over the parts: each part's forward (``enter``), its children's
    (depth-first, in order), then its backward (``leave``), with an explicit stack (a
    trajectory of a thousand parts is a chain a thousand deep); and which parts run their
    forward twice in training (``recompute``: ``"auto"``, the parts with grandchildren;
    ``True``, every part with children; ``False``, none)."""

    def __init__(self, parts: Parts, train: bool, recompute: bool | str):
        if recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={recompute!r}: use 'auto', True or False")
        self.children = collections.defaultdict(list)  # part -> the parts hanging off it
        for j, part in enumerate(parts.parts):
            self.children[part.parent].append(j)
        self.recomputed = set()
        if train and recompute:
            below = {j for j in self.children if j >= 0}  # parts with parts below them
            self.recomputed = below if recompute is True else {
                j for j in below if any(c in below for c in self.children[j])}

    def run(self, enter, leave) -> None:
        stack = [(i, False) for i in reversed(self.children[-1])]
        while stack:
            i, children_done = stack.pop()
            if children_done:
                leave(i)
                continue
            enter(i)
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(self.children[i]))

    def run_parts(self, carried: Carried, forward, outputs, rng, *, train: bool,
                  seed: float = 1.0) -> None:
        """Every part in this order: ``outputs(i, *forward(i))`` gives its loss (None for
        none); in training its backward runs after its children's, with the gradients they
        added to what it carries (``seed`` times its loss's). A recomputed part runs
        ``forward`` once without gradients before its children, keeping only what it hands
        them, and again before its backward, with the random state of the first (``rng``: a
        ``(get, set)`` pair of the generators dropout draws from), so its masks repeat."""
        get_rng, set_rng = rng
        losses: dict = {}
        saved: dict = {}

        def enter(i: int) -> None:
            if i in self.recomputed:  # a first forward for the parts below only: no graph
                saved[i] = get_rng()
                with torch.no_grad(), carried.recomputed(i, "first"):
                    forward(i)
            else:
                losses[i] = outputs(i, *forward(i))

        def leave(i: int) -> None:
            if i in self.recomputed:  # again, with the same dropout masks, for the backward
                after = get_rng()
                set_rng(saved.pop(i))
                with carried.recomputed(i, "second"):
                    losses[i] = outputs(i, *forward(i))
                set_rng(after)
            loss = losses.pop(i, None)
            if train:
                tensors, grads = carried.backward_inputs(i)
                if loss is not None and loss.requires_grad:
                    tensors, grads = [loss, *tensors], [torch.ones_like(loss) * seed, *grads]
                if tensors:
                    torch.autograd.backward(tensors, grads)
            carried.release(i)

        self.run(enter, leave)


def attend_part(carried: Carried, i: int, module, query: Tensor, key: Tensor, value: Tensor, *,
                scale, softcap, window, dropout, sinks: Tensor | None = None,
                chunk: int | None = None) -> Tensor:
    """Part ``i``'s attention (``[1, heads, rows, d]``): its own keys and values kept for the
    parts below (under ``module``), its queries against its context's and its own, by the
    part's chains; ``sinks`` (a logit per query head) as one more key every query sees, added
    here: it is no row, so nothing carries it; ``chunk``: each query within its chunk of
    depths (the chains then hold whole ancestries, as the segment backend's do)."""
    carried.put(i, module, key, value)
    pack, budget = carried.parts.pack, carried.parts.max_rows
    reach = window if chunk is None else None
    chains = part_chains(pack, budget, i, reach)
    groups = part_groups(pack, budget, i, reach, query.shape[1] * query.shape[3])
    context = carried.gather(module, chains.context, 2)
    if context is not None:
        key, value = torch.cat((context[0], key), 2), torch.cat((context[1], value), 2)
    if sinks is not None:
        if softcap is not None:
            raise ValueError(f"softcap={softcap} with attention sinks: the sink's own score "
                             "must not be capped")
        query, key = sink_channel(query, key, sinks, scale)
    return attend_groups(query, key, value, groups, scale=scale, softcap=softcap,
                         window=window, dropout=dropout, sink=sinks is not None, chunk=chunk)


# --------------------------------------------------------------------- each part's plans

class PartChains(NamedTuple):
    """A part's attention chains, their keys as slots of (context, then own rows), and its
    context rows ``(part, rows of that part)`` in slot order."""

    chains: Chains
    context: list[tuple[int, Tensor]]


@derived_from_pack
def part_chains(pack: TreePack, budget: int, i: int, window) -> PartChains:
    parts = split(pack, budget)
    c = subset_chains(pack, parts.parts[i].rows, window)
    outside, slot, context, grouped = _outside(parts, i, c.key_rows)
    slot[~outside] += context
    return PartChains(Chains(c.start, c.length, c.context, slot), grouped)


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
def part_predictions(pack: TreePack, budget: int | None, align: str) -> list[Predictions]:
    """The predictions of each part of ``split(pack, budget)`` (``budget`` None: one part,
    the whole pack), sources counted among the part's rows."""
    if budget is None:
        return [lean.predictions(pack, align)]
    where, seq, source, token, real = lean.host_predictions(pack, align)
    parts = split(pack, budget)
    part_of, local, count = parts.part_of, parts.local[source], len(parts.parts)
    order = np.lexsort((local, part_of[source]))  # by part, then source row
    counts = np.bincount(part_of[source], minlength=count)
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(pack.device)  # noqa: E731
    return [Predictions(move(where[sel]), seq[sel], local[sel], move(token[sel]),
                        None if real[sel].all() else move(real[sel]))
            for sel in np.split(order, np.cumsum(counts)[:-1])]
