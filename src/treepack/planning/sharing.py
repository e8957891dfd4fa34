"""Where a step's sharing was lost: the rows it computed against the rows it could have.

A step's sequences merged into one prefix forest need ``achievable_rows`` packed rows. The
step computes ``achieved_rows``: its sequences were dealt to ranks, cut into micro-batches, and
trees over the budget were cut into packs that each repeat the prefix above the cut. Below the
one forest lies the ``ideal``: the same forest had every group's prompts been the same tokens.
The rows between them are attributed to five causes, in this order, each counting the rows
its cut adds given the ones before it::

    ideal_rows            the one forest, each group's prompts made to agree
    + false_forks         rollouts of one group whose prompts differ in their tokens
    + differing_routes    MoE routes that differ where the tokens agree (``routes=``: rows
                          merge only where routes agree too; 0 without routes)
    = achievable_rows     the one forest of the step's sequences as they are
    + across_ranks        forests per rank instead of one
    + across_micro_batches  forests per (rank, micro-batch)
    + split_and_repeat    forests per (rank, micro-batch, pack)
    = achieved_rows

So ``achieved_rows == ideal_rows + sum(report.lost)`` holds exactly, and no cause is negative:
splitting a set of sequences never lowers its forest's rows, and the ideal only ever merges
rows of the actual forest (below).

How each number is computed, with one sort of the step's sequences (``sort_and_lcp``):

- The rows of any subset of the sorted sequences are their lengths minus each member's LCP
  with the member before it (in sorted order); that LCP is the least adjacent LCP between
  the two, a range minimum over the ``lcp`` array. One sparse table of range minima
  (O(N log N)) answers every level: a cell's members are adjacent after a stable sort by
  cell, so each level is one vectorised query over N pairs.
- False forks: the prompt a group's rollouts share is as long as its shortest (an agent
  loop's later turns hold their session's history: not the group's prompt). Each sequence's
  prompt of that length, keyed by its group, is sorted once more; a group's prompts agree up
  to the least LCP between its adjacent members (the *divergence depth*).
  The ideal relabels every row of the actual forest that lies inside a diverging group's
  prompt from that depth on with the group's label (one label per row: of the groups whose
  prompts pass through it, the one that appears first), keeps every other row's token, and
  counts the relabelled sequences' forest. Because the label is a function of the actual row, sequences
  that shared a row still share it: the ideal merges, never splits. Rows saved are
  attributed to the group of the first relabelled row on their path.

Host cost: O(total tokens) vectorised numpy, O(N log N) for the sort and the range minima,
and O(N) Python (the sort's key list, one small array per prompt, one entry per false-fork
group); no Python loop over tokens, nothing [N, L] or T x T. The false-fork pass builds two flat
layouts only when some group's prompts differ.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import numpy as np
from torch import Tensor

from treepack.core.forest import (build_layout, identities, ragged_arange, route_keys,
                                  sort_and_lcp, stats_of_arrays)
from treepack.core.checks import validate_keys, validate_routes, validate_sequences

__all__ = ["report", "SharingReport", "Causes", "FalseFork", "SessionFork", "Placement",
           "placement", "rows_from_trl", "rows_from_verl", "CAUSES", "COUNTS",
           "metrics_from_counts", "unpadded"]

# the JSON-lines writers and the padded-batch reader live with their format and with
# collation; these names are kept here, where earlier releases defined them
from treepack.planning.collation import unpadded  # noqa: E402
from treepack.planning.jsonl import rows_from_trl, rows_from_verl  # noqa: E402

CAUSES = ("false_forks", "across_ranks", "across_micro_batches", "split_and_repeat",
          "differing_routes")


class Causes(NamedTuple):
    """One value per cause (:data:`CAUSES`). Rows are attributed in the order false forks,
    differing routes, then the placement's cuts; ``differing_routes`` comes last in the
    tuple, defaulting to 0, so a four-cause ``Causes(...)`` still builds."""

    false_forks: int | float | bool
    across_ranks: int | float | bool
    across_micro_batches: int | float | bool
    split_and_repeat: int | float | bool
    differing_routes: int | float | bool = 0


class FalseFork(NamedTuple):
    """A group whose sequences' prompts differ in their tokens."""

    group: object  # the group's key as given (verl's uid, ...)
    sequences: int  # the group's sequences
    variants: int  # distinct prompts among them
    depth: int  # tokens every prompt of the group shares: the first divergence
    prompt_length: int  # the group's longest prompt
    shortest_prompt: int  # the group's shortest prompt
    tokens: tuple[int, int]  # two prompts' tokens at ``depth``
    rows: int  # rows the one forest would save were the group's prompts the same

    @property
    def hint(self) -> str:
        """The likely cause, and what to change, in one line."""
        if self.depth == 0:
            return ("the prompts differ from their first token: a BOS token or system prompt "
                    "that differs between rollouts; render the prompt once per group and reuse "
                    "its ids")
        if self.shortest_prompt == self.prompt_length:
            return ("the prompts have one length but differ inside: a value rendered into the "
                    "template (a date, a random id, a sampled instruction); keep it fixed "
                    "within a group")
        return ("the prompts diverge part-way and differ in length: the history was "
                "re-rendered or re-tokenized (a chat template that rewrites earlier turns, "
                "e.g. drops their reasoning, or text tokenized across a turn boundary); extend "
                "the previous turn's ids instead of re-tokenizing the conversation")


