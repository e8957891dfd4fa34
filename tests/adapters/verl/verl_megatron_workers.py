"""verl's real Megatron engine on CPU, for tests/adapters/test_verl_megatron.py (spawned ranks
import this module).

verl 0.9.1's Megatron engine builds its model with mbridge (``vanilla_mbridge=True``) from a
Hugging Face checkpoint. The test-only adjustments, none of which changes verl's, mbridge's or
megatron-core's code on disk:

- the CPU platform of :mod:`verl_workers` and the megatron-core stand-ins of
  :mod:`megatron_cpu`;
- mbridge's layer spec built with ``use_transformer_engine=False`` (megatron-core's local
  spec: no TransformerEngine here), its core attention :class:`THDAttention`, its norms
  :class:`megatron_cpu.Norm` (torch's refuses sequence parallelism), and mbridge's
  Qwen2 and Qwen2/3-MoE name maps given the local spec's separate norms (``input_layernorm``,
  ``pre_mlp_layernorm``; TE fuses them into the linear layers), MoE experts named as TE's
  grouped ones (:class:`NamedExperts`), and the router's aux-loss-free ``expert_bias``
  (a buffer, zero at the start) not read from Qwen's checkpoints, which have none;
- ``Tensor.type()`` names CPU tensors as CUDA ones (megatron-core's optimizer and gradient
  clipping assert it);
- ``dtype="float32"``: verl's config admits bfloat16 and float16 only; the tests compare in
  float32, set after that check, so both engines compute in float32 and agree to rounding.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist

import verl_workers  # noqa: F401  (installs the CPU platform first)
import megatron_cpu
from megatron_cpu import Norm

megatron_cpu.install()

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.workers.config import (HFModelConfig, McoreEngineConfig,  # noqa: E402
                                 McoreOptimizerConfig)


class _GatherRows(torch.autograd.Function):
    """Every context-parallel rank's rows, in rank order; backward: each rank's share of the
    summed gradient (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


class THDAttention(DotProductAttention):
    """megatron-core's local core attention, which refuses packed sequences, plus verl's THD
    micro-batches: each sequence (``cu_seqlens_q_padded``) causal and alone, grouped query
    heads repeated. Under context parallelism each rank holds verl's zigzag share of every
    sequence (of its padded length ``L``, halves ``h = L / 2CP``: rows ``[h r, h (r + 1))``
    and ``[L - h (r + 1), L - h r)`` on rank ``r``); keys and values are gathered over the CP
    group, differentiably. Stock verl's reference here, as TE's attention is on a GPU."""

    def __init__(self, config, *args, **kwargs):
        local = copy.copy(config)  # the local attention asserts CP = 1; this one gathers
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None and attention_mask is not None and \
                attention_mask.dim() == 2 and attention_mask.dtype == torch.bool:
            return _causal_rows(query, key, value, attention_mask, self.softmax_scale)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        bounds = packed_seq_params.cu_seqlens_q_padded
        if bounds is None:
            bounds = packed_seq_params.cu_seqlens_q
        bounds = bounds.tolist()
        cp, r = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
        if cp > 1:
            group = mpu.get_context_parallel_group()
            key, value = (_GatherRows.apply(t, group).view(cp, -1, *t.shape[1:])
                          for t in (key, value))
        else:
            key, value = key[None], value[None]
        repeat = query.shape[1] // key.shape[2]
        out = query.new_zeros(query.shape)
        for start, stop in zip(bounds[:-1], bounds[1:]):
            length, a, b = stop - start, start // cp, stop // cp
            # the global position of each of this rank's rows, and of every rank's rows
            where = _zigzag(r, cp, length)
            every = torch.cat([_zigzag(j, cp, length) for j in range(cp)])
            k, v = (torch.zeros(length, *t.shape[2:], dtype=t.dtype).index_put(
                (every,), t[:, a:b].flatten(0, 1)) for t in (key, value))
            q = query[a:b].transpose(0, 1)
            k, v = (t.repeat_interleave(repeat, 1).transpose(0, 1) for t in (k, v))
            mask = where[:, None] >= torch.arange(length)[None]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.softmax_scale)
            out[a:b] = o.transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def _causal_rows(query, key, value, keep, scale) -> torch.Tensor:
    """verl's ``bshd`` vision-language micro-batches (``[length, batch, heads, d]``, ``keep``
    ``[batch, length]`` True on each row's tokens): causal, grouped query heads repeated; a
    row's padding sits at its tail, where no token of the row reads it."""
    lengths = keep.sum(-1)
    assert torch.equal(keep, torch.arange(keep.shape[1])[None] < lengths[:, None]), \
        "padding before a row's end"
    repeat = query.shape[2] // key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key.repeat_interleave(repeat, 2),
                                                value.repeat_interleave(repeat, 2)))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           scale=scale)
    return out.permute(2, 0, 1, 3).flatten(2)


