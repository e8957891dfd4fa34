"""Run transformers causal LMs on a TreePack (transformers >= 5; imported lazily).

    hf.prepare(model)                                  # once
    out = treepack.hf.logprobs(model, pack)            # out.logprobs: [N, L]

:func:`prepare` routes the model's attention through treepack (:mod:`.routing`): a tree
backend when a pack is given, the model's original attention (sdpa, eager, flex, ...)
otherwise, so one model object serves packed and ordinary padded batches. The pack reaches
every attention layer as a forward keyword argument, so gradient checkpointing recomputes the
same tree attention. :func:`logprobs` is the one way to get log-probs: from the model's logits,
from its hidden states and LM head, or from the head inside the forward (:mod:`.forward`).

What would be silently wrong is refused with :class:`UnsupportedModel` (a ``ValueError`` and a
``NotImplementedError``), naming the fix: a model whose layers do not all go through
transformers' attention interface (custom attention code, recurrent layers it does not
route), a model that ignores ``position_ids``, attention sinks in parts or under sequence
parallelism, and rotary scalings that read
the longest position. Keyword arguments that would break the tree (caches, ``labels``,
attention masks, flash "padding-free" boundaries) raise ``ValueError``. An MoE router
auxiliary loss is recomputed with each packed row weighted by the number of original tokens it
stands for, so it equals the unpacked one (:mod:`.moe`). Every transformers internal treepack
touches is in :mod:`.compat`.

A tree larger than one forward runs in parts that each compute their rows once
(:func:`backward_in_parts`, :func:`step_in_parts` for losses of whole sequences,
:func:`logprobs_in_parts`; :mod:`.parts`). A tree too long for one GPU's activations runs over
a sequence-parallel group (Ulysses: ``sequence_parallel=group`` in :func:`logprobs` and the
parts calls; each rank computes a slice of the rows, each attention layer exchanges rows for
heads; :mod:`.sequence_parallel`), and :func:`average_gradients` averages its gradients over
the group for a model outside DDP / FSDP.
"""

from treepack.adapters.hf.forwarding import (HEADS, HiddenOutput, forward, forward_hidden,
                                          forward_lean, logprobs)
from treepack.adapters.hf.head import lm_head
from treepack.adapters.hf.parts import (PartsResult, backward_in_parts, logprobs_in_parts,
                                        step_in_parts)
from treepack.adapters.hf.moe import batch_router_aux_loss, router_aux_loss, row_multiplicity
from treepack.adapters.hf.prepare import (compute_device, is_prepared, original_attention,
                                          pair_cost, prepare, prepared, restore, unprepare,
                                          unwrap)
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.adapters.hf.sequence_parallel import average_gradients
from treepack.adapters.hf.vision import Images

__all__ = ["logprobs", "HEADS", "pair_cost", "forward", "forward_hidden", "HiddenOutput",
           "prepare", "restore", "prepared", "unprepare", "is_prepared", "original_attention", "unwrap",
           "lm_head", "row_multiplicity", "router_aux_loss", "batch_router_aux_loss",
           "UnsupportedModel", "compute_device", "forward_lean", "backward_in_parts",
           "logprobs_in_parts", "step_in_parts", "PartsResult", "average_gradients", "Images"]
