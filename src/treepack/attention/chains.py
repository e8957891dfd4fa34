"""Attention chains: the packed rows cut where a tree forks, with the keys each chain reads.

A *chain* is a maximal run of packed rows ``[a, b)`` in which every row's parent is the row
before it (``parent_row[r] == r - 1``). In DFS pre-order such a run follows first children
from ``a`` down to a leaf, so chains end only where a tree forks (every later child starts a
chain) or where a tree ends, never where a sequence ends mid-way: the steps of an agent
trajectory that extend each other are one chain. Padding rows are one-row chains.

Row ``a + t`` of a chain sees the ancestors of ``a`` and the chain's rows ``a .. a + t``. So
a chain's keys are one list: its *context*, the rows of its ancestor path at depths
``lo .. d0 - 1`` (``d0`` the depth of ``a``; ``lo = 0``, or ``d0 - window + 1`` with a
sliding window), then its own rows. Its queries, the contiguous rows ``[a, b)``, attend them
causally aligned bottom-right: query ``t`` sees key ``u`` iff ``u <= context + t`` and, with
a window, ``u > context + t - window``. That is FlashAttention's variable-length contract
with ``cu_seq_q`` the chain boundaries and ``cu_seq_k`` the running key counts (the
``varlen`` backend); the ``segment`` backend batches chains of equal shape instead.

Chunked attention (Llama 4: a query sees the keys of its own chunk of ``chunk`` depths only)
cuts a chain also where a chunk begins (a row at a depth divisible by ``chunk``) and starts its
context at its chunk's first depth: each chain then lies in one chunk, and the same causal
contract holds.

Only forks cost a gather: the keys read beyond the rows themselves are the context rows,
``sum(context)``, bounded by the depths of the forks; a forest without forks (padding-free
packing, a single agent trajectory) gathers nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.forest import ragged_arange
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["Chains", "chains", "subset_chains", "VarlenIndex", "varlen_index", "index_of",
           "BlockIndex", "block_index", "gather_rows", "geometric_bucket"]

EXACT_UP_TO = 16  # sizes up to this are their own bucket


class Chains(NamedTuple):
    """The packed rows cut into chains, on the host (see the module doc)."""

    start: np.ndarray  # [C] first packed row of each chain, ascending; they tile [0, T')
    length: np.ndarray  # [C] rows of the chain: its queries
    context: np.ndarray  # [C] ancestor rows its queries also see, keyed before its own rows
    key_rows: np.ndarray  # [K] per chain: its context rows (by depth), then its own rows

    @property
    def key_length(self) -> np.ndarray:
        """[C] keys of each chain: context plus own rows."""
        return self.context + self.length

    @property
    def key_start(self) -> np.ndarray:
        """[C + 1] where each chain's keys start in ``key_rows`` (the last is K)."""
        return np.concatenate(([0], np.cumsum(self.key_length)))

    @property
    def gathers(self) -> bool:
        """Whether any chain reads context rows (else ``key_rows`` is ``arange(T')``)."""
        return bool(self.context.any())


@derived_from_pack
def chains(pack: TreePack, window: int | None = None, chunk: int | None = None) -> Chains:
    """The chains of ``pack`` and their keys for a sliding ``window`` (None: unbounded) and
    attention ``chunk`` (None: no chunks).

    Host work, O(T' + K) numpy: no per-row Python.
    """
    return subset_chains(pack, np.arange(pack.num_rows), window, chunk)


def subset_chains(pack: TreePack, rows: np.ndarray, window: int | None = None,
                  chunk: int | None = None, blocks: np.ndarray | None = None) -> Chains:
    """The chains of a subset of the pack's rows run as one forward (all of them:
    :func:`chains`; a part of a tree too large for one forward: :mod:`treepack.hf.parts`).

    ``rows`` (ascending) are the forward's query rows; its chains are cut where a row's parent
    is not the row before it in the subset. ``start`` counts in the subset (0 .. len(rows));
    ``key_rows`` are the pack's rows: a chain's ancestors (which may lie outside the subset,
    computed by an earlier forward) then its own rows. Host work, O(len(rows) + K) numpy.
    """
    h = pack.host
    rows = np.asarray(rows, dtype=np.int64)
    first = np.ones(rows.shape[0], dtype=bool)
    first[1:] = h.parent_row[rows[1:]] != rows[:-1]
    if chunk is not None:  # a chunk's first depth starts a chain: each lies in one chunk
        first |= h.position_ids[rows] % chunk == 0
    if blocks is not None:  # a block (rows that see each other both ways) is a chain alone
        first[1:] |= blocks[rows[1:]] != blocks[rows[:-1]]
    start = np.flatnonzero(first)
    length = np.diff(np.append(start, rows.shape[0]))
    head = rows[start]
    depth = h.position_ids[head]  # padding rows have depth 0: no context
    lo = np.zeros_like(depth) if window is None else np.maximum(depth - window + 1, 0)
    if chunk is not None:  # nothing before the chunk's first depth
        lo = np.maximum(lo, depth - depth % chunk)
    context = depth - lo
    # Any sequence through the segment holding a chain's first row passes through the
    # chain's ancestors: its rows at depths lo .. depth - 1 are the context.
    real = head < pack.num_packed_rows
    seq = np.zeros_like(head)
    seq[real] = h.segment_sequence[np.searchsorted(h.segment_start, head[real],
                                                   side="right") - 1]
    # where sequence `seq`'s rows start in the flattened rows table ([N, L] or flat)
    base = h.offsets[seq] if h.rows.ndim == 1 else seq * (h.rows.shape[1] if h.rows.size else 0)
    context_rows = h.rows.reshape(-1)[ragged_arange(base + lo, context)]
    key_length = context + length
    key_start = np.cumsum(key_length) - key_length
    key_rows = np.empty(int(key_length.sum()), dtype=np.int64)
    key_rows[ragged_arange(key_start, context)] = context_rows
    key_rows[ragged_arange(key_start + context, length)] = rows
    return Chains(start, length, context, key_rows)


