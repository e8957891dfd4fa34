"""The segment backend: exact tree sparsity on standard attention kernels.

The packed rows are cut into chains (:mod:`treepack.attention.chains`): chain ``[a, b)``'s
``q`` queries see its context rows (its ancestors, by depth) and then its own rows causally,
``kv`` keys in all, aligned bottom-right: query t sees key u iff ``u <= off + t`` (and
``u > off + t - window``) with ``off = kv - q``. Chains run batched, one SDPA call per group.

Grouping is a cost choice. A call has a fixed cost (forward + backward on a CPU: tenths of a
millisecond, whatever its size) besides its ``G x q x kv`` scores, so a ragged batch with dozens
of distinct chain shapes would be launch-bound if every shape were its own call. Shapes are
therefore put in buckets (``q`` and ``kv`` each rounded up to one of 8 steps per doubling,
:func:`~treepack.attention.chains.geometric_bucket`), and a bucket holding several shapes runs
as one call padded to its largest shape, with an exact mask per chain, when the padding costs
less than the calls it saves. Padded query slots repeat their chain's last query (their
output is dropped and their gradient is zero); padded key slots are masked out.

Groups of one exact shape without a window or soft-capping use SDPA's bottom-right causal
bias (no mask is materialised). Padded groups, sliding windows and soft-capping need an
explicit mask (and, for soft-capping, the eager formula's scores), so they run in query chunks
whose key range is cut to what the chunk can see: memory stays O(chunk x keys).

Per forward: one gather each of queries, keys and values for all groups (keys and values with
float32 gradient accumulation over repeated rows), one call per group, one gather back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from treepack.attention.chains import Chains, chains, gather_rows, geometric_bucket
from treepack.attention.dense import sdpa, with_sink_key
from treepack.core.derived import derived_from_pack

CHUNK_ELEMENTS = 1 << 24  # scores (or mask entries) per chunk of a masked group
# The fixed cost of one attention call (forward + backward) in scores, at heads x head_dim =
# 64, and how a score's cost grows with that width. Measured on 2 CPU cores (torch 2.13): a
# score costs 6.9 ns at 4 heads of 16 and 36 ns at 8 heads of 64 (exponent 0.8); the call
# cost was tuned on ragged batches (bench/attention.py), where 20k beat 0, 80k and 320k.
CALL_COST = 20_000
SCORE_COST_EXPONENT = 0.8


def call_cost(width: int) -> float:
    """One call's fixed cost in scores at heads x head_dim = ``width``."""
    return CALL_COST * (64 / width) ** SCORE_COST_EXPONENT


class Padding(NamedTuple):
    """The real shape of each chain of a padded group."""

    offset: Tensor  # [G, 1, 1, 1] kv - q of each chain
    queries: Tensor  # [G, 1, 1, 1] real queries of each chain
    keys: Tensor  # [G, 1, 1, 1] real keys of each chain
    last_key: np.ndarray  # [Q] per query slot t, the extremes over chains of the last key
    first_key: np.ndarray  # it sees, off + min(t, q - 1): both nondecreasing in t


class Group(NamedTuple):
    """Chains attended in one batched call, padded to one shape where they differ."""

    size: int  # G, chains in the group
    q: int  # query slots per chain
    kv: int  # key slots per chain
    padding: Padding | None  # None when every chain has exactly this shape


class ShapeGroups(NamedTuple):
    groups: list[Group]
    q_rows: Tensor  # [S] the packed row of every query slot, group by group, chain by chain
    row_slot: Tensor  # [T'] the query slot holding each packed row's real output
    kv_rows: Tensor  # [sum of G * kv] the packed row of every key slot, in the same order


@derived_from_pack
def shape_groups(pack, window: int | None, width: int = 512) -> ShapeGroups:
    """Group the pack's chains into calls for heads x head_dim = ``width``; host work only."""
    return chain_groups(chains(pack, window), pack.num_rows, pack.device, width)


def chain_groups(c: Chains, num_rows: int, device, width: int = 512) -> ShapeGroups:
    """Group chains into calls: queries are rows ``[start, start + length)`` of ``num_rows``
    query rows, keys ``key_rows`` of a key tensor that may hold more rows than the queries
    (the context rows a part of a tree reads from earlier parts, :mod:`treepack.parts`)."""
    shapes, chain_shape = np.unique(np.stack((c.key_length, c.length), 1), axis=0,
                                    return_inverse=True)
    call = group_shapes(shapes[:, 1], shapes[:, 0], np.bincount(chain_shape.reshape(-1)),
                        call_cost(width))[chain_shape.reshape(-1)]
    key_start = c.key_start
    groups, q_rows, kv_rows, slots = [], [], [], []
    order = np.argsort(call, kind="stable")
    for members in np.split(order, np.flatnonzero(np.diff(call[order])) + 1):
        q_len, kv_len = c.length[members], c.key_length[members]
        Q, K = int(q_len.max()), int(kv_len.max())
        slot_q = np.minimum(np.arange(Q), q_len[:, None] - 1)  # [G, Q] padding repeats the last
        slot_k = np.minimum(np.arange(K), kv_len[:, None] - 1)  # [G, K] padding is masked
        q_rows.append((c.start[members][:, None] + slot_q).reshape(-1))
        kv_rows.append(c.key_rows[(key_start[members][:, None] + slot_k).reshape(-1)])
        real = np.arange(Q) < q_len[:, None]
        slots.append(real.reshape(-1))
        padding = None
        if (q_len != Q).any() or (kv_len != K).any():
            per_chain = lambda a: torch.from_numpy(a).view(-1, 1, 1, 1).to(device)  # noqa
            last = kv_len - q_len + np.minimum(np.arange(Q)[:, None], q_len - 1)  # [Q, G]
            padding = Padding(per_chain(kv_len - q_len), per_chain(q_len), per_chain(kv_len),
                              last.max(1), last.min(1))
        groups.append(Group(len(members), Q, K, padding))
    q_rows, real = np.concatenate(q_rows), np.concatenate(slots)
    row_slot = np.empty(num_rows, dtype=np.int64)
    row_slot[q_rows[real]] = np.flatnonzero(real)
    move = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return ShapeGroups(groups, move(q_rows), move(row_slot), move(np.concatenate(kv_rows)))


def merge_shapes(q: np.ndarray, kv: np.ndarray, count: np.ndarray, call_cost: float
                 ) -> tuple[np.ndarray, float]:
    """An optimal partition of the shapes, in the order given, into runs that each cost
    ``call_cost + chains x max(q) x max(kv)`` scores (one padded call).

    ``q``, ``kv``, ``count`` [n] are distinct shapes and their chain counts. Returns the run
    of each shape and the total cost. Dynamic programming over run ends, O(n^2) vectorised
    numpy.
    """
    n = q.shape[0]
    best = np.zeros(n + 1)
    start = np.zeros(n, dtype=np.int64)
    chains_before = np.concatenate(([0], np.cumsum(count)))
    for j in range(n):  # the run ending at shape j starts at some i <= j
        q_max = np.maximum.accumulate(q[j::-1])[::-1]  # max(q[i..j]) for i = 0..j
        kv_max = np.maximum.accumulate(kv[j::-1])[::-1]
        chains_in_run = chains_before[j + 1] - chains_before[: j + 1]
        cost = best[: j + 1] + call_cost + chains_in_run * q_max * kv_max
        start[j] = int(np.argmin(cost))
        best[j + 1] = cost[start[j]]
    run = np.empty(n, dtype=np.int64)
    j, r = n - 1, 0
    while j >= 0:  # walk the runs back from the last shape
        run[start[j]: j + 1] = r
        j, r = start[j] - 1, r + 1
    return run, float(best[n])


