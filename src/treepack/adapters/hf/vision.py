"""Images on a pack: every distinct image encoded once per forward, its features scattered into
the placeholder rows that stand for it, each row at the position its token has in its own
sequence.

A vision-language model's processor turns an image into a run of placeholder tokens (one id,
``<|image_pad|>``, for every image) and the pixels the vision tower encodes into one feature
per placeholder. Three things make that exact on a pack:

- **Content keys.** The tree is built over (id, key) pairs (:meth:`TreePack.from_sequences`'s
  ``keys=``), each placeholder keyed by its image's content (a hash of its pixels and grid):
  two prompts with the same text and different images never share a row; the same image in
  two sequences does, wherever their contexts agree.
- **One encoding per distinct image.** Inside the model's forward, when it embeds the pack's
  rows, the vision tower runs once over the distinct images this forward's rows need, with the
  model's own attention (never the tree's), and each placeholder row takes its image's
  feature. A shared row is one row, so its feature's gradient is the sum over the sequences
  through it, as unpacked; an image placeholder that appears in two unshared places reads the
  one encoding twice, so the vision tower's gradient collects both.
- **Positions.** A model with multimodal rotary positions (Qwen2-VL's mrope: temporal, height
  and width) gets, for each row, the positions the model itself gives that token in its own
  sequence (``get_rope_index``, per sequence, mapped to rows; equal for a shared row, whose
  context is the same). The attention's structure and sliding windows still count depth.
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
import hashlib
import inspect
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import TREE_FORWARD, UnsupportedModel, text_config
from treepack.core.derived import derived_from_pack
from treepack.core.checks import validate_sequences
from treepack.core.tree import TreePack

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
_KEY_MASK = (1 << 62) - 1


def image_token_ids(config) -> dict[str, int]:
    """A model config's image / video / audio placeholder ids, by field name."""
    fields = ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
              "audio_token_id", "audio_token_index")
    return {f: getattr(config, f) for f in fields if getattr(config, f, None) is not None}


