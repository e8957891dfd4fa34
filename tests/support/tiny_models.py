"""Tiny models the zoo does not build, and the tokenizer over the zoo's vocabulary, shared by
the tests that need them."""

from __future__ import annotations

import torch


def word_tokenizer():
    """A word-level tokenizer over the zoo's vocabulary: ``w<i>`` is token ``i + 3`` after
    ``<pad>``, ``<bos>``, ``<eos>`` (TRL reads its pad token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from treepack import zoo

    words = ["<pad>", "<bos>", "<eos>"] + [f"w{i}" for i in range(zoo.VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


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


def llama4_text(dtype=torch.float32):
    """treepack.zoo's tiny Llama 4 text model: chunked attention (chunks of 5 depths) on its
    rope layer, a no-rope layer with attention temperature tuning, MoE."""
    from treepack import zoo

    model = zoo.tiny_llama4(dtype)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    return model


def llama4_in_float64(monkeypatch) -> None:
    """Llama 4's float32 internals (complex rotary, RMS and L2 norms, the router's sigmoid)
    in float64, for exact comparisons of a float64 model: with them, a tree equals every
    sequence alone to rounding (as tests/reference.exact_kernel does for Gated DeltaNet)."""
    import transformers.models.llama4.modeling_llama4 as llama4

    def rotary(xq, xk, freqs_cis):
        f = freqs_cis.to(torch.complex128)[:, :, None, :]

        def turn(x):
            pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * f).flatten(3).type_as(x)

        return turn(xq), turn(xk)

    def router(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        top, index = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.sigmoid(scores), logits

    monkeypatch.setattr(llama4, "apply_rotary_emb", rotary)
    monkeypatch.setattr(llama4.Llama4TextRMSNorm, "forward",
                        lambda self, x: self._norm(x) * self.weight)
    monkeypatch.setattr(llama4.Llama4TextL2Norm, "forward", lambda self, x: self._norm(x))
    monkeypatch.setattr(llama4.Llama4Router, "forward", router)
