"""megatron-core on a tree: step time, activation memory per rank and the context-parallel
exchange of a GPTModel on the ragged RL workloads, tree vs padding-free vs padded, at TP = 1,
TP = 2 and CP = 2, in one run (gloo on this CPU).

    python bench/megatron.py            # lengths / 16 (the workloads of treepack bench)
    python bench/megatron.py --quick    # lengths / 64, one round: a CPU check

Runs where megatron-core is installed (``pip install -e ".[test-megatron]"``, the
environment ``.ci/run`` makes); megatron-core's CUDA assumptions are stood in for as the tests
do (``tests/support/megatron_cpu.py``).

Each layout runs in fresh processes holding the same random model (float32: hidden 256,
2 layers, 8 query / 2 key-value heads of 32, intermediate 512, vocabulary 4,096, rope).
Steps, one training step each (forward, mean NLL over every original prediction, backward):

- ``tree``: ``treepack.megatron.logprobs`` on ``TreePack.from_sequences`` (one pack);
- ``padding_free``: the same on ``TreePack.from_sequences(..., share_prefixes=False)``: every
  sequence its own chain, the same kernels, nothing shared (THD packing without
  TransformerEngine, which does not run on a CPU);
- ``padded``: Megatron's own path, a right-padded ``[B, L]`` batch with a causal mask through
  the stock core attention and full vocabulary-parallel logits (its loss on a copy of them,
  as ``vocab_parallel_cross_entropy`` changes its input); Megatron's local attention refuses
  context parallelism, so not at CP = 2.

Per layout and workload: the median step time over ``--repeats`` interleaved rounds on the
slowest rank, the ratios round by round; the bytes each rank saves for its backward during
the forward (the rank that holds the most); and at CP = 2 the bytes each attention layer's
forward hands the all-to-all per rank, against the formula ``(h + 2 k' + h) · d · w`` elements
(``h`` query heads and ``k' = lcm(k, CP)`` key/value heads of the TP rank, ``w`` rows per CP
rank).

``--model gdn`` makes the first layer a Gated DeltaNet (Qwen3-Next's hybrid; megatron-core's
torch kernel, ``deterministic_mode``). megatron-core cannot pack that layer (its
``GatedDeltaNet`` refuses packed sequences), so ``padding_free`` there is treepack's own path
on every sequence's chain, the strongest packed baseline there is; ``padded`` is Megatron's.

``--model mamba`` runs megatron-core's ``MambaModel`` (Nemotron-H's hybrid, small: a Mamba2
layer, an MLP, attention, an MLP; the Mamba2 kernels mamba_ssm's where installed, else torch's
SSD in chunks, ``megatron_cpu.mamba_without_ssm``, in the stock steps as in the tree's).
megatron-core packs Mamba2 layers only through mamba_ssm's kernels, so on a CPU
``padding_free`` is treepack's own path on every sequence's chain, as for ``gdn``.

``--model moe`` makes every MLP an MoE layer (8 experts, top-2, all-to-all dispatch) that
replays the rollout's routes (``moe_enable_routing_replay``; routes a function of each
token's context, so a shared prefix has one): the tree and padding-free packs carry them
(``routes=``), the padded step replays them through Megatron's ``RouterReplay``. Layouts
TP = 1 and EP = 2 (expert parallelism is data parallelism: each rank half the sequences).

On one device (``--device cuda``, or ``--device cpu`` for a check of the same code): one
process, TP = 1, and two parts.

- ``verify``: the tree against every sequence alone through Megatron's own attention on the
  same model (GQA with rope; the same with a 64-position window on every other layer; MoE
  layers replaying the rollout's routes, which the reference replays through
  ``RouterReplay``; DeepSeek's multi-latent attention with yarn, its reference attention
  ``megatron_cpu.ReferenceAttention``; ``--model gdn``'s hybrid, on fla's kernels where fla
  is installed; ``--model mamba``'s), in
  float32 (flex and segment: varlen refuses float32) and in bfloat16 inside Megatron's
  ``Float16Module`` (varlen and flex), and in parts under a quarter of the tree's rows
  (``treepack.megatron.backward_in_parts``). Log-probs and every parameter gradient (of a fixed
  random weighting of the log-probs) against the float32 reference; in bfloat16 the error
  is divided by the bfloat16 model's own error run sequence by sequence (its spread).
- ``step``: the timing above on a Qwen2.5-0.5B-shaped model in bfloat16 (24 layers, hidden
  896, 14 / 2 heads of 64, vocabulary 151,936; ``--shape tiny``: the CPU model), padded in
  micro-batches of 4 rows (fewer where they would pass 8,192 padded tokens: Megatron's local
  attention holds every layer's ``[b, h, L, L]`` scores) and padding-free in packs of at
  most 32,768 tokens, with the peak memory of each step; and the tree under a budget of a
  quarter of its rows, in parts (``treepack.megatron.backward_in_parts``) against the plan's
  split (each pack repeating its prefix).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# this file is megatron.py: its own folder off the path, or `import megatron` finds it
sys.path[:] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests", "support")] + [
    p for p in sys.path if os.path.abspath(p or ".") != HERE]

from megatron_cpu import replaying  # noqa: E402  (Megatron's own routing replay)
from treepack import TreePack  # noqa: E402
from treepack.face.benchmark.memory import saved_storages  # noqa: E402
from treepack.face.benchmark.timing import Spread, interleave  # noqa: E402
from treepack.face.benchmark.traffic import Traffic  # noqa: E402
from treepack.face.benchmark.workloads import rl_workloads  # noqa: E402
from treepack.planning.planner import plan  # noqa: E402

VOCAB = 4096
MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
             kv_channels=32, ffn_hidden_size=512)
LAYOUTS = {"TP=1": dict(tp=1, cp=1), "TP=2": dict(tp=2, cp=1), "CP=2": dict(tp=1, cp=2),
           "EP=2": dict(tp=1, cp=1, ep=2)}
# --model moe: every MLP 8 experts, top-2, all-to-all dispatch, replaying the rollout's
# routes (R3); the router's losses off (the padded batch's padding would count in them)
MOE = dict(num_moe_experts=8, moe_router_topk=2, moe_enable_routing_replay=True,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
# --model gdn: the first of the two layers a Gated DeltaNet (Qwen3-Next's hybrid, small:
# 8 value heads over 4 key heads of 32, a kernel of 4), megatron-core's torch kernel
GDN = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
           linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
           linear_num_key_heads=4, linear_num_value_heads=8)
# --model mamba: Nemotron-H's hybrid, small: a Mamba2 layer, an MLP, attention, an MLP (8 heads
# of 64, B and C in 2 groups of 64 states, chunks of 128), megatron-core's MambaModel
MAMBA = dict(hybrid_override_pattern="M-*-", mamba_num_heads=8, mamba_head_dim=64,
             mamba_num_groups=2, mamba_state_dim=64)
FIELDS = {"dense": {}, "moe": MOE, "gdn": GDN, "mamba": MAMBA}
STEPS = ("tree", "padding_free", "padded")


SHAPES = {"tiny": dict(MODEL, vocab=VOCAB),
          "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, num_attention_heads=14,
                               num_query_groups=2, kv_channels=64, ffn_hidden_size=4864,
                               vocab=151936)}


def build(tp: int, cp: int, shape: dict | None = None, bf16: bool = False, device="cpu",
          **fields):
    """The bench's GPTModel (float32; in Megatron's ``Float16Module`` with ``bf16``), prepared
    for trees; ``fields`` go to its ``TransformerConfig`` (with ``hybrid_override_pattern``:
    a MambaModel of that pattern)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    import treepack.megatron as tm

    shape = dict(shape or SHAPES["tiny"])
    vocab = shape.pop("vocab")
    fields = dict(fields)
    pattern = fields.pop("hybrid_override_pattern", None)
    if pattern is not None:
        shape["num_layers"] = len(pattern)
    mla = bool(fields.get("multi_latent_attention"))
    make = TransformerConfig
    if mla:  # DeepSeek's shape of it, small: q and kv low-rank, a decoupled rope part
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        make = MLATransformerConfig
        shape.update(num_query_groups=shape["num_attention_heads"])
    config = make(
        **shape, use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        # megatron-core 0.16's config refuses CP with Gated DeltaNet; the tree's CP is
        # parallel_state's either way
        context_parallel_size=1 if "experimental_attention_variant" in fields else cp,
        bf16=bf16, **fields)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm",
                                    num_experts=fields.get("num_moe_experts"),
                                    multi_latent_attention=mla, qk_layernorm=mla)
    if mla:  # the stock path: megatron-core's local attention takes no k_channels
        from megatron_cpu import ReferenceAttention, mla_without_te

        mla_without_te()
        spec.submodules.self_attention.submodules.core_attention = ReferenceAttention
    if "experimental_attention_variant" in fields:  # Gated DeltaNet, then attention
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron_cpu import gdn_layer

        # fla's kernels where fla is installed (a GPU), else megatron-core's torch kernel
        config.deterministic_mode = importlib.util.find_spec("fla") is None
        spec = TransformerBlockSubmodules(
            layer_specs=[gdn_layer(spec) if i % 2 == 0 else spec
                         for i in range(config.num_layers)])
    if pattern is not None:  # mamba_ssm's kernels where installed, else torch's in chunks
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron_cpu import hybrid_stack_spec

        model = MambaModel(config, tm.layer_spec(hybrid_stack_spec(chunked=True)),
                           vocab_size=vocab, max_sequence_length=1 << 16,
                           hybrid_override_pattern=pattern, position_embedding_type="rope")
    else:
        model = GPTModel(config, tm.layer_spec(spec), vocab_size=vocab,
                         max_sequence_length=1 << 16, position_embedding_type="rope")
    model.to(device)
    if bf16 and pattern is not None:  # built in float32 as the float32 model is (the same
        config.params_dtype = torch.bfloat16  # weights, rounded), then Megatron's bf16
        # setting, which a Mamba layer casts its input to
    return tm.prepare(Float16Module(config, model) if bf16 else model)


