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
"""

from __future__ import annotations

import sys
from typing import Callable

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("treepack.hf needs transformers >= 5: pip install 'treepack[hf]'") from e

__all__ = ["WRITTEN_AGAINST", "attn_implementation", "set_attn_implementation", "text_config",
           "register", "attention_function", "mask_function", "model_function"]

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
