"""The JSON-lines batch format of ``treepack stats``: its reader and the writers that dump a
TRL or verl batch into it.

Each line is one sequence: a list of ids, ``{"input_ids": [...]}``, ``{"prompt": [...],
"completion": [...]}`` or TRL's ``{"prompt_ids": [...], "completion_ids": [...]}``, with
optional fields saying where it sat in a step (its group ``uid`` / ``group``, ``rank``,
``micro_batch``, ``pack``, agent ``session``) and per-token content ``keys``
(docs/sharing.md). :func:`rows_from_trl` and :func:`rows_from_verl` write lines from a
framework's batch; :func:`read_batch` reads them back. Importing this module loads numpy
only (``treepack --help`` reads none of it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import NamedTuple

import numpy as np

__all__ = ["read_batch", "JsonlBatch", "InputError", "rows_from_trl", "rows_from_verl",
           "KNOWN_FIELDS"]

PROGRESS_MIN_BYTES = 8 << 20  # files at least this large show a progress bar


class InputError(Exception):
    """A problem with the user's input file, reported as ``FILE:LINE: message``."""


TOKEN_FORMATS = (("input_ids",), ("prompt", "completion"), ("prompt_ids", "completion_ids"))
GROUP_FIELDS = ("uid", "group")  # verl's name, and treepack.collate's
PLACEMENT_FIELDS = ("rank", "micro_batch", "pack")
SESSION_FIELD = "session"  # an agent trajectory: its lines are its turns, in order
KEYS_FIELD = "keys"  # per-token content keys (an image placeholder's image), 0 for text
KNOWN_FIELDS = (*(k for f in TOKEN_FORMATS for k in f), *GROUP_FIELDS, *PLACEMENT_FIELDS,
                SESSION_FIELD, KEYS_FIELD)


class JsonlBatch(NamedTuple):
    """A JSON-lines batch: its sequences and, where every line gives them, their prompt
    lengths, group keys, placement, sessions and per-token keys (None where the lines do
    not)."""

    sequences: list
    prompt_lengths: list | None
    groups: list | None
    ranks: list | None
    micro_batches: list | None
    packs: list | None
    group_field: str | None  # "uid" or "group", as the file names it
    sessions: list | None = None
    keys: list | None = None


def _token_list(ids, name: str, where: str):
    what = "content keys" if name == KEYS_FIELD else "token ids"
    if not isinstance(ids, list):
        raise InputError(f"{where}: {name!r} must be a list of {what}, got "
                         f"{type(ids).__name__}")
    if ids and all(isinstance(x, list) for x in ids):
        raise InputError(f"{where}: {name!r} holds {len(ids)} lists: a batch on one line? "
                         "Write one sequence per line (a list of ids, or an object)")
    if any(type(x) is not int for x in ids):
        bad = next(x for x in ids if type(x) is not int)
        raise InputError(f"{where}: {what} must be integers, found {bad!r}")
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        raise InputError(f"{where}: a {what[:-1]} is beyond int64 (max {max(ids)})") from None
    if arr.size and arr.min() < 0 and name != KEYS_FIELD:
        at = int(np.argmax(arr < 0))
        raise InputError(f"{where}: token ids must be >= 0, found {int(arr[at])} at position "
                         f"{at}: strip padding and ignore-index values such as -100 first "
                         "(write each sequence's real tokens only)")
    return arr