class SessionFork(NamedTuple):
    """An agent session (a trajectory whose turns are given in order) in which a turn's prompt
    does not extend the previous turn's ids: its history was re-rendered, so the turn shares
    the previous one's rows only up to ``depth``."""

    session: object  # the session's key as given
    turns: int  # the session's turns (sequences)
    breaks: int  # turns whose prompt does not extend the previous turn
    turn: int  # the first such turn (0-based, within the session)
    depth: int  # tokens it shares with the previous turn
    previous_length: int  # the previous turn's tokens
    tokens: tuple[int, int]  # the previous turn's token and this turn's at ``depth``
    rows: int  # rows the session's forest would save had every turn extended the last

    @property
    def hint(self) -> str:
        """The likely cause, and what to change, in one line."""
        return ("the conversation was re-rendered or re-tokenized between turns (a chat "
                "template that rewrites earlier turns, e.g. drops their reasoning, or text "
                "tokenized across a turn boundary): build each turn's prompt by extending the "
                "previous turn's ids")


@dataclasses.dataclass(frozen=True)
class SharingReport:
    """What a step computed against what it could have (module doc: the decomposition)."""

    num_sequences: int
    original_tokens: int
    ideal_rows: int  # the one forest, every group's prompts made to agree
    achievable_rows: int  # the one forest of the sequences as given
    achieved_rows: int  # summed over the cells of the given placement
    lost: Causes  # rows each cause adds, in attribution order
    measured: Causes  # bools: whether the inputs let each cause be measured
    groups: int | None  # number of groups; None without group keys or prompt lengths
    groups_hit: Causes  # groups with a false fork, split across ranks, micro-batches, packs
    false_forks: tuple[FalseFork, ...]  # most rows first
    # sessions whose later turns do not extend the earlier ones (most rows first); their rows
    # are measured on each session alone, outside the decomposition above
    session_forks: tuple[SessionFork, ...] = ()
    sessions: int | None = None  # number of sessions; None without session keys

    @property
    def ideal_ratio(self) -> float:
        return self.ideal_rows / self.original_tokens

    @property
    def achievable_ratio(self) -> float:
        return self.achievable_rows / self.original_tokens

    @property
    def achieved_ratio(self) -> float:
        return self.achieved_rows / self.original_tokens

    @property
    def shares(self) -> Causes:
        """Each cause's rows as a fraction of all rows lost (``achieved - ideal``); zeros
        when nothing was lost."""
        total = self.achieved_rows - self.ideal_rows
        return Causes(*(rows / total if total else 0.0 for rows in self.lost))

    def as_dict(self) -> dict:
        """Every number, JSON-ready (what ``treepack stats --json`` prints under
        ``"sharing"``).

        Returns:
            A dict of plain ints, floats, strings and lists.
        """
        return {
            "num_sequences": self.num_sequences, "original_tokens": self.original_tokens,
            "ideal_rows": self.ideal_rows, "achievable_rows": self.achievable_rows,
            "achieved_rows": self.achieved_rows, "ideal_ratio": self.ideal_ratio,
            "achievable_ratio": self.achievable_ratio, "achieved_ratio": self.achieved_ratio,
            "lost": {c: {"rows": int(r), "share": s, "measured": bool(m), "groups": int(g)}
                     for c, r, s, m, g in zip(CAUSES, self.lost, self.shares, self.measured,
                                              self.groups_hit)},
            "groups": self.groups,
            "false_forks": [{**f._asdict(), "group": _plain(f.group), "tokens": list(f.tokens),
                             "hint": f.hint} for f in self.false_forks],
            "sessions": self.sessions,
            "session_forks": [{**f._asdict(), "session": _plain(f.session),
                               "tokens": list(f.tokens), "hint": f.hint}
                              for f in self.session_forks],
        }

    def metrics(self, prefix: str = "treepack/") -> dict[str, float]:
        """Flat scalars for a trainer's logger.

        Args:
            prefix: put before every name.

        Returns:
            ``{prefix + "achievable_ratio": ..., prefix + "achieved_ratio": ...,
            prefix + "ideal_ratio": ..., prefix + "lost_rows/<cause>": ...}``, a cause only
            where it was measured.
        """
        return metrics_from_counts(self.counts(), self.measured, prefix)

    def counts(self) -> list[int]:
        """The report's numbers in :data:`COUNTS` order: what adds up over processes (each
        process's report, summed by one all-reduce, gives the step's
        :func:`metrics_from_counts`).

        Returns:
            A list of ints.
        """
        return [self.original_tokens, self.ideal_rows, self.achievable_rows,
                self.achieved_rows, *(int(r) for r in self.lost)]


