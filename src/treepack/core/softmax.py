"""Log-softmax of selected logits rows, chunk by chunk, without a float32 copy of the logits.

``log_softmax(logits.float(), -1)`` over ``[T', V]`` logits keeps a ``[T', V]`` float32 tensor
for backward (and the entropy two more): at T' = 16k rows and V = 152k that is 10 GB each,
more than the bfloat16 logits themselves. :func:`log_softmax_rows` computes what a loss reads
(the log-prob of each picked token, and optionally each row's entropy) one chunk of rows at
a time and recomputes the chunk's softmax in backward, so besides the logits (kept for
backward, as any use of them does) and their gradient only ``O(chunk x V)`` float32 work and
``O(rows)`` statistics exist. Values and gradients are computed in float32 at least and the
gradient is rounded to the logits' dtype once per element.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["log_softmax_rows", "default_chunk_size", "to_device", "CHUNK_BYTES",
           "DEFAULT_CHUNK_BYTES"]

# Bytes of float32 logits per chunk, by device type. On a GPU the chunk must be large for the
# per-chunk work (and, in the lean head, its three matmuls) to run near peak and to amortise
# (measured on an H200 at V = 151,936: 110-row chunks took 3.3x the time of full logits,
# 4096-row chunks 1.1x); 1 GiB is ~1,770 rows there. The peak is a few chunks, never growing
# with T'.
CHUNK_BYTES = {"cuda": 1 << 30}
DEFAULT_CHUNK_BYTES = 1 << 26  # 64 MiB elsewhere: on CPU larger chunks gain little


def default_chunk_size(vocab: int, device: torch.device | str | None = None) -> int:
    """Rows per chunk: ``CHUNK_BYTES`` of float32 logits on ``device``'s type (1 GiB on CUDA,
    64 MiB elsewhere), at least one row.

    Args:
        vocab: V, the logits per row.
        device: where the chunks are computed (default: the CPU).

    Returns:
        The number of rows.

    Raises:
        Nothing of its own (torch raises for a device name it does not know).
    """
    kind = torch.device(device).type if device is not None else "cpu"
    return max(1, CHUNK_BYTES.get(kind, DEFAULT_CHUNK_BYTES) // (4 * vocab))


def log_softmax_rows(logits: Tensor, rows: np.ndarray, temperature: np.ndarray | float,
                     pick: np.ndarray, token: Tensor, *, with_entropy: bool = False,
                     chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Picked log-probs (and row entropies) of ``log_softmax(logits[rows] / temperature)``.

    Normalised row ``i`` is logits row ``rows[i]`` divided by ``temperature[i]``; a logits row
    may be normalised several times (at different temperatures), its repeats adjacent.

    Args:
        logits: [T', V] floating-point logits.
        rows: [R] host int array, nondecreasing: the logits row of each normalised row.
        temperature: [R] host array of finite values > 0, or one number for every row
            (validated by the caller).
        pick: [M] host int array: the normalised row of each wanted log-prob.
        token: [M] token ids on the logits' device: ``out[m] = logp[pick[m], token[m]]``.
        with_entropy: also return every normalised row's entropy.
        chunk_size: normalised rows per chunk (default :func:`default_chunk_size`).

    Returns:
        ``(logp [M], entropy [R] or None)`` in float32 at least (float64 stays float64).

    Raises:
        Nothing of its own (the callers validate shapes and values).
    """
    work = torch.promote_types(logits.dtype, torch.float32)
    plan = _ChunkPlan(rows, pick, temperature, work,
                      chunk_size or default_chunk_size(logits.shape[1], logits.device),
                      logits.device)
    out = _RowLogSoftmax.apply(logits, token, plan, with_entropy)
    return (out[0], out[1]) if with_entropy else (out, None)


class _ChunkPlan:
    """Host-side chunking of the normalised rows, and device copies of the indices.

    Chunks never split a logits row's repeats, so each logits row's gradient is summed in
    float32 and rounded once. The picks are sorted by normalised row so that each chunk's
    picks are one contiguous range. A chunk of consecutive logits rows reads them as a view,
    and a chunk at temperature 1 divides by nothing. Every index reaches the device in one
    copy, from pinned memory on a GPU, so building the plan does not wait for the GPU.
    """

    def __init__(self, rows, pick, temperature, work: torch.dtype, chunk: int, device):
        rows = np.asarray(rows, dtype=np.int64)
        pick = np.asarray(pick, dtype=np.int64)
        n = len(rows)
        temps = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,))
        bounds, a = [], 0
        while a < n:
            b = min(a + chunk, n)
            b = int(np.searchsorted(rows, rows[b - 1], side="right"))  # keep repeats together
            bounds.append((a, b))
            a = b
        order = np.argsort(pick, kind="stable")
        pick_sorted = pick[order]
        starts = np.searchsorted(pick_sorted, [a for a, _ in bounds] + [n])
        host = [rows, pick, order, pick_sorted]
        distinct = []  # per chunk: its distinct logits rows and each row's among them, or None
        for a, b in bounds:
            uniq, inverse = np.unique(rows[a:b], return_inverse=True)
            distinct.append(None if len(uniq) == b - a else (len(host), len(host) + 1))
            if len(uniq) < b - a:
                host += [uniq, inverse.reshape(-1)]
        ints = to_device(host, torch.int64, device)
        self.rows, self.pick, self.order, self.pick_sorted = ints[:4]
        self.temperature = to_device([temps], torch.float64, device)[0].to(work)
        self.work = work
        self.chunks = []
        for i, (a, b) in enumerate(bounds):
            consecutive = distinct[i] is None and rows[b - 1] - rows[a] == b - a - 1
            self.chunks.append(_Chunk(
                a, b, int(starts[i]), int(starts[i + 1]),
                slice(int(rows[a]), int(rows[b - 1]) + 1) if consecutive else self.rows[a:b],
                None if (temps[a:b] == 1).all() else self.temperature[a:b, None],
                None if distinct[i] is None else tuple(ints[j] for j in distinct[i])))

    def logits(self, logits: Tensor, chunk: _Chunk) -> tuple[Tensor, bool]:
        """The chunk's scaled logits [C, V] in the work dtype, and whether the tensor is
        fresh (may be changed in place) rather than a view of ``logits``."""
        z = logits[chunk.rows]
        fresh = isinstance(chunk.rows, Tensor)
        if z.dtype != self.work:
            z, fresh = z.to(self.work), True
        if chunk.temperature is not None:  # a tensor, as for the picked logits: same rounding
            z, fresh = z / chunk.temperature, True
        return z, fresh


