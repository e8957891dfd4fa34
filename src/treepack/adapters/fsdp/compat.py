"""Every access treepack makes to FSDP (and DDP) beyond their documented API, in one place.

Written against torch 2.13 (the CPU build the suite pins) and run on 2.11 (the GPU image);
:func:`check` runs before FSDP1's internals are first used and names any of these that moved.

FSDP1 (``FullyShardedDataParallel``, verl's ``strategy=fsdp``), gathered once for a step in
parts (:func:`gather_fsdp1`, :func:`release_fsdp1`):

- ``torch.distributed.fsdp._runtime_utils._lazy_init(state, root)``, ``._unshard(state,
  handle, unshard_stream, pre_unshard_stream)``, ``._reshard(state, handle, free)``;
- ``torch.distributed.fsdp._traversal_utils._get_fsdp_states(root)``;
- each state's ``_handle``, ``_sync_gradients`` (the flag ``no_sync`` sets),
  ``_unshard_stream`` and ``_pre_unshard_stream``;
- each handle's ``_sharding_strategy`` (set to
  ``torch.distributed.fsdp._flat_param.HandleShardingStrategy.SHARD_GRAD_OP`` while the parts
  run) and ``uses_sharded_strategy``.

FSDP2 (``fully_shard``): ``FSDPModule``'s public ``set_requires_gradient_sync``,
``set_reshard_after_forward``, ``set_reshard_after_backward``, ``unshard`` and ``reshard``.
DDP: ``module`` and ``process_group``.

Read elsewhere, by duck typing (no import): FSDP1's ``compute_device`` and FSDP2's DTensor
``device_mesh`` (:func:`treepack.hf.compute_device`), a flat parameter's ``_is_flat_param``
(:mod:`treepack.core.agreement`).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import _runtime_utils, _traversal_utils
from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy

from treepack.core.compat import require

__all__ = ["WRITTEN_AGAINST", "check", "gather_fsdp1", "release_fsdp1"]

WRITTEN_AGAINST = "2.13"

SYMBOLS = (
    ("torch.distributed.fsdp._runtime_utils._lazy_init", _runtime_utils, "_lazy_init"),
    ("torch.distributed.fsdp._runtime_utils._unshard", _runtime_utils, "_unshard"),
    ("torch.distributed.fsdp._runtime_utils._reshard", _runtime_utils, "_reshard"),
    ("torch.distributed.fsdp._traversal_utils._get_fsdp_states", _traversal_utils,
     "_get_fsdp_states"),
    ("HandleShardingStrategy.SHARD_GRAD_OP", HandleShardingStrategy, "SHARD_GRAD_OP"),
    ("FlatParamHandle.uses_sharded_strategy", FlatParamHandle, "uses_sharded_strategy"),
)


def check() -> None:
    """Raise ``ImportError`` naming the FSDP internals treepack uses that moved."""
    require("torch", torch.__version__, WRITTEN_AGAINST, SYMBOLS)


def gather_fsdp1(root) -> tuple[list, list]:
    """Every handle of the FSDP1 module ``root`` unsharded, in handle order, and kept so while
    gradients accumulate unsharded: gradient sync off (``no_sync``'s flag) and each sharded
    handle run as ``SHARD_GRAD_OP`` (FSDP1 skips its all-gather while the unsharded parameter
    is allocated, and frees it only for the reshard-after-forward strategies or when syncing).
    Returns the states and each handle's strategy, for :func:`release_fsdp1`."""
    check()
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
    return states, strategies


def release_fsdp1(states: list, strategies: list, reshard: bool) -> None:
    """The strategies and gradient sync of :func:`gather_fsdp1` back; with ``reshard``, every
    handle resharded now (else the next synced backward reduce-scatters and reshards)."""
    for handle, strategy in strategies:
        handle._sharding_strategy = strategy
    for state in states:
        state._sync_gradients = True
    if reshard:
        for state in states:
            if state._handle is not None:
                _runtime_utils._reshard(state, state._handle, True)
