"""Random-init tiny causal LMs of several transformers families (imports transformers lazily).

For verification, tests and benchmarks: nothing is downloaded, every model is built from a
config with ``AutoModelForCausalLM.from_config``. Each family exercises something the tree
layout must get right:

========== ===================================================================
llama      rotary positions, grouped-query attention
qwen2      mixed sliding-window and full-attention layers, q/k/v biases
mistral    a sliding window on every layer
gemma2     sliding + full layers, attention logit soft-capping, final logit soft-capping
qwen3      q/k norms
olmo2      q/k norms over the whole projection
gpt_neox   partial rotary (rotary_pct), parallel residual
phi3       partial rotary (partial_rotary_factor), fused qkv
gpt2       learned absolute positions, full multi-head attention
mixtral    mixture of experts (router load-balancing loss)
cohere     q/k layer norms, parallel attention + MLP block, logit_scale after the LM head
granite    attention/embedding/residual multipliers, logits_scaling after the LM head
qwen3_5    hybrid: Gated DeltaNet layers (short conv + gated delta rule) and gated attention
qwen3_5_moe  the same with mixture-of-experts MLPs
qwen3_next hybrid Gated DeltaNet + attention, mixture of experts
olmo_hybrid  hybrid Gated DeltaNet + attention
lfm2       hybrid: short gated convolutions and attention
lfm3       hybrid: short convolutions, sliding-window and full attention
bamba      hybrid: Mamba2 layers (short conv + SSD scan) and attention
nemotron_h hybrid: Mamba2, attention without positions, and MLP-only layers
falcon_h1  hybrid: attention and Mamba2 side by side in every layer, muP multipliers
jamba      hybrid: Mamba (v1) layers (short conv + selective scan), attention without
           positions, mixture of experts
falcon_mamba  Mamba (v1) layers only, norms on the scan's B, C and step
zamba      hybrid: Mamba (v1) layers of 2 heads, one attention block shared by its layers
kimi_linear  hybrid: Kimi Delta Attention (the gated delta rule, a gate per key channel),
           multi-latent attention without positions, mixture of experts
minimax    hybrid: lightning attention (linear attention decaying per head, computed inline
           in its layer), attention, mixture of experts
========== ===================================================================
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["FAMILIES", "HYBRIDS", "tiny_config", "tiny_model", "tiny_llama4", "qwen2_40m_config",
           "qwen25_05b_config", "qwen35_40m_config", "MODELS", "VISION_FAMILIES",
           "VISION_IDS", "WHOLE_IMAGES", "tiny_vision_model", "ImageBatch", "image_batch"]

VOCAB = 97
_IDS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_COMMON = dict(_IDS, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096)
WINDOW = 6  # small enough that the test sequences cross it

_DELTANET = dict(_COMMON, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
_HYBRID_LAYERS = ["linear_attention", "full_attention"]  # repeated to the layer count
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", _COMMON),
    "qwen2": ("Qwen2Config", dict(_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1)),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=16, sliding_window=WINDOW,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                                    query_pre_attn_scalar=16)),
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=16)),
    "olmo2": ("Olmo2Config", _COMMON),
    "gpt_neox": ("GPTNeoXConfig", dict(_IDS, hidden_size=64, intermediate_size=96,
                                       num_attention_heads=4, max_position_embeddings=4096,
                                       rotary_pct=0.5)),
    "phi3": ("Phi3Config", dict(_COMMON, partial_rotary_factor=0.5)),
    "gpt2": ("GPT2Config", dict(_IDS, n_embd=64, n_head=4, n_positions=4096)),
    "mixtral": ("MixtralConfig", dict(_COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "cohere": ("CohereConfig", dict(_COMMON, logit_scale=0.5, use_qk_norm=True)),
    "granite": ("GraniteConfig", dict(_COMMON, logits_scaling=4.0, attention_multiplier=0.1,
                                      embedding_multiplier=3.0, residual_multiplier=0.5)),
    "qwen3_5": ("Qwen3_5TextConfig", _DELTANET),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_DELTANET, **_MOE)),
    "qwen3_next": ("Qwen3NextConfig", dict(_DELTANET, **_MOE)),
    "olmo_hybrid": ("OlmoHybridConfig", _COMMON),
    "lfm2": ("Lfm2Config", _COMMON),
    "lfm3": ("Lfm3Config", dict(_COMMON, sliding_window=WINDOW)),
    "bamba": ("BambaConfig", dict(_COMMON, attn_layer_indices=[1, 3, 5, 7], mamba_n_heads=4,
                                  mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                  mamba_chunk_size=64)),
    "nemotron_h": ("NemotronHConfig", dict(_COMMON, mamba_num_heads=4, mamba_head_dim=32,
                                           ssm_state_size=16, n_groups=1, chunk_size=64)),
    "falcon_h1": ("FalconH1Config", dict(_COMMON, mamba_n_heads=4, mamba_d_head=32,
                                         mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=1,
                                         mamba_chunk_size=64, lm_head_multiplier=0.5)),
    "jamba": ("JambaConfig", dict(_COMMON, attn_layer_period=2, attn_layer_offset=1,
                                  expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                  num_experts_per_tok=2, mamba_d_state=16, mamba_dt_rank=8)),
    "falcon_mamba": ("FalconMambaConfig", dict(_IDS, hidden_size=64, state_size=16, expand=2,
                                               conv_kernel=4, time_step_rank=8)),
    "zamba": ("ZambaConfig", dict(_COMMON, num_key_value_heads=4, n_mamba_heads=2,
                                  mamba_d_state=16, mamba_dt_rank=8)),
    "kimi_linear": ("KimiLinearConfig", dict(_COMMON, num_key_value_heads=4, head_dim=16,
                                             kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16,
                                             linear_head_dim=16, linear_num_heads=4,
                                             linear_conv_kernel_dim=4, num_experts=4,
                                             num_experts_per_token=2, moe_intermediate_size=32,
                                             num_shared_experts=1)),
    # lightning attention's blocks of 8 rows: the tests' sequences cross them
    "minimax": ("MiniMaxConfig", dict(_COMMON, head_dim=16, block_size=8, num_local_experts=4,
                                      num_experts_per_tok=2)),
}
HYBRIDS = {"qwen3_5": _HYBRID_LAYERS, "qwen3_5_moe": _HYBRID_LAYERS,
           "qwen3_next": _HYBRID_LAYERS, "olmo_hybrid": _HYBRID_LAYERS,
           "lfm2": ["conv", "full_attention"],
           "lfm3": ["conv", "sliding_attention", "conv", "full_attention"],
           "nemotron_h": ["linear_attention", "full_attention", "mlp"],
           "bamba": None, "falcon_h1": None, "jamba": None, "falcon_mamba": None,
           # Zamba ties its hybrid layers' shared block, so it needs two at least
           "zamba": ["hybrid", "hybrid", "linear_attention"],
           "kimi_linear": _HYBRID_LAYERS, "minimax": _HYBRID_LAYERS}
# each family's layer types, in turn (None: its config sets them)


def tiny_config(family: str, *, layers: int = 2, **overrides):
    """The config of a tiny random model of ``family`` (see the module doc), dropout off.

    Args:
        family: a key of :data:`FAMILIES`.
        layers: hidden layers.
        **overrides: config fields to set.

    Returns:
        A transformers config.

    Raises:
        ValueError: an unknown family.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    name, kwargs = FAMILIES[family]
    layer_key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    if HYBRIDS.get(family):  # every kind of layer at least once
        cycle = HYBRIDS[family]
        kwargs = dict(kwargs, layer_types=[cycle[i % len(cycle)] for i in range(layers)])
    config = getattr(transformers, name)(**{**kwargs, layer_key: layers, **overrides})
    # Dropout off by default: verification needs deterministic forwards.
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                "attn_pdrop", "attention_probs_dropout_prob", "hidden_dropout_prob"):
        if hasattr(config, key) and key not in overrides:
            setattr(config, key, 0.0)
    return config


