"""The TreePack layout: N token sequences merged into one prefix forest in DFS pre-order.

Shape legend (used in comments across the package)::

    N   input sequences             L   longest input sequence
    T   distinct packed rows        T'  rows after padding (T' >= T)
    S   compressed segments         M   prediction occurrences (sum of len - 1)
    V   vocabulary                  H   hidden size

Invariants (docs/design.md): rows are laid out in depth-first pre-order, so every row's subtree
is the contiguous range ``[j, subtree_end[j])`` and key row ``j`` is visible to query row
``i`` iff ``j <= i < subtree_end[j]``; ``position_ids`` are depths on the original
sequences; ``rows[s, p]`` is the packed row of token ``p`` of sequence ``s``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core import deprecation
from treepack.core import mask as _mask
from treepack.core import outputs
from treepack.core.checks import (pack_device, positive_int, sequence_indices,
                                  validate_keys, validate_routes, validate_sequences)
from treepack.core import derived as _derived
from treepack.core.derived import derived_from_pack
from treepack.core.forest import (ForestStats, HostLayout, build_layout, identities,
                                  route_keys, stats_of_arrays)

__all__ = ["TreePack", "Segments", "Predictions", "HostLayout", "forest_stats",
           "validate_sequences", "derived_from_pack", "MAX_PAD_MULTIPLE"]

MAX_PAD_MULTIPLE = 1 << 20  # rows: far beyond any block or compile bucket


class Segments(NamedTuple):
    """The compressed prefix forest: one segment per node, in DFS pre-order.

    A segment is a maximal run of rows that every sequence passing through its first row
    also passes through whole; it breaks at branch points and where a sequence ends. All rows
    of a segment share one ``subtree_end``. Its queries see the rows of its ancestor
    segments plus its own rows causally.
    """

    start: Tensor  # [S] first packed row
    end: Tensor  # [S] one past the last packed row
    parent: Tensor  # [S] index of the parent segment, -1 for a root


class Predictions(NamedTuple):
    """Every next-token prediction occurrence of the input, flattened (M of them).

    Occurrence ``m`` predicts token ``p`` of sequence ``s`` (``index[m] = s * L + p``,
    ``1 <= p < len_s``) from packed row ``source[m] = rows[s, p - 1]``; the target token
    id is ``target[m]``. Shared rows appear once per occurrence in ``source``.
    """

    source: Tensor  # [M] packed row whose logits predict the target
    target: Tensor  # [M] target token id
    index: Tensor  # [M] flat position s * L + p in the [N, L] layout


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TreePack:
    """One forward's worth of sequences, merged into a prefix forest.

    Build it with :meth:`TreePack.from_sequences`. Rows hold each distinct prefix once, in
    depth-first pre-order; ``position_ids`` are depths, not packed indices; a key row is
    visible to a query row iff it is an ancestor or the row itself. Per-occurrence data
    (loss masks, advantages, old log-probs) stays in the original ``[N, L]`` layout: the
    model's per-row outputs come back to that layout through :meth:`token_logprobs` and
    :meth:`unpack`.

    The worked example: three sequences ABCD, ABCE, ABFG (token ids A=1 ... G=7) share the
    prefixes A, AB and ABC. Seven rows instead of twelve:

    >>> A, B, C, D, E, F, G = range(1, 8)
    >>> pack = TreePack.from_sequences([[A, B, C, D], [A, B, C, E], [A, B, F, G]])
    >>> pack
    TreePack(sequences=3, packed_rows=7, original_tokens=12, token_ratio=0.583, segments=5, predictions=9)
    >>> pack.input_ids.tolist()  # A B C D E F G
    [1, 2, 3, 4, 5, 6, 7]
    >>> pack.position_ids.tolist()  # depth on the original sequence: F is at depth 2
    [0, 1, 2, 3, 3, 2, 3]
    >>> pack.subtree_end.tolist()  # row j's subtree is rows [j, subtree_end[j])
    [7, 7, 5, 4, 5, 7, 7]
    >>> pack.parent_row.tolist()  # the row of the previous token: D and E hang off C
    [-1, 0, 1, 2, 2, 1, 5]
    >>> pack.rows.tolist()  # packed row of token p of sequence s
    [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5, 6]]
    >>> print(pack.dense_mask().int())  # E (row 4) sees A B C E, never D; G sees A B F G
    tensor([[1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 1, 1]], dtype=torch.int32)

    Segments are the compressed nodes: AB, C, D, E, FG, each with its parent segment.

    >>> pack.segments.start.tolist(), pack.segments.end.tolist(), pack.segments.parent.tolist()
    ([0, 2, 3, 4, 5], [2, 3, 4, 5, 7], [-1, 0, 1, 1, 0])

    Nine prediction occurrences come from four distinct logit rows (A, B, C and F); C's
    row predicts both D and E, B's row predicts C twice and F once.

    >>> pack.num_predictions, pack.num_prediction_rows
    (9, 4)
    >>> pack.predictions.source.tolist()
    [0, 1, 2, 0, 1, 2, 0, 1, 5]
    >>> pack.predictions.target.tolist()
    [2, 3, 4, 2, 3, 5, 2, 6, 7]
    >>> pack.prediction_mask.int().tolist()  # position 0 predicts nothing
    [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]

    ``token_logprobs`` maps logits ``[T', V]`` to label-aligned log-probs ``[N, L]``:
    ``logps[s, p] = log p(seq_s[p] | seq_s[:p])``. With uniform logits over a vocabulary
    of 8, each is ``log(1/8)``:

    >>> logps = pack.token_logprobs(torch.zeros(7, 8))
    >>> torch.allclose(logps[pack.prediction_mask], torch.tensor(1 / 8).log())
    True
    """

    input_ids: Tensor  # [T'] token id of each packed row (0 for padding rows)
    position_ids: Tensor  # [T'] depth of the row on its original sequences (0 for padding)
    subtree_end: Tensor  # [T'] one past the last row of the row's subtree (j + 1 for padding)
    parent_row: Tensor  # [T'] row of the previous token on the path; -1 at roots and padding
    rows: Tensor  # [N, L] packed row of token p of sequence s, -1 beyond its length
    # (flat layout: [total], rows[offsets[s] + p])
    lengths: Tensor  # [N] length of each input sequence
    offsets: Tensor  # [N + 1] where each sequence starts in the flat layout (cumsum of lengths)
    seq_ids: Tensor  # [N] index of each sequence in the caller's batch (arange(N) by default)
    prediction_mask: Tensor  # [N, L] (flat: [total]) True where logps is a real prediction
    segments: Segments
    predictions: Predictions
    num_packed_rows: int  # T: distinct rows, padding excluded
    num_original_tokens: int  # sum of the input lengths
    num_prediction_rows: int  # distinct rows whose logits predict at least one token
    max_token_id: int  # the largest token id (-1 for an empty pack): checked against V
    host: HostLayout

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int] | np.ndarray | Tensor],
        *,
        pad_to_multiple_of: int | None = None,
        device: torch.device | str | None = None,
        seq_ids=None,
        share_prefixes: bool = True,
        layout: str = "dense",
        keys=None,
        routes=None,
    ) -> TreePack:
        """Merge token sequences into one prefix forest.

        Args:
            sequences: N non-empty sequences of non-negative token ids: lists of ints, 1-D
                integer numpy arrays or 1-D integer tensors. Duplicates, sequences that are
                prefixes of others and unrelated sequences (several trees) are all fine.
            pad_to_multiple_of: pad the packed rows to a multiple of this (e.g. the
                attention block size or a compile-friendly bucket). Padding rows have id 0
                and position 0, see only themselves, and are never read back.
            device: where the tensors live (default CPU); see also :meth:`to`.
            seq_ids: the index of each sequence in the caller's batch (default
                ``0 .. N-1``), kept as :attr:`seq_ids` so outputs can be matched back.
            share_prefixes: with ``False`` nothing is merged: every sequence is its own
                chain of rows, back to back in input order. That is standard padding-free
                packing (one row per original token), through the same code path, backends
                and outputs: the baseline to compare tree packing with, and a layout for data
                without shared prefixes.
            layout: ``"dense"`` (default): per-token tables and outputs (``rows``,
                ``prediction_mask``, :meth:`token_logprobs`, ...) are ``[N, L]``, label
                aligned. ``"flat"``: they are ``[total tokens]``, sequence after sequence
                (:attr:`offsets`, as ``cu_seqlens``), so a batch of very uneven lengths never
                costs N x the longest; the layout of padding-free trainers (verl's nested
                tensors).
            keys: per-token content keys, one integer sequence per sequence of the same
                length (0: the token is its id alone), for any model input that makes
                tokens with one id differ: the content hash of the image an image
                placeholder stands for, an audio clip's, a token type. Two tokens are then one
                row only where their ids, their keys and everything before them are equal:
                the same text with different images never merges, the same image in two
                prompts does. The rows' keys are ``pack.host.row_keys``.
            routes: the experts each token was routed to, one integer array
                ``[len(seq), moe_layers, topk]`` per sequence, as rollout engines record them
                for routing replay (verl's ``routed_experts``, slime's): two tokens are then
                one row only where their routes agree too, so a prompt the engine routed once
                stays shared and one routed differently forks where its routes differ. A
                layer's top-k of -1 throughout means no route was recorded there (verl's
                replay mask): the router routes that token itself, so such tokens merge
                with each other, not with recorded ones. Each sequence's last route is a
                placeholder (the rollout has no route for the last token, which predicts
                nothing of its sequence; verl pads it): it is not compared, and the last
                token takes the route of the row it joins. The rows' routes are
                ``pack.host.row_routes`` (``[T', moe_layers, topk]``).

        Returns:
            The :class:`TreePack` (immutable).

        Raises:
            TypeError / ValueError: a sequence that is empty, not 1-D, not integer, or holds a
                negative id (the message names it); a bad ``pad_to_multiple_of``, ``seq_ids``,
                ``share_prefixes``, ``layout``, ``keys`` or ``routes``.
        """
        ids = validate_sequences(sequences)
        seq_ids = sequence_indices(seq_ids, len(ids))
        keys = None if keys is None else validate_keys(keys, ids)
        if pad_to_multiple_of is not None:
            pad_to_multiple_of = positive_int(
                pad_to_multiple_of, "pad_to_multiple_of", maximum=MAX_PAD_MULTIPLE,
                hint=" (padding rows per multiple; None for no padding)")
        if not isinstance(share_prefixes, bool):
            raise TypeError(f"share_prefixes={share_prefixes!r} must be True or False")
        if layout not in ("dense", "flat"):
            raise ValueError(f"layout={layout!r}: choose 'dense' ([N, L] outputs) or 'flat' "
                             "([total tokens] outputs, sequence after sequence)")
        match = None
        if routes is not None:
            routes = validate_routes(routes, ids)
            if share_prefixes:
                match, routes = route_keys(ids, keys, routes)
        tables = build_layout(ids, pad_to_multiple_of or 1, share=share_prefixes,
                              flat=layout == "flat", keys=keys, routes=routes, match=match)
        pack = cls._from_host(tables, seq_ids)
        return pack if device is None else pack.to(device)

    @classmethod
    def empty(cls, num_rows: int = 1, *, device: torch.device | str | None = None) -> TreePack:
        """A pack of no sequences: ``num_rows`` padding rows, no predictions.

        For ranks that have fewer packs than others in a step: running it keeps collectives
        (DDP, FSDP) in step and adds nothing to any loss or gradient.

        Args:
            num_rows: padding rows, at least 1.
            device: where the tensors live (default CPU).

        Returns:
            The empty :class:`TreePack`.

        Raises:
            ValueError: ``num_rows`` not a positive int (or beyond ``MAX_PAD_MULTIPLE``).
        """
        num_rows = positive_int(num_rows, "num_rows", maximum=MAX_PAD_MULTIPLE)
        pack = cls._from_host(HostLayout.empty(num_rows), np.zeros(0, dtype=np.int64))
        return pack if device is None else pack.to(device)

    @classmethod
    def _from_host(cls, host: HostLayout, seq_ids: np.ndarray) -> TreePack:
        t = torch.from_numpy  # CPU tensors share the host tables' memory
        return cls(
            input_ids=t(host.input_ids),
            position_ids=t(host.position_ids),
            subtree_end=t(host.subtree_end),
            parent_row=t(host.parent_row),
            rows=t(host.rows),
            lengths=t(host.lengths),
            offsets=t(host.offsets),
            seq_ids=t(seq_ids),
            prediction_mask=t(host.prediction_mask),
            segments=Segments(t(host.segment_start), t(host.segment_end),
                              t(host.segment_parent)),
            predictions=Predictions(t(host.prediction_source), t(host.prediction_target),
                                    t(host.prediction_index)),
            num_packed_rows=host.num_packed_rows,
            num_original_tokens=int(host.lengths.sum()),
            num_prediction_rows=host.num_prediction_rows,
            max_token_id=int(host.input_ids[: host.num_packed_rows].max(initial=-1)),
            host=host,
        )

    def to(self, device: torch.device | str | int, *rest, **options) -> TreePack:
        """The same pack with every tensor on ``device``.

        Only the device changes: a pack holds integer and boolean tables (ids, depths, rows,
        masks) whose dtypes are part of its layout, so unlike ``Tensor.to`` this takes no
        dtype, no tensor to copy a dtype from and no further options.

        Args:
            device: a torch device, its name or a CUDA device index.

        Returns:
            A new :class:`TreePack`; host tables stay on the host, and structures derived from
            the pack (attention plans, block masks) are rebuilt there on first use.

        Raises:
            TypeError: a dtype, a tensor or anything else that is not a device, or any
                argument beyond the device.
        """
        device = pack_device(device, rest, options)

        def move(value):
            if isinstance(value, Tensor):
                return value.to(device)
            if isinstance(value, (Segments, Predictions)):
                return type(value)(*(x.to(device) for x in value))
            return value

        return dataclasses.replace(
            self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)}
        )

    def derived(self, key, build):
        """``build()``, computed once per pack (and device) and cached under ``key``.

        Prefer :func:`derived_from_pack`, which keys each structure by the function that
        builds it (:mod:`treepack.core.derived` holds the cache).
        """
        return _derived.cached(self, key, build)

    # ------------------------------------------------------------------ sizes

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_sequences(self) -> int:
        """N, the number of input sequences."""
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        """L, the longest input sequence (the width of the ``[N, L]`` layout)."""
        return int(self.host.lengths.max(initial=0))

    @property
    def layout(self) -> str:
        """``"dense"``: per-token outputs are ``[N, L]``; ``"flat"``: ``[total tokens]``,
        sequence ``s`` at ``offsets[s] .. offsets[s + 1]``."""
        return "flat" if self.rows.dim() == 1 else "dense"

    @property
    def num_rows(self) -> int:
        """T', the padded rows: packed rows plus padding, the length the model runs on."""
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Deprecated: :attr:`num_packed_rows`, T, the distinct packed rows."""
        deprecation.warn("TreePack.num_tokens", "TreePack.num_packed_rows")
        return self.num_packed_rows

    @property
    def num_segments(self) -> int:
        return self.host.segment_start.shape[0]

    @property
    def num_predictions(self) -> int:
        """M, the next-token prediction occurrences of the input (sum of ``len - 1``)."""
        return self.predictions.source.shape[0]

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs of one attention pass over the packed rows: each row
        sees its depth + 1 ancestors and itself (padding excluded)."""
        return int((self.host.position_ids[: self.num_packed_rows] + 1).sum())

    @property
    def token_ratio(self) -> float:
        """Distinct rows over original tokens (padding excluded): the share of work left."""
        return self.num_packed_rows / max(self.num_original_tokens, 1)

    def __repr__(self) -> str:
        pad = f", padded_rows={self.num_rows}" if self.num_rows != self.num_packed_rows else ""
        return (
            f"TreePack(sequences={self.num_sequences}, packed_rows={self.num_packed_rows}{pad}, "
            f"original_tokens={self.num_original_tokens}, token_ratio={self.token_ratio:.3f}, "
            f"segments={self.num_segments}, predictions={self.num_predictions}"
            + (", layout=flat)" if self.layout == "flat" else ")")
        )

    # ------------------------------------------------------------------ attention masks

    def dense_mask(self) -> Tensor:
        """BoolTensor [T', T']: True where query row i may attend key row j.

        The slow, obviously correct reference for tests and small packs: it allocates T'^2
        booleans. Models should use an attention backend (:mod:`treepack.attention`).

        Returns:
            ``mask[i, j] = j <= i < subtree_end[j]``.
        """
        return _mask.dense_mask(self.subtree_end)

    def mask_mod(self, *, window: int | None = None):
        """A FlexAttention ``mask_mod`` for the pack.

        Args:
            window: with a sliding window, keys fewer than ``window`` positions (depths)
                back only.

        Returns:
            ``mask_mod(b, h, q, kv) = (kv <= q) & (q < subtree_end[kv])`` (and
            ``position_ids[q] - position_ids[kv] < window``), a closure over O(T') tensors.
        """
        return _mask.tree_mask_mod(self.subtree_end, self.position_ids, window)

    def block_mask(self, block_size: int = 128, *, window: int | None = None):
        """A FlexAttention ``BlockMask`` over the T' rows, built from ``subtree_end``.

        Uses per-block min/max of ``subtree_end`` (O(T + (T'/block_size)^2) work and memory,
        never a T x T tensor); full blocks are listed apart from partial ones so the kernel
        skips ``mask_mod`` on them, and the query-side tables for the backward pass are
        built directly rather than by transposing. With a sliding ``window``, blocks wholly
        out of reach in depth are skipped as well.

        Args:
            block_size: FlexAttention's block size (128 by default).
            window: a sliding window in positions, or None.

        Returns:
            The ``BlockMask`` (on the pack's device).

        Raises:
            ValueError: ``block_size`` not a positive int.
        """
        return _mask.block_mask(
            self.host.subtree_end, block_size=block_size, device=self.device,
            mask_mod=self.mask_mod(window=window), position_ids=self.host.position_ids,
            window=window,
        )

    # ------------------------------------------------------------------ outputs back to [N, L]

    def token_logprobs(self, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
        """Label-aligned log-probs [N, L] (flat layout: [total]) from packed logits [T', V].

        ``out[s, p] = log softmax(logits[rows[s, p-1]] / temperature)[seq_s[p]]`` for
        ``1 <= p < len_s`` and 0 elsewhere (see :attr:`prediction_mask`). Each packed row is
        normalised once, however many occurrences read it; the first token after a fork is
        predicted from the shared parent row; backward adds every occurrence's gradient into
        the shared rows. Computed in float32 at least (float64 stays float64), in chunks of
        rows (:mod:`treepack.softmax`): no float32 copy of the logits is made or kept.

        Args:
            logits: [T', V] floating-point logits of the packed rows (``out.logits[0]``).
            temperature: a finite number > 0 the logits are divided by.

        Returns:
            [N, L] (flat: [total]) log-probs in float32 at least.

        Raises:
            ValueError: logits of the wrong shape, device, dtype or vocabulary (a token id
                of the pack beyond V), or a bad temperature.
        """
        return self._outputs(logits, temperature, "token_logprobs", entropy=False).logprobs

    def token_entropy(self, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
        """Entropy of each prediction's next-token distribution, in the layout of
        :meth:`token_logprobs` (``out[s, p]`` is the entropy at row ``rows[s, p-1]``).

        Args:
            logits: [T', V] floating-point logits of the packed rows.
            temperature: a finite number > 0 the logits are divided by.

        Returns:
            [N, L] (flat: [total]) entropies; a ``-inf`` logit contributes 0.

        Raises:
            ValueError: as :meth:`token_logprobs`.
        """
        return self._outputs(logits, temperature, "token_entropy", entropy=True).entropy

    def token_logprobs_and_entropy(self, logits: Tensor, *, temperature: float = 1.0
                                   ) -> tuple[Tensor, Tensor]:
        """:meth:`token_logprobs` and :meth:`token_entropy` in one pass over the logits (half
        the work of calling both, and each row's gradient rounded once).

        Args:
            logits: [T', V] floating-point logits of the packed rows.
            temperature: a finite number > 0 the logits are divided by.

        Returns:
            ``(logprobs, entropy)``, each [N, L] (flat: [total]).

        Raises:
            ValueError: as :meth:`token_logprobs`.
        """
        out = self._outputs(logits, temperature, "token_logprobs_and_entropy", entropy=True)
        return out.logprobs, out.entropy

    def place(self, values: Tensor) -> Tensor:
        """Per-prediction values placed in the pack's layout.

        Args:
            values: [M] one value per prediction occurrence, in :attr:`predictions` order.

        Returns:
            [N, L] label-aligned (flat: [total]), 0 where there is no prediction; autograd
            flows back to ``values``.
        """
        out = values.new_zeros(self.rows.numel()).index_put((self.predictions.index,), values)
        return out.view(self.rows.shape)

    def check_vocabulary(self, vocab: int) -> None:
        """Raise unless every token id of the pack is below ``vocab``."""
        if self.max_token_id >= vocab:
            raise ValueError(
                f"the pack has token id {self.max_token_id} but the logits cover a vocabulary of "
                f"{vocab}: use the model (or LM head) that matches the tokenizer"
            )

    def check_device(self, tensor: Tensor, name: str) -> None:
        """Raise unless ``tensor`` is on the pack's device, naming the fix."""
        if tensor.device != self.device:
            raise ValueError(
                f"{name} is on {tensor.device} but the pack is on {self.device}; move the pack "
                f"with pack.to({str(tensor.device)!r})"
            )

    def _outputs(self, logits: Tensor, temperature: float, what: str, *, entropy: bool):
        return outputs.from_logits(self, logits, temperature=temperature, entropy=entropy, what=what)

    def completion_mask(self, prompt_lengths) -> Tensor:
        """BoolTensor [N, L]: the predictions of completion tokens, for a loss on them only.

        Args:
            prompt_lengths: [N] tokens of each sequence's prompt, in this pack's order (for
                a pack from :func:`treepack.plan`, index your batch's lengths with
                :attr:`seq_ids`: ``pack.completion_mask(prompt_lens[pack.seq_ids])``).

        Returns:
            ``mask[s, p]`` True where ``prompt_lengths[s] <= p < lengths[s]`` (and p >= 1):
            exactly where :meth:`token_logprobs` holds the log-prob of a completion token.

        Raises:
            ValueError: not one non-negative integer per sequence, or a prompt longer than
                its sequence.
        """
        plen = torch.as_tensor(prompt_lengths)
        if plen.numel() == 0:  # [] reads as float32: an empty list of lengths is fine
            plen = plen.long()
        if plen.shape != (self.num_sequences,) or plen.dtype.is_floating_point or \
                plen.dtype == torch.bool:
            raise ValueError(f"prompt_lengths must be {self.num_sequences} integers, one per "
                             f"sequence of the pack, got {plen.dtype} {tuple(plen.shape)}")
        plen = plen.to(self.device)
        bad = (plen < 0) | (plen > self.lengths)
        if bad.any():
            s = int(bad.nonzero()[0, 0])
            raise ValueError(f"prompt_lengths[{s}] = {int(plen[s])} but sequence {s} has "
                             f"{int(self.lengths[s])} tokens")
        if self.layout == "flat":
            lengths = self.lengths.to(self.device)
            start = self.offsets[:-1]
            position = torch.arange(self.num_original_tokens, device=self.device) - \
                torch.repeat_interleave(start, lengths)  # [total] p of each token
            return (position >= torch.repeat_interleave(plen, lengths)) & self.prediction_mask
        positions = torch.arange(self.max_length, device=self.device)
        return (positions >= plen[:, None]) & self.prediction_mask

    def unpack(self, x: Tensor) -> Tensor:
        """Map a per-row tensor to the original layout: the inverse of packing.

        ``out[s, p] = x[rows[s, p]]`` and 0 beyond each sequence's length. A shared row is
        copied to every occurrence, and in backward each occurrence's gradient is added into
        it.

        Args:
            x: [T', ...] one value (or vector) per packed row, e.g. ``out.hidden_states[k][0]``.

        Returns:
            [N, L, ...] (flat layout: [total, ...]).

        Raises:
            ValueError: ``x`` does not have T' rows.
        """
        if x.dim() == 0 or x.shape[0] != self.num_rows:
            raise ValueError(
                f"unpack expects a per-row tensor of shape [T'={self.num_rows}, ...], got "
                f"{tuple(x.shape)}; for a model output of shape [1, T', ...] pass out[0]"
            )
        if self.layout == "flat":
            return x[self.rows]
        valid = self.rows >= 0
        out = x[self.rows.clamp(min=0)]
        return out.masked_fill(~valid.view(*valid.shape, *([1] * (x.dim() - 1))), 0)


def forest_stats(sequences, keys=None) -> ForestStats:
    """What packing ``sequences`` into one forest saves, without building the layout.

    O(total tokens) time and memory (sort and adjacent LCPs only), so it suits whole
    datasets.

    Args:
        sequences: token-id sequences, as for :meth:`TreePack.from_sequences`.
        keys: per-token content keys, as for :meth:`TreePack.from_sequences` (an image
            placeholder's image): the forest over (id, key) pairs, as the pack would be.

    Returns:
        :class:`ForestStats`: ``packed_rows``, ``token_ratio``, visible attention pairs
        packed vs unpacked, and the number of trees.

    Raises:
        TypeError / ValueError: bad sequences, as :meth:`TreePack.from_sequences`.
    """
    ids = validate_sequences(sequences)
    return stats_of_arrays(ids if keys is None else identities(ids, validate_keys(keys, ids)))
