"""The predictions a forward over some of a pack's rows makes, normalised and placed in the
pack's layout: one rank's slice of the rows, one part of a tree, or both.

A prediction is one (sequence, position) of the pack's layout, with its source row (the row
whose logits predict it) and its target token. A forward over some rows owns the predictions
whose source row it computed: :func:`forward_predictions` lists every prediction of a pack
once (cached), :meth:`ForwardPredictions.within` narrows them to a slice of rows, and
:func:`logprobs_at` normalises a forward's rows once per (row, temperature) and scatters the
log-probs (and entropies) to where they go. Every adapter that splits a pack's rows (sequence
and context parallelism, parts) places its log-probs through here. (A pack's own
:class:`~treepack.core.tree.Predictions` are its occurrences in input order; these are what
one forward's rows predict, by source row.)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.derived import derived_from_pack
from treepack.core.outputs import check_align, sequence_of
from treepack.core.softmax import Head, Logits, normalise
from treepack.core.tree import TreePack

__all__ = ["ForwardPredictions", "HostPredictions", "forward_predictions", "host_predictions",
           "logprobs_at"]


class HostPredictions(NamedTuple):
    """Every prediction of a pack on the host: where it goes in the flattened layout, its
    sequence, its source row, its target token, and whether it predicts a token (the
    ``"prediction"`` alignment also normalises each sequence's last row, for its entropy)."""

    where: np.ndarray
    seq: np.ndarray
    source: np.ndarray
    token: np.ndarray
    real: np.ndarray


class ForwardPredictions(NamedTuple):
    """ForwardPredictions of one forward: where they go in the pack's (flattened) layout, their
    sequences and source rows among the forward's rows (host), their target tokens, and which
    of them predict a token (None: all)."""

    where: Tensor
    seq: np.ndarray
    source: np.ndarray
    token: Tensor
    real: Tensor | None

    def within(self, start: int, stop: int) -> "ForwardPredictions":
        """Those whose source is among rows ``start .. stop - 1``, sources counted from
        ``start``: a rank's slice of the forward's rows."""
        keep = (self.source >= start) & (self.source < stop)
        if keep.all():
            return self._replace(source=self.source - start)
        on = torch.from_numpy(np.flatnonzero(keep)).to(self.where.device)
        return ForwardPredictions(self.where[on], self.seq[keep], self.source[keep] - start,
                           self.token[on], None if self.real is None else self.real[on])


@derived_from_pack
def host_predictions(pack: TreePack, align: str) -> HostPredictions:
    """Every prediction of ``pack`` in ``align``'s layout (:mod:`treepack.core.outputs`), on
    the host, in layout order."""
    check_align(align)
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
    return HostPredictions(where, sequence_of(h, where), source, token, real)


@derived_from_pack
def forward_predictions(pack: TreePack, align: str) -> ForwardPredictions:
    """Every prediction of ``pack`` (sources among all its rows), on its device, by source
    row."""
    where, seq, source, token, real = host_predictions(pack, align)
    order = np.argsort(source, kind="stable")
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a[order])).to(pack.device)  # noqa: E731
    return ForwardPredictions(move(where), seq[order], source[order], move(token),
                       None if real.all() else move(real))


def logprobs_at(predictions: ForwardPredictions, source: Logits | Head, temperature: np.ndarray,
                *, entropy: bool, numel: int, chunk_size: int | None = None
                ) -> tuple[Tensor, Tensor | None]:
    """The forward's log-probs (and entropies) at ``predictions``, in a flat ``[numel]``
    layout (0 elsewhere), with autograd to the source's tensors.

    Args:
        predictions: the forward's, sources among its rows.
        source: its logits or hidden states and head (:mod:`treepack.core.softmax`), one row
            per row of the forward.
        temperature: [N] one per sequence of the pack.
        entropy: also the entropy of each prediction's distribution.
        numel: the layout's size.
        chunk_size: rows per chunk of the log-softmax.

    Returns:
        ``(logprobs [numel], entropy [numel] or None)``.
    """
    where, seq, rows, token, real = predictions
    # one normalised row per (source row, temperature), rows ascending
    normalised, pick = np.unique(np.stack((rows, temperature[seq])), axis=1,
                                 return_inverse=True)
    pick = pick.reshape(-1)
    logp, ent = normalise(source, normalised[0].astype(np.int64), normalised[1], pick, token,
                          entropy=entropy, chunk_size=chunk_size)
    if real is not None:  # a sequence's last row: its entropy only
        logp = logp.where(real, 0)
    logprobs = logp.new_zeros(numel).index_put((where,), logp)
    if ent is None:
        return logprobs, None
    ent = ent[torch.from_numpy(pick).to(ent.device)]  # per prediction
    return logprobs, ent.new_zeros(numel).index_put((where,), ent)