def geometric_bucket(n):
    """``n`` rounded up to one of 8 steps per doubling: unchanged up to ``EXACT_UP_TO``, then
    the next multiple of ``2**(e - 3)`` for ``2**e <= n < 2**(e + 1)`` (at most 1/8 more).
    Works on ints and integer arrays alike."""
    n = np.asarray(n, dtype=np.int64)
    step = np.left_shift(1, np.maximum(np.frexp(np.maximum(n, 1))[1] - 4, 0))  # 2**(e-3)
    out = np.where(n <= EXACT_UP_TO, n, -(-n // step) * step)
    return int(out) if out.ndim == 0 else out


class VarlenIndex(NamedTuple):
    """The chains as FlashAttention's varlen arguments, on the pack's device."""

    cu_seq_q: Tensor  # [C + 1] int32 chain boundaries in the packed rows
    cu_seq_k: Tensor  # [C + 1] int32 chain boundaries in the gathered keys
    max_q: int
    max_k: int
    key_rows: Tensor | None  # [K] rows to gather as keys; None when K = T' in order
    cu_seq_q_host: np.ndarray  # the same boundaries on the host, for the CPU reference
    cu_seq_k_host: np.ndarray


@derived_from_pack
def varlen_index(pack: TreePack, window: int | None = None,
                 chunk: int | None = None) -> VarlenIndex:
    """The chains as FlashAttention's varlen arguments on the pack's device (cached)."""
    return index_of(chains(pack, window, chunk), pack.num_rows, pack.device)


def index_of(c: Chains, rows: int, device_of) -> VarlenIndex:
    """Chains ``c`` over ``rows`` query rows as FlashAttention's varlen arguments on
    ``device_of`` (a whole pack's, or a part's: its ``key_rows`` slots of its keys)."""
    cu_q = np.append(c.start, rows)
    cu_k = c.key_start

    def device(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device_of, dtype=dtype)

    return VarlenIndex(
        cu_seq_q=device(cu_q, torch.int32),
        cu_seq_k=device(cu_k, torch.int32),
        max_q=int(c.length.max()),
        max_k=int(c.key_length.max()),
        key_rows=device(c.key_rows, torch.int64) if c.gathers else None,
        cu_seq_q_host=cu_q,
        cu_seq_k_host=cu_k,
    )


class BlockIndex(NamedTuple):
    """A pack's chains with blocks of rows that see each other both ways (Gemma 3's image
    tokens), as two varlen calls: the chains outside blocks (causal) and the blocks (each its
    own chain, seeing its ancestors and all of its own rows)."""

    causal: VarlenIndex | None  # None: every row is in a block
    causal_rows: Tensor | None  # [Qc] the packed rows of its queries, in order
    both_ways: VarlenIndex | None  # None: no blocks
    block_rows: Tensor | None
    order: Tensor  # [T'] where each packed row's output is in (causal, then block) outputs


def block_index(pack: TreePack, window: int | None, blocks: np.ndarray) -> BlockIndex:
    """:class:`BlockIndex` of ``pack`` for ``blocks`` (``[T']`` block ids, -1 outside; a
    block lies within one chain). Host work, O(T' + K) numpy."""
    c = subset_chains(pack, np.arange(pack.num_rows), window, blocks=blocks)
    in_block = blocks[c.start] >= 0
    key_start = c.key_start
    parts, rows_of = [], []
    for pick in (~in_block, in_block):
        if not pick.any():
            parts.append(None)
            rows_of.append(np.zeros(0, dtype=np.int64))
            continue
        length, context = c.length[pick], c.context[pick]
        rows = ragged_arange(c.start[pick], length)
        keys = c.key_rows[ragged_arange(key_start[:-1][pick], length + context)]
        sub = Chains(np.cumsum(length) - length, length, context, keys)
        index = index_of(sub, int(length.sum()), pack.device)
        if not sub.gathers:  # its keys are other rows than its queries: always gather
            index = index._replace(key_rows=torch.from_numpy(keys).to(pack.device))
        parts.append(index)
        rows_of.append(rows)
    order = np.empty(pack.num_rows, dtype=np.int64)
    order[np.concatenate(rows_of)] = np.arange(pack.num_rows)

    def device(a):
        return torch.from_numpy(a).to(pack.device) if a.size else None

    return BlockIndex(parts[0], device(rows_of[0]), parts[1], device(rows_of[1]),
                      torch.from_numpy(order).to(pack.device))


class _GatherRows(torch.autograd.Function):
    """``x.index_select(dim, rows)`` whose backward sums repeated rows in float32, rounding once.

    A shared key row is gathered once per chain below it; plain indexing would add those
    gradients one by one in the input dtype (bfloat16: one rounding per addition), where the
    attention kernel of an unpacked run reduces over all queries with one rounding.
    """

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, dim: int) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.shape, ctx.dtype, ctx.dim = x.shape, x.dtype, dim
        return x.index_select(dim, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        acc = torch.promote_types(ctx.dtype, torch.float32)
        out = grad.new_zeros(ctx.shape, dtype=acc)
        out.index_add_(ctx.dim, rows, grad.to(acc))
        return out.to(ctx.dtype), None, None


def gather_rows(x: Tensor, rows: Tensor, dim: int) -> Tensor:
    """``x.index_select(dim, rows)``, with repeated rows' gradients summed in float32."""
    return _GatherRows.apply(x, rows, dim)
