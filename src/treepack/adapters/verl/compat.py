"""Every access treepack makes to verl beyond its documented API, in one place.

Written against verl 0.9.1 (``treepack[verl]`` pins it; :data:`VERL_VERSION`). :func:`check`
runs in :func:`treepack.adapters.verl.install` and names any of these that moved.

Replaced or written:

- ``verl.workers.engine.base.EngineRegistry._engines["language_model"][backend][device]``:
  the engine classes verl builds; treepack's engines are written there directly
  (:func:`register_engine`), since ``EngineRegistry.register`` refuses keys the stock engines
  hold.
- ``PPOTrainer._balance_batch`` (v1, ``verl.trainer.ppo.v1.trainer_base``) and
  ``RayPPOTrainer._balance_batch`` (v0, ``verl.trainer.ppo.ray_trainer``): wrapped by the
  group-keeping balance (:mod:`.trainer`; the original kept as ``__wrapped__``).
- The ``forward`` of the Qwen2-VL / Qwen2.5-VL classes verl's ``apply_monkey_patch`` replaces
  for every model of the process (:data:`PATCHED_BY_VERL`): treepack keeps transformers' own,
  read when this module is imported (verl imports ``external_lib`` before it builds an
  engine), and runs its packed forwards on them (:func:`transformers_forwards`).

Subclassed and called: ``FSDPEngineWithLMHead`` (``verl.workers.engine.fsdp.transformer_impl``)
and ``MegatronEngineWithLMHead`` (``verl.workers.engine.megatron.transformer_impl``; imported
with megatron-core only, :func:`megatron_engine`): their ``initialize``,
``forward_backward_batch`` (replaced), ``_gradient_sync_context``, ``_autocast_dtype``,
``scaler``, ``module``, ``ulysses_parallel_group``, ``use_ulysses_sp``,
``ulysses_sequence_parallel_size``, ``get_data_parallel_group`` / ``_size``; and the Megatron
engine's ``engine_config``, ``tf_config``, ``enable_routing_replay``,
``postprocess_micro_batch_func`` and ``_routed_num_tokens``. The v1 trainer's
``_get_required_batch_multiple``, ``upsample_batch_to_divisible_size``, ``tokenizer``,
``actor_rollout_wg`` and ``config``.

Helpers read: ``verl.utils.tensordict_utils`` (``get_non_tensor_data``, ``assign_non_tensor``,
``index_select_tensor_dict``), ``verl.utils.device.get_device_id`` / ``get_device_name``,
``verl.utils.model.extract_multi_modal_inputs``, ``verl.workers.engine.utils.detach_tree``,
``verl.utils.py_functional.append_to_dict``, ``verl.utils.seqlen_balancing``
(``calculate_workload``, ``log_seqlen_unbalance``) and, for the Megatron engine,
``verl.utils.megatron.pipeline_parallel.make_batch_generator``.
"""

from __future__ import annotations

import contextlib
import importlib

try:
    import verl
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.py_functional import append_to_dict
    from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.utils import detach_tree
except ImportError as e:  # pragma: no cover - exercised only without verl
    raise ImportError("treepack.verl needs verl 0.9.1: pip install 'treepack[verl]'") from e

from treepack.core.compat import require

__all__ = ["VERL_VERSION", "check", "register_engine", "megatron_engine",
           "transformers_forwards", "PATCHED_BY_VERL", "tu", "get_device_id", "get_device_name",
           "extract_multi_modal_inputs", "append_to_dict", "calculate_workload",
           "log_seqlen_unbalance", "EngineRegistry", "FSDPEngineWithLMHead", "detach_tree",
           "ray_trainer", "trainer_base"]

VERL_VERSION = "0.9.1"

SYMBOLS = (  # (name, owner, attribute path): what treepack replaces, writes or subclasses
    ("EngineRegistry._engines", EngineRegistry, "_engines"),
    ("trainer_base.PPOTrainer._balance_batch", trainer_base, "PPOTrainer._balance_batch"),
    ("trainer_base.PPOTrainer._get_required_batch_multiple", trainer_base,
     "PPOTrainer._get_required_batch_multiple"),
    ("trainer_base.upsample_batch_to_divisible_size", trainer_base,
     "upsample_batch_to_divisible_size"),
    ("ray_trainer.RayPPOTrainer._balance_batch", ray_trainer, "RayPPOTrainer._balance_batch"),
    ("FSDPEngineWithLMHead.forward_backward_batch", FSDPEngineWithLMHead,
     "forward_backward_batch"),
    ("FSDPEngineWithLMHead._gradient_sync_context", FSDPEngineWithLMHead,
     "_gradient_sync_context"),
)


def check() -> None:
    """Raise ``ImportError`` naming the verl symbols treepack replaces or reads that moved."""
    require("verl", verl.__version__, VERL_VERSION, SYMBOLS)


def register_engine(backends: tuple[str, ...], stock: type, family: type, engine: type,
                    devices) -> None:
    """Make ``engine`` verl's language-model engine for ``backends``: every registry entry that
    names ``stock`` (verl's engine) or one of treepack's (a subclass of ``family``), for any
    device and vendor, and each of ``devices``. Writes verl's registry table directly: its
    ``register`` decorator refuses keys that are taken, and the stock engine has taken
    these."""
    table = EngineRegistry._engines.setdefault("language_model", {})
    for backend in backends:
        entries = table.setdefault(backend, {})
        for key, registered in list(entries.items()):
            if registered is stock or (isinstance(registered, type) and
                                       issubclass(registered, family)):
                entries[key] = engine
        for device in devices:
            entries[device] = engine


def megatron_engine():
    """verl's Megatron language-model engine class and its batch generator (this imports
    megatron-core)."""
    from verl.utils.megatron.pipeline_parallel import make_batch_generator
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    return MegatronEngineWithLMHead, make_batch_generator


@contextlib.contextmanager
def unfused(chunks):
    """While it lasts, the model ``chunks`` verl's fused kernels patched (``use_fused_kernels``
    on a megatron-core before 0.18: each ``GPTModel``'s ``forward`` replaced by one that
    needs the labels and returns log-probs) run megatron-core's own forward again; the patch
    is restored after. A chunk verl did not patch is left alone."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward
    from verl.utils.megatron_utils import unwrap_model

    patched = [c for c in chunks if hasattr(unwrap_model(c), "forward_backup")
               or hasattr(getattr(unwrap_model(c), "language_model", None), "forward_backup")]
    for chunk in patched:
        unpatch_fused_forward(chunk)
    try:
        yield
    finally:
        for chunk in patched:
            patch_fused_forward(chunk)


# verl 0.9.1's apply_monkey_patch replaces these classes' forwards, for every model of the
# process, when it builds a Qwen2-VL / Qwen2.5-VL engine: the model's forward with one that
# takes only [4, batch, length] position ids and its attention with a direct flash-attention
# call, which no attention interface reaches.
PATCHED_BY_VERL = (
    ("transformers.models.qwen2_vl.modeling_qwen2_vl",
     ("Qwen2VLForConditionalGeneration", "Qwen2VLModel", "Qwen2VLTextModel",
      "Qwen2VLAttention")),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
     ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel", "Qwen2_5_VLTextModel",
      "Qwen2_5_VLAttention")),
)


def _own_forwards() -> dict:
    """transformers' own ``forward`` of each class verl patches, as they are now."""
    found = {}
    for module_name, names in PATCHED_BY_VERL:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - a transformers without the family
            continue
        for name in names:
            cls = getattr(module, name, None)
            forward = None if cls is None else cls.__dict__.get("forward")
            if forward is not None and getattr(forward, "__module__", "").startswith(
                    "transformers."):
                found[cls] = forward
    return found


_TRANSFORMERS_FORWARDS = _own_forwards()  # before verl builds an engine and patches them


@contextlib.contextmanager
def transformers_forwards():
    """While it lasts, the classes verl patched run transformers' own forwards."""
    swapped = {cls: cls.__dict__["forward"] for cls, own in _TRANSFORMERS_FORWARDS.items()
               if cls.__dict__.get("forward") is not own}
    for cls in swapped:
        cls.forward = _TRANSFORMERS_FORWARDS[cls]
    try:
        yield
    finally:
        for cls, patched in swapped.items():
            cls.forward = patched
