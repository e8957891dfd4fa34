"""What a part reads from the parts above it, and the token mixers that read it.

Per layer, a part keeps what the parts below it need of its rows: an attention layer's keys
and values, a short convolution's inputs, a recurrent scan's state after each row a part
below continues from (its scan chains end at every such row). In training these go below as
detached leaves; each part below adds its gradient into them, and the part's own backward
runs once, after all of them, with its loss and those gradients (:meth:`Carried.
backward_inputs`).

A part's plans (its attention chains over its context and own rows, its convolution paths,
its scan chains and where each root chain's state comes from) are functions of the tree and
the budget only, built once per pack and budget (:func:`~treepack.core.derived.
derived_from_pack`): the passes of one step, and every step over the same pack, share them.
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.routing import TreeForward, UnsupportedModel
from treepack.attention.chains import Chains, subset_chains
from treepack.attention.segment import ShapeGroups, attend_groups, chain_groups
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack
from treepack.planning.parts import Parts, split
from treepack.recurrent import ancestor_table, path_conv1d, row_levels, scan_levels

__all__ = ["Carried", "PartForward"]


class Carried:
    """What the parts run so far carry to the parts below them, per part and layer."""

    def __init__(self, parts: Parts, train: bool):
        self.parts, self.train = parts, train
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
            raise UnsupportedModel(
                "a layer ran its forward without gradients during a training step: "
                "reentrant activation checkpointing, whose backward would not see the "
                "gradients the parts below add to this part's keys and values. Use "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})")
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


class PartForward(TreeForward):
    """The per-forward object of one part: every token mixer over the part's context and
    own rows."""

    SINKS = False  # the sink key is not carried between parts yet

    def __init__(self, carried: Carried, index: int):
        self.pack = carried.parts.pack
        self.carried, self.index = carried, index
        self.budget = carried.parts.max_rows
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()
        self.layer = None  # the recurrent layer under way: its convolution's weight

    def attend(self, module, query, key, value, *, scale, softcap, window, dropout):
        carried = self.carried
        carried.put(self.index, module, key, value)
        chains = part_chains(self.pack, self.budget, self.index, window)
        groups = part_groups(self.pack, self.budget, self.index, window,
                             query.shape[1] * query.shape[3])
        context = carried.gather(module, chains.context, 2)
        if context is not None:
            key, value = torch.cat((context[0], key), 2), torch.cat((context[1], value), 2)
        return attend_groups(query, key, value, groups, scale=scale, softcap=softcap,
                             window=window, dropout=dropout)

    def conv(self, x, weight, bias):
        # a layer's convolution weight names it, in every forward and recompute of the step
        self.layer = ("conv", weight.data_ptr())
        self.carried.put(self.index, self.layer, x)
        paths = conv_paths(self.pack, self.budget, self.index, weight.shape[1])
        context = self.carried.gather(self.layer, paths.context, 0)
        if context is not None:
            x = torch.cat((x, *context))
        return path_conv1d(x, paths.index, weight, bias)

    def scan(self, kernel, inputs):
        if self.layer is None:
            raise UnsupportedModel("a recurrent scan ran before its layer's convolution: "
                                   "treepack cannot tell which layer's state to carry")
        key = ("scan", self.layer[1])
        plan = scan_plan(self.pack, self.budget, self.index)
        initial = None
        if plan.carried:  # root chains continuing another part's state; the others from zeros
            states = [self.carried.leaves[j][key][0].index_select(0, position)
                      for j, position, _ in plan.carried]
            which = torch.cat([chains for _, _, chains in plan.carried])
            initial = states[0].new_zeros((plan.roots, *states[0].shape[1:]))
            initial = initial.index_copy(0, which, torch.cat(states))
        out, finals = scan_levels(plan.levels, kernel, inputs, initial)
        if plan.picks:
            exported = torch.cat([finals[d].index_select(0, hit) for d, hit in plan.picks])
            self.carried.put(self.index, key, exported.index_select(0, plan.reorder))
        return out


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
