"""TRL's GRPOTrainer on a vision-language model, packed, against stock, through
``trainer.train()``: prompts with images, a processor built offline (no torchvision, no hub)."""

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (LlavaConfig, LlavaForConditionalGeneration,  # noqa: E402
                          LlavaProcessor, PreTrainedTokenizerFast, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLProcessor)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import treepack.trl  # noqa: E402
from treepack.adapters.hf import vision  # noqa: E402

from test_trl import GradientsAtStep, assert_same_training  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
WORDS = ["user", "assistant", "what", "color", "is", "this", "red", "blue", "green", "a",
         "the", "image", "describe", "yes", "no", "?", "."]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


class OfflineQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor: transformers 5.24 builds one by default,
    and it needs torchvision, which has no build for this CPU torch. Images only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


def word_tokenizer(special, **tokens):
    """A word-level tokenizer over ``special`` tokens and :data:`WORDS`, padding on the left;
    ``tokens``: its named tokens (``eos_token=...``)."""
    vocab = {t: i for i, t in enumerate(special + ["[UNK]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   padding_side="left", **tokens)


def processor():
    tokenizer = word_tokenizer(SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                      min_pixels=16, max_pixels=256)
    return OfflineQwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                                   chat_template=CHAT_TEMPLATE)


def tiny_model(tokenizer):
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                           in_channels=3, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2), **ids)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def dataset():
    rng = np.random.default_rng(0)
    image = [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8))
             for shape in ((12, 8, 3), (8, 8, 3), (8, 12, 3))]
    # the same question on two images: two groups, never one
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": text}] for text in
                   ("what color is this ?", "what color is this ?", "describe the image .",
                    "describe the image .")],
        "image": [image[0], image[1], image[0], image[2]],
    })


@pytest.mark.parametrize("config", [dict(), dict(steps_per_generation=2,
                                                 gradient_accumulation_steps=2,
                                                 treepack_max_tokens=40), dict(beta=0.04)])
def test_a_vision_language_grpo_step_equals_the_stock_trainer(tmp_path, config, monkeypatch):
    """Policy, old-log-prob and (with ``beta``, the model loaded from its path) reference
    passes packed, each distinct image encoded once per forward; losses, every gradient (the
    vision tower's too) and the weights after the step equal stock TRL's. Under accumulation,
    groups are dealt whole, keyed by prompt and image."""
    proc = processor()
    encoded = []
    place = vision._encode

    def counting(core, images, needed, device):
        encoded.append((len(needed), images.num_images))
        return place(core, images, needed, device)

    monkeypatch.setattr(vision, "_encode", counting)
    max_tokens = config.pop("treepack_max_tokens", None)
    config = {"beta": 0.0, **config}
    model_path = None
    if config["beta"]:  # TRL loads the reference model from the policy's path
        model_path = str(tmp_path / "model")
        tiny_model(proc.tokenizer).save_pretrained(model_path)
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        extra = {"treepack_max_tokens": max_tokens} if name == "packed" and max_tokens else {}
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=4, max_steps=1,
                          logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no", learning_rate=1e-2, optim="sgd",
                          temperature=1.0, seed=0, **config)
        trainer = cls(model=model_path or tiny_model(proc.tokenizer),
                      reward_funcs=lambda completions, **kw:
                      [float(len(str(c))) + 0.1 * i for i, c in enumerate(completions)],
                      args=args, train_dataset=dataset(), processing_class=proc,
                      callbacks=[probe], **extra)
        torch.manual_seed(0)
        trainer.train()
        runs[name] = (trainer, probe.grads, probe.sizes)
    assert_same_training(runs)
    packed, stock_grads = runs["packed"][0], runs["stock"][1]
    assert any(k.startswith("model.visual") for k in stock_grads)
    # every packed forward encoded the distinct images of its rows, each once
    assert encoded and all(needed <= distinct <= 3 for needed, distinct in encoded)
    ratios = [h["treepack/token_ratio"] for h in packed.state.log_history
              if "treepack/token_ratio" in h]
    assert ratios and 0 < ratios[0] < 1


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    " </s> {% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def llava_processor():
    """LLaVA's processor offline: a word-level tokenizer and CLIP's PIL image processor on
    8x8 images (4x4 patches: 4 image tokens each)."""
    tokenizer = word_tokenizer(["<pad>", "<s>", "</s>", "<image>"], eos_token="</s>",
                               pad_token="<pad>", bos_token="<s>")
    images = CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                          vision_feature_select_strategy="default",
                          chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1)


def tiny_llava(tokenizer):
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8,
                           patch_size=4, projection_dim=16),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=4,
        vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def test_a_llava_grpo_step_equals_the_stock_trainer(tmp_path):
    """LLaVA (one [C, H, W] tensor an image, 1-D positions) through trainer.train() under
    accumulation, whole groups keyed by prompt and image: equal to stock TRL."""
    runs = accumulated_runs(tmp_path, llava_processor(), tiny_llava)
    assert_same_training(runs, zero_by_algebra=("self_attn.k_proj.bias",))


def accumulated_runs(tmp_path, proc, build):
    """One GRPO step of stock TRL and of treepack's trainer, each on ``build(tokenizer)``,
    under gradient accumulation; each run's trainer and gradients at the step."""
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=4, max_steps=1,
                          logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no", beta=0.0, learning_rate=1e-2, optim="sgd",
                          temperature=1.0, seed=0, steps_per_generation=2,
                          gradient_accumulation_steps=2)
        trainer = cls(model=build(proc.tokenizer), reward_funcs=lambda completions, **kw:
                      [float(len(str(c))) + 0.1 * i for i, c in enumerate(completions)],
                      args=args, train_dataset=dataset(), processing_class=proc,
                      callbacks=[probe])
        torch.manual_seed(0)
        trainer.train()
        runs[name] = (trainer, probe.grads, probe.sizes)
    assert any(k.startswith("model.vision_tower") for k in runs["stock"][1])
    return runs


GEMMA3_SPECIAL = ["<pad>", "<bos>", "<eos>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]
GEMMA3_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    " <eos> {% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def gemma3_processor():
    """Gemma 3's processor offline: a word-level tokenizer with its image tokens, and its PIL
    image processor on 8x8 images (4 image tokens each, pooled from 2x2 patches)."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer(
        GEMMA3_SPECIAL, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": 8, "width": 8})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                           chat_template=GEMMA3_TEMPLATE)


def tiny_gemma3(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=256, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"],
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=2),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def test_a_gemma3_grpo_step_equals_the_stock_trainer(tmp_path):
    """Gemma 3 (an image's tokens see each other both ways; TRL passes token_type_ids that
    mark them) through trainer.train() under accumulation: equal to stock TRL."""
    assert_same_training(accumulated_runs(tmp_path, gemma3_processor(), tiny_gemma3))
