"""Building the prefix forest: sort, adjacent LCPs, nearest-smaller queries. Numpy only.

Sort the N sequences lexicographically (a prefix before its extensions) and let ``lcp[k]``
be the longest common prefix of sorted sequences k-1 and k (``lcp[0] = 0``). Then DFS
pre-order of the prefix forest is: sequence 0 whole, then each next sequence's suffix after
its LCP. Sorted sequence k *owns* the new rows ``base[k] .. base[k+1]-1`` at depths
``lcp[k] .. len[k]-1``. Everything else follows from two facts:

- Sequence k forks off the rows of ``pse[k] = max{j < k : lcp[j] < lcp[k]}`` (the previous
  strictly smaller LCP) at depth ``lcp[k]``: its shallower rows are owned by ``pse[k]``,
  ``pse[pse[k]]``, ... and the row of ``pse[k]`` at depth ``lcp[k]`` starts a new segment.
- In DFS pre-order of segments with start depths ``d``, the parent of segment i is the
  previous segment with ``d < d[i]`` and its subtree ends where the next segment with
  ``d <= d[i]`` begins.

So the work is O(total tokens) of vectorised numpy plus O((N + S) log(N + S)) for the
nearest-smaller queries; no [N, L]-wide pass except writing the ``rows`` output itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["sort_and_lcp", "previous_smaller", "ragged_arange", "build_layout", "Layout",
           "forest_stats", "ForestStats"]


def sort_and_lcp(ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic order of the sequences and the LCP of each with its predecessor.

    Returns ``order`` [N] (a prefix sorts before its extensions) and ``lcp`` [N] with
    ``lcp[k]`` the longest common prefix of sequences ``order[k-1]`` and ``order[k]``
    (``lcp[0] = 0``). O(total tokens) numpy work plus O(N) Python; never pads to [N, L].
    """
    n = len(ids)
    # Big-endian bytes compare like the id sequences (a prefix sorts first), so Python's
    # C-level sort on bytes keys orders the sequences lexicographically. One conversion for
    # the whole batch, then one bytes slice per sequence.
    flat = np.concatenate(ids)
    width = 8 if flat.max() >= 2**32 else 4
    raw = flat.astype(f">u{width}").tobytes()
    ends = np.cumsum(np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=n)) * width
    bounds = zip([0, *ends[:-1].tolist()], ends.tolist())
    keys = [raw[a:b] for a, b in bounds]
    order = np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    if n == 1:
        return order, lcp
    s_ids = [ids[i] for i in order]
    m = np.array([min(len(a), len(b)) for a, b in zip(s_ids, s_ids[1:])], dtype=np.int64)
    # Each sorted pair laid side by side over its common length; the first mismatch of
    # pair k at or after its offset is its LCP (or m[k] if none falls inside the pair).
    left = np.concatenate([a[:w] for a, w in zip(s_ids, m)])
    right = np.concatenate([b[:w] for b, w in zip(s_ids[1:], m)])
    mismatch = np.flatnonzero(left != right)
    lo = np.cumsum(m) - m
    first = np.searchsorted(mismatch, lo)
    at = np.append(mismatch, np.iinfo(np.int64).max)[first]
    lcp[1:] = np.where(at < lo + m, at - lo, m)
    return order, lcp


