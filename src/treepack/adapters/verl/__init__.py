"""verl integration: tree-packed micro-batches inside verl's FSDP language-model engine.

Switch it on with one line of verl config (every actor, rollout-log-prob and reference
forward then runs on prefix-tree packs)::

    actor_rollout_ref.model.external_lib=treepack.verl

verl imports ``external_lib`` in every worker before it builds the engine; importing this
module runs :func:`install`, once per process however often it is called: it registers
:class:`TreepackEngine` as verl's FSDP / FSDP2 language-model engine
(``treepack.verl.register()`` does that alone, from a launch script), where megatron-core is
installed :class:`treepack.verl_megatron.TreepackMegatronEngine` as its Megatron one
(``model_engine=megatron``; :func:`register_megatron`), and the group-keeping batch balance
on verl's trainers (:mod:`treepack.verl_trainer`). Written against verl 0.9.1
(``treepack[verl]`` pins it; every verl internal treepack touches is in :mod:`.compat`, which
names what moved).

What changes, and what does not:

- **Micro-batches are formed by trees.** The rank's sequences (verl's rows) are planned with
  :func:`treepack.plan` under verl's token budget (``ppo_max_token_len_per_gpu`` /
  ``log_prob_max_token_len_per_gpu``, or ``micro_batch_size_per_gpu`` x the longest row),
  so the rollouts of one prompt and the steps of one agent trajectory (whose histories are
  prefixes of each other) land in the same pack. Every rank runs the same number of real
  micro-batches (the count is all-reduced; a rank that planned fewer packs splits its
  largest), as verl's per-micro-batch metric aggregation across ranks needs.
- **One packed forward per micro-batch**, through :func:`treepack.hf.logprobs` with the
  default backend, inside the FSDP module (so FSDP1 and FSDP2 both work).
- **Outputs in verl's layout.** ``log_probs`` and ``entropy`` are nested tensors in verl's
  prediction-aligned layout (position p holds the log-prob of token p + 1), each row at its
  own temperature (verl's per-sample temperature too; the model still runs once per
  micro-batch). verl's own ``loss_function`` (policy losses, ``loss_agg_mode``,
  KL, entropy) runs unchanged on them, normalised by verl's global token counts. The last
  position of each row (which verl's losses never read, and whose value in stock verl
  depends on the micro-batch's next row) is 0.
- **Ulysses sequence parallelism packs too** (``ulysses_sequence_parallel_size = P > 1``):
  the P ranks of verl's ``sp`` mesh dimension hold one data-parallel share, plan the same
  packs under verl's Ulysses budget (``max_token_len_per_gpu`` x P) and each computes a
  slice of every pack's rows, exchanging rows for heads at each attention layer
  (``sequence_parallel=`` of :func:`treepack.hf.logprobs` and the parts calls; see
  docs/sequence-parallel.md). Every rank gets the whole micro-batch's outputs and runs
  verl's loss on them, as stock verl's Ulysses does; FSDP's average over every rank gives
  the gradient. Trees over that budget run in parts, each part split the same way.
- **Images pack too** (a vision-language model :class:`treepack.hf.Images` runs; tested on
  Qwen3-VL and Qwen2-VL): each row's ``multi_modal_inputs`` (its copy of its
  images) become the batch's images, keyed by content in the plan and the packs, each
  distinct image encoded once a forward; verl's ``[4, length]`` mrope position ids are read
  for their text row (depths), the model's own rope index giving the rest. For Qwen2-VL and
  Qwen2.5-VL, whose forward (and, with ``use_remove_padding``, attention) verl replaces for
  every model of the process, the packed forwards and their backward run transformers' own
  forwards, kept when this module is imported; verl's stock path keeps verl's.
- **Transparent fallback.** Batches or models that cannot be packed — multi-modal
  inputs other than images (video, audio), mrope position ids of a model without images,
  position ids other than ``0 .. length - 1``, fused kernels,
  distillation outputs, a temperature that is not finite and > 0, a model
  :func:`treepack.hf.prepare` refuses — run verl's stock path, with one log line saying why
  (logger ``treepack.verl``). The decision is all-reduced: if one rank
  falls back, every rank does, so collectives stay in step.
- **Metrics.** Each micro-batch reports ``treepack/token_ratio`` (packed rows / tokens);
  verl's trainer logs an update's as ``actor/treepack/token_ratio``. It drops the metrics of
  log-prob passes, so an update also reports the engine's last log-prob pass (this rank's
  packed rows / tokens over the pass) as ``treepack/log_prob_token_ratio``. An update also
  reports where its sharing was lost (``treepack/*_ratio``, ``treepack/lost_rows/*``:
  :func:`treepack.sharing.report` over the rank's rows, summed over the ranks) and, on v1
  agent-loop rows (which carry ``session_id``), the sessions whose later turns do not
  extend the earlier ones (``treepack/session_forks/{sessions,rows}``).
- **Trees larger than the budget run in parts** (:mod:`treepack.hf.parts`) where the plan
  would split one and repeat its prefix, under FSDP or FSDP2: the rank's batch is one micro-batch
  whose trees run in forwards of at most the budget, every row once. A log-prob pass is
  those forwards. An update takes two passes, since verl's losses normalise per sequence
  (``seq-mean-token-mean``), which a part holding some of a sequence's tokens cannot: the
  log-probs without gradients, verl's ``loss_function`` on them (its value, metrics and
  gradient with respect to each log-prob and entropy), then the parts' forwards and
  backwards with that gradient; one more forward over the tree's rows than a pack would
  take, against repeating every split prefix. A float16 gradient scaler keeps the split
  (said once). ``treepack/parts`` reports the forwards.
- ``use_remove_padding=false`` changes nothing (a pack never holds padding); said once.
- **Groups stay on one rank.** Importing this module also makes verl's trainers keep each
  group (``uid``) on one data-parallel rank when they balance a batch
  (:mod:`treepack.verl_trainer`): the trainer process imports ``external_lib`` too.
"""

from treepack.adapters.verl.compat import VERL_VERSION
from treepack.adapters.verl.fsdp_engine import (TreepackEngine, TreepackLeanEngine, register,
                                                verl_log_probs)
from treepack.adapters.verl.install import install, register_megatron

__all__ = ["TreepackEngine", "TreepackLeanEngine", "register", "register_megatron", "install",
           "VERL_VERSION", "verl_log_probs"]

install()
