"""The predictions of a forward over some of a pack's rows, for the transformers adapter: one
part of a tree, one rank's slice of a sequence-parallel forward, or both.

The predictions themselves and their placement are :mod:`treepack.lean.predictions`' (shared
with every adapter that splits a pack's rows; :func:`part_predictions`, grouped by part once
per pack and budget, is :mod:`treepack.forwards.plans`'); :func:`place` reads a packed forward's output (its logits,
or its hidden states and head) as their source.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from treepack.core.softmax import Head, Logits
from treepack.forwards.plans import part_predictions
from treepack.lean import predictions as lean
from treepack.lean.predictions import Predictions

__all__ = ["Predictions", "part_predictions", "place", "zero_of"]


def place(predictions: Predictions, out, temperature: np.ndarray, *, entropy: bool,
          numel: int, chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`treepack.lean.predictions.place` from a packed forward's output ``out`` (a
    :class:`~.packed.PackedOutput`: its hidden states and head, ``output="hidden"``, or its
    logits)."""
    if out.hidden is not None:
        h = out.head
        source = Head(out.hidden, h["weight"], h.get("bias"), scale=h.get("scale", 1.0),
                      softcap=h.get("softcap"))
    else:
        source = Logits(out.output.logits[0])
    return lean.place(predictions, source, temperature, entropy=entropy, numel=numel,
                      chunk_size=chunk_size)


def zero_of(out) -> Tensor:
    """0, as a function of everything a forward's predictions would read (its hidden states
    and head, or its logits): the loss of a sequence-parallel rank that predicts nothing, so
    that its backward runs the exchanges the other ranks' do and its gradients are the same
    set of parameters (zeros), as theirs."""
    if out.hidden is None:
        return out.output.logits.sum() * 0
    head = [t.sum() for t in out.head.values() if isinstance(t, Tensor)]
    return (out.hidden.sum() + sum(head)) * 0