COUNTS = ("original_tokens", "ideal_rows", "achievable_rows", "achieved_rows",
          *(f"lost_rows/{c}" for c in CAUSES))


def metrics_from_counts(counts, measured=Causes(True, True, True, True, True),
                        prefix: str = "treepack/") -> dict[str, float]:
    """:meth:`SharingReport.metrics` of :meth:`SharingReport.counts`, e.g. summed over the
    processes of a step.

    Args:
        counts: numbers in :data:`COUNTS` order (ints, floats, or a tensor's ``tolist()``).
        measured: which causes to log (:attr:`SharingReport.measured`).
        prefix: put before every name.

    Returns:
        The ratios of ideal, achievable and achieved rows to the original tokens, and the
        rows lost to each measured cause.
    """
    values = dict(zip(COUNTS, (float(c) for c in counts)))
    tokens = max(values["original_tokens"], 1.0)
    out = {f"{prefix}{k}_ratio": values[f"{k}_rows"] / tokens
           for k in ("ideal", "achievable", "achieved")}
    out.update({f"{prefix}lost_rows/{c}": values[f"lost_rows/{c}"]
                for c, m in zip(CAUSES, measured) if m})
    return out


class Placement(NamedTuple):
    """Where a plan put each sequence: ``ranks`` [N] and ``packs`` [N] (the pack's index on
    its rank), for :func:`report`."""

    ranks: np.ndarray
    packs: np.ndarray


def placement(plan) -> Placement:
    """The rank and pack of every sequence of a :class:`treepack.Plan`.

    Args:
        plan: what :func:`treepack.plan` returned.

    Returns:
        :class:`Placement`; pass its fields as :func:`report`'s ``ranks`` and ``packs``.
    """
    n = sum(len(p.seq_ids) for rank in plan.specs for p in rank)
    ranks, packs = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for r, specs in enumerate(plan.specs):
        for j, spec in enumerate(specs):
            ranks[spec.seq_ids], packs[spec.seq_ids] = r, j
    return Placement(ranks, packs)


