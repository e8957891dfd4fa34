"""A Megatron vision-language model on a tree, for test_megatron_vision.py (spawned ranks import this
module): mbridge's ``Qwen2_5VLModel`` (what verl's Megatron engine builds for Qwen2.5-VL),
tiny, in float64, built from megatron-core's local specs.

The test-only adjustments, none of which changes mbridge's or megatron-core's code on disk:

- the vision tower's core attention :class:`megatron_cpu.BlockAttention`: each of the tower's windows (its
  ``cu_seqlens``) attends within itself both ways, as TransformerEngine's attention does on a
  GPU (megatron-core's local attention refuses packed sequences);
- mbridge 0.15.1's ``Qwen2_5VLSelfAttention.forward`` takes no ``rotary_pos_cos_sin``, which
  megatron-core 0.16's ``TransformerLayer`` passes (None outside inference): a subclass drops
  it (:func:`megatron_cpu.mbridge_vl_attention`), so the stock model runs at all.

mbridge's ``get_rope_index`` and the model's forward read Qwen's token ids (151,652 vision
start, 151,653 vision end, 151,655 image), so the vocabulary is Qwen's.
"""

from __future__ import annotations

import copy

import mbridge.models.qwen2_5_vl.model  # noqa: F401  (transformers first: the CUDA stand-ins
import numpy as np  # replace torch.cuda.Stream, which transformers annotates with)
import torch

import megatron_workers as mw
from megatron_cpu import BlockAttention, Norm, mbridge_vl_attention

VOCAB = 151936
VISION_START, VISION_END, IMAGE, VIDEO = 151652, 151653, 151655, 151656
PATCH = 3 * 2 * 2 * 2  # channels x temporal patch x patch²: values a pixel row


def build(tp: int = 1, cp: int = 1, sequence_parallel: bool = False, tree: bool = True,
          pp: int = 1):
    """The tiny Qwen2.5-VL (float64): 2 language layers (hidden 64, 4 query / 2 key-value
    heads of 16, mrope sections 2 / 3 / 3), a vision tower of 2 layers (hidden 32, windows of
    2 x 2 tokens, the second layer whole images), patches of 2 x 2 x 2 x 3 values merged
    2 x 2 to a token."""
    import torch.nn.functional as F
    from mbridge.models.qwen2_5_vl.model import Qwen2_5VLModel
    from mbridge.models.qwen2_5_vl.transformer_config import (Qwen2VLTransformerConfig,
                                                              get_vision_model_config,
                                                              get_vision_projection_config)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.moe_module_specs import MLPSubmodules
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    import treepack.megatron as tm

    mbridge_vl_attention()
    config = Qwen2VLTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, kv_channels=16, use_cpu_initialization=True,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.float64, init_method_std=0.05,
        attention_softmax_in_fp32=False, mrope_section=[2, 3, 3], transformer_impl="local",
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1, pipeline_model_parallel_size=pp,
        **(dict(pipeline_dtype=torch.float64, variable_seq_lengths=True,
                moe_token_dispatcher_type="alltoall") if pp > 1 else {}))
    vision = get_vision_model_config(copy.deepcopy(config))
    vision.num_layers, vision.hidden_size, vision.num_attention_heads = 2, 32, 2
    vision.num_query_groups, vision.kv_channels, vision.ffn_hidden_size = 2, 16, 64
    vision.add_bias_linear, vision.sequence_parallel = True, False
    vision.spatial_merge_size, vision.temporal_patch_size, vision.patch_size = 2, 2, 2
    vision.in_channels, vision.fullatt_block_indexes = 3, [1]
    vision._qwen2_5_vl_window_size = 8  # pixels: 2 x 2 tokens a window
    vision.pipeline_model_parallel_size, vision.first_pipeline_num_layers = 1, None
    projection = get_vision_projection_config(copy.deepcopy(config), vision.hidden_size,
                                              spatial_merge_size=2)
    language = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in language.layer_specs:
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = Norm
    language.layer_norm = Norm
    tower = get_vit_layer_with_local_spec()
    tower.submodules.self_attention.submodules.core_attention = BlockAttention
    from megatron.core import parallel_state as ps

    model = Qwen2_5VLModel(
        config, tm.layer_spec(language) if tree else language, VOCAB, 1024, vision, tower,
        projection, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                  linear_fc2=RowParallelLinear),
        language_rotary_base=10000, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage())
    return model.double()


