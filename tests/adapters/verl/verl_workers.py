"""verl's real FSDP language-model engine on CPU, for tests/adapters/test_verl.py (spawned ranks import
this module).

verl 0.9.1 knows only GPU and NPU platforms. The test-only adjustments, none of which changes
verl's code:

- a CPU platform (``platform_manager.set_platform``): device ``"cpu"``, collectives over gloo,
  no-op versions of the ``torch.cuda`` calls verl makes through ``get_torch_device()``;
  installed before ``transformer_impl`` is imported, which reads the device name at import;
- FSDP1 only: torch's guard against ``sync_module_states=True`` with CPU tensors (verl
  hard-codes that flag; the broadcast itself works over gloo) is switched off;
- ``attn_implementation="sdpa"`` (verl's default, flash_attention_2, needs flash-attn) and an
  fp32 mixed-precision policy, so both engines compute in float32 and compare exactly.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import logging
import os
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase


def _none(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


class _CPUDevice(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes (memory stats, cache, rng)."""

    empty_cache = ipc_collect = reset_peak_memory_stats = staticmethod(_none)
    set_per_process_memory_fraction = manual_seed = manual_seed_all = staticmethod(_none)
    memory_allocated = memory_reserved = staticmethod(_zero)
    max_memory_allocated = max_memory_reserved = staticmethod(_zero)
    mem_get_info = staticmethod(lambda *a, **k: (0, 0))
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    get_device_name = staticmethod(lambda *a, **k: "cpu")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)


