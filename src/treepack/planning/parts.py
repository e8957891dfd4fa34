"""A tree too large for one forward, cut into parts that each compute their rows once.

:func:`treepack.plan` splits a tree that does not fit ``max_tokens`` into packs that each
repeat the prefix above their cut. Here every row of the tree is computed by exactly one
*part* of at most ``max_rows`` rows; a part's rows read their ancestors' keys and values
from the parts that computed them (its *context*), so nothing is recomputed.

The parts form a tree. :func:`split` takes, under each root it is given,

- a subtree that fits whole: bin-packed with the subtrees beside it, in pre-order, into parts
  of at most ``max_rows`` rows (siblings of one fork share their context);
- a subtree that does not: its *trunk*, the rows whose own subtree does not fit (every
  ancestor of such a row is one too), becomes one part, its first ``max_rows`` rows in
  pre-order if there are more; the subtrees hanging below it are split the same way, as
  that part's children.

A GRPO group whose prompt fits but whose responses do not is a trunk (the prompt) and
branches (the responses, a few per part); a long agent trajectory is a chain of trunk parts,
each with its side branches. Execution (:func:`treepack.hf.backward_in_parts`) runs a part,
then its children depth-first, then the part's backward once: every part's forward and
backward run once per step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from treepack.core.checks import positive_int
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["Part", "Parts", "split"]


class Part(NamedTuple):
    """One forward's rows of the tree."""

    rows: np.ndarray  # [n] rows of the pack, ascending (pre-order)
    parent: int  # the part holding the parents of this part's top rows; -1 at a tree root


class Parts(NamedTuple):
    """A tree cut into parts, in execution order: a part comes after its parent part."""

    pack: TreePack  # the whole tree (dense or flat, no padding rows unless it is empty)
    parts: list[Part]  # none for a pack without sequences
    part_of: np.ndarray  # [T'] the part computing each row
    local: np.ndarray  # [T'] the row's index among its part's rows
    max_rows: int  # the budget the parts were cut at

    @property
    def rows_computed(self) -> int:
        """Rows all parts compute together: the tree's rows, each once."""
        return sum(p.rows.shape[0] for p in self.parts)


def split(pack: TreePack, max_rows: int) -> Parts:
    """Cut ``pack``'s forest into parts of at most ``max_rows`` rows (module doc).

    Built once per pack, device and budget: a second call returns the same object.

    Args:
        pack: the whole forest, without padding rows (a pack without sequences, as
            ``TreePack.empty``, has no parts).
        max_rows: the most rows one forward may compute.

    Returns:
        :class:`Parts`: one part when the forest fits.

    Raises:
        ValueError: a padded pack, or a bad ``max_rows``.
    """
    max_rows = positive_int(max_rows, "max_rows", hint=" (rows one forward may compute)")
    if pack.num_sequences and pack.num_rows != pack.num_packed_rows:
        raise ValueError(f"the pack has {pack.num_rows - pack.num_packed_rows} padding rows: "
                         "build the whole tree without pad_to_multiple_of to split it")
    return _split(pack, max_rows)


@derived_from_pack
def _split(pack: TreePack, max_rows: int) -> Parts:
    if not pack.num_sequences:
        nowhere = np.full(pack.num_rows, -1, dtype=np.int64)
        return Parts(pack, [], nowhere, nowhere, max_rows)
    h = pack.host
    n = pack.num_rows
    size = h.subtree_end[:n] - np.arange(n)
    parts: list[Part] = []
    # (roots hanging off one part, that part): the roots are whole subtrees still to cover
    todo = [(np.flatnonzero(h.parent_row[:n] < 0), -1)]
    while todo:
        roots, parent = todo.pop(0)
        light = roots[size[roots] <= max_rows]
        for group in _bins(light, size[light], max_rows):
            rows = np.concatenate([np.arange(r, r + size[r]) for r in group])
            parts.append(Part(rows, parent))
        for root in roots[size[roots] > max_rows]:
            rows = np.arange(root, root + size[root])
            trunk = rows[size[rows] > max_rows][:max_rows]  # upward closed, pre-order prefix
            parts.append(Part(trunk, parent))
            inside = np.zeros(n, dtype=bool)
            inside[trunk] = True
            below = rows[~inside[rows] & inside[np.maximum(h.parent_row[rows], 0)]
                         & (h.parent_row[rows] >= 0)]
            todo.append((below, len(parts) - 1))
    part_of = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    for i, part in enumerate(parts):
        part_of[part.rows] = i
        local[part.rows] = np.arange(part.rows.shape[0])
    return Parts(pack, parts, part_of, local, max_rows)


def _bins(roots: np.ndarray, sizes: np.ndarray, max_rows: int) -> list[np.ndarray]:
    """Consecutive runs of ``roots`` (pre-order) of at most ``max_rows`` rows each."""
    bins, start, total = [], 0, 0
    for i, s in enumerate(sizes.tolist()):
        if total + s > max_rows and i > start:
            bins.append(roots[start:i])
            start, total = i, 0
        total += s
    if start < roots.shape[0]:
        bins.append(roots[start:])
    return bins