def tiny_model(family: str, *, layers: int = 2, seed: int = 0, dtype=None,
               attn_implementation: str | None = None, **overrides):
    """A random-init tiny causal LM of ``family`` (deterministic for ``seed``).

    Args:
        family: a key of :data:`FAMILIES`.
        layers: hidden layers.
        seed: the weights' random seed.
        dtype: the parameters' dtype (default float32).
        attn_implementation: transformers' attention implementation (default: its own).
        **overrides: config fields to set.

    Returns:
        An unprepared ``AutoModelForCausalLM`` (:func:`treepack.hf.prepare` it for packs).

    Raises:
        ValueError: an unknown family.
    """
    import torch
    import transformers

    dtype = dtype or torch.float32
    config = tiny_config(family, layers=layers, **overrides)
    extra = {}
    if (hasattr(config, "num_local_experts") or hasattr(config, "num_experts")) and \
            dtype == torch.float64:
        extra["experts_implementation"] = "eager"  # the grouped-mm kernel has no float64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype, **extra
        )
    return model


def tiny_llama4(dtype=None):
    """A random-init tiny Llama 4 text model (not in :data:`FAMILIES`: its float32 internals
    make float64 comparisons float32-accurate): chunked attention of 5 depths on its rope
    layer, a no-rope layer with attention temperature tuning (its scale steps every 2
    positions), MoE."""
    import torch
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=5,
        no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"],
        attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        transformers.set_seed(0)
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype or torch.float32).eval()