def routes_of(sequences: list, layers: int, experts: int) -> list:
    """Routes as a rollout engine records them for ``--model moe`` (``[len, layers, 2]`` per
    sequence): a function of each token's whole context (a running hash of the prefix), so a
    shared prefix has one route, and two distinct experts per layer."""
    import numpy as np

    out = []
    for seq in sequences:
        h, rows = 0, []
        for token in seq:  # host work before the clock, once per workload
            h = (h * 1_000_003 + int(token) + 1) % (1 << 61)
            first = [(h >> (7 * layer)) % experts for layer in range(layers)]
            rows.append([[e, (e + 1 + (h >> (5 + 7 * layer)) % (experts - 1)) % experts]
                         for layer, e in enumerate(first)])
        out.append(np.asarray(rows, dtype=np.int16))
    return out


def tree_step(model, pack: TreePack, backend: str = "auto", count: int | None = None):
    """The mean NLL of the pack's predictions (over ``count`` where the pack is one of several
    making up a batch)."""
    import treepack.megatron as tm

    mask, count = pack.prediction_mask, count or pack.num_predictions

    def forward():
        out = tm.logprobs(model, pack, backend=backend).logprobs
        return -out.where(mask, 0).sum() / count

    return forward


def padded_step(model, sequences: list, device="cpu", count: int | None = None,
                routes: list | None = None):
    """Megatron's own step on a right-padded batch: full logits, its loss on a copy (the mean
    over ``count`` predictions where the batch is a micro-batch of a larger one); replaying
    ``routes`` (one per sequence) where given."""
    from megatron.core import tensor_parallel

    width = max(map(len, sequences))
    flat = None
    if routes is not None:  # the router sees [width, batch] tokens; padding: any route
        every = torch.zeros(width, len(sequences), *routes[0].shape[1:], dtype=torch.long)
        every[..., 1] = 1
        for b, r in enumerate(routes):
            every[:len(r), b] = torch.from_numpy(r.astype("int64"))
        flat = every.reshape(width * len(sequences), *routes[0].shape[1:]).to(device)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    real = torch.zeros(len(sequences), width, dtype=torch.bool)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq)], real[b, :len(seq)] = torch.as_tensor(seq), True
    positions = torch.arange(width).expand(len(sequences), -1)
    i = torch.arange(width)
    causal = (i[None, :] > i[:, None])[None, None]
    labels = torch.roll(ids, -1, 1)
    predicted = real & torch.roll(real, -1, 1)
    predicted[:, -1] = False
    count = count or int(predicted.sum())
    ids, positions, causal, labels, predicted = (
        t.to(device) for t in (ids, positions, causal, labels, predicted))

    def forward():
        with replaying(model, flat):
            logits = model(ids, positions, causal)  # [B, L, V / tp]
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels)
        return nll.where(predicted, 0).sum() / count

    return forward


