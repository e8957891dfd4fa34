"""Vision-language models on Megatron: a vision tower beside a ``GPTModel`` language model with
multimodal rotary positions (mbridge's ``Qwen2_5VLModel``, what verl's Megatron engine builds
for Qwen2.5-VL), on a tree.

The image rules are :mod:`treepack.forwards.images`' (shared with ``treepack.hf``): the pack is
built over (id, content key) pairs, so rows of different images never merge; every
placeholder token names a feature of one distinct image; each row takes the multimodal
positions its token has in its own sequence, from the model's own ``get_rope_index``.
:class:`Images` reads them off the model.

A tree forward (:func:`run`) runs the model's steps as its forward runs them, on the
forward's rows:

- the vision tower (the model's own, with its own attention) once over the distinct images
  this forward's rows need, in one call;
- the language model's embedding of the rows, each image placeholder row set to its image's
  feature, scattered over the TP ranks under sequence parallelism as the model does;
- the language model over the rows at their multimodal positions, its layers' core attention
  the tree's (:func:`treepack.megatron.prepare` readies the language model only).

The vision tower's parameters get the gradient of every row that reads an image: a shared
row once, an image read in two unshared places twice, as unpacked.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import torch
from torch import Tensor

from megatron.core import tensor_parallel

from treepack.adapters.megatron import rotary
from treepack.adapters.megatron.attention import UnsupportedMegatron
from treepack.core.compat import replaced
from treepack.forwards import images as rules

__all__ = ["Images", "vision_language", "describe", "check", "run"]


def vision_language(model):
    """The vision-language model inside Megatron's wrappers (DDP, ``Float16Module``, a list
    of one chunk): a module with a ``vision_model`` and a ``GPTModel`` ``language_model``;
    None for a text model."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    inner = model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model
    for _ in range(8):
        if isinstance(getattr(inner, "language_model", None), GPTModel) and \
                hasattr(inner, "vision_model"):
            return inner
        if not hasattr(inner, "module"):
            return None
        inner = inner.module
    return None


class Images(rules.Images):
    """The images of a batch of sequences, for a Megatron vision-language model on a pack
    (as :class:`treepack.hf.Images`, whose rules it shares)::

        images = tm.Images(model, sequences, pixel_values=pixels, image_grid_thw=grids)
        pack = images.pack()
        out = tm.logprobs(model, pack, images=images)

    Args:
        model: the model (mbridge's ``Qwen2_5VLModel``, or Megatron's wrapper of one).
        sequences: N token-id sequences holding the image placeholders.
        pixel_values: every image of the batch, in order, ``[patches, D]`` (one row per
            patch, as the processor gives).
        image_grid_thw: ``[images, 3]``, each image's (temporal, height, width) patch grid.
        num_images: optional, images per sequence, checked against the placeholders.
        pixel_values_videos, video_grid_thw, second_per_grid_ts: refused (videos do not run
            on a Megatron tree yet).

    Raises:
        TypeError: not a vision-language model.
        UnsupportedMegatron: videos; a model whose rotary positions treepack cannot read.
        ValueError: as :class:`treepack.forwards.images.Images`.
    """

    def __init__(self, model, sequences, **kwargs):
        vl = vision_language(model)
        if vl is None:
            raise TypeError(f"{type(model).__name__} is not a vision-language model (a "
                            "vision_model beside a GPTModel language_model): give a text "
                            "model text sequences without images=")
        super().__init__(describe(vl), sequences, **kwargs)


def describe(vl) -> rules.VisionModel:
    """What the image rules read of a vision-language model ``vl``."""
    tower = vl.vision_model  # None past the first pipeline stage: its pixels go unread there
    if tower is not None:
        config = tower.config
        merge, patch = int(tower.spatial_merge_size), int(config.patch_size)
        width = int(config.in_channels) * int(config.temporal_patch_size) * patch ** 2
    else:  # merge² patches to a token, as the model's own square_merge_size says
        merge, patch, width = round(vl.square_merge_size ** 0.5), None, None
    rope = _rope_index(vl)

    def positions(ids, grid, video_grid, seconds):
        input_ids, mask = rules.padded_ids(ids)
        out = rope(input_ids, image_grid_thw=torch.as_tensor(grid) if len(grid) else None,
                   video_grid_thw=torch.as_tensor(video_grid) if len(video_grid) else None,
                   second_per_grid_ts=seconds, attention_mask=mask)[0]  # [3, N, L]
        return [out[:, s, :len(seq)].numpy().astype(np.int64) for s, seq in enumerate(ids)]

    hidden = vl.language_model.config.hidden_size
    return rules.VisionModel(  # no video_token_id: videos are refused by name (untested here)
        type(vl).__name__, int(vl.image_token_id),
        (type(vl).__name__, int(vl.image_token_id), merge, patch, hidden),
        merge=merge, patch_width=width, positions=positions, error=UnsupportedMegatron)


