"""The counts a step's loss is normalised by, over every pack and every rank (core).

A step spread over several packs (gradient accumulation) and data-parallel ranks must divide
by the whole step's counts, not each pack's: :func:`global_denominators` counts once per
step, all-reducing over ``torch.distributed`` when it is initialised. ``treepack.losses``
and ``treepack.collate`` use these; both re-export them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Denominators", "global_denominators", "check_layout"]


class Denominators(NamedTuple):
    """The counts a step's loss is normalised by."""

    tokens: float  # masked tokens of the whole step (every pack, every rank)
    sequences: float  # sequences with at least one masked token, likewise
    world_size: int = 1  # ranks whose gradients DDP / FSDP average (the loss is scaled back up)

    @classmethod
    def of(cls, mask: Tensor) -> Denominators:
        """This mask's own counts (one pack, one process)."""
        check_layout(mask, mask, "mask")
        return cls(tokens=float(mask.sum()), sequences=float(mask.any(-1).sum()))


def check_layout(values: Tensor, mask: Tensor, name: str = "values") -> Tensor:
    """Raise unless ``values`` and the bool ``mask`` are one [N, L] layout; return the mask."""
    if mask.dim() != 2:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)}: losses take the [N, L] layout of a dense "
            "pack (a flat pack's [total] outputs: view them per sequence with pack.offsets, "
            "or build the pack with layout='dense')"
        )
    if values.shape != mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but mask has {tuple(mask.shape)}; both "
            "must be the [N, L] layout of pack.token_logprobs"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    return mask


def global_denominators(masks: Iterable[Tensor], *, group=None) -> Denominators:
    """The counts of a whole step: every pack and, with torch.distributed, every rank.

    Call it once per step, before the forwards, on every rank.

    Args:
        masks: this rank's packs' masks ([N, L] bool each).
        group: the process group to all-reduce over (default: the world).

    Returns:
        :class:`Denominators`: masked tokens, sequences with a masked token, and
        ``world_size`` (the losses scale back up by it, undoing DDP / FSDP averaging).

    Raises:
        ValueError / TypeError: no masks, or a mask that is not [N, L] bool.
    """
    masks = list(masks)
    if not masks:
        raise ValueError("global_denominators needs the masks of this rank's packs (got none)")
    device = masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for m in masks:
        check_layout(m, m, "mask")
        counts += torch.stack((m.sum(), m.any(-1).sum())).to(device, torch.float64)
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, group=group)
        world = torch.distributed.get_world_size(group)
    tokens, sequences = counts.tolist()
    return Denominators(tokens=tokens, sequences=sequences, world_size=world)
