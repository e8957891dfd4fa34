"""``TreepackGRPOTrainer``: a ``trl.GRPOTrainer`` built already patched (:func:`.patch.patch`),
which also takes a model object built in memory with ``beta > 0``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

from treepack.adapters.trl.compat import (GRPOTrainer, get_config_model_id, grpo_trainer,
                                          is_peft_model)
from treepack.adapters.trl.patch import patch
from treepack.adapters.trl.seam import _get_per_token_logps_and_entropies

__all__ = ["TreepackGRPOTrainer"]


@contextlib.contextmanager
def _reference_from_object(model, config, peft_config):
    """TRL (``beta != 0``) loads its reference model from the policy config's
    ``_name_or_path``; a model built in memory has none, and TRL's load fails (``Repo id must
    use alphanumeric chars``). Inside this context that load returns a copy of the model
    object, taken before TRL touches it: the policy's starting weights, as a load of a saved
    checkpoint of it gives. A model with a path, a PEFT model (TRL disables the adapter
    instead) or ``beta == 0`` leave TRL as it is."""
    if (isinstance(model, str) or config is None or config.beta == 0.0 or peft_config is not None
            or is_peft_model(model) or get_config_model_id(model.config)):
        yield
        return
    reference = copy.deepcopy(model).eval()  # from_pretrained gives a model in eval mode
    original = grpo_trainer.create_model_from_path

    def create_model_from_path(model_id, *args, **kwargs):
        return reference if model_id == "" else original(model_id, *args, **kwargs)

    grpo_trainer.create_model_from_path = create_model_from_path
    try:  # only while TRL builds the trainer
        yield
    finally:
        grpo_trainer.create_model_from_path = original


class TreepackGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs come from packed forwards
    (:func:`patch`).

    Extra keyword arguments: ``treepack_backend`` ('auto', 'varlen', 'segment', 'flex', 'dense'),
    ``treepack_max_tokens`` (rows per forward; default: the whole batch in one pack) and
    ``treepack_pad_to_multiple_of``. A model object built in memory (no path in its config)
    works with ``beta > 0`` too: the reference model is a copy of it as given, where stock TRL
    cannot load one.
    """

    _get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies

    def __init__(self, *args, treepack_backend: str = "auto",
                 treepack_max_tokens: int | None = None,
                 treepack_pad_to_multiple_of: int | None = None, **kwargs):
        given = inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs)
        with _reference_from_object(given.arguments.get("model"), given.arguments.get("args"),
                                    given.arguments.get("peft_config")):
            super().__init__(*args, **kwargs)
        patch(self, backend=treepack_backend, max_tokens=treepack_max_tokens,
              pad_to_multiple_of=treepack_pad_to_multiple_of)
