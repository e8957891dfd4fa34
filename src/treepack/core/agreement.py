"""Every rank of a group agrees, or every rank refuses: one all-gather before the first
collective.

The ranks of a sequence-parallel (or context-parallel) group each compute a share of one
forward, so they must be given the same pack, make the same call with the same arguments, and
each accept them. What goes wrong otherwise depends on what differs:

- a rank that refuses while the others go on leaves them waiting in the first exchange (a
  hang until the process group's timeout);
- ranks that disagree on something that sizes an exchange (a parts budget, recomputation,
  the call) abort inside it;
- ranks that disagree on something that does not (a temperature, the alignment, the weights,
  a parts budget that happens to cut parts of equal widths) return, without a word, a mix of
  each rank's rows computed its own way.

:func:`agreement` is the one check. Inside its block each rank runs its own checks and names
the fields that must agree; on leaving it, one all-gather of ``[refused, digest of every
field]`` over the group. Only when something is wrong does a second gather (of each rank's
field summaries, or its refusal) run, and then every rank raises: the refusing rank its own
error, the others the same type naming that rank and its message; on a disagreement, every
rank a :class:`Disagreement` that names each differing field and its value on every rank.

A digest is :func:`fingerprint`: a blake2b hash of a value's type and contents, the same in
every process (Python's ``hash`` of a string is not). :func:`parameters_fingerprint` adds a
model's weights, computed once per module.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from treepack.core.derived import derived_from_pack

__all__ = ["agreement", "Disagreement", "Label", "fingerprint", "parameters_fingerprint",
           "collective_device", "PackIdentity", "pack_identity"]

# Tensors up to this many elements are hashed by their bytes; larger ones by their shape,
# dtype, sum and norm (one reduction on their device): a keyword tensor can be large.
_BYTES_UP_TO = 1 << 16


class Disagreement(ValueError):
    """The ranks of a group were given different packs or arguments."""


class Label(str):
    """A field's value that messages show as it is, without quotes (a checksum)."""

    def __repr__(self) -> str:
        return str(self)