def _row_from_line(value, where: str):
    """(ids, prompt length or None, {group / placement / session / keys field: value}, the
    token format's first field) of one line."""
    import difflib

    if isinstance(value, list):
        value = {"input_ids": value}
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a list of token ids or an object with "
                         f"'input_ids', 'prompt' and 'completion', or 'prompt_ids' and "
                         f"'completion_ids', got {type(value).__name__}")
    for key in value:
        near = difflib.get_close_matches(key, KNOWN_FIELDS, n=1, cutoff=0.85)
        if key not in KNOWN_FIELDS and near:
            raise InputError(f"{where}: unknown field {key!r}: did you mean {near[0]!r}? "
                             f"(treepack stats reads {', '.join(KNOWN_FIELDS)}; other fields "
                             "are ignored)")
    given = [f for f in TOKEN_FORMATS if any(k in value for k in f)]
    if len(given) != 1 or not all(k in value for k in given[0]):
        have = sorted(k for f in TOKEN_FORMATS for k in f if k in value) or \
            sorted(value) or ["no field"]
        raise InputError(
            f"{where}: expected 'input_ids', or 'prompt' and 'completion', or 'prompt_ids' and "
            f"'completion_ids' (one of them), got {', '.join(map(repr, have))}"
            if have != ["no field"] else f"{where}: an object without 'input_ids' (or "
            "'prompt' and 'completion', or 'prompt_ids' and 'completion_ids')")
    parts = [_token_list(value[k], k, where) for k in given[0]]
    ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if not ids.size:
        raise InputError(f"{where}: the sequence is empty; every sequence needs a token")
    if sum(k in value for k in GROUP_FIELDS) > 1:
        raise InputError(f"{where}: both 'uid' and 'group': give the group key once")
    fields = {}
    if KEYS_FIELD in value:
        keys = _token_list(value[KEYS_FIELD], KEYS_FIELD, where)
        if keys.shape != ids.shape:
            raise InputError(f"{where}: 'keys' has {keys.size} values for the sequence's "
                             f"{ids.size} tokens: give one content key per token (0 for text)")
        fields[KEYS_FIELD] = (KEYS_FIELD, keys)
    for key in (*GROUP_FIELDS, *PLACEMENT_FIELDS, SESSION_FIELD):
        if key not in value:
            continue
        v = value[key]
        if key in (*GROUP_FIELDS, SESSION_FIELD) and (
                isinstance(v, bool) or not isinstance(v, (str, int))):
            what = "a group key" if key in GROUP_FIELDS else "a session"
            raise InputError(f"{where}: {key!r} is {v!r}: {what} is a string or an "
                             "integer (verl's uid, a prompt's index, a trajectory's id)")
        if key in PLACEMENT_FIELDS and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InputError(f"{where}: {key!r} is {v!r}: give the {key.replace('_', '-')}'s "
                             "index, an integer >= 0")
        fields["group" if key in GROUP_FIELDS else key] = (key, v)
    return ids, (len(parts[0]) if len(parts) > 1 else None), fields, given[0][0]


def read_batch(path: str) -> JsonlBatch:
    """A batch from a JSON-lines file (``-``: standard input). Each line: a list of ids,
    ``{"input_ids": [...]}``, ``{"prompt": [...], "completion": [...]}`` or TRL's
    ``{"prompt_ids": [...], "completion_ids": [...]}`` (the sequence is the prompt, then the
    completion); optionally a group key ``uid`` (verl) or ``group``, a placement ``rank``,
    ``micro_batch``, ``pack``, a ``session`` (an agent trajectory whose lines are its turns,
    in order) and ``keys`` (one content key per token, 0 for text: an image placeholder's
    image, so that the same text on two images is two rows, as the packs build it). Other
    fields are ignored.

    Blank lines are skipped; any other bad line raises :class:`InputError` naming it; a
    group, placement, session or keys field must be on every line or on none, and so must a
    prompt (lines with one and lines of ``input_ids`` alone do not mix).
    """
    from tqdm import tqdm

    if path == "-":
        f, size, path = contextlib.nullcontext(sys.stdin.buffer), 0, "<stdin>"
    else:
        try:
            size = os.path.getsize(path)
            f = open(path, "rb")
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror})") from None
    seqs, plens, columns, first, first_number = [], [], {}, {}, 0
    prompted = {}  # has a prompt -> (first line number, its format)
    with f as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"reading {os.path.basename(path)}",
                 disable=size < PROGRESS_MIN_BYTES, file=sys.stderr) as bar:
        for number, line in enumerate(f, start=1):
            bar.update(len(line))
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json.loads(line)
            except ValueError as e:
                raise InputError(f"{where}: not valid JSON ({e})") from None
            ids, plen, fields, form = _row_from_line(value, where)
            prompted.setdefault(plen is not None, (number, form))
            if len(prompted) > 1:
                (has, has_form), (lacks, lacks_form) = prompted[True], prompted[False]
                raise InputError(
                    f"{where}: the lines mix formats: line {has} gives {has_form!r} (a prompt) "
                    f"and line {lacks} {lacks_form!r} (no prompt): give every line its prompt "
                    "('prompt' + 'completion', or 'prompt_ids' + 'completion_ids'; false forks "
                    "and groups by prompt need them), or none")
            if not seqs:
                first, first_number = {k: name for k, (name, _) in fields.items()}, number
                columns = {k: [] for k in fields}
            if fields.keys() != first.keys():
                k = next(iter(sorted(fields.keys() ^ first.keys())))
                name = first[k] if k in first else fields[k][0]
                has, lacks = (first_number, number) if k in first else (number, first_number)
                raise InputError(f"{where}: line {has} has {name!r} and line {lacks} has not: "
                                 f"give every line a {name!r}, or none")
            for k, (_, v) in fields.items():
                columns[k].append(v)
            seqs.append(ids)
            plens.append(plen)
    if not seqs:
        raise InputError(f"{path}: no sequences (the file has no non-blank line)")
    return JsonlBatch(seqs, None if None in plens else plens, columns.get("group"),
                 columns.get("rank"), columns.get("micro_batch"), columns.get("pack"),
                 first.get("group"), columns.get(SESSION_FIELD), columns.get(KEYS_FIELD))


