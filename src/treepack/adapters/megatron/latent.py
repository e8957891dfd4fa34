"""Multi-latent attention under context parallelism: the keys and values travel as latents.

Under CP each rank holds a contiguous slice of a tree forward's rows, and before attention
the rows are exchanged for heads (:mod:`.forward`): every rank then holds every row for its
heads. An ordinary layer's exchange carries its keys and values. A multi-latent attention
layer (DeepSeek's MLA, ``MLASelfAttention``) makes them from two narrow tensors per row: the
latent (``kv_lora_rank`` wide) and the rope key (``qk_pos_emb_head_dim`` wide, one for all
heads), which its ``linear_kv_up_proj`` expands to ``heads x (qk_head_dim + v_head_dim)``.
So each rank all-gathers the latent and the rotated rope key of every row over the CP group
and up-projects them itself, for its own heads only; the queries and the outputs still
travel by the all-to-all.

For DeepSeek-V3's shapes (128 heads, keys 128 + 64 wide, values 128, latent 512 + 64) at
CP = 2 and no TP, a rank receives 576 values per row of the other rank instead of
64 x 320 = 20,480. The up-projection costs the same FLOPs (every row for a rank's heads, not
its rows for every head); in the backward, the latents' gradients are reduce-scattered back
to the ranks that own the rows.

**How.** :func:`install` gives each ``MLASelfAttention`` a subclass whose
``get_query_key_value_tensors``, in a tree forward under CP, runs megatron-core's own with
the up-projection deferred: for that call ``linear_kv_up_proj`` (through its ``__call__``,
so its hooks run) exchanges its input and up-projects it as above, and hands megatron-core
zeros of its output's shape (a stride-0 tensor). Megatron-core's query path, its
down-projection, its TP and sequence-parallel gathers and the rope at each row's depth run
unchanged; the rotated rope key is read back from the key megatron-core builds (its first
head's rope part), gathered, and joined to the up-projected keys. The core attention then
gets keys and values for every row and this rank's heads; :meth:`.forward.MegatronForward.
core_attention` exchanges only the queries.

Up-projections read this way: a column-parallel linear without bias (megatron-core's
``ColumnParallelLinear``, TransformerEngine's ``TEColumnParallelLinear``) and TE's fused norm
and linear (``TELayerNormColumnParallelLinear``, in TE's MLA spec with ``qk_layernorm``: its
``RMSNorm`` or ``LayerNorm`` applied here from ``layer_norm_weight``, ``layer_norm_bias``,
``eps`` and ``zero_centered_gamma``, in float32 or wider as TE's kernel does). Each keeps Megatron's
tensor-parallel gradient rules (the latent's gradient summed over the TP ranks' heads, and
under sequence parallelism reduce-scattered). Other up-projections, FP8 / FP4, and a
recomputed up-projection (``recompute_modules`` with ``"mla_up_proj"``) exchange the
expanded keys and values, exact as well, and so do layers whose expanded keys and values are
the smaller (TP x CP past ``heads x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) /
(kv_lora_rank + qk_pos_emb_head_dim)``: 71 for DeepSeek-V3); :func:`install` logs which and
why, once.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from treepack.core.compat import mixed_in, replaced

__all__ = ["LatentKeys", "install"]

log = logging.getLogger("treepack")

_NORMS = ("RMSNorm", "LayerNorm")


class LatentKeys:
    """One MLA layer's keys and values, up-projected for this CP rank's heads from every
    row's latent.

    Args:
        attention: the ``MLASelfAttention`` (its ``linear_kv_up_proj``, head counts and
            tensor-parallel group are read).
    """

    def __init__(self, attention):
        config = attention.config
        self.up = attention.linear_kv_up_proj
        self.heads = attention.num_attention_heads_per_partition
        self.key_width, self.value_width = config.qk_head_dim, config.v_head_dim
        self.tp_group = attention.tp_group
        tp = torch.distributed.get_world_size(self.tp_group) if self.tp_group is not None \
            else 1
        self.tp = tp
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        self.fused_norm = getattr(self.up, "layer_norm_weight", None) is not None

    @staticmethod
    def refusal(attention, cp: int) -> str | None:
        """Why ``attention``'s keys and values should not travel as latents over ``cp``
        ranks, or None."""
        config = attention.config
        heads = attention.num_attention_heads_per_partition
        latent = config.kv_lora_rank + config.qk_pos_emb_head_dim
        expanded = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim
                            + config.v_head_dim) / cp
        if latent >= expanded:  # values per row received from each other rank
            return (f"the expanded keys and values are the smaller ({expanded:g} values per "
                    f"row from each rank at {heads} heads per TP rank and CP = {cp}, the "
                    f"latent {latent})")
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            return "an FP8 / FP4 up-projection"
        if getattr(attention, "recompute_up_proj", False):
            return "a recomputed up-projection (recompute_modules with 'mla_up_proj')"
        up = getattr(attention, "linear_kv_up_proj", None)
        weight = getattr(up, "weight", None)
        rows = heads * (config.qk_head_dim + config.v_head_dim)
        if not isinstance(weight, Tensor) or tuple(weight.shape) != (rows, config.kv_lora_rank):
            return (f"{type(up).__name__}'s weight is not one [{rows}, {config.kv_lora_rank}] "
                    "matrix")
        bias = getattr(up, "bias", None)
        if isinstance(bias, Tensor) and bias.numel():
            return f"{type(up).__name__} has a bias"
        if getattr(up, "layer_norm_weight", None) is not None \
                and getattr(up, "normalization", None) not in _NORMS:
            return (f"{type(up).__name__} fuses a norm that is not one of {_NORMS} "
                    f"({getattr(up, 'normalization', None)!r})")
        return None

    def _norm(self, latent: Tensor) -> Tensor:
        """The fused norm of TE's ``LayerNormLinear``, computed in float32 (as its kernel)
        or wider."""
        up, wide = self.up, torch.promote_types(latent.dtype, torch.float32)
        weight = up.layer_norm_weight.to(wide)
        if getattr(up, "zero_centered_gamma", False):
            weight = weight + 1
        x = latent.to(wide)
        if up.normalization == "RMSNorm":
            out = F.rms_norm(x, (x.shape[-1],), weight, up.eps)
        else:
            bias = up.layer_norm_bias
            out = F.layer_norm(x, (x.shape[-1],), weight,
                               None if bias is None else bias.to(wide), up.eps)
        return out.to(latent.dtype)

    def project(self, latent: Tensor, exchange) -> tuple[Tensor, Tensor]:
        """The unrotated keys ``[rows, heads, qk_head_dim]`` and values ``[rows, heads,
        v_head_dim]`` of every row of the forward for this CP rank's heads, from this rank's
        latents (the up-projection's input: ``[own rows, kv_lora_rank]``, this TP rank's
        share of them under sequence parallelism)."""
        from megatron.core.tensor_parallel import mappings

        if self.fused_norm:  # on the rows that hold it, before any gather (TE's order)
            latent = self._norm(latent)
        if self.sequence_parallel:  # as the column-parallel linear gathers its input
            latent = mappings.gather_from_sequence_parallel_region(latent, group=self.tp_group)
        elif self.tp > 1:  # its gradient: the sum over the TP ranks' heads
            latent = mappings.copy_to_tensor_model_parallel_region(latent, group=self.tp_group)
        latent = exchange.gather(latent)
        lo, hi = exchange.split(self.heads, "attention heads", "MLASelfAttention")
        width = self.key_width + self.value_width
        weight = self.up.weight.view(self.heads, width, -1)[lo:hi].flatten(0, 1)
        kv = F.linear(latent, weight).view(latent.shape[0], hi - lo, width)
        return kv.split((self.key_width, self.value_width), -1)

    @contextlib.contextmanager
    def deferred(self, exchange):
        """While it lasts, the layer's up-projection projects as :meth:`project` does and
        hands its caller zeros of its own output's shape; yields a dict that then holds
        ``"keys"`` and ``"values"``."""
        up, out = self.up, {}

        def forward(latent, *args, **kwargs):
            out["keys"], out["values"] = self.project(latent, exchange)
            rows = latent.shape[0] * (self.tp if self.sequence_parallel else 1)
            zeros = latent.new_zeros(()).expand(rows, *latent.shape[1:-1],
                                                self.heads * (self.key_width
                                                              + self.value_width))
            return zeros, None

        with replaced(up, "forward", forward):
            yield out


class _TreeMLA:
    """Mixed into an ``MLASelfAttention`` class (module doc)."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None, *args,
                                    **kwargs):
        tree = getattr(packed_seq_params, "tree", None)
        latent = None if tree is None else tree.latent_keys(self.core_attention)
        if latent is None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params, *args,
                **kwargs)
        with latent.deferred(tree.exchange) as up:
            query, key, _, q_compressed, kv_compressed = super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params, *args,
                **kwargs)
        if "keys" not in up:
            raise RuntimeError(f"{type(self).__name__} did not call linear_kv_up_proj: this "
                               "megatron-core's MLA is not the one treepack reads")
        rope = tree.exchange.gather(key[..., 0, latent.key_width:].reshape(key.shape[0], -1))
        keys = torch.cat((up["keys"], rope[:, None].expand(-1, up["keys"].shape[1], -1)), -1)
        return query, keys, up["values"], q_compressed, kv_compressed


def install(model) -> None:
    """Give each ``MLASelfAttention`` of ``model`` the latent exchange for tree forwards
    under CP (module doc), where its up-projection allows it; log the layers that exchange
    expanded keys and values instead, once."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    refused, cp = {}, parallel_state.get_context_parallel_world_size()
    for module in model.modules():
        if not isinstance(module, MLASelfAttention):
            continue
        why = LatentKeys.refusal(module, cp)
        if why is not None:
            refused.setdefault(why, []).append(module.layer_number)
            module.core_attention.latent = None
            continue
        mixed_in(module, _TreeMLA)
        module.core_attention.latent = LatentKeys(module)
    if refused and cp > 1:
        for why, layers in refused.items():
            log.info("treepack.megatron: MLA layers %s exchange expanded keys and values under "
                     "context parallelism, not latents: %s", layers, why)
