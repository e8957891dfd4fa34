"""What the parts of a tree run so far carry to the parts below them, per part and layer.

Per layer, a part keeps what the parts below it need of its rows: an attention layer's keys
and values, a short convolution's inputs, a recurrent scan's state after each row a part
below continues from (its scan chains end at every such row). In training these go below as
detached leaves; each part below adds its gradient into them, and the part's own backward
runs once, after all of them, with its loss and those gradients
(:meth:`Carried.backward_inputs`). :func:`attend_part` is a part's attention over its
context's keys (read from here) and its own.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch import Tensor

from treepack.attention import choose_backend, log_once, sink_channel, varlen
from treepack.attention.segment import attend_groups
from treepack.forwards.plans import part_chains, part_groups, part_varlen_index
from treepack.planning.parts import Parts

__all__ = ["Carried", "attend_part"]


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


def attend_part(carried: Carried, i: int, module, query: Tensor, key: Tensor, value: Tensor, *,
                scale, softcap, window, dropout, sinks: Tensor | None = None,
                chunk: int | None = None, backend: str = "segment") -> Tensor:
    """Part ``i``'s attention (``[1, heads, rows, d]``): its own keys and values kept for the
    parts below (under ``module``), its queries against its context's and its own, by the
    part's chains; ``sinks`` (a logit per query head) as one more key every query sees, added
    here: it is no row, so nothing carries it; ``chunk``: each query within its chunk of
    depths (the chains then hold whole ancestries, as the segment backend's do).

    ``backend``: ``"varlen"`` runs the part's chains as one FlashAttention varlen call over
    its context's keys and its own (sinks through the kernel's log-sum-exp; chunks as chains
    cut at chunk starts, as :mod:`treepack.attention.chains` cuts a pack's); ``"auto"`` does
    where :func:`~treepack.attention.choose_backend` picks varlen for the layer; anything
    else the ``segment`` backend's grouped calls."""
    carried.put(i, module, key, value)
    pack, budget = carried.parts.pack, carried.parts.max_rows
    if _varlen_here(backend, query, key, value, softcap=softcap, dropout=dropout, sinks=sinks,
                    chunk=chunk):
        # chunked: the chains' context starts at their chunk, so reach over the window only
        chains = part_chains(pack, budget, i, window, chunk)
        key, value = _with_context(carried, module, chains, key, value)
        return varlen.attend_index(query, key, value,
                                   part_varlen_index(pack, budget, i, window, chunk),
                                   scale=scale, window=window, sinks=sinks)
    reach = window if chunk is None else None  # segment masks chunks per group
    chains = part_chains(pack, budget, i, reach)
    key, value = _with_context(carried, module, chains, key, value)
    groups = part_groups(pack, budget, i, reach, query.shape[1] * query.shape[3])
    if sinks is not None:
        if softcap is not None:
            raise ValueError(f"softcap={softcap} with attention sinks: the sink's own score "
                             "must not be capped")
        query, key = sink_channel(query, key, sinks, scale)
    return attend_groups(query, key, value, groups, scale=scale, softcap=softcap,
                         window=window, dropout=dropout, sink=sinks is not None, chunk=chunk)


def _with_context(carried: Carried, module, chains, key: Tensor, value: Tensor):
    """The part's keys and values after those of its context (the ancestors in parts above
    that its chains read), as the chains' key slots count them."""
    context = carried.gather(module, chains.context, 2)
    if context is None:
        return key, value
    return torch.cat((context[0], key), 2), torch.cat((context[1], value), 2)


def _varlen_here(backend: str, query, key, value, *, softcap, dropout, sinks, chunk) -> bool:
    """Whether a part attends through varlen (:func:`attend_part`'s ``backend``): ``auto``
    where :func:`~treepack.attention.choose_backend` picks it for the layer (flex, which it
    may pick instead, has no parts: those run on segment)."""
    if backend == "auto":
        choice, why = choose_backend(query, key, value, softcap=softcap, dropout=dropout,
                                     sinks=sinks, chunk=chunk)
        runs = "varlen" if choice == "varlen" else "segment"
        log_once("treepack parts: backend='auto' attends on %r (%s)", runs,
                 why if choice == runs else f"{why}; flex runs no parts")
        return runs == "varlen"
    if backend != "varlen":
        return False
    varlen.check(query, value, softcap=softcap, dropout=dropout, sinks=sinks)
    return True
