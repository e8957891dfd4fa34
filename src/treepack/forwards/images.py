"""Images on a pack, the rules every adapter shares: which rows stand for which image, each
distinct image once, each row at the position its token has in its own sequence.

A vision-language model's processor turns an image into a run of placeholder tokens (one id,
``<|image_pad|>``, for every image) and the pixels the vision tower encodes into one feature
per placeholder. Three rules make that exact on a pack:

- **Content keys.** The tree is built over (id, key) pairs (:meth:`TreePack.from_sequences`'s
  ``keys=``), each placeholder keyed by its image's content (a hash of its pixels and grid):
  two prompts with the same text and different images never share a row; the same image in
  two sequences does, wherever their contexts agree.
- **One encoding per distinct image.** Each placeholder token names a feature of one distinct
  image (:attr:`Images.features`); a forward encodes the distinct images its rows need, once,
  and each placeholder row takes its feature (the adapters do: ``treepack.hf``,
  ``treepack.megatron``).
- **Positions.** A model with multimodal rotary positions (Qwen2-VL's mrope: temporal, height
  and width) gets, for each row, the positions the model itself gives that token in its own
  sequence (per sequence, mapped to rows; equal for a shared row, whose context is the same).

:class:`Images` holds a batch's images and its per-token tables, for a model described by a
:class:`VisionModel` (what the rules read of it, which each adapter fills from its model);
:func:`row_tables` lays them on a pack's rows. Torch and numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core.checks import validate_sequences
from treepack.core.derived import derived_from_pack
from treepack.core.tree import TreePack

__all__ = ["VisionModel", "Images", "RowTables", "row_tables", "content_key",
           "placeholder_keys", "padded_ids"]

_KEY_MASK = (1 << 62) - 1


class VisionModel(NamedTuple):
    """What the image rules read of a vision-language model (each adapter fills it).

    Attributes:
        family: the model's family (``"qwen2_5_vl"``, ``"llava"``, ...), for messages and for
            the adapter's own rules.
        image_token_id: the image placeholder id.
        key: what an :class:`Images` depends on in the model (checked when a forward runs it).
        merge: Qwen-VL's spatial merge size (``merge``² patches make a token, a grid per
            image); None for a fixed number of tokens per image.
        patch_width: values per pixel row (channels x temporal patch x patch²), or None.
        image_shape: ``(C, H, W)`` of an image where each is one tensor (LLaVA), else None.
        tokens_per_image: placeholders per image where it is fixed (LLaVA), else None.
        video_token_id: the video placeholder id, or None where the model takes no videos.
        video_runs: a video's placeholders are one run per temporal patch (Qwen3-VL's
            timestamps between) rather than one run.
        positions: ``positions(ids, image_grid, video_grid, seconds)``: each sequence's
            ``[3, L]`` multimodal rotary positions as the model computes them, or None
            (positions are depths).
        error: the adapter's refusal type.
    """

    family: str
    image_token_id: int
    key: tuple
    merge: int | None = None
    patch_width: int | None = None
    image_shape: tuple | None = None
    tokens_per_image: int | None = None
    video_token_id: int | None = None
    video_runs: bool = False
    positions: Callable | None = None
    error: type = ValueError


class Images:
    """The images of a batch of sequences, for a vision-language model on a pack
    (:class:`VisionModel` describes the model; the adapters' ``Images`` build it from
    theirs).

    Images are read in order: sequence 0's images first, each sequence's in the order of its
    placeholder runs (as processors lay them out). The same image given several times (each
    GRPO rollout carries a copy) is stored and encoded once.

    Args:
        model: the :class:`VisionModel`.
        sequences: N token-id sequences holding the image placeholders.
        pixel_values: every image of the batch, in order: Qwen-VL ``[patches, D]``, one row
            per patch; LLaVA ``[images, C, H, W]``.
        image_grid_thw: Qwen-VL ``[images, 3]``, each image's (temporal, height, width)
            patch grid; none for LLaVA.
        num_images: optional, images per sequence, checked against the placeholders.
        pixel_values_videos, video_grid_thw, second_per_grid_ts: the batch's videos, in order
            (Qwen-VL), and seconds per temporal patch (its temporal mrope).

    Raises:
        ValueError: pixel rows that disagree with the grids, a sequence whose placeholders do
            not match its images (naming the sequence), placeholders without an image, images
            left over; ``model.error``: videos for a model without them.
    """

    def __init__(self, model: VisionModel, sequences, *, pixel_values: Tensor | None = None,
                 image_grid_thw: Tensor | None = None, num_images: Sequence[int] | None = None,
                 pixel_values_videos: Tensor | None = None,
                 video_grid_thw: Tensor | None = None,
                 second_per_grid_ts: Sequence[float] | Tensor | None = None):
        self.family, self.model_key = model.family, model.key
        self.image_token_id = int(model.image_token_id)
        ids = validate_sequences(sequences)
        videos = _videos(model, pixel_values_videos, video_grid_thw, second_per_grid_ts)
        if pixel_values is None:  # videos only: no image rows, in the videos' dtype
            pixel_values = (torch.zeros(0, *videos[1].shape[1:], dtype=videos[1].dtype)
                            if videos else None)
            image_grid_thw = torch.zeros(0, 3, dtype=torch.long) if videos else None
            if pixel_values is None:
                raise ValueError("Images needs pixel_values (images) or pixel_values_videos "
                                 "(videos)")
        if model.merge is not None:
            grid, pixel_values, tokens, starts = _patches(model, pixel_values, image_grid_thw)
        else:
            grid, pixel_values, tokens, starts = _per_image(model, pixel_values,
                                                            image_grid_thw)
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
            # The tower then casts all to its own dtype, as the models' forwards do with each
            # modality.
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
            separated=model.merge is not None)
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
        self.positions = None if model.positions is None else (
            model.positions(ids, grid[:image_count], grid[image_count:],
                            self.second_per_grid_ts) if ids else [])

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

    def select(self, indices):
        """The images of sequences ``indices`` (a micro-batch, a plan's pack's ``seq_ids``).

        Args:
            indices: sequence indices into this batch.

        Returns:
            The same kind of images over those sequences, in that order (the distinct-image
            table is shared, and only the images a forward's rows need are encoded).
        """
        out = object.__new__(type(self))
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

    def pixels(self, needed: np.ndarray) -> tuple[Tensor, Tensor | None]:
        """The pixel rows of distinct images ``needed``, concatenated in that order, and
        their grids (None where images have none), as a vision tower takes them."""
        pixels = torch.cat([self.pixel_values[self.patch_start[u]:self.patch_start[u + 1]]
                            for u in needed])
        return pixels, None if self.grid is None else self.grid[torch.as_tensor(needed)]

    def encoding(self, feature: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What a forward encodes for its placeholder rows (``feature``: their global
        feature indices): the distinct images they need, in order (each encoded once), and
        each row's index into those images' concatenated features."""
        image_of = np.searchsorted(self.feature_start, feature, side="right") - 1
        needed = np.unique(image_of)
        start = np.concatenate(([0], np.cumsum(self.tokens[needed])))
        local = np.empty(len(self.unique_key), dtype=np.int64)
        local[needed] = start[:-1] - self.feature_start[needed]
        return needed, feature + local[image_of]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sequences={self.num_sequences}, "
                f"images={sum(map(len, self.images_of))}, distinct={self.num_images}, "
                f"family={self.family!r})")


