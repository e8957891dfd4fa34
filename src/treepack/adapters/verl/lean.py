"""verl with tree packing and the lean head, switched on by one line of verl config::

    actor_rollout_ref.model.external_lib=treepack.verl_lean

Importing this module installs treepack in verl (:func:`treepack.adapters.verl.install`) with
:class:`treepack.verl.TreepackLeanEngine` as verl's FSDP / FSDP2 language-model engine:
:mod:`treepack.verl`'s engine, with log-probs and entropies computed from hidden states inside
the model's forward, so the ``[T', V]`` logits of a micro-batch never exist
(docs/integrations.md, "verl").
"""

from treepack.adapters.verl.fsdp_engine import TreepackLeanEngine
from treepack.adapters.verl.install import install

__all__ = ["TreepackLeanEngine"]

install(engine=TreepackLeanEngine)
