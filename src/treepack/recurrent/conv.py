"""Depthwise causal convolution along each row's path in the tree."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["ancestors", "ancestor_table", "tree_conv1d", "path_conv1d"]


@derived_from_pack
def ancestors(pack: TreePack, taps: int) -> Tensor:
    """``[taps, T']``: row ``j``'s ancestor ``m`` steps up its path at ``[m, j]`` (``m = 0`` is
    the row itself), or ``T'`` (one past the last row) where the path is shorter.

    Args:
        pack: the pack.
        taps: how many steps, the kernel size of the convolution.

    Returns:
        An int64 tensor on the pack's device (cached per pack and ``taps``).
    """
    return torch.from_numpy(ancestor_table(pack.host.parent_row, taps)).to(pack.device)


def ancestor_table(parent: np.ndarray, taps: int) -> np.ndarray:
    """:func:`ancestors` on the host from a parent array: ``[taps, n]``, ``n`` past a root.

    Args:
        parent: ``[n]`` each row's parent row, -1 at roots.
        taps: how many steps.

    Returns:
        An int64 array.
    """
    rows = parent.shape[0]
    out = np.empty((taps, rows), dtype=np.int64)
    out[0] = np.arange(rows)
    up = np.append(np.where(parent >= 0, parent, rows), rows)  # rows -> rows (a sink)
    for m in range(1, taps):  # one vectorised step per tap (K is 2 to 4)
        out[m] = up[out[m - 1]]
    return out


def tree_conv1d(pack: TreePack, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y[j] = bias + sum_m weight[:, K - 1 - m] * x[ancestor_m(j)]``: what a causal depthwise
    ``conv1d`` (left padding K - 1) computes on each sequence alone, for every packed row.

    Args:
        pack: the pack ``x`` belongs to.
        x: [T', C] per-row inputs.
        weight: [C, K] the depthwise kernel (``conv1d.weight.squeeze(1)``).
        bias: [C] or None.

    Returns:
        [T', C] in the dtype of ``x`` and ``weight`` promoted, summed in float32 at least and
        rounded once (autograd flows to all three).

    Raises:
        ValueError: ``x`` that is not one row per row of the pack, or a kernel that does not
            fit its channels.
    """
    if x.dim() != 2 or x.shape[0] != pack.num_rows:
        raise ValueError(f"x must be [T'={pack.num_rows}, C], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [C={x.shape[1]}, K], got {tuple(weight.shape)}")
    return path_conv1d(x, ancestors(pack, weight.shape[1]), weight, bias)


def path_conv1d(x: Tensor, index: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y[j] = bias + sum_m weight[:, K - 1 - m] * x[index[m, j]]``, ``x[n]`` reading zeros:
    :func:`tree_conv1d` over any rows given their paths (one part of a tree reads the inputs
    of ancestors another part computed).

    Args:
        x: [n, C] inputs.
        index: [K, J] the row of ``x`` ``m`` steps up each output's path, ``n`` past its
            start (:func:`ancestors`).
        weight: [C, K] the depthwise kernel.
        bias: [C] or None.

    Returns:
        [J, C], as :func:`tree_conv1d`.
    """
    taps = weight.shape[1]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    work = torch.promote_types(dtype, torch.float32)  # one rounding, as conv1d's accumulator
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])]).to(work)  # row n: zeros before a path
    w = weight.to(work)
    out = padded.index_select(0, index[0]) * w[:, taps - 1]  # backward: index_add, not
    # indexing's accumulating index_put (11x slower on a CPU)
    for m in range(1, taps):
        out = out + padded.index_select(0, index[m]) * w[:, taps - 1 - m]
    if bias is not None:
        out = out + bias.to(work)
    return out.to(dtype)
