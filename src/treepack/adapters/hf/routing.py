"""Routing: each layer's token mixer of a prepared model, with a pack or without.

:func:`treepack.hf.prepare` registers a treepack attention implementation per original one
(``treepack_sdpa``, ...). With a pack (a :class:`TreeForward` passed as a forward keyword) it
runs the tree backend and counts the layers that took it; without one it runs the original
implementation, so one model object serves packed and ordinary batches. Hybrid models' other
mixers (linear attention, state-space, short convolutions) are routed here too, by layer type.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

from treepack.adapters.hf import compat
from treepack.attention import TreeAttention
from treepack.core.tree import TreePack

__all__ = ["UnsupportedModel", "TreeForward", "tree_forward", "registered_name", "check_calls",
           "text_config", "TREE_FORWARD_KWARG", "ATTENTION_LAYER_TYPES"]


TREE_FORWARD_KWARG = "treepack_tree_forward"  # the model keyword that carries a TreeForward
_PREFIX = "treepack_"
ORIGINAL: dict[str, str] = {}  # registered treepack name -> the original implementation
TREE_FORWARD = contextvars.ContextVar("treepack_tree_forward", default=False)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


class UnsupportedModel(NotImplementedError, ValueError):
    """A model treepack cannot run exactly on a pack; the message says why and what to do.

    The one exception of "this model cannot run exactly". It is a ``NotImplementedError``
    (and so a ``RuntimeError``) and a ``ValueError``, the types earlier releases raised for
    these cases, so code that caught those still catches it.
    """


def registered_name(original: str) -> str:
    """The treepack implementation registered for ``original`` (registered on first use)."""
    # transformers treats any implementation whose name contains "flash" as flash attention,
    # so the registered name must not.
    name = _PREFIX + re.sub(r"[^a-z0-9]+", "_", original.lower().replace("flash", "fa"))
    if name not in ORIGINAL:
        ORIGINAL[name] = original
        compat.register(name, _attention, _mask)
    return name


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention: the tree backend with a pack, the original one without."""
    tree = kwargs.pop(TREE_FORWARD_KWARG, None)
    if tree is None:
        original = ORIGINAL[compat.attn_implementation(module.config)]
        return compat.attention_function(module, original)(module, query, key, value,
                                                           attention_mask, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModel(
            f"{type(module).__name__} uses attention sinks (s_aux), which treepack's backends "
            "do not implement yet; run this model unpacked"
        )
    tree.calls += 1
    tree.windowed += kwargs.get("sliding_window") is not None
    out = tree.attention(
        query, key, value,
        scale=kwargs.get("scaling"),
        softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"),
        dropout=kwargs.get("dropout", 0.0),
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T', H, D] as transformers expects


def _mask(*args, config=None, **kwargs):
    """No mask in a tree forward (the backend has the pack); the original one otherwise."""
    if TREE_FORWARD.get():
        return None
    mask = compat.mask_function(ORIGINAL[compat.attn_implementation(config)])
    if mask is None:
        return kwargs.get("attention_mask")  # transformers passes such masks through as-is
    return mask(*args, config=config, **kwargs)


class TreeForward:
    """The per-forward object every attention layer receives: the backend and a call count."""

    def __init__(self, pack: TreePack, backend: str, block_size: int = 128):
        self.attention = TreeAttention(pack, backend, block_size=block_size)
        self.calls = 0
        self.windowed = 0  # calls that passed a sliding window


@contextlib.contextmanager
def tree_forward():
    """While it lasts, mask functions return no mask: the backend has the pack."""
    token = TREE_FORWARD.set(True)
    try:
        yield
    finally:
        TREE_FORWARD.reset(token)


def text_config(model):
    """The config of a model's language part (a multimodal model's ``text_config``)."""
    return compat.text_config(model.config)


def _expected_windowed_calls(config) -> int:
    """Layers the model gives a sliding window, by its config."""
    if getattr(config, "sliding_window", None) is None:
        return 0
    types = getattr(config, "layer_types", None)
    if types:
        return sum(t == "sliding_attention" for t in types)
    return config.num_hidden_layers if getattr(config, "use_sliding_window", True) else 0


def check_calls(model, tree: TreeForward) -> None:
    """Refuse a forward in which some layers bypassed the tree attention, or dropped their
    sliding window."""
    config = text_config(model)
    expected = config.num_hidden_layers
    if tree.calls != expected:
        raise UnsupportedModel(
            f"{type(model).__name__} has {expected} layers but {tree.calls} of them attended "
            "through transformers' attention interface: the others would attend across the "
            "packed forest (siblings would see each other). treepack supports models whose "
            "every layer uses the attention interface; run this one unpacked"
        )
    windowed = _expected_windowed_calls(config)
    if tree.windowed != windowed:
        raise UnsupportedModel(
            f"{type(model).__name__} uses a sliding window of {config.sliding_window} on "
            f"{windowed} layers, but {tree.windowed} of them passed it to the attention "
            "interface (the model applies it through its own mask, which a tree forward "
            "cannot use): those layers would attend without their window. Run this model "
            "unpacked"
        )
