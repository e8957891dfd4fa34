"""Depth positions for Megatron's position embeddings.

``GPTModel`` with ``position_embedding_type="rope"`` asks its ``RotaryEmbedding`` for the
embeddings of positions ``0 .. s - 1`` (``get_rotary_seq_len``, then ``forward``): packed
rows would get their packed index, not their depth. :func:`install` gives the model's rotary
embedding a subclass whose two methods, for a tree forward, return the embedding of each of
the forward's rows at its depth (``[rows, 1, 1, dim]``); Megatron's attention applies it row
by row (the ``"sbhd"`` path of ``apply_rotary_pos_emb``, fused or not). For any other forward
they are Megatron's own. The tree reaches them through ``packed_seq_params``
(:class:`~.attention.TreePackedSeqParams`): ``get_rotary_seq_len`` receives it and returns a
:class:`TreeRows`, the int that ``forward`` then receives.

``mrope`` takes per-token position ids (``[3, 1, rows]``: the depth three times for text) and
``learned_absolute`` per-token ids too: those need nothing here, only the depths as
``position_ids``. Others (YaRN) are refused by name.
"""

from __future__ import annotations

from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding, RotaryEmbedding)

from treepack.adapters.megatron.attention import UnsupportedMegatron

__all__ = ["TreeRows", "install", "position_kind", "POSITION_KINDS"]

POSITION_KINDS = ("rope", "mrope", "learned_absolute", "none")


class TreeRows(int):
    """The rotary length Megatron asks for, carrying the forward's row depths ``[rows]``."""

    depths: Tensor

    def __new__(cls, depths: Tensor):
        out = super().__new__(cls, int(depths.shape[0]))
        out.depths = depths
        return out


class _TreeRotary:
    """Mixed into the model's ``RotaryEmbedding`` class (see the module doc)."""

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input,
                           transformer_config, packed_seq_params=None, **kwargs):
        tree = getattr(packed_seq_params, "tree", None)
        if tree is not None:
            return TreeRows(tree.depths)
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input,
                                          transformer_config, packed_seq_params, **kwargs)

    def forward(self, max_seq_len, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if not isinstance(max_seq_len, TreeRows):
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        depths = max_seq_len.depths
        top = int(depths.max()) + 1 if depths.numel() else 1
        # [top, 1, 1, dim] for positions 0 .. top - 1, then each row's at its depth; Megatron
        # slices nothing per CP rank here: the rows are this rank's already
        emb = self.get_emb(top, offset)
        return emb.index_select(0, depths.to(emb.device))


_CLASSES: dict[type, type] = {}


def install(model) -> None:
    """Give ``model``'s ``RotaryEmbedding`` (``rope``) depth positions for tree forwards
    (module doc); nothing for position ids Megatron reads per token.

    Raises:
        UnsupportedMegatron: a position embedding treepack does not place by depth.
    """
    kind = position_kind(model)
    if kind != "rope":
        return
    rotary = model.rotary_pos_emb
    cls = type(rotary)
    if issubclass(cls, _TreeRotary):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Tree{cls.__name__}", (_TreeRotary, cls), {})
    rotary.__class__ = _CLASSES[cls]


def position_kind(model) -> str:
    """``model``'s position embedding (:data:`POSITION_KINDS`), checked.

    Raises:
        UnsupportedMegatron: YaRN or another embedding treepack does not place by depth, or
            multi-latent attention (which applies its own rotary inside the layer).
    """
    kind = getattr(model, "position_embedding_type", "learned_absolute")
    if getattr(model.config, "multi_latent_attention", False):
        raise UnsupportedMegatron(
            "multi-latent attention (DeepSeek's MLA) applies its own rotary embedding inside "
            "each layer, at positions 0 .. s - 1: not placed by depth yet")
    if kind not in POSITION_KINDS:
        raise UnsupportedMegatron(
            f"position_embedding_type={kind!r}: treepack places {POSITION_KINDS} by depth; "
            "YaRN's embedding is not routed yet")
    if kind == "rope" and not isinstance(model.rotary_pos_emb, RotaryEmbedding):
        raise UnsupportedMegatron(f"rope through {type(model.rotary_pos_emb).__name__}, not "
                                  "megatron-core's RotaryEmbedding")
    if kind == "mrope" and not isinstance(model.rotary_pos_emb, MultimodalRotaryEmbedding):
        raise UnsupportedMegatron(f"mrope through {type(model.rotary_pos_emb).__name__}, not "
                                  "megatron-core's MultimodalRotaryEmbedding")
    return kind


def position_ids(kind: str, depths: Tensor) -> Tensor:
    """What ``GPTModel.forward`` takes as ``position_ids`` for rows at ``depths``."""
    if kind == "mrope":
        return depths[None, None].expand(3, 1, -1).contiguous()
    return depths[None]
