"""The predictions a forward over some of a pack's rows makes, normalised and placed in the
pack's layout: one part of a tree, one rank's slice of a sequence-parallel forward, or both.

A prediction is one (sequence, position) of the pack's layout, with its source row (the row
whose logits predict it) and its target token. A forward over some rows owns the predictions
whose source row it computed; :func:`part_predictions` groups them by part once per pack and
budget, :meth:`Predictions.within` narrows a part's to a slice of its rows, and :func:`place`
normalises a forward's rows once per (row, temperature) and scatters the log-probs (and
entropies) to where they go.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.derived import derived_from_pack
from treepack.core.outputs import sequence_of
from treepack.core.softmax import Head, Logits, normalise
from treepack.core.tree import TreePack
from treepack.planning.parts import split

__all__ = ["Predictions", "part_predictions", "place", "zero_of"]


class Predictions(NamedTuple):
    """Predictions of one forward: where they go in the pack's (flattened) layout, their
    sequences and source rows among the forward's rows (host), their target tokens, and which
    of them predict a token (None: all; ``"prediction"`` alignment also normalises each
    sequence's last row, for its entropy)."""

    where: Tensor
    seq: np.ndarray
    source: np.ndarray
    token: Tensor
    real: Tensor | None

    def within(self, start: int, stop: int) -> "Predictions":
        """Those whose source is among rows ``start .. stop - 1``, sources counted from
        ``start``: a rank's slice of the forward's rows."""
        keep = (self.source >= start) & (self.source < stop)
        if keep.all():
            return self._replace(source=self.source - start)
        on = torch.from_numpy(np.flatnonzero(keep)).to(self.where.device)
        return Predictions(self.where[on], self.seq[keep], self.source[keep] - start,
                           self.token[on], None if self.real is None else self.real[on])


@derived_from_pack
def part_predictions(pack: TreePack, budget: int | None, align: str) -> list[Predictions]:
    """The predictions of each part of ``split(pack, budget)`` (``budget`` None: one part,
    the whole pack), sources counted among the part's rows."""
    h = pack.host
    if align == "label":
        where, source, token = h.prediction_index, h.prediction_source, h.prediction_target
        real = np.ones(where.shape[0], dtype=bool)
    else:  # every position; the log-prob of the next token where there is one
        flat_rows = h.rows.reshape(-1)
        where = np.flatnonzero(flat_rows >= 0)
        source = flat_rows[where]
        token_at = np.zeros(flat_rows.shape[0], dtype=np.int64)
        real_at = np.zeros(flat_rows.shape[0], dtype=bool)
        token_at[h.prediction_index - 1] = h.prediction_target
        real_at[h.prediction_index - 1] = True
        token, real = token_at[where], real_at[where]
    seq = sequence_of(h, where)
    if budget is None:
        part_of, local, count = np.zeros(pack.num_rows, dtype=np.int64), None, 1
    else:
        parts = split(pack, budget)
        part_of, local, count = parts.part_of, parts.local, len(parts.parts)
    local = source if local is None else local[source]
    order = np.lexsort((local, part_of[source]))  # by part, then source row
    counts = np.bincount(part_of[source], minlength=count)
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(pack.device)  # noqa: E731
    return [Predictions(move(where[sel]), seq[sel], local[sel], move(token[sel]),
                        None if real[sel].all() else move(real[sel]))
            for sel in np.split(order, np.cumsum(counts)[:-1])]


def place(predictions: Predictions, out, temperature: np.ndarray, *, entropy: bool,
          numel: int, chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The forward's log-probs (and entropies) at ``predictions``, in a flat ``[numel]``
    layout (0 elsewhere), with autograd to the forward's tensors.

    Args:
        predictions: the forward's, sources among its rows.
        out: the forward's :class:`~.packed.PackedOutput`: its hidden states and head
            (``output="hidden"``) or its logits.
        temperature: [N] one per sequence of the pack.
        entropy: also the entropy of each prediction's distribution.
        numel: the layout's size.
        chunk_size: rows per chunk of the log-softmax.
    """
    where, seq, source, token, real = predictions
    # one normalised row per (source row, temperature), rows ascending
    normalised, pick = np.unique(np.stack((source, temperature[seq])), axis=1,
                                 return_inverse=True)
    pick = pick.reshape(-1)
    if out.hidden is not None:
        h = out.head
        logits = Head(out.hidden, h["weight"], h.get("bias"), scale=h.get("scale", 1.0),
                      softcap=h.get("softcap"))
    else:
        logits = Logits(out.output.logits[0])
    logp, ent = normalise(logits, normalised[0].astype(np.int64), normalised[1], pick, token,
                          entropy=entropy, chunk_size=chunk_size)
    if real is not None:  # a sequence's last row: its entropy only
        logp = logp.where(real, 0)
    logprobs = logp.new_zeros(numel).index_put((where,), logp)
    if ent is None:
        return logprobs, None
    ent = ent[torch.from_numpy(pick).to(ent.device)]  # per prediction
    return logprobs, ent.new_zeros(numel).index_put((where,), ent)


def zero_of(out) -> Tensor:
    """0, as a function of everything a forward's predictions would read (its hidden states
    and head, or its logits): the loss of a sequence-parallel rank that predicts nothing, so
    that its backward runs the exchanges the other ranks' do and its gradients are the same
    set of parameters (zeros), as theirs."""
    if out.hidden is None:
        return out.output.logits.sum() * 0
    head = [t.sum() for t in out.head.values() if isinstance(t, Tensor)]
    return (out.hidden.sum() + sum(head)) * 0
