"""verl's real Megatron engine on a vision-language model (mbridge's Qwen2.5-VL, what verl's
``vanilla_mbridge`` path builds for it), on CPU, for test_verl_megatron_vision.py (spawned ranks
import this module).

On top of :mod:`verl_megatron_workers`' adjustments, these test-only ones, none of which
changes verl's, mbridge's or megatron-core's code on disk (mbridge 0.15.1, the newest, was
written for transformers 4 and a GPU):

- the checkpoint is saved under transformers 4's names (``visual.*``, ``model.*``), which
  mbridge's Qwen2.5-VL map reads (transformers 5 saves ``model.visual.*`` and
  ``model.language_model.*``);
- the bridge sees transformers 4's flat config: the text model's settings copied to the top
  level, where mbridge reads them (transformers 5 keeps them in ``text_config`` only);
- the bridge's provider builds the model from megatron-core's local specs (no
  TransformerEngine), the vision tower from the checkpoint's vision config (mbridge's is
  Qwen2.5-VL-7B's, hard-coded), with :class:`megatron_cpu.BlockAttention` as the tower's core
  attention and :func:`megatron_cpu.mbridge_vl_attention`; the local specs' separate norms
  (``input_layernorm``, ``pre_mlp_layernorm``, both towers) mapped to the checkpoint's;
- verl's stock path runs Qwen-VL micro-batches as ``bshd`` rows (``use_remove_padding=False``):
  mbridge 0.15.1's ``Qwen2_5VLModel.forward`` embeds ``[batch, length]`` ids and cannot take
  verl's packed ``thd`` ones. :class:`verl_megatron_workers.THDAttention` reads verl's
  ``[batch, length]`` keep-mask there: causal, each row's padding (at its tail) unread.

The reference is verl's stock engine with one row a micro-batch: every sequence alone through
mbridge's own forward (its vision tower on the row's images, its ``get_rope_index``, its
attention), verl's own logits processor, loss and optimizer. It shares no code with the tree.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from megatron_cpu import BlockAttention, Norm, mbridge_vl_attention

VOCAB = 151936  # Qwen's: mbridge reads its vision ids
PAD, EOS = 151643, 151645
VISION_START, VISION_END, IMAGE = 151652, 151653, 151655
PATCH = 3 * 2 * 2 * 2  # channels x temporal patch x patch²: the values of a pixel row


def make_model_dir(root: str) -> str:
    """A random tiny Qwen2.5-VL (2 language layers of hidden 64, 4 query / 2 key-value heads
    of 16, mrope sections 2 / 3 / 3; a vision tower of 2 layers of hidden 32, windows of 2 x 2
    tokens, its second layer whole images; patches of 2 x 2 x 2 x 3 values merged 2 x 2 to a
    token), saved under transformers 4's names, and a word-level tokenizer."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration)

    path = os.path.join(root, "tiny_qwen2_5_vl")
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=EOS),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1],
                           in_chans=3),
        image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=EOS)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    renamed = {}
    for name, w in weights.items():  # transformers 4's layout, which mbridge reads
        for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
            if name.startswith(new):
                name = old + name[len(new):]
        renamed[name] = w
    save_file(renamed, file, metadata={"format": "pt"})
    vocab = {f"t{i}": i for i in range(VOCAB)}  # Qwen's size: ids without holes
    vocab.update({"<unk>": 0, "<pad>": PAD, "<eos>": EOS})
    del vocab["t0"], vocab[f"t{PAD}"], vocab[f"t{EOS}"]
    words = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


# ------------------------------------------------------------------- mbridge on a CPU

def _flat_config(build):
    """mbridge's Qwen2.5-VL config built from transformers 4's flat config: the text model's
    settings copied to the top level, where mbridge reads them (transformers 5 keeps them in
    ``text_config`` only)."""

    def flat(self):
        text = self.hf_config.text_config
        for key, value in text.to_dict().items():
            if not hasattr(self.hf_config, key):
                setattr(self.hf_config, key, value)
        rope = getattr(text, "rope_parameters", None) or text.rope_scaling
        self.hf_config.rope_scaling, self.hf_config.rope_theta = rope, rope["rope_theta"]
        return build(self)

    return flat