def qwen2_40m_config():
    """A Qwen2-like config of about 40M parameters, for CPU benchmarks.

    22.5M parameters in 8 layers and a 16.4M tied embedding (vocabulary 32000); GQA 8/2 heads
    of 64, intermediate 1408.

    Returns:
        A ``transformers.Qwen2Config``.
    """
    import transformers

    return transformers.Qwen2Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def qwen25_05b_config():
    """Qwen2.5-0.5B's shape with random weights (494M parameters), for GPU benchmarks.

    24 layers, hidden 896, GQA 14/2 heads of 64, intermediate 4864, vocabulary 151,936, tied
    embedding. Nothing is downloaded.

    Returns:
        A ``transformers.Qwen2Config``.
    """
    import transformers

    return transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=65536,
        tie_word_embeddings=True, rope_theta=1e6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )


def qwen35_40m_config():
    """A Qwen3.5-like hybrid of about 40M parameters, for CPU benchmarks: Qwen3.5's layer
    pattern (three Gated DeltaNet layers, then one gated attention layer) at the size of
    :func:`qwen2_40m_config` — not a shape Qwen ships.

    8 layers, hidden 512, intermediate 1408, vocabulary 32000 (tied); attention 8/2 heads of
    64; DeltaNet 4 key / 8 value heads of 64, convolution kernel 4.

    Returns:
        A ``transformers.Qwen3_5TextConfig``.
    """
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"], max_position_embeddings=32768, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


MODELS = {"qwen2-40m": qwen2_40m_config, "qwen2.5-0.5b": qwen25_05b_config,
          "qwen3.5-40m": qwen35_40m_config}  # bench presets


# ---------------------------------------------------------------------- vision-language

# Image placeholder ids of the tiny vision-language models (vocabulary VISION_VOCAB).
VISION_IDS = dict(image_token_id=100, video_token_id=101, vision_start_token_id=102,
                  vision_end_token_id=103)
VISION_VOCAB = 128
PATCH_DIM = 12  # a pixel row: 3 channels x 1 frame x a 2x2 patch
_TOWER = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
              patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3)
