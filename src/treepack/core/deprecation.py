"""The one deprecation policy of treepack.

A renamed or replaced public name keeps working until :data:`REMOVED_IN`. Each use warns with
a ``FutureWarning`` (shown to users by Python's default filters, once per call site) naming
the replacement and that release. docs/api.md lists every deprecated name.
"""

from __future__ import annotations

import warnings

__all__ = ["warn", "REMOVED_IN"]

REMOVED_IN = "0.3.0"


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``.

    Args:
        old: what the caller used (``"hf.forward_lean"``).
        new: what to use instead (``"hf.logprobs(model, pack, head='inside')"``).
        stacklevel: frames up to the user's call (3: the caller of the deprecated function).
    """
    warnings.warn(f"{old} is deprecated and goes in treepack {REMOVED_IN}: use {new}",
                  FutureWarning, stacklevel=stacklevel)