def _local_provider(self, post_model_creation_callbacks):
    """mbridge's Qwen2.5-VL provider on megatron-core's local specs, the vision tower from the
    checkpoint's vision config."""
    from mbridge.models.qwen2_5_vl import model as vl
    from mbridge.models.qwen2_5_vl.transformer_config import (get_vision_model_config,
                                                              get_vision_projection_config)
    from megatron.core.models.gpt.moe_module_specs import MLPSubmodules
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    hf, seen = self.hf_config, self.hf_config.vision_config
    text = hf.text_config
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling

    def provider(pre_process, post_process, vp_stage=None):
        language = self._get_transformer_layer_spec(vp_stage)
        vision = get_vision_model_config(copy.deepcopy(self.config))
        vision.num_layers, vision.hidden_size = seen.depth, seen.hidden_size
        vision.num_attention_heads = vision.num_query_groups = seen.num_heads
        vision.kv_channels = seen.hidden_size // seen.num_heads
        vision.ffn_hidden_size = seen.intermediate_size
        vision.patch_size, vision.temporal_patch_size = seen.patch_size, seen.temporal_patch_size
        vision.spatial_merge_size, vision.in_channels = seen.spatial_merge_size, seen.in_chans
        vision.fullatt_block_indexes = list(seen.fullatt_block_indexes)
        vision._qwen2_5_vl_window_size = seen.window_size
        vision.pipeline_model_parallel_size, vision.first_pipeline_num_layers = 1, None
        projection = get_vision_projection_config(
            copy.deepcopy(self.config), vision.hidden_size,
            spatial_merge_size=seen.spatial_merge_size)
        tower = get_vit_layer_with_local_spec()
        tower.submodules.self_attention.submodules.core_attention = BlockAttention
        tower.submodules.input_layernorm = tower.submodules.pre_mlp_layernorm = Norm
        model = vl.Qwen2_5VLModel(
            language_transformer_config=self.config,
            language_transformer_layer_spec=language,
            language_vocab_size=text.vocab_size,
            language_max_sequence_length=text.max_position_embeddings,
            vision_transformer_config=vision, vision_transformer_layer_spec=tower,
            vision_projection_config=projection,
            vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                       linear_fc2=RowParallelLinear),
            vision_projection_type="mlp", language_rotary_base=rope["rope_theta"],
            pre_process=pre_process, post_process=post_process, add_decoder=True,
            add_encoder=True, parallel_output=True,
            language_share_embeddings_and_output_weights=False)
        for callback in post_model_creation_callbacks:
            callback(model, pre_process=pre_process, post_process=post_process,
                     config=self.config, hf_config=hf)
        return model

    return provider


def install() -> None:
    """The adjustments above (and :mod:`verl_megatron_workers`'), for this process; importing
    this module does not make them (the trainer's side reads its rows only)."""
    import verl_megatron_workers  # noqa: F401  (the CPU platform, megatron-core, mbridge)

    mbridge_vl_attention()
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    if getattr(Qwen2_5VLBridge, "_treepack_cpu", False):
        return
    Qwen2_5VLBridge._treepack_cpu = True

    Qwen2_5VLBridge._build_config = _flat_config(Qwen2_5VLBridge._build_config)
    Qwen2_5VLBridge._model_provider = _local_provider
    attention, mlp = dict(Qwen2_5VLBridge._ATTENTION_MAPPING), dict(Qwen2_5VLBridge._MLP_MAPPING)
    for tower, hf in (("language_model", "model.layers"), ("vision_model", "visual.blocks")):
        first, second = (("input_layernorm", "post_attention_layernorm")
                         if tower == "language_model" else ("norm1", "norm2"))
        attention[f"{tower}.decoder.layers.{{layer_number}}.input_layernorm.weight"] = [
            f"{hf}.{{layer_number}}.{first}.weight"]
        mlp[f"{tower}.decoder.layers.{{layer_number}}.pre_mlp_layernorm.weight"] = [
            f"{hf}.{{layer_number}}.{second}.weight"]
    Qwen2_5VLBridge._ATTENTION_MAPPING, Qwen2_5VLBridge._MLP_MAPPING = attention, mlp
    to_hf = Qwen2_5VLBridge._weight_name_mapping_mcore_to_hf

    def mapped(self, name):  # the separate input norm, looked up with the attention's
        if name.endswith(".input_layernorm.weight"):
            return self._weight_name_mapping_attention(name)
        return to_hf(self, name)

    Qwen2_5VLBridge._weight_name_mapping_mcore_to_hf = mapped


