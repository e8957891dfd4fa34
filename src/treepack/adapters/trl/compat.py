"""Every access treepack makes to TRL (and accelerate) beyond their documented API, in one
place.

Written against TRL 1.16 (``treepack[trl]`` allows ``>= 1.16, < 2``; the suite installs the
newest). :func:`check` runs when a trainer is patched and names any of these that moved.

Replaced, on the patched trainer instance (:func:`treepack.trl.patch`) or its class
(``TreepackGRPOTrainer``):

- ``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
  logits_to_keep, batch_size=None, compute_entropy=False, compute_aux_loss=False, **extra)``:
  the log-prob seam (:mod:`.seam`), wrapped in ``trl.extras.profiling.profiling_decorator``
  so TRL's timer reports it under the same name.
- ``GRPOTrainer._prepare_inputs`` and ``GRPOTrainer._compute_loss``: wrapped (the original
  kept on the instance as ``_treepack_prepare_inputs`` / ``_treepack_compute_loss``).
- ``trl.trainer.grpo_trainer.shuffle_sequence_dict``: swapped for the group-keeping shuffle
  for the length of one ``_prepare_inputs`` call (:mod:`.shuffle`).
- ``trl.trainer.grpo_trainer.create_model_from_path``: swapped while ``TreepackGRPOTrainer``
  builds, so a model built in memory serves as its own reference (:mod:`.trainer`).

Read on the trainer: ``args`` (``steps_per_generation``, ``gradient_accumulation_steps``,
``per_device_train_batch_size``, ``entropy_target``, ``cast_lm_head_to_fp32``),
``num_generations``, ``loss_type``, ``top_entropy_quantile``, ``entropy_coef``,
``use_adaptive_entropy``, ``_last_world_entropy``, ``aux_loss_enabled``,
``router_aux_loss_coef``, ``temperature``, ``current_gradient_accumulation_steps``,
``accelerator`` (``autocast``, ``reduce``, ``sync_gradients``, ``num_processes``, ``device``)
and ``_metrics["train"]`` (where treepack's sharing metrics are logged). Also
``trl.trainer.utils.get_config_model_id`` and ``accelerate.utils.is_peft_model``.
"""

from __future__ import annotations

try:
    import trl
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.extras.profiling import profiling_decorator
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import get_config_model_id
except ImportError as e:  # pragma: no cover - exercised only without trl
    raise ImportError("treepack.trl needs TRL: pip install trl") from e

from treepack.core.compat import require

__all__ = ["WRITTEN_AGAINST", "check", "GRPOTrainer", "grpo_trainer", "profiling_decorator",
           "get_config_model_id", "is_peft_model"]

WRITTEN_AGAINST = "1.16"

SYMBOLS = (  # (name, owner, attribute path): what treepack replaces or swaps
    ("trl.GRPOTrainer._get_per_token_logps_and_entropies", GRPOTrainer,
     "_get_per_token_logps_and_entropies"),
    ("trl.GRPOTrainer._prepare_inputs", GRPOTrainer, "_prepare_inputs"),
    ("trl.GRPOTrainer._compute_loss", GRPOTrainer, "_compute_loss"),
    ("trl.trainer.grpo_trainer.shuffle_sequence_dict", grpo_trainer, "shuffle_sequence_dict"),
    ("trl.trainer.grpo_trainer.create_model_from_path", grpo_trainer, "create_model_from_path"),
)


def check() -> None:
    """Raise ``ImportError`` naming the TRL symbols treepack replaces that moved."""
    require("TRL", trl.__version__, WRITTEN_AGAINST, SYMBOLS)
