"""megatron-core workers for tests/adapters/test_megatron.py (spawned ranks import this module).

One canonical model per case is built at TP = 1 (float64, seeded) and saved; every parallel
layout loads its shard of the same weights (each tensor-parallel parameter cut along its
``partition_dim``, ``partition_stride`` pieces at a time, as Megatron lays it out), so every
layout computes the same function. The reference is that TP = 1 model run on each sequence
alone through Megatron's own attention; each layout runs the pack through treepack and saves
its log-probs, entropies and every parameter's gradient, gathered back to the full tensor.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
from megatron_cpu import (Norm, ReferenceAttention, fused_norm_linear, gdn_layer,
                          hybrid_stack_spec, recorded, replaying)

VOCAB = 128
TEMPERATURES = (0.7, 1.0, 1.3)


def sequences(kind: str = "forest", seed: int = 0) -> list[list[int]]:
    """A case's sequences: two GRPO groups (one prompt each, completions of several lengths,
    one a prefix of another, a duplicate), an agent trajectory whose steps extend each other,
    and a one-token sequence; or smaller ones."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    if kind == "tiny":  # fewer rows than ranks
        return [[5, 6, 7]]
    if kind == "long":  # the forest, and a group whose prompt is longer than a 64-row chunk
        long = tokens(70)  # (a Gated DeltaNet's), forking past it; one stops inside it
        return sequences("forest", seed) + [long + tokens(n) for n in (5, 9)] + [long[:40]]
    prompt, other = tokens(9), tokens(5)
    out = [prompt + tokens(n) for n in (4, 7, 1)]
    out.append(out[1][:12])  # a prefix of another
    out.append(list(out[0]))  # a duplicate
    out += [other + tokens(n) for n in (3, 6)]
    if kind == "forest":
        history = tokens(6)
        for _ in range(3):  # an agent: each step repeats the history
            history = history + tokens(3)
            out.append(list(history))
        out.append([7])
    return out


def routes_of(seqs: list[list[int]], case: dict, seed: int = 7) -> list[np.ndarray] | None:
    """The routes a rollout engine recorded for the case's sequences (``[len, moe_layers,
    topk]`` each; None unless the case has ``routes``): one random route per distinct context
    (a naive trie over prefixes: a shared prompt is routed once), except that sequence 1 was
    routed its own way from its fourth token on, so its rows must fork from its group's
    there. Each route's top-k experts are distinct, as a router's are."""
    if not case.get("routes"):
        return None
    fields = case.get("config", {})
    experts, topk = fields.get("num_moe_experts", 4), fields.get("moe_router_topk", 2)
    g = np.random.default_rng(seed)
    trie: dict = {}
    layers = case.get("layers", 2)  # one route per layer (vLLM's), or per MoE layer
    width = {"all": layers, None: sum(moe_pattern(case))}.get(case.get("route_layers"),
                                                              case.get("route_layers"))

    def route():
        return np.stack([g.permutation(experts)[:topk] for _ in range(width)])

    out = []
    for s, seq in enumerate(seqs):
        out.append(np.stack([route() if s == 1 and i >= 3 else
                             trie.setdefault(tuple(seq[:i + 1]), route())
                             for i in range(len(seq))]).astype(np.int16))
    if case.get("unrecorded"):  # sequence 0's first tokens without a recorded route: -1
        out[0][:case["unrecorded"]] = -1
    return out


def moe_pattern(case: dict) -> list[int]:
    """Which of the case's layers are MoE layers (1), as ``moe_layer_freq`` says."""
    layers = case.get("layers", 2)
    freq = case.get("config", {}).get("moe_layer_freq", 1)
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]


def config(case: dict, tp: int = 1, cp: int = 1, pp: int = 1):
    from megatron.core import parallel_state as ps

    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=case.get("layers", 2), hidden_size=64, num_attention_heads=4,
                  num_query_groups=case.get("groups", 2), ffn_hidden_size=96, kv_channels=16,
                  use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False,
                  gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False,
                  bias_dropout_fusion=False, apply_rope_fusion=False,
                  gradient_accumulation_fusion=False, attention_dropout=0.0,
                  hidden_dropout=0.0, params_dtype=torch.float64, init_method_std=0.05,
                  attention_softmax_in_fp32=False,  # float64: the reference exact too
                  tensor_model_parallel_size=tp, context_parallel_size=cp,
                  pipeline_model_parallel_size=pp,
                  expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                  # Megatron trains MoE under TP only with sequence parallelism
                  sequence_parallel=tp > 1 and bool(
                      case.get("sequence_parallel")
                      or case.get("config", {}).get("num_moe_experts")))
    if case.get("mla"):  # DeepSeek's multi-latent attention, small: decoupled rope
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        fields.update(multi_latent_attention=True, q_lora_rank=case.get("q_lora_rank", 24),
                      kv_lora_rank=20, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10,
                      rope_type=case["mla"], rotary_base=10000, rotary_scaling_factor=4.0,
                      original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0,
                      num_query_groups=fields["num_attention_heads"])
        if pp > 1:
            fields.update(pipeline_dtype=torch.float64, variable_seq_lengths=True,
                          moe_token_dispatcher_type="alltoall")
        fields.update(case.get("config", {}))
        return MLATransformerConfig(**fields)
    if case.get("gdn"):  # Gated DeltaNet in every other layer (Qwen3-Next's, small), on
        # megatron-core's deterministic torch kernel; v heads twice the k heads
        fields.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                      linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4, deterministic_mode=True,
                      # megatron-core 0.16's config refuses CP with Gated DeltaNet (0.19 on
                      # takes it); the tree's CP group is parallel_state's either way
                      context_parallel_size=1)
    if case.get("mamba"):  # a hybrid of Mamba2, attention and MLP layers (Nemotron-H's
        # shape, small): 4 heads of 16 channels, B and C in 2 groups of 8 states
        fields.update(num_layers=len(case["mamba"]), mamba_state_dim=8, mamba_head_dim=16,
                      mamba_num_groups=2, mamba_num_heads=4)
    if pp > 1:  # packs differ in rows: the stages exchange their shapes
        fields.update(pipeline_dtype=torch.float64, variable_seq_lengths=True,
                      moe_token_dispatcher_type="alltoall")
    fields.update(case.get("config", {}))
    return TransformerConfig(**fields)