class _Chunk(NamedTuple):
    a: int  # normalised rows [a, b)
    b: int
    lo: int  # its picks, in sorted order [lo, hi)
    hi: int
    rows: slice | Tensor  # its logits rows
    temperature: Tensor | None  # [C, 1], or None at temperature 1
    distinct: tuple[Tensor, Tensor] | None  # distinct logits rows and each row's among them


def to_device(arrays: list[np.ndarray], dtype: torch.dtype, device) -> list[Tensor]:
    """The arrays on ``device`` through one copy (pinned and asynchronous on a GPU)."""
    sizes = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.float64 if dtype == torch.float64
                                                          else np.int64, copy=False))
    device = torch.device(device)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(flat.split(sizes))


class _RowLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token, plan: _ChunkPlan, with_entropy):
        n = plan.rows.shape[0]
        lse = logits.new_empty(n, dtype=plan.work)
        entropy = logits.new_empty(n, dtype=plan.work) if with_entropy else None
        for c in plan.chunks:
            z, fresh = plan.logits(logits, c)  # [C, V]
            lse[c.a:c.b] = torch.logsumexp(z, dim=-1)
            if with_entropy:  # H = -sum p logp, a -inf logit adding 0
                logp = z.sub_(lse[c.a:c.b, None]) if fresh else z - lse[c.a:c.b, None]
                p = logp.exp()
                entropy[c.a:c.b] = p.mul_(logp.masked_fill_(logp.isneginf(), 0)).sum(-1).neg_()
        picked = logits[plan.rows[plan.pick], token].to(plan.work) / plan.temperature[plan.pick]
        logp = picked - lse[plan.pick]
        ctx.save_for_backward(logits, token, lse, entropy)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    @once_differentiable  # the backward recomputes in chunks: no graph for a second order
    def backward(ctx, grad_logp, grad_entropy=None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        logits, token, lse, entropy = ctx.saved_tensors
        plan = ctx.plan
        grad = torch.zeros_like(logits)
        # d logp[m] / d z[pick m] = onehot(token m) - softmax: each row needs its picks' sum
        g_row = lse.new_zeros(lse.shape[0])
        g_pick = None
        if grad_logp is not None:
            g_pick = grad_logp.to(lse.dtype)[plan.order]  # sorted by normalised row
            g_row.index_add_(0, plan.pick_sorted, g_pick)
        token_sorted = token[plan.order]
        for c in plan.chunks:
            z, fresh = plan.logits(logits, c)
            logp = z.sub_(lse[c.a:c.b, None]) if fresh else z - lse[c.a:c.b, None]
            if grad_entropy is None:  # softmax and its gradient in place
                gz = logp.exp_().mul_(-g_row[c.a:c.b, None])
            else:  # dH/dz = -p * (logp + H): gz = -p * (g_row + g_H * (logp + H)), in place
                p = logp.exp()
                gz = (logp.masked_fill_(logp.isneginf(), 0).add_(entropy[c.a:c.b, None])
                      .mul_(grad_entropy[c.a:c.b, None]).add_(g_row[c.a:c.b, None])
                      .mul_(p).neg_())
            if g_pick is not None and c.hi > c.lo:
                gz.index_put_((plan.pick_sorted[c.lo:c.hi] - c.a, token_sorted[c.lo:c.hi]),
                              g_pick[c.lo:c.hi], accumulate=True)
            if c.temperature is not None:
                gz /= c.temperature
            if c.distinct is not None:  # a row at several temperatures: sum, round once
                uniq, inverse = c.distinct
                summed = gz.new_zeros(len(uniq), gz.shape[1]).index_add_(0, inverse, gz)
                grad.index_copy_(0, uniq, summed.to(grad.dtype))
            elif isinstance(c.rows, slice):
                grad[c.rows] = gz
            else:
                grad.index_copy_(0, c.rows, gz.to(grad.dtype))
        return grad, None, None, None