# ---------------------------------------------------------------------- writers


def rows_from_trl(prompt_ids, prompt_mask, completion_ids, completion_mask, *, groups=None,
                  rank=None, micro_batch=None, pack=None, keys=None) -> list[dict]:
    """JSON-lines rows for ``treepack stats`` from TRL's batch columns.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts and their real tokens (TRL's
            ``inputs["prompt_ids"]`` / ``["prompt_mask"]``).
        completion_ids, completion_mask: ``[B, C]`` completions and their real tokens.
        groups: ``[B]`` group keys (e.g. ``(first_row + arange(B)) // num_generations`` on
            the generation batch); omitted, ``treepack stats`` groups by identical prompts.
        rank: the process (an int, or ``[B]``).
        micro_batch: the gradient-accumulation micro-batch (an int, or ``[B]``).
        pack: ``[B]`` the pack within the micro-batch (:func:`placement` of its plan).
        keys: B per-token content keys of each row's real tokens, prompt then completion
            (``treepack.hf.Images(...).keys`` for rows with images).

    Returns:
        One dict per row: ``{"prompt_ids": [...], "completion_ids": [...]}`` plus
        ``"group"``, ``"rank"``, ``"micro_batch"``, ``"pack"``, ``"keys"`` where given: write
        each with ``json.dumps`` on its own line.

    Raises:
        ValueError: shapes that do not match, or a per-row field whose length is not B.
    """
    prompts = _unpadded(prompt_ids, prompt_mask, "prompt_ids", "prompt_mask")
    completions = _unpadded(completion_ids, completion_mask, "completion_ids",
                            "completion_mask")
    if len(prompts) != len(completions):
        raise ValueError(f"prompt_ids has {len(prompts)} rows and completion_ids "
                         f"{len(completions)}: give both columns of one batch")
    rows = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(prompts, completions)]
    _with_keys(rows, keys, [len(p) + len(c) for p, c in zip(prompts, completions)])
    return _with_fields(rows, group=groups, rank=rank, micro_batch=micro_batch, pack=pack)


