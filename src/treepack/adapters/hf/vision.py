"""Images on a pack: every distinct image encoded once per forward, its features scattered into
the placeholder rows that stand for it, each row at the position its token has in its own
sequence.

The rules (content keys on the placeholders, one feature index per placeholder token, each
row at its token's multimodal position) are :mod:`treepack.forwards.images`', shared with the
Megatron adapter; this module reads them off a transformers model and runs its vision tower:

- **One encoding per distinct image.** Inside the model's forward, when it embeds the pack's
  rows, the vision tower runs once over the distinct images this forward's rows need, with the
  model's own attention (never the tree's), and each placeholder row takes its image's
  feature. A shared row is one row, so its feature's gradient is the sum over the sequences
  through it, as unpacked; an image placeholder that appears in two unshared places reads the
  one encoding twice, so the vision tower's gradient collects both.
- **Positions.** mrope positions come from the model's own ``get_rope_index``, per sequence;
  the attention's structure and sliding windows still count depth.
- **Image blocks.** Where an image's tokens see each other both ways (Gemma 3), each run of
  an image's placeholder rows is a block of the tree's attention (:class:`TreeAttention`'s
  ``blocks``): a run lies within one segment of the tree (its content key forbids a fork
  inside it), so its rows are contiguous and one path's, and every sequence through it sees
  the same block.

:class:`Images` holds a batch's images and the per-token tables; :func:`treepack.hf.logprobs`
and every other packed call take it as ``images=``.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import TREE_FORWARD, UnsupportedModel, text_config
from treepack.core.tree import TreePack
from treepack.forwards import images as rules
from treepack.forwards.images import content_key, placeholder_keys

__all__ = ["Images", "MROPE_FAMILIES", "IMAGE_FAMILIES", "REFUSED_FAMILIES", "check_family",
           "vision_forward", "image_token_ids", "content_key", "placeholder_keys",
           "BIDIRECTIONAL_FAMILIES", "image_blocks"]

# Families whose processor gives one pixel row per patch and an image_grid_thw per image, whose
# vision tower is ``model.visual`` and whose rotary positions are 3-D (mrope).
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                  "qwen3_5_moe")
# Families whose processor gives one [C, H, W] tensor per image, each image a fixed number of
# placeholder tokens, encoded by a vision tower and a projector; positions 1-D (depth).
IMAGE_FAMILIES = ("llava", "gemma3")
# Families whose image tokens see each other both ways (every token of an image sees the whole
# image, later tokens included): each image's rows are a block of the tree's attention.
BIDIRECTIONAL_FAMILIES = ("gemma3",)
REFUSED_FAMILIES = {
    "gemma3n": "Gemma 3n's image tokens attend to each other bidirectionally, which the "
               "tree's ancestor-only attention does not express",
    "paligemma": "PaliGemma's prefix (image and prompt) attends bidirectionally, which the "
                 "tree's ancestor-only attention does not express",
}


def image_token_ids(config) -> dict[str, int]:
    """A model config's image / video / audio placeholder ids, by field name."""
    fields = ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
              "audio_token_id", "audio_token_index")
    return {f: getattr(config, f) for f in fields if getattr(config, f, None) is not None}


