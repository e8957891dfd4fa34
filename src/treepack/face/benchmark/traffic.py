"""Bytes a forward and backward hand the row/head exchange (all-to-all) of sequence or
context parallelism, counted by wrapping :func:`treepack.attention.exchange._all_to_all`."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from treepack.attention import exchange

__all__ = ["Traffic"]


class Traffic:
    """Bytes handed to the exchange's all-to-all while counting, by phase (``forward`` and
    ``backward``: set :attr:`phase` between them): all of them (``sent``), the share that
    leaves the rank (``leaving``), and the calls."""

    def __init__(self):
        self.phase = "forward"
        self.counts = {p: {"sent": 0, "leaving": 0, "calls": 0} for p in ("forward", "backward")}

    @contextlib.contextmanager
    def counting(self):
        original = exchange._all_to_all

        def all_to_all(x, scatter, gather, group):
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            sent = x.numel() * x.element_size()
            own = x.chunk(size, scatter)[rank].numel() * x.element_size()
            count = self.counts[self.phase]
            count["sent"] += sent
            count["leaving"] += sent - own
            count["calls"] += 1
            return original(x, scatter, gather, group)

        exchange._all_to_all = all_to_all  # the exchange looks it up at every call
        try:
            yield self
        finally:
            exchange._all_to_all = original