def group_shapes(q: np.ndarray, kv: np.ndarray, count: np.ndarray, call_cost: float
                 ) -> np.ndarray:
    """The call of each distinct shape: the cheapest :func:`merge_shapes` partition over a few
    orders (by keys; by query bucket then keys; by key bucket then queries), since padding
    one dimension is cheap only among shapes close in the other."""
    best = None
    for order in (np.lexsort((q, kv)), np.lexsort((kv, geometric_bucket(q))),
                  np.lexsort((q, geometric_bucket(kv)))):
        run, cost = merge_shapes(q[order], kv[order], count[order], call_cost)
        if best is None or cost < best[1]:
            call = np.empty_like(run)
            call[order] = run
            best = (call, cost)
    return best[0]


class _SelectSlots(torch.autograd.Function):
    """``x[:, q_rows]``: every packed row into its query slot, plus padding slots.

    Backward is the gather ``grad[:, row_slot]``, not a zero-fill and scatter: each row has
    one real slot, and a padding slot's gradient is exactly zero (its output is dropped).
    """

    @staticmethod
    def forward(ctx, x: Tensor, q_rows: Tensor, row_slot: Tensor) -> Tensor:
        ctx.save_for_backward(row_slot)
        return x.index_select(1, q_rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (row_slot,) = ctx.saved_tensors
        return grad.index_select(1, row_slot), None, None


def attention(q, k, v, attend, *, scale, softcap, window, dropout, sink=False,
              chunk=None, blocks=None) -> Tensor:
    # chunks need each chain's whole ancestry (key slot = depth); the window is masked then
    plan = shape_groups(attend.pack, window if chunk is None else None,
                        q.shape[1] * q.shape[3])
    return attend_groups(q, k, v, plan, scale=scale, softcap=softcap, window=window,
                         dropout=dropout, sink=sink, chunk=chunk, blocks=blocks)


def attend_groups(q, k, v, plan: ShapeGroups, *, scale, softcap, window, dropout,
                  sink=False, chunk=None, blocks=None) -> Tensor:
    """``q`` ``[1, Hq, rows, D]`` against ``k``/``v`` ``[1, Hkv, keys, D]`` by ``plan``;
    with ``sink``, one more key that every query sees (:func:`treepack.attention.sink_channel`);
    with ``chunk``, a query sees the keys of its own chunk of depth only (Llama 4's chunked
    attention: a chain's key slot is its depth, so the chunk starts at slot ``depth - depth %
    chunk``); with ``blocks`` (``[keys]`` block ids, -1 outside), a query also sees the later
    keys of its own block (a block lies within one chain, whose own rows are its last key
    slots)."""
    q_all = _SelectSlots.apply(q[0], plan.q_rows, plan.row_slot)  # [Hq, S, D]
    q_all = q_all.split([g.size * g.q for g in plan.groups], dim=1)
    sizes = [g.size * g.kv for g in plan.groups]
    k_all = gather_rows(k[0], plan.kv_rows, 1).split(sizes, dim=1)  # repeated rows summed once
    v_all = gather_rows(v[0], plan.kv_rows, 1).split(sizes, dim=1)
    qb_all = kb_all = [None] * len(plan.groups)
    if blocks is not None:
        q_blocks = blocks.index_select(0, plan.q_rows).split([g.size * g.q for g in plan.groups])
        k_blocks = blocks.index_select(0, plan.kv_rows).split(sizes)
        # which groups' queries hold a block: one look from the host for every group
        held = torch.stack([(qb >= 0).any() for qb in q_blocks]).tolist()
        qb_all = [qb if h else None for qb, h in zip(q_blocks, held)]
        kb_all = [kb if h else None for kb, h in zip(k_blocks, held)]
    outs = []
    for g, qg, kg, vg, qb, kb in zip(plan.groups, q_all, k_all, v_all, qb_all, kb_all):
        qg = qg.unflatten(1, (g.size, g.q)).transpose(0, 1)  # [G, Hq, q, D]
        kg = kg.unflatten(1, (g.size, g.kv)).transpose(0, 1)  # [G, Hkv, kv, D]
        vg = vg.unflatten(1, (g.size, g.kv)).transpose(0, 1)
        if window is None and softcap is None and g.padding is None and not sink \
                and chunk is None and qb is None:
            out = sdpa(qg, kg, vg, causal_lower_right(g.q, g.kv), scale=scale, softcap=None,
                       dropout=dropout)
        else:
            blocks_g = None if qb is None else (qb.view(g.size, g.q), kb.view(g.size, g.kv))
            out = _masked_chunks(qg, kg, vg, g, window, scale=scale, softcap=softcap,
                                 dropout=dropout, sink=sink, chunk=chunk, blocks=blocks_g)
        outs.append(out.transpose(0, 1).flatten(1, 2))  # [Hq, G * q, D]
    return torch.cat(outs, dim=1).index_select(1, plan.row_slot)[None]  # [1, Hq, T', D]


def _masked_chunks(qg, kg, vg, group: Group, window, sink=False, chunk=None, blocks=None,
                   **kw) -> Tensor:
    """Bottom-right causal (and windowed) attention with an explicit mask, in query chunks.

    Query t of a chain with ``q`` queries and ``kv`` keys sees key u iff ``u <= off + t``
    and, with a window, ``u > off + t - window`` (``off = kv - q``). In a padded group each
    chain has its own ``off`` and ``kv``, and a padding query slot ``t >= q`` takes the mask of
    query ``q - 1``. A chunk ``[t0, t1)`` needs keys ``[max(0, off_min + t0 - window + 1),
    off_max + t1)`` only; with ``blocks`` (each query and key slot's block id, ``[G, q]`` and
    ``[G, kv]``) it also sees the keys of its own block, to the last key slot.
    """
    G, H, Q, _ = qg.shape
    K = kg.shape[2]
    pad = group.padding
    off = K - Q if pad is None else pad.offset
    step = max(1, min(Q, CHUNK_ELEMENTS // max(1, G * H * K)))  # queries per call
    outs = []
    for t0 in range(0, Q, step):
        t1 = min(t0 + step, Q)
        first = K - Q + t0 if pad is None else int(pad.first_key[t0])
        last = K - Q + t1 - 1 if pad is None else int(pad.last_key[t1 - 1])
        a = 0 if window is None else max(0, first - window + 1)
        b = last + 1 if blocks is None else K
        t = torch.arange(t0, t1, device=qg.device)[:, None]
        u = torch.arange(a, b, device=qg.device)[None, :]
        if pad is not None:
            t = torch.minimum(t, pad.queries - 1)  # [G, 1, chunk, 1]
        mask = u <= off + t  # [chunk, b - a], or [G, 1, chunk, b - a] when padded
        if blocks is not None:  # [G, 1, chunk, b - a]: the query's own block, both ways
            qb, kb = blocks[0][:, None, t0:t1, None], blocks[1][:, None, None, a:b]
            mask = mask | ((qb == kb) & (qb >= 0))
        if pad is not None:
            mask = mask & (u < pad.keys)
        if window is not None:
            mask = mask & (u > off + t - window)
        if chunk is not None:  # key slot u is depth u: the query's chunk starts at a multiple
            mask = mask & (u >= (off + t) // chunk * chunk)
        ks, vs = kg[:, :, a:b], vg[:, :, a:b]
        if sink:  # the sink key after the chain's keys, seen by every query of the chunk
            ks, vs = with_sink_key(ks, vs, 2)
            mask = torch.cat((mask, mask.new_ones((*mask.shape[:-1], 1))), -1)
        outs.append(sdpa(qg[:, :, t0:t1], ks, vs, mask, **kw))
    return torch.cat(outs, dim=2)
