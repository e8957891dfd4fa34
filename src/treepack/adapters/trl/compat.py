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

The asynchronous GRPO trainer (:mod:`.async_grpo`), resolved on first use by
:func:`async_grpo` (``trl.AsyncGRPOTrainer`` where TRL exports it, from 1.18; else
``trl.experimental.async_grpo.AsyncGRPOTrainer``), which checks :func:`async_symbols`. In the
module that defines the trainer (``async_grpo_trainer`` in 1.16):

- ``create_model_from_path`` and ``add_fused_lm_head``: swapped while
  ``TreepackAsyncGRPOTrainer.__init__`` runs. The first loads the model without TRL's
  ``attn_implementation="tree_fa3"`` and prepares it (:func:`treepack.hf.prepare`, which
  refuses what treepack cannot run), then hides from TRL's tree-packing check, on that model
  object only, what treepack routes: the text config's non-attention ``layer_types`` (its
  class swapped for a subclass whose ``layer_types`` reads None) and parameters named
  ``*.sinks`` (``named_parameters`` filtered on the instance). The second puts both back before
  calling TRL's: TRL calls it right after the check, before anything else reads them.
- ``DataCollatorForRollout``: subclassed, and swapped for the subclass while
  ``get_train_dataloader`` runs (it is looked up there as a module global). Its
  ``torch_call`` reads each rank row's ``TreeRow.samples`` (``input_ids``,
  ``completion_mask``) and adds four keys, one padded row per rank.
- ``AsyncGRPOTrainer.compute_loss``: called with a stand-in for the model and an identity
  ``token_index``. It relies on TRL calling ``model(**packed_row)`` once, reading
  ``outputs.log_probs.flatten()[token_index]``, ``outputs.entropy.flatten()[token_index]`` and
  ``outputs.aux_loss``, and on the loss terms being laid out as ``TreeRow.pack`` lays them
  (sample by sample, positions ``1 ..`` whose ``completion_mask`` is 1; checked against the
  batch's ``segment_id`` every step).

Read on the trainer: ``temperature``, ``aux_loss_enabled``, ``accelerator`` (``reduce``) and
``_metrics["train"]``; from the batch: ``token_index`` and ``segment_id``.
"""

from __future__ import annotations

import sys

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
           "get_config_model_id", "is_peft_model", "async_grpo", "async_symbols"]

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


def async_symbols(trainer: type, module) -> tuple[tuple[str, object, str], ...]:
    """What :mod:`.async_grpo` replaces, swaps or calls in TRL's asynchronous GRPO trainer
    ``trainer`` and the ``module`` that defines it: ``(name, owner, attribute path)``."""
    where = module.__name__
    return (
        (f"{trainer.__name__}.compute_loss", trainer, "compute_loss"),
        (f"{trainer.__name__}.get_train_dataloader", trainer, "get_train_dataloader"),
        (f"{where}.create_model_from_path", module, "create_model_from_path"),
        (f"{where}.add_fused_lm_head", module, "add_fused_lm_head"),
        (f"{where}.DataCollatorForRollout.torch_call", module, "DataCollatorForRollout.torch_call"),
        (f"{where}.TreeRow.pack", module, "TreeRow.pack"),
    )


def async_grpo():
    """TRL's asynchronous GRPO trainer class and the module that defines it, checked.

    ``trl.AsyncGRPOTrainer`` where TRL exports it (1.18 on), else
    ``trl.experimental.async_grpo.AsyncGRPOTrainer`` (1.16, 1.17). Imported here, on first
    use, so ``treepack.trl`` imports without it.

    Returns:
        ``(AsyncGRPOTrainer, its module)``.

    Raises:
        ImportError: the trainer cannot be imported (the message says what to install), or a
            symbol of :func:`async_symbols` moved.
    """
    try:
        trainer = getattr(trl, "AsyncGRPOTrainer", None)
        if trainer is None:
            from trl.experimental.async_grpo import AsyncGRPOTrainer as trainer
    except (ImportError, RuntimeError) as e:  # TRL's lazy module raises RuntimeError for a
        # submodule whose import failed
        raise ImportError(
            f"treepack.trl.TreepackAsyncGRPOTrainer needs TRL's asynchronous GRPO trainer "
            f"(trl.AsyncGRPOTrainer from TRL 1.18, trl.experimental.async_grpo in TRL "
            f"{WRITTEN_AGAINST} and 1.17), which did not import with TRL {trl.__version__}: "
            f"{e}. Install TRL >= {WRITTEN_AGAINST} with the trainer's dependencies") from e
    module = sys.modules[trainer.__module__]
    require("TRL", trl.__version__, WRITTEN_AGAINST, async_symbols(trainer, module))
    return trainer, module