class RowTables(NamedTuple):
    """An :class:`Images` laid out on a pack's rows."""

    feature: np.ndarray  # [T'] feature index of each row, -1 for a text row
    positions: np.ndarray | None  # [3, T'] multimodal rotary positions, or None


@derived_from_pack
def row_tables(pack: TreePack, images: Images) -> RowTables:
    """Each row's feature (a distinct image's token, -1 for text) and multimodal positions,
    from every sequence's; cached per pack and images.

    Raises:
        ValueError: images of other sequences, a pack built without their keys, rows that
            stand for two images or two contexts.
    """
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
    return RowTables(feature, positions)


def padded_ids(ids: list[np.ndarray]) -> tuple[Tensor, Tensor]:
    """Sequences as one right-padded batch, as a model's ``get_rope_index`` takes them:
    ``input_ids`` ``[N, L]`` (0 past each end) and its ``attention_mask`` (1 on tokens)."""
    n, longest = len(ids), max(len(a) for a in ids)
    input_ids = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for s, seq in enumerate(ids):
        input_ids[s, :len(seq)] = torch.as_tensor(seq)
        mask[s, :len(seq)] = 1
    return input_ids, mask


def _check_rows_agree(placed: np.ndarray, wanted: np.ndarray) -> None:
    """Every token's row holds that token's feature and position: no row stands for two
    images, or for two contexts."""
    if not np.array_equal(placed, wanted):
        raise ValueError("rows of the pack hold placeholders of different images (its keys "
                         "do not tell the images apart): build it with images.pack()")