def fingerprint(value) -> int:
    """A 63-bit digest of ``value``, equal in every process exactly where the values are equal:
    ints, floats, strings, bools and None by type and value (``1`` and ``"1"`` differ),
    sequences and dicts element by element, arrays and tensors by dtype, shape and contents,
    dtypes and devices by name, anything else by its type's name."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, value)
    return int.from_bytes(digest.digest(), "little") >> 1


def _feed(digest, value) -> None:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}[{len(value)}](".encode())
        for v in value:
            _feed(digest, v)
        digest.update(b")")
    elif isinstance(value, dict):
        digest.update(f"dict[{len(value)}](".encode())
        for k in sorted(value, key=repr):
            _feed(digest, k)
            _feed(digest, value[k])
        digest.update(b")")
    elif isinstance(value, np.ndarray):
        digest.update(f"array:{value.dtype}:{value.shape};".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Tensor):
        t = value.detach()
        digest.update(f"tensor:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel() <= _BYTES_UP_TO:
            digest.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            summary = torch.stack([t.sum(dtype=torch.float64),
                                   torch.linalg.vector_norm(t, dtype=torch.float64)])
            digest.update(summary.cpu().numpy().tobytes())
    elif isinstance(value, (torch.dtype, torch.device)):
        digest.update(f"{type(value).__name__}:{value};".encode())
    else:
        digest.update(f"object:{type(value).__module__}.{type(value).__qualname__};".encode())


_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def parameters_fingerprint(module: torch.nn.Module) -> int | str:
    """A digest of ``module``'s parameters (each one's float64 sum and norm), computed the
    first time per module and remembered: the ranks of a group hold the same weights when
    they first meet. ``"sharded"`` where the parameters are shards that differ between ranks
    by design (FSDP2's DTensors, FSDP1's flat parameters, DeepSpeed ZeRO-3's partitions):
    their wrapper made them from one set of weights."""
    if module not in _PARAMETERS:
        _PARAMETERS[module] = _parameters_digest(module)
    return _PARAMETERS[module]


def _parameters_digest(module: torch.nn.Module) -> int | str:
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    if any(isinstance(p, DTensor) or hasattr(p, "ds_id") or hasattr(p, "_is_flat_param")
           or type(p).__name__ == "FlatParameter" for p in params) or any(
            type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        return "sharded"
    if not params:
        return 0
    summary = torch.stack([torch.stack([p.detach().sum(dtype=torch.float64),
                                        torch.linalg.vector_norm(p.detach(), dtype=torch.float64)])
                           .to(params[0].device) for p in params])
    return fingerprint(summary.cpu().numpy())


class PackIdentity(NamedTuple):
    """A pack as the ranks of a group compare it: its rows and a digest of its contents."""

    rows: int
    digest: int

    def __repr__(self) -> str:
        return f"{self.rows} rows"


@derived_from_pack
def pack_identity(pack) -> PackIdentity:
    """The pack's rows and a digest of its ids, structure, layout, content keys and routes
    (once per pack)."""
    h = pack.host
    return PackIdentity(pack.num_rows, fingerprint(
        [h.input_ids, h.parent_row, h.position_ids, h.rows, h.row_keys, h.row_routes]))


def collective_device(group) -> torch.device:
    """Where a small tensor for a collective on ``group`` lives: the CPU for gloo, else the
    current CUDA device (NCCL)."""
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def agreement(group, what: str = "group", hints: dict | None = None):
    """Inside: this rank's own checks, filling the yielded dict with the fields that must
    agree. On leaving: every rank agrees, or every rank raises (module doc).

    Args:
        group: a ``torch.distributed`` process group (None: no group, nothing to agree on; the
            block's errors pass through).
        what: the group's name in the messages (``"sequence_parallel group"``).
        hints: what to do when a field differs, per field name (``{"pack": "give every rank
            the same batch"}``); a general one otherwise.

    Yields:
        A dict to fill with ``name: value`` (anything :func:`fingerprint` takes).

    Raises:
        Disagreement: the ranks' fields differ (on every rank).
        The block's exception: on the rank whose check failed; on every other rank the same
            type (a ``RuntimeError`` where that type cannot be rebuilt from a message), naming
            the rank and its message.
    """
    fields: dict = {}
    if group is None:
        yield fields
        return
    refusal = None
    try:
        yield fields
    except Exception as e:  # noqa: BLE001 - joined below, then raised on every rank
        refusal = e
    _settle(group, what, fields, refusal, hints or {})


def _settle(group, what: str, fields: dict, refusal: Exception | None, hints: dict) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    digest = 0 if refusal is not None else fingerprint(fields)
    mine = torch.tensor([int(refusal is not None), digest], dtype=torch.int64,
                        device=collective_device(group))
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every).cpu()
    refused = every[:, 0].nonzero().flatten().tolist()
    if refused:
        said = [None] * size
        mine_said = None if refusal is None else (
            type(refusal).__module__, type(refusal).__qualname__, str(refusal))
        dist.all_gather_object(said, mine_said, group=group)
        if refusal is not None:
            raise refusal
        first = refused[0]
        module, name, message = said[first]
        text = (f"rank {first} of the {what} refused this call, so every rank of it does "
                f"(ranks {refused} refused): {name}: {message}")
        raise _rebuilt(module, name, text)
    if (every[:, 1] == every[0, 1]).all():
        return
    summaries = [None] * size
    dist.all_gather_object(summaries, {k: (fingerprint(v), _show(v)) for k, v in fields.items()},
                           group=group)
    raise Disagreement(_disagreement(what, summaries, hints))


def _rebuilt(module: str, name: str, text: str) -> Exception:
    """The exception type ``module.name`` with message ``text`` (a ``RuntimeError`` where the
    type cannot be found or built from a message), so that a caller catching the refusing
    rank's type (an adapter falling back to a stock path) catches it on every rank."""
    import importlib

    try:
        kind = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
        if isinstance(kind, type) and issubclass(kind, Exception):
            return kind(text)
    except Exception:  # noqa: BLE001 - a type that takes other arguments, or none found
        pass
    return RuntimeError(text)


def _disagreement(what: str, summaries: list[dict], hints: dict) -> str:
    names = list(dict.fromkeys(k for s in summaries for k in s))
    differ = {}
    for name in names:
        values = [s.get(name, (None, "(not given)")) for s in summaries]
        if len({v[0] for v in values}) > 1:
            shown = ", ".join(f"rank {r}: {v[1]}" for r, v in enumerate(values))
            if len({v[1] for v in values}) == 1:
                shown += "; alike in size, different in contents or order"
            differ[name] = shown
    if "call" in differ:  # the other fields follow from the call
        differ = {"call": differ["call"]}
    if not differ:  # summaries that agree where the digests did not: another field order
        return f"the ranks of the {what} disagree on the order of their fields {names}"
    lines = [f"{name} ({shown})" for name, shown in differ.items()]
    advice = [hints[name] for name in differ if name in hints]
    if len(advice) < len(differ):
        advice.append("every rank of the group must make the same call with the same "
                      "arguments")
    return f"the ranks of the {what} disagree on {', '.join(lines)}: {'; '.join(advice)}"


def _show(value, limit: int = 80) -> str:
    """A short description of a field's value for a message."""
    if isinstance(value, Tensor):
        if value.numel() <= 8:
            return f"tensor({value.detach().cpu().tolist()})"
        return f"tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, np.ndarray):
        if value.size and (value == value.flat[0]).all():
            return f"{value.flat[0].item()!r} for each of {value.size}"
        if value.size <= 8:
            return repr(value.tolist())
        return f"array of shape {value.shape} ({value.dtype})"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
