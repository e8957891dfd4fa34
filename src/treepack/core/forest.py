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

from treepack.core import deprecation

__all__ = ["sort_and_lcp", "previous_smaller", "causal_pairs", "ragged_arange", "build_layout",
           "route_keys", "HostLayout",
           "stats_of_arrays", "ForestStats"]


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


def causal_pairs(length):
    """Visible (query, key) pairs of causal attention over ``length`` tokens: n (n + 1) / 2.
    A sequence sharing its first ``k`` tokens adds ``causal_pairs(n) - causal_pairs(k)``."""
    return length * (length + 1) // 2


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, a + n) for a, n in zip(starts, counts)])``, vectorised."""
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts  # where each run starts in the output
    return np.arange(int(counts.sum())) + np.repeat(np.asarray(starts) - before, counts)


class HostLayout(NamedTuple):
    """Every table of a pack, on the host (numpy), under :class:`~treepack.TreePack`'s names.

    The build produces it; a TreePack holds it as ``pack.host`` beside its device tensors, so
    shape-dependent code reads sizes here instead of calling ``.tolist()`` / ``.item()`` on
    device tensors inside a forward. Shapes: T' rows (padding included), N sequences, L the
    longest, S segments, M predictions.
    """

    input_ids: np.ndarray  # [T']
    position_ids: np.ndarray  # [T'] depth
    subtree_end: np.ndarray  # [T']
    parent_row: np.ndarray  # [T'] the row of the previous token on the path, -1 at a root
    rows: np.ndarray  # [N, L], or [total] in the flat layout
    lengths: np.ndarray  # [N]
    offsets: np.ndarray  # [N + 1] where each sequence starts in the flat layout
    prediction_mask: np.ndarray  # [N, L], or [total] in the flat layout
    segment_start: np.ndarray  # [S]
    segment_end: np.ndarray  # [S]
    segment_parent: np.ndarray  # [S]
    segment_sequence: np.ndarray  # [S] an input sequence whose path passes through it
    prediction_source: np.ndarray  # [M]
    prediction_target: np.ndarray  # [M]
    prediction_index: np.ndarray  # [M] s * L + p, or offsets[s] + p in the flat layout
    num_packed_rows: int  # T: distinct rows, padding excluded
    num_prediction_rows: int  # packed rows with at least one child
    row_keys: np.ndarray | None = None  # [T'] each row's content key (0: none), or None
    row_routes: np.ndarray | None = None  # [T', layers, topk] each row's routed experts

    @classmethod
    def empty(cls, num_rows: int) -> HostLayout:
        """The host layout of no sequences.

        Args:
            num_rows: padding rows, each seeing only itself.

        Returns:
            A :class:`HostLayout` with no sequences, segments or predictions.
        """
        none = np.zeros(0, dtype=np.int64)
        pad = np.arange(num_rows)
        return cls(
            input_ids=np.zeros(num_rows, dtype=np.int64), position_ids=np.zeros_like(pad),
            subtree_end=pad + 1, parent_row=np.full_like(pad, -1),
            rows=np.zeros((0, 0), dtype=np.int64), lengths=none, offsets=np.zeros(1, np.int64),
            prediction_mask=np.zeros((0, 0), dtype=bool), segment_start=none, segment_end=none,
            segment_parent=none, segment_sequence=none, prediction_source=none,
            prediction_target=none, prediction_index=none, num_packed_rows=0,
            num_prediction_rows=0,
        )


def build_layout(ids: list[np.ndarray], multiple: int = 1, *, share: bool = True,
                 flat: bool = False, keys: list[np.ndarray] | None = None,
                 routes: list[np.ndarray] | None = None,
                 match: list[np.ndarray] | None = None) -> HostLayout:
    """The whole layout from validated 1-D int64 id arrays (see the module doc).

    With ``share=False`` nothing is merged: the sequences are laid out back to back in input
    order, each its own tree (padding-free packing), as if no two shared a prefix. With
    ``flat`` the per-token tables (``rows``, ``prediction_mask`` and the prediction indices)
    are [total tokens], sequence after sequence (``offsets``), instead of [N, L]: nothing
    costs N x the longest length. Rows are padded to a multiple of ``multiple``. With
    ``keys`` (one int64 array per sequence, its tokens' content keys) two tokens are the same
    only if their ids and keys both are: the tree is built over (id, key) pairs. With
    ``routes`` (one ``[len, layers, topk]`` array per sequence, equal wherever the tree merges
    two tokens) each row keeps its tokens'. ``match`` (default: ``keys``) is what tokens are
    compared by beyond their ids, where that is more than their content keys
    (:func:`route_keys`: the keys and the routes).
    """
    match = keys if match is None else match
    n = len(ids)
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=n)
    if share:
        order, lcp = sort_and_lcp(ids if match is None else identities(ids, match))
    else:
        order, lcp = np.arange(n), np.zeros(n, dtype=np.int64)
    new = lengths[order] - lcp  # rows each sorted sequence adds; 0 only for a duplicate
    base = np.concatenate(([0], np.cumsum(new)))  # [N + 1] where they start
    pse = previous_smaller(lcp)  # the sequence each one forks from (-1: a new tree)
    # Per-row fields: each sequence's suffix after its LCP, back to back.
    input_ids = np.concatenate([ids[i][c:] for i, c in zip(order, lcp)])  # [T]
    position_ids = np.arange(base[-1]) - np.repeat(base[:-1] - lcp, new)  # [T] depth
    seg = _segments(order, lcp, new, base, pse, position_ids)
    values = _rows(order, lcp, lengths[order], base, pse)  # each sequence's rows, in order
    tables = _per_token(values, lengths, np.concatenate(ids), flat)
    T = int(base[-1])
    pad = np.arange(T, -(-T // multiple) * multiple)
    row_keys = None
    if keys is not None:
        row_keys = np.concatenate([keys[i][c:] for i, c in zip(order, lcp)]
                                  + [np.zeros_like(pad)])
    row_routes = None
    if routes is not None:
        row_routes = np.concatenate([routes[i][c:] for i, c in zip(order, lcp)]
                                    + [np.zeros((len(pad), *routes[0].shape[1:]),
                                                dtype=routes[0].dtype)])
    return HostLayout(
        input_ids=np.concatenate((input_ids, np.zeros_like(pad))),
        position_ids=np.concatenate((position_ids, np.zeros_like(pad))),
        subtree_end=np.concatenate((seg.subtree_end, pad + 1)),
        parent_row=np.concatenate((seg.parent_row, np.full_like(pad, -1))),
        lengths=lengths,
        **tables,
        segment_start=seg.start,
        segment_end=seg.end,
        segment_parent=seg.parent,
        segment_sequence=seg.sequence,
        num_packed_rows=T,
        num_prediction_rows=seg.rows_with_children,
        row_keys=row_keys,
        row_routes=row_routes,
    )


def identities(ids: list[np.ndarray], keys: list[np.ndarray]) -> list[np.ndarray]:
    """Each token as one integer standing for its (id, key) pair: equal exactly where both
    are, so the prefix tree over them merges a row only where its whole context, ids and
    keys, is the same."""
    lengths = [a.shape[0] for a in ids]
    pairs = _pair_ids(np.concatenate(ids), np.concatenate(keys))
    return np.split(pairs, np.cumsum(lengths)[:-1])


def route_keys(ids: list[np.ndarray], keys: list[np.ndarray] | None,
               routes: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Content keys that make two tokens one row only where their routes agree too, and the
    routes each row then keeps.

    A token's route (the experts each MoE layer sent it to) is part of what it computes, so
    two tokens merge only where their ids, keys and routes, and everything before them, are
    equal. The one exception is each sequence's last token: it predicts nothing of its
    sequence, and a rollout engine records no route for it (verl stores a placeholder there),
    so its route is not compared. It joins the row of a longer sequence's token with the same
    context, id and key (taking that token's route, which is what the longer sequence
    replays), or, where there is none, the row of the other last tokens ending there.

    Args:
        ids: the validated sequences.
        keys: their content keys, or None.
        routes: one ``[len, layers, topk]`` integer array per sequence.

    Returns:
        ``(match, routes)`` for :func:`build_layout`: keys combining the content keys and the
        routes, and the routes with each last token's placeholder replaced by the route of
        the row it joins.
    """
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))
    ends = np.cumsum(lengths)
    cuts, last = ends[:-1], ends - 1  # the flat order's cuts; each sequence's last token
    flat_keys = np.zeros(int(lengths.sum()), np.int64) if keys is None else np.concatenate(keys)
    flat_routes = np.concatenate(routes)  # a new array: last tokens' routes are set below
    _, route_id = np.unique(flat_routes.reshape(len(flat_routes), -1), axis=0,
                            return_inverse=True)
    route_id = route_id.reshape(-1).astype(np.int64)
    # the tree over every token but the last, where routes always count
    inner = np.flatnonzero(lengths > 1)
    split = np.split(_pair_ids(flat_keys, route_id), cuts)
    rows_of = np.full(len(ids), -1, dtype=np.int64)  # the row before each last token (-1: root)
    if inner.size:
        before = build_layout([ids[k][:-1] for k in inner], keys=[split[k][:-1] for k in inner],
                              flat=True)
        rows_of[inner] = before.rows[before.offsets[1:] - 1]
        by_row = _first_token_of_rows(inner, before, lengths)
        # a longer sequence's token whose context, id and key a last token shares: its row
        ref = np.stack((before.parent_row[:before.num_packed_rows],
                        before.input_ids[:before.num_packed_rows], flat_keys[by_row]))
        query = np.stack((rows_of, np.concatenate(ids)[last], flat_keys[last]))
        _, code = np.unique(np.concatenate((ref, query), axis=1), axis=1, return_inverse=True)
        code = code.reshape(-1)
        ref_code, query_code = code[:ref.shape[1]], code[ref.shape[1]:]
        sort = np.argsort(ref_code, kind="stable")
        at = np.minimum(np.searchsorted(ref_code[sort], query_code), len(sort) - 1)
        found = ref_code[sort][at] == query_code
        joined = sort[at][found]  # the row each matched last token joins (in ``before``)
        route_id[last[found]] = route_id[by_row[joined]]
        flat_routes[last[found]] = flat_routes[by_row[joined]]
        unmatched = last[~found]
    else:
        unmatched = last
    route_id[unmatched] = -1  # last tokens that join no longer one: compared without routes
    return np.split(_pair_ids(flat_keys, route_id), cuts), np.split(flat_routes, cuts)


