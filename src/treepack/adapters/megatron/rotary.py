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
``position_ids``.

Multi-latent attention (DeepSeek's MLA, ``config.multi_latent_attention``) has no rotary
embedding on the model: each ``MLASelfAttention`` holds its own (``rope_type="rope"``: a
``RotaryEmbedding``; ``"yarn"``: a ``YarnRotaryEmbedding``, whose ``forward`` also returns
its ``mscale``) and applies it to the decoupled rope part of q and k. It asks that module
the same two questions with the layer's ``packed_seq_params``, so :func:`install` gives each
layer's module the same depth subclass (``kind == "mla"``). Others (YaRN on the model) are
refused by name, and so is MLA's fused rope (``apply_rope_fusion``: TransformerEngine's
kernel takes positions ``0 .. s - 1`` per ``cu_seqlens``).
"""

from __future__ import annotations

from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding, RotaryEmbedding)
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding)

from treepack.adapters.megatron.attention import UnsupportedMegatron
from treepack.core.compat import mixed_in

__all__ = ["TreeRows", "install", "position_kind", "POSITION_KINDS", "MLA_ROPE_TYPES"]

POSITION_KINDS = ("rope", "mrope", "learned_absolute", "none")
MLA_ROPE_TYPES = ("rope", "yarn")


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
        return self._at_depths(self.get_emb(*_span(max_seq_len, offset)), max_seq_len.depths)

    # multi-latent attention drops the batch dimension of q and k where packed_seq_params is
    # given ([rows, heads, dim]): its rows' embeddings are [rows, 1, dim] (install)
    _squeezed = False

    def _at_depths(self, emb: Tensor, depths: Tensor) -> Tensor:
        # [top, 1, 1, dim] for positions 0 .. top - 1, then each row's at its depth; Megatron
        # slices nothing per CP rank here: the rows are this rank's already
        out = emb.index_select(0, depths.to(emb.device))
        return out[:, 0] if self._squeezed else out


class _TreeYarn(_TreeRotary):
    """Mixed into a ``YarnRotaryEmbedding`` class: its ``forward`` (and ``get_emb``) return
    the embedding and its ``mscale``."""

    def forward(self, max_seq_len, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if not isinstance(max_seq_len, TreeRows):
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        emb, mscale = self.get_emb(*_span(max_seq_len, offset))
        return self._at_depths(emb, max_seq_len.depths), mscale


def _span(rows: TreeRows, offset: int) -> tuple[int, int]:
    """The positions ``0 .. top - 1`` the forward's rows' depths lie in."""
    return (int(rows.depths.max()) + 1 if rows.depths.numel() else 1), offset


def install(model) -> None:
    """Give ``model``'s ``RotaryEmbedding`` (``rope``) depth positions for tree forwards
    (module doc); nothing for position ids Megatron reads per token.

    Raises:
        UnsupportedMegatron: a position embedding treepack does not place by depth.
    """
    kind = position_kind(model)
    if kind == "rope":
        _by_depth(model.rotary_pos_emb, squeezed=False)
    elif kind == "mla":
        for module in model.modules():
            if isinstance(getattr(module, "rotary_pos_emb", None), RotaryEmbedding) \
                    and module is not model:
                _by_depth(module.rotary_pos_emb, squeezed=True)


def _by_depth(rotary: RotaryEmbedding, squeezed: bool) -> None:
    """Give ``rotary`` (a ``RotaryEmbedding`` or ``YarnRotaryEmbedding``) the depth
    subclass of its class (``squeezed``: for multi-latent attention's layout)."""
    if isinstance(rotary, _TreeRotary):
        return
    mixin = _TreeYarn if isinstance(rotary, YarnRotaryEmbedding) else _TreeRotary
    mixed_in(rotary, mixin, _squeezed=squeezed)


def position_kind(model) -> str:
    """``model``'s position embedding (:data:`POSITION_KINDS`), checked.

    Raises:
        UnsupportedMegatron: YaRN or another embedding treepack does not place by depth;
            multi-latent attention with another ``rope_type`` or its fused rope.
    """
    kind = getattr(model, "position_embedding_type", "learned_absolute")
    config = model.config
    if getattr(config, "multi_latent_attention", False):
        rope = getattr(config, "rope_type", "rope")
        if rope not in MLA_ROPE_TYPES:
            raise UnsupportedMegatron(
                f"multi-latent attention with rope_type={rope!r}: treepack places "
                f"{MLA_ROPE_TYPES} by depth inside each layer")
        if kind not in ("rope", "none"):
            raise UnsupportedMegatron(
                f"position_embedding_type={kind!r} with multi-latent attention: MLA applies "
                "its own rotary (config.rope_type) inside each layer; build the GPTModel with "
                "position_embedding_type='rope'")
        if getattr(config, "apply_rope_fusion", False):
            raise UnsupportedMegatron(
                "apply_rope_fusion=True with multi-latent attention: TransformerEngine's fused "
                "MLA rope takes positions 0 .. s - 1 per cu_seqlens, not each row's depth. "
                "Set apply_rope_fusion=False for tree forwards")
        return "mla"
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
