"""Structures derived from a pack, built once per pack: the one cache every plan, block mask
and index table of treepack goes through."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # annotations only: tree.py imports this module
    from treepack.core.tree import TreePack

__all__ = ["derived_from_pack"]

R = TypeVar("R")


def derived_from_pack(build: Callable[..., R]) -> Callable[..., R]:
    """Decorator: ``build(pack, *args)`` runs once per pack, device and ``args``; later calls
    return the same object.

    Every structure derived from a pack (attention plans, block masks, edge lists) is one
    such function, its only accessor: the cache key is the function itself plus its
    arguments, never a tuple spelled out elsewhere. :meth:`TreePack.to` starts a new cache.
    """

    signature = inspect.signature(build)

    @functools.wraps(build)
    def cached(pack: TreePack, *args, **kwargs):
        bound = signature.bind(pack, *args, **kwargs)
        bound.apply_defaults()  # one key however the arguments were spelled
        values = tuple(bound.arguments.values())[1:]
        return pack.derived((build.__module__, build.__qualname__, *values),
                            lambda: build(pack, *values))

    return cached