def _zigzag(rank: int, cp: int, length: int) -> torch.Tensor:
    """The positions in its sequence (of padded ``length``) of the rows verl gives CP
    ``rank``."""
    if cp == 1:
        return torch.arange(length)
    half = length // (2 * cp)
    return torch.cat((torch.arange(half * rank, half * (rank + 1)),
                      torch.arange(length - half * (rank + 1), length - half * rank)))


class NamedExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP`` (one local MLP per expert) with its parameters named
    as TransformerEngine's grouped experts name theirs (``linear_fc1.weight{i}``,
    ``linear_fc2.weight{i}``), the names mbridge's MoE bridges map: the same parameters,
    computed as ``SequentialMLP`` computes them (no grouped GEMM on a CPU)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        experts = list(self.local_experts)
        del self._modules["local_experts"]
        self.local_experts = experts  # computed by, no longer registered under, the experts
        for name in ("linear_fc1", "linear_fc2"):
            holder = torch.nn.Module()
            for i, expert in enumerate(experts):
                holder.register_parameter(f"weight{i}", getattr(expert, name).weight)
            self.add_module(name, holder)


def _local_spec(self, vp_stage=None):
    """mbridge's ``_get_transformer_layer_spec`` on megatron-core's local spec (MoE layers'
    experts as :class:`NamedExperts`)."""
    extra = {}
    if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters:
        extra["vp_stage"] = vp_stage
    self.has_vp_stage = bool(extra)
    config = copy.copy(self.config)
    config.moe_grouped_gemm = False  # megatron-core's local spec: SequentialMLP experts
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **extra)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = THDAttention
        if config.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = Norm
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = Norm
        experts = getattr(getattr(layer.submodules.mlp, "submodules", None), "experts", None)
        if experts is not None:
            experts.module = NamedExperts
    spec.layer_norm = Norm
    return spec


def _cuda_type(self, dtype=None, *args, **kwargs):
    """``Tensor.type()`` as on a GPU (``torch.cuda.FloatTensor``): megatron-core's optimizer
    and gradient clipping check parameters by it; with arguments, a conversion as usual."""
    if dtype is not None or args or kwargs:
        return _TYPE(self, dtype, *args, **kwargs)
    name = _TYPE(self)  # (megatron_cpu's torch-function mode may call this one back)
    return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)


_TYPE = torch.Tensor.type


