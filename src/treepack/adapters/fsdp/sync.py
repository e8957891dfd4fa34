"""Data parallelism around a step in parts: every rank runs its own sequence of parts, and the
collectives line up anyway.

- DDP: the parts run on the module inside the wrapper (whose per-backward reduction and
  per-forward buffer broadcast would need every rank to run as many parts); the gradients are
  averaged once at the end (:func:`average_gradients`), as DDP's reducer would.
- FSDP2 and FSDP1: every parameter is gathered once, up front, and kept while the parts run,
  their gradients accumulated unsharded; one empty forward and backward, the same on every
  rank (the adapter's ``empty_step``), then reduce-scatters them and reshards
  (:func:`unsharded`).

A rank without trees (an empty pack) runs no part and still takes part in each collective.
:func:`average_gradients` is also what ``treepack.hf.average_gradients`` runs after a
sequence-parallel backward outside DDP / FSDP.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["local", "unsharded", "average_gradients", "finish"]


def local(model):
    """The module a rank runs its parts on: the one inside DDP, else ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def finish(model) -> None:
    """After a training step's parts: DDP's gradient average (FSDP's ran in
    :func:`unsharded`)."""
    if local(model) is not model:
        average_gradients(model.module, model.process_group, zeros_for_missing=True)


@contextlib.contextmanager
def unsharded(model, empty_step, train: bool = True):
    """FSDP2: every module's parameters gathered once, up front, and kept while the parts
    run, their gradients accumulated unsharded without reduction; then one empty forward
    and backward on every rank reduce-scatters them and reshards (without ``train``: the
    parameters are resharded). So each rank runs its own sequence of parts, while the
    collectives (one all-gather per module, one reduce-scatter per module) line up across
    ranks. FSDP1: :func:`_fsdp1_unsharded`. Anything else: nothing to do.

    ``empty_step()``: one forward and backward of no rows through ``model``, contributing
    nothing (the adapter's: an empty pack through the model)."""
    from torch.distributed.fsdp import FSDPModule

    if _fsdp1_root(model) is not None:
        with _fsdp1_unsharded(model, empty_step, train):
            yield
        return
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        yield
        return
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_forward(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        if train:
            _sync_step(empty_step)
        else:
            for m in sharded:
                m.reshard()


def _sync_step(empty_step) -> None:
    """One empty forward and backward, the same on every rank: with FSDP's gradient sync
    back on, it reduce-scatters what the parts accumulated unsharded, and reshards."""
    with torch.enable_grad():
        empty_step()


def _fsdp1_root(model):
    """The outermost FSDP1 (``FullyShardedDataParallel``) module in ``model``, or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


@contextlib.contextmanager
def _fsdp1_unsharded(model, empty_step, train: bool):
    """FSDP1, as FSDP2 above: every handle's flat parameter gathered once, up front, and kept
    while the parts run, their gradients accumulated unsharded (:func:`.compat.gather_fsdp1`:
    FSDP1's internals). Then, strategies and sync back, one empty forward and backward on
    every rank reduce-scatters the accumulated gradients and reshards (without ``train``:
    every handle reshards)."""
    from treepack.adapters.fsdp import compat  # FSDP1's internals, imported when used

    states, strategies = compat.gather_fsdp1(_fsdp1_root(model))
    try:
        yield
    finally:
        compat.release_fsdp1(states, strategies, reshard=not train)
        if train:
            _sync_step(empty_step)


def average_gradients(model, group=None, *, zeros_for_missing: bool = False,
                      bucket_bytes: int = 25 * 2**20) -> None:
    """Every gradient of ``model`` averaged over ``group``, in place, in flat buckets of about
    ``bucket_bytes`` (DDP's default size: a few collectives, not one per parameter), as DDP's
    reducer does once per step.

    Args:
        model: the module whose parameters' ``.grad`` to average.
        group: the process group (None: every rank).
        zeros_for_missing: a parameter that requires a gradient and has none on this rank
            gets zeros first, so that ranks with different parameter sets (a step in parts)
            line up; without it, such a parameter is left alone and every rank must have
            gradients for the same parameters (a sequence-parallel backward gives every rank
            the same).
        bucket_bytes: the size of a bucket.
    """
    world = dist.get_world_size(group)
    grads = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None and zeros_for_missing:
            p.grad = torch.zeros_like(p)
        if p.grad is not None:
            grads.append(p.grad)
    buckets: list[list[Tensor]] = []
    size = 0
    for g in grads:  # consecutive runs of one dtype and device, up to the size
        fits = buckets and buckets[-1][0].dtype == g.dtype and buckets[-1][0].device == g.device
        if not fits or size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= world
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))
