"""The segment backend: exact tree sparsity on standard attention kernels.

A compressed segment's rows ``[a, b)`` at depths ``d0 .. d0+q-1`` see exactly the rows of its
path at depths ``lo .. d0+q-1`` (``lo = 0``, or ``d0 - window + 1`` with a sliding window),
causally, aligned bottom-right: query t sees path position u iff ``u <= off + t`` (and
``u > off + t - window``) with ``off = kv - q``. That path is a slice of ``rows`` for any
sequence through the segment, so the keys are one gather. Segments with the same
``(q, kv)`` run as one batched call. Per forward: one gather of keys and values for all
groups, one gather of queries and one attention call per group, one permutation back.

Plain groups use SDPA's bottom-right causal bias (no mask is materialised). Groups with a
sliding window or soft-capping need an explicit mask (and, for soft-capping, the eager
formula's scores), so they run in query chunks whose key range is cut to what the chunk can
see: memory stays O(chunk x keys), never a segment's full [q, kv].
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from treepack.attention.dense import sdpa


CHUNK_ELEMENTS = 1 << 24  # scores (or mask entries) per chunk of a masked group


class Group(NamedTuple):
    q_rows: Tensor  # [G * q] packed rows of the group's queries, segment by segment
    kv_rows: Tensor  # [G, kv] packed rows of each segment's visible path
    q: int
    kv: int


class Plan(NamedTuple):
    groups: list[Group]
    kv_rows: Tensor  # [sum of G * kv] every group's kv_rows, flattened, in group order
    inverse: Tensor  # [T'] where each packed row's output sits in the groups' concatenation


def build_plan(pack, window: int | None) -> Plan:
    """Group the segments (and padding rows, as one-row segments) by shape; host work only."""
    h = pack.host
    start, end = h.segment_start, h.segment_end
    q_len = end - start
    d0 = h.position_ids[start]
    lo = np.zeros_like(d0) if window is None else np.maximum(d0 - window + 1, 0)
    kv_len = d0 + q_len - lo
    pad = np.arange(pack.num_tokens, pack.num_rows)  # padding rows see only themselves
    key = np.stack((np.append(q_len, np.ones_like(pad)), np.append(kv_len, np.ones_like(pad))))
    order = np.lexsort(key[::-1])
    edges = np.flatnonzero(np.any(np.diff(key[:, order], axis=1) != 0, axis=0)) + 1
    groups, placed = [], []
    num_segments = start.shape[0]
    for members in np.split(order, edges):
        q, kv = (int(x) for x in key[:, members[0]])
        segs = members[members < num_segments]
        pads = pad[members[members >= num_segments] - num_segments][:, None]  # only if q == 1
        q_rows = np.concatenate((start[segs][:, None] + np.arange(q), pads.repeat(q, 1)))
        path = h.rows[h.segment_sequence[segs][:, None], lo[segs][:, None] + np.arange(kv)]
        kv_rows = np.concatenate((path, pads.repeat(kv, 1)))
        placed.append(q_rows.reshape(-1))
        groups.append(Group(
            q_rows=torch.from_numpy(q_rows.reshape(-1)).to(pack.device),
            kv_rows=torch.from_numpy(kv_rows).to(pack.device),
            q=q, kv=kv,
        ))
    inverse = np.empty(pack.num_rows, dtype=np.int64)
    inverse[np.concatenate(placed)] = np.arange(pack.num_rows)
    kv_rows = torch.cat([g.kv_rows.reshape(-1) for g in groups])
    return Plan(groups, kv_rows, torch.from_numpy(inverse).to(pack.device))


class _GatherRows(torch.autograd.Function):
    """``x[:, rows]`` whose backward sums repeated rows in float32 and rounds once.

    A shared key row is gathered once per descendant segment; plain indexing would add those
    gradients one by one in the input dtype (bfloat16: one rounding per addition), where the
    attention kernel of an unpacked run reduces over all queries with one rounding.
    """

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:  # x [H, T', D], rows [R]
        ctx.save_for_backward(rows)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x[:, rows]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        acc = torch.promote_types(ctx.dtype, torch.float32)
        out = grad.new_zeros(ctx.shape, dtype=acc)
        out.index_add_(1, rows, grad.to(acc))
        return out.to(ctx.dtype), None


def attention(q, k, v, ctx, *, scale, softcap, window, dropout) -> Tensor:
    plan = ctx.cached(("segment", window), lambda: build_plan(ctx.pack, window))
    q0 = q[0]  # [H, T', D]
    sizes = [g.kv_rows.numel() for g in plan.groups]
    k_all = _GatherRows.apply(k[0], plan.kv_rows).split(sizes, dim=1)  # one gather, one sum
    v_all = _GatherRows.apply(v[0], plan.kv_rows).split(sizes, dim=1)
    outs = []
    for g, kg, vg in zip(plan.groups, k_all, v_all):
        n = g.kv_rows.shape[0]
        qg = q0[:, g.q_rows].unflatten(1, (n, g.q)).transpose(0, 1)  # [G, Hq, q, D]
        kg = kg.unflatten(1, (n, g.kv)).transpose(0, 1)  # [G, Hkv, kv, D]
        vg = vg.unflatten(1, (n, g.kv)).transpose(0, 1)
        if window is None and softcap is None:
            out = sdpa(qg, kg, vg, causal_lower_right(g.q, g.kv), scale=scale, softcap=None,
                       dropout=dropout)
        else:
            out = _masked_chunks(qg, kg, vg, window, scale=scale, softcap=softcap,
                                 dropout=dropout)
        outs.append(out.transpose(0, 1).flatten(1, 2))  # [Hq, G * q, D]
    return torch.cat(outs, dim=1)[:, plan.inverse][None]  # [1, Hq, T', D]


def _masked_chunks(qg, kg, vg, window, **kw) -> Tensor:
    """Bottom-right causal (and windowed) attention, a chunk of queries at a time.

    Query t (of q) sees path position u (of kv) iff ``u <= off + t`` and, with a window,
    ``u > off + t - window`` (``off = kv - q``); a chunk ``[t0, t1)`` needs keys
    ``[max(0, off + t0 - window + 1), off + t1)`` only.
    """
    G, H, q, _ = qg.shape
    kv = kg.shape[2]
    off = kv - q
    chunk = max(1, min(q, CHUNK_ELEMENTS // max(1, G * H * kv)))
    outs = []
    for t0 in range(0, q, chunk):
        t1 = min(t0 + chunk, q)
        a = 0 if window is None else max(0, off + t0 - window + 1)
        b = off + t1
        t = torch.arange(t0, t1, device=qg.device)[:, None]
        u = torch.arange(a, b, device=qg.device)[None, :]
        mask = u <= off + t  # [t1 - t0, b - a]
        if window is not None:
            mask &= u > off + t - window
        outs.append(sdpa(qg[:, :, t0:t1], kg[:, :, a:b], vg[:, :, a:b], mask, **kw))
    return torch.cat(outs, dim=2)