class Images(rules.Images):
    """The images of a batch of sequences, for a vision-language model on a pack.

    Build it from what the model's processor gives for the batch, then build the pack with its
    keys and pass it to any packed call::

        images = hf.Images(model, sequences, pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"])
        pack = images.pack()                      # TreePack.from_sequences(sequences, keys=...)
        out = hf.logprobs(model, pack, images=images)

    Images are read in order: sequence 0's images first, each sequence's in the order of its
    placeholder runs (as processors lay them out). The same image given several times (each
    GRPO rollout carries a copy) is stored and encoded once. The rules are
    :mod:`treepack.forwards.images`' (the Megatron adapter's images share them).

    Args:
        model: the vision-language model (prepared or not, or a wrapper of one): Qwen2-VL,
            Qwen2.5-VL, Qwen3-VL, Qwen3.5 (``...ForConditionalGeneration``), LLaVA, or
            Gemma 3 (whose image tokens see each other both ways).
        sequences: N token-id sequences holding the image placeholders (the processor's
            ``input_ids`` without their padding).
        pixel_values: every image of the batch, in order (the processor's
            ``pixel_values``): Qwen-VL ``[patches, D]``, one row per patch; LLaVA and
            Gemma 3 ``[images, C, H, W]``.
        image_grid_thw: Qwen-VL ``[images, 3]``, each image's (temporal, height, width) patch
            grid; none for LLaVA (each image is the config's fixed number of tokens).
        num_images: optional, images per sequence (TRL's ``num_images``), checked against the
            placeholders.
        pixel_values_videos, video_grid_thw, second_per_grid_ts: the batch's videos, in order
            (Qwen-VL families; the processor's fields): ``[patches, D]`` and ``[videos, 3]`` as
            for images, and Qwen2.5-VL's seconds per temporal patch (its temporal mrope).
            Each distinct video is encoded once, by the vision tower that encodes the images;
            its placeholders (``video_token_id``) are one run (Qwen2-VL, Qwen2.5-VL) or one
            run a temporal patch, with the processor's timestamps between (Qwen3-VL).
            Videos and images each keep their own dtype until the tower casts them to its
            own, as the model's forward does.

    Raises:
        UnsupportedModel: a model that encodes no images, or a family treepack does not run
            (Gemma 3n's and PaliGemma's bidirectional attention, by name).
        ValueError: pixel rows that disagree with the grids, a sequence whose placeholders do
            not match its images (naming the sequence), placeholders without an image, images
            left over.
    """

    def __init__(self, model, sequences, **kwargs):
        core = unwrap(model)
        super().__init__(vision_model(core, check_family(core)), sequences, **kwargs)


