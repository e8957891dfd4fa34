"""The tree as a Megatron layer's core attention.

Megatron's self-attention computes ``q`` ``[s, b, h_local, d]`` and ``k``, ``v``
``[s, b, g_local, d]`` (TP-local heads, grouped query heads not expanded), applies the rotary
embedding, and hands them to its ``core_attention`` with the layer's mask and
``packed_seq_params``. :class:`TreeCoreAttention` is that module: given a
:class:`TreePackedSeqParams` (what :func:`treepack.megatron.logprobs` passes through
``GPTModel.forward``), it runs treepack's tree attention over the pack's rows; given anything
else, the stock core attention it was built beside (an ordinary batch runs as before).

The pack travels in ``packed_seq_params`` rather than in ``attention_mask``: Megatron's
activation recomputation saves the mask among the tensors of a checkpointed region (a pack is
no tensor), while ``packed_seq_params`` reaches the core attention through closures, in the
forward and in every recompute. Its ``qkv_format`` is ``"sbhd"``, so Megatron keeps the
``[s, b, h, d]`` layout and applies the rotary embedding row by row (the rows' depths, see
:mod:`.rotary`).

:func:`layer_spec` puts it in a layer spec (the local spec or the TransformerEngine spec: only
``core_attention`` changes, TE's fused linears and norms stay); :func:`swap` puts it in a built
model.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = ["TreeCoreAttention", "TreePackedSeqParams", "layer_spec", "swap", "tree_layers",
           "UnsupportedMegatron"]


class UnsupportedMegatron(ValueError, NotImplementedError):
    """A Megatron model or configuration treepack cannot run exactly on a tree."""


@dataclasses.dataclass
class TreePackedSeqParams(PackedSeqParams):
    """``packed_seq_params`` that carry a tree forward (:class:`~.forward.MegatronForward`) to
    every :class:`TreeCoreAttention` of the model."""

    tree: object = None


class TreeCoreAttention(MegatronModule):
    """A layer's core attention over a tree, or its stock core attention otherwise.

    Built from a layer spec with the stock module's arguments (``config``, ``layer_number``,
    ``attn_mask_type``, ``attention_type``, ``softmax_scale``, ``cp_comm_type``,
    ``pg_collection``, and whatever else a newer megatron-core passes); ``stock`` is the
    spec's original core attention (a class or a ``ModuleSpec``), built beside it where it can
    be (Megatron's local ``DotProductAttention`` refuses context parallelism: with CP > 1 on
    the local spec, only trees run).
    """

    latent = None  # multi-latent attention: its keys and values travel as latents (.latent)

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 *, stock=None, **kwargs):
        super().__init__(config=config)
        self._configure(config, layer_number, softmax_scale,
                        config.attention_dropout if attention_dropout is None
                        else attention_dropout)
        self.stock, self.stock_refusal = None, None
        if stock is not None:
            try:
                self.stock = stock(config=config, layer_number=layer_number,
                                   attn_mask_type=attn_mask_type, attention_type=attention_type,
                                   attention_dropout=attention_dropout,
                                   softmax_scale=softmax_scale, **kwargs)
            except AssertionError as e:  # the local spec under context parallelism
                self.stock_refusal = str(e)
            except TypeError as e:  # multi-latent attention's head widths (k_channels,
                if not {"k_channels", "v_channels"} & set(kwargs):  # v_channels), which
                    raise  # megatron-core 0.16's local DotProductAttention does not take
                self.stock_refusal = (
                    f"{getattr(stock, '__name__', stock)} takes no k_channels / v_channels "
                    f"({e}), which multi-latent attention passes: build the layer spec with "
                    "TransformerEngine's core attention for unpacked batches")
        self._own_sinks(config)

    @classmethod
    def around(cls, stock: torch.nn.Module, layer_number: int) -> TreeCoreAttention:
        """A tree core attention for a built model, with ``stock`` (the layer's built core
        attention) as its stock path."""
        out = cls.__new__(cls)
        MegatronModule.__init__(out, config=stock.config)
        scale = getattr(stock, "softmax_scale", None)
        if scale is not None and getattr(stock.config, "apply_query_key_layer_scaling", False):
            scale = scale * max(1, layer_number)  # DotProductAttention stored it divided
        out._configure(stock.config, layer_number, scale, stock.config.attention_dropout)
        out.stock, out.stock_refusal = stock, None
        out._own_sinks(stock.config)
        return out

    def _own_sinks(self, config) -> None:
        """Attention sinks (``softmax_type="learnable"``: one logit per head in every softmax
        denominator, attending to nothing). The offset is this module's parameter, named
        ``softmax_offset`` as Megatron's and TE's core attention name it (so checkpoints
        load either way); the stock module beside it reads the same tensor."""
        self.sink_kind = getattr(config, "softmax_type", "vanilla")
        if self.sink_kind != "learnable":
            return
        stock_offset = getattr(self.stock, "softmax_offset", None)
        if isinstance(stock_offset, torch.nn.Parameter):
            del self.stock._parameters["softmax_offset"]
            offset = stock_offset
        else:  # no stock module (the local spec under CP): the offset as Megatron makes it
            from megatron.core import parallel_state

            heads = config.num_attention_heads \
                // parallel_state.get_tensor_model_parallel_world_size()
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            offset = torch.nn.Parameter(torch.empty(heads, device=device,
                                                    dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(offset)
        self.softmax_offset = offset
        if self.stock is not None:  # read, not registered: one parameter, one name
            object.__setattr__(self.stock, "softmax_offset", offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's distributed checkpoint of this module: its children's and, for
        learnable sinks, ``softmax_offset`` split over the TP ranks by heads (axis 0), as
        Megatron's and TE's core attention save it (the default would save one rank's
        offsets as every rank's)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.sink_kind == "learnable":
            import inspect

            from megatron.core import parallel_state
            from megatron.core.transformer import utils

            make = utils.make_sharded_tensors_for_checkpoint
            groups = {"tp_group": getattr(self, "tp_group", None)
                      or parallel_state.get_tensor_model_parallel_group()}
            if hasattr(utils, "ensure_metadata_has_dp_cp_group"):
                groups["dp_cp_group"] = utils.ensure_metadata_has_dp_cp_group(
                    metadata)["dp_cp_group"]
            accepted = inspect.signature(make).parameters
            out.update(make({"softmax_offset": self.softmax_offset}, prefix,
                            {"softmax_offset": 0}, sharded_offsets,
                            **{k: v for k, v in groups.items() if k in accepted}))
        return out

    def _sinks(self, query: Tensor) -> Tensor | None:
        """This layer's sink logits per TP-local head, or None without sinks."""
        if self.sink_kind == "learnable":
            return self.softmax_offset
        if self.sink_kind == "off-by-one":  # a sink of logit 0: the "+1" in the denominator
            return query.new_zeros(query.shape[2])
        return None

    def _configure(self, config, layer_number: int, scale: float | None, dropout: float):
        """The layer's scale, dropout and window, and what it refuses."""
        self.layer_number = max(1, layer_number)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies
        # the scores back in float32: the same scores, so the plain scale here
        self.scale = scale if scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = dropout
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            left, right = config.window_size
            if right not in (0, -1, None):
                raise UnsupportedMegatron(
                    f"window_size={config.window_size} looks {right} positions ahead: a causal "
                    "tree attention sees ancestors only; use window_size=(left, 0)")
            self.window = None if left is None or left < 0 else left + 1
        self.refusal = None
        if getattr(config, "softmax_type", "vanilla") not in ("vanilla", "off-by-one",
                                                              "learnable"):
            self.refusal = (f"softmax_type={config.softmax_type!r} is not a tree backend's "
                            "softmax (vanilla, off-by-one and learnable sinks are)")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, **kwargs):
        tree = getattr(packed_seq_params, "tree", None)
        if tree is None:
            if self.stock is None:
                raise UnsupportedMegatron(
                    "this layer's core attention is treepack's, and its stock attention could "
                    f"not be built ({self.stock_refusal or 'no stock module'}): run ordinary "
                    "batches on a model built from the stock spec")
            return self.stock(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias,
                              packed_seq_params=packed_seq_params, **kwargs)
        if self.refusal is not None:
            raise UnsupportedMegatron(self.refusal)
        if attention_bias is not None:
            raise UnsupportedMegatron("an attention bias (ALiBi, relative positions) is not "
                                      "read by the tree backends")
        return tree.core_attention(self, query, key, value, scale=self.scale, window=self.window,
                           dropout=self.dropout if self.training else 0.0,
                           sinks=self._sinks(query))


