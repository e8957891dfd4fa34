"""Every access treepack makes to transformers beyond its documented API, in one place.

Written against transformers 5.24 (the version the test suite installs) and run on 5.17 (the
GPU image). When transformers moves one of these, this file is the one to change:

- ``config._attn_implementation``: the name each attention layer looks its function up by
  (read and set; transformers itself sets it at load).
- ``AttentionInterface`` / ``AttentionMaskInterface``: registering treepack's functions.
- ``ALL_ATTENTION_FUNCTIONS[name]`` and ``ALL_MASK_ATTENTION_FUNCTIONS._global_mapping``: the
  original attention and mask functions a prepared model falls back to without a pack.
- ``<model module>.eager_attention_forward``: "eager" is each model's own function.
- ``<model module>.load_balancing_loss_func``: an MoE model's router loss.
- ``<model module>.causal_conv1d_fn`` / ``torch_chunk_gated_delta_rule`` /
  ``mamba2_chunk_scan`` / ``mamba2_split_conv1d_scan_combined`` / ``mamba_selective_scan`` /
  ``mamba_inner_fn``: the short convolution, the gated-delta-rule scan, Mamba2's SSD scan,
  Mamba (v1)'s selective scan and the fused training kernels of both, which a hybrid model's
  recurrent layers call by their module-level names (Qwen3.5, Qwen3-Next, OLMo-hybrid, LFM2,
  Bamba, Nemotron-H, Falcon-H1, Mamba, Mamba2, Falcon-Mamba, Jamba, Zamba in 5.24;
  :data:`MIXERS`), and ``chunk_kimi_delta_attention`` (Kimi-Linear, Bailing-hybrid) and
  ``MiniMaxLightningAttention.forward`` (MiniMax's lightning attention, computed inline in
  its forward: ``qkv_proj``, ``act_fn``, ``slope_rate``, ``norm``, ``output_gate``,
  ``out_proj``); a prepared
  model's module has them wrapped (:func:`module_functions`, :func:`replace`).
- ``<Gated DeltaNet layer>.causal_conv1d_fn`` / ``.chunk_gated_delta_rule``: the same two,
  held per layer in transformers 5.10 (:data:`LAYER_MIXERS`, :func:`layer_functions`).
- ``transformers.modeling_layers.GradientCheckpointingLayer``: the decoder layers, the modules
  that receive a model's forward keywords (:func:`decoder_layers`). In 5.17 LFM2's
  short-convolution module takes none of them, so the pack reaches its module-level
  convolution through its decoder layer.
- ``transformers.activations.ACT2FN``: the convolution's activation by name.
- ``<model module>.torch_recurrent_gated_delta_rule`` (5.10:
  ``<layer>.recurrent_gated_delta_rule``) and ``recurrent_kimi_delta_attention``: the
  token-by-token forms of the scans, which ``treepack verify`` runs as a second unpacked
  implementation (:func:`other_scan`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("treepack.hf needs transformers >= 5: pip install 'treepack[hf]'") from e

__all__ = ["other_scan", "WRITTEN_AGAINST", "attn_implementation", "set_attn_implementation",
           "text_config", "register", "attention_function", "mask_function", "model_function",
           "MIXERS", "module_functions", "lookup", "LAYER_MIXERS", "layer_functions",
           "decoder_layers", "replace", "activation", "layer_types"]

WRITTEN_AGAINST = "5.24"


def attn_implementation(config) -> str:
    """The attention implementation a model's layers run (``"eager"`` when unset)."""
    return config._attn_implementation or "eager"


def set_attn_implementation(config, name: str) -> None:
    config._attn_implementation = name


def text_config(config):
    """The language model's config (multi-modal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def register(name: str, attention: Callable, mask: Callable) -> None:
    """Register ``name`` as an attention implementation and its mask builder."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


