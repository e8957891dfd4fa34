"""Recurrent token mixers on a tree: short causal convolutions and state scans, exact at every
branch point (torch and numpy only; imports the core alone).

A short causal convolution of kernel K reads a row's own path at depths d - K + 1 .. d:
:func:`tree_conv1d` gathers those ancestors (:func:`ancestors`) and sums, one gather per tap.
A recurrent scan (gated delta rule, Mamba2's SSD, ...) runs over the pack's segments level by
level in fork depth (:func:`level_scan`): a segment starts from the final state of its parent
segment, every segment of a level goes through one batched call of the family's own kernel,
and gradients flow into each parent's final state once per child. A GRPO tree is two levels;
an agent trajectory without forks one per step it extends.
"""

from treepack.recurrent.conv import ancestor_table, ancestors, path_conv1d, tree_conv1d
from treepack.recurrent.linear import decayed_linear_attention, ssd_scan
from treepack.recurrent.scan import (Levels, level_chunk, level_scan, levels, row_levels,
                                     scan_levels)

__all__ = ["ancestors", "ancestor_table", "tree_conv1d", "path_conv1d", "Levels", "levels",
           "row_levels", "level_scan", "scan_levels", "level_chunk", "decayed_linear_attention",
           "ssd_scan"]