def _rope_index(vl):
    """The model's ``get_rope_index`` (its own, or its package's ``rope_utils``', which
    mbridge's forward imports)."""
    own = getattr(vl, "get_rope_index", None)
    if callable(own):
        return own
    package = type(vl).__module__.rsplit(".", 1)[0]
    try:
        return importlib.import_module(f"{package}.rope_utils").get_rope_index
    except (ImportError, AttributeError) as e:
        raise UnsupportedMegatron(
            f"{type(vl).__name__}: treepack reads its multimodal rotary positions from its "
            f"get_rope_index (the model's, or {package}.rope_utils'), found none") from e


def check(model, pack, images) -> None:
    """A forward's ``images`` against its model and pack.

    Raises:
        TypeError: images that are not :class:`Images`.
        ValueError: images for a text model, for another model, or for another pack.
    """
    if images is None:
        return
    vl = vision_language(model)
    if vl is None:
        raise ValueError(f"images= given to a text model ({type(model).__name__}): pass "
                         "images to a vision-language model only")
    if not isinstance(images, rules.Images):
        raise TypeError(f"images must be a treepack.megatron.Images, got "
                        f"{type(images).__name__}")
    key = describe(vl).key
    if images.model_key != key:
        raise ValueError(f"these images were built for another model ({images.model_key}), "
                         f"not this one ({key}): build them with the model that runs them")
    rules.row_tables(pack, images)  # the pack's sequences and keys are the images'


def run(vl, forward) -> Tensor:
    """The tree forward of a vision-language model's stage (module doc): its language
    model's output over ``forward``'s rows (a :class:`~.forward.MegatronForward` whose
    ``images`` are the pack's, or None for text rows)."""
    lm = vl.language_model
    pack, images = forward.pack, forward.images
    if images is None:
        _no_placeholders(vl, pack)
    index = forward.rows.cpu().numpy()
    tables = None if images is None else rules.row_tables(pack, images)
    if tables is not None and tables.positions is not None:
        positions = torch.as_tensor(tables.positions[:, index][:, None], device=pack.device)
    else:  # text rows: the depth, three times
        positions = rotary.position_ids("mrope", forward.depths)
    embeds = None
    if lm.pre_process:
        embeds = lm.embedding(input_ids=pack.input_ids[forward.rows][None], position_ids=None)
        if tables is not None:
            embeds = _placed(vl, images, tables.feature[index], embeds)
        if lm.config.sequence_parallel:
            embeds = tensor_parallel.scatter_to_sequence_parallel_region(embeds)
    with _squeezed_rotary(lm):
        return lm(input_ids=None, position_ids=positions, attention_mask=None,
                  decoder_input=embeds, packed_seq_params=forward.params())


def _no_placeholders(vl, pack) -> None:
    """A forward without images must hold no image or video placeholder: its rows would be
    the placeholder token's embedding, not the image's features."""
    ids = pack.host.input_ids[:pack.num_packed_rows]
    for name in ("image_token_id", "video_token_id"):
        token = getattr(vl, name, None)
        if token is not None and (ids == token).any():
            raise UnsupportedMegatron(
                f"the pack holds {name.split('_')[0]} placeholders (id {token}) but no images "
                "were given: build treepack.megatron.Images(model, sequences, pixel_values=..., "
                "image_grid_thw=...) and pass images= to this call (videos do not run on a "
                "Megatron tree yet)")


def _placed(vl, images: rules.Images, feature: np.ndarray, embeds: Tensor) -> Tensor:
    """The rows' embeddings ``[n, 1, H]`` with each image placeholder row set to its feature
    (``feature``: global feature indices, -1 for text), from one call of the vision tower
    over the distinct images these rows need."""
    where = np.flatnonzero(feature >= 0)
    if not len(where):
        return embeds
    needed, pick = images.encoding(feature[where])
    tower = vl.vision_model
    pixels, grid = images.pixels(needed)
    encoded = tower(vision_data=pixels.to(device=embeds.device,
                                          dtype=next(tower.parameters()).dtype),
                    grid_thw=grid.to(embeds.device))
    pick = torch.as_tensor(pick, device=embeds.device)
    at = torch.as_tensor(where, device=embeds.device)
    return embeds.index_put((at, torch.zeros_like(at)), encoded[pick].to(embeds.dtype))


def _squeezed_rotary(lm):
    """mbridge's Qwen2.5-VL attention drops the batch dimension of q and k wherever
    ``packed_seq_params`` is given (``[rows, heads, d]``) and applies the rotary embedding to
    them as they are: for a tree forward its embedding is ``[rows, 1, d]`` (the
    ``[rows, 1, 1, d]`` Megatron makes would broadcast over the rows twice). Nothing for
    attention that keeps the batch dimension."""
    layers = getattr(lm.decoder, "layers", [])
    if not any(c.__module__.startswith("mbridge.")
               for layer in layers for c in type(getattr(layer, "self_attention", None)).__mro__):
        return contextlib.nullcontext()
    embedding = lm.rotary_pos_emb
    original = embedding.forward
    return replaced(embedding, "forward", lambda *args, **kwargs: original(*args, **kwargs)[:, 0])