_VL_TEXT = dict(_IDS, vocab_size=VISION_VOCAB, hidden_size=64, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
_INTERLEAVED = dict(_MROPE, mrope_interleaved=True)
VISION_FAMILIES = {  # family: (config class, text config, vision config, layer cycle)
    # mrope; a ViT without window attention
    "qwen2_vl": ("Qwen2VLConfig", dict(_VL_TEXT, rope_scaling={"type": "mrope",
                                                                "mrope_section": [2, 3, 3]}),
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=1, in_channels=3), None),
    # mrope; window attention in the vision tower, one full-attention block
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(_VL_TEXT, rope_scaling=dict(_MROPE, type="mrope")),
                   dict(_TOWER, window_size=8, fullatt_block_indexes=[1]), None),
    # interleaved mrope; deepstack features added to the first decoder layers
    "qwen3_vl": ("Qwen3VLConfig", dict(_VL_TEXT, head_dim=16, rope_scaling=_INTERLEAVED),
                 dict(_TOWER, num_position_embeddings=16, deepstack_visual_indexes=[0]), None),
    # interleaved mrope on a Gated DeltaNet hybrid
    "qwen3_5_vl": ("Qwen3_5Config", dict(_VL_TEXT, head_dim=16, linear_num_key_heads=2,
                                         linear_num_value_heads=4, linear_key_head_dim=8,
                                         linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                         rope_parameters=dict(_INTERLEAVED,
                                                              partial_rotary_factor=0.5)),
                   dict(_TOWER, num_position_embeddings=16), _HYBRID_LAYERS),
    # the same with mixture-of-experts decoders
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", dict(_VL_TEXT, head_dim=16, rope_scaling=_INTERLEAVED,
                                              num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32),
                     dict(_TOWER, num_position_embeddings=16, deepstack_visual_indexes=[0]),
                     None),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", dict(_VL_TEXT, head_dim=16, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=8,
                                                linear_value_head_dim=8,
                                                linear_conv_kernel_dim=4, num_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32,
                                                rope_parameters=dict(_INTERLEAVED,
                                                                     partial_rotary_factor=0.5)),
                       dict(_TOWER, num_position_embeddings=16), _HYBRID_LAYERS),
    # 1-D positions: a CLIP tower, its last layer's patch features, a projector
    "llava": ("LlavaConfig", dict(_VL_TEXT, model_type="llama"),
              dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                   num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4,
                   projection_dim=32), None),
    # an image's tokens see each other both ways; a SigLIP tower pooled to 4 tokens an
    # image; sliding and full layers
    "gemma3": ("Gemma3Config", dict(_VL_TEXT, head_dim=16, sliding_window=WINDOW,
                                    query_pre_attn_scalar=16),
               dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                    num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2),
               ["sliding_attention", "full_attention"]),
}
# Families whose pixel_values hold one [3, 8, 8] image each (4 placeholder tokens an image)
# rather than one row per patch with a grid, and their token ids.
WHOLE_IMAGES = {
    "llava": dict(image_token_index=VISION_IDS["image_token_id"], image_seq_length=4,
                  vision_feature_layer=-1, vision_feature_select_strategy="default"),
    "gemma3": dict(image_token_index=VISION_IDS["image_token_id"], mm_tokens_per_image=4,
                   boi_token_index=VISION_IDS["vision_start_token_id"],
                   eoi_token_index=VISION_IDS["vision_end_token_id"]),
}


def tiny_vision_model(family: str, *, layers: int = 2, seed: int = 0, dtype=None,
                      attn_implementation: str | None = None):
    """A random-init tiny vision-language model of ``family`` (:data:`VISION_FAMILIES`):
    vocabulary :data:`VISION_VOCAB` with the placeholders of :data:`VISION_IDS`. The Qwen-VL
    families: a vision tower of 2x2 patches merged 2x2 into one token (an image of h x w
    patches is h*w/4 placeholder tokens), pixel rows of :data:`PATCH_DIM`; LLaVA
    (:data:`WHOLE_IMAGES`): a CLIP tower on 8x8 images of 4x4 patches, 4 tokens an image.

    Args:
        family: a key of :data:`VISION_FAMILIES`.
        layers: decoder layers (a hybrid cycles its layer types).
        seed: the weights' random seed.
        dtype: the parameters' dtype (default float32).
        attn_implementation: transformers' attention implementation (default: its own).

    Returns:
        An unprepared ``...ForConditionalGeneration`` model.

    Raises:
        ValueError: an unknown family.
    """
    import torch
    import transformers

    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; choose one of "
                         f"{sorted(VISION_FAMILIES)}")
    name, text, vision, cycle = VISION_FAMILIES[family]
    text = dict(text, num_hidden_layers=layers)
    if cycle:
        text["layer_types"] = [cycle[i % len(cycle)] for i in range(layers)]
    ids = WHOLE_IMAGES.get(family, VISION_IDS)
    config = getattr(transformers, name)(text_config=text, vision_config=vision, **ids)
    extra = {"experts_implementation": "eager"} if "num_experts" in text and \
        dtype == torch.float64 else {}  # the grouped-mm kernel has no float64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype or torch.float32,
            **extra)
    return model.eval()


