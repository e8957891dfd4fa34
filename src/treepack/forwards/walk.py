"""One pass over a tree's parts, whatever runs each part's forward: the order (depth-first,
with an explicit stack), the recomputed forwards, each part's one backward, and what a
training step in parts returns (:class:`PartsResult`).

The adapters (:mod:`treepack.adapters.hf.parts`, :mod:`treepack.adapters.megatron.parts`)
give a part's forward and what it predicts; everything else about a pass is here.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import Tensor

from treepack.forwards.carried import Carried
from treepack.planning.parts import Parts

__all__ = ["Walk", "PartsResult"]


@dataclasses.dataclass(frozen=True)
class PartsResult:
    """What ``backward_in_parts`` and ``step_in_parts`` return (the gradients are in the
    parameters)."""

    loss: Tensor  # the step's loss (detached)
    logprobs: Tensor  # in the pack's layout and the ``align`` alignment (detached)
    entropy: Tensor | None  # the same shape, when asked for
    parts: int  # forwards run (per pass)
    rows: int  # rows they computed: the tree's, each once


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