def vision_model(core, family: str) -> rules.VisionModel:
    """What the image rules read of a transformers vision-language model (``core``, of
    ``family``)."""
    config = core.config
    vision = config.vision_config
    if family not in MROPE_FAMILIES:  # LLaVA, Gemma 3: a fixed number of tokens an image
        tokens = getattr(config, "mm_tokens_per_image", None) or (  # Gemma 3: pooled
            (vision.image_size // vision.patch_size) ** 2
            + (config.vision_feature_select_strategy == "full"))
        return rules.VisionModel(
            family, int(config.image_token_id), _model_key(core),
            image_shape=(vision.num_channels, vision.image_size, vision.image_size),
            tokens_per_image=int(tokens), error=UnsupportedModel)
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", None))
    width = None if channels is None else \
        int(channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    image_id = int(config.image_token_id)
    video_id = getattr(config, "video_token_id", None)

    def positions(ids, grid, video_grid, seconds):
        return _rope_positions(core, ids, grid, image_id,
                               video_id if len(video_grid) else None, video_grid, seconds)

    return rules.VisionModel(
        family, image_id, _model_key(core), merge=int(vision.spatial_merge_size),
        patch_width=width, video_token_id=None if video_id is None else int(video_id),
        video_runs=family.startswith("qwen3"), positions=positions, error=UnsupportedModel)


# ---------------------------------------------------------------------- the forward


def _placeholder_runs(h, feature: np.ndarray) -> np.ndarray:
    """Each image placeholder row's run: the first row of the run of consecutive placeholder
    rows on its path that it belongs to (-1 for a text row). A run is what transformers makes
    one block of (Gemma 3's ``token_type_ids`` runs); it must lie within one segment of the
    tree, or the sequences through it would see different blocks."""
    n = len(feature)
    row = np.arange(n)
    image = feature >= 0
    parent = h.parent_row[:n]
    starts = image & ((parent < 0) | ~image[np.maximum(parent, 0)])
    if (image & ~starts & (parent != row - 1)).any():  # a run's rows follow one another
        raise ValueError("a run of image placeholder rows is not contiguous in the pack: build "
                         "it with images.pack()")
    runs = np.where(image, np.maximum.accumulate(np.where(starts, row, -1)), -1)
    segment_end = np.zeros(n, dtype=np.int64)  # segments partition the rows in order
    segment_end[h.segment_start] = h.segment_end
    segment_end = np.maximum.accumulate(segment_end)
    first = np.flatnonzero(starts)
    last = first + np.bincount(runs[image], minlength=n)[first] - 1
    crossing = np.flatnonzero(last >= segment_end[first])
    if len(crossing):
        a, b = int(first[crossing[0]]), int(last[crossing[0]])
        raise UnsupportedModel(
            f"a run of image placeholder rows (rows {a} .. {b}) crosses a fork or a sequence's "
            "end in the tree: the sequences through it would see their images' tokens in "
            "different blocks (two images with no text between them, or a sequence cut inside "
            "an image). Separate the images with text tokens, as the model's processor does")
    return runs


def image_blocks(model, pack: TreePack, images: Images | None) -> Tensor | None:
    """The pack's rows' image blocks (``[T']``, -1 for a text row) where the model's image
    tokens see each other both ways (:data:`BIDIRECTIONAL_FAMILIES`), else None."""
    if images is None or images.family not in BIDIRECTIONAL_FAMILIES:
        return None
    runs = _placeholder_runs(pack.host, rules.row_tables(pack, images).feature)
    return torch.as_tensor(runs, device=pack.device)


@contextlib.contextmanager
def vision_forward(model, pack: TreePack, images: Images | None, rows: Tensor | None):
    """While it lasts, the model's input embedding of this forward's rows (``rows`` of
    ``pack``, all by default) puts each image placeholder row's feature in place, from one
    encoding of the distinct images those rows need. Yields the rows' position ids for the
    model: ``[3, 1, n]`` multimodal rotary positions, or None (depths, as for text).

    Under torch.distributed a vision-language model's forward runs its vision tower once even
    when these rows need no image (on a dummy image, its output added times 0): FSDP gathers
    the tower's parameters in collectives every rank must join, and DDP expects every
    parameter in the graph."""
    if images is None:
        with _idle_tower(model):
            yield None
        return
    if not isinstance(images, Images):
        raise TypeError(f"images must be a treepack.hf.Images, got {type(images).__name__}: "
                        "build it with hf.Images(model, sequences, pixel_values=..., "
                        "image_grid_thw=...)")
    core = unwrap(model)
    if _model_key(core) != images.model_key:
        raise ValueError(f"these images were built for another model ({images.model_key}: "
                         "family, image token id, tokens per patch grid, feature width), not "
                         f"{type(core).__name__} ({_model_key(core)}): build hf.Images with "
                         "the model that runs them")
    tables = rules.row_tables(pack, images)
    index = slice(None) if rows is None else rows.cpu().numpy()
    feature = tables.feature[index]
    positions = None
    if tables.positions is not None:
        positions = torch.as_tensor(tables.positions[:, index][:, None], device=pack.device)
    where = np.flatnonzero(feature >= 0)
    if not len(where):
        with _idle_tower(model):
            yield positions
        return
    deepstack: list = []
    placed = []  # one entry per embedding call: exactly one a forward

    def put_features(module, args, out):
        placed.append(True)
        if len(placed) > 1:  # refused after the forward
            return out
        return _place(core, images, feature[where], where, out, deepstack)

    handles = []
    try:
        handles.append(core.get_input_embeddings().register_forward_hook(put_features))
        text_model = _text_model(core)
        if text_model is not None and "deepstack_visual_embeds" in inspect.signature(
                text_model.forward).parameters:
            handles.append(text_model.register_forward_pre_hook(
                lambda module, args, kwargs: _deepstack(args, kwargs, deepstack, where),
                with_kwargs=True))
        yield positions
    finally:
        for handle in handles:
            handle.remove()
    if len(placed) != 1:
        raise UnsupportedModel(
            f"{type(core).__name__}'s forward embedded the pack's rows {len(placed)} times "
            "through its input embedding (once is how image features reach their rows): "
            "its image rows would hold text embeddings or be encoded twice; run this model's "
            "image prompts unpacked")


def _place(core, images: Images, feature: np.ndarray, where: np.ndarray, out: Tensor,
           deepstack: list) -> Tensor:
    """The embedding output ``[1, n, H]`` with the image rows ``where`` set to their features
    (global indices ``feature``), from one encoding of the images they belong to."""
    needed, pick = images.encoding(feature)
    encoded, layers = _encode(core, images, needed, out.device)
    pick = torch.as_tensor(pick, device=out.device)
    at = torch.as_tensor(where, device=out.device)
    deepstack[:] = [layer[pick] for layer in layers]
    return out.index_put((torch.zeros_like(at), at), encoded[pick].to(out.dtype))


def _deepstack(args: tuple, kwargs: dict, deepstack: list, where: np.ndarray):
    """Qwen3-VL's deepstack: the visual features of the earlier vision layers, added to the
    first decoder layers' hidden states at the image rows."""
    if not deepstack:
        return None
    if "inputs_embeds" not in kwargs:
        raise UnsupportedModel("the language model was called without inputs_embeds by "
                               "keyword: its deepstack features cannot be placed")
    n = kwargs["inputs_embeds"].shape[1]
    mask = torch.zeros(1, n, dtype=torch.bool, device=deepstack[0].device)
    mask[0, torch.as_tensor(where, device=mask.device)] = True
    return args, {**kwargs, "visual_pos_masks": mask,
                "deepstack_visual_embeds": [d.to(kwargs["inputs_embeds"].dtype)
                                            for d in deepstack]}


def _encode(core, images: Images, needed: np.ndarray,
            device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """The distinct images ``needed`` through the vision tower (and projector), with its own
    attention: the features ``[tokens, H]`` and any deepstack features (each ``[tokens, H]``)."""
    return _tower(core, *images.pixels(needed), device)


@contextlib.contextmanager
def _idle_tower(model):
    """Under torch.distributed, a vision-language model's vision tower runs once in this
    forward on a dummy image, its features added to the embedding times 0."""
    core = unwrap(model)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    try:
        check_family(core)
    except UnsupportedModel:  # a text model, or images treepack does not run
        yield
        return

    def touch(module, args, out):
        features, deep = _tower(core, *_dummy_image(core), out.device)
        return out + 0.0 * sum(f.sum() for f in [features, *deep]).to(out.dtype)

    handle = core.get_input_embeddings().register_forward_hook(touch)
    try:
        yield
    finally:
        handle.remove()


def _dummy_image(core) -> tuple[Tensor, Tensor | None]:
    """The smallest image the model's vision tower takes: pixels of zeros (and its grid)."""
    config = core.config
    vision = config.vision_config
    if config.model_type in IMAGE_FAMILIES:
        size = vision.image_size
        return torch.zeros(1, getattr(vision, "num_channels", 3), size, size), None
    merge = int(vision.spatial_merge_size)
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return torch.zeros(merge * merge, width), torch.tensor([[1, merge, merge]])


def _tower(core, pixels: Tensor, grid: Tensor | None,
           device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """Pixels (and their grids) through the vision tower with its own attention, on
    ``device`` (the forward's: an offloading FSDP keeps the tower's parameters elsewhere until
    it runs): features ``[tokens, H]`` and any deepstack features."""
    visual = _visual(core)
    pixels = pixels.to(device=device, dtype=next(visual.parameters()).dtype)
    token = TREE_FORWARD.set(False)  # mask functions build the vision tower's own masks
    try:
        if grid is None:  # LLaVA-style: the tower, a layer's features, the projector
            config = core.config
            chosen = {k: getattr(config, k) for k in ("vision_feature_layer",
                                                      "vision_feature_select_strategy")
                      if hasattr(config, k)}  # LLaVA's; Gemma 3 pools the last layer
            out = getattr(core, "model", core).get_image_features(pixel_values=pixels,
                                                                  **chosen)
        else:
            out = visual(pixels, grid_thw=grid.to(device))
    finally:
        TREE_FORWARD.reset(token)
    if isinstance(out, Tensor):
        return out.reshape(-1, out.shape[-1]), []
    if isinstance(out, (list, tuple)) and not hasattr(out, "pooler_output"):
        if out and isinstance(out[0], Tensor) and grid is None:  # one per image
            return torch.cat([o.reshape(-1, o.shape[-1]) for o in out]), []
        return out[0], list(out[1] or []) if len(out) > 1 else []  # older: (features, deep)
    features = out.pooler_output
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    features = features.reshape(-1, features.shape[-1])  # Gemma 3: [images, tokens, H]
    return features, list(getattr(out, "deepstack_features", None) or [])


def _visual(core):
    inner = getattr(core, "model", core)
    visual = getattr(inner, "visual", None) or getattr(inner, "vision_tower", None)
    if visual is None:
        raise UnsupportedModel(f"{type(core).__name__} has no vision tower (model.visual, "
                               "model.vision_tower)")
    return visual


def _text_model(core):
    inner = getattr(core, "model", core)
    return getattr(inner, "language_model", None)


# ---------------------------------------------------------------------- building


def _model_key(core) -> tuple:
    """What an :class:`Images` depends on in its model: family, image token id, how patches
    become tokens, the features' width."""
    config = core.config
    vision = config.vision_config
    return (config.model_type, int(config.image_token_id),
            getattr(vision, "spatial_merge_size", None), getattr(vision, "image_size", None),
            getattr(vision, "patch_size", None), getattr(text_config(core), "hidden_size", None))


def check_family(core) -> str:
    """The model's vision family (``config.model_type``), or :class:`UnsupportedModel`
    naming why its images cannot run on a pack."""
    kind = getattr(core.config, "model_type", None)
    if kind in REFUSED_FAMILIES:
        raise UnsupportedModel(f"{type(core).__name__} cannot run images on a pack: "
                               f"{REFUSED_FAMILIES[kind]}. Run its image prompts unpacked")
    towers = set(getattr(core.config, "sub_configs", None) or ()) - {"text_config"}
    if not image_token_ids(core.config) and not towers:
        raise UnsupportedModel(f"{type(core).__name__} ({kind}) encodes no images (its config "
                               "has no image_token_id and vision_config): give it text "
                               "sequences without images=")
    if kind not in MROPE_FAMILIES + IMAGE_FAMILIES:  # a multimodal model of another family
        raise UnsupportedModel(f"{type(core).__name__} ({kind}): treepack runs the images of "
                               f"{list(MROPE_FAMILIES + IMAGE_FAMILIES)} on a pack; run this "
                               "model's image prompts unpacked")
    return kind


def _rope_positions(core, ids: list[np.ndarray], grid: np.ndarray, image_id: int,
                    video_id: int | None = None, video_grid: np.ndarray | None = None,
                    seconds: Tensor | None = None) -> list[np.ndarray]:
    """Each sequence's ``[3, L]`` multimodal rotary positions, as the model computes them
    (its ``get_rope_index``, with the videos' grids and seconds per temporal patch), one
    padded batch."""
    if not ids:
        return []
    inner = getattr(core, "model", core)
    input_ids, mask = rules.padded_ids(ids)
    kwargs = dict(image_grid_thw=torch.as_tensor(grid), attention_mask=mask)
    takes = inspect.signature(inner.get_rope_index).parameters
    videos = video_id is not None
    if videos:
        kwargs["video_grid_thw"] = torch.as_tensor(video_grid)
        if seconds is not None and "second_per_grid_ts" in takes:
            kwargs["second_per_grid_ts"] = seconds
    if "mm_token_type_ids" in takes:
        # a video id without videos given is a text token (as the model runs it)
        kinds = (input_ids == image_id).long()
        if videos:
            kinds = kinds + 2 * (input_ids == video_id).long()
        kwargs["mm_token_type_ids"] = kinds
    positions = inner.get_rope_index(input_ids, **kwargs)[0]  # [3, N, L]
    return [positions[:, s, :len(seq)].numpy().astype(np.int64) for s, seq in enumerate(ids)]
