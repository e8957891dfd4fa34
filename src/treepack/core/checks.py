"""Argument checks shared by the whole package (core: imports nothing else of treepack).

Each raises ``ValueError`` (wrong types included, as the library always has) with a message
that names the argument, the value, the rule and, where one exists, the fix.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["positive_int", "positive_finite", "temperature", "floating", "MIN_TEMPERATURE"]


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