def install() -> None:
    """The mbridge adjustments above, and ``Tensor.type`` for megatron-core's optimizer, for
    this process."""
    torch.Tensor.type = _cuda_type
    from mbridge.core import llm_bridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    llm_bridge.LLMBridge._get_transformer_layer_spec = _local_spec
    local_to_global = Qwen2MoEBridge._weight_name_mapping_mcore_local_to_global

    def without_expert_bias(self, model, *args, **kwargs):  # a buffer Qwen's checkpoints lack
        return {k: v for k, v in local_to_global(self, model, *args, **kwargs).items()
                if not k.endswith("router.expert_bias")}

    Qwen2MoEBridge._weight_name_mapping_mcore_local_to_global = without_expert_bias
    for bridge in (Qwen2Bridge, Qwen2MoEBridge):  # (Qwen3-MoE's is Qwen2-MoE's)
        bridge._OTHER_MAPPING = dict(
            getattr(bridge, "_OTHER_MAPPING", {}),
            **{"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]})
        bridge._MLP_MAPPING = dict(
            bridge._MLP_MAPPING,
            **{"pre_mlp_layernorm.weight":
               ["model.layers.{layer_number}.post_attention_layernorm.weight"]})


install()


def engine_config(dtype: str = "float32", **fields) -> McoreEngineConfig:
    """verl's Megatron engine config, computing in ``dtype`` (float32 set after verl's dtype
    check, which admits bfloat16 and float16 only)."""
    config = McoreEngineConfig(**fields)
    object.__setattr__(config, "dtype", dtype)
    return config


def make_engine(engine_cls, path: str, *, tp: int = 1, pp: int = 1, cp: int = 1,
                lr: float = 1e-2, dtype: str = "float32", **fields):
    """verl's Megatron engine as its workers build it (mbridge, vanilla), on CPU in ``dtype``,
    SGD at ``lr`` (verl_workers.optimizer_settings); ``fields`` of its engine config. mbridge
    switches Megatron's sequence parallelism on wherever TP > 1."""
    config = dict(vanilla_mbridge=True, seed=42, use_dynamic_bsz=True,
                  max_token_len_per_gpu=96, infer_max_token_len_per_gpu=96,
                  micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  context_parallel_size=cp, use_distributed_optimizer=False) | fields
    engine = engine_cls(
        model_config=HFModelConfig(path=path, use_remove_padding=True),
        engine_config=engine_config(dtype, **config),
        optimizer_config=McoreOptimizerConfig(**verl_workers.optimizer_settings(lr, "sgd")),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


# ------------------------------------------------------------------------------ comparisons

def _grads(engine) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter's gradient (Megatron DDP's ``main_grad``, reduced
    over the data-parallel ranks), by name."""
    out = {}
    for i, chunk in enumerate(engine.module):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            name = name.replace("module.", "")  # DDP's, and Float16Module's in bfloat16
            out[f"{i}.{name}"] = (torch.zeros_like(p) if g is None else g).detach().clone()
    return out


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max |want| over every rank's paired tensors (a collective)."""
    diff = max((float((a - b).abs().max()) for a, b in zip(got, want, strict=True)),
               default=0.0)
    scale = max((float(b.abs().max()) for b in want), default=0.0)
    return _max(diff) / max(_max(scale), 1e-30)


def grad_error(got: dict, want: dict) -> float:
    """max over parameters of max |got - want| / max |want|, each parameter's shards over
    every rank that holds one (pipeline stages hold different parameters: a collective)."""
    mine = {k: (float((got[k] - w).abs().max()), float(w.abs().max())) for k, w in want.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mpu.get_pipeline_model_parallel_rank(), mine))
    merged: dict = {}
    for stage, part in every:
        for k, (diff, scale) in part.items():
            old = merged.get((stage, k), (0.0, 0.0))
            merged[stage, k] = (max(old[0], diff), max(old[1], scale))
    return max(diff / max(scale, 1e-30) for diff, scale in merged.values())


def compare_engines(rank: int, world: int, port: int, model_dir: str, out_path: str,
                    tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None,
                    budget: int | None = None, loss_scale: float | None = None) -> None:
    """Stock ``MegatronEngineWithLMHead`` vs ``TreepackMegatronEngine`` at TP x PP x CP (the
    rest data-parallel; ``vpp`` virtual stages per pipeline stage) on the same batches, under
    a token budget per GPU (``budget``: ``max_token_len_per_gpu``; verl's default here 96);
    rank 0 saves the measured errors."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.utils.padding import response_from_nested

    import treepack.verl as treepack_verl
    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import (actor_loss, captured_log, init, make_batch, make_rows,
                              ref_and_advantages, save, shard)

    init(rank, world, port)
    try:
        treepack_verl.register_megatron(devices=("cpu",))
        layout = dict(tp=tp, pp=pp, cp=cp, virtual_pipeline_model_parallel_size=vpp)
        if budget is not None:
            layout.update(max_token_len_per_gpu=budget, infer_max_token_len_per_gpu=budget)
        stock = make_engine(MegatronEngineWithLMHead, model_dir, **layout)
        tree = make_engine(TreepackMegatronEngine, model_dir, **layout)
        if loss_scale is not None:  # as a float16 optimizer scales the loss (grad_scale_func)
            from megatron.core.utils import get_model_config

            for engine in (stock, tree):
                get_model_config(engine.module[0]).grad_scale_func = \
                    lambda loss: loss * loss_scale
        result_chunks = len(tree.module)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        rows = make_rows()
        result = {"registered": type(tree).__name__, "dp": dp, "chunks": result_chunks}
        log = captured_log()

        def infer(engine, **kw):
            data = shard(make_batch(rows, engine, forward_only=True, **kw), dp_rank, dp)
            with engine.eval_mode():
                return engine.forward_backward_batch(data, None, forward_only=True)

        def outputs(engine, **kw):
            out = infer(engine, **kw)
            if not last:
                return [], [], out
            # each row's last position predicts nothing; stock verl fills it from the next row
            lp = [t[:-1] for t in out["model_output"]["log_probs"].unbind()]
            return lp, list(out["model_output"]["entropy"].unbind()), out

        # 1. log-probs and entropy, one temperature, then one per row; a fixed micro-batch
        for name, kw in (("scalar", dict(temperature=0.7)),
                         ("per_row", dict(temperature=0.5 + torch.arange(len(rows)) % 3 / 4)),
                         ("fixed_size", dict(use_dynamic_bsz=False,
                                             micro_batch_size_per_gpu=3))):
            want_lp, want_ent, _ = outputs(stock, **kw)
            got_lp, got_ent, out = outputs(tree, **kw)
            result[f"log_probs_{name}"] = relative(got_lp, want_lp)
            result[f"entropy_{name}"] = relative(got_ent, want_ent)
            if name == "scalar" and last:
                result["token_ratio"] = out["metrics"]["treepack/token_ratio"]

        # 2. the update: verl's ppo_loss (clip, KL, entropy) under two aggregations
        base = infer(stock, temperature=1.0)
        g = torch.Generator().manual_seed(1)
        full = make_batch(rows, stock, True)
        noise = [0.3 * torch.randn(len(r["mask"]), generator=g) for r in rows]
        if last:
            got = response_from_nested(base["model_output"]["log_probs"],
                                       shard(full, dp_rank, dp)["response_mask"])
            mine = [t.detach() for t in got.unbind()]
        else:
            mine = None
        # every rank's old log-probs: the last stage's, broadcast over the pipeline
        every = [None] * world
        dist.all_gather_object(every, (dp_rank, last, mine))
        per_dp = {d: m for d, is_last, m in every if is_last}
        old = [t + n for t, n in zip([t for d in range(dp) for t in per_dp[d]], noise)]
        ref, adv = ref_and_advantages(old, rows, g)
        for mode in ("seq-mean-token-mean", "token-mean"):  # the last one steps
            losses, grads, norms = {}, {}, {}
            for label, engine in (("stock", stock), ("tree", tree)):
                data = shard(make_batch(rows, engine, False, temperature=1.0, old_log_probs=old,
                                        ref_log_prob=ref, advantages=adv), dp_rank, dp)
                with engine.train_mode():
                    engine.optimizer_zero_grad()
                    out = engine.forward_backward_batch(data, actor_loss(mode, len(rows)))
                    loss = torch.tensor([float(sum(out.get("loss", [])))], dtype=torch.float64)
                    reporting = (last and mpu.get_tensor_model_parallel_rank() == 0
                                 and mpu.get_context_parallel_rank() == 0)
                    if reporting:  # the sum over the data-parallel ranks' micro-batches
                        dist.all_reduce(loss, group=mpu.get_data_parallel_group())
                    losses[label] = _max(float(loss) if reporting else float("-inf"))
                    if label == "tree" and last:
                        result["update_metrics"] = {k: v for k, v in out["metrics"].items()
                                                    if k.startswith("treepack/")}
                    grads[label] = _grads(engine)
                    if mode == "token-mean":
                        norms[label] = float(engine.optimizer_step())
            result[f"loss_{mode}"] = (losses["tree"], losses["stock"])
            names = sorted(grads["stock"])
            result[f"grad_names_{mode}"] = names == sorted(grads["tree"])
            result[f"grads_{mode}"] = grad_error(grads["tree"], grads["stock"])
            if norms:
                result["grad_norm"] = (norms["tree"], norms["stock"])

        # 3. after one optimizer step on each, the two models still agree
        want_lp, _, _ = outputs(stock)
        got_lp, _, _ = outputs(tree)
        result["log_probs_after_step"] = relative(got_lp, want_lp)
        # the last stage's metrics, which rank 0 saves
        every = [None] * world
        dist.all_gather_object(every, {k: result.get(k) for k in ("token_ratio",
                                                                   "update_metrics")}
                               if last and mpu.get_data_parallel_rank() == 0 else None)
        result.update(next(x for x in every if x is not None))
        save(result, log, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def compare_replay(rank: int, world: int, port: int, model_dir: str, out_path: str,
                   tp: int = 1, cp: int = 1, fused: bool = False,
                   budget: int | None = None) -> None:
    """An MoE model (``model_dir``: Qwen3-MoE through mbridge) under verl's R3 routing replay
    (``router_replay.mode=R3``, the rollout's ``routed_experts`` in every batch): stock
    ``MegatronEngineWithLMHead`` vs ``TreepackMegatronEngine`` (with verl's fused kernels on
    where ``fused``; stock's need a GPU) at TP x CP, the rest data-parallel, under a token
    budget per GPU (``budget``; verl's default here 96, under which the update runs in
    parts). The log-probs and
    entropies of a replaying pass (``compute_log_prob``) and of a native one
    (``compute_ref_log_prob``: verl's batch flag ``enable_routing_replay`` off), a replaying
    update's loss, gradients, grad norm and expert biases (sigmoid routing with the
    aux-loss-free bias), and the log-probs after the step; rank 0 saves the
    errors, how far replayed log-probs are from native ones, and the update's metrics."""
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    import treepack.verl as treepack_verl
    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import (actor_loss, captured_log, init, make_batch, make_rows,
                              ref_and_advantages, rollout_routes, save, shard)

    init(rank, world, port)
    try:
        treepack_verl.register_megatron(devices=("cpu",))
        log = captured_log()
        # DeepSeek-V3's routing: sigmoid scores and the aux-loss-free expert bias, which
        # the update moves by each expert's token count (verl's replay patch counts them)
        replay = dict(tp=tp, cp=cp, router_replay=EngineRouterReplayConfig(mode="R3"),
                      override_transformer_config={"moe_router_score_function": "sigmoid",
                                                   "moe_router_enable_expert_bias": True})
        if budget is not None:
            replay.update(max_token_len_per_gpu=budget, infer_max_token_len_per_gpu=budget)
        # verl's replay patch keeps the routers of the engine built last (a class-level
        # list, cleared per engine) and replays through those only: stock's are built last
        tree = make_engine(TreepackMegatronEngine, model_dir, use_fused_kernels=fused, **replay)
        stock = make_engine(MegatronEngineWithLMHead, model_dir, **replay)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        rows = make_rows()
        config = stock.tf_config
        routes = rollout_routes(rows, (config.num_layers, config.num_moe_experts,
                                       config.moe_router_topk))
        result = {"routers": type(stock.module[0].module.decoder.layers[0].mlp.router
                                  .router_replay).__module__,
                  "fused": hasattr(tree.module[0].module, "forward_backup")}  # verl's patch

        def batch(engine, forward_only, replaying, **kw):
            return shard(make_batch(rows, engine, forward_only, routes=routes,
                                    enable_routing_replay=replaying,
                                    use_fused_kernels=fused and engine is tree, **kw),
                         dp_rank, dp)

        def infer(engine, replaying=True):
            with engine.eval_mode():
                out = engine.forward_backward_batch(batch(engine, True, replaying), None,
                                                    forward_only=True)["model_output"]
            # each row's last position predicts nothing of its row: under replay, verl routes
            # that token natively, and a tree may merge it with a longer row's recorded route
            return tuple([t[:-1] for t in out[k].unbind()] for k in ("log_probs", "entropy"))

        # 1. compute_log_prob (replaying) and compute_ref_log_prob (native routing)
        for name, replaying in (("replay", True), ("native", False)):
            (want_lp, want_ent), (got_lp, got_ent) = infer(stock, replaying), infer(tree,
                                                                                    replaying)
            result[f"log_probs_{name}"] = relative(got_lp, want_lp)
            result[f"entropy_{name}"] = relative(got_ent, want_ent)
            result[f"stock_{name}"] = want_lp
        # the routes matter: replayed log-probs are not the native ones
        result["replay_vs_native"] = relative(result.pop("stock_native"),
                                              result.pop("stock_replay"))

        # 2. a replaying update (verl's ppo_loss, token-mean), then one SGD step
        g = torch.Generator().manual_seed(1)
        old = [-1.0 + 0.3 * torch.randn(len(r["mask"]), generator=g) for r in rows]
        ref, adv = ref_and_advantages(old, rows, g)
        losses, grads, norms = {}, {}, {}
        for label, engine in (("stock", stock), ("tree", tree)):
            data = batch(engine, False, True, temperature=1.0, old_log_probs=old,
                         ref_log_prob=ref, advantages=adv)
            with engine.train_mode():
                engine.optimizer_zero_grad()
                out = engine.forward_backward_batch(data, actor_loss("token-mean", len(rows)))
                loss = torch.tensor([float(sum(out.get("loss", [])))], dtype=torch.float64)
                if mpu.get_tensor_model_parallel_rank() == 0 and \
                        mpu.get_context_parallel_rank() == 0:
                    dist.all_reduce(loss, group=mpu.get_data_parallel_group())
                else:
                    loss.fill_(float("-inf"))
                losses[label] = _max(float(loss))
                if label == "tree":
                    result["update_metrics"] = {k: v for k, v in out["metrics"].items()
                                                if k.startswith("treepack/")}
                grads[label] = _grads(engine)
                norms[label] = float(engine.optimizer_step())
        result["loss"] = (losses["tree"], losses["stock"])
        result["grad_names"] = sorted(grads["stock"]) == sorted(grads["tree"])
        result["grads"] = grad_error(grads["tree"], grads["stock"])
        result["grad_norm"] = (norms["tree"], norms["stock"])
        biases = {label: [m.expert_bias.clone() for m in engine.module[0].modules()
                          if getattr(m, "expert_bias", None) is not None]
                  for label, engine in (("tree", tree), ("stock", stock))}
        result["expert_bias"] = relative(biases["tree"], biases["stock"])
        result["expert_bias_moved"] = _max(max(float(b.abs().max()) for b in biases["stock"]))
        result["log_probs_after_step"] = relative(infer(tree)[0], infer(stock)[0])
        result["fused_after"] = hasattr(tree.module[0].module, "forward_backup")  # restored
        every = [None] * world
        dist.all_gather_object(every, result["update_metrics"] if dp_rank == 0 else None)
        result["update_metrics"] = next(x for x in every if x is not None)
        save(result, log, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------- verl's worker

def _float32_post_init():
    """verl's Megatron engine config built by the worker (from Hydra) admits ``float32``: its
    ``__post_init__`` checks bfloat16 and float16 only."""
    original = McoreEngineConfig.__post_init__
    if getattr(original, "admits_float32", False):
        return

    def post_init(self):
        wanted = self.dtype
        if wanted == "float32":
            object.__setattr__(self, "dtype", "bfloat16")
        original(self)
        object.__setattr__(self, "dtype", wanted)

    post_init.admits_float32 = True
    McoreEngineConfig.__post_init__ = post_init


# the docs' command's FSDP lines, and the FSDP settings of the CPU overrides
FSDP_ONLY = ("actor_rollout_ref.actor.strategy=", "+actor_rollout_ref.actor.fsdp_config.",
             "+actor_rollout_ref.ref.fsdp_config.", "actor_rollout_ref.actor.optim.optimizer=")


def megatron_overrides(tp: int = 1, pp: int = 1, cp: int = 1) -> list[str]:
    """verl's Megatron switch (``model_engine=megatron``: the actor's and the reference's
    ``strategy=megatron``), mbridge, the parallel sizes, float32, no offloading, and the
    training steps verl's trainer counts (Megatron's learning-rate schedule needs them)."""
    out = ["model_engine=megatron", "actor_rollout_ref.actor.strategy=megatron",
           # what verl's trainer sets from its data loader before it builds the workers
           "actor_rollout_ref.actor.optim.total_training_steps=10",
           "actor_rollout_ref.actor.optim.optimizer=sgd"]  # Megatron's spelling of SGD
    for role in ("actor", "ref"):
        out += [f"actor_rollout_ref.{role}.megatron.{k}={v}" for k, v in (
            ("use_mbridge", "true"), ("vanilla_mbridge", "true"), ("dtype", "float32"),
            ("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp), ("use_distributed_optimizer", "false"),
            ("param_offload", "false"))]
    return out


def compare_workers(rank: int, world: int, port: int, model_dir: str, batches_path: str,
                    out_path: str, tp: int = 1, pp: int = 1, cp: int = 1,
                    budget: int | None = None, replay: bool = False,
                    stock_extra: list[str] = ()) -> None:
    """Stock verl's Megatron engine and treepack's through verl's ``ActorRolloutRefWorker``
    (``model_engine=megatron`` on the docs' command), on the trainer's v1 batches of each
    data-parallel rank; rank 0 saves every output of both (rows in global batch order, from
    the last stage) and the update's metrics; ``budget``: the worker's token budgets;
    ``replay``: the actor replays the rollout's routes (``router_replay.mode=R3``; each row's
    last entropy left out: it predicts nothing of its row, and under replay verl routes that
    token natively where a tree may share a longer row's recorded route); ``stock_extra``:
    overrides of the stock worker only (the lines of the docs' command they set dropped)."""
    import verl_trainer_path as path
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import captured_log, init, save

    init(rank, world, port)
    try:
        _float32_post_init()
        records = captured_log()
        batches = torch.load(batches_path, weights_only=False)["v1"]
        result = {}
        for label, engine in (("stock", MegatronEngineWithLMHead),
                              ("tree", TreepackMegatronEngine)):
            extra = megatron_overrides(tp, pp, cp) + (
                path.budget_overrides(budget) if budget is not None else []) + (
                ["actor_rollout_ref.actor.megatron.router_replay.mode=R3"] if replay else [])
            drop = FSDP_ONLY
            if label == "stock" and stock_extra:
                extra += list(stock_extra)
                drop += tuple(o.split("=")[0] + "=" for o in stock_extra)
            config = path.compose_config(model_dir, treepack=label == "tree", world=world,
                                         extra=extra, drop=drop)
            actor, ref = path._workers(config, engine, ("megatron",))
            result[f"engines_{label}"] = (type(actor.actor.engine).__name__,
                                          type(ref.ref.engine).__name__)
            dp_rank = mpu.get_data_parallel_rank()
            out = path._calls(actor, ref, batches, dp_rank)
            last = mpu.is_pipeline_last_stage(ignore_virtual=True)
            mine = None
            if last and mpu.get_tensor_model_parallel_rank() == 0 and \
                    mpu.get_context_parallel_rank() == 0:
                mine = (dp_rank, {
                    "log_probs": [t[:-1] for t in out["log_prob"]["log_probs"].unbind()],
                    "entropy": [t[:-1] if replay else t
                                for t in out["log_prob"]["entropy"].unbind()],
                    "ref_log_probs": [t[:-1] for t in out["ref"]["log_probs"].unbind()],
                    "log_probs_after": [t[:-1] for t in
                                        out["log_prob_after"]["log_probs"].unbind()],
                    "update_metrics": out["update"]["metrics"]})
            every = [None] * world
            dist.all_gather_object(every, mine)
            shares = dict(x for x in every if x is not None)
            result[label] = {k: [t for d in sorted(shares) for t in shares[d][k]]
                             for k in ("log_probs", "entropy", "ref_log_probs",
                                       "log_probs_after")}
            result[label]["update_metrics"] = {
                k: v for k, v in shares[0]["update_metrics"].items()
                if k.startswith("treepack/") or k in ("grad_norm", "actor/pg_loss",
                                                      "actor/entropy_loss", "kl_loss")}
            del actor, ref
        save(result, records, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def divergent_fallback(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    """At two data-parallel ranks, only rank 0's rows cannot be packed (temperature 0): every
    rank must take verl's stock path, say why once, and give stock's outputs."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import captured_log, init, make_batch, make_rows, save, shard

    init(rank, world, port)
    try:
        log = captured_log()
        stock = make_engine(MegatronEngineWithLMHead, model_dir)
        tree = make_engine(TreepackMegatronEngine, model_dir)
        rows = make_rows()
        temperature = torch.full((len(rows),), 0.7)
        temperature[0] = 0.0  # a row of rank 0's share
        outs = {}
        for label, engine in (("stock", stock), ("tree", tree)):
            data = shard(make_batch(rows, engine, True, temperature=temperature), rank, world)
            with engine.eval_mode():
                outs[label] = engine.forward_backward_batch(data, None, forward_only=True)
        got, want = (outs[k]["model_output"]["log_probs"].unbind() for k in ("tree", "stock"))
        result = {"equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
                  "reason": tree._stock_reason(shard(make_batch(rows, tree, True,
                                                                temperature=temperature),
                                                     rank, world))}
        every = [None] * world
        dist.all_gather_object(every, ([r.getMessage() for r in log], result))
        save({"ranks": every}, [], rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def compare_bfloat16(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    """verl's own dtype: the stock and tree engines in bfloat16 (Megatron's ``Float16Module``
    around the model), each against the stock engine in float32, on one rank; saves each
    one's error (log-probs and entropies: max relative; the gradients of one ``token-mean``
    update: the largest ``|got - want| / |want|`` over the parameters, in norm)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import actor_loss, init, make_batch, make_rows, ref_and_advantages, save

    init(rank, world, port)
    try:
        engines = {"float32": make_engine(MegatronEngineWithLMHead, model_dir),
                   "stock": make_engine(MegatronEngineWithLMHead, model_dir, dtype="bfloat16"),
                   "tree": make_engine(TreepackMegatronEngine, model_dir, dtype="bfloat16")}
        rows = make_rows()
        g = torch.Generator().manual_seed(1)
        old = [-1.0 + 0.3 * torch.randn(len(r["mask"]), generator=g) for r in rows]
        ref, adv = ref_and_advantages(old, rows, g)
        outs = {}
        for label, engine in engines.items():
            with engine.eval_mode():
                out = engine.forward_backward_batch(make_batch(rows, engine, True), None,
                                                    forward_only=True)["model_output"]
            data = make_batch(rows, engine, False, temperature=1.0, old_log_probs=old,
                              ref_log_prob=ref, advantages=adv)
            with engine.train_mode():  # (leaving it zeroes the gradients)
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(data, actor_loss("token-mean", len(rows)))
                grads = _grads(engine)
            outs[label] = {"log_probs": [t[:-1].float() for t in out["log_probs"].unbind()],
                           "entropy": [t.float() for t in out["entropy"].unbind()],
                           "grads": grads}
        want = outs["float32"]
        result = {"modules": [type(e.module[0].module).__name__ for e in engines.values()]}
        for label in ("stock", "tree"):
            got = outs[label]
            result[label] = {k: relative(got[k], want[k]) for k in ("log_probs", "entropy")}
            # per tensor in norm (one rank): a max element of bfloat16 noise is one draw
            result[label]["grads"] = max(float((got["grads"][k] - w).norm() / w.norm())
                                         for k, w in want["grads"].items() if w.norm() > 0)
        save(result, [], rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()
