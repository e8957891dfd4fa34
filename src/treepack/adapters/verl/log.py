"""The verl adapter's log: logger ``treepack.verl``, each message once per process."""

from __future__ import annotations

import logging

__all__ = ["log", "say_once"]

log = logging.getLogger("treepack.verl")
_SAID: set[str] = set()


def say_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` (logger ``treepack.verl``) the first time it comes, in this process."""
    if message not in _SAID:
        _SAID.add(message)
        log.log(level, "treepack: %s", message)
