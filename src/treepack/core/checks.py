"""Argument checks shared by the whole package (core: imports nothing else of treepack).

Each raises ``ValueError`` (``TypeError`` where a sequence of the batch is of the wrong type)
with a message that names the argument, the value, the rule and, where one exists, the fix:
the numbers of :func:`positive_int` and friends, and the batch a pack is built from
(:func:`validate_sequences`, :func:`validate_keys`, :func:`sequence_indices`).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

__all__ = ["positive_int", "positive_finite", "temperature", "floating", "MIN_TEMPERATURE",
           "validate_sequences", "validate_keys", "sequence_indices", "pack_device"]


def positive_int(value, name: str, *, hint: str = "", maximum: int | None = None) -> int:
    """``value`` as an int >= 1 (Python or numpy integers; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int{hint}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is more than {maximum:,}{hint}")
    return int(value)


def positive_finite(value, name: str, *, hint: str = "", minimum: float = 0.0) -> float:
    """``value`` (a real number, or a one-element real tensor) as a finite float > 0 and at
    least ``minimum``."""
    if isinstance(value, Tensor) and value.numel() == 1 and (
            value.dtype.is_floating_point or value.dtype in _INTEGER_DTYPES):
        value = value.item()  # a host read: call it outside hot loops
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0{hint}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} is below {minimum:g}{hint}")
    return float(value)


_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MIN_TEMPERATURE = 1e-6  # logits / t overflows float32 (and gives NaN) for t near 1e-38


def temperature(value) -> float:
    """A sampling temperature as a float: finite, > 0 and at least :data:`MIN_TEMPERATURE`."""
    return positive_finite(value, "temperature", minimum=MIN_TEMPERATURE,
                           hint=": dividing logits by it must stay finite in float32 (for "
                                "greedy decoding take the argmax instead of log-probs)")