def previous_smaller(a: np.ndarray, *, strict: bool = True) -> np.ndarray:
    """``out[k] = max{j < k : a[j] < a[k]}`` (``<=`` when not strict), -1 if none.

    Vectorised binary lifting over a sparse table of prefix-clipped window minima:
    O(N log N) numpy work, no Python loop over elements.
    """
    n = a.shape[0]
    # mins[l][i] = min(a[max(0, i - 2**l + 1) .. i])
    mins = [a]
    while (1 << len(mins)) <= n:
        prev, h = mins[-1], 1 << (len(mins) - 1)
        mins.append(np.concatenate((prev[:h], np.minimum(prev[h:], prev[:-h]))))
    pos = np.arange(n) - 1  # the window ending at pos is the next one to try to skip
    for lvl in range(len(mins) - 1, -1, -1):
        live = pos >= 0
        w = mins[lvl][np.maximum(pos, 0)]
        skip = live & ((w >= a) if strict else (w > a))
        pos = np.where(skip, pos - (1 << lvl), pos)
    return np.maximum(pos, -1)


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, a + n) for a, n in zip(starts, counts)])``, vectorised."""
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts  # where each run starts in the output
    return np.arange(int(counts.sum())) + np.repeat(np.asarray(starts) - before, counts)


class Layout(NamedTuple):
    """Host-side layout of a TreePack (see ``treepack.tree`` for the shape legend)."""

    input_ids: np.ndarray  # [T']
    position_ids: np.ndarray  # [T']
    subtree_end: np.ndarray  # [T']
    parent_row: np.ndarray  # [T'] the row of the previous token on the path, -1 at a root
    rows: np.ndarray  # [N, L], or [total] when flat
    lengths: np.ndarray  # [N]
    offsets: np.ndarray  # [N + 1] where each sequence starts in the flat layout
    prediction_mask: np.ndarray  # [N, L], or [total] when flat
    seg_start: np.ndarray  # [S]
    seg_end: np.ndarray  # [S]
    seg_parent: np.ndarray  # [S]
    seg_sequence: np.ndarray  # [S] an input sequence whose path passes through the segment
    pred_source: np.ndarray  # [M]
    pred_target: np.ndarray  # [M]
    pred_index: np.ndarray  # [M] s * L + p, or offsets[s] + p when flat
    num_tokens: int  # T
    num_prediction_rows: int


def build_layout(ids: list[np.ndarray], multiple: int = 1, *, share: bool = True,
                 flat: bool = False) -> Layout:
    """The whole layout from validated 1-D int64 id arrays (see the module doc).

    With ``share=False`` nothing is merged: the sequences are laid out back to back in input
    order, each its own tree (padding-free packing), as if no two shared a prefix. With
    ``flat`` the per-token tables (``rows``, ``prediction_mask`` and the prediction indices)
    are [total tokens], sequence after sequence (``offsets``), instead of [N, L]: nothing
    costs N x the longest length.
    """
    n = len(ids)
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=n)
    if share:
        order, lcp = sort_and_lcp(ids)
    else:
        order, lcp = np.arange(n), np.zeros(n, dtype=np.int64)
    s_len = lengths[order]  # sorted order from here on
    new = s_len - lcp  # rows each sequence adds; 0 only for an exact duplicate
    base = np.concatenate(([0], np.cumsum(new)))  # [N + 1]
    T = int(base[-1])
    pse = previous_smaller(lcp)  # the sequence each one forks from (-1: a new tree)

    # Per-row fields: each sequence's suffix after its LCP, back to back.
    input_ids = np.concatenate([ids[i][c:] for i, c in zip(order, lcp)])  # [T]
    position_ids = np.arange(T) - np.repeat(base[:-1] - lcp, new)  # [T] depth

    # Segments start where a sequence's new rows start and where a later one forks off.
    cut = np.zeros(T + 1, dtype=bool)
    cut[base[:-1][new > 0]] = True
    forks = np.flatnonzero(lcp > 0)
    owner = pse[forks]
    cut[base[owner] + lcp[forks] - lcp[owner]] = True
    seg_start = np.flatnonzero(cut[:T])
    seg_end = np.append(seg_start[1:], T)
    depth = position_ids[seg_start]  # [S]
    seg_parent = previous_smaller(depth)
    # The subtree of segment i ends where the next segment with depth <= depth[i] starts.
    after = depth.shape[0] - 1 - previous_smaller(depth[::-1], strict=False)[::-1]
    seg_subtree_end = np.append(seg_start, T)[after]
    subtree_end = np.repeat(seg_subtree_end, seg_end - seg_start)  # [T]
    # the sequence that owns a segment's rows passes through it (and through its ancestors)
    seg_sequence = order[np.searchsorted(base, seg_start, side="right") - 1]
    parent_row = np.arange(T) - 1  # inside a segment the parent is the row before
    parent_row[seg_start] = np.where(seg_parent >= 0, seg_end[seg_parent] - 1, -1)

    values = _rows(order, lcp, s_len, base, pse)  # [total]: each sequence's rows in order
    # Predictions: every token but each sequence's first, from the row before it.
    total = values.shape[0]
    offsets = np.concatenate(([0], np.cumsum(lengths)))  # [N + 1]
    later = np.ones(total, dtype=bool)
    later[offsets[:-1]] = False
    if flat:
        rows, prediction_mask, position = values, later, np.arange(total)
    else:
        L = int(lengths.max())
        position = np.arange(total) + np.repeat(np.arange(n) * L - offsets[:-1], lengths)
        rows = np.full(n * L, -1, dtype=np.int64)  # s * L + p, no [N, L] temporaries
        rows[position] = values
        rows = rows.reshape(n, L)
        prediction_mask = np.zeros(n * L, dtype=bool)
        prediction_mask[position[later]] = True
        prediction_mask = prediction_mask.reshape(n, L)
    pred_index = position[later]
    pred_source = values[:-1][later[1:]]
    pred_target = np.concatenate(ids)[later]
    # A row predicts something iff it has a child: all rows but the last of a leaf segment.
    has_child = np.zeros(seg_start.shape[0], dtype=bool)
    has_child[seg_parent[seg_parent >= 0]] = True

    padded = -(-T // multiple) * multiple
    pad = np.arange(T, padded)
    return Layout(
        input_ids=np.concatenate((input_ids, np.zeros_like(pad))),
        position_ids=np.concatenate((position_ids, np.zeros_like(pad))),
        subtree_end=np.concatenate((subtree_end, pad + 1)),
        parent_row=np.concatenate((parent_row, np.full_like(pad, -1))),
        rows=rows,
        lengths=lengths,
        offsets=offsets,
        prediction_mask=prediction_mask,
        seg_start=seg_start,
        seg_end=seg_end,
        seg_parent=seg_parent,
        seg_sequence=seg_sequence,
        pred_source=pred_source,
        pred_target=pred_target,
        pred_index=pred_index,
        num_tokens=T,
        num_prediction_rows=T - int((~has_child).sum()),
    )


def _rows(order, lcp, s_len, base, pse) -> np.ndarray:
    """The packed row of every token of every sequence, sequences in the original order.

    Sorted sequence k's path is a chain of pieces: its own new rows (depths lcp[k] ..
    len[k]-1), then depths lcp[j] .. lcp[k]-1 owned by j = pse[k], and so on up to a root.
    The loop runs once per level of that chain, vectorised over the sequences.
    """
    n = order.shape[0]
    seq, own, lo, hi = [], [], [], []
    cur, top = np.arange(n), s_len
    k = cur
    while k.size:
        bottom = lcp[cur]
        seq.append(k), own.append(cur), lo.append(bottom), hi.append(top)
        keep = bottom > 0
        k, cur, top = k[keep], pse[cur[keep]], bottom[keep]
    seq, own, lo, hi = map(np.concatenate, (seq, own, lo, hi))
    # Pieces in (original sequence, depth) order are the row-major order of valid entries.
    pick = np.lexsort((lo, order[seq]))
    own, lo, hi = own[pick], lo[pick], hi[pick]
    return ragged_arange(base[own] - lcp[own] + lo, hi - lo)


class ForestStats(NamedTuple):
    """What packing a batch into one forest would save (no layout is built)."""

    num_sequences: int
    original_tokens: int
    packed_tokens: int  # distinct rows: one per distinct prefix
    trees: int  # sequences with distinct first tokens
    packed_attention_pairs: int  # visible (query, key) pairs: sum of depth + 1 over rows
    unpacked_attention_pairs: int  # causal pairs of every sequence alone

    @property
    def token_ratio(self) -> float:
        return self.packed_tokens / self.original_tokens

    @property
    def attention_ratio(self) -> float:
        return self.packed_attention_pairs / self.unpacked_attention_pairs


def forest_stats(ids: list[np.ndarray]) -> ForestStats:
    """Sizes of the forest of validated id arrays from the sort and LCPs alone: O(total)."""
    order, lcp = sort_and_lcp(ids)
    s_len = np.fromiter((ids[i].shape[0] for i in order), dtype=np.int64, count=len(ids))
    # rows of sequence k have depths lcp[k] .. len[k]-1; each sees depth + 1 keys
    packed_pairs = (s_len * (s_len + 1) - lcp * (lcp + 1)) // 2
    return ForestStats(
        num_sequences=len(ids),
        original_tokens=int(s_len.sum()),
        packed_tokens=int((s_len - lcp).sum()),
        trees=int((lcp == 0).sum()),
        packed_attention_pairs=int(packed_pairs.sum()),
        unpacked_attention_pairs=int((s_len * (s_len + 1) // 2).sum()),
    )