class CPUPlatform(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPUDevice("verl_test_cpu")

    def current_device(self):
        return "cpu"  # verl passes it to .to(): an int would mean an accelerator

    def communication_backend_name(self):
        return "gloo"

    def is_available(self):
        return True

    def device_count(self):
        return 1

    def get_device_capability(self, device_index=0):
        return None, None

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @contextmanager
    def nvtx_range(self, msg):
        yield

    set_device = synchronize = set_allocator_settings = empty_cache = _none
    profiler_start = profiler_stop = cudart = _none


if not isinstance(platform_manager._current_platform, CPUPlatform):
    platform_manager.set_platform(CPUPlatform())

from verl.trainer.config import CheckpointConfig  # noqa: E402  (after the platform)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dataset.dataset_utils import DatasetPadMode  # noqa: E402
from verl.utils.metric.utils import Metric  # noqa: E402
from verl.utils.torch_functional import allgather_dict_into_dict  # noqa: E402
from verl.workers.config import (  # noqa: E402
    ActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import response_from_nested  # noqa: E402

import treepack.verl as treepack_verl  # noqa: E402
from tolerance import FLOAT32_RELATIVE  # noqa: E402
from treepack import hf  # noqa: E402

VOCAB = 128
PAD, EOS, BOS, UNK = 0, 1, 2, 3
# float32 engines, tree and stock: every output and gradient within FLOAT32_RELATIVE of its
# largest value (a loss or a metric: of itself)
TOLERANCE = FLOAT32_RELATIVE


# ------------------------------------------------------------------------------- the model

def make_model_dir(root: str, family: str = "qwen2", layers: int = 2) -> str:
    """A random tiny model (Qwen2 of ``layers`` layers, or a ``treepack.zoo`` family such as
    the hybrid ``qwen3_5``) and a word-level tokenizer, saved where verl loads models from."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = os.path.join(root, f"tiny_{family}" + ("" if layers == 2 else f"_{layers}"))
    torch.manual_seed(0)
    from treepack import zoo

    if family in zoo.VISION_FAMILIES:  # vocabulary 128 with the image placeholders 100-103
        model = zoo.tiny_vision_model(family)
        model.config.text_config.update(dict(pad_token_id=PAD, eos_token_id=EOS,
                                             bos_token_id=BOS))
        model.save_pretrained(path)
    elif family == "qwen3_moe":  # 4 experts, top-2, in every layer
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                tie_word_embeddings=False, decoder_sparse_step=1,
                                mlp_only_layers=[], norm_topk_prob=True, pad_token_id=PAD,
                                eos_token_id=EOS, bos_token_id=BOS)
        Qwen3MoeForCausalLM(config).save_pretrained(path)
    elif family == "qwen2":
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2,
                             max_position_embeddings=512, tie_word_embeddings=False,
                             pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
        Qwen2ForCausalLM(config).save_pretrained(path)
    else:
        model = zoo.tiny_model(family, vocab_size=VOCAB)
        model.config.update(dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS))
        model.save_pretrained(path)
    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK}
    vocab.update({f"t{i}": i for i in range(4, VOCAB)})
    words = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>", unk_token="<unk>").save_pretrained(path)
    return path


def make_engine(engine_cls, path: str, strategy: str, model_config=None, lr: float = 1e-2,
                **engine_config):
    """verl's engine as its workers build it, computing in float32 on CPU (SGD at ``lr``)."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import _init_utils

        _init_utils._check_module_states_for_sync_module_states = _none
    config = dict(strategy=strategy, model_dtype="fp32", use_torch_compile=False,
                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                   "buffer_dtype": "fp32"},
                  use_dynamic_bsz=True, max_token_len_per_gpu=96,
                  infer_max_token_len_per_gpu=96, micro_batch_size_per_gpu=2,
                  infer_micro_batch_size_per_gpu=2, seed=42)
    config.update(engine_config)
    engine = engine_cls(
        model_config=HFModelConfig(**{"path": path, "use_remove_padding": True,
                                      "enable_gradient_checkpointing": True,
                                      "override_config": {"attn_implementation": "sdpa"},
                                      **(model_config or {})}),
        engine_config=FSDPEngineConfig(**config),
        optimizer_config=FSDPOptimizerConfig(**optimizer_settings(lr)),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def optimizer_settings(lr: float, optimizer: str = "SGD") -> dict:
    """Every test engine's optimizer: SGD at ``lr`` (Megatron spells it ``"sgd"``), no
    warm-up or decay, clipping at 1. SGD's step is linear in the gradient, so the log-probs
    after it agree to float32 rounding (TOLERANCE); AdamW's first step, lr * g / (|g| + eps),
    turns a rounding-level difference in a gradient element near eps into a share of lr (the
    log-probs after it were 1e-5 to 4e-5 apart, measured: no rounding bound holds there)."""
    return dict(lr=lr, total_training_steps=10, lr_warmup_steps=0, weight_decay=0.0,
                clip_grad=1.0, optimizer=optimizer)


# ------------------------------------------------------------------------------- the batch

def make_rows(seed: int = 0) -> list[dict]:
    """Rollout rows as verl's agent loop writes them, each with its ``uid``: GRPO groups (one
    prompt, ragged responses) and agent trajectories whose every step is a row repeating the
    whole history, with tool tokens (response mask 0) inside later responses."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def group(uid, rollouts):  # GRPO: one prompt, ragged responses
        prompt = tokens(between(8, 14))
        for _ in range(rollouts):
            response = tokens(between(2, 12)) + [EOS]
            rows.append(dict(uid=uid, prompt=prompt, response=response,
                             mask=[1] * len(response)))

    def trajectory(uid, steps):  # every step a row that repeats the whole history
        history = tokens(10)
        for _ in range(steps):
            said, tool, more = tokens(between(2, 5)), tokens(3), tokens(between(1, 3)) + [EOS]
            rows.append(dict(uid=uid, prompt=history, response=said + tool + more,
                             mask=[1] * len(said) + [0] * len(tool) + [1] * len(more)))
            history = history + said + tool + more + tokens(2)

    # With 2 ranks, the first (one group) packs into fewer micro-batches than the second.
    rows = []
    group("prompt0", 9)
    trajectory("agent0", 3)
    trajectory("agent1", 3)
    group("prompt1", 3)
    return rows


def make_image_rows(seed: int = 0) -> list[dict]:
    """Rollout rows with images, as verl's agent loop writes them for a Qwen-VL model: each
    row its own copy of its prompt's images (``images``: (pixels, grid) each). A GRPO group on
    image 0, the same question on image 1 (another group), the same text again on image 2
    (images 1 and 2 have one placeholder count: only their keys tell the two prompts apart),
    and an agent trajectory whose second step repeats the first, a screenshot (image 2) in
    its first turn's prompt and another (image 1) returned by a tool in its second turn's
    response."""
    from treepack import zoo

    g = torch.Generator().manual_seed(seed)
    batch = zoo.image_batch([[("image", k)] for k in range(3)], seed=seed)
    pixels = list(torch.split(batch.pixel_values, batch.image_grid_thw.prod(-1).tolist()))
    images = [(pixels[k], batch.image_grid_thw[k:k + 1]) for k in range(3)]
    placed = [batch.sequences[k] for k in range(3)]

    def tokens(n):
        return torch.randint(4, 100, (n,), generator=g).tolist()  # text: below the placeholders

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = []
    question = tokens(6)
    assert placed[1] == placed[2]
    for uid, k, rollouts in (("prompt0", 0, 6), ("prompt1", 1, 2), ("prompt1b", 2, 2)):
        if uid != "prompt1b":  # the same text as prompt1, on another image
            prompt = tokens(3) + placed[k] + question
            prompt = [BOS] + prompt[1:]
        for _ in range(rollouts):
            response = tokens(between(2, 10)) + [EOS]
            rows.append(dict(uid=uid, prompt=prompt, response=response,
                             mask=[1] * len(response), images=[images[k]]))
    history, shown = tokens(5) + placed[2] + tokens(3), [images[2]]
    for step in range(2):
        said = tokens(between(2, 4))
        tool = placed[1] if step == 1 else tokens(3)  # a screenshot from a tool, once
        more = tokens(between(1, 3)) + [EOS]
        response = said + tool + more
        rows.append(dict(uid="agent0", prompt=history, response=response,
                         mask=[1] * len(said) + [0] * len(tool) + [1] * len(more),
                         images=shown + ([images[1]] if step == 1 else [])))
        history = history + response + tokens(2)
        shown = shown + ([images[1]] if step == 1 else [])
    return rows


def _mrope_positions(engine, rows) -> list[torch.Tensor]:
    """Each row's ``[4, length]`` position ids as verl's agent loop computes them: the text
    positions, then the model's own ``get_rope_index`` (its processor's)."""

    inner = hf.unwrap(engine.module).model
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt"] + r["response"]])
        grid = torch.cat([grid for _, grid in r["images"]]) if r["images"] else None
        rope, _ = inner.get_rope_index(ids, mm_token_type_ids=(ids == 100).long(),
                                       image_grid_thw=grid)
        out.append(torch.cat([torch.arange(ids.shape[1])[None], rope[:, 0]]))
    return out


def _nested(rows) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def row_routes(ids: list[int], shape: tuple[int, int, int], forked: int | None = None,
               placeholder: bool = True) -> torch.Tensor:
    """The routes an MoE rollout engine records for a row of ``ids`` (``shape``: layers,
    experts, top-k; R3's ``routed_experts``, int16): each token's route a function of the
    ids up to it, as an engine that computed a shared prompt once records one route for it;
    from token ``forked`` on, routed differently (a prompt recomputed in another batch). The
    rollout fed every token but the last through the model: ``[len - 1, layers, topk]``, or
    with verl's agent loop's ``placeholder`` a zero route for the last."""
    layers, experts, topk = shape
    out = torch.zeros(len(ids), layers, topk, dtype=torch.int16)
    for t in range(len(ids) - 1):
        moved = 7 if forked is not None and t >= forked else 0
        g = torch.Generator().manual_seed(hash(tuple(ids[:t + 1])) % 2**31 + moved)
        for layer in range(layers):
            out[t, layer] = torch.randperm(experts, generator=g)[:topk]
    return out if placeholder else out[:-1]


def rollout_routes(rows, shape: tuple[int, int, int],
                   forked: str = "prompt0") -> list[torch.Tensor]:
    """:func:`row_routes` of each row, the last rollout of group ``forked`` routed
    differently from its prompt's fifth token on; rows alternate between verl's two layouts
    (without the last token's route, and with its placeholder)."""
    last = max(i for i, r in enumerate(rows) if r["uid"] == forked)
    return [row_routes(r["prompt"] + r["response"], shape, 4 if i == last else None,
                       placeholder=bool(i % 2)) for i, r in enumerate(rows)]


def make_batch(rows, engine, forward_only: bool, temperature=0.7, old_log_probs=None,
               ref_log_prob=None, advantages=None, routes=None, positions=None, **flags):
    """The batch verl's trainer and worker hand to ``forward_backward_batch``: nested
    ``input_ids`` / ``position_ids`` / ``prompts`` / ``responses`` / ``loss_mask``, per-row
    ``uid``, the rollout's ``routed_experts`` (``routes``), the trainer's and the worker's
    flags."""
    ids = [torch.tensor(r["prompt"] + r["response"]) for r in rows]
    mask = [torch.tensor(r["mask"]) for r in rows]
    images = "images" in rows[0]
    if positions is None:  # (a Megatron model's mrope ids: the caller's)
        positions = (_mrope_positions(engine, rows) if images
                     else [torch.arange(len(i)) for i in ids])
    tensors = {
        "input_ids": _nested(ids), "position_ids": _nested(positions),
        "prompts": _nested(torch.tensor(r["prompt"]) for r in rows),
        "responses": _nested(torch.tensor(r["response"]) for r in rows),
        "response_mask": _nested(mask), "loss_mask": _nested(mask),
        "uid": [r["uid"] for r in rows],
    }
    if images:  # verl's per-row dict ({} for a row without images)
        tensors["multi_modal_inputs"] = [
            dict(pixel_values=torch.cat([p for p, _ in r["images"]]),
                 image_grid_thw=torch.cat([g for _, g in r["images"]]),
                 images_seqlens=torch.cat([g for _, g in r["images"]]).prod(-1),
                 **r.get("inputs", {}))
            if r["images"] else dict(r.get("inputs", {})) for r in rows]
    for key, value in (("old_log_probs", old_log_probs), ("ref_log_prob", ref_log_prob),
                       ("advantages", advantages), ("routed_experts", routes)):
        if value is not None:
            tensors[key] = _nested(value)
    config = engine.engine_config
    flags = dict(calculate_entropy=True, compute_loss=not forward_only,
                 global_batch_size=len(rows), pad_mode=DatasetPadMode.NO_PADDING,
                 use_remove_padding=True, use_dynamic_bsz=config.use_dynamic_bsz,
                 max_token_len_per_gpu=(config.infer_max_token_len_per_gpu if forward_only
                                        else config.max_token_len_per_gpu),
                 micro_batch_size_per_gpu=(config.infer_micro_batch_size_per_gpu if forward_only
                                           else config.micro_batch_size_per_gpu),
                 use_fused_kernels=False) | flags
    if isinstance(temperature, torch.Tensor):
        tensors["temperature"] = temperature
    else:
        flags["temperature"] = temperature
    return tu.get_tensordict(tensors, non_tensor_dict=flags)


def ref_and_advantages(old: list, rows: list[dict], g: torch.Generator):
    """An update's reference log-probs (the old ones, perturbed) and advantages (of both
    signs, on each row's response mask)."""
    ref = [t + 0.1 * torch.randn(t.shape, generator=g) for t in old]
    adv = [torch.tensor(r["mask"], dtype=torch.float32) * (i % 5 - 2) / 2
           for i, r in enumerate(rows)]
    return ref, adv


def shard(batch, rank: int, world: int):
    """This rank's contiguous share, as verl's data-parallel dispatch cuts it."""
    return tu.chunk_tensordict(batch, world)[rank]


# ------------------------------------------------------------------------------- reading out

def full_grads(module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective), by its original name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    def name(n):
        for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            n = n.replace(wrapper, "")
        return n

    if isinstance(module, FSDP):  # FSDP1 flat parameters: gather each shard, split it back
        out, world = {}, dist.get_world_size()
        for prefix, m in module.named_modules():
            if not isinstance(m, FSDP) or m._handle is None:
                continue
            flat = m._handle.flat_param
            g = (flat.grad if flat.grad is not None else torch.zeros_like(flat)).detach()
            if m._handle.uses_sharded_strategy and world > 1:
                parts = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(parts, g.contiguous())
                g = torch.cat(parts)
            g = g[:flat._unpadded_unsharded_size.numel()]
            names = iter(zip(flat._fqns, flat._shapes))
            for piece, padding in zip(torch.split(g, list(flat._numels_with_padding)),
                                      flat._is_padding_mask):
                if not padding:
                    fqn, shape = next(names)
                    out[name(f"{prefix}.{fqn}" if prefix else fqn)] = piece.view(shape).clone()
        return out
    out = {}
    for n, p in module.named_parameters():  # FSDP2: DTensors
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name(n)] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def save(result: dict, log, rank: int, out_path: str) -> None:
    """Rank 0 saves ``result`` with the messages ``log`` (:func:`captured_log`) caught."""
    result["messages"] = [r.getMessage() for r in log]
    if rank == 0:
        torch.save(result, out_path)


def gather_rows(nested: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's rows of a nested output, in global batch order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [t.detach().float() for t in nested.unbind()])
    return [t for part in every for t in part]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max |want| over paired rows."""
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    return diff / max(float(b.abs().max()) for b in want)


def metric_error(got, want, size: float = 0.0) -> float:
    """The largest ``|got - want|`` of a metric's values over ``max(|want|, size)``: relative
    to each value, or to ``size`` where the value is a rounding-level one (a KL between equal
    policies: rounding of log-probs of size ``size``)."""
    import numpy as np

    got, want = (torch.as_tensor(np.asarray(v, dtype=float)).reshape(-1) for v in (got, want))
    return float(((got - want).abs() / want.abs().clamp_min(size).clamp_min(1e-300)).max())


def global_loss(out, data) -> float:
    """The mini-batch's loss: verl scales each micro-batch's by dp_size and FSDP averages the
    gradients over ranks, so the loss is the sum over ranks and micro-batches / dp_size."""
    total = torch.tensor([float(sum(out["loss"]))], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / data["dp_size"]


def actor_loss(loss_agg_mode: str, rows: int):
    """verl's ppo_loss as its actor worker binds it: clipping, KL and entropy terms on."""
    config = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=rows,
                         use_dynamic_bsz=True, loss_agg_mode=loss_agg_mode, clip_ratio=0.2,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                         kl_loss_type="low_var_kl")
    return functools.partial(ppo_loss, config=config)


# ------------------------------------------------------------------------------- the ranks

def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # a collective one rank skips fails in a minute instead of hanging the test
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def compare_engines(rank: int, world: int, port: int, model_dir: str, strategy: str,
                    out_path: str, stock_padded: bool = False, budget: int | None = None,
                    images: bool = False, model_config: dict | None = None,
                    lr: float = 1e-2) -> None:
    """Stock engine vs TreepackEngine on the same batches; rank 0 saves the measured errors.
    ``stock_padded``: the stock engine's batches say ``use_remove_padding=False`` (a hybrid:
    verl's padding-free path runs transformers' CPU scan across the sequences it concatenates,
    which ignores their boundaries). ``images``: rows with images (:func:`make_image_rows`)
    for a vision-language model. ``model_config``: fields of both engines' model config;
    ``lr``: their AdamW learning rate."""
    init(rank, world, port)
    try:
        treepack_verl.register(devices=("cpu",))
        budgets = {} if budget is None else dict(max_token_len_per_gpu=budget,
                                                 infer_max_token_len_per_gpu=budget)
        stock = make_engine(FSDPEngineWithLMHead, model_dir, strategy, model_config, lr,
                            **budgets)
        tree = make_engine(treepack_verl.TreepackEngine, model_dir, strategy, model_config,
                           lr, **budgets)
        rows = make_image_rows() if images else make_rows()
        result = {"registered": type(tree).__name__, "messages": []}
        log = captured_log()

        def infer(engine, **kw):
            if stock_padded and engine is stock:
                kw = dict(kw, use_remove_padding=False)
            data = shard(make_batch(rows, engine, forward_only=True, **kw), rank, world)
            with engine.eval_mode():
                out = engine.forward_backward_batch(data, None, forward_only=True)
            return out, data

        def outputs(engine, **kw):
            out, _ = infer(engine, **kw)
            lp, ent = out["model_output"]["log_probs"], out["model_output"]["entropy"]
            # each row's last position predicts nothing; stock verl fills it from the next row
            return [t[:-1] for t in gather_rows(lp)], gather_rows(ent), out

        # 1. log-probs and entropy, one temperature, then one per row
        for name, temperature in (("scalar", 0.7),
                                  ("per_row", 0.5 + torch.arange(len(rows)) % 3 / 4)):
            want_lp, want_ent, _ = outputs(stock, temperature=temperature)
            got_lp, got_ent, out = outputs(tree, temperature=temperature)
            result[f"log_probs_{name}"] = relative_error(got_lp, want_lp)
            result[f"entropy_{name}"] = relative_error(got_ent, want_ent)
        result["token_ratio"] = out["metrics"]["treepack/token_ratio"]
        result["parts"] = out["metrics"].get("treepack/parts")
        every = [None] * world
        dist.all_gather_object(every, (len(out["loss"]), len(out["metrics"]["treepack/token_ratio"])))
        result["micro_batches"] = every  # (run, packed) per rank

        # 2. fixed micro-batch size instead of a token budget
        fixed = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=3)  # 3 divides 18 and 9
        want_lp, want_ent, _ = outputs(stock, **fixed)
        got_lp, got_ent, _ = outputs(tree, **fixed)
        result["log_probs_fixed_size"] = relative_error(got_lp, want_lp)

        # 3. the update: verl's ppo_loss (clip, KL, entropy) under two aggregations
        base, _ = infer(stock, temperature=1.0)
        g = torch.Generator().manual_seed(1)
        old = [t + 0.3 * torch.randn(t.shape, generator=g)
               for t in gather_rows(response_from_nested(
                   base["model_output"]["log_probs"],
                   shard(make_batch(rows, stock, True), rank, world)["response_mask"]))]
        padded = {"use_remove_padding": False} if stock_padded else {}
        ref, adv = ref_and_advantages(old, rows, g)
        for mode in ("seq-mean-token-mean", "token-mean"):  # the last one steps
            losses, grads, norms = {}, {}, {}
            for label, engine in (("stock", stock), ("tree", tree)):
                data = shard(make_batch(rows, engine, False, temperature=1.0, old_log_probs=old,
                                        ref_log_prob=ref, advantages=adv,
                                        **(padded if engine is stock else {})), rank, world)
                with engine.train_mode():
                    engine.optimizer_zero_grad()
                    out = engine.forward_backward_batch(data, actor_loss(mode, len(rows)))
                    losses[label] = global_loss(out, data)
                    result[f"metrics_{label}"] = verl_dp_metrics(out["metrics"])
                    if images and label == "tree":
                        result["sharing"] = dict(
                            expected_sharing(engine, data, group=None),
                            logged=out["metrics"]["treepack/achievable_ratio"])
                    grads[label] = full_grads(engine.module)
                    if mode == "token-mean":
                        norms[label] = float(engine.optimizer_step())
            result[f"loss_{mode}"] = (losses["tree"], losses["stock"])
            result[f"grads_{mode}"] = max(
                float((grads["tree"][k] - w).abs().max() / w.abs().max().clamp_min(1e-30))
                for k, w in grads["stock"].items())
            result[f"grads_over_model_{mode}"] = max(
                float((grads["tree"][k] - w).abs().max()) for k, w in grads["stock"].items()
            ) / max(float(w.abs().max()) for w in grads["stock"].values())
            result[f"grad_names_{mode}"] = sorted(grads["tree"]) == sorted(grads["stock"])
            if norms:
                result["grad_norm"] = (norms["tree"], norms["stock"])
            result["model_output_dropped"] = "log_probs" not in out["model_output"]

        # 4. after one optimizer step on each, the two models still agree
        want_lp, _, _ = outputs(stock)
        got_lp, _, _ = outputs(tree)
        result["log_probs_after_step"] = relative_error(got_lp, want_lp)
        if images:  # a video input is not an image: that batch runs stock, saying why
            video = [dict(r, inputs={"pixel_values_videos": torch.zeros(1, 12)}) for r in rows]
            result["video_reason"] = tree._stock_reason(shard(make_batch(video, tree, True),
                                                              rank, world))
        save(result, log, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def compare_lean(rank: int, world: int, port: int, model_dir: str, strategy: str,
                 out_path: str) -> None:
    """The stock engine vs TreepackLeanEngine (external_lib=treepack.verl_lean): log-probs,
    entropies, the ppo loss and every gradient, the LM head used inside FSDP's forward."""
    init(rank, world, port)
    try:
        importlib.import_module("treepack.verl_lean")  # what external_lib does

        treepack_verl.register(devices=("cpu",), engine=treepack_verl.TreepackLeanEngine)
        records = captured_log()
        stock = make_engine(FSDPEngineWithLMHead, model_dir, strategy)
        lean = make_engine(treepack_verl.TreepackLeanEngine, model_dir, strategy)
        rows = make_rows()
        result = {"registered": type(lean).__name__}
        for name, temperature in (("scalar", 0.7),
                                  ("per_row", 0.5 + torch.arange(len(rows)) % 3 / 4)):
            got = []
            for engine in (stock, lean):
                data = shard(make_batch(rows, engine, True, temperature=temperature), rank, world)
                with engine.eval_mode():
                    got.append(engine.forward_backward_batch(data, None, forward_only=True))
            lp = [[t[:-1] for t in gather_rows(o["model_output"]["log_probs"])] for o in got]
            ent = [gather_rows(o["model_output"]["entropy"]) for o in got]
            result[f"log_probs_{name}"] = relative_error(lp[1], lp[0])
            result[f"entropy_{name}"] = relative_error(ent[1], ent[0])
        adv = [torch.tensor(r["mask"], dtype=torch.float32) * (i % 5 - 2) / 2
               for i, r in enumerate(rows)]
        old = [torch.zeros(len(r["response"])) for r in rows]
        losses, grads = {}, {}
        for label, engine in (("stock", stock), ("lean", lean)):
            data = shard(make_batch(rows, engine, False, temperature=1.0, old_log_probs=old,
                                    ref_log_prob=old, advantages=adv), rank, world)
            with engine.train_mode():
                engine.optimizer_zero_grad()
                out = engine.forward_backward_batch(data, actor_loss("token-mean", len(rows)))
                losses[label] = global_loss(out, data)
                grads[label] = full_grads(engine.module)
        result["loss"] = (losses["lean"], losses["stock"])
        result["grads"] = max(float((grads["lean"][k] - w).abs().max()
                                    / w.abs().max().clamp_min(1e-30))
                              for k, w in grads["stock"].items())
        result["grad_names"] = sorted(grads["lean"]) == sorted(grads["stock"])
        result["messages"] = [r.getMessage() for r in records]
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def expected_sharing(engine, data, group) -> dict:
    """The achievable ratio of this update summed over the ranks, over (id, image) pairs (as
    the packs are built) and over ids alone: what ``treepack/achievable_ratio`` must be, and
    what it was when the engine's report ignored the image keys."""
    from treepack import sharing
    from treepack.adapters.verl.batches import host_sequences

    sequences = host_sequences(data)
    keys = engine._images(data, sequences).keys
    out = {}
    for name, k in (("keys", keys), ("ids", None)):
        counts = torch.tensor(sharing.report(sequences, keys=k).counts(), dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        out[name] = float(counts[2] / counts[0])  # achievable rows / original tokens
    return out


def verl_dp_metrics(metrics: dict) -> dict:
    """What verl's worker does with a step's metrics (engine_workers: allgather_dict_into_dict,
    then Metric.aggregate_dp, which needs as many values on every rank)."""
    gathered = allgather_dict_into_dict(data=metrics, group=None)
    return {key: float(Metric.aggregate_dp(values)) for key, values in gathered.items()
            if isinstance(values[0], Metric)}


def captured_log() -> list[logging.LogRecord]:
    """Every record treepack.verl logs from now on in this process."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("treepack.verl").addHandler(handler)
    return records


def divergent_fallback(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    """Only rank 0's rows cannot be packed (temperature 0): every rank must take the stock
    path together (a rank that packed would wait for collectives the others never make)."""
    init(rank, world, port)
    try:
        records = captured_log()
        treepack_verl.register(devices=("cpu",))
        stock = make_engine(FSDPEngineWithLMHead, model_dir, "fsdp2")
        tree = make_engine(treepack_verl.TreepackEngine, model_dir, "fsdp2")
        rows = make_rows()
        temperature = torch.full((len(rows),), 0.7)
        temperature[: len(rows) // world] = 0.0  # rank 0's shard
        got = []
        for engine in (stock, tree):
            data = shard(make_batch(rows, engine, True, temperature=temperature,
                                    use_dynamic_bsz=False, micro_batch_size_per_gpu=3),
                         rank, world)
            with engine.eval_mode():
                got.append(engine.forward_backward_batch(data, None, forward_only=True))
        same = all(torch.equal(a, b) for a, b in zip(got[0]["model_output"]["log_probs"].unbind(),
                                                    got[1]["model_output"]["log_probs"].unbind()))
        pos = data["position_ids"]  # positions that do not start at 0: not packable
        data["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1,
                                                                      pos.offsets())
        shifted = tree._stock_reason(data)
        every = [None] * world
        dist.all_gather_object(every, (same, [r.getMessage() for r in records], shifted))
        if rank == 0:
            torch.save(every, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def fallback(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    """A model treepack refuses: the TreepackEngine runs verl's stock path, says why once,
    and gives the stock engine's numbers."""
    init(rank, world, port)
    try:
        records = captured_log()

        def refuse(model, **kw):
            raise hf.UnsupportedModel("a layer treepack cannot pack (test)")

        real = hf.prepare  # the function the engine calls, as treepack.hf.prepare
        hf.prepare = refuse
        try:
            tree = make_engine(treepack_verl.TreepackEngine, model_dir, "fsdp2")
        finally:
            hf.prepare = real
        stock = make_engine(FSDPEngineWithLMHead, model_dir, "fsdp2")
        rows = make_rows(seed=3)
        got = []
        for engine in (stock, tree, tree):
            data = shard(make_batch(rows, engine, forward_only=True), rank, world)
            with engine.eval_mode():
                out = engine.forward_backward_batch(data, None, forward_only=True)
            got.append(out)
        same = all(torch.equal(a, b) for out in got[1:] for a, b in
                   zip(got[0]["model_output"]["log_probs"].unbind(),
                       out["model_output"]["log_probs"].unbind()))
        if rank == 0:
            torch.save({"same": same, "messages": [r.getMessage() for r in records],
                        "metrics": sorted(got[1]["metrics"])}, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()



def compare_lora(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    """verl's LoRA path (``model.lora_rank > 0``: FSDP around a peft model): log-probs with the
    adapter and without it (``disable_adapter``, verl's reference pass when the reference
    lives in the actor) and one update's LoRA gradients, stock engine vs treepack's."""
    init(rank, world, port)
    try:
        treepack_verl.register(devices=("cpu",))
        lora = dict(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        stock = make_engine(FSDPEngineWithLMHead, model_dir, "fsdp2", model_config=lora)
        tree = make_engine(treepack_verl.TreepackEngine, model_dir, "fsdp2", model_config=lora)
        rows = make_rows()
        result = {"refused": tree._treepack_refused}

        def log_probs(engine, adapter: bool):
            data = shard(make_batch(rows, engine, forward_only=True), rank, world)
            with engine.eval_mode():
                with engine.disable_adapter() if not adapter else contextlib.nullcontext():
                    out = engine.forward_backward_batch(data, None, forward_only=True)
            return [t[:-1] for t in gather_rows(out["model_output"]["log_probs"])]

        adv = [torch.tensor(r["mask"], dtype=torch.float32) * (i % 5 - 2) / 2
               for i, r in enumerate(rows)]
        old = [torch.full((len(r["response"]),), -4.0) for r in rows]
        grads = {}
        for label, engine in (("stock", stock), ("tree", tree)):
            with torch.no_grad():  # the same adapter in both engines (peft draws A at random
                for name, p in engine.module.named_parameters():  # and starts B at 0)
                    if "lora_" in name:
                        p.fill_(0.05 if "lora_B" in name else 0.02)
            result[label] = {"adapter": log_probs(engine, True),
                             "no_adapter": log_probs(engine, False)}
            data = shard(make_batch(rows, engine, False, temperature=1.0, old_log_probs=old,
                                    ref_log_prob=old, advantages=adv), rank, world)
            with engine.train_mode():
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(data, actor_loss("token-mean", len(rows)))
                grads[label] = {k: g for k, g in full_grads(engine.module).items()
                                if "lora_" in k}
        result["grad_names"] = sorted(grads["tree"]) == sorted(grads["stock"]) and grads["tree"]
        result["grads"] = max(float((grads["tree"][k] - w).abs().max()
                                    / w.abs().max().clamp_min(1e-30))
                              for k, w in grads["stock"].items())
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()

