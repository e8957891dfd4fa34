"""Vision-language models until their images pack: text-only sequences pack exactly, and
image placeholders or image inputs are refused by name instead of running silently wrong."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treepack import TreePack, hf  # noqa: E402

IMAGE, VIDEO, START, END = 100, 101, 102, 103


def tiny_qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(torch.float64).eval()
    return hf.prepare(model)


def test_text_only_sequences_on_a_vision_language_model_equal_each_alone():
    model = tiny_qwen2_vl()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 99, (12,), generator=g)
    seqs = [torch.cat((prompt, torch.randint(3, 99, (n,), generator=g))) for n in (4, 7, 1)]
    pack = TreePack.from_sequences(seqs)
    got = hf.logprobs(model, pack, head="logits").logprobs
    for s, seq in enumerate(seqs):
        logp = model(input_ids=seq[None], use_cache=False).logits[0].log_softmax(-1)
        want = logp[:-1].gather(-1, seq[1:, None])[:, 0]
        torch.testing.assert_close(got[s, 1:len(seq)], want, rtol=0, atol=1e-12)


def test_image_placeholders_in_a_pack_are_refused_by_name():
    model = tiny_qwen2_vl()
    image_prompt = [1, START, IMAGE, IMAGE, END, 5, 6]
    pack = TreePack.from_sequences([image_prompt + [7], image_prompt + [8]])
    with pytest.raises(hf.UnsupportedModel, match=r"ids \[100\] \(its \['image_token_id'\]\)"
                                                  r".*does not encode images"):
        hf.logprobs(model, pack)


@pytest.mark.parametrize("key", ["pixel_values", "image_grid_thw", "mm_token_type_ids"])
def test_image_inputs_are_refused_by_name(key):
    model = tiny_qwen2_vl()
    pack = TreePack.from_sequences([[1, 5, 6], [1, 5, 7]])
    with pytest.raises(ValueError, match=f"does not take '{key}'.*does not encode images"):
        hf.logprobs(model, pack, **{key: torch.zeros(1)})