class Images:
    """The images of a batch of sequences, for a vision-language model on a pack.

    Build it from what the model's processor gives for the batch, then build the pack with its
    keys and pass it to any packed call::

        images = hf.Images(model, sequences, pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"])
        pack = images.pack()                      # TreePack.from_sequences(sequences, keys=...)
        out = hf.logprobs(model, pack, images=images)

    Images are read in order: sequence 0's images first, each sequence's in the order of its
    placeholder runs (as processors lay them out). The same image given several times (each
    GRPO rollout carries a copy) is stored and encoded once.

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

    def __init__(self, model, sequences, *, pixel_values: Tensor | None = None,
                 image_grid_thw: Tensor | None = None, num_images: Sequence[int] | None = None,
                 pixel_values_videos: Tensor | None = None,
                 video_grid_thw: Tensor | None = None,
                 second_per_grid_ts: Sequence[float] | Tensor | None = None):
        core = unwrap(model)
        self.family = check_family(core)
        config = core.config
        self.image_token_id = int(config.image_token_id)
        self.model_key = _model_key(core)
        ids = validate_sequences(sequences)
        videos = _videos(core, self.family, pixel_values_videos, video_grid_thw,
                         second_per_grid_ts)
        if pixel_values is None:  # videos only: no image rows, in the videos' dtype
            pixel_values = (torch.zeros(0, *videos[1].shape[1:], dtype=videos[1].dtype)
                            if videos else None)
            image_grid_thw = torch.zeros(0, 3, dtype=torch.long) if videos else None
            if pixel_values is None:
                raise ValueError("hf.Images needs pixel_values (images) or "
                                 "pixel_values_videos (videos)")
        if self.family in MROPE_FAMILIES:
            grid, pixel_values, tokens, starts = _patches(config, pixel_values, image_grid_thw)
        else:
            grid, pixel_values, tokens, starts = _per_image(config, pixel_values, image_grid_thw)
        image_count = len(tokens)
        runs = np.ones(image_count, dtype=np.int64)  # placeholder runs of each item
        self.video_token_id = self.second_per_grid_ts = None
        hosts = [pixel_values.detach().cpu()]  # each modality's pixels, in its own dtype
        if videos:  # the items after the images: their grids, rows, tokens and runs
            v_grid, v_pixels, v_tokens, v_starts, v_runs, self.video_token_id, seconds = videos
            grid = np.concatenate((grid, v_grid))
            starts = np.concatenate((starts, starts[-1] + v_starts[1:]))
            hosts.append(v_pixels.detach().cpu())
            # one table in the dtype both modalities widen to exactly (float32 for bfloat16
            # beside float32, float64 beside anything): no video rounded to the images' dtype.
            # The tower then casts all to its own dtype, as get_image_features and
            # get_video_features each do with their modality.
            wide = torch.promote_types(pixel_values.dtype, v_pixels.dtype)
            pixel_values = torch.cat((pixel_values.to(wide), v_pixels.to(wide)))
            tokens, runs = np.concatenate((tokens, v_tokens)), np.concatenate((runs, v_runs))
            self.second_per_grid_ts = seconds
        # one content key per image or video: its pixels (in their own dtype) and grid (and kind)
        base = (0, starts[image_count])  # where the images' and the videos' rows start

        def pixels_of(i):
            kind = int(i >= image_count)
            return hosts[kind][starts[i] - base[kind]:starts[i + 1] - base[kind]]

        keys = np.array([content_key(pixels_of(i),
                                     np.zeros(0, np.int64) if grid is None else grid[i],
                                     video=i >= image_count)
                         for i in range(len(tokens))], dtype=np.int64)
        self.unique_key, first, occurrence = np.unique(keys, return_index=True,
                                                       return_inverse=True)
        self.occurrence = occurrence.reshape(-1)
        self.grid = None if grid is None else torch.as_tensor(grid[first])  # [U, 3]
        self.tokens = tokens[first]  # [U]
        self.feature_start = np.concatenate(([0], np.cumsum(self.tokens)))  # [U + 1]
        # each distinct image's rows of pixel_values (patches; one for a whole image)
        self.patch_start = np.concatenate(([0], np.cumsum(np.diff(starts)[first])))
        self.pixel_values = (torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in first])
                             if len(first) else pixel_values[:0])
        self.keys, self.features, self.images_of = _assign(
            ids, self.image_token_id, tokens[:image_count], keys[:image_count],
            self.occurrence[:image_count], self.feature_start, num_images,
            separated=self.family in MROPE_FAMILIES)
        self.videos_of = [[] for _ in ids]
        self.grids_in_order = grid  # every image's, then every video's (rope positions)
        self.image_count = image_count
        if videos:
            v_keys, v_features, videos_of = _assign(
                ids, self.video_token_id, tokens[image_count:], keys[image_count:],
                self.occurrence[image_count:], self.feature_start, None, separated=True,
                runs=runs[image_count:], what="video")
            self.keys = [a + b for a, b in zip(self.keys, v_keys)]  # disjoint placeholders
            self.features = [np.maximum(a, b) for a, b in zip(self.features, v_features)]
            self.videos_of = [[image_count + v for v in mine] for mine in videos_of]
        self.sequences = ids
        self.positions = (_rope_positions(core, ids, grid[:image_count], self.image_token_id,
                                          self.video_token_id, grid[image_count:],
                                          self.second_per_grid_ts)
                          if self.family in MROPE_FAMILIES else None)

    # ------------------------------------------------------------------ batches

    @property
    def num_sequences(self) -> int:
        """N, the sequences these images belong to."""
        return len(self.sequences)

    @property
    def num_images(self) -> int:
        """Distinct images (each encoded once per forward that needs it)."""
        return len(self.unique_key)

    def pack(self, **kwargs) -> TreePack:
        """The pack of these sequences, keyed by their images.

        Args:
            **kwargs: as :meth:`TreePack.from_sequences` (``layout``, ``device``, ...).

        Returns:
            ``TreePack.from_sequences(sequences, keys=self.keys, **kwargs)``.
        """
        return TreePack.from_sequences(self.sequences, keys=self.keys, **kwargs)

    def select(self, indices) -> Images:
        """The images of sequences ``indices`` (a micro-batch, a plan's pack's ``seq_ids``).

        Args:
            indices: sequence indices into this batch.

        Returns:
            An :class:`Images` over those sequences, in that order (the distinct-image table
            is shared, and only the images a forward's rows need are encoded).
        """
        out = object.__new__(Images)
        out.__dict__.update(self.__dict__)
        index = [int(i) for i in np.asarray(torch.as_tensor(indices).cpu()).reshape(-1)]
        bad = [i for i in index if not 0 <= i < self.num_sequences]
        if bad:
            raise ValueError(f"select({bad[:4]}...): these images hold sequences 0 .. "
                             f"{self.num_sequences - 1}")
        for name in ("sequences", "keys", "features", "images_of", "videos_of", "positions"):
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, [value[i] for i in index])
        return out

    def __repr__(self) -> str:
        return (f"Images(sequences={self.num_sequences}, images={sum(map(len, self.images_of))}, "
                f"distinct={self.num_images}, family={self.family!r})")


# ---------------------------------------------------------------------- the forward


class _RowTables(NamedTuple):
    """An :class:`Images` laid out on a pack's rows."""

    feature: np.ndarray  # [T'] feature index of each row, -1 for a text row
    positions: np.ndarray | None  # [3, T'] multimodal rotary positions, or None


@derived_from_pack
def _row_tables(pack: TreePack, images: Images) -> _RowTables:
    h = pack.host
    if images.num_sequences != pack.num_sequences:
        raise ValueError(f"images holds {images.num_sequences} sequences but the pack "
                         f"{pack.num_sequences}: pass the images of the pack's sequences, in "
                         "its order (images.select(pack.seq_ids) for a plan's pack)")
    rows = ([h.rows[a:b] for a, b in zip(h.offsets[:-1], h.offsets[1:])]
            if pack.layout == "flat" else [h.rows[s, :n] for s, n in enumerate(h.lengths)])
    for s, (r, seq) in enumerate(zip(rows, images.sequences)):
        if len(r) != len(seq) or not np.array_equal(h.input_ids[r], seq):
            raise ValueError(f"sequence {s} of the pack is not sequence {s} of the images: "
                             "build the pack with images.pack() (or images.select(...) for a "
                             "subset)")
    every = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    keys = np.concatenate(images.keys) if rows else np.zeros(0, np.int64)
    if keys.any() and (h.row_keys is None or not np.array_equal(h.row_keys[every], keys)):
        raise ValueError("the pack was built without these images' content keys, so rows of "
                         "different images may have merged: build it with images.pack(), or "
                         "TreePack.from_sequences(sequences, keys=images.keys)")
    feature = np.full(pack.num_rows, -1, dtype=np.int64)
    positions = None
    if rows:
        wanted = np.concatenate(images.features)
        feature[every] = wanted
        _check_rows_agree(feature[every], wanted)
    if images.positions is not None:
        positions = np.zeros((3, pack.num_rows), dtype=np.int64)
        if rows:
            wanted = np.concatenate(images.positions, axis=1)
            positions[:, every] = wanted
            _check_rows_agree(positions[:, every], wanted)
    return _RowTables(feature, positions)


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
    runs = _placeholder_runs(pack.host, _row_tables(pack, images).feature)
    return torch.as_tensor(runs, device=pack.device)


def _check_rows_agree(placed: np.ndarray, wanted: np.ndarray) -> None:
    """Every token's row holds that token's feature and position: no row stands for two
    images, or for two contexts."""
    if not np.array_equal(placed, wanted):
        raise ValueError("rows of the pack hold placeholders of different images (its keys "
                         "do not tell the images apart): build it with images.pack()")


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
    tables = _row_tables(pack, images)
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
    image_of = np.searchsorted(images.feature_start, feature, side="right") - 1
    needed = np.unique(image_of)
    encoded, layers = _encode(core, images, needed, out.device)
    local_start = np.concatenate(([0], np.cumsum(images.tokens[needed])))
    local = np.empty(len(images.unique_key), dtype=np.int64)
    local[needed] = local_start[:-1] - images.feature_start[needed]
    pick = torch.as_tensor(feature + local[image_of], device=out.device)
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
    parts = [images.pixel_values[images.patch_start[u]:images.patch_start[u + 1]]
             for u in needed]
    grid = None if images.grid is None else images.grid[torch.as_tensor(needed)]
    return _tower(core, torch.cat(parts), grid, device)


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


def _patches(config, pixel_values, image_grid_thw):
    """Qwen-VL's layout: one pixel row per patch, a (t, h, w) grid per image, merged
    ``spatial_merge_size``² patches to a token. Returns the grids, the pixels, each image's
    tokens and where its rows start (``[images + 1]``)."""
    if image_grid_thw is None:
        raise ValueError(f"{config.model_type} images need image_grid_thw (the processor's "
                         "[images, 3] patch grids) beside pixel_values")
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    grid = _as_grid(image_grid_thw)
    pixel_values = _as_pixels(pixel_values, grid)
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", None))
    if channels is not None:
        width = int(channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        if pixel_values.shape[1] != width:
            raise ValueError(
                f"pixel_values has rows of {pixel_values.shape[1]} values, but "
                f"{config.model_type}'s vision tower takes patches of {width} (channels "
                f"{channels} x temporal_patch_size {vision.temporal_patch_size} x patch_size "
                f"{vision.patch_size}²): use this model's own processor")
    patches = grid.prod(1)
    bad = np.flatnonzero((grid[:, 1:] % merge != 0).any(1)) if len(grid) else []
    if len(bad):
        raise ValueError(f"image_grid_thw[{bad[0]}] = {grid[bad[0]].tolist()}: height and "
                         f"width must be multiples of the spatial merge size {merge} (the "
                         "processor's own output is)")
    return grid, pixel_values, patches // merge ** 2, np.concatenate(([0], np.cumsum(patches)))


def _per_image(config, pixel_values, image_grid_thw):
    """LLaVA's layout: ``pixel_values`` ``[images, C, H, W]``, each image the same number of
    placeholder tokens (the config's ``image_seq_length``)."""
    if image_grid_thw is not None:
        raise ValueError(f"{config.model_type} images take no image_grid_thw: pixel_values is "
                         "[images, channels, height, width]")
    if not isinstance(pixel_values, Tensor) or pixel_values.ndim != 4:
        raise ValueError(f"{config.model_type} pixel_values must be the processor's [images, "
                         "channels, height, width] tensor, got "
                         f"{getattr(pixel_values, 'shape', type(pixel_values))}")
    vision = config.vision_config
    want = (vision.num_channels, vision.image_size, vision.image_size)
    if tuple(pixel_values.shape[1:]) != want:
        raise ValueError(f"pixel_values has images of shape {tuple(pixel_values.shape[1:])}, "
                         f"but {config.model_type}'s vision tower takes {want} (channels, "
                         "height, width): use this model's own processor")
    tokens = getattr(config, "mm_tokens_per_image", None) or (  # Gemma 3: pooled to a count
        (vision.image_size // vision.patch_size) ** 2
        + (config.vision_feature_select_strategy == "full"))
    n = pixel_values.shape[0]
    return None, pixel_values.detach(), np.full(n, tokens, dtype=np.int64), np.arange(n + 1)


def _as_grid(image_grid_thw) -> np.ndarray:
    grid = np.asarray(torch.as_tensor(image_grid_thw).detach().cpu(), dtype=np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [images, 3] (t, h, w) patch counts, got "
                         f"shape {tuple(grid.shape)}")
    bad = np.flatnonzero((grid < 1).any(1))
    if bad.size:
        raise ValueError(f"image_grid_thw[{bad[0]}] = {grid[bad[0]].tolist()}: image "
                         f"{bad[0]}'s (t, h, w) patch counts must each be at least 1 (the "
                         "processor's own output is)")
    return grid


def _as_pixels(pixel_values, grid: np.ndarray) -> Tensor:
    if not isinstance(pixel_values, Tensor) or pixel_values.ndim != 2:
        raise ValueError("pixel_values must be the processor's [patches, D] tensor (one row "
                         f"per patch), got {getattr(pixel_values, 'shape', type(pixel_values))}")
    want = int(grid.prod(1).sum())
    if pixel_values.shape[0] != want:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows but "
                         f"image_grid_thw's {len(grid)} grids make {want}: pass the "
                         "processor's pixel_values and image_grid_thw of the same images")
    return pixel_values.detach()


def placeholder_keys(sequences, image_token_id: int, images) -> list[np.ndarray]:
    """Per-token content keys without the model, for code that holds a batch's ids and
    images but not the model (verl's trainer): each sequence's image placeholders keyed by
    their image, as :class:`Images` keys them, text 0.

    Args:
        sequences: N token-id sequences.
        image_token_id: the placeholder id (the processor's ``image_token_id``).
        images: per sequence, its images in order, each ``(pixels, grid)``: an image's pixel
            rows and its ``(t, h, w)`` grid (Qwen-VL), or its ``[1, C, H, W]`` pixels and
            None (LLaVA).

    Returns:
        N int64 arrays, one key per token.

    Raises:
        ValueError: a sequence whose placeholders cannot be split into its images (neither
            one run per image nor equal shares).
    """
    ids = validate_sequences(sequences)
    if len(images) != len(ids):
        raise ValueError(f"images has {len(images)} entries for {len(ids)} sequences: give "
                         "each sequence its (possibly empty) list of images")
    out = []
    for s, (seq, mine) in enumerate(zip(ids, images)):
        key = np.zeros(len(seq), dtype=np.int64)
        at = np.flatnonzero(seq == image_token_id)
        runs = np.split(at, np.flatnonzero(np.diff(at) > 1) + 1) if at.size else []
        if len(runs) != len(mine):  # adjacent images in one run (LLaVA): equal shares
            if len(runs) > len(mine) or at.size % len(mine):
                raise ValueError(f"sequence {s} has {at.size} placeholders (id "
                                 f"{image_token_id}) in {len(runs)} runs for {len(mine)} "
                                 "images: give each sequence its images, in order")
            runs = np.split(at, len(mine))
        for run, (pixels, grid) in zip(runs, mine):
            grid = np.zeros(0, np.int64) if grid is None else \
                np.asarray(torch.as_tensor(grid).cpu(), dtype=np.int64).reshape(-1)
            key[run] = content_key(torch.as_tensor(pixels), grid)
        out.append(key)
    return out


def content_key(pixels: Tensor, grid: np.ndarray, video: bool = False) -> int:
    """A 62-bit non-zero key of an image's (or a video's) pixels and grid (equal images, equal
    keys; a video never keys as an image)."""
    digest = hashlib.blake2b(grid.tobytes(), digest_size=8, person=b"video" if video else b"")
    digest.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return (int.from_bytes(digest.digest(), "little") & _KEY_MASK) % _KEY_MASK + 1


def _assign(ids: list[np.ndarray], image_id: int, tokens: np.ndarray, keys: np.ndarray,
            occurrence: np.ndarray, feature_start: np.ndarray, num_images,
            separated: bool = False, runs: np.ndarray | None = None, what: str = "image"):
    """Each sequence's images in order, their placeholder runs checked: per-token content
    keys, per-token feature indices (-1 for text), the distinct image of each of its images.
    ``separated``: each image's run is a whole run of placeholders (Qwen-VL's processors
    put vision_start / vision_end around each, and its rope index reads runs). ``runs``: how
    many equal runs each item's placeholders come in (Qwen3-VL's videos: one a temporal
    patch, timestamps between), 1 by default."""
    runs = np.ones(len(tokens), dtype=np.int64) if runs is None else runs
    if num_images is not None:
        num_images = [int(n) for n in num_images]
        if len(num_images) != len(ids) or sum(num_images) != len(tokens):
            raise ValueError(f"num_images={num_images} must give each of the {len(ids)} "
                             f"sequences its image count, {len(tokens)} in all")
    out_keys, out_features, images_of = [], [], []
    nxt = 0
    for s, seq in enumerate(ids):
        at = np.flatnonzero(seq == image_id)
        key = np.zeros(len(seq), dtype=np.int64)
        feature = np.full(len(seq), -1, dtype=np.int64)
        mine, used = [], 0
        while used < len(at):
            if nxt >= len(tokens):
                raise ValueError(f"sequence {s} has {len(at) - used} {what} placeholder tokens "
                                 f"(id {image_id}) beyond the {len(tokens)} {what}s given: "
                                 f"every placeholder needs its {what}'s pixels and grid")
            n, pieces = int(tokens[nxt]), int(runs[nxt])
            each = n // pieces
            u = occurrence[nxt]
            for piece in range(pieces):
                run = at[used:used + each]
                if len(run) < each or run[-1] - run[0] != each - 1:
                    raise ValueError(
                        f"sequence {s}: {what} {nxt} of the batch needs {each} consecutive "
                        f"placeholders (its grid's tokens{' a run' if pieces > 1 else ''}) at "
                        f"its turn, but the sequence has {len(run)} there, from position "
                        f"{int(run[0])}: the sequence's placeholders and the {what}s' grids "
                        "disagree")
                if separated and ((run[0] > 0 and seq[run[0] - 1] == image_id) or (
                        run[-1] + 1 < len(seq) and seq[run[-1] + 1] == image_id)):
                    raise ValueError(
                        f"sequence {s}: {what} {nxt} of the batch ({each} tokens) is not a "
                        f"whole run of placeholders at position {int(run[0])}: each {what} "
                        "needs its own run (vision_start, its placeholders, vision_end), as "
                        "the processor writes it")
                key[run] = keys[nxt]
                first = feature_start[u] + piece * each
                feature[run] = np.arange(first, first + each)
                used += each
            mine.append(nxt)
            nxt += 1
        if num_images is not None and len(mine) != num_images[s]:
            raise ValueError(f"sequence {s}: num_images says {num_images[s]} images but its "
                             f"placeholders hold {len(mine)}")
        out_keys.append(key)
        out_features.append(feature)
        images_of.append(mine)
    if nxt != len(tokens):
        raise ValueError(f"{len(tokens) - nxt} of the {len(tokens)} {what}s given have no "
                         f"placeholders in the sequences: pass the {what}s of these sequences "
                         "only, in order")
    return out_keys, out_features, images_of


def _videos(core, family: str, pixel_values_videos, video_grid_thw, second_per_grid_ts):
    """A batch's videos as items after its images: ``(grids, pixel rows, tokens, row starts,
    placeholder runs, video_token_id, seconds per grid)``, or None without videos."""
    if pixel_values_videos is None and video_grid_thw is None:
        if second_per_grid_ts is not None:
            raise ValueError("second_per_grid_ts without videos: pass pixel_values_videos "
                             "and video_grid_thw too")
        return None
    config = core.config
    video_id = getattr(config, "video_token_id", None)
    if family not in MROPE_FAMILIES or video_id is None:
        raise UnsupportedModel(f"{type(core).__name__} ({family}): treepack runs videos of "
                               f"{list(MROPE_FAMILIES)} on a pack; run this model's video "
                               "prompts unpacked")
    if pixel_values_videos is None or video_grid_thw is None:
        raise ValueError("videos need both pixel_values_videos and video_grid_thw (the "
                         "processor's fields)")
    grid, pixels, tokens, starts = _patches(config, pixel_values_videos, video_grid_thw)
    # Qwen3-VL's processor writes a video a temporal patch at a time, timestamps between
    runs = grid[:, 0] if family.startswith("qwen3") else np.ones(len(grid), dtype=np.int64)
    seconds = None
    if second_per_grid_ts is not None:
        seconds = torch.as_tensor(second_per_grid_ts, dtype=torch.float64).reshape(-1)
        if seconds.shape[0] != len(grid):
            raise ValueError(f"second_per_grid_ts has {seconds.shape[0]} values for "
                             f"{len(grid)} videos: one a video, as the processor gives")
    return grid, pixels, tokens, starts, runs, int(video_id), seconds


def _rope_positions(core, ids: list[np.ndarray], grid: np.ndarray, image_id: int,
                    video_id: int | None = None, video_grid: np.ndarray | None = None,
                    seconds: Tensor | None = None) -> list[np.ndarray]:
    """Each sequence's ``[3, L]`` multimodal rotary positions, as the model computes them
    (its ``get_rope_index``, with the videos' grids and seconds per temporal patch), one
    padded batch."""
    if not ids:
        return []
    inner = getattr(core, "model", core)
    n, longest = len(ids), max(len(a) for a in ids)
    input_ids = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for s, seq in enumerate(ids):
        input_ids[s, :len(seq)] = torch.as_tensor(seq)
        mask[s, :len(seq)] = 1
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