def report(sequences, *, groups=None, prompt_lengths=None, ranks=None, micro_batches=None,
           packs=None, keys=None, sessions=None, routes=None) -> SharingReport:
    """Rows a step computed, rows it could have, and the cause of each row between.

    Args:
        sequences: the step's token-id sequences (lists, numpy arrays or 1-D tensors), as
            for :meth:`treepack.TreePack.from_sequences`.
        groups: ``[N]`` group keys (ints or strings: verl's ``uid``, the index of a TRL
            prompt): sequences that should share their prompt. Keys are equal as Python
            compares them (``1`` and ``"1"`` are two groups). Without them, sequences with
            identical prompts form the groups and no false fork can be seen.
        prompt_lengths: ``[N]`` prompt tokens at the start of each sequence; needed for false
            forks (a divergence inside the prompt) and for groups by prompt.
        ranks: ``[N]`` the data-parallel rank (process) each sequence went to.
        micro_batches: ``[N]`` the micro-batch on its rank: the rows the trainer hands to
            packing at once (TRL's gradient-accumulation micro-batch, verl's PPO mini-batch).
        packs: ``[N]`` the pack (one forward) within its micro-batch; trees cut by the
            planner repeat their prefix in each pack. A tree run in parts
            (``hf.backward_in_parts``) computes every row once: give it one pack.
        keys: per-token content keys, one integer sequence per sequence, as for
            :meth:`treepack.TreePack.from_sequences` (``treepack.hf.Images.keys``: an image
            placeholder's image): every number counts (id, key) pairs, the rows the packs
            are built from, so the same text on two images is two rows. False forks name
            token ids.
        sessions: ``[N]`` session keys (an agent trajectory: verl v1's ``{uid}_{session_id}``):
            a session's sequences are its turns, in the order given, and each turn's prompt
            should extend the previous turn's ids. A turn that does not (a re-rendered
            history) is a :class:`SessionFork`, with the rows the session's forest would
            save had it; measured on each session alone, outside ``lost``.
        routes: per-token routed experts, as for :meth:`treepack.TreePack.from_sequences`
            (an MoE rollout's, for routing replay): rows merge only where routes agree too,
            so ``achievable_rows`` and the placement's rows count (id, key, route) rows, and
            ``lost.differing_routes`` is the rows the routes fork (the one forest with
            routes against the one without); ``ideal_rows`` and the false forks stay on ids
            and keys. Each sequence's last token joins a longer one's row as the whole step
            resolves it (a pack of some of them may resolve it otherwise).

    Returns:
        :class:`SharingReport`: ``ideal_rows <= achievable_rows <= achieved_rows``, their
        ratios to ``original_tokens``, ``lost`` (a :class:`Causes` of rows, which sums to
        ``achieved_rows - ideal_rows``), ``shares``, ``groups_hit`` (groups per cause) and
        ``false_forks`` (one :class:`FalseFork` per group whose prompts differ, most rows
        first). Placement not given counts as one cell (no rows lost to it), and
        ``measured`` says which causes the inputs could show.

    Raises:
        ValueError / TypeError: bad sequences (as ``TreePack.from_sequences``); a group key,
            prompt length or placement array whose length is not N; a prompt length outside
            ``0 .. len``; a placement label or group key that is not an integer or string.

    Example:
        >>> from treepack.planning.sharing import report
        >>> seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 4], [7, 8]]
        >>> r = report(seqs, groups=["a", "a", "a", "b"], prompt_lengths=[3, 3, 3, 1],
        ...            ranks=[0, 0, 1, 1])
        >>> r.ideal_rows, r.achievable_rows, r.achieved_rows
        (7, 9, 11)
        >>> r.lost
        Causes(false_forks=2, across_ranks=2, across_micro_batches=0, split_and_repeat=0, differing_routes=0)
        >>> fork, = r.false_forks
        >>> fork.group, fork.depth, fork.prompt_length, fork.tokens
        ('a', 2, 3, (3, 9))
    """
    shown = validate_sequences(sequences)  # the token ids, for the false forks' tokens
    keys = None if keys is None else validate_keys(keys, shown)
    ids = shown if keys is None else identities(shown, keys)
    n = len(ids)
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=n)
    plen = None if prompt_lengths is None else _prompt_lengths(prompt_lengths, lengths)
    group_keys, gi = (None, None) if groups is None else _labels(groups, n, "groups",
                                                                 _GROUP_HINT)
    cells = [None if x is None else _labels(x, n, name, _PLACE_HINT)[1]
             for x, name in ((ranks, "ranks"), (micro_batches, "micro_batches"),
                             (packs, "packs"))]
    order, lcp = sort_and_lcp(ids)
    s_len = lengths[order]
    plain = int((s_len - lcp).sum())  # the one forest on ids and keys

    ideal, forks = None, ()
    if gi is None and plen is not None:
        gi = _same_prompt(ids, plen)  # groups by identical prompt: splits counted, no forks
    elif gi is not None and plen is not None:
        ideal, forks = _false_forks(ids, lengths, plen, group_keys, gi, shown)
    ideal = plain if ideal is None else ideal

    forked = 0  # groups whose rows the routes fork
    if routes is not None:  # every count past the false forks on (id, key, route) rows
        routed = identities(shown, route_keys(shown, keys, validate_routes(routes, shown))[0])
        r_order, r_lcp = sort_and_lcp(routed)
        if gi is not None:
            forked = int((_cell_rows(gi[r_order], lengths[r_order], _RangeMin(r_lcp))
                          > _cell_rows(gi[order], s_len, _RangeMin(lcp))).sum())
        order, lcp, s_len = r_order, r_lcp, lengths[r_order]
    rows, hit = _placed_rows(cells, order, s_len, lcp, gi)
    achievable = rows[0]
    return SharingReport(
        num_sequences=n, original_tokens=int(lengths.sum()), ideal_rows=ideal,
        achievable_rows=achievable, achieved_rows=rows[-1],
        lost=Causes(plain - ideal, *(b - a for a, b in zip(rows, rows[1:])),
                    differing_routes=achievable - plain),
        measured=Causes(groups is not None and plen is not None,
                        *(c is not None for c in cells), differing_routes=routes is not None),
        groups=None if gi is None else int(gi.max()) + 1,
        groups_hit=Causes(len(forks), *hit, differing_routes=forked), false_forks=forks,
        **_session_forks(ids, shown, plen, sessions))