def rows_from_verl(input_ids, uid, *, attention_mask=None, prompt_width=None,
                   prompt_lengths=None, rank=None, micro_batch=None, pack=None, keys=None,
                   session=None) -> list[dict]:
    """JSON-lines rows for ``treepack stats`` from verl's batch.

    Args:
        input_ids: ``[B, S]`` padded (``batch["input_ids"]``, with ``attention_mask``), or
            B 1-D sequences (a nested tensor or a list) of real tokens only.
        uid: ``[B]`` group keys (``non_tensor_batch["uid"]``).
        attention_mask: ``[B, S]`` real tokens of a padded ``input_ids``.
        prompt_width: the prompt columns of a padded ``input_ids``
            (``batch["prompts"].shape[1]``): a row's prompt is its real tokens there.
        prompt_lengths: ``[B]`` prompt tokens of each of the 1-D sequences.
        rank: the data-parallel rank (an int, or ``[B]``).
        micro_batch: the PPO mini-batch on the rank (an int, or ``[B]``).
        pack: ``[B]`` the pack within the mini-batch (:func:`placement` of its plan).
        keys: B per-token content keys of each row's real tokens (rows with images).
        session: ``[B]`` each row's agent session (verl v1's ``{uid}_{session_id}`` of its
            key ``{uid}_{session_id}_{index}``), its turns in order.

    Returns:
        One dict per row: ``{"prompt": [...], "completion": [...], "uid": ...}`` where the
        prompt is known, else ``{"input_ids": [...], "uid": ...}``; plus ``"rank"``,
        ``"micro_batch"``, ``"pack"``, ``"keys"`` and ``"session"`` where given.

    Raises:
        ValueError: a padded ``input_ids`` without ``attention_mask`` or with
            ``prompt_lengths``, 1-D sequences with ``attention_mask`` or ``prompt_width``, or
            lengths that do not match.
    """
    nested = bool(getattr(input_ids, "is_nested", False))
    if not nested and getattr(input_ids, "ndim", None) == 2:
        if attention_mask is None or prompt_lengths is not None:
            raise ValueError("input_ids is a padded [B, S] array: give its attention_mask "
                             "(batch['attention_mask']) and, for the prompt, prompt_width "
                             "(batch['prompts'].shape[1]), not prompt_lengths")
        seqs = _unpadded(input_ids, attention_mask, "input_ids", "attention_mask")
        plen = None if prompt_width is None else \
            _numpy(attention_mask).astype(bool)[:, :int(prompt_width)].sum(1)
    else:
        if attention_mask is not None or prompt_width is not None:
            raise ValueError("input_ids holds 1-D sequences of real tokens: attention_mask and "
                             "prompt_width read a padded [B, S] array; give prompt_lengths")
        seqs = [_numpy(s).reshape(-1).tolist() for s in
                (input_ids.unbind() if nested else input_ids)]
        plen = None if prompt_lengths is None else _numpy(prompt_lengths).reshape(-1)
        if plen is not None and len(plen) != len(seqs):
            raise ValueError(f"prompt_lengths has {len(plen)} values for {len(seqs)} "
                             "sequences: give one per sequence")
    if plen is None:
        rows = [{"input_ids": s} for s in seqs]
    else:
        rows = [{"prompt": s[:p], "completion": s[p:]} for s, p in zip(seqs, plen.tolist())]
    _with_keys(rows, keys, [len(s) for s in seqs])
    return _with_fields(rows, uid=uid, rank=rank, micro_batch=micro_batch, pack=pack,
                        session=session)


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _unpadded(ids, mask, ids_name: str, mask_name: str) -> list[list[int]]:
    from treepack.planning.collation import unpadded  # torch: only when writing

    return [r.tolist() for r in unpadded(ids, mask, ids_name, mask_name)]


def _with_keys(rows: list[dict], keys, lengths: list[int]) -> None:
    """Each row's per-token ``keys`` (one list per row, of its length) added to ``rows``."""
    if keys is None:
        return
    keys = [_numpy(k).reshape(-1).tolist() for k in keys]
    if len(keys) != len(rows) or any(len(k) != n for k, n in zip(keys, lengths)):
        raise ValueError(f"keys must give each of the {len(rows)} rows one key per real token "
                         f"(lengths {lengths[:4]}...), got {[len(k) for k in keys][:4]}...")
    for row, k in zip(rows, keys):
        row["keys"] = k


def _with_fields(rows: list[dict], **fields) -> list[dict]:
    """Per-row fields (a scalar for every row, or one value per row) added to ``rows``."""
    for name, value in fields.items():
        if value is None:
            continue
        values = _numpy(value)
        if values.ndim == 0:
            values = np.full(len(rows), values.item(), dtype=values.dtype)
        if values.ndim != 1 or values.shape[0] != len(rows):
            raise ValueError(f"{name} has shape {values.shape} for {len(rows)} rows: give one "
                             "value, or one per row")
        for row, v in zip(rows, values.tolist()):
            row[name] = v
    return rows