def image(seed: int, height: int = 4, width: int = 4):
    """An image's pixel rows ``[h x w, PATCH]`` and its grid ``(1, h, w)``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(height * width, PATCH, generator=g, dtype=torch.float64), (1, height,
                                                                                 width)


def batch():
    """Sequences with images, as a processor lays them out (vision start, the placeholders,
    vision end), and each sequence's images: a GRPO group on one image (a duplicate among its
    rollouts), the same prompt text on another image, an image read again in another
    context beside a wider one, an agent whose steps repeat an image, and text alone."""
    g = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    a, b, c = image(0), image(1), image(2, 4, 8)

    def shown(img):
        return [VISION_START] + [IMAGE] * (img[0].shape[0] // 4) + [VISION_END]

    prompt = text(3)
    out = []
    for n in (4, 6, 2):
        out.append((prompt + shown(a) + text(2) + text(n), [a]))
    out.append((list(out[0][0]), [a]))  # a duplicate rollout
    for n in (3, 5):  # the same text, another image: no row of the image is shared
        out.append((prompt + shown(b) + text(2) + text(n), [b]))
    out.append((text(2) + shown(a) + text(1) + shown(c) + text(4), [a, c]))
    history = text(2) + shown(c) + text(2)
    for _ in range(2):  # an agent: each step repeats the history, its image with it
        history = history + text(3)
        out.append((list(history), [c]))
    out.append((text(6), []))
    return out


def pixels_of(images: list) -> tuple:
    """The processor's ``pixel_values`` and ``image_grid_thw`` of images, in order."""
    if not images:
        return None, None
    return (torch.cat([p for p, _ in images]),
            torch.tensor([grid for _, grid in images], dtype=torch.long))


def counted(model) -> list:
    """Every call of the model's vision tower from now on: the images it encoded."""
    calls = []
    tower = model.vision_model
    forward = tower.forward

    def count(*args, grid_thw=None, **kwargs):
        calls.append(int(grid_thw.shape[0]))
        return forward(*args, grid_thw=grid_thw, **kwargs)

    tower.forward = count
    return calls


def reference_worker(rank: int, world: int, port: int, out: str) -> None:
    """The canonical weights, and every sequence alone through the stock model (its own
    vision tower, mrope positions and attention): log-probs, entropies, and the gradients of
    a fixed weighting of them."""
    mw.init(rank, world, port)
    try:
        torch.manual_seed(0)
        model = build(tree=False)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        seqs = batch()
        width = max(len(s) for s, _ in seqs)
        w, v = mw.weights((len(seqs), width))
        logps = torch.zeros(len(seqs), width, dtype=torch.float64)
        ents = torch.zeros_like(logps)
        for s, (seq, images) in enumerate(seqs):
            pixels, grids = pixels_of(images)
            logits = model(torch.tensor(seq)[None], None, None, pixel_values=pixels,
                           image_grid_thw=grids)[0]
            logps, ents = mw.put(logps, ents, s, seq, logits)
        torch.save({"state": state, **mw.weighted_backward(model, logps, ents, w, v)},
                   f"{out}/vision-reference.pt")
    finally:
        mw.shutdown()


def tree_worker(rank: int, world: int, port: int, out: str, layout: dict) -> None:
    """The pack on this layout (``tp``, ``cp``, ``sequence_parallel``): log-probs,
    entropies, full gradients, the vision tower's calls and the pack's rows; and what the
    refusals say."""
    from megatron.core import parallel_state as ps

    import treepack
    import treepack.megatron as tm

    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    mw.init(rank, world, port, tp=tp, cp=cp)
    try:
        reference = torch.load(f"{out}/vision-reference.pt")
        model = build(tp, cp, layout.get("sequence_parallel", False))
        group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(mw.shard_of(p, reference["state"][k], tp_rank, tp))
        tm.prepare(model)
        seqs = batch()
        pixels, grids = pixels_of([img for _, images in seqs for img in images])
        images = tm.Images(model, [s for s, _ in seqs], pixel_values=pixels,
                           image_grid_thw=grids)
        pack = images.pack()
        calls = counted(model)
        got = tm.logprobs(model, pack, entropy=True, images=images)
        w, v = mw.weights(tuple(pack.rows.shape))
        loss = (got.logprobs * w).sum() + (got.entropy * v).sum()
        loss.backward()
        result = {"logprobs": got.logprobs.detach(), "entropy": got.entropy.detach(),
                  "loss": loss.detach(), "grads": mw.full_grads(model, tp, cp, group),
                  "calls": list(calls),
                  "distinct": images.num_images, "rows": pack.num_rows,
                  "tokens": sum(len(s) for s, _ in seqs),
                  "unkeyed_rows": treepack.TreePack.from_sequences([s for s, _ in seqs]).num_rows}
        result["parts"] = _in_parts(model, pack, images, w, v, tp, cp, group)
        result["refused"] = _refusals(model, seqs, images, pack)
        torch.save(result, f"{out}/vision-{layout['name']}-rank{rank}.pt")
    finally:
        mw.shutdown()


