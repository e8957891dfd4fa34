"""Megatron's Gated DeltaNet layers on a tree: the short convolution along each row's path,
the gated delta rule chain by chain from each parent's state.

megatron-core's ``GatedDeltaNet`` (``experimental_attention_variant="gated_delta_net"``, the
layers ``linear_attention_freq`` picks; Qwen3-Next and Qwen3.5 shape) refuses packed
sequences. :func:`install` gives each one a subclass whose forward, in a tree forward, runs
the layer's own steps on the forward's rows, two of them on the tree:

- ``in_proj`` (with its fused input norm, its TP split and its sequence-parallel gather),
  the split into q, k, v, the output gate, beta and alpha, the L2 norm of q and k, the
  repeated key heads, ``g`` and ``beta``, the gated norm and ``out_proj``: the layer's own
  modules, parameters and functions, as its forward uses them;
- the depthwise causal convolution over q, k and v: the forward's ``conv``
  (:func:`treepack.recurrent.tree_conv1d`: each row reads its ancestors), then the layer's
  activation;
- the gated delta rule: the forward's ``scan`` (:func:`treepack.recurrent.level_scan`: each
  chain of rows from its parent chain's final state), through the layer's own kernel
  (megatron-core's torch kernel in ``deterministic_mode``, fla's ``chunk_gated_delta_rule``
  otherwise) given ``initial_state`` and ``output_final_state``. Padding past a chain's end
  is zeros (``g`` and ``beta`` 0 keep a state), and the torch kernel's chunk is fitted to
  each level (:func:`treepack.recurrent.level_chunk`).

Any other forward is megatron-core's own. A tree in parts carries each layer's convolution
inputs and states across parts (:class:`treepack.forwards.PartForward`).
"""

from __future__ import annotations

import inspect
import sys

import torch.nn.functional as F

from treepack.core.compat import mixed_in
from treepack.recurrent import level_chunk

__all__ = ["install", "gated_delta_nets", "is_gated_delta_net"]


def _stock_gdn():
    """megatron-core's ``GatedDeltaNet`` class (None where this megatron-core has none)."""
    try:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    except ImportError:  # pragma: no cover - megatron-core without the experimental layer
        return None
    return GatedDeltaNet


def is_gated_delta_net(module) -> bool:
    """Whether ``module`` (a class, as a layer spec holds it) is megatron-core's
    ``GatedDeltaNet`` or a subclass of it."""
    cls = _stock_gdn()
    return cls is not None and isinstance(module, type) and issubclass(module, cls)


def gated_delta_nets(model) -> list:
    """The model's ``GatedDeltaNet`` layers, in order."""
    cls = _stock_gdn()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


class _TreeGDN:
    """Mixed into a ``GatedDeltaNet`` class (module doc)."""

    def forward(self, hidden_states, *args, **kwargs):
        tree = getattr(kwargs.get("packed_seq_params"), "tree", None)
        if tree is None:
            return super().forward(hidden_states, *args, **kwargs)
        return _tree_forward(self, tree, hidden_states)


def _kernels(layer):
    """The layer's L2 norm and gated delta rule (from the module that defines its class)."""
    module = sys.modules[_stock_gdn().__module__]
    rule = getattr(layer, "gated_delta_rule", None)  # megatron-core 0.19 on
    if rule is None:
        rule = (module.torch_chunk_gated_delta_rule if layer.config.deterministic_mode
                else module.chunk_gated_delta_rule)
    return getattr(module, "l2norm", None), rule


def _tree_forward(layer, tree, hidden_states):
    """One ``GatedDeltaNet`` layer over a tree forward's rows: ``hidden_states``
    ``[rows, 1, hidden]`` (this TP rank's share of them under sequence parallelism) in,
    ``(output, bias)`` out as the layer's forward returns them."""
    tree.calls += 1
    tp = layer.tp_size
    qk, v, heads = layer.qk_dim // tp, layer.v_dim // tp, layer.num_value_heads // tp
    mixed, _ = layer.in_proj(hidden_states)  # [rows, 1, in_proj_dim / TP]
    rows = mixed.shape[0]
    qkv, gate, beta, alpha = mixed[:, 0].split((2 * qk + v, v, heads, heads), -1)
    conv = layer.conv1d
    qkv = layer.act_fn(tree.conv(qkv, conv.weight[:, 0], conv.bias))
    query, key, value = qkv.split((qk, qk, v), -1)
    query = query.reshape(rows, -1, layer.key_head_dim)
    key = key.reshape(rows, -1, layer.key_head_dim)
    value = value.reshape(rows, -1, layer.value_head_dim)
    l2norm, rule = _kernels(layer)
    if layer.use_qk_l2norm:
        query, key = l2norm(query.contiguous()), l2norm(key.contiguous())
    repeat = layer.num_value_heads // layer.num_key_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, 1)
        key = key.repeat_interleave(repeat, 1)
    g = -layer.A_log.exp() * F.softplus(alpha.float() + layer.dt_bias)  # float32, as the layer
    chunked = "chunk_size" in inspect.signature(rule).parameters  # the torch kernel

    def kernel(batch, state):
        extra = {"chunk_size": level_chunk(64, batch["q"].shape[1])} if chunked else {}
        return rule(batch["q"], batch["k"], batch["v"], g=batch["g"], beta=batch["b"],
                    initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=False, **extra)

    out = tree.scan(kernel, {"q": query.contiguous(), "k": key.contiguous(),
                             "v": value.contiguous(), "g": g, "b": beta.sigmoid()})
    normed = layer._apply_gated_norm(out[None], gate.reshape(1, rows, -1, layer.value_head_dim))
    return layer.out_proj(normed.reshape(rows, 1, -1))


def install(model) -> int:
    """Give each ``GatedDeltaNet`` of ``model`` the tree forward (module doc); how many."""
    found = gated_delta_nets(model)
    for layer in found:
        mixed_in(layer, _TreeGDN)
    return len(found)
