"""Data parallelism around a step in parts: every rank runs its own sequence of parts, and the
collectives line up anyway.

- DDP: the parts run on the module inside the wrapper (whose per-backward reduction and
  per-forward buffer broadcast would need every rank to run as many parts); the gradients are
  averaged once at the end (:func:`average_gradients`), as DDP's reducer would.
- FSDP2 and FSDP1: every parameter is gathered once, up front, and kept while the parts run,
  their gradients accumulated unsharded; one empty forward and backward, the same on every
  rank, then reduce-scatters them and reshards (:func:`unsharded`).

A rank without trees (an empty pack) runs no part and still takes part in each collective.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from treepack.adapters.hf.forwarding import forward
from treepack.adapters.hf.prepare import compute_device
from treepack.core.tree import TreePack

__all__ = ["local", "unsharded", "average_gradients", "finish"]


def local(model):
    """The module a rank runs its parts on: the one inside DDP, else ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def finish(model) -> None:
    """After a training step's parts: DDP's gradient average (FSDP's ran in
    :func:`unsharded`)."""
    if local(model) is not model:
        average_gradients(model)


@contextlib.contextmanager
def unsharded(model, train: bool = True):
    """FSDP2: every module's parameters gathered once, up front, and kept while the parts
    run, their gradients accumulated unsharded without reduction; then one empty forward
    and backward on every rank reduce-scatters them and reshards (without ``train``: the
    parameters are resharded). So each rank runs its own sequence of parts, while the
    collectives (one all-gather per module, one reduce-scatter per module) line up across
    ranks. FSDP1: :func:`_fsdp1_unsharded`. Anything else: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    if _fsdp1_root(model) is not None:
        with _fsdp1_unsharded(model, train):
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
            _sync_step(model)
        else:
            for m in sharded:
                m.reshard()


def _sync_step(model) -> None:
    """One empty forward and backward, the same on every rank: with FSDP's gradient sync
    back on, it reduce-scatters what the parts accumulated unsharded, and reshards."""
    empty = TreePack.empty(1, device=compute_device(model))
    with torch.enable_grad():
        (forward(model, empty).logits.sum() * 0.0).backward()


def _fsdp1_root(model):
    """The outermost FSDP1 (``FullyShardedDataParallel``) module in ``model``, or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


@contextlib.contextmanager
def _fsdp1_unsharded(model, train: bool):
    """FSDP1, as FSDP2 above: every handle's flat parameter gathered once, up front (in
    handle order on every rank), then kept while the parts run: FSDP1 skips its all-gather
    when the unsharded parameter is still allocated, and it frees it only for the
    reshard-after-forward strategies or when syncing gradients, so the handles run as
    ``SHARD_GRAD_OP`` with gradient sync off (``no_sync``'s flag; gradients accumulate
    unsharded). Then, strategies and sync back, one empty forward and backward on every rank
    reduce-scatters the accumulated gradients and reshards (without ``train``: every handle
    reshards). These are FSDP1's internals (torch.distributed.fsdp._runtime_utils,
    _traversal_utils), as of torch 2.11-2.13."""
    from torch.distributed.fsdp import _runtime_utils, _traversal_utils
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    root = _fsdp1_root(model)
    _runtime_utils._lazy_init(root, root)
    states = _traversal_utils._get_fsdp_states(root)
    strategies = []
    for state in states:
        handle = state._handle
        state._sync_gradients = False
        if handle is None:
            continue
        _runtime_utils._unshard(state, handle, state._unshard_stream,
                                state._pre_unshard_stream)
        strategies.append((handle, handle._sharding_strategy))
        if handle.uses_sharded_strategy:
            handle._sharding_strategy = HandleShardingStrategy.SHARD_GRAD_OP
    try:
        yield
    finally:
        for handle, strategy in strategies:
            handle._sharding_strategy = strategy
        for state in states:
            state._sync_gradients = True
        if train:
            _sync_step(model)
        else:
            for state in states:
                if state._handle is not None:
                    _runtime_utils._reshard(state, state._handle, True)


def average_gradients(model, bucket_bytes: int = 25 * 2**20) -> None:
    """What DDP's reducer does once per step: every gradient averaged over its process
    group, in flat buckets of about ``bucket_bytes`` (DDP's default size: a few collectives,
    not one per parameter). A parameter without a gradient on this rank adds zeros (the
    ranks' parameter lists must line up)."""
    import torch.distributed as dist

    group = model.process_group
    world = dist.get_world_size(group)
    grads = []
    for p in model.module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
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