def _session_forks(ids, shown, plen, sessions) -> dict:
    """``session_forks`` and ``sessions`` of :class:`SharingReport` (module doc of
    :class:`SessionFork`): per session, each turn against the previous one as it would have
    been had every turn extended the last; the session's rows with and without that fix."""
    if sessions is None:
        return {}
    names, si = _labels(sessions, len(ids), "sessions", _SESSION_HINT)
    members = [[] for _ in names]
    for s, k in enumerate(si.tolist()):  # a loop over sequences, not tokens
        members[k].append(s)
    forks = []
    for name, turns in zip(names, members):
        fixed, tokens, found = [ids[turns[0]]], shown[turns[0]], []
        for t in range(1, len(turns)):
            previous, current = fixed[-1], ids[turns[t]]
            prompt = current.shape[0] if plen is None else int(plen[turns[t]])
            end = min(previous.shape[0], prompt)  # what the turn should repeat
            diff = np.flatnonzero(previous[:end] != current[:end])
            mine = shown[turns[t]]
            if diff.size:
                depth = int(diff[0])
                found.append((t, depth, previous.shape[0],
                              (int(tokens[depth]), int(mine[depth]))))
                current = np.concatenate((previous[:end], current[end:]))
                mine = np.concatenate((tokens[:end], mine[end:]))
            fixed.append(current)
            tokens = mine
        if found:
            rows = (stats_of_arrays([ids[s] for s in turns]).packed_rows
                    - stats_of_arrays(fixed).packed_rows)
            t, depth, length, tokens = found[0]
            forks.append(SessionFork(name, len(turns), len(found), t, depth, length, tokens,
                                     int(rows)))
    forks.sort(key=lambda f: (-f.rows, -f.breaks))
    return {"session_forks": tuple(forks), "sessions": len(names)}