def _pair_ids(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 per (a, b) pair, equal exactly where both are."""
    _, inverse = np.unique(np.stack((a, b)), axis=1, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def _first_token_of_rows(inner, before: HostLayout, lengths) -> np.ndarray:
    """For each row of ``before`` (the tree over the sequences ``inner`` without their last
    tokens), a token in the whole batch's flat order that the row stands for."""
    starts = (np.cumsum(lengths) - lengths)[inner]  # flat start of each
    # before.rows is flat over the truncated sequences: token j of truncated sequence i
    # is token j of sequence inner[i]
    trunc = lengths[inner] - 1
    flat = np.repeat(starts - np.concatenate(([0], np.cumsum(trunc)[:-1])), trunc) \
        + np.arange(int(trunc.sum()))
    out = np.zeros(before.num_packed_rows, dtype=np.int64)
    out[before.rows] = flat
    return out


class _Segments(NamedTuple):
    start: np.ndarray  # [S]
    end: np.ndarray  # [S]
    parent: np.ndarray  # [S]
    sequence: np.ndarray  # [S] the sorted sequence that owns the segment's rows
    subtree_end: np.ndarray  # [T]
    parent_row: np.ndarray  # [T]
    rows_with_children: int


def _segments(order, lcp, new, base, pse, position_ids) -> _Segments:
    """Compressed segments, and the per-row fields that follow from them (module doc)."""
    T = int(base[-1])
    # Segments start where a sequence's new rows start and where a later one forks off.
    cut = np.zeros(T + 1, dtype=bool)
    cut[base[:-1][new > 0]] = True
    forks = np.flatnonzero(lcp > 0)
    owner = pse[forks]
    cut[base[owner] + lcp[forks] - lcp[owner]] = True
    start = np.flatnonzero(cut[:T])
    end = np.append(start[1:], T)
    depth = position_ids[start]  # [S]
    parent = previous_smaller(depth)
    # The subtree of segment i ends where the next segment with depth <= depth[i] starts.
    after = depth.shape[0] - 1 - previous_smaller(depth[::-1], strict=False)[::-1]
    subtree_end = np.repeat(np.append(start, T)[after], end - start)  # [T]
    parent_row = np.arange(T) - 1  # inside a segment the parent is the row before
    parent_row[start] = np.where(parent >= 0, end[parent] - 1, -1)
    # A row predicts something iff it has a child: all rows but the last of a leaf segment.
    has_child = np.zeros(start.shape[0], dtype=bool)
    has_child[parent[parent >= 0]] = True
    # the sequence that owns a segment's rows passes through it (and through its ancestors)
    sequence = order[np.searchsorted(base, start, side="right") - 1]
    return _Segments(start, end, parent, sequence, subtree_end, parent_row,
                     T - int((~has_child).sum()))


def _per_token(values: np.ndarray, lengths: np.ndarray, targets: np.ndarray, flat: bool
               ) -> dict[str, np.ndarray]:
    """``rows``, ``offsets``, ``prediction_mask`` and the predictions, in the [N, L] layout
    (flattened index s * L + p) or the flat one (offsets[s] + p); no [N, L] temporaries."""
    n, total = lengths.shape[0], values.shape[0]
    offsets = np.concatenate(([0], np.cumsum(lengths)))  # [N + 1]
    # Predictions: every token but each sequence's first, from the row before it.
    later = np.ones(total, dtype=bool)
    later[offsets[:-1]] = False
    if flat:
        rows, prediction_mask, position = values, later, np.arange(total)
    else:
        L = int(lengths.max())
        position = np.arange(total) + np.repeat(np.arange(n) * L - offsets[:-1], lengths)
        rows = np.full(n * L, -1, dtype=np.int64)
        rows[position] = values
        rows = rows.reshape(n, L)
        prediction_mask = np.zeros(n * L, dtype=bool)
        prediction_mask[position[later]] = True
        prediction_mask = prediction_mask.reshape(n, L)
    return dict(rows=rows, offsets=offsets, prediction_mask=prediction_mask,
                prediction_source=values[:-1][later[1:]], prediction_target=targets[later],
                prediction_index=position[later])


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
    packed_rows: int  # distinct rows: one per distinct prefix
    trees: int  # sequences with distinct first tokens
    packed_attention_pairs: int  # visible (query, key) pairs: sum of depth + 1 over rows
    unpacked_attention_pairs: int  # causal pairs of every sequence alone

    @property
    def token_ratio(self) -> float:
        return self.packed_rows / self.original_tokens

    @property
    def packed_tokens(self) -> int:
        """Deprecated: :attr:`packed_rows`."""
        deprecation.warn("ForestStats.packed_tokens", "ForestStats.packed_rows")
        return self.packed_rows

    @property
    def attention_ratio(self) -> float:
        return self.packed_attention_pairs / self.unpacked_attention_pairs


def stats_of_arrays(ids: list[np.ndarray]) -> ForestStats:
    """Sizes of the forest of validated id arrays from the sort and LCPs alone: O(total).
    (:func:`treepack.forest_stats` validates any sequences and calls this.)"""
    order, lcp = sort_and_lcp(ids)
    s_len = np.fromiter((ids[i].shape[0] for i in order), dtype=np.int64, count=len(ids))
    # rows of sequence k have depths lcp[k] .. len[k]-1; each sees depth + 1 keys
    packed_pairs = causal_pairs(s_len) - causal_pairs(lcp)
    return ForestStats(
        num_sequences=len(ids),
        original_tokens=int(s_len.sum()),
        packed_rows=int((s_len - lcp).sum()),
        trees=int((lcp == 0).sum()),
        packed_attention_pairs=int(packed_pairs.sum()),
        unpacked_attention_pairs=int(causal_pairs(s_len).sum()),
    )
