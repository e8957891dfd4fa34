"""Every access treepack makes to megatron-core beyond its documented API, in one place.

Written against megatron-core 0.16.1 (the newest for Python 3.11, which the suite installs)
and kept to what 0.16 and 0.19 share (``treepack[megatron]`` allows ``>= 0.16``; the GPU image
carries newer wheels). :func:`check` runs in :func:`treepack.megatron.prepare` and names any of
these that moved.

Replaced on each instance of the model being prepared (never on the classes):

- ``TopKRouter.routing``, ``.apply_z_loss``, ``._apply_aux_loss``, ``._apply_seq_aux_loss``,
  ``._apply_global_aux_loss``, ``._apply_expert_bias``: the router's steps that average over
  a batch's tokens, weighted by each row's multiplicity in a tree forward (:mod:`.moe`; the
  originals kept as ``_stock_*``). They call ``get_aux_loss_coeff``,
  ``attach_and_log_load_balancing_loss`` and ``moe_utils``' ``MoEAuxLossAutoScaler``,
  ``save_to_aux_losses_tracker`` and ``switch_load_balancing_loss_func``, and read the
  router's ``tp_cp_group``, ``tp_dp_cp_group``, ``layer_number``, ``topk``,
  ``enable_expert_bias``, ``global_tokens_per_expert``, ``ga_steps`` and
  ``local_tokens_per_expert``.
- ``RouterReplay.get_replay_topk`` (routing replay, ``router.router_replay``): for one
  router call of a tree forward, a function returning the rows' routes and the router's
  scores at them (:mod:`.moe`); its signature ``scores, topk, num_groups, group_topk,
  default_compute_topk`` is what ``moe_utils.topk_routing_with_score_function`` calls.
  Under full recomputation a layer's ``self_attention.core_attention`` hands its forward's
  routing to ``mlp.router`` (both found on ``decoder.layers``).
- ``GPTModel.rotary_pos_emb.__class__`` (multi-latent attention: each
  ``MLASelfAttention.rotary_pos_emb``, a ``RotaryEmbedding`` or ``YarnRotaryEmbedding``):
  swapped for a subclass whose ``get_rotary_seq_len`` / ``forward`` give each row its depth
  (:mod:`.rotary`; ``RotaryEmbedding.get_emb``, ``YarnRotaryEmbedding.get_emb`` returning the
  embedding and its ``mscale``).
- ``MLASelfAttention.__class__`` (multi-latent attention): swapped for a subclass whose
  ``get_query_key_value_tensors`` (signature ``hidden_states, key_value_states,
  position_ids, packed_seq_params, ...``; returns ``query, key, value, q_compressed,
  kv_compressed``), in a tree forward under CP, calls megatron-core's own with
  ``linear_kv_up_proj.forward`` replaced for that call, reads the module's
  ``num_attention_heads_per_partition``, ``tp_group``, ``recompute_up_proj``, the up
  projection's ``weight`` (``[heads x (qk_head_dim + v_head_dim), kv_lora_rank]``) and,
  where TE fuses the norm into it, ``layer_norm_weight``, ``layer_norm_bias``,
  ``normalization``, ``eps``, ``zero_centered_gamma``; and the rope part of the key it
  returns (:mod:`.latent`).
- ``GatedDeltaNet.__class__`` (``megatron.core.ssm.gated_delta_net``): swapped for a
  subclass whose ``forward``, in a tree forward, runs the layer's ``in_proj``, ``conv1d``,
  ``A_log``, ``dt_bias``, ``_apply_gated_norm`` and ``out_proj`` and reads ``tp_size``,
  ``qk_dim``, ``v_dim``, ``num_key_heads``, ``num_value_heads``, ``key_head_dim``,
  ``value_head_dim``, ``use_qk_l2norm``, ``act_fn``, and its module's ``l2norm`` and
  ``torch_chunk_gated_delta_rule`` / ``chunk_gated_delta_rule`` (or the layer's
  ``gated_delta_rule``, megatron-core 0.19 on) (:mod:`.recurrent`).
- ``MambaMixer.__class__`` (``megatron.core.ssm.mamba_mixer``): swapped for a subclass whose
  ``forward``, in a tree forward, runs the layer's ``in_proj``, ``conv1d``, ``act``,
  ``dt_bias``, ``A_log``, ``D``, ``norm`` and ``out_proj`` and reads ``d_inner_local_tp``,
  ``ngroups_local_tp``, ``nheads_local_tp``, ``d_state``, ``headdim``, ``D_has_hdim``,
  ``rmsnorm``, ``chunk_size`` and its module's ``mamba_chunk_scan_combined`` (mamba_ssm's, where
  installed) (:mod:`.recurrent`).
- A vision-language model (mbridge's ``Qwen2_5VLModel``: ``vision_model``,
  ``language_model``, ``image_token_id``, ``video_token_id``): a tree forward calls its
  ``vision_model(vision_data=, grid_thw=)`` (reading ``spatial_merge_size`` and its config's
  ``in_channels``, ``temporal_patch_size``, ``patch_size``), ``language_model.embedding`` and
  ``language_model(decoder_input=...)``, and reads positions from the model's
  ``get_rope_index`` or its package's ``rope_utils.get_rope_index``; where its attention is
  mbridge's (which drops the batch dimension of q and k given ``packed_seq_params``),
  ``language_model.rotary_pos_emb.forward`` is replaced for the forward to return
  ``[rows, 1, d]`` (:mod:`.vision`).
- ``GPTModel.output_layer.forward``: for one forward, returns its input and records the weight
  (:mod:`.forward`), so no ``[T', V]`` logits exist.
- ``<layer>.self_attention.core_attention``: the tree core attention around the built module
  (:mod:`.attention`), which shares the stock module's ``softmax_offset`` (attention sinks)
  after deleting it from ``stock._parameters``.

Implemented: the core-attention contract Megatron builds and calls (constructor ``config,
layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
cp_comm_type, pg_collection``; forward ``query, key, value, attention_mask, attn_mask_type,
attention_bias, packed_seq_params``), and ``PackedSeqParams`` subclassed with a ``tree`` field
(``qkv_format``, ``max_seqlen_q``, ``max_seqlen_kv``, ``cp_group`` read by Megatron).
"""