def attention_function(module, name: str) -> Callable:
    """The attention function of implementation ``name`` for a layer ``module``."""
    if name == "eager":  # eager is each model's own function, not a registered one
        return model_function(module, "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS[name]


def mask_function(name: str) -> Callable | None:
    """The mask builder of implementation ``name``, or None where transformers passes the
    attention mask through as it is."""
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[name]


def model_function(obj, name: str) -> Callable | None:
    """A function of the modeling module that defines ``obj``'s class (None if absent)."""
    return getattr(sys.modules[type(obj).__module__], name, None)


# The module-level functions of a modeling module that a hybrid layer's token mixer calls,
# by the role treepack gives them.
MIXERS = {"causal_conv1d_fn": "conv", "torch_chunk_gated_delta_rule": "gated_delta",
          "mamba2_chunk_scan": "ssd", "mamba2_split_conv1d_scan_combined": "fused",
          "mamba_selective_scan": "selective", "mamba_inner_fn": "fused",
          # Kimi Delta Attention: the gated delta rule with a gate per key channel, under the
          # same signature (a zero gate and beta keep its state too)
          "chunk_kimi_delta_attention": "gated_delta",
          # MiniMax's lightning attention computes inline in its forward, which is wrapped
          "MiniMaxLightningAttention.forward": "lightning"}


def module_functions(model) -> list[tuple[object, str]]:
    """``(module, name)`` of every :data:`MIXERS` function in the modeling modules that define
    ``model``'s submodules."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    return [(module, name) for module in sorted(modules, key=lambda m: m.__name__)
            for name in MIXERS if callable(lookup(module, name))]


def lookup(module, name: str):
    """``module.name``, where ``name`` may be dotted (a class's method), or None."""
    for part in name.split("."):
        module = getattr(module, part, None)
    return module


# transformers 5.10 (verl 0.9's pin): the Gated DeltaNet layers (Qwen3.5, Qwen3-Next) hold
# their convolution and scan as attributes each layer sets in ``__init__`` (the convolution
# None without the causal-conv1d package), by the role treepack gives them.
LAYER_MIXERS = {"causal_conv1d_fn": "conv", "chunk_gated_delta_rule": "gated_delta"}


def layer_functions(model) -> list[tuple[object, list[str]]]:
    """``(layer, names)`` of every submodule of ``model`` that holds :data:`LAYER_MIXERS`
    attributes of its own (transformers 5.10)."""
    found = []
    for layer in model.modules():
        names = [name for name in LAYER_MIXERS if name in vars(layer)]
        if names:
            found.append((layer, names))
    return found


def decoder_layers(model) -> list:
    """Every decoder layer of ``model``: the modules a model's forward keywords reach."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def replace(module, name: str, function: Callable) -> Callable:
    """Set ``module.name`` (dotted: a class's method) to ``function``; return what was
    there."""
    *path, last = name.split(".")
    for part in path:
        module = getattr(module, part)
    original = getattr(module, last)
    setattr(module, last, function)
    return original


def activation(name: str) -> Callable:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def layer_types(config) -> list[str] | None:
    """Each layer's kind (``"full_attention"``, ``"linear_attention"``, ``"conv"``, ...), or
    None for a model without ``layer_types``."""
    return getattr(text_config(config), "layer_types", None)


# each chunked scan's token-by-token form (Kimi Delta Attention's too: Kimi-Linear,
# Bailing-hybrid)
_SCAN_FORMS = {"torch_chunk_gated_delta_rule": "torch_recurrent_gated_delta_rule",
               "chunk_kimi_delta_attention": "recurrent_kimi_delta_attention"}


@contextlib.contextmanager
def other_scan(model):
    """While it lasts, ``model``'s gated-delta-rule layers scan token by token (transformers'
    recurrent form) instead of by chunks: the same math, other float32 roundings. Swaps the
    modeling module's function and, in transformers 5.10, each layer's own attribute."""
    def by_token(recurrent):
        def scan(query, key, value, g, beta, chunk_size=64, **kwargs):
            kwargs.pop("cu_seqlens", None)  # 5.10 passes it (None) to the chunked form only
            return recurrent(query, key, value, g=g, beta=beta, **kwargs)
        return scan

    swapped = []
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        for by_chunks, one_by_one in _SCAN_FORMS.items():
            chunked = getattr(module, by_chunks, None)
            recurrent = getattr(module, one_by_one, None)
            if chunked is not None and recurrent is not None:
                swapped.append((module, by_chunks,
                                replace(module, by_chunks, by_token(recurrent))))
    for layer, names in layer_functions(model):
        recurrent = vars(layer).get("recurrent_gated_delta_rule")
        if "chunk_gated_delta_rule" in names and recurrent is not None:
            swapped.append((layer, "chunk_gated_delta_rule",
                            replace(layer, "chunk_gated_delta_rule", by_token(recurrent))))
    try:
        yield
    finally:
        for owner, name, chunked in swapped:
            replace(owner, name, chunked)