def _patches(model: VisionModel, pixel_values, image_grid_thw, what: str = "images"):
    """Qwen-VL's layout: one pixel row per patch, a (t, h, w) grid per image, merged
    ``merge``² patches to a token. Returns the grids, the pixels, each image's tokens and
    where its rows start (``[images + 1]``)."""
    if image_grid_thw is None:
        raise ValueError(f"{model.family} {what} need their grids (the processor's [n, 3] "
                         "patch grids) beside their pixel values")
    merge = int(model.merge)
    grid = _as_grid(image_grid_thw)
    pixel_values = _as_pixels(pixel_values, grid)
    if model.patch_width is not None and pixel_values.shape[1] != model.patch_width:
        raise ValueError(
            f"pixel_values has rows of {pixel_values.shape[1]} values, but {model.family}'s "
            f"vision tower takes patches of {model.patch_width} (channels x temporal patch x "
            "patch²): use this model's own processor")
    patches = grid.prod(1)
    bad = np.flatnonzero((grid[:, 1:] % merge != 0).any(1)) if len(grid) else []
    if len(bad):
        raise ValueError(f"image_grid_thw[{bad[0]}] = {grid[bad[0]].tolist()}: height and "
                         f"width must be multiples of the spatial merge size {merge} (the "
                         "processor's own output is)")
    return grid, pixel_values, patches // merge ** 2, np.concatenate(([0], np.cumsum(patches)))


def _per_image(model: VisionModel, pixel_values, image_grid_thw):
    """LLaVA's layout: ``pixel_values`` ``[images, C, H, W]``, each image the same number of
    placeholder tokens."""
    if image_grid_thw is not None:
        raise ValueError(f"{model.family} images take no image_grid_thw: pixel_values is "
                         "[images, channels, height, width]")
    if not isinstance(pixel_values, Tensor) or pixel_values.ndim != 4:
        raise ValueError(f"{model.family} pixel_values must be the processor's [images, "
                         "channels, height, width] tensor, got "
                         f"{getattr(pixel_values, 'shape', type(pixel_values))}")
    if model.image_shape is not None and tuple(pixel_values.shape[1:]) != model.image_shape:
        raise ValueError(f"pixel_values has images of shape {tuple(pixel_values.shape[1:])}, "
                         f"but {model.family}'s vision tower takes {model.image_shape} "
                         "(channels, height, width): use this model's own processor")
    n = pixel_values.shape[0]
    return (None, pixel_values.detach(), np.full(n, model.tokens_per_image, dtype=np.int64),
            np.arange(n + 1))


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


def _videos(model: VisionModel, pixel_values_videos, video_grid_thw, second_per_grid_ts):
    """A batch's videos as items after its images: ``(grids, pixel rows, tokens, row starts,
    placeholder runs, video_token_id, seconds per grid)``, or None without videos."""
    if pixel_values_videos is None and video_grid_thw is None:
        if second_per_grid_ts is not None:
            raise ValueError("second_per_grid_ts without videos: pass pixel_values_videos "
                             "and video_grid_thw too")
        return None
    if model.merge is None or model.video_token_id is None:
        raise model.error(f"{model.family}: treepack runs videos of transformers' Qwen-VL "
                          "families on a pack, not this model's; run its video prompts "
                          "unpacked")
    if pixel_values_videos is None or video_grid_thw is None:
        raise ValueError("videos need both pixel_values_videos and video_grid_thw (the "
                         "processor's fields)")
    grid, pixels, tokens, starts = _patches(model, pixel_values_videos, video_grid_thw,
                                            "videos")
    # Qwen3-VL's processor writes a video a temporal patch at a time, timestamps between
    runs = grid[:, 0] if model.video_runs else np.ones(len(grid), dtype=np.int64)
    seconds = None
    if second_per_grid_ts is not None:
        seconds = torch.as_tensor(second_per_grid_ts, dtype=torch.float64).reshape(-1)
        if seconds.shape[0] != len(grid):
            raise ValueError(f"second_per_grid_ts has {seconds.shape[0]} values for "
                             f"{len(grid)} videos: one a video, as the processor gives")
    return grid, pixels, tokens, starts, runs, int(model.video_token_id), seconds