def _placed_rows(cells, order, s_len, lcp, gi) -> tuple[list[int], list[int]]:
    """Rows at each level of the placement (the one forest first, then per rank, per
    (rank, micro-batch), per (rank, micro-batch, pack); a level not given adds no cut) and
    the groups each level's cut splits."""
    rows, hit = [int((s_len - lcp).sum())], []
    mins = _RangeMin(lcp) if any(c is not None for c in cells) else None
    cell = np.zeros(order.shape[0], dtype=np.int64)
    for labels in cells:
        if labels is None:
            rows.append(rows[-1])
            hit.append(0)
            continue
        finer = np.unique(cell * (int(labels.max()) + 1) + labels,
                          return_inverse=True)[1].reshape(-1)
        rows.append(int(_cell_rows(finer[order], s_len, mins).sum()))
        hit.append(0 if gi is None else _groups_split(gi, cell, finer))
        cell = finer
    return rows, hit


_GROUP_HINT = "one group key per sequence (verl's uid, the index of a TRL prompt)"
_PLACE_HINT = "one label per sequence (an integer, e.g. the rank or micro-batch index)"
_SESSION_HINT = "one session key per sequence (an agent trajectory's id)"


def _labels(values, n: int, name: str, hint: str) -> tuple[list, np.ndarray]:
    """``values`` [n] as (the distinct keys in order of first appearance, index per
    sequence [n] into them)."""
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, (list, tuple)) and not all(type(v) is int for v in values) and \
            all(isinstance(v, (str, bytes, numbers.Number)) for v in values):
        # as given: np.asarray would turn [1, "1"] into ["1", "1"], one group
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
    else:
        arr = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if arr.ndim != 1 or arr.shape[0] != n:
        shape = f"{arr.shape[0]} values" if arr.ndim == 1 else f"shape {arr.shape}"
        raise ValueError(f"{name} has {shape} for {n} sequences: give {hint}")
    if arr.dtype.kind in "iu":
        uniq, first, index = np.unique(arr, return_index=True, return_inverse=True)
        rank = np.empty(len(uniq), dtype=np.int64)  # renumber by first appearance
        rank[np.argsort(first, kind="stable")] = np.arange(len(uniq))
        return [uniq[i].item() for i in np.argsort(first, kind="stable")], rank[index.reshape(-1)]
    seen: dict = {}
    index = np.empty(n, dtype=np.int64)
    for i, v in enumerate(arr.tolist()):
        if isinstance(v, bool) or not isinstance(v, (str, bytes, numbers.Integral)):
            raise TypeError(f"{name}[{i}] is {v!r} ({type(v).__name__}): give {hint}")
        index[i] = seen.setdefault(v, len(seen))
    return list(seen), index


