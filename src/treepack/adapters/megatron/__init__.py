"""Run a megatron-core ``GPTModel`` (or a ``MambaModel`` hybrid, or a vision-language model
around a ``GPTModel``) on a TreePack (megatron-core 0.16 and later; imported lazily).

    spec = treepack.megatron.layer_spec(get_gpt_layer_local_spec())    # or the TE spec
    model = GPTModel(config, spec, vocab_size, max_sequence_length, ...)
    treepack.megatron.prepare(model)           # a model from a stock spec: its core
                                               # attention is swapped in place
    out = treepack.megatron.logprobs(model, pack, temperature=..., entropy=True)
    loss = my_loss(out.logprobs, out.entropy)  # [N, L], as treepack.hf.logprobs gives
    loss.backward()

A tree larger than one forward runs in parts that each compute their rows once
(:mod:`.parts`: ``backward_in_parts``, ``step_in_parts``, ``logprobs_in_parts``).

The tree enters each layer as its ``core_attention`` (:mod:`.attention`): treepack's
backends (``segment`` on a CPU, ``varlen`` / ``flex`` on CUDA) over the pack's rows, at
their depths (:mod:`.rotary`); a Gated DeltaNet or Mamba2 layer runs its convolution and
scan along each row's path (:mod:`.recurrent`), and multi-latent attention exchanges latents
under CP (:mod:`.latent`). A vision-language model encodes each distinct image once and
places its features on the rows that stand for it (:class:`Images`, :mod:`.vision`):

    images = treepack.megatron.Images(model, sequences, pixel_values=..., image_grid_thw=...)
    out = treepack.megatron.logprobs(model, images.pack(), images=images)

Log-probs come from the vocabulary-parallel output layer's weight, normalised on each TP
rank's share of the vocabulary (:mod:`.forward`). Tensor, Megatron sequence and context
parallelism follow ``megatron.core.parallel_state``. Every megatron-core internal treepack
touches is in :mod:`.compat`.
"""

from treepack.adapters.megatron import compat  # first: says what is missing  # noqa: F401
from treepack.adapters.megatron.attention import (TreeCoreAttention, TreePackedSeqParams,
                                                  UnsupportedMegatron, layer_spec)
from treepack.adapters.megatron.forward import (MegatronForward, StageOutput, forward_stage,
                                                forward_step, is_prepared, logprobs, prepare,
                                                unwrap)
from treepack.adapters.megatron.parts import (PartsResult, backward_in_parts,
                                              logprobs_in_parts, step_in_parts)
from treepack.adapters.megatron.vision import Images

__all__ = ["layer_spec", "prepare", "logprobs", "forward_step", "forward_stage", "StageOutput",
           "is_prepared", "unwrap", "TreeCoreAttention", "TreePackedSeqParams", "MegatronForward",
           "UnsupportedMegatron", "backward_in_parts", "step_in_parts", "logprobs_in_parts",
           "PartsResult", "Images"]
