"""What each adapter's compat module checks when it installs: that the framework symbols it
replaces, wraps or reads are where it was written against (core: imports nothing).

A framework release that moves one of them should fail at install, naming the symbol, the
installed version and the one treepack was written against, not later as an
``AttributeError`` inside a training step (or, worse, as a patch that no longer reaches the
code it meant to replace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

__all__ = ["moved", "require", "replaced", "mixed_in"]


def moved(symbols: Iterable[tuple[str, object, str]]) -> list[str]:
    """The names among ``symbols`` (``(name, owner, dotted attribute path)``) whose path no
    longer resolves on its owner."""
    gone = []
    for name, owner, path in symbols:
        value = owner
        for part in path.split("."):
            value = getattr(value, part, _MISSING)
            if value is _MISSING:
                gone.append(name)
                break
    return gone


def require(framework: str, installed: str, written_against: str,
            symbols: Iterable[tuple[str, object, str]]) -> None:
    """Raise ``ImportError`` naming every symbol of ``symbols`` that moved.

    Args:
        framework: the framework's name as users install it (``"TRL"``, ``"verl"``).
        installed: its installed version.
        written_against: the version the adapter was written against.
        symbols: ``(name, owner, dotted attribute path)``: e.g.
            ``("trl.GRPOTrainer._prepare_inputs", GRPOTrainer, "_prepare_inputs")``.
    """
    gone = moved(symbols)
    if gone:
        raise ImportError(
            f"{framework} {installed} has no {', '.join(gone)}: treepack's {framework} adapter "
            f"was written against {framework} {written_against} and replaces or reads "
            f"{'them' if len(gone) > 1 else 'it'}. Install {framework} {written_against} "
            "(or a release that still has them), or a treepack written for this one")


_MISSING = object()


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """While it lasts, ``owner.name`` is ``value`` (an instance attribute: a module's
    ``forward`` for one call, say); then exactly what was there again (nothing, where the
    attribute came from the class)."""
    saved = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


_MIXED: dict[tuple, type] = {}


def mixed_in(instance, mixin: type, **attrs) -> None:
    """Give ``instance`` the subclass of its class with ``mixin`` first (``attrs`` its class
    attributes), made once per class, mixin and attributes: how the adapters give one built
    module of a framework new methods without touching the framework's class. Nothing where
    its class has ``mixin`` already."""
    cls = type(instance)
    if issubclass(cls, mixin):
        return
    key = (cls, mixin, tuple(sorted(attrs.items())))
    if key not in _MIXED:
        _MIXED[key] = type(f"Tree{cls.__name__}", (mixin, cls), attrs)
    instance.__class__ = _MIXED[key]