def floating(x: Tensor, name: str) -> None:
    """Refuse a tensor that is not real floating point (ints, bools, complex)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {x.dtype}; it must be a real floating-point tensor "
                        "(float32, bfloat16, ...)")
    if x.dtype == torch.float8_e4m3fn or x.dtype == torch.float8_e5m2:
        raise TypeError(f"{name} has dtype {x.dtype}; cast it to bfloat16 or float32 first")


# ------------------------------------------------ sequences, keys and indices of a batch

def sequence_indices(seq_ids, n: int) -> np.ndarray:
    """``seq_ids`` (each sequence's index in the caller's batch; None: ``0 .. n-1``) as n
    int64s."""
    if seq_ids is None:
        return np.arange(n, dtype=np.int64)
    out = np.asarray(seq_ids.cpu() if isinstance(seq_ids, Tensor) else seq_ids)
    if out.shape != (n,) or (n and out.dtype.kind not in "iu"):
        raise ValueError(f"seq_ids must be {n} integers, one per sequence; got shape "
                         f"{out.shape} of {out.dtype}")
    if n and out.dtype == np.uint64 and out.max() > np.iinfo(np.int64).max:
        raise ValueError(f"seq_ids holds {out.max()}, beyond int64: use indices into your batch")
    return out.astype(np.int64, copy=False)


def validate_keys(keys, ids: list[np.ndarray]) -> list[np.ndarray]:
    """Per-token content keys as int64 arrays, one per sequence and of its length (raises
    naming the sequence, the value and the fix)."""
    if isinstance(keys, (Tensor, np.ndarray)):
        raise TypeError("keys must be a list with one key sequence per sequence (a "
                        f"{type(keys).__name__} was given)")
    keys = list(keys)
    if len(keys) != len(ids):
        raise ValueError(f"keys has {len(keys)} sequences for {len(ids)} sequences: give one "
                         "key sequence per sequence (zeros where no token has a key)")
    out = []
    for i, (k, seq) in enumerate(zip(keys, ids)):
        arr = k.detach().cpu().numpy() if isinstance(k, Tensor) else np.asarray(k)
        if arr.ndim != 1 or arr.shape[0] != seq.shape[0]:
            raise ValueError(f"keys[{i}] has shape {tuple(arr.shape)} but sequence {i} has "
                             f"{seq.shape[0]} tokens: one key per token (0 for none)")
        if arr.shape[0] and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"keys[{i}] has dtype {arr.dtype}; keys must be integers (e.g. "
                            "a 63-bit hash of an image's pixels and grid)")
        out.append(arr.astype(np.int64))
    return out


def validate_routes(routes, ids: list[np.ndarray]) -> list[np.ndarray]:
    """Per-token routed experts as integer arrays, one ``[len, layers, topk]`` per sequence of
    its length, every one of the same ``[layers, topk]`` (raises naming the sequence, the
    value and the fix). A layer's top-k of -1 throughout: no recorded route, the router routes
    that token itself (verl's replay mask). Each sequence's last route is a placeholder and
    may hold anything."""
    if isinstance(routes, (Tensor, np.ndarray)):
        raise TypeError("routes must be a list with one [len, layers, topk] array per sequence "
                        f"(a {type(routes).__name__} was given: split a padded batch per "
                        "sequence, e.g. [r[:n] for r, n in zip(routes, lengths)])")
    routes = list(routes)
    if len(routes) != len(ids):
        raise ValueError(f"routes has {len(routes)} entries for {len(ids)} sequences: give one "
                         "[len, layers, topk] array per sequence")
    out, shape = [], None
    for i, (r, seq) in enumerate(zip(routes, ids)):
        arr = r.detach().cpu().numpy() if isinstance(r, Tensor) else np.asarray(r)
        if arr.ndim != 3 or arr.shape[0] != seq.shape[0]:
            raise ValueError(f"routes[{i}] has shape {tuple(arr.shape)} but sequence {i} has "
                             f"{seq.shape[0]} tokens: one [layers, topk] route per token, "
                             "[len, layers, topk] (the last token's a placeholder)")
        if shape is None:
            shape = arr.shape[1:]
        elif arr.shape[1:] != shape:
            raise ValueError(f"routes[{i}] has [layers, topk] = {list(arr.shape[1:])} but "
                             f"routes[0] has {list(shape)}: every token is routed by the same "
                             "MoE layers to the same number of experts")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"routes[{i}] has dtype {arr.dtype}; routes are expert indices "
                            "(integers, e.g. verl's int16 routed_experts)")
        inner = arr[:-1]
        if inner.min(initial=0) < -1:
            raise ValueError(f"routes[{i}] holds expert index {int(inner.min())} before its "
                             "last token: an expert index is >= 0, or -1 throughout a layer's "
                             "top-k where no route was recorded")
        native = inner == -1
        mixed = native.any(-1) & ~native.all(-1)  # [len - 1, layers]
        if mixed.any():
            t, layer = (int(x[0]) for x in np.nonzero(mixed))
            raise ValueError(f"routes[{i}][{t}, {layer}] is {inner[t, layer].tolist()}: a "
                             "layer's top-k is recorded (every entry an expert) or not (-1 "
                             "throughout: the router routes the token itself)")
        out.append(arr)
    dtype = np.result_type(*(a.dtype for a in out)) if out else np.int64
    return [a.astype(dtype, copy=False) for a in out]


def validate_sequences(sequences) -> list[np.ndarray]:
    """The input sequences as 1-D int64 numpy arrays, after the checks of
    :meth:`TreePack.from_sequences` (raises naming the sequence, the value and the fix)."""
    if isinstance(sequences, (Tensor, np.ndarray)) and sequences.ndim == 1:
        raise TypeError(
            f"sequences is one 1-D {type(sequences).__name__}; pass a list of sequences, e.g. "
            "[ids] for a single one"
        )
    if isinstance(sequences, (Tensor, np.ndarray)) and sequences.ndim != 1:
        raise TypeError(
            f"sequences is a {sequences.ndim}-D {type(sequences).__name__}; pass a list of "
            "1-D sequences (a padded batch would merge its padding into the tree: strip it "
            "first, e.g. [ids[m.bool()] for ids, m in zip(input_ids, attention_mask)])"
        )
    try:
        sequences = list(sequences)
    except TypeError:
        raise TypeError(
            f"sequences must be a list of token-id sequences, got {type(sequences).__name__}"
        ) from None
    if not sequences:
        raise ValueError("sequences is empty: a TreePack needs at least one sequence")
    out = []
    for i, seq in enumerate(sequences):
        if isinstance(seq, Tensor):
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(
                    f"sequence {i} has dtype {seq.dtype}; token ids must be an integer "
                    "tensor (e.g. torch.long)"
                )
            arr = seq.detach().cpu().numpy()
        else:
            if isinstance(seq, (list, tuple)) and bool in set(map(type, seq)):
                at = list(map(type, seq)).index(bool)  # C-level scans, only on failure
                raise TypeError(f"sequence {i} holds {seq[at]!r} at position {at}; token ids "
                                "must be integers, not True / False")
            arr = np.asarray(seq)
        if isinstance(seq, (str, bytes)):
            raise TypeError(
                f"sequence {i} is text ({seq[:40]!r}), not token ids: tokenize it first, e.g. "
                "tokenizer(texts)['input_ids'], and pass the lists of ids"
            )
        if arr.ndim == 0:
            raise TypeError(
                f"sequence {i} is a single value ({arr.item()!r}), not a sequence; pass a list "
                "of sequences, e.g. [[1, 2, 3]] rather than [1, 2, 3]"
            )
        if arr.ndim != 1:
            raise ValueError(
                f"sequence {i} has shape {tuple(arr.shape)}; each sequence must be 1-D"
            )
        if arr.size == 0:
            raise ValueError(
                f"sequence {i} is empty; every sequence needs at least one token (drop it "
                "before packing)"
            )
        if arr.dtype.kind not in "iu":  # the failure path only: loops over tokens are fine
            if isinstance(seq, (list, tuple)):
                bad = next(((j, x) for j, x in enumerate(seq) if not isinstance(x, int)), None)
                if bad is None:  # Python ints numpy could not hold as int64
                    raise ValueError(f"sequence {i} has a token id {max(seq, key=abs)} beyond "
                                     "int64")
                if arr.dtype == object:  # mixed Python values: name the first odd one
                    raise TypeError(f"sequence {i} holds {bad[1]!r} at position {bad[0]}; "
                                    "token ids must be integers")
            raise TypeError(
                f"sequence {i} has dtype {arr.dtype} (first value {arr[0]!r}); token ids "
                "must be integers"
            )
        if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
            raise ValueError(f"sequence {i} has a token id {arr.max()} beyond int64")
        out.append(arr.astype(np.int64, copy=False))
    flat = np.concatenate(out)
    if flat.min() < 0:  # one pass over all tokens; find the culprit only on failure
        at = int(np.argmax(flat < 0))
        ends = np.cumsum([a.shape[0] for a in out])
        i = int(np.searchsorted(ends, at, side="right"))
        where = at - (int(ends[i - 1]) if i else 0)
        raise ValueError(
            f"sequence {i} has a negative token id {flat[at]} at position {where}; ids must "
            "be >= 0 (strip padding / ignore-index values such as -100 first)"
        )
    return out


def pack_device(device, rest=(), options=None) -> torch.device:
    """``device`` (the arguments of :meth:`TreePack.to`) as a :class:`torch.device`, refusing
    what ``Tensor.to`` would take as a dtype, a tensor or options."""
    options = options or {}
    call = ", ".join([repr(device), *map(repr, rest), *(f"{k}={v!r}" for k, v in options.items())])
    rule = (f"TreePack.to({call}): a pack holds integer tables (ids, rows, depths) that must "
            "keep their dtypes, and .to takes a device alone")
    if isinstance(device, torch.dtype) or rest or options:
        raise TypeError(f"{rule}; pass only the device, e.g. pack.to('cuda') (cast the model, "
                        "not the pack, to change precision)")
    if isinstance(device, (torch.device, str)) or (
            isinstance(device, int) and not isinstance(device, bool)):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise TypeError(f"{rule}; {device!r} is not a device name ({exc}): pass one such "
                            "as 'cpu', 'cuda' or 'cuda:1'") from None
    raise TypeError(f"{rule}; got {type(device).__name__}: pass a torch.device, its name or a "
                    "CUDA index (for a tensor's device, pack.to(tensor.device))")
