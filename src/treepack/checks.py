"""Argument checks shared by the whole package (core: imports nothing else of treepack).

Each raises ``ValueError`` (wrong types included, as the library always has) with a message
that names the argument, the value, the rule and, where one exists, the fix.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["positive_int", "positive_finite", "floating"]


def positive_int(value, name: str, *, hint: str = "", maximum: int | None = None) -> int:
    """``value`` as an int >= 1 (Python or numpy integers; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int{hint}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is more than {maximum:,}{hint}")
    return int(value)


def positive_finite(value, name: str, *, hint: str = "") -> float:
    """``value`` as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0{hint}")
    return float(value)


def floating(x: Tensor, name: str) -> None:
    """Refuse a tensor that is not real floating point (ints, bools, complex)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {x.dtype}; it must be a real floating-point tensor "
                        "(float32, bfloat16, ...)")
    if x.dtype == torch.float8_e4m3fn or x.dtype == torch.float8_e5m2:
        raise TypeError(f"{name} has dtype {x.dtype}; cast it to bfloat16 or float32 first")
