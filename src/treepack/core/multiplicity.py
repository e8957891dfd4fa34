"""How many original tokens each packed row stands for: the weight a row gets wherever an
unpacked batch averages over its tokens (an MoE router's load-balancing and z-losses)."""

from __future__ import annotations

import torch
from torch import Tensor

from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["row_multiplicity"]


@derived_from_pack
def row_multiplicity(pack: TreePack) -> Tensor:
    """How many original tokens each packed row stands for (computed once per pack).

    Args:
        pack: a :class:`~treepack.TreePack`.

    Returns:
        [T'] float on the pack's device: the occurrences of each row among the pack's
        sequences (0 for padding).

    Example:
        >>> from treepack import TreePack
        >>> row_multiplicity(TreePack.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5]])).tolist()
        [3.0, 2.0, 1.0, 1.0, 1.0]
    """
    rows = pack.rows[pack.rows >= 0]
    return torch.bincount(rows, minlength=pack.num_rows).float()