def pipeline_worker(rank: int, world: int, port: int, out: str, layout: dict) -> None:
    """The batch through Megatron's pipeline schedule (``pp`` stages: the vision tower on the
    first; two micro-batches, each a ``(pack, images)`` pair for
    ``treepack.megatron.forward_step``): the log-probs from the last stage, and every
    parameter's full gradient by its canonical name, each stage its own."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import treepack.megatron as tm

    pp = layout["pp"]
    mw.init(rank, world, port, pp=pp)
    try:
        reference = torch.load(f"{out}/vision-reference.pt")
        model = build(pp=pp)
        from megatron.core.transformer.enums import ModelType

        model.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read
        names = {}
        for name, _ in model.named_parameters():  # layers are numbered on their stage
            key = name
            if name.startswith("language_model.decoder.layers."):
                local = int(name.split(".")[3])
                number = model.language_model.decoder.layers[local].layer_number - 1
                key = name.replace(f"layers.{local}.", f"layers.{number}.", 1)
            names[name] = key
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(reference["state"][names[k]])
        tm.prepare(model)
        seqs = batch()
        pixels, grids = pixels_of([img for _, images in seqs for img in images])
        every = tm.Images(model, [s for s, _ in seqs], pixel_values=pixels,
                          image_grid_thw=grids)
        w, v = mw.weights(tuple(reference["logprobs"].shape))
        groups = [list(range(i, len(seqs), 2)) for i in range(2)]
        items = [(every.select(g).pack(), every.select(g)) for g in groups]
        group_of = {id(pack): g for (pack, _), g in zip(items, groups)}

        def loss_fn(got, pack):
            g = group_of[id(pack)]
            width = got.logprobs.shape[1]
            loss = (got.logprobs * w[g, :width]).sum() + (got.entropy * v[g, :width]).sum()
            return loss, {"logprobs": got.logprobs.detach(), "entropy": got.entropy.detach()}

        reduced = get_forward_backward_func()(
            forward_step_func=tm.forward_step(loss_fn, entropy=True), data_iterator=iter(items),
            model=[model], num_microbatches=len(items), seq_length=1, micro_batch_size=1,
            forward_only=False)
        grads = {names[k]: p.grad * len(items) for k, p in model.named_parameters()}
        logprobs = torch.zeros_like(reference["logprobs"])
        for g, r in zip(groups, reduced or []):
            logprobs[g, :r["logprobs"].shape[1]] = r["logprobs"]
        torch.save({"grads": grads, "last": ps.is_pipeline_last_stage(), "logprobs": logprobs},
                   f"{out}/vision-{layout['name']}-rank{rank}.pt")
    finally:
        mw.shutdown()


def _in_parts(model, pack, images, w, v, tp, cp, group) -> dict:
    """The same loss in parts of at most 40 rows (each part encoding the images its rows
    need): log-probs, entropies, full gradients, the parts."""
    import treepack.megatron as tm

    model.zero_grad(set_to_none=True)

    def loss_fn(out, mask):
        return (out.logprobs * w).where(mask, 0).sum() + (out.entropy * v).where(mask, 0).sum()

    got = tm.backward_in_parts(model, pack, loss_fn, max_tokens=40, entropy=True,
                               images=images)
    return {"logprobs": got.logprobs.detach(), "entropy": got.entropy.detach(),
            "loss": got.loss.detach(), "grads": mw.full_grads(model, tp, cp, group),
            "parts": got.parts}


def _refusals(model, seqs, images, pack) -> dict:
    """What a tree refuses of a vision-language batch, by name."""
    import treepack
    import treepack.megatron as tm

    out = {}
    cases = {
        "a pack built without the images' keys":
            lambda: tm.logprobs(model, treepack.TreePack.from_sequences(
                [s for s, _ in seqs]), images=images),
        "images of other sequences":
            lambda: tm.logprobs(model, pack, images=images.select(np.arange(3))),
        "image placeholders without images": lambda: tm.logprobs(model, pack),
        "image placeholders in parts without images":
            lambda: tm.logprobs_in_parts(model, pack, max_tokens=40),
        "videos": lambda: tm.Images(model, [[5, VISION_START, VIDEO, VIDEO, VIDEO, VIDEO,
                                             VISION_END]],
                                    pixel_values_videos=image(3)[0].repeat(2, 1),
                                    video_grid_thw=torch.tensor([[2, 4, 4]])),
    }
    for name, call in cases.items():
        try:
            with torch.no_grad():
                call()
            out[name] = "ran"
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            out[name] = f"{type(e).__name__}: {e}"
    return out
