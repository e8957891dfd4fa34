"""A pack's log-probs and entropies, in the layouts users read them in.

Every log-prob of treepack is computed here: :func:`token_outputs` normalises each packed row
that an output reads once per temperature (:func:`treepack.core.softmax.normalise`, from the
model's logits or from hidden states and the LM head) and places the values in one of two
alignments of the pack's ``[N, L]`` (or flat ``[total]``) layout:

- ``"label"`` (the default, :meth:`TreePack.token_logprobs`'s): ``[s, p]`` holds
  ``log p(seq_s[p] | seq_s[:p])`` and the entropy of the distribution that predicted it; 0 at
  ``p = 0`` and at padding (:attr:`TreePack.prediction_mask`);
- ``"prediction"`` (verl's): ``[s, p]`` holds ``log p(seq_s[p + 1] | seq_s[:p + 1])`` (0 at
  each sequence's last position) and the entropy of the distribution at ``p``, every position
  included.

:func:`take_columns` then reads label-aligned values into a framework's own columns (TRL's
completion columns, :class:`treepack.collation.Batch`'s).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core import checks
from treepack.core.softmax import Head, Logits, normalise, to_device
from treepack.core.derived import derived_from_pack

if TYPE_CHECKING:  # annotations only: tree.py imports this module
    from treepack.core.tree import TreePack

__all__ = ["check_align", "TokenLogprobs", "RowLogprobs", "token_outputs", "from_logits",
           "row_outputs", "take_columns", "per_sequence_temperature", "sequence_of",
           "ALIGNMENTS"]

ALIGNMENTS = ("label", "prediction")


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """What every log-prob call of treepack returns: per-position values in a pack's layout.

    ``logprobs, entropy = result`` unpacks as the pair it was in earlier releases.
    """

    logprobs: Tensor  # [N, L] (flat: [total]), float32 at least
    entropy: Tensor | None = None  # the same shape, when asked for
    align: str = "label"  # "label" or "prediction" (module docstring)
    aux_loss: Tensor | None = None  # an MoE model's router loss of the original tokens
    router_logits: tuple | None = None  # the forward's, per layer, for a loss over packs

    def __iter__(self):
        return iter((self.logprobs, self.entropy))

    def __getitem__(self, i):
        return (self.logprobs, self.entropy)[i]

    def __len__(self) -> int:
        return 2


class RowLogprobs(NamedTuple):
    """Per packed row: the log-prob of the row's token given its parent row (0 at roots and
    padding), and the entropy of the next-token distribution at the row. What the lean head
    computes inside a model's forward (one value per row for the model's output tensor)."""

    logprobs: Tensor  # [T']
    entropy: Tensor | None  # [T']

    def in_layout(self, pack: TreePack, align: str = "label") -> TokenLogprobs:
        """These per-row values in ``pack``'s layout (module docstring: ``align``).

        Indexing by ``pack.rows`` directly would shift the entropy by one position and read
        row -1 in a dense layout's padding.

        Args:
            pack: the pack these rows came from.
            align: ``"label"`` or ``"prediction"``.

        Returns:
            :class:`TokenLogprobs`; ``entropy`` is None when these rows have none. Autograd flows
            back to the row values.

        Raises:
            ValueError: row values whose length is not the pack's row count, or another
                ``align``.
        """
        check_align(align)
        if self.logprobs.shape != (pack.num_rows,):
            raise ValueError(f"{tuple(self.logprobs.shape)} row values for a pack of "
                             f"{pack.num_rows} rows: use the pack they were computed on")
        where = _places(pack, align)
        flat_rows = pack.rows.reshape(-1)
        logprobs = _place(pack, where.logprobs, self.logprobs[flat_rows[pack.predictions.index]])
        entropy = None
        if self.entropy is not None:
            source = pack.predictions.source if align == "label" else flat_rows[where.entropy]
            entropy = _place(pack, where.entropy, self.entropy[source])
        return TokenLogprobs(logprobs, entropy, align)


def token_outputs(pack: TreePack, source: Logits | Head, *, temperature=1.0,
                  entropy: bool = False, align: str = "label",
                  chunk_size: int | None = None) -> TokenLogprobs:
    """Every prediction's log-prob (and entropy) from a pack's logits or hidden states.

    A packed row is normalised once per distinct temperature of the sequences that read it,
    however many occurrences read it; backward adds every occurrence's gradient into the
    shared row, which is the chain rule of the unpacked loss.

    Args:
        pack: the pack the outputs came from.
        source: :class:`~treepack.core.softmax.Logits` ``[T', V]`` or
            :class:`~treepack.core.softmax.Head` (validated by the caller).
        temperature: a finite number > 0, or one per sequence ([N], a tensor or array).
        entropy: also compute the entropies.
        align: ``"label"`` or ``"prediction"`` (module docstring).
        chunk_size: normalised rows per chunk (default: by bytes, see
            :func:`~treepack.core.softmax.default_chunk_size`).

    Returns:
        :class:`TokenLogprobs` in the pack's layout.

    Raises:
        ValueError: a temperature that is not finite and > 0, or not one per sequence; an
            ``align`` that is neither.
    """
    check_align(align)
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    distinct, seq_temp = np.unique(temps, return_inverse=True)
    plan = _normalised_rows(pack, tuple(seq_temp.tolist()) if len(distinct) > 1 else None,
                            entropy, align)
    logp, ent = normalise(source, plan.rows, distinct[plan.temperature], plan.pick,
                          pack.predictions.target, entropy=entropy, chunk_size=chunk_size)
    where = _places(pack, align)
    return TokenLogprobs(_place(pack, where.logprobs, logp),
                    None if ent is None else _place(pack, where.entropy, ent[plan.entropy]),
                    align)


def from_logits(pack: TreePack, logits: Tensor, *, temperature=1.0, entropy: bool = False,
                align: str = "label", chunk_size: int | None = None,
                what: str = "from_logits") -> TokenLogprobs:
    """:func:`token_outputs` of a pack's logits [T', V], every argument checked.

    Args:
        pack: the pack the logits came from.
        logits: [T', V] floating-point logits of the packed rows (``out.logits[0]``).
        temperature, entropy, align, chunk_size: as :func:`token_outputs`.
        what: the caller's name, for the messages.

    Returns:
        As :func:`token_outputs`.

    Raises:
        ValueError: logits of the wrong shape, device or vocabulary (a token id of the pack
            beyond V), or a bad temperature or ``align``.
        TypeError: logits that are not real floating point.
    """
    if logits.dim() != 2 or logits.shape[0] != pack.num_rows:
        hint = ("; for a model output of shape [1, T', V] pass out.logits[0]"
                if logits.dim() == 3 and logits.shape[0] == 1 else "")
        raise ValueError(f"{what} expects logits of shape [T'={pack.num_rows}, V] (one row per "
                         f"row of the pack, padding included), got {tuple(logits.shape)}{hint}")
    pack.check_device(logits, "logits")
    checks.floating(logits, "logits")
    pack.check_vocabulary(logits.shape[1])
    return token_outputs(pack, Logits(logits), temperature=temperature, entropy=entropy,
                         align=align, chunk_size=chunk_size)


def row_outputs(pack: TreePack, source: Logits | Head, *, temperature: float = 1.0,
                entropy: bool = False, chunk_size: int | None = None) -> RowLogprobs:
    """:func:`token_outputs` per packed row (one temperature): what a model's forward can
    return as one ``[T']`` tensor per quantity.

    Args:
        pack, source, chunk_size: as :func:`token_outputs`.
        temperature: one finite number > 0.
        entropy: also compute each packed row's entropy (leaves included).

    Returns:
        :class:`RowLogprobs` ``(logprobs [T'], entropy [T'] or None)``.

    Raises:
        ValueError: a bad temperature.
    """
    temperature = checks.temperature(temperature)
    plan = _row_plan(pack, entropy)
    logp, ent = normalise(source, plan.rows, temperature, plan.pick, plan.token,
                          entropy=entropy, chunk_size=chunk_size)
    row_logp = logp.new_zeros(pack.num_rows).index_put((plan.child,), logp)
    if ent is not None:
        ent = torch.cat([ent, ent.new_zeros(pack.num_rows - len(ent))])
    return RowLogprobs(row_logp, ent)


def take_columns(values: Tensor, columns: Tensor, keep: Tensor) -> Tensor:
    """Label-aligned ``[B, L]`` values read into a framework's columns: ``out[b, j] =
    values[b, columns[b, j]]`` where ``keep[b, j]``, else 0.

    TRL's completion columns and :meth:`treepack.collation.Batch.completion` both read a
    pack's values this way.

    Args:
        values: [B, L] values in a pack's (label-aligned) layout.
        columns: [B, K] integer positions into ``values`` (clamped into range).
        keep: [B, K] bool: which columns hold a value.

    Returns:
        [B, K] values, 0 where not kept; autograd flows back to ``values``.
    """
    columns = columns.clamp(0, max(values.shape[1] - 1, 0))
    if values.shape[1] == 0:
        return values.new_zeros(keep.shape)
    return torch.where(keep, values.gather(1, columns), values.new_zeros(()))


def per_sequence_temperature(temperature, n: int) -> np.ndarray:
    """A temperature (a number, or one per sequence as a tensor, array or list) as [N]
    float64 on the host, each finite and at least ``checks.MIN_TEMPERATURE``.

    Args:
        temperature: the temperature(s).
        n: the number of sequences.

    Returns:
        [N] float64.

    Raises:
        ValueError: not one value or one per sequence, or a value out of range.
    """
    if not isinstance(temperature, (Tensor, np.ndarray, list, tuple)) or (
            isinstance(temperature, Tensor) and temperature.dim() == 0):
        return np.full(n, checks.temperature(temperature))
    if isinstance(temperature, Tensor):  # its own precision, widened exactly
        t = temperature.detach().to("cpu", torch.float64).reshape(-1).numpy()
    else:  # numbers as Python has them (torch.as_tensor would round a list to float32)
        t = np.asarray(temperature, dtype=np.float64).reshape(-1)
    if t.size == 1:
        return np.full(n, checks.temperature(float(t[0])))
    if t.size != n:
        raise ValueError(f"temperature has {t.size} values for {n} sequences: give one "
                         "number or one per sequence")
    bad = ~(np.isfinite(t) & (t >= checks.MIN_TEMPERATURE))
    if bad.any():
        raise ValueError(f"temperature[{int(np.argmax(bad))}]={float(t[bad][0])!r} must be a finite "
                         f"number of at least {checks.MIN_TEMPERATURE:g}")
    return t


# ---------------------------------------------------------------------- index plans


def check_align(align: str) -> None:
    """Refuse an ``align`` that is not one of :data:`ALIGNMENTS`."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align={align!r} must be one of {ALIGNMENTS}: 'label' puts the "
                         "log-prob of token p at p, 'prediction' at p - 1")


def sequence_of(host, index: np.ndarray) -> np.ndarray:
    """The sequence of each flat position ``index`` of a pack's layout (``host``: its
    :class:`~treepack.core.forest.HostLayout`): ``s`` of ``s * L + p`` (dense) or of
    ``offsets[s] + p`` (flat)."""
    if host.rows.ndim == 2:
        return index // max(host.rows.shape[1], 1)
    return np.searchsorted(host.offsets, index, side="right") - 1


class _Places(NamedTuple):
    logprobs: Tensor  # [M] flat position of each prediction's log-prob
    entropy: Tensor  # flat position of each entropy value


@derived_from_pack
def _places(pack: TreePack, align: str) -> _Places:
    """Where the values go in the flattened layout: the target's position (label) or the one
    before it (prediction); entropies at the predictions (label) or at every token."""
    index = pack.predictions.index
    if align == "label":
        return _Places(index, index)
    tokens = np.flatnonzero(pack.host.rows.reshape(-1) >= 0)
    return _Places(index - 1, torch.from_numpy(tokens).to(pack.device))


def _place(pack: TreePack, where: Tensor, values: Tensor) -> Tensor:
    out = values.new_zeros(pack.rows.numel()).index_put((where,), values)
    return out.view(pack.rows.shape)


class _RowsToNormalise(NamedTuple):
    rows: np.ndarray  # [R] packed row of each normalised row, nondecreasing
    temperature: np.ndarray  # [R] index into the distinct temperatures
    pick: np.ndarray  # [M] normalised row of each prediction
    entropy: Tensor  # normalised row of each entropy value (_places order), on the device


@derived_from_pack
def _normalised_rows(pack: TreePack, seq_temp: tuple | None, entropy: bool,
                     align: str) -> _RowsToNormalise:
    """One normalised row per distinct (packed row, temperature) that an output reads, sorted
    by row: keys ``row * n + temperature index``."""
    h = pack.host
    seq_temp = np.zeros(pack.num_sequences, dtype=np.int64) if seq_temp is None else \
        np.asarray(seq_temp, dtype=np.int64)
    n = int(seq_temp.max()) + 1 if len(seq_temp) else 1
    flat_rows = h.rows.reshape(-1)
    pred_key = h.prediction_source * n + seq_temp[sequence_of(h, h.prediction_index)]
    if not entropy or align == "label":
        entropy_key = pred_key
    else:
        tokens = np.flatnonzero(flat_rows >= 0)
        entropy_key = flat_rows[tokens] * n + seq_temp[sequence_of(h, tokens)]
    keys = np.unique(np.concatenate([pred_key, entropy_key]) if entropy else pred_key)
    where = to_device([np.searchsorted(keys, entropy_key)], torch.int64, pack.device)[0]
    return _RowsToNormalise(keys // n, keys % n, np.searchsorted(keys, pred_key), where)


class _RowPlan(NamedTuple):
    rows: np.ndarray  # [R] packed rows to normalise
    pick: np.ndarray  # [E] normalised row of each (parent, child) edge's parent
    token: Tensor  # [E] the child's token
    child: Tensor  # [E] the child row


@derived_from_pack
def _row_plan(pack: TreePack, entropy: bool) -> _RowPlan:
    """Every (parent row, child row) edge; the rows normalised are the parents, or with
    entropies every packed row."""
    parent = pack.host.parent_row
    child = np.flatnonzero(parent >= 0)
    rows = np.arange(pack.num_packed_rows) if entropy else np.unique(parent[child])
    child_t = torch.from_numpy(child).to(pack.device)
    return _RowPlan(rows, np.searchsorted(rows, parent[child]), pack.input_ids[child_t],
                    child_t)