class ImageBatch(NamedTuple):
    """Sequences with images, as a processor lays them out."""

    sequences: list  # N token-id lists, each image a run of placeholders
    pixel_values: object  # [patches, PATCH_DIM], every image of every sequence, in order
    image_grid_thw: object  # [images, 3] (None for WHOLE_IMAGES families)
    images: list  # per sequence, the indices of its images in the distinct-image list
    pixel_values_videos: object = None  # [patches, PATCH_DIM], every video, in order
    video_grid_thw: object = None  # [videos, 3]
    second_per_grid_ts: object = None  # [videos] seconds per temporal patch
    videos: list | None = None  # per sequence, the indices of its videos


VIDEO_SECONDS = (0.5, 2.0)  # each distinct video's seconds per temporal patch


def image_batch(layout, *, sizes=((4, 4), (4, 6), (6, 4)), seed: int = 0, dtype=None,
                family: str = "qwen2_vl", video_sizes=((2, 4, 4), (3, 4, 2))):
    """Sequences with images (and videos) for the tiny vision-language models.

    Args:
        layout: per sequence, a list of items: an ``int`` is a text token, ``("image", k)``
            distinct image ``k`` (``vision_start``, its placeholders, ``vision_end``),
            ``("video", k)`` distinct video ``k`` (Qwen-VL families): one such run, or for
            Qwen3-VL one a frame, each after a timestamp token (as its processor writes it).
        sizes: each distinct image's (height, width) in patches (Qwen-VL families).
        seed: the pixels' random seed.
        dtype: the pixels' dtype (default float32).
        family: the model family the pixels are laid out for (:data:`WHOLE_IMAGES`: one
            ``[3, 8, 8]`` image each, 4 tokens, no grid).
        video_sizes: each distinct video's (frames, height, width) in patches.

    Returns:
        An :class:`ImageBatch`; an image used twice is given twice (as processors do).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    whole = family in WHOLE_IMAGES
    if whole:
        sizes = [(4, 4)] * len(sizes)  # 4 tokens each: the tiny tower's 2x2 patches
    pixels = [torch.randn(*((3, 8, 8) if whole else (h * w, PATCH_DIM)), generator=g,
                          dtype=dtype or torch.float32) for h, w in sizes]
    frames = [torch.randn(t * h * w, PATCH_DIM, generator=g, dtype=dtype or torch.float32)
              for t, h, w in video_sizes]
    sequences, rows, grids, images = [], [], [], []
    video_rows, video_grids, seconds, videos = [], [], [], []
    for items in layout:
        seq, mine, theirs = [], [], []
        for item in items:
            if isinstance(item, int):
                seq.append(item)
                continue
            k = item[1]
            if item[0] == "video":
                t, h, w = video_sizes[k]
                run = ([VISION_IDS["vision_start_token_id"]] + [VISION_IDS["video_token_id"]]
                       * (h * w // 4) + [VISION_IDS["vision_end_token_id"]])
                if family.startswith("qwen3"):  # a timestamp, then the frame's run
                    seq += [tok for _ in range(t) for tok in [9] + run]
                else:
                    seq += run[:1] + run[1:-1] * t + run[-1:]
                video_rows.append(frames[k])
                video_grids.append([t, h, w])
                seconds.append(VIDEO_SECONDS[k % len(VIDEO_SECONDS)])
                theirs.append(k)
                continue
            h, w = sizes[k]
            seq += ([VISION_IDS["vision_start_token_id"]] + [VISION_IDS["image_token_id"]]
                    * (h * w // 4) + [VISION_IDS["vision_end_token_id"]])
            rows.append(pixels[k])
            grids.append([1, h, w])
            mine.append(k)
        sequences.append(seq)
        images.append(mine)
        videos.append(theirs)
    if whole:
        pixel_values = torch.stack(rows) if rows else torch.zeros(0, 3, 8, 8)
        return ImageBatch(sequences, pixel_values, None, images)
    pixel_values = torch.cat(rows) if rows else torch.zeros(0, PATCH_DIM)
    batch = ImageBatch(sequences, pixel_values,
                       torch.tensor(grids, dtype=torch.long).reshape(-1, 3), images)
    if not video_rows:
        return batch
    return batch._replace(pixel_values_videos=torch.cat(video_rows),
                          video_grid_thw=torch.tensor(video_grids, dtype=torch.long),
                          second_per_grid_ts=torch.tensor(seconds), videos=videos)