def _prompt_lengths(values, lengths: np.ndarray) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    n = lengths.shape[0]
    if arr.ndim != 1 or arr.shape[0] != n or (n and arr.dtype.kind not in "iu"):
        raise ValueError(f"prompt_lengths has shape {arr.shape} and dtype {arr.dtype} for {n} "
                         "sequences: give one integer per sequence, its prompt's tokens")
    bad = np.flatnonzero((arr < 0) | (arr > lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"prompt_lengths[{i}] = {arr[i]} is outside 0 .. {lengths[i]} (the "
                         f"length of sequence {i}): a prompt is the start of its sequence")
    return arr.astype(np.int64)


class _RangeMin:
    """``min(a[lo..hi])`` for many (lo, hi) at once: a sparse table of power-of-two window
    minima, O(N log N) to build, O(1) numpy per query."""

    def __init__(self, a: np.ndarray):
        n = a.shape[0]
        levels = [a]  # levels[j][i] = min(a[i : i + 2**j])
        while (1 << len(levels)) <= n:
            h = 1 << (len(levels) - 1)
            levels.append(np.minimum(levels[-1][:-h], levels[-1][h:]))
        self.table = np.zeros((len(levels), n), dtype=np.int64)
        for j, level in enumerate(levels):
            self.table[j, :level.shape[0]] = level

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        j = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1  # floor(log2(count)), exact
        return np.minimum(self.table[j, lo], self.table[j, hi - (1 << j) + 1])


def _cell_rows(cell_sorted: np.ndarray, s_len: np.ndarray, mins: _RangeMin) -> np.ndarray:
    """Each cell's forest rows, from the sorted sequences' cells: a cell's members are
    adjacent after a stable sort by cell, and two adjacent members share the least LCP
    between them (module doc)."""
    by_cell = np.argsort(cell_sorted, kind="stable")  # each cell's members, ascending
    same = cell_sorted[by_cell[1:]] == cell_sorted[by_cell[:-1]]
    prev, cur = by_cell[:-1][same], by_cell[1:][same]
    shared = mins(prev + 1, cur) if cur.size else np.zeros(0, dtype=np.int64)
    cells = int(cell_sorted.max()) + 1 if cell_sorted.size else 0
    return (np.bincount(cell_sorted, weights=s_len, minlength=cells)
            - np.bincount(cell_sorted[cur], weights=shared, minlength=cells)).astype(np.int64)


def _groups_split(gi: np.ndarray, coarse: np.ndarray, fine: np.ndarray) -> int:
    """Groups that lie in more of the ``fine`` cells than of the ``coarse`` ones."""
    width = int(fine.max()) + 1
    count = [np.bincount(np.unique(gi * width + c) // width, minlength=int(gi.max()) + 1)
             for c in (coarse, fine)]
    return int((count[1] > count[0]).sum())


class _Prompts(NamedTuple):
    """The prompts sorted behind their group index, as adjacent pairs (``prev``, ``cur``)."""

    order: np.ndarray  # [N] sorted position -> sequence
    prev: np.ndarray  # [N - 1] sequence indices
    cur: np.ndarray  # [N - 1]
    same_group: np.ndarray  # [N - 1] bool
    common: np.ndarray  # [N - 1] their prompts' LCP
    equal: np.ndarray  # [N - 1] bool: the two prompts are the same tokens


def _prompts(ids, plen: np.ndarray, gi: np.ndarray) -> _Prompts:
    """Each prompt behind its group's index, sorted: a group's prompts are adjacent and the
    LCP of two of them is one more than their prompts' LCP (0 across groups)."""
    keyed = [np.concatenate((gi[i:i + 1], a[:p])) for i, (a, p) in
             enumerate(zip(ids, plen.tolist()))]
    order, lcp = sort_and_lcp(keyed)
    prev, cur = order[:-1], order[1:]
    common = lcp[1:] - 1
    return _Prompts(order, prev, cur, lcp[1:] >= 1, common,
                    (common == plen[prev]) & (plen[prev] == plen[cur]))


def _same_prompt(ids, plen: np.ndarray) -> np.ndarray:
    """A group index per sequence: sequences with equal prompts form one group."""
    pr = _prompts(ids, plen, np.zeros(len(ids), dtype=np.int64))
    gi = np.empty(len(ids), dtype=np.int64)
    gi[pr.order] = np.cumsum(np.append(True, ~pr.equal)) - 1
    return gi


def _false_forks(ids, lengths, plen, keys, gi, shown
                 ) -> tuple[int | None, tuple[FalseFork, ...]]:
    """The ideal rows (None: no group's prompts differ, the ideal is the achievable) and one
    :class:`FalseFork` per group whose prompts differ within the group's shortest prompt:
    the tokens every rollout of the group was given (a later turn's prompt in an agent loop
    holds its session's history, which differs between sessions by design)."""
    n_groups = int(gi.max()) + 1
    none = np.iinfo(np.int64).max
    shortest = np.full(n_groups, none)
    np.minimum.at(shortest, gi, plen)
    longest = np.zeros(n_groups, dtype=np.int64)
    np.maximum.at(longest, gi, plen)
    plen = shortest[gi]  # the prompt that must agree
    pr = _prompts(ids, plen, gi)
    differ = pr.same_group & ~pr.equal
    if not differ.any():
        return None, ()
    g_pair = gi[pr.cur]
    # The least LCP over a group's differing pairs is where its prompts first diverge.
    depth = np.full(n_groups, none)
    np.minimum.at(depth, g_pair[differ], pr.common[differ])
    forked = np.flatnonzero(depth < none)
    variants = 1 + np.bincount(g_pair[differ], minlength=n_groups)
    at = np.flatnonzero(differ & (pr.common == depth[g_pair]))  # pairs at that depth
    first = at[np.unique(g_pair[at], return_index=True)[1]]  # each forked group's first
    ideal, saved = _ideal(ids, lengths, plen, gi, np.where(depth < none, depth, -1))
    size = np.bincount(gi, minlength=n_groups)
    forks = []
    for g, k in zip(forked.tolist(), first.tolist()):
        d = int(depth[g])  # < the group's shortest prompt: both prompts have a token there
        tok = tuple(int(shown[s][d]) for s in (pr.prev[k], pr.cur[k]))
        forks.append(FalseFork(keys[g], int(size[g]), int(variants[g]), d, int(longest[g]),
                               int(shortest[g]), tok, int(saved[g])))
    forks.sort(key=lambda f: (-f.rows, -f.sequences))
    return ideal, tuple(forks)


def _ideal(ids, lengths, plen, gi, depth) -> tuple[int, np.ndarray]:
    """Rows of the forest with every diverging group's prompt rows (at or below its
    divergence depth) relabelled by group, and the rows saved per group (module doc)."""
    actual = build_layout(ids, flat=True)
    offsets, node = actual.offsets, actual.rows  # [N + 1], [total]: each token's row
    T = actual.num_packed_rows
    d = depth[gi]
    span = np.where(d >= 0, np.maximum(plen - d, 0), 0)  # prompt tokens to relabel
    pos = ragged_arange(offsets[:-1] + np.maximum(d, 0), span)
    none = np.iinfo(np.int64).max
    label = np.full(T, none)  # per actual row: the least group relabelling it
    np.minimum.at(label, node[pos], np.repeat(gi, span))
    flat = np.concatenate(ids)
    per_token = label[node]
    relabelled = per_token != none
    flat[relabelled] = int(flat.max()) + 1 + per_token[relabelled]  # past every token id
    seqs = np.split(flat, offsets[1:-1])
    ideal = build_layout(seqs, flat=True)
    # The quotient map: each actual row lies in one ideal row; an ideal row holding k saves
    # k - 1, credited to the first relabelled row on its path.
    ideal_of = np.empty(T, dtype=np.int64)
    ideal_of[node] = ideal.rows
    saved = np.bincount(ideal_of, minlength=ideal.num_packed_rows) - 1
    # Every path through a merged ideal row has the same relabelled tokens above it, so any
    # sequence through it names the same first label (rows nothing merged into save 0).
    mark = np.where(relabelled, np.arange(flat.shape[0]), np.repeat(offsets[1:] - 1, lengths))
    first = np.minimum.reduceat(mark, offsets[:-1])  # its first relabelled token, else its last
    credit = np.empty(ideal.num_packed_rows, dtype=np.int64)
    credit[ideal.rows] = np.repeat(np.where(relabelled[first], per_token[first], 0), lengths)
    hit = saved > 0
    per_group = np.bincount(credit[hit], weights=saved[hit], minlength=int(gi.max()) + 1)
    return ideal.num_packed_rows, per_group.astype(np.int64)


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v
