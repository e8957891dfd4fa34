"""Tree attention over ranks that each hold a slice of the rows (Ulysses exchange).

Every rank of a group holds a contiguous slice of a forward's rows (``width`` rows, the last
ranks padded) and all heads; tree attention needs every row, so an all-to-all turns
(own rows, all heads) into (all rows, own heads), the tree backend runs over every row for
those heads, and a second all-to-all turns the result back. Both exchanges are autograd
functions whose backward is the reverse exchange, so the backward is the tree's.
:class:`HeadExchange` is shared by the transformers adapter's sequence parallelism and
Megatron's context parallelism.

Key/value heads fewer than, or not a multiple of, the group's size are repeated up to a
multiple of it first (each rank then holds whole heads); query heads must divide.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["HeadExchange", "all_to_all", "all_gather", "sum_over", "rank_stream"]

# torch 2.13 renamed the single-tensor collectives; the GPU image's 2.11 has the old names
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_to_all(x: Tensor, scatter: int, gather: int, group) -> Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), gather)


class _Exchange(torch.autograd.Function):
    """All-to-all: ``x`` cut into P pieces along ``scatter``, piece j to rank j, the pieces
    received joined along ``gather`` in rank order. Its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter: int, gather: int, group) -> Tensor:
        ctx.dims, ctx.group = (scatter, gather), group
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter, gather = ctx.dims
        return _all_to_all(grad, gather, scatter, ctx.group), None, None, None


def all_to_all(x: Tensor, scatter: int, gather: int, group) -> Tensor:
    """``x`` cut into the group's size along ``scatter``, piece j sent to rank j, the pieces
    received joined along ``gather`` in rank order; differentiable (the backward is the
    reverse exchange)."""
    return _Exchange.apply(x.contiguous(), scatter, gather, group)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0: every rank's ``x`` joined in rank order. Its backward
    reduce-scatters: each rank gets the sum over the group of its piece's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _gather_into(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather(x: Tensor, group) -> Tensor:
    """Every rank's ``x`` joined along dim 0 in rank order, on every rank; differentiable (each
    rank's gradient is the group's sum of the gradients of its piece)."""
    return _Gather.apply(x.contiguous(), group)


class _Sum(torch.autograd.Function):
    """The sum over the group of every rank's ``x``; its backward hands each rank the
    gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, group, scale: float) -> Tensor:
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None, None


def sum_over(x: Tensor, group, scale: float = 1.0) -> Tensor:
    """Every rank's ``x`` summed over ``group``, on every rank; the gradient back is the
    caller's times ``scale`` (1: each rank's parameters hold the gradient of its own share;
    the group's size: P times it, for an average over the group)."""
    return _Sum.apply(x, group, float(scale))


class HeadExchange:
    """The exchanges of one forward whose ``total`` rows are split over ``group``.

    Args:
        group: the process group; ``rank`` and ``size``, this process's place in it.
        total: the forward's rows, over every rank.
        width: the rows each rank holds (its own, padded); ``width * size >= total``.
        error: the exception type for counts the group cannot split.
    """

    def __init__(self, group, rank: int, size: int, total: int, width: int,
                 error: type = ValueError):
        self.group, self.rank, self.size = group, rank, size
        self.total, self.width, self.error = total, width, error

    def split(self, count: int, what: str, owner: str) -> tuple[int, int]:
        """This rank's share ``lo .. hi - 1`` of ``count`` heads or channels."""
        if count % self.size:
            raise self.error(
                f"{owner} has {count} {what}, which {self.size} ranks cannot split evenly: "
                f"use a group size that divides {count}")
        each = count // self.size
        return self.rank * each, (self.rank + 1) * each

    def to_heads(self, x: Tensor, heads: int, rows: int) -> Tensor:
        """(own rows, all heads) -> (all rows, own heads), ``rows`` cut to the forward's."""
        return all_to_all(x, heads, rows, self.group).narrow(rows, 0, self.total)

    def to_rows(self, x: Tensor, rows: int, heads: int) -> Tensor:
        """(all rows, own heads) -> (own rows, all heads)."""
        pad = self.width * self.size - self.total
        if pad:
            shape = list(x.shape)
            shape[rows] = pad
            x = torch.cat((x, x.new_zeros(shape)), rows)
        return all_to_all(x, rows, heads, self.group)

    def gather(self, x: Tensor) -> Tensor:
        """(own rows, ...) -> (all rows, ...): every rank's rows along dim 0, cut to the
        forward's; differentiable (each row's gradient summed over the group, to its owner)."""
        return all_gather(x, self.group).narrow(0, 0, self.total)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attend, owner: str) -> Tensor:
        """``attend(q, k, v)`` over every row for this rank's heads, from this rank's rows
        of ``query`` ``[1, H, width, D]`` and ``key``, ``value`` ``[1, K, width, D]``; the
        result ``[1, H, width, D]`` for this rank's rows and every head."""
        heads, kv = query.shape[1], key.shape[1]
        self.split(heads, "attention heads", owner)
        if kv % self.size:  # fewer key/value heads than ranks: repeat each one
            repeat = math.lcm(kv, self.size) // kv
            if heads % (kv * repeat):
                self.split(kv, "key/value heads", owner)
            key = key.repeat_interleave(repeat, 1)
            value = value.repeat_interleave(repeat, 1)
        q, k, v = self._qkv_to_heads(query, key, value)
        return self.to_rows(attend(q, k, v), 2, 1)

    def _qkv_to_heads(self, query: Tensor, key: Tensor, value: Tensor):
        """The three in one exchange where their head widths agree: each rank's piece holds
        its query, key and value heads side by side."""
        if not query.shape[3] == key.shape[3] == value.shape[3]:
            return tuple(self.to_heads(t, 1, 2) for t in (query, key, value))
        p, (_, h, n, d), kv = self.size, query.shape, key.shape[1]
        joined = torch.cat([t.reshape(1, p, t.shape[1] // p, n, d) for t in (query, key, value)],
                           2).reshape(1, -1, n, d)
        return self.to_heads(joined, 1, 2).split((h // p, kv // p, kv // p), 1)


@contextlib.contextmanager
def rank_stream(rank: int, device: torch.device):
    """While it lasts, random numbers come from a stream of this rank's own: seeded from one
    draw of the global CPU generator (the same on every rank seeded alike) and ``rank``. Ranks
    that split one forward's rows or heads would otherwise draw one dropout mask for
    different rows or heads. Recomputation replays it: activation checkpointing saves the
    generators' state inside the stream, and a caller that restores the global generators
    before the draw gets the same stream again. The global CPU generator advances by the
    one draw; the device's is restored."""
    draw = int(torch.randint(0, 2**62, (1,)).item())
    seed = (draw * 0x9E3779B97F4A7C15 + rank + 1) % 2**63
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield

