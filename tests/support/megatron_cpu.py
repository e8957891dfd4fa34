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
parallelism on a CPU).
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
