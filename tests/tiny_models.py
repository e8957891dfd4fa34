"""Tiny models the zoo does not build, shared by the tests that need them."""

from __future__ import annotations

import torch


def gpt_oss(dtype=torch.float32):
    """A tiny GPT-OSS: attention sinks (s_aux), sliding and full layers alternating, MoE;
    each head's sink set apart from the others (its initialisation is near 0)."""
    import transformers

    from treepack import zoo

    config = transformers.GptOssConfig(
        vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    with torch.random.fork_rng(devices=[]):
        transformers.set_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                              **extra).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2, 2, 4))
    return model
