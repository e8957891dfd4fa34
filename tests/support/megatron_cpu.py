"""megatron-core on a CPU, for the tests only (never in the library): megatron-core assumes
CUDA in a few places that have nothing to do with what the tests check.

- ``torch.cuda.current_device()`` is the CPU (the rotary embedding moves its frequencies to
  it; buffers are allocated on it);
- the model-parallel RNG tracker keeps CPU generator states (Megatron's forks CUDA ones);
- ``torch.cuda.synchronize`` does nothing (pipeline p2p calls it), and CUDA streams are one
  stream that waits for nothing (the MoE all-to-all dispatcher's side stream);
- ``moe_utils.te_general_gemm`` is None without TransformerEngine (megatron-core 0.16's router
  reads the name unguarded, a ``NameError`` without TE), and the all-to-all dispatcher's split
  sizes reach ``all_to_all_single`` as numpy, as they do from a GPU;
- a ``TorchFunctionMode`` maps ``device="cuda"`` to the CPU, ``.cuda()`` to nothing and drops
  ``pin_memory`` (the causal and sliding-window masks, the CP rotary slice, the pipeline
  schedule's buffers).

:class:`Norm` is the RMSNorm the tests' layer specs use (torch's refuses Megatron's sequence
parallelism on a CPU). For mbridge's Qwen2.5-VL: :class:`BlockAttention`, its vision tower's
core attention, and :func:`mbridge_vl_attention`, its attention on megatron-core 0.16.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _CPUTracker:
    """megatron's CudaRNGStatesTracker on CPU generator states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_, self.seeds_, self._is_initialized = {}, set(), False
        self._current_state_name = "default-rng"

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _CUDAToCPU(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:  # .cuda(): stays where it is
            return args[0]
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (device == "cuda" or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream that is the CPU's one stream: waits and records do nothing."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # an event that is already done: synchronize() does nothing

    def __eq__(self, other) -> bool:
        return isinstance(other, _Stream)

    __hash__ = object.__hash__


_STREAM = _Stream()


def install() -> None:
    """Every stand-in above, for this process."""
    from megatron.core.tensor_parallel import random

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    # the MoE all-to-all dispatcher copies its splits to the host on a side stream
    torch.cuda.Stream = lambda *a, **k: _STREAM
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 reads it unguarded
        moe_utils.te_general_gemm = None  # when TransformerEngine is not installed
    from megatron.core.transformer.moe import token_dispatcher

    to_host = moe_utils.maybe_move_tensor_to_cpu

    def host(tensor, as_numpy=False, record_stream=False):  # CPU tensors too: the
        if torch.is_tensor(tensor) and as_numpy:  # dispatcher's split sizes as numpy
            return tensor.detach().cpu().numpy()
        return to_host(tensor, as_numpy, record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = host
    mla_without_te()
    tracker = _CPUTracker()
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    random.initialize_rng_tracker = lambda *a, **k: None
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    _CUDAToCPU().__enter__()  # for the rest of the process


def mla_without_te() -> None:
    """Without TransformerEngine, megatron-core 0.16 finds mocks of TE's classes, sets
    ``HAVE_TE`` in its multi-latent attention module and asks ``isinstance`` of a mock when
    it builds MLA: say TE is absent there (a CPU, or a GPU image without TE)."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.HAVE_TE = False


class ReferenceAttention(torch.nn.Module):
    """The reference's core attention where Megatron's local one cannot be built: softmax
    attention over ``[s, b, heads, d]`` with the layer's mask (True: masked), one head
    width for queries and keys and another for values (multi-latent attention passes
    ``k_channels`` / ``v_channels``, which megatron-core 0.16's ``DotProductAttention`` does
    not take). TP = 1 only."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, **kwargs):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale
        weights = scores.masked_fill(attention_mask, float("-inf")).softmax(-1)
        out = torch.einsum("bhst,tbhd->sbhd", weights, value)
        return out.reshape(*out.shape[:2], -1)


@contextlib.contextmanager
def replaying(model, routes):
    """Megatron's own routing replay for one forward of ``model`` (PP = 1): each router
    replays ``routes[..., its MoE layer, :]`` (``[tokens, moe_layers, topk]`` in the order
    its router sees the tokens); nothing where ``routes`` is None."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    replays = [m.router_replay for m in routers]
    every = routes.shape[1] == model.config.num_layers  # one route per layer, or per MoE one
    assert every or len(replays) == routes.shape[1]
    for i, (router, replay) in enumerate(zip(routers, replays)):
        column = router.layer_number - 1 if every else i
        replay.set_target_indices(torch.as_tensor(routes[:, column]).long())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


def recorded(model, *args) -> "np.ndarray":
    """``model(*args)`` (no gradients) routing natively, Megatron's ``RouterReplay`` recording:
    each token's route, ``[tokens, moe_layers, topk]`` (PP = 1)."""
    import numpy as np
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    for replay in replays:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            model(*args)
        return np.stack([r.get_recorded_indices().cpu().numpy() for r in replays], 1)
    finally:
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


class Norm(torch.nn.Module):
    """RMSNorm for Megatron's sequence parallelism on a CPU: the local spec's torch norm
    refuses ``sequence_parallel`` (Apex's and TE's accept it). Its weight is marked as
    Megatron marks a sequence-parallel norm's, whose gradient each TP rank holds a share of
    (``finalize_model_grads`` sums them)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def fused_norm_linear():
    """TransformerEngine's ``TELayerNormColumnParallelLinear`` on a CPU: an RMSNorm fused
    before megatron-core's ``ColumnParallelLinear``, its attributes named as TE's
    ``LayerNormLinear`` names them (``layer_norm_weight``, ``layer_norm_bias``,
    ``normalization``, ``eps``, ``zero_centered_gamma``). TE's MLA spec puts it in
    ``linear_kv_up_proj`` with ``qk_layernorm``. Its norm runs on the rows this rank holds
    (under sequence parallelism, before the linear gathers them), in float32 or wider."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class FusedNormLinear(ColumnParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.normalization, self.eps = "RMSNorm", config.layernorm_epsilon
            self.zero_centered_gamma = False
            self.layer_norm_weight = torch.nn.Parameter(
                1 + 0.1 * torch.randn(input_size, dtype=config.params_dtype))
            self.layer_norm_weight.sequence_parallel = config.sequence_parallel
            self.layer_norm_bias = None

        def forward(self, x, *args, **kwargs):
            y = x.to(torch.promote_types(x.dtype, torch.float32))
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            return super().forward((y * self.layer_norm_weight.to(y.dtype)).to(x.dtype), *args,
                                   **kwargs)

    return FusedNormLinear


def gdn_without_fla() -> None:
    """megatron-core 0.16's ``GatedDeltaNet`` refuses to build without fla (flash-linear-
    attention, Triton kernels: no CPU). In ``deterministic_mode`` it runs megatron-core's own
    torch kernel and needs only fla's ``l2norm``: given here in torch (fla's:
    ``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension); the kernel at float64 for float64
    inputs (:func:`_at_input_precision`)."""
    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA:
        return

    def l2norm(x, dim: int = -1, eps: float = 1e-6):
        return x * torch.rsqrt(x.pow(2).sum(dim, keepdim=True) + eps)

    gated_delta_net.HAVE_FLA, gated_delta_net.l2norm = True, l2norm
    gated_delta_net.torch_chunk_gated_delta_rule = _at_input_precision(
        gated_delta_net.torch_chunk_gated_delta_rule)


def _at_input_precision(kernel):
    """megatron-core's torch gated delta rule computing at float32 or its inputs' precision
    if wider (float64 in the tests) where it casts them to float32: built from the installed
    kernel's own source, that one cast changed. The tree and every sequence alone are then
    compared at float64, and a wrong state shows at 1e-6, not under the float32 rounding a
    scan sums (the layer's own float32 ``g`` stays); float32 and bfloat16 runs (the bench)
    compute as megatron-core's. A megatron-core whose kernel casts otherwise fails here, by
    name."""
    import inspect

    from megatron.core.ssm import gated_delta_net

    source = inspect.getsource(kernel)
    cast = ".to(torch.float32) for x in (query, key, value, beta, g)"
    if source.count(cast) != 1:
        raise RuntimeError("megatron-core's torch_chunk_gated_delta_rule no longer casts its "
                           f"inputs with {cast!r}: update megatron_cpu._at_input_precision")
    namespace = dict(vars(gated_delta_net))
    exec(source.replace(cast, ".to(torch.promote_types(query.dtype, torch.float32)) for x in "
                              "(query, key, value, beta, g)"), namespace)
    return namespace[kernel.__name__]


def gdn_layer(kind):
    """``kind`` (a local layer spec) with a Gated DeltaNet for its self-attention, as
    megatron-core's experimental block spec builds one from TransformerEngine (which a CPU
    lacks): the input norm fused into ``in_proj`` (:func:`fused_norm_linear`), ``out_norm``
    (:class:`Norm`) and a row-parallel ``out_proj``."""
    import copy

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    gdn_without_fla()
    out = copy.deepcopy(kind)
    out.submodules.input_layernorm = IdentityOp
    out.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=(
        GatedDeltaNetSubmodules(in_proj=fused_norm_linear(), out_norm=Norm,
                                out_proj=RowParallelLinear)))
    return out


def mamba_without_ssm(chunked: bool = False) -> None:
    """megatron-core 0.16's ``MambaMixer`` refuses to build without mamba_ssm (Triton
    kernels: no CPU) and its module imports Triton. Given here in torch:

    - ``mamba_split_conv1d_scan_combined``, the fused training kernel (convolution, SSD
      scan, ``D``, the output gate ``y * silu(z)``): the convolution by ``F.conv1d``, the
      scan one token at a time (``reference.naive_ssd``, a reference that shares nothing with
      the tree's chunked scan), or in chunks (``chunked``: ``treepack.recurrent.ssd_scan``,
      the bench's stock runs, as fast as the tree's); at float32 or the inputs' precision if
      wider, as mamba_ssm's computes in float32;
    - ``RMSNormGated`` (the layer's grouped norm): RMS over each group of channels, times the
      weight (``z`` gates before the norm, ``norm_before_gate=False``);
    - the final norm (``TENorm`` in ``MambaStack``): :class:`Norm`;
    - Megatron's Triton tensor ops of dynamic inference (never called in training): absent.
    """
    import sys
    import types

    name = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
    try:
        import triton  # noqa: F401
    except ImportError:
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.tensor_get_slice_after = stub.tensor_masked_update = stub.tensor_merge = None
            sys.modules[name] = stub
    from megatron.core.ssm import mamba_block, mamba_mixer

    if mamba_mixer.HAVE_MAMBA_SSM and not getattr(mamba_mixer, "_treepack_stand_in", False):
        return  # mamba_ssm's own kernels
    mamba_mixer.HAVE_MAMBA_SSM = mamba_mixer._treepack_stand_in = True
    mamba_mixer.mamba_split_conv1d_scan_combined = _split_conv1d_scan(chunked)
    mamba_mixer.ExtendedRMSNorm = GatedNorm
    mamba_block.TENorm = Norm


def _split_conv1d_scan(chunked: bool):
    import torch.nn.functional as F

    def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                         chunk_size, seq_idx=None, activation="silu",
                                         headdim=None, ngroups=1, norm_before_gate=True,
                                         dt_limit=(0.0, float("inf")), **kwargs):
        assert seq_idx is None and activation == "silu", "a packed batch: not modelled here"
        assert not {k for k, v in kwargs.items() if v not in (None, False)}, kwargs
        b, length, _ = zxbcdt.shape
        heads = dt_bias.shape[0]
        width = headdim if D.dim() == 1 else D.shape[1]
        inner, channels = heads * width, conv1d_weight.shape[0]
        state = (channels - inner) // (2 * ngroups)
        z, xbc, dt = zxbcdt.split((inner, channels, heads), -1)
        xbc = F.conv1d(xbc.transpose(1, 2), conv1d_weight[:, None], conv1d_bias,
                       padding=conv1d_weight.shape[1] - 1, groups=channels)[..., :length]
        x, B, C = F.silu(xbc).transpose(1, 2).split((inner, ngroups * state,
                                                     ngroups * state), -1)
        compute = torch.promote_types(zxbcdt.dtype, torch.float32)
        dt = F.softplus(dt.to(compute) + dt_bias.to(compute)).clamp(*dt_limit)
        x = x.reshape(b, length, heads, width).to(compute)
        B, C = (t.reshape(b, length, ngroups, state).to(compute) for t in (B, C))
        if chunked:
            from treepack.recurrent import ssd_scan

            y, _ = ssd_scan(x, dt, A, B, C, D, chunk=chunk_size)
        else:
            from reference import naive_ssd

            y, _ = naive_ssd(x, dt, A.to(compute), B, C, D.to(compute))
        y = y.reshape(b, length, inner) * F.silu(z.to(compute))
        return y.to(zxbcdt.dtype)

    return mamba_split_conv1d_scan_combined


class GatedNorm(torch.nn.Module):
    """mamba_ssm's ``RMSNormGated`` (megatron-core's ``ExtendedRMSNorm``) in torch: RMS over
    each ``group_size`` channels, times the weight; ``z``, if given, gates first
    (``norm_before_gate=False``, which megatron-core asserts)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=False,
                 device=None, dtype=None):
        super().__init__()
        assert not norm_before_gate
        self.eps, self.group_size = eps, group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x, z=None):
        if z is not None:
            x = x * torch.nn.functional.silu(z)
        shape = x.shape
        x = x.reshape(*shape[:-1], -1, self.group_size)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.reshape(shape) * self.weight


def hybrid_stack_spec(pattern_fields: dict | None = None, chunked: bool = False):
    """megatron-core's hybrid stack spec (``mamba_stack_spec``: Mamba2, attention, MLP and MoE
    layers) from local modules, as its TransformerEngine spec lays them out: each layer's
    input norm fused into its first linear (:func:`fused_norm_linear`), row-parallel second
    linears, Megatron's local core attention (:func:`mamba_without_ssm` first, ``chunked``
    as it takes it). ``pattern_fields``: extra ``params`` of the Mamba mixer (its
    ``chunk_size``)."""
    mamba_without_ssm(chunked)
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                             TransformerLayerSubmodules)

    fused = fused_norm_linear()
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            mixer=ModuleSpec(module=MambaMixer, params=dict(pattern_fields or {}),
                             submodules=MambaMixerSubmodules(in_proj=fused,
                                                             out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(linear_qkv=fused,
                                                   core_attention=DotProductAttention,
                                                   linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fused,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add))))


# ------------------------------------------------------------- vision-language models

class BlockAttention(torch.nn.Module):
    """The vision tower's core attention on a CPU: each ``cu_seqlens`` block attends within
    itself both ways (``[t, heads, d]`` or ``[t, 1, heads, d]`` in, ``[t, 1, heads x d]``
    out)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, **kwargs):
        super().__init__()
        self.scale = softmax_scale or config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if query.dim() == 4:
            query, key, value = query[:, 0], key[:, 0], value[:, 0]
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        out = torch.zeros_like(query)
        for a, b in zip(bounds[:-1], bounds[1:]):
            scores = torch.einsum("qhd,khd->hqk", query[a:b], key[a:b]) * self.scale
            out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[a:b])
        return out.reshape(out.shape[0], 1, -1)


def mbridge_vl_attention() -> None:
    """mbridge's Qwen2.5-VL attention, taking (and dropping) ``rotary_pos_cos_sin``."""
    from mbridge.models.qwen2_5_vl import model as vl

    base = vl.Qwen2_5VLSelfAttention
    if getattr(base, "_treepack_shim", False):
        return

    class Qwen2_5VLSelfAttention(base):
        _treepack_shim = True

        def forward(self, *args, rotary_pos_cos_sin=None, **kwargs):
            assert rotary_pos_cos_sin is None, "fused rotary cos / sin: not in training"
            return super().forward(*args, **kwargs)

    vl.Qwen2_5VLSelfAttention = Qwen2_5VLSelfAttention