def parts_step(model, pack: TreePack, budget: int, count: int, value: bool = True):
    """One step of the mean NLL over a tree too large for ``budget`` rows, in parts: its loss
    (a number; ``value=False``: a detached tensor, the backward done)."""
    import treepack.megatron as tm

    def loss_fn(out, mask):
        return -out.logprobs.where(mask, 0).sum() / count

    def step():
        loss = tm.backward_in_parts(model, pack, loss_fn, max_tokens=budget).loss
        return loss.item() if value else loss

    return step


def split_step(model, packs: list, count: int):
    """One step of the mean NLL over the plan's packs of a split tree, one backward each."""
    forwards = [tree_step(model, p, count=count) for p in packs]

    def step():
        total = 0.0
        for forward in forwards:
            loss = forward()
            loss.backward()
            total += loss.item()
        return total

    return step


def formula_bytes(rows: int, cp: int, tp: int, itemsize: int) -> int:
    """What a CP rank hands the all-to-all per attention layer in the forward: q, k and v of
    its rows out, ``(h + 2 k') d w`` elements, the output back, ``h d w`` (module doc)."""
    if cp == 1:
        return 0
    h, k = MODEL["num_attention_heads"] // tp, MODEL["num_query_groups"] // tp
    d, w = MODEL["kv_channels"], -(-rows // cp)
    return (h + 2 * math.lcm(k, cp) + h) * d * w * itemsize


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import megatron_cpu
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    torch.set_num_threads(config["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    megatron_cpu.install()
    layout = LAYOUTS[config["layout"]]
    ep = layout.get("ep", 1)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"],
                                 context_parallel_size=layout["cp"],
                                 expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        torch.manual_seed(0)
        moe = config["model"] == "moe"
        model = build(layout["tp"], layout["cp"], **(
            dict(MOE, expert_model_parallel_size=ep,
                 sequence_parallel=layout["tp"] > 1) if moe else FIELDS[config["model"]]))
        out = {}
        for w in rl_workloads(scale=config["scale"], vocab=VOCAB):
            seqs = [list(map(int, s)) for s in w.sequences]
            if ep > 1:  # expert parallelism is data parallelism: each rank half the batch
                half = -(-len(seqs) // ep)
                seqs = seqs[rank * half:(rank + 1) * half]
            routes = (routes_of(seqs, MODEL["num_layers"], MOE["num_moe_experts"]) if moe
                      else None)
            packs = {"tree": TreePack.from_sequences(seqs, routes=routes),
                     "padding_free": TreePack.from_sequences(seqs, share_prefixes=False,
                                                             routes=routes)}
            steps = {name: tree_step(model, pack) for name, pack in packs.items()}
            if layout["cp"] == 1:
                steps["padded"] = padded_step(model, seqs, routes=routes)
            # the tree over a budget of a quarter of its rows: in parts (every row once)
            # against the plan's split, whose packs repeat the prefix above each cut
            budget = max(packs["tree"].num_rows // 4, max(map(len, seqs)))
            whole = sum(len(s) - 1 for s in seqs)
            split = [p for p in plan(seqs, max_tokens=budget, routes=routes).packs(0)
                     if p.num_sequences]
            over = {"in_parts": parts_step(model, packs["tree"], budget, whole),
                    "split": split_step(model, split, whole)}
            if ep > 1:  # each rank its own trees: as many parts and packs as the others'
                over = {}  # forwards (the experts' all-to-all) is the schedule's to arrange
            result = {}
            for name, run in over.items():  # warm-up
                model.zero_grad(set_to_none=True)
                result[name] = dict(loss=run(), budget=budget,
                                    rows=sum(p.num_rows for p in split) if name == "split"
                                    else packs["tree"].num_rows)
            for name, forward in steps.items():  # warm-up: held bytes, traffic, the loss
                model.zero_grad(set_to_none=True)
                traffic = Traffic()
                with traffic.counting(), saved_storages(model) as held:
                    loss = forward()
                traffic.phase = "backward"
                with traffic.counting():
                    loss.backward()
                result[name] = dict(loss=loss.item(), held=sum(held.values()),
                                    traffic=traffic.counts,
                                    rows=packs[name].num_rows if name in packs else None)

            @contextlib.contextmanager
            def around(name):  # outside the clock: gradients freed, the ranks together
                model.zero_grad(set_to_none=True)
                dist.barrier()
                yield

            def run(forward):
                return lambda: forward().backward()

            times = interleave({**{n: run(f) for n, f in steps.items()}, **over},
                               config["repeats"], around=around)
            for name in times:
                result[name]["seconds"] = times[name]
            out[w.name] = dict(result, tokens=sum(map(len, seqs)))
        with open(os.path.join(config["dir"], f"{config['layout']}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_layout(name: str, config: dict) -> list[dict]:
    from launch import free_port

    layout = LAYOUTS[name]
    world = layout["tp"] * layout["cp"] * layout.get("ep", 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    config = dict(config, layout=name, threads=max(1, (cores or 1) // world))
    os.environ["OMP_NUM_THREADS"] = str(config["threads"])
    mp.spawn(worker, args=(world, free_port(), config), nprocs=world, join=True)
    every = []
    for r in range(world):
        with open(os.path.join(config["dir"], f"{name}-rank{r}.json")) as f:
            every.append(json.load(f))
    return every


def combine(name: str, every: list[dict], model: str = "dense") -> dict:
    """Per workload and step: the slowest rank per round, the rank holding the most."""
    layout = LAYOUTS[name]
    rows = {}
    for w in every[0]:
        steps = [s for s in STEPS if s in every[0][w]]
        row = {"tokens": every[0][w]["tokens"]}
        for s in steps:
            per = [r[w][s] for r in every]
            rounds = [max(t) for t in zip(*(p["seconds"] for p in per))]
            forward = max(p["traffic"]["forward"]["sent"] for p in per) / MODEL["num_layers"]
            row[s] = dict(seconds=statistics.median(rounds), rounds=rounds, loss=per[0]["loss"],
                          held=max(p["held"] for p in per), rows=per[0]["rows"],
                          exchange=forward)
        for s in ("in_parts", "split"):  # the tree over a budget (held: not measured)
            if s not in every[0][w]:
                continue
            per = [r[w][s] for r in every]
            rounds = [max(t) for t in zip(*(p["seconds"] for p in per))]
            row[s] = dict(seconds=statistics.median(rounds), rounds=rounds, loss=per[0]["loss"],
                          rows=per[0]["rows"], budget=per[0]["budget"])
        for top, base in (("tree", "padding_free"), ("tree", "padded"), ("in_parts", "split"),
                          ("in_parts", "tree")):
            if base in row and top in row:
                row[f"{top}/{base}"] = Spread.of(
                    a / b for a, b in zip(row[top]["rounds"], row[base]["rounds"]))._asdict()
        row["formula"] = formula_bytes(row["tree"]["rows"], layout["cp"], layout["tp"], 4) \
            if model not in ("gdn", "mamba") else None  # a recurrent layer exchanges
        # otherwise
        rows[w] = row
    return rows


# ---------------------------------------------------------------- one device (--device)

VERIFY = {"gqa-rope": {}, "window-64": dict(window_size=(63, 0), window_attn_skip_freq=2),
          # MoE replaying the rollout's routes (R3), and DeepSeek's multi-latent attention
          # (yarn; q 64 + 32 rope wide, v 64)
          "moe-replay": MOE,
          "mla-yarn": dict(multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64,
                           qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
                           rope_type="yarn", rotary_scaling_factor=4.0,
                           original_max_position_embeddings=256, mscale=1.0,
                           mscale_all_dim=1.0),
          # a Gated DeltaNet layer, then attention (--model gdn's)
          "gdn-hybrid": GDN,
          # a Mamba2 layer, an MLP, attention, an MLP (--model mamba's)
          "mamba-hybrid": MAMBA}


def in_packs(sequences: list, budget: int) -> list[list]:
    """Consecutive sequences in groups of at most ``budget`` tokens (padding-free packs)."""
    out, size = [[]], 0
    for seq in sequences:
        if out[-1] and size + len(seq) > budget:
            out.append([])
            size = 0
        out[-1].append(seq)
        size += len(seq)
    return out


def alone(model, sequences: list, weights: torch.Tensor, device, routes=None) -> tuple:
    """Every sequence run alone through Megatron's own attention (replaying ``routes``, one
    per sequence, where given): ``[N, L]`` log-probs, and the gradients of ``(weights *
    log-probs).sum()`` by parameter name."""
    out = torch.zeros(weights.shape, device=device)
    model.zero_grad(set_to_none=True)
    for s, seq in enumerate(sequences):
        ids = torch.tensor(seq, device=device)[None]
        positions = torch.arange(len(seq), device=device)[None]
        i = torch.arange(len(seq), device=device)
        route = None if routes is None else torch.from_numpy(routes[s].astype("int64"))
        with replaying(model, None if route is None else route.to(device)):
            logits = model(ids, positions, (i[None, :] > i[:, None])[None, None])[0].float()
        logp = logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        (weights[s, 1:len(seq)] * logp).sum().backward()
        out[s, 1:len(seq)] = logp.detach()
    return out, grads_of(model)


def on_tree(model, pack: TreePack, weights: torch.Tensor, backend: str) -> tuple:
    import treepack.megatron as tm

    model.zero_grad(set_to_none=True)
    logp = tm.logprobs(model, pack, backend=backend).logprobs.float()
    (weights * logp).sum().backward()
    return logp.detach(), grads_of(model)


def in_parts(model, pack: TreePack, weights: torch.Tensor, budget: int) -> tuple:
    """:func:`on_tree` with the tree over ``budget`` rows, in parts (every row once)."""
    import treepack.megatron as tm

    def loss_fn(out, mask):
        return (weights * out.logprobs.float()).where(mask, 0).sum()

    model.zero_grad(set_to_none=True)
    result = tm.backward_in_parts(model, pack, loss_fn, max_tokens=budget)
    return result.logprobs.float(), grads_of(model)


def grads_of(model) -> dict:
    return {name.removeprefix("module."): p.grad.float().clone()
            for name, p in model.named_parameters() if p.grad is not None}


def errors(logp, grads, reference) -> dict:
    """The log-probs' largest error, and the gradients' (per tensor, over its largest value;
    the worst tensor, named)."""
    ref_logp, ref_grads = reference
    if set(grads) != set(ref_grads):
        raise AssertionError(f"gradients of {sorted(set(grads) ^ set(ref_grads))} on one side")
    per = {k: ((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
           for k, g in ref_grads.items()}
    worst = max(per, key=per.get)
    return dict(logprobs=(logp - ref_logp).abs().max().item(), grads=per[worst],
                worst=worst)


def verify_rows(device, quick: bool) -> list[dict]:
    """The tree against every sequence alone on the same model (module doc, ``verify``)."""
    from megatron.core import tensor_parallel

    works = rl_workloads(scale=64 if quick else 16, vocab=VOCAB)[: 1 if quick else None]
    cuda = device.type == "cuda"
    rows = []
    for name, fields in VERIFY.items():
        models = {}
        try:  # a megatron-core that cannot build the model: its rows, not the run
            for bf16 in (False, True):  # the same weights: both generators reseeded (the
                torch.manual_seed(0)  # recurrent layers draw theirs from Megatron's tracker)
                tensor_parallel.model_parallel_cuda_manual_seed(0)
                models[bf16] = build(1, 1, bf16=bf16, device=device, **fields)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(model=name, result="ERROR",
                             message=f"{type(e).__name__}: {e}"[:300]))
            print("verify " + json.dumps(rows[-1]), flush=True)
            continue
        for w in works:
            seqs = [list(map(int, s)) for s in w.sequences]
            routes = (routes_of(seqs, MODEL["num_layers"], MOE["num_moe_experts"])
                      if "num_moe_experts" in fields else None)
            pack = TreePack.from_sequences(seqs, device=device, routes=routes)
            weights = torch.randn(pack.prediction_mask.shape, generator=torch.Generator()
                                  .manual_seed(1)).to(device).where(pack.prediction_mask, 0)
            reference = alone(models[False], seqs, weights, device, routes)
            spread = errors(*alone(models[True], seqs, weights, device, routes), reference)
            budget = max(pack.num_rows // 4, max(map(len, seqs)))
            fast = ("flex",) if "multi_latent_attention" in fields else ("varlen", "flex")
            for dtype, backends in (("float32", ("flex", "segment") if cuda else ("segment",)),
                                    ("bfloat16", fast if cuda else ("segment",))):
                for backend in (*backends, "parts"):  # parts: under a quarter of the rows
                    row = dict(model=name, workload=w.name, dtype=dtype, backend=backend,
                               rows=pack.num_rows, tokens=sum(map(len, seqs)))
                    model = models[dtype == "bfloat16"]
                    try:
                        err = errors(*(in_parts(model, pack, weights, budget)
                                       if backend == "parts" else
                                       on_tree(model, pack, weights, backend)), reference)
                    except Exception as e:  # noqa: BLE001 - a row, not the run
                        rows.append(dict(row, result="ERROR", message=f"{type(e).__name__}: "
                                         f"{e}"[:300]))
                        continue
                    if dtype == "float32":
                        ok = err["logprobs"] <= 1e-3 and err["grads"] <= 1e-3
                    else:  # bfloat16: within 1.5x of the model's own error sequence by sequence
                        err.update(own_logprobs=spread["logprobs"], own_grads=spread["grads"])
                        ok = all(err[k] <= 1.5 * max(spread[k], 1e-6 if k == "logprobs" else
                                                     1e-4) for k in ("logprobs", "grads"))
                    rows.append(dict(row, **err, result="PASS" if ok else "FAIL"))
                    print("verify " + json.dumps(rows[-1]), flush=True)
    return rows


def step_rows(device, shape: str, scale: int, repeats: int) -> dict:
    """Tree vs padding-free vs padded training steps on one device (module doc, ``step``)."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build(1, 1, shape=SHAPES[shape], bf16=cuda, device=device)
    vocab = SHAPES[shape]["vocab"]
    out = {}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for w in rl_workloads(scale=scale, vocab=vocab):
        seqs = [list(map(int, s)) for s in w.sequences]
        count = sum(len(s) - 1 for s in seqs)
        # Megatron's local attention holds [b, h, L, L] scores per layer: 4 rows a
        # micro-batch, fewer for long ones (at most 8,192 padded tokens)
        micro = max(1, min(4, 8192 // max(map(len, seqs))))
        tree = TreePack.from_sequences(seqs, device=device)
        free = [TreePack.from_sequences(g, share_prefixes=False, device=device)
                for g in in_packs(seqs, 32768)]
        budget = max(tree.num_rows // 4, max(map(len, seqs)))  # a tree over a budget:
        split = [p for p in plan(seqs, max_tokens=budget, device=device).packs(0) if p.num_sequences]
        parts = {"tree": [tree_step(model, tree, count=count)],
                 "in_parts": [parts_step(model, tree, budget, count, value=False)],
                 "split": [tree_step(model, p, count=count) for p in split],
                 "padding_free": [tree_step(model, p, count=count) for p in free],
                 "padded": [padded_step(model, seqs[i:i + micro], device, count=count)
                            for i in range(0, len(seqs), micro)]}

        def step(forwards):
            def run():
                loss = 0.0
                for forward in forwards:  # micro-batches: each backward frees its graph
                    part = forward()
                    if part.requires_grad:  # in parts, the backward is done already
                        part.backward()
                    loss += float(part)
                sync()
                return loss
            return run

        steps = {name: step(f) for name, f in parts.items()}
        row = {"tokens": sum(map(len, seqs)), "rows": tree.num_rows,
               "padding_free_rows": sum(p.num_rows for p in free), "budget": budget,
               "split_rows": sum(p.num_rows for p in split)}
        for name, run in steps.items():  # warm-up: the loss and the peak memory
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            row[name] = {"loss": run()}
            if cuda:
                row[name]["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20

        @contextlib.contextmanager
        def around(name):
            model.zero_grad(set_to_none=True)
            sync()
            yield

        times = interleave(steps, repeats, around=around)
        for name in steps:
            row[name]["seconds"] = statistics.median(times[name])
        for top, base in (("tree", "padding_free"), ("tree", "padded"), ("in_parts", "split"),
                          ("in_parts", "tree")):
            row[f"{top}/{base}"] = Spread.of(
                a / b for a, b in zip(times[top], times[base]))._asdict()
        out[w.name] = row
        print("step " + json.dumps({w.name: row}), flush=True)
    return out


def single(args) -> None:
    """One process on one device: verify, then step (module doc)."""
    from launch import free_port
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if device.type != "cuda":
        import megatron_cpu

        megatron_cpu.install()
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    import megatron.core

    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                  torch=torch.__version__, megatron_core=megatron.core.__version__)
    try:
        import transformer_engine  # noqa: F401
        report["transformer_engine"] = transformer_engine.__version__
    except ImportError as e:
        report["transformer_engine"] = f"not installed ({e})"
    print("bench/megatron.py " + json.dumps(report), flush=True)
    try:
        if "verify" in args.parts:
            report["verify"] = verify_rows(device, args.quick)
        if "step" in args.parts:
            report["step"] = step_rows(device, args.shape, 64 if args.quick else args.scale,
                                       args.repeats or (1 if args.quick else 3))
    finally:
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths / 64, one round")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layouts", nargs="*", default=None,
                        help="default: TP=1 TP=2 CP=2 (dense, gdn, mamba), TP=1 EP=2 "
                        "(--model moe)")
    parser.add_argument("--model", default="dense", choices=tuple(FIELDS),
                        help="moe: MoE layers replaying the rollout's routes; gdn: a Gated "
                             "DeltaNet layer before the attention layer; mamba: a Mamba2 "
                             "hybrid (module doc)")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--device", default=None,
                        help="one process on this device (cuda; cpu: a check of that path)")
    parser.add_argument("--parts", nargs="+", default=["verify", "step"],
                        help="with --device: verify, step")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES),
                        help="with --device: the step's model")
    parser.add_argument("--scale", type=int, default=1,
                        help="with --device: workload lengths / scale")
    args = parser.parse_args()
    if args.device:
        return single(args)
    config = dict(scale=64 if args.quick else 16, model=args.model,
                  repeats=args.repeats or (1 if args.quick else 3))
    if args.layouts is None:
        args.layouts = ["TP=1", "EP=2"] if args.model == "moe" else ["TP=1", "TP=2", "CP=2"]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.layouts:
            results[name] = combine(name, run_layout(name, dict(config, dir=d)), args.model)
    print(f"bench/megatron.py: {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, lengths / {config['scale']}, {config['repeats']} rounds, "
          f"model {args.model}")
    print("| layout | workload | tokens | rows tree / padding-free | step s tree | padding-free "
          "| padded | tree / padding-free [range] | tree / padded [range] | MiB held per rank "
          "tree / padding-free / padded | exchange KiB per layer (formula) | loss tree / "
          "padded |")
    print("|---|---|---:|---|---:|---:|---:|---|---|---|---|---|")
    for name, rows in results.items():
        for w, row in rows.items():
            t, f, p = row["tree"], row["padding_free"], row.get("padded")

            def spread(key, r=row):
                s = r.get(key)
                return f"{s['median']:.3f} [{s['low']:.3f}–{s['high']:.3f}]" if s else "n/a"

            held = " / ".join(f"{x['held'] / 2**20:.1f}" if x else "n/a" for x in (t, f, p))
            exchange = (f"{t['exchange'] / 1024:.1f} ({row['formula'] / 1024:.1f})"
                        if row["formula"] else "–")
            if row["formula"] is None and LAYOUTS[name]["cp"] > 1:  # no formula: measured
                exchange = f"{t['exchange'] / 1024:.1f}"
            padded = f"{p['seconds']:.2f}" if p else "n/a"
            loss = f"{t['loss']:.4f} / " + (f"{p['loss']:.4f}" if p else "n/a")
            print(f"| {name} | {w} | {row['tokens']:,} | {t['rows']:,} / {f['rows']:,} | "
                  f"{t['seconds']:.2f} | {f['seconds']:.2f} | {padded} | "
                  f"{spread('tree/padding_free')} | {spread('tree/padded')} | {held} | "
                  f"{exchange} | {loss} |")
    print("\nThe tree over a budget of a quarter of its rows: in parts (every row once) and "
          "the plan's split (each pack repeats the prefix above its cut), beside the whole "
          "tree in one forward:")
    print("| layout | workload | budget | rows in parts / split | step s in parts | split | "
          "whole tree | in parts / split [range] | in parts / whole [range] | loss in parts / "
          "split / whole |")
    print("|---|---|---:|---|---:|---:|---:|---|---|---|")
    for name, rows in results.items():
        for w, row in rows.items():
            if "in_parts" not in row:
                continue
            p, sp, t = row["in_parts"], row["split"], row["tree"]

            def spread(key, r=row):
                s = r[key]
                return f"{s['median']:.3f} [{s['low']:.3f}–{s['high']:.3f}]"

            print(f"| {name} | {w} | {p['budget']:,} | {p['rows']:,} / {sp['rows']:,} | "
                  f"{p['seconds']:.2f} | {sp['seconds']:.2f} | {t['seconds']:.2f} | "
                  f"{spread('in_parts/split')} | {spread('in_parts/tree')} | "
                  f"{p['loss']:.4f} / {sp['loss']:.4f} / {t['loss']:.4f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