def layer_spec(spec):
    """``spec`` with every self-attention's core attention a :class:`TreeCoreAttention`
    (its stock module kept as the stock path): a layer spec (``ModuleSpec``), a block spec
    (``TransformerBlockSubmodules``: several layer specs), a list of layer specs, or a hybrid
    stack spec (``ModuleSpec(MambaStack, MambaStackSubmodules(...))``).

    Args:
        spec: what ``get_gpt_layer_local_spec(...)``, ``get_gpt_layer_with_transformer_engine
            _spec(...)``, ``get_gpt_decoder_block_spec(...)`` return, or megatron-core's
            ``mamba_stack_spec`` (its TransformerEngine hybrid spec) or one like it.

    Returns:
        A copy of ``spec``, the core attentions replaced; everything else (TE's fused
        linears and norms, MoE, the Mamba2 mixers) unchanged.

    Raises:
        UnsupportedMegatron: a spec with no core attention to replace and no Gated DeltaNet
            or Mamba2 layer.
    """
    out = _copied(spec)
    if not _replace(out) and not _mixers(out):
        raise UnsupportedMegatron(
            f"found no core_attention in {type(spec).__name__}: pass a GPT layer spec "
            "(get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec) or a "
            "decoder block spec")
    return out


def _copied(node):
    """A copy of a spec's tree (``ModuleSpec``, the submodule dataclasses, their lists,
    tuples and ``params`` dicts); its leaves (module classes, functions) shared. A deep copy
    would copy whatever a spec holds, and cannot: TransformerEngine's classes are mocks where
    TE is absent, and some specs hold closures."""
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, params=_copied(node.params),
                                   submodules=_copied(node.submodules))
    if isinstance(node, (list, tuple)):
        items = [_copied(n) for n in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    if isinstance(node, dict):
        return {k: _copied(v) for k, v in node.items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _copied(getattr(node, f.name))
                                            for f in dataclasses.fields(node) if f.init})
    return node