from __future__ import annotations

try:
    import megatron.core
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("treepack.megatron needs megatron-core >= 0.16: pip install "
                      "'treepack[megatron]'") from e

from treepack.core.compat import require

__all__ = ["WRITTEN_AGAINST", "ROUTER_STEPS", "check"]

WRITTEN_AGAINST = "0.16.1"

# the router steps a tree forward weights, replaced on each router instance (.moe)
ROUTER_STEPS = ("routing", "apply_z_loss", "_apply_aux_loss", "_apply_seq_aux_loss",
                "_apply_global_aux_loss", "_apply_expert_bias")

SYMBOLS = (  # (name, owner, attribute path)
    *((f"TopKRouter.{step}", TopKRouter, step) for step in ROUTER_STEPS),
    ("TopKRouter.get_aux_loss_coeff", TopKRouter, "get_aux_loss_coeff"),
    ("TopKRouter.attach_and_log_load_balancing_loss", TopKRouter,
     "attach_and_log_load_balancing_loss"),
    ("moe_utils.MoEAuxLossAutoScaler", moe_utils, "MoEAuxLossAutoScaler"),
    ("moe_utils.save_to_aux_losses_tracker", moe_utils, "save_to_aux_losses_tracker"),
    ("moe_utils.switch_load_balancing_loss_func", moe_utils, "switch_load_balancing_loss_func"),
    ("RouterReplay.get_replay_topk", RouterReplay, "get_replay_topk"),
    ("RotaryEmbedding.get_rotary_seq_len", RotaryEmbedding, "get_rotary_seq_len"),
    ("RotaryEmbedding.get_emb", RotaryEmbedding, "get_emb"),
    ("YarnRotaryEmbedding.get_emb", YarnRotaryEmbedding, "get_emb"),
    ("MLASelfAttention.get_query_key_value_tensors", MLASelfAttention,
     "get_query_key_value_tensors"),
    # the fields Megatron reads of the packed_seq_params a tree forward passes (all default)
    *((f"PackedSeqParams.{f}", PackedSeqParams, f)
      for f in ("qkv_format", "max_seqlen_q", "max_seqlen_kv", "cp_group")),
)


def check() -> None:
    """Raise ``ImportError`` naming the megatron-core symbols treepack replaces or reads that
    moved."""
    require("megatron-core", getattr(megatron.core, "__version__", "?"), WRITTEN_AGAINST,
            SYMBOLS)