def spec(case: dict, tree: bool = True, pp: int = 1):
    """The case's decoder block spec (this pipeline stage's layers): the local layer spec with
    :class:`Norm` for its norms (and the final one); the tree's core attention in it unless
    ``tree`` is False."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    import treepack.megatron as tm

    if case.get("mamba"):  # the hybrid stack (every stage's: the stack picks its layers),
        stack = hybrid_stack_spec({"chunk_size": 32})  # chunks of 32 rows: the long
        return tm.layer_spec(stack) if tree else stack  # prompt spans three
    experts = case.get("config", {}).get("num_moe_experts")
    kinds = {}
    for moe in (0, 1):
        kinds[moe] = get_gpt_layer_local_spec(
            normalization="RMSNorm", num_experts=experts if moe else None,
            multi_latent_attention=bool(case.get("mla")), qk_layernorm=bool(case.get("mla")))
        kinds[moe].submodules.input_layernorm = kinds[moe].submodules.pre_mlp_layernorm = Norm
        if case.get("mla"):  # the latents' norms; the reference's core attention its own
            attention = kinds[moe].submodules.self_attention.submodules
            attention.q_layernorm = attention.kv_layernorm = Norm
            if case.get("fused_norm"):  # TE's layout: the kv norm inside the up-projection
                from megatron.core.transformer.identity_op import IdentityOp

                attention.kv_layernorm = IdentityOp
                attention.linear_kv_up_proj = fused_norm_linear()
            if not tree:
                attention.core_attention = ReferenceAttention
    pattern = moe_pattern(case) if experts else [0] * case.get("layers", 2)
    layers = [kinds[m] for m in pattern]
    if case.get("gdn"):  # linear_attention_freq = 2: layers 1, 3, ... Gated DeltaNet
        layers = [gdn_layer(kind) if i % 2 == 0 else kind for i, kind in enumerate(layers)]
    per_stage = len(pattern) // pp
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank() if pp > 1 else 0
    block = TransformerBlockSubmodules(
        layer_specs=layers[stage * per_stage:(stage + 1) * per_stage], layer_norm=Norm)
    return tm.layer_spec(block) if tree and case.get("spec", "tree") == "tree" else block


def build(case: dict, tp: int = 1, cp: int = 1, pp: int = 1, tree: bool = True,
          pg_collection=None):
    """The case's GPTModel on this rank (float64), from the tree spec or the stock one
    (``pg_collection``: its process groups, else Megatron's)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec_ = spec(case, tree, pp)
    if case.get("mamba"):
        from megatron.core.models.mamba.mamba_model import MambaModel

        model = MambaModel(config(case, tp, cp, pp), spec_, vocab_size=VOCAB,
                           max_sequence_length=128, hybrid_override_pattern=case["mamba"],
                           position_embedding_type=case.get("positions", "rope"),
                           share_embeddings_and_output_weights=case.get("tied", False),
                           pre_process=_first(), post_process=_last(),
                           pg_collection=pg_collection)
        return model.double()
    model = GPTModel(config(case, tp, cp, pp), spec_, vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type=case.get("positions", "rope"),
                     share_embeddings_and_output_weights=case.get("tied", False),
                     pre_process=_first(), post_process=_last(), pg_collection=pg_collection)
    return model.double()


_ALONE_GROUPS: list = []


def without_cp():
    """Megatron's process groups with a context-parallel group of this rank alone: a model
    built with them runs each sequence whole on this rank (Megatron's rope slices positions
    per rank of the CP group it is given). Collective the first time (every rank makes every
    one-rank group)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not _ALONE_GROUPS:
        _ALONE_GROUPS.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.cp = _ALONE_GROUPS[dist.get_rank()]
    return groups


def _first() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage()


def _last() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def init(rank: int, world: int, port: int, tp: int = 1, cp: int = 1, pp: int = 1,
         ep: int = 1) -> None:
    import megatron_cpu
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    megatron_cpu.install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _layout(param: torch.Tensor) -> tuple[int, int | list[int]] | None:
    """``(partition_dim, partition_stride)`` of a TP-split parameter, else None; or
    ``(dim, sections)``: the whole tensor's sections along ``dim``, each split over the TP
    ranks (a Gated DeltaNet's q, k, v, gate, beta and alpha: :func:`mark_head_split`). A
    learnable softmax offset (attention sinks) is split by heads without Megatron's marks:
    one entry per TP-local head."""
    sections = getattr(param, "_treepack_sections", None)
    if sections is not None:
        return 0, sections
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, getattr(param, "partition_stride", 1)
    if getattr(param, "_treepack_heads", False):
        return 0, 1
    return None


def mark_head_split(model) -> None:
    """Mark each core attention's learnable softmax offset as split by heads, and each Gated
    DeltaNet's and Mamba2 mixer's parameters by their sections (``_layout``)."""
    from treepack.adapters.megatron.recurrent import gated_delta_nets, mamba_mixers

    for layer in mamba_mixers(model):  # z, x, B, C, dt; the convolution's x, B, C
        inner, grouped, heads = layer.d_inner, layer.ngroups * layer.d_state, layer.nheads
        layer.in_proj.weight._treepack_sections = [inner, inner, grouped, grouped, heads]
        for p in (layer.conv1d.weight, layer.conv1d.bias):
            p._treepack_sections = [inner, grouped, grouped]
        for p in (layer.dt_bias, layer.A_log, layer.D, layer.norm.weight):
            p._treepack_sections = [p.shape[0] * layer.tp_group.size()]

    for name, p in model.named_parameters():
        if name.endswith("softmax_offset"):
            p._treepack_heads = True
    for layer in gated_delta_nets(model):
        qk, v, heads = layer.qk_dim, layer.v_dim, layer.num_value_heads
        layer.in_proj.weight._treepack_sections = [qk, qk, v, v, heads, heads]
        layer.conv1d.weight._treepack_sections = [qk, qk, v]
        if layer.conv1d.bias is not None:
            layer.conv1d.bias._treepack_sections = [qk, qk, v]
        layer.A_log._treepack_sections = layer.dt_bias._treepack_sections = [heads]


def _sections(layout, whole: int) -> tuple[int, list[int]]:
    dim, sections = layout
    return dim, ([whole // sections] * sections if isinstance(sections, int) else sections)


def shard_of(param: torch.Tensor, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of ``full`` as Megatron lays ``param`` out."""
    layout = _layout(param)
    if layout is None or size == 1:
        return full
    dim, sections = _sections(layout, full.shape[layout[0]])
    return torch.cat([s.chunk(size, dim)[rank] for s in full.split(sections, dim)], dim)


def full_of(param: torch.Tensor, local: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole tensor from every TP rank's ``local`` piece (the inverse of ``shard_of``)."""
    layout = _layout(param)
    if layout is None or size == 1:
        return local
    dim, sections = _sections(layout, local.shape[layout[0]] * size)
    every = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(every, local.contiguous(), group=group)
    pieces = [p.split([n // size for n in sections], dim) for p in every]
    return torch.cat([pieces[r][s] for s in range(len(sections)) for r in range(size)], dim)


def weights(shape, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn(shape, generator=g, dtype=torch.float64))


def causal(n: int, window: int | None = None) -> torch.Tensor:
    """Megatron's mask for one sequence: True where a query must not look."""
    i = torch.arange(n)
    masked = i[None, :] > i[:, None]
    if window is not None:
        masked |= i[:, None] - i[None, :] >= window
    return masked[None, None]


def canonical(case: dict):
    """The case's model at TP = 1 from its seed (Megatron's own attention), and its weights:
    what every layout loads its shard of. Without activation recomputation, which changes
    no value: the reference cannot share a recomputation's mistake (Megatron's own routing
    replay, for one, routes the recomputed forward natively unless told otherwise)."""
    from megatron.core import tensor_parallel

    # Megatron's tracker too (the recurrent layers draw from it): weights that do not depend
    # on the cases built before
    torch.manual_seed(case.get("seed", 0))
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    case = {**case, "config": {k: v for k, v in case.get("config", {}).items()
                               if not k.startswith("recompute")}}
    model = build(case, tree=False)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()
                   if isinstance(v, torch.Tensor)}


def reference_worker(rank: int, world: int, port: int, out: str, cases: dict) -> None:
    """Per case: the canonical TP = 1 weights, and every sequence alone through Megatron's
    own attention: log-probs, entropies and the gradients of a fixed loss of them."""
    init(rank, world, port)
    try:
        results = {}
        for name, case in cases.items():
            model, state = canonical(case)
            results[name] = {"state": state, **alone(model, case)}
        torch.save(results, f"{out}/reference.pt")
    finally:
        shutdown()


def replays(model, routes) -> bool:
    """Whether the reference replays ``routes``: a replaying model, routes that fit it (a
    case whose routes do not is refused on the tree, and runs natively here)."""
    from megatron.core.transformer.moe.router import TopKRouter

    if routes is None or not getattr(model.config, "moe_enable_routing_replay", False):
        return False
    routers = sum(isinstance(m, TopKRouter) for m in model.modules())
    return routes[0].shape[1] in (routers, model.config.num_layers)


def alone(model, case: dict, tp: int = 1) -> dict:
    """Every sequence run alone, [N, L] log-probs and entropies, and the loss's gradients
    (at ``tp`` > 1: this rank's shard of each; the logits gathered over the vocabulary, each
    sequence right-padded to a multiple of ``tp`` under sequence parallelism, the padding
    after every token the loss reads)."""
    from megatron.core import tensor_parallel

    seqs = sequences(case.get("batch", "forest"), case.get("seed", 0))
    width = max(map(len, seqs))
    w, v = weights((len(seqs), width))
    logps = torch.zeros(len(seqs), width, dtype=torch.float64)
    ents = torch.zeros_like(logps)
    window = case.get("window")
    routes = routes_of(seqs, case)
    model.zero_grad(set_to_none=True)
    multiple = tp if model.config.sequence_parallel else 1
    for s, seq in enumerate(seqs):
        n = -(-len(seq) // multiple) * multiple
        ids = torch.tensor(seq + [0] * (n - len(seq)))[None]
        positions = torch.arange(n)[None]
        if case.get("positions") == "mrope":
            positions = positions[None].expand(3, 1, -1)
        route = routes[s] if replays(model, routes) else None
        if route is not None and (route[..., 0, 0] < 0).any():  # an unrecorded prefix: the
            p = int((route[..., 0, 0] < 0).sum())  # routes the router itself gives it
            assert (route[:p, ..., 0] < 0).all()  # (causal: the prefix alone routes alike)
            route = route.copy()
            route[:p] = recorded(model, ids[:, :p], positions[..., :p], causal(p, window))
        if route is not None and multiple > 1:  # this rank's share of the padded tokens
            from megatron.core import parallel_state as ps

            route = np.concatenate([route, np.repeat(route[-1:], n - len(seq), 0)])
            route = np.split(route, tp)[ps.get_tensor_model_parallel_rank()]
        with replaying(model, route):
            logits = model(ids, positions, causal(n, window))[0, :len(seq)]  # [L, V]
        if tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        t = TEMPERATURES[s % 3] if case.get("temperatures") else 1.0
        logps, ents = put(logps, ents, s, seq, logits / t)
    return weighted_backward(model, logps, ents, w, v)


def put(logps: torch.Tensor, ents: torch.Tensor, s: int, seq: list, logits: torch.Tensor):
    """``[N, L]`` log-probs and entropies with sequence ``s``'s next-token ones from its
    logits ``[len(seq), V]``."""
    logp = logits.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    at = (torch.tensor([s]), torch.arange(1, len(seq)))
    return (logps.index_put(at, logp[:-1].gather(-1, torch.tensor(seq)[1:, None])[:, 0]),
            ents.index_put(at, ent[:-1]))


def weighted_backward(model, logps: torch.Tensor, ents: torch.Tensor, w: torch.Tensor,
                      v: torch.Tensor) -> dict:
    """The backward of ``(logps * w).sum() + (ents * v).sum()``: the outputs, the loss and
    every parameter's gradient."""
    loss = (logps * w).sum() + (ents * v).sum()
    loss.backward()
    return {"logprobs": logps.detach(), "entropy": ents.detach(), "loss": loss.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}}


@contextlib.contextmanager
def broken(how: str | None):
    """A negative control: treepack's Megatron path with one thing broken."""
    from treepack.adapters.megatron import forward, rotary
    from treepack.attention import exchange

    from treepack.forwards import carried
    from treepack.adapters.megatron import moe

    from treepack.forwards import mixers
    from treepack.recurrent import scan

    saved = (rotary.install, exchange._Exchange.backward, forward.MegatronForward.core_attention,
             forward.Head, moe.install, carried.Carried.backward_inputs, moe.Routing.replaying,
             moe.resume, rotary._TreeRotary._at_depths, rotary._span, scan.scan_levels,
             mixers.tree_conv1d)
    try:
        if how == "positions":  # the rotary embedding at each row's packed index
            rotary.install = lambda model: None
        elif how == "unweighted router":  # the router's losses over packed rows as they are
            moe.install = lambda model: None
        elif how == "packed index":  # every row's rotary at its packed index, not its depth
            rotary._span = lambda rows, offset: (int(rows), offset)
            rotary._TreeRotary._at_depths = lambda self, emb, depths: saved[8](
                self, emb, torch.arange(depths.shape[0], device=depths.device))
        elif how == "no routing in recomputation":  # a recomputed router routes natively
            moe.resume = lambda attention, routing: None
        elif how == "routes not replayed":  # the tree's routers route natively
            @contextlib.contextmanager
            def native(self, router):
                def topk(scores, topk, num_groups=None, group_topk=None,
                         default_compute_topk=None):
                    self.replayed[router.layer_number] = 1
                    return default_compute_topk(scores, topk, num_groups, group_topk)
                object.__setattr__(router.router_replay, "get_replay_topk", topk)
                try:
                    yield
                finally:
                    vars(router.router_replay).pop("get_replay_topk")
            moe.Routing.replaying = native
        elif how == "each row replays its neighbour's route":
            @contextlib.contextmanager
            def rolled(self, router):
                routes, self.routes = self.routes, self.routes.roll(1, 0)
                try:
                    with saved[6](self, router):
                        yield
                finally:
                    self.routes = routes
            moe.Routing.replaying = rolled
        elif how == "exchange gradient":  # no gradient back through rows -> heads
            def backward(ctx, grad):
                scatter, gather = ctx.dims
                out = saved[1](ctx, grad)
                return (torch.zeros_like(out[0]), *out[1:]) if scatter == 1 else out
            exchange._Exchange.backward = staticmethod(backward)
        elif how == "local mask":  # each CP rank attends among its own rows only
            def attend(self, module, query, key, value, *, scale, window, dropout,
                       sinks=None):
                if self.exchange is None:
                    return saved[2](self, module, query, key, value, scale=scale,
                                    window=window, dropout=dropout, sinks=sinks)
                self.calls += 1
                own = self.own
                mask = self.pack.dense_mask()[self.start:self.stop, self.start:self.stop]
                q, k, v = (t[:own].permute(1, 2, 0, 3) for t in (query, key, value))
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale)
                out = out.permute(2, 0, 1, 3).reshape(own, 1, -1)
                return torch.cat((out, out.new_zeros(self.width - own, *out.shape[1:])))
            forward.MegatronForward.core_attention = attend
        elif how == "scan from zeros":  # every chain of a scan from zeros, not its parent's
            scan.scan_levels = lambda plan, kernel, inputs, initial=None: saved[10](
                plan, lambda batch, state: kernel(batch, None), inputs, initial)
        elif how == "packed convolution":  # each row's convolution reads the packed rows
            def packed_conv(pack, x, weight, bias=None):  # before it, not its ancestors
                out = torch.nn.functional.conv1d(x.T[None], weight[:, None], bias,
                                                 padding=weight.shape[1] - 1,
                                                 groups=weight.shape[0])
                return out[0, :, :x.shape[0]].T
            mixers.tree_conv1d = packed_conv
        elif how == "carried gradient":  # parts hand no gradient to the parts above
            carried.Carried.backward_inputs = lambda self, i: ([], [])
        elif how == "vocabulary share":  # every TP rank takes its share for the first
            def head(*args, vocab_start=0, **kwargs):  # (the target's logit from the wrong
                return saved[3](*args, vocab_start=0, **kwargs)  # rank)
            forward.Head = head
        yield
    finally:
        (rotary.install, exchange._Exchange.backward, forward.MegatronForward.core_attention,
         forward.Head, moe.install, carried.Carried.backward_inputs, moe.Routing.replaying,
         moe.resume, rotary._TreeRotary._at_depths, rotary._span, scan.scan_levels,
         mixers.tree_conv1d) = saved


def each_case(cases: dict, path: str, run) -> None:
    """``run(name, case)`` for every case (broken as it says), its result or what it raised
    saved to ``path`` for the test to read."""
    results = {}
    for name, case in cases.items():
        try:
            with broken(case.get("broken")):
                results[name] = run(name, case)
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    torch.save(results, path)


def cases_worker(rank: int, world: int, port: int, out: str, cases: dict, layout: dict) -> None:
    """Every case on this layout (``tp``, ``cp``; the rest of the world is data-parallel and
    runs the same batch): the packed forward's log-probs, entropies and full gradients."""
    from megatron.core import parallel_state as ps

    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    init(rank, world, port, tp=tp, cp=cp)
    try:
        reference = torch.load(f"{out}/reference.pt")
        tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        each_case(cases, f"{out}/{layout['name']}-rank{rank}.pt", lambda name, case: run_case(
            case, reference[name], tp, cp, tp_group, tp_rank))
    finally:
        shutdown()


def run_case(case: dict, reference: dict, tp: int, cp: int, tp_group, tp_rank: int) -> dict:
    """One case on this rank: the packed forward's outputs and every full gradient."""
    import treepack
    import treepack.megatron as tm

    model = build(case, tp, cp)
    mark_head_split(model)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(shard_of(p, reference["state"][k], tp_rank, tp))
    tm.prepare(model)
    seqs = sequences(case.get("batch", "forest"), case.get("seed", 0))
    routes = routes_of(seqs, case)
    pack = treepack.TreePack.from_sequences(seqs, routes=routes)
    if routes is not None:  # the forked sequence forks: more rows than on ids alone
        assert pack.num_rows > treepack.TreePack.from_sequences(seqs).num_rows
    w, v = weights(tuple(pack.rows.shape))
    temps = [TEMPERATURES[s % 3] for s in range(len(seqs))] if case.get("temperatures") \
        else 1.0
    if case.get("mismatch"):  # every rank of the group its own temperature
        temps = 1.0 + 0.25 * dist.get_rank()
    if case.get("dropout_pair"):  # step_in_parts under dropout against backward_in_parts
        return dropout_pair(model, pack, w, v, case["parts"], tp_group, tp, cp)
    if case.get("parts"):  # a tree over the budget: every row once, in parts of that many
        def loss_fn(out, mask):
            return (out.logprobs * w).where(mask, 0).sum() + (out.entropy * v).where(mask, 0).sum()

        run = tm.step_in_parts if case.get("step") else tm.backward_in_parts
        got = run(model, pack, loss_fn, max_tokens=case["parts"], temperature=temps,
                  entropy=True, recompute=case.get("recompute", "auto"),
                  backend=case.get("backend", "auto"))
        assert got.parts > 2 and got.rows == pack.num_rows, (got.parts, got.rows)
        loss = got.loss
    else:
        with replay_state_kept(model):
            got = tm.logprobs(model, pack, temperature=temps, entropy=True,
                              backend=case.get("backend", "auto"))
        loss = (got.logprobs * w).sum() + (got.entropy * v).sum()
        loss.backward()
    out = {"logprobs": got.logprobs.detach(), "entropy": got.entropy.detach(),
           "loss": loss.detach(), "grads": full_grads(model, tp, cp, tp_group)}
    if (case.get("mla") or case.get("gdn")) and tp > 1:  # (stock_at)
        out["reference"] = stock_at(case, reference, tp, tp_group, tp_rank, cp)
    if case.get("config", {}).get("softmax_type") == "learnable":  # its checkpoint shards
        sharded = model.sharded_state_dict()
        key = next(k for k in sharded if k.endswith("layers.0.self_attention.core_attention"
                                                   ".softmax_offset"))
        out["offset_shard"] = (tuple(sharded[key].global_shape),
                               tuple(sharded[key].global_offset))
    return out


def stock_at(case: dict, reference: dict, tp: int, tp_group, tp_rank: int,
             cp: int = 1) -> dict:
    """The stock model at this TP size (CP = 1) on every sequence alone, its gradients
    gathered to full tensors: the reference where Megatron's own model at TP > 1 is not the
    TP = 1 model's function. Multi-latent attention on the local spec is one: its rope key
    ``k_pos_emb`` leaves ``linear_kv_down_proj`` (column-parallel) through
    ``gather_from_tensor_model_parallel_region`` and is used by this rank's heads only, so
    each rank's share of its gradient is its heads' part (measured: the tree at TP = 2
    equals this within 1.3e-15 and differs from TP = 1 by up to 5e-2). A Gated DeltaNet's
    ``out_norm`` is another: each TP rank normalises its heads' outputs with the one weight,
    which Megatron sums over TP only under sequence parallelism. Under CP, each CP
    rank runs it with a CP group of its own (:func:`without_cp`)."""
    model = build(case, tp, tree=False, pg_collection=without_cp() if cp > 1 else None)
    mark_head_split(model)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(shard_of(p, reference["state"][k], tp_rank, tp))
    out = alone(model, case, tp)
    return {**out, "grads": full_grads(model, tp, 1, tp_group)}


def full_grads(model, tp: int, cp: int, tp_group) -> dict:
    """Every parameter's full gradient on this rank, by name: each CP rank's share summed
    (their sum is the pack's), the sequence-parallel norms' shares summed over TP as
    Megatron's finalize_model_grads does, each TP shard gathered."""
    from megatron.core import parallel_state as ps

    grads = {}
    for k, p in model.named_parameters():
        g = p.grad.clone()
        if cp > 1:
            dist.all_reduce(g, group=ps.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False) and tp > 1:
            dist.all_reduce(g, group=tp_group)
        grads[k] = full_of(p, g, tp_group, tp)
    return grads


@contextlib.contextmanager
def replay_state_kept(model):
    """Around a tree forward of a replaying model: a caller's replay state for unpacked
    forwards (a target, its action, the backward list) is neither read nor changed."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = [m.router_replay for m in model.modules()
               if isinstance(m, TopKRouter) and m.router_replay is not None]
    stale = torch.zeros(1, 1, dtype=torch.long)  # a caller's target for another batch
    for replay in replays:
        replay.set_target_indices(stale)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    yield
    for replay in replays:
        assert replay.target_topk_idx is stale and replay.replay_backward_list == [stale]
        assert replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
        replay.clear_indices()
        replay.clear_router_replay_action()


def dropout_pair(model, pack, w, v, budget: int, tp_group, tp: int, cp: int) -> dict:
    """With dropout on, step_in_parts (two passes) and backward_in_parts (one) from the same
    random state, on a loss that is a sum over predictions: the same masks must give the
    same loss and gradients (the second pass replays the first's masks)."""
    import treepack.megatron as tm
    from megatron.core import parallel_state as ps
    from treepack.adapters.megatron.parts import _rng_state, _set_rng_state

    def loss_fn(out, mask):
        return (out.logprobs * w).where(mask, 0).sum() + (out.entropy * v).where(mask, 0).sum()

    model.train()
    start, got = _rng_state(), {}
    for name, run in (("backward", tm.backward_in_parts), ("step", tm.step_in_parts)):
        _set_rng_state(start)
        model.zero_grad(set_to_none=True)
        result = run(model, pack, loss_fn, max_tokens=budget, entropy=True)
        grads = {}
        for k, p in model.named_parameters():
            g = p.grad.clone()
            if cp > 1:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            grads[k] = full_of(p, g, tp_group, tp)
        got[name] = {"loss": result.loss, "logprobs": result.logprobs, "grads": grads}
    model.eval()
    with torch.no_grad():  # without dropout: the masks did change the log-probs
        plain = tm.logprobs_in_parts(model, pack, max_tokens=budget).logprobs
    return {"pair": got, "dropout_effect": float((got["step"]["logprobs"] - plain).abs().max())}


def canonical_names(model) -> dict:
    """This pipeline stage's parameter names -> the canonical (TP = 1, one stage) model's:
    its layers are numbered locally, ``layer_number`` is global."""
    out = {}
    for name, _ in model.named_parameters():
        key = name
        if name.startswith("decoder.layers."):
            local = int(name.split(".")[2])
            number = model.decoder.layers[local].layer_number - 1
            key = name.replace(f"decoder.layers.{local}.", f"decoder.layers.{number}.", 1)
        out[name] = key
    return out


def pipeline_worker(rank: int, world: int, port: int, out: str, cases: dict,
                    layout: dict) -> None:
    """Every case through Megatron's pipeline schedule (``pp`` stages, the case's sequences
    dealt to ``micro_batches`` packs): each pack's log-probs from the last stage, and every
    parameter's full gradient, each stage saving its own (by canonical name)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import treepack
    import treepack.megatron as tm

    tp, pp = layout.get("tp", 1), layout["pp"]
    init(rank, world, port, tp=tp, pp=pp)
    try:
        reference = torch.load(f"{out}/reference.pt")
        tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        results = {}
        for name, case in cases.items():
            model = build(case, tp, 1, pp)
            mark_head_split(model)
            names = canonical_names(model)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(shard_of(p, reference[name]["state"][names[k]], tp_rank, tp))
            tm.prepare(model)
            seqs = sequences(case.get("batch", "forest"), case.get("seed", 0))
            w, v = weights((len(seqs), max(map(len, seqs))))
            count = layout["micro_batches"]
            groups = [list(range(i, len(seqs), count)) for i in range(count)]
            routes = routes_of(seqs, case)
            packs = [treepack.TreePack.from_sequences(
                [seqs[i] for i in g], routes=None if routes is None else [routes[i] for i in g])
                for g in groups]
            temps = [TEMPERATURES[i % 3] if case.get("temperatures") else 1.0
                     for i in range(len(seqs))]
            group_of = {id(p): g for p, g in zip(packs, groups)}

            def loss_fn(got, pack):
                g = group_of[id(pack)]
                width = got.logprobs.shape[1]
                loss = (got.logprobs * w[g, :width]).sum() + (got.entropy * v[g, :width]).sum()
                return loss, {"logprobs": got.logprobs.detach(), "entropy": got.entropy.detach()}

            def step(data_iterator, model_):  # each pack at its sequences' temperatures
                pack = next(data_iterator)
                temperature = [temps[i] for i in group_of[id(pack)]]
                return tm.forward_step(loss_fn, entropy=True, temperature=temperature)(
                    iter([pack]), model_)

            reduced = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(packs), model=[model],
                num_microbatches=len(packs), seq_length=1, micro_batch_size=1,
                forward_only=False)
            grads = {}
            for k, p in model.named_parameters():  # the schedule divided each loss by the
                g = p.grad * len(packs)  # packs
                if getattr(p, "sequence_parallel", False) and tp > 1:  # as Megatron's
                    dist.all_reduce(g, group=tp_group)  # finalize_model_grads does
                grads[names[k]] = full_of(p, g, tp_group, tp)
            logprobs = torch.zeros_like(reference[name]["logprobs"])
            entropy = torch.zeros_like(logprobs)
            for g, r in zip(groups, reduced or []):
                width = r["logprobs"].shape[1]
                logprobs[g, :width], entropy[g, :width] = r["logprobs"], r["entropy"]
            results[name] = {"grads": grads, "last": ps.is_pipeline_last_stage(),
                             "logprobs": logprobs, "entropy": entropy}
        torch.save(results, f"{out}/{layout['name']}-rank{rank}.pt")
    finally:
        shutdown()


# ------------------------------------------------------------------------- MoE and EP

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
           moe_router_load_balancing_type="aux_loss", moe_router_dtype="fp64")


def moe_subsets(case: dict, ranks: int) -> list[list[int]]:
    """The sequences each data-parallel (expert-parallel) rank trains on."""
    n = len(sequences(case.get("batch", "forest"), case.get("seed", 0)))
    return [list(range(r, n, ranks)) for r in range(ranks)]


def moe_reference_worker(rank: int, world: int, port: int, out: str, cases: dict,
                         ranks: int) -> None:
    """Per MoE case and per rank's subset: the canonical weights, and the subset as one
    right-padded batch through Megatron's own path, its padding excluded from the router's
    losses (``padding_mask``): the log-probs, and the gradients of the fixed loss plus the
    router's load-balancing and z-losses over the batch's tokens."""
    init(rank, world, port)
    try:
        results = {}
        for name, case in cases.items():
            model, state = canonical(case)
            model.train()
            seqs = sequences(case.get("batch", "forest"), case.get("seed", 0))
            w, v = weights((len(seqs), max(map(len, seqs))))
            per_rank = []
            for subset in moe_subsets(case, ranks):
                model.zero_grad(set_to_none=True)
                routes = routes_of(seqs, case)
                logps, loss = batched(model, [seqs[i] for i in subset], w[subset],
                                      None if routes is None else [routes[i] for i in subset])
                loss.backward()
                per_rank.append({"logprobs": logps.detach(), "grads": {
                    k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}})
            results[name] = {"state": state, "ranks": per_rank}
        torch.save(results, f"{out}/moe-reference.pt")
    finally:
        shutdown()


def batched(model, seqs: list, w: torch.Tensor, routes: list | None = None):
    """``seqs`` as one right-padded batch (replaying ``routes``, one per sequence, if given):
    ``[n, L]`` log-probs and the fixed loss."""
    n, width = len(seqs), max(map(len, seqs))
    ids = torch.zeros(n, width, dtype=torch.long)
    pad = torch.ones(n, width, dtype=torch.bool)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)], pad[b, :len(seq)] = torch.tensor(seq), False
    flat = None
    if routes is not None:  # the router sees the tokens [width, n]-major; padding: any route
        every = np.broadcast_to(np.arange(routes[0].shape[2], dtype=np.int16),
                                (width, n, *routes[0].shape[1:])).copy()
        for b, r in enumerate(routes):
            every[:len(r), b] = r
        flat = every.reshape(width * n, *routes[0].shape[1:])
    with replaying(model, flat):
        logits = model(ids, torch.arange(width).expand(n, -1), causal(width),
                       padding_mask=pad)
    logp = logits.log_softmax(-1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].where(~pad[:, 1:], 0)
    logps = torch.cat([torch.zeros(n, 1, dtype=picked.dtype), picked], 1)
    return logps, (logps * w[:, :width]).sum()


def expert_name(model, name: str, ep_rank: int) -> str:
    """A local expert's parameter name -> the canonical model's (its global expert index)."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.", 1)
    local, tail = rest.split(".", 1)
    from megatron.core import parallel_state as ps

    per_rank = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return f"{head}.local_experts.{ep_rank * per_rank + int(local)}.{tail}"


def moe_worker(rank: int, world: int, port: int, out: str, cases: dict) -> None:
    """Every MoE case at EP = ``world``: each rank its subset's pack, in train mode; the
    log-probs, and every parameter's gradient summed over the ranks (each expert's from the
    rank that holds it, which saw every rank's tokens routed to it)."""
    init(rank, world, port, ep=world)
    try:
        reference = torch.load(f"{out}/moe-reference.pt")
        each_case(cases, f"{out}/moe-rank{rank}.pt",
                  lambda name, case: run_moe_case(case, reference[name], rank, world))
    finally:
        shutdown()


def run_moe_case(case: dict, reference: dict, rank: int, world: int) -> dict:
    import treepack
    import treepack.megatron as tm

    model = build(case)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(reference["state"][expert_name(model, k, rank)])
    tm.prepare(model)
    model.train()
    seqs = sequences(case.get("batch", "forest"), case.get("seed", 0))
    w, _ = weights((len(seqs), max(map(len, seqs))))
    subset = moe_subsets(case, world)[rank]
    routes = routes_of(seqs, case)
    pack = treepack.TreePack.from_sequences(
        [seqs[i] for i in subset], routes=None if routes is None else [routes[i] for i in subset])
    if case.get("parts"):  # a tree over the budget, in parts
        width = pack.rows.shape[1]
        got = tm.backward_in_parts(
            model, pack, lambda out, mask: (out.logprobs * w[subset, :width]).where(mask, 0)
            .sum(), max_tokens=case["parts"])
    else:
        got = tm.logprobs(model, pack)
        width = got.logprobs.shape[1]
        (got.logprobs * w[subset, :width]).sum().backward()
    grads = {}
    for k, p in model.named_parameters():
        g = p.grad.clone()
        if getattr(p, "allreduce", True):  # a replicated parameter: every rank's share
            dist.all_reduce(g)
        grads[expert_name(model, k, rank)] = g
    every = [None] * world
    dist.all_gather_object(every, grads)
    merged = {}
    for per in every:
        merged.update(per)
    return {"logprobs": got.logprobs.detach(), "grads": merged}



def latent_traffic_worker(rank: int, world: int, port: int, out: str) -> None:
    """An MLA model at CP = ``world`` on one pack, forward only, twice: its keys and values
    exchanged as latents (the default), then as expanded keys and values (every layer's
    ``latent`` taken away). The values each rank received from the others in each, counted
    at the collectives, and the two runs' log-probs."""
    from treepack.adapters.megatron.attention import tree_layers
    from treepack.attention import exchange

    import treepack
    import treepack.megatron as tm

    init(rank, world, port, cp=world)
    try:
        case = {"mla": "rope"}
        torch.manual_seed(0)
        model = tm.prepare(build(case, cp=world))
        pack = treepack.TreePack.from_sequences(sequences("forest", 0))
        received = [0]
        all_to_all, gather_into = exchange._all_to_all, exchange._gather_into

        def counted_all_to_all(x, scatter, gather, group):
            received[0] += x.numel() * (world - 1) // world
            return all_to_all(x, scatter, gather, group)

        def counted_gather_into(output, input_, group=None):
            received[0] += output.numel() - input_.numel()
            return gather_into(output, input_, group=group)

        exchange._all_to_all, exchange._gather_into = counted_all_to_all, counted_gather_into
        result = {"rows": pack.num_rows}
        with torch.no_grad():
            for name in ("latent", "expanded"):
                received[0] = 0
                if name == "expanded":
                    for layer in tree_layers(model):
                        layer.latent = None
                got = tm.logprobs(model, pack)
                result[name] = {"received": received[0], "logprobs": got.logprobs}
        torch.save(result, f"{out}/traffic-rank{rank}.pt")
    finally:
        shutdown()
