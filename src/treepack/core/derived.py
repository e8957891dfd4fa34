"""Structures derived from a pack, built once per pack: the one cache every plan, block mask
and index table of treepack goes through.

The cache is this module's: a pack knows nothing of it. Each pack's entries live as long as
the pack (a weak key), and a pack moved with :meth:`TreePack.to` is a new pack, so its
structures are built again on its device.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["derived_from_pack", "cached"]

R = TypeVar("R")

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pack -> {key: structure}


def cached(pack, key, build: Callable[[], R]) -> R:
    """``build()``, computed once per ``pack`` and ``key``.

    Built outside inference mode: a pack first used to score under
    ``torch.inference_mode()`` must still train afterwards, and inference tensors cannot be
    saved for backward.
    """
    entries = _CACHE.setdefault(pack, {})
    if key not in entries:
        with torch.inference_mode(False):
            entries[key] = build()
    return entries[key]


def derived_from_pack(build: Callable[..., R]) -> Callable[..., R]:
    """Decorator: ``build(pack, *args)`` runs once per pack, device and ``args``; later calls
    return the same object. Arguments are keyed by value (a tensor by identity: pass plain
    values, or cache per tensor elsewhere).

    Every structure derived from a pack (attention plans, block masks, edge lists) is one
    such function, its only accessor: the cache key is the function itself plus its
    arguments, never a tuple spelled out elsewhere.
    """

    signature = inspect.signature(build)

    @functools.wraps(build)
    def wrapper(pack, *args, **kwargs):
        bound = signature.bind(pack, *args, **kwargs)
        bound.apply_defaults()  # one key however the arguments were spelled
        values = tuple(bound.arguments.values())[1:]
        return cached(pack, (build.__module__, build.__qualname__, *values),
                      lambda: build(pack, *values))

    return wrapper