# ------------------------------------------------------------------------------ the rows

def image(seed: int, height: int = 4, width: int = 4):
    """An image as a processor gives it: ``[h x w, PATCH]`` pixel rows, grid ``[[1, h, w]]``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(height * width, PATCH, generator=g),
            torch.tensor([[1, height, width]]))


def shown(img) -> list[int]:
    """An image's tokens in a prompt: vision start, a placeholder per merged token, end."""
    return [VISION_START] + [IMAGE] * (int(img[1].prod()) // 4) + [VISION_END]


def make_rows(seed: int = 0) -> list[dict]:
    """Rollout rows as verl's agent loop writes them for Qwen2.5-VL: a GRPO group on image a
    (a duplicate rollout among them), the same question on image b (no row of the image is
    shared), an agent trajectory whose second step repeats the first (a screenshot, image c,
    in its prompt; another, image b, from a tool in its second response), a prompt on two
    images, and text alone."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    a, b, c = image(0), image(1), image(2, 4, 8)
    rows = []
    question = text(5)
    for uid, img, rollouts in (("prompt0", a, 5), ("prompt1", b, 2)):
        prompt = text(2) + shown(img) + question
        for _ in range(rollouts):
            response = text(between(2, 9)) + [EOS]
            rows.append(dict(uid=uid, prompt=prompt, response=response,
                             mask=[1] * len(response), images=[img]))
    rows.insert(2, dict(rows[0]))  # a duplicate rollout
    history, seen = text(3) + shown(c) + text(2), [c]
    for step in range(2):
        said, more = text(between(2, 4)), text(between(1, 3)) + [EOS]
        tool = shown(b) if step == 1 else text(2)
        response = said + tool + more
        rows.append(dict(uid="agent0", prompt=history, response=response,
                         mask=[1] * len(said) + [0] * len(tool) + [1] * len(more),
                         images=seen + ([b] if step == 1 else [])))
        history, seen = history + response + text(2), seen + ([b] if step == 1 else [])
    prompt = text(2) + shown(a) + text(1) + shown(c) + text(2)
    rows.append(dict(uid="prompt2", prompt=prompt, response=text(4) + [EOS], mask=[1] * 5,
                     images=[a, c]))
    rows.append(dict(uid="prompt3", prompt=text(6), response=text(3) + [EOS], mask=[1] * 4,
                     images=[]))
    return rows


def mrope_positions(rows) -> list[torch.Tensor]:
    """Each row's ``[4, length]`` position ids as verl's agent loop writes them: the text
    positions, then the model's ``get_rope_index`` (t, h, w)."""
    from mbridge.models.qwen2_5_vl.rope_utils import get_rope_index

    out = []
    for r in rows:
        ids = torch.tensor([r["prompt"] + r["response"]])
        grid = torch.cat([g for _, g in r["images"]]) if r["images"] else None
        rope, _ = get_rope_index(ids, image_grid_thw=grid)
        out.append(torch.cat([torch.arange(ids.shape[1])[None], rope[:, 0]]))
    return out


class ImagePrompts:
    """The images of :func:`verl_trainer_path.agent_loop_rows`'s prompts for this model
    (Qwen's ids, mbridge's rope index): prompt ``p`` shows image ``IMAGE_OF[p]``."""

    IMAGE_OF = {0: 0, 1: 1, 2: 0, 3: 2}

    def __init__(self):
        self.images = [image(0), image(1), image(2, 4, 8)]

    def placed(self, p: int) -> list[int]:
        return shown(self.images[self.IMAGE_OF[p]])

    def shown(self, p: int) -> list[int]:
        return [self.IMAGE_OF[p]]

    def inputs(self, seen: list[int]) -> dict:
        grid = torch.cat([self.images[k][1] for k in seen])
        return {"pixel_values": torch.cat([self.images[k][0] for k in seen]),
                "image_grid_thw": grid, "images_seqlens": grid.prod(-1)}

    def positions(self, input_ids, seen: list[int]):
        row = dict(prompt=input_ids.tolist(), response=[], images=[self.images[k] for k in seen])
        return mrope_positions([row])[0]


# ------------------------------------------------------------------------------ the runs

def _stock_layout() -> dict:
    """verl's stock engine on Qwen-VL here: ``bshd`` rows, one a micro-batch (module doc)."""
    return dict(use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=1,
                infer_micro_batch_size_per_gpu=1)


def _counted(engine) -> list:
    """Every call of the engine's vision tower from now on: the images (grids) each
    encoded."""
    from treepack.adapters.megatron import vision

    calls = []
    for chunk in engine.module:
        vl = vision.vision_language(chunk)
        if vl is None or vl.vision_model is None:
            continue
        tower, forward = vl.vision_model, vl.vision_model.forward

        def count(*args, grid_thw=None, _forward=forward, **kwargs):
            calls.append(int(grid_thw.shape[0]))
            return _forward(*args, grid_thw=grid_thw, **kwargs)

        tower.forward = count
    return calls


def _whole(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor-parallel parameter's ``g`` (this rank's shard of ``p``): its
    shards gathered along the partition dimension (a collective over the TP group)."""
    from megatron.core import parallel_state as mpu

    if not getattr(p, "tensor_model_parallel", False) or \
            mpu.get_tensor_model_parallel_world_size() == 1:
        return g
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, g.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _named(engine, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient, Megatron DDP's reduced ``main_grad``), whole, by
    name (a collective over the TP group)."""
    out = {}
    for chunk in engine.module:
        for name, p in chunk.named_parameters():
            if grads:
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                t = torch.zeros_like(p) if g is None else g
            else:
                t = p
            out[name.replace("module.", "")] = _whole(p, t.detach().clone())
    return out


def run_engine(rank: int, world: int, port: int, model_dir: str, out_path: str,
               stock: bool = False, tp: int = 1, cp: int = 1,
               budget: int | None = None) -> None:
    """verl's stock Megatron engine (``stock``: each row alone, the reference) or treepack's
    (tree packs, under ``budget`` tokens per GPU, verl's here 96 -- or more) at TP x CP, the
    rest data-parallel, on :func:`make_rows`: log-probs and entropies (one temperature, one
    per row), two updates' losses (verl's ppo_loss, ``seq-mean-token-mean`` then
    ``token-mean``) and gradients, the second's grad norm and SGD step, the parameters and
    log-probs after it; rank 0 saves them whole (rows in batch order) with the vision
    tower's calls, the update's metrics and the fallback lines."""
    install()  # first: the CPU platform before verl's engine is imported
    import verl_megatron_workers as vmw
    from megatron.core import parallel_state as mpu
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    import treepack.verl as treepack_verl
    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl_workers import (actor_loss, captured_log, init, make_batch, ref_and_advantages,
                              save, shard)

    init(rank, world, port)
    try:
        treepack_verl.register_megatron(devices=("cpu",))
        layout = dict(tp=tp, cp=cp) | (_stock_layout() if stock else {})
        if budget is not None:
            layout.update(max_token_len_per_gpu=budget, infer_max_token_len_per_gpu=budget)
        engine = vmw.make_engine(MegatronEngineWithLMHead if stock else TreepackMegatronEngine,
                                 model_dir, **layout)
        log, calls = captured_log(), _counted(engine)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        reporting = (mpu.get_tensor_model_parallel_rank() == 0
                     and mpu.get_context_parallel_rank() == 0)
        rows = make_rows()
        positions = mrope_positions(rows)
        result = {"engine": type(engine).__name__, "dp": dp}

        def batch(forward_only, **kw):
            return shard(make_batch(rows, engine, forward_only, positions=positions, **kw),
                         dp_rank, dp)

        def rows_of(nested) -> list[torch.Tensor]:  # every DP rank's rows, in batch order
            every = [None] * world
            mine = [t.detach().clone() for t in nested.unbind()] if reporting else None
            dist.all_gather_object(every, (dp_rank, mine))
            share = dict(x for x in every if x[1] is not None)
            return [t for d in range(dp) for t in share[d]]

        def infer(**kw):
            with engine.eval_mode():
                out = engine.forward_backward_batch(batch(True, **kw), None, forward_only=True)
            return out["model_output"]

        for name, kw in (("scalar", dict(temperature=0.7)),
                         ("per_row", dict(temperature=0.5 + torch.arange(len(rows)) % 3 / 4))):
            calls.clear()
            out = infer(**kw)
            # each row's last position predicts nothing of its row
            result[f"log_probs_{name}"] = [t[:-1] for t in rows_of(out["log_probs"])]
            result[f"entropy_{name}"] = rows_of(out["entropy"])
            result[f"calls_{name}"] = list(calls)

        g = torch.Generator().manual_seed(1)
        old = [-1.0 + 0.3 * torch.randn(len(r["mask"]), generator=g) for r in rows]
        ref, adv = ref_and_advantages(old, rows, g)
        for mode in ("seq-mean-token-mean", "token-mean"):  # the last one steps
            data = batch(False, temperature=1.0, old_log_probs=old, ref_log_prob=ref,
                         advantages=adv)
            with engine.train_mode():
                engine.optimizer_zero_grad()
                out = engine.forward_backward_batch(data, actor_loss(mode, len(rows)))
                loss = torch.tensor([float(sum(out.get("loss", [])))], dtype=torch.float64)
                if reporting:  # the mean over the data-parallel ranks (verl's loss on
                    # each is times the DP size: DDP averages their gradients)
                    dist.all_reduce(loss, group=mpu.get_data_parallel_group())
                result[f"loss_{mode}"] = float(loss) / dp
                result[f"grads_{mode}"] = _named(engine, grads=True)
                result[f"metrics_{mode}"] = {k: v for k, v in out["metrics"].items()
                                             if k.startswith("treepack/")}
                if mode == "token-mean":
                    result["grad_norm"] = float(engine.optimizer_step())
        if not stock:  # a row with a video: verl's stock path, said why
            video = [dict(rows[0], inputs=dict(pixel_values_videos=torch.zeros(16, PATCH),
                                               video_grid_thw=torch.tensor([[2, 4, 4]])))]
            result["video_refusal"] = engine._stock_reason(
                make_batch(video, engine, True, positions=positions[:1]))
        result["params_after"] = _named(engine, grads=False)
        result["log_probs_after"] = [t[:-1] for t in rows_of(infer(temperature=1.0)
                                                           ["log_probs"])]
        save(result, log, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


# the stock worker: verl's bshd rows, one a micro-batch (module doc)
STOCK_WORKER = ["actor_rollout_ref.model.use_remove_padding=false",
                "actor_rollout_ref.actor.use_dynamic_bsz=false",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]


def compare_workers(rank: int, world: int, port: int, model_dir: str, batches_path: str,
                    out_path: str, tp: int = 1) -> None:
    """:func:`verl_megatron_workers.compare_workers` on this model: verl's
    ``ActorRolloutRefWorker`` with ``model_engine=megatron`` on the trainer's batches with
    images, the stock worker on ``bshd`` rows, one a micro-batch."""
    install()
    import verl_megatron_workers as vmw

    vmw.compare_workers(rank, world, port, model_dir, batches_path, out_path, tp,
                        stock_extra=STOCK_WORKER)
