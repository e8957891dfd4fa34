"""Switching verl over to tree packing: one explicit, idempotent :func:`install`, which
importing :mod:`treepack.verl` (verl's ``external_lib``) or :mod:`treepack.verl_lean` calls.
"""

from __future__ import annotations

import importlib.util

from treepack.adapters.verl import compat, trainer
from treepack.adapters.verl.fsdp_engine import TreepackEngine, register

__all__ = ["install", "register_megatron"]


def install(engine: type = TreepackEngine, devices=("cuda", "npu")) -> None:
    """Make ``engine`` verl's FSDP / FSDP2 language-model engine (:func:`register`), where
    megatron-core is installed treepack's Megatron engine verl's Megatron one
    (:func:`register_megatron`), and put the group-keeping batch balance on verl's trainers
    (:func:`treepack.verl_trainer.install`). Calling it again changes nothing but the engine.

    Args:
        engine: :class:`TreepackEngine` (``treepack.verl``) or
            :class:`~treepack.verl.TreepackLeanEngine` (``treepack.verl_lean``).
        devices: device names to register for, besides those the stock engines hold.

    Raises:
        ImportError: the installed verl lacks a symbol treepack replaces or reads (named).
    """
    compat.check()
    register(devices, engine)
    register_megatron(devices)
    trainer.install()


def register_megatron(devices=("cuda", "npu")) -> bool:
    """Make :class:`treepack.verl_megatron.TreepackMegatronEngine` verl's Megatron
    language-model engine (``strategy=megatron``), where megatron-core is installed.
    :func:`install` does it.

    Args:
        devices: device names to register for, besides those the stock engine holds.

    Returns:
        Whether megatron-core was found (and the engine registered).
    """
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(
            "megatron.core") is None:
        return False
    from treepack.adapters.verl import megatron_engine

    megatron_engine.register(devices)
    return True