def _mixers(node) -> int:
    """How many Gated DeltaNet and Mamba2 layers (token mixers
    :func:`treepack.megatron.prepare` runs on a tree without a core attention) are below
    ``node``: a pipeline stage, or a Mamba stack, may hold only those."""
    if isinstance(node, (list, tuple)):
        return sum(_mixers(n) for n in node)
    if isinstance(node, ModuleSpec):
        from treepack.adapters.megatron.recurrent import is_gated_delta_net, is_mamba_mixer

        return int(is_gated_delta_net(node.module) or is_mamba_mixer(node.module)) \
            + _mixers(node.submodules)
    if node is None or not dataclasses.is_dataclass(node):
        return 0
    return sum(_mixers(getattr(node, f.name)) for f in dataclasses.fields(node))


def _replace(node) -> int:
    """Replace every ``core_attention`` below ``node`` in place; how many."""
    if isinstance(node, (list, tuple)):
        return sum(_replace(n) for n in node)
    if isinstance(node, ModuleSpec):
        return _replace(node.submodules)
    if node is None or not dataclasses.is_dataclass(node):
        return 0
    count = 0
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if field.name == "core_attention":
            if not _is_tree(value):
                setattr(node, field.name, ModuleSpec(module=TreeCoreAttention,
                                                     params={"stock": value}))
            count += 1
        else:
            count += _replace(value)
    return count


def _is_tree(value) -> bool:
    module = value.module if isinstance(value, ModuleSpec) else value
    return isinstance(module, type) and issubclass(module, TreeCoreAttention)


def swap(model: torch.nn.Module) -> int:
    """Every self-attention's built core attention in ``model`` wrapped in a
    :class:`TreeCoreAttention` (the built one its stock path); how many layers there are."""
    count = 0
    for module in model.modules():
        core = getattr(module, "core_attention", None)
        if isinstance(core, torch.nn.Module) and not isinstance(core, TreeCoreAttention):
            module.core_attention = TreeCoreAttention.around(core, module.layer_number)
            count += 1
        elif isinstance(core, TreeCoreAttention):
            count += 1
    return count


def tree_layers(model: torch.nn.Module) -> list[TreeCoreAttention]:
    """The model's tree core attentions, in order."""
    return [m for m in model.modules() if isinstance(m, TreeCoreAttention)]
