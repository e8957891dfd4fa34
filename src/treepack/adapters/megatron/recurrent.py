"""Megatron's recurrent layers on a tree, Gated DeltaNet and Mamba2: the short convolution
along each row's path, the scan chain by chain from each parent's state.

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

megatron-core's ``MambaMixer`` (the ``M`` layers of a ``MambaModel``'s
``hybrid_override_pattern``: Nemotron-H's and Nemotron-3's shape) runs its training forward
as one fused kernel (``mamba_split_conv1d_scan_combined``: convolution, SSD scan, ``D`` and
the output gate), which cannot start a sequence from a state. Its tree forward runs the
layer's steps apart, as that kernel computes them:

- ``in_proj`` (its fused input norm, its TP split, its sequence-parallel gather), split into
  the gate ``z``, the convolution's channels ``x``, ``B``, ``C`` and the step ``dt``;
- the depthwise causal convolution: the forward's ``conv``, then the layer's activation;
- the SSD scan (``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``, in float32 or wider as
  the kernel computes them, then ``+ D x``): the forward's ``scan`` through mamba_ssm's
  ``mamba_chunk_scan_combined`` given ``initial_states`` where the layer's module has it,
  else :func:`treepack.recurrent.ssd_scan` (torch, chunked, the chunk fitted to each level);
  zeros past a chain's end (``dt`` 0) keep a state;
- ``y * silu(z)``, the layer's gated norm and ``out_proj``.

Any other forward is megatron-core's own. A tree in parts carries each layer's convolution
inputs and states across parts (:class:`treepack.forwards.PartForward`).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from treepack.core.compat import mixed_in
from treepack.recurrent import level_chunk, ssd_scan

__all__ = ["install", "gated_delta_nets", "is_gated_delta_net", "mamba_mixers",
           "is_mamba_mixer", "tree_mixers"]


_CLASSES = {"gdn": ("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"),
            "mamba": ("megatron.core.ssm.mamba_mixer", "MambaMixer")}


def _stock(kind: str):
    """megatron-core's ``GatedDeltaNet`` or ``MambaMixer`` class (:data:`_CLASSES`), or None
    where its module was never imported: a model or spec holding the class imported it, so
    nothing is imported here (Mamba's module needs Triton, and a forward asks every time)."""
    module, name = _CLASSES[kind]
    return getattr(sys.modules.get(module), name, None)


def _is(kind: str, module) -> bool:
    cls = _stock(kind)
    return cls is not None and isinstance(module, type) and issubclass(module, cls)


def _found(kind: str, model) -> list:
    cls = _stock(kind)
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def is_gated_delta_net(module) -> bool:
    """Whether ``module`` (a class, as a layer spec holds it) is megatron-core's
    ``GatedDeltaNet`` or a subclass of it."""
    return _is("gdn", module)


def gated_delta_nets(model) -> list:
    """The model's ``GatedDeltaNet`` layers, in order."""
    return _found("gdn", model)


def is_mamba_mixer(module) -> bool:
    """Whether ``module`` (a class, as a layer spec holds it) is megatron-core's
    ``MambaMixer`` or a subclass of it."""
    return _is("mamba", module)


def mamba_mixers(model) -> list:
    """The model's ``MambaMixer`` layers, in order."""
    return _found("mamba", model)


def tree_mixers(model) -> list:
    """The model's recurrent layers a tree forward runs (:func:`install`), in order."""
    classes = tuple(c for c in map(_stock, _CLASSES) if c is not None)
    return [m for m in model.modules() if isinstance(m, classes)] if classes else []


class _TreeRecurrent:
    """Mixed into a ``GatedDeltaNet`` or ``MambaMixer`` class (module doc): a tree forward
    (``packed_seq_params.tree``) runs ``on_tree(layer, tree, hidden_states)``, any other the
    layer's own."""

    on_tree = None

    def forward(self, hidden_states, *args, **kwargs):
        tree = getattr(kwargs.get("packed_seq_params"), "tree", None)
        if tree is None:
            return super().forward(hidden_states, *args, **kwargs)
        return type(self).on_tree(self, tree, hidden_states)


def _kernels(layer):
    """The layer's L2 norm and gated delta rule (from the module that defines its class)."""
    module = sys.modules[_stock("gdn").__module__]
    rule = getattr(layer, "gated_delta_rule", None)  # megatron-core 0.19 on
    if rule is None:
        rule = (module.torch_chunk_gated_delta_rule if layer.config.deterministic_mode
                else module.chunk_gated_delta_rule)
    return getattr(module, "l2norm", None), rule


@functools.lru_cache(maxsize=None)
def _takes_chunk(rule) -> bool:
    """Whether a gated delta rule takes ``chunk_size`` (megatron-core's torch kernel does,
    fla's does not); looked up once per kernel."""
    return "chunk_size" in inspect.signature(rule).parameters


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
    chunked = _takes_chunk(rule)  # the torch kernel

    def kernel(batch, state):
        extra = {"chunk_size": level_chunk(64, batch["q"].shape[1])} if chunked else {}
        return rule(batch["q"], batch["k"], batch["v"], g=batch["g"], beta=batch["b"],
                    initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=False, **extra)

    out = tree.scan(kernel, {"q": query.contiguous(), "k": key.contiguous(),
                             "v": value.contiguous(), "g": g, "b": beta.sigmoid()})
    normed = layer._apply_gated_norm(out[None], gate.reshape(1, rows, -1, layer.value_head_dim))
    return layer.out_proj(normed.reshape(rows, 1, -1))


def _tree_mamba(layer, tree, hidden_states):
    """One ``MambaMixer`` over a tree forward's rows: ``hidden_states`` ``[rows, 1, hidden]``
    (this TP rank's share under sequence parallelism) in, ``(output, bias)`` out as the
    layer's forward returns them."""
    tree.calls += 1
    inner, groups = layer.d_inner_local_tp, layer.ngroups_local_tp
    heads, state, width = layer.nheads_local_tp, layer.d_state, layer.headdim
    mixed, _ = layer.in_proj(hidden_states)  # [rows, 1, in_proj_dim / TP]
    rows = mixed.shape[0]
    z, xbc, dt = mixed[:, 0].split((inner, inner + 2 * groups * state, heads), -1)
    conv = layer.conv1d
    xbc = layer.act(tree.conv(xbc, conv.weight[:, 0], conv.bias))
    x, B, C = xbc.split((inner, groups * state, groups * state), -1)
    compute = torch.promote_types(x.dtype, torch.float32)  # as the fused kernel computes
    dt = F.softplus(dt.to(compute) + layer.dt_bias.float().to(compute))  # 0 past a chain
    A = -layer.A_log.float().exp()
    D = layer.D.float().view(heads, width) if layer.D_has_hdim else layer.D
    fused = getattr(sys.modules[_stock("mamba").__module__], "mamba_chunk_scan_combined",
                    None)  # mamba_ssm's, where installed

    def kernel(batch, start):
        if fused is not None:
            return fused(batch["x"], batch["dt"], batch["A"], batch["B"], batch["C"],
                         layer.chunk_size, D=batch["D"], initial_states=start,
                         return_final_states=True)
        return ssd_scan(batch["x"], batch["dt"], batch["A"], batch["B"], batch["C"],
                        batch["D"], start, chunk=level_chunk(layer.chunk_size,
                                                             batch["x"].shape[1]))

    y = tree.scan(kernel, {"x": x.reshape(rows, heads, width), "dt": dt,
                           "B": B.reshape(rows, groups, state),
                           "C": C.reshape(rows, groups, state)}, per_head={"A": A, "D": D})
    y = (y.reshape(rows, inner).to(compute) * F.silu(z.to(compute))).to(x.dtype)[:, None]
    if layer.rmsnorm:
        y = layer.norm(y)
    return layer.out_proj(y)


def install(model) -> int:
    """Give each ``GatedDeltaNet`` and ``MambaMixer`` of ``model`` the tree forward (module
    doc); how many."""
    gdn, mamba = gated_delta_nets(model), mamba_mixers(model)
    for layer in gdn:
        mixed_in(layer, _TreeRecurrent, on_tree=_tree_forward)
    for layer in mamba:
        mixed_in(layer, _TreeRecurrent, on_tree=_tree_mamba)
    return len(gdn) + len(mamba)
