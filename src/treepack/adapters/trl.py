"""TRL integration: GRPOTrainer's per-token log-probs from one packed forward.

    from treepack.adapters.trl import TreepackGRPOTrainer        # a GRPOTrainer, packed
    trainer = TreepackGRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)

or, for a trainer you already have (or a subclass of GRPOTrainer)::

    treepack.trl.patch(trainer)

The seam is ``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids,
attention_mask, logits_to_keep, ...)``. TRL calls it with each prompt + completion row
(left-padded prompts, right-padded completions) and expects ``[B, logits_to_keep]``
log-probs (and entropies) aligned with its completion mask. Here the padding is stripped,
the rows (whose prompts repeat ``num_generations`` times) are merged into one prefix forest —
or, with ``max_tokens``, planned into several packs — and log-probs come from
:func:`treepack.hf.logprobs` (the lean head inside the model's forward where it applies, so no
``[T', V]`` logits), with TRL's temperature. A no-grad pass (old and reference log-probs)
whose tree the plan would split runs in parts instead, every row once
(:func:`treepack.hf.logprobs_in_parts`). Everything else in the trainer is TRL's own.

Under gradient accumulation TRL shuffles each generation batch and cuts it into
``steps_per_generation`` micro-batches; the packed trainer deals whole groups to them instead
(:func:`shuffle_whole_groups`), each row kept in the optimizer step TRL's shuffle gives it.
Every loss TRL averages per row or over the whole batch is then unchanged. Its entropy bonus, a
token mean per micro-batch, is corrected to the micro-batch TRL would have put each row in; the
options TRL computes over a micro-batch's rows as a whole (``loss_type="bnpo"``,
``top_entropy_quantile < 1``, the router load-balancing loss) keep TRL's own micro-batches.

A vision-language run (prompts with images, a processor as ``processing_class``; the
families of :class:`treepack.hf.Images`, Qwen-VL and LLaVA) packs too: the seam keys the tree
by image content and encodes each distinct image once per forward, and whole groups are found
by prompt and image together.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import types
import warnings
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.adapters import hf
from treepack.adapters.hf.vision import BIDIRECTIONAL_FAMILIES
from treepack.adapters.hf.vision import content_key as image_content_key
from treepack.core.outputs import take_columns
from treepack.core.tree import TreePack
from treepack.planning import sharing
from treepack.planning.collation import unpadded
from treepack.planning.groups import keep_groups_together
from treepack.planning.planner import plan

try:
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.extras.profiling import profiling_decorator
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import get_config_model_id
except ImportError as e:  # pragma: no cover - exercised only without trl
    raise ImportError("treepack.trl needs TRL: pip install trl") from e

__all__ = ["TreepackGRPOTrainer", "patch", "per_token_logps_and_entropies",
           "shuffle_whole_groups"]


def per_token_logps_and_entropies(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    backend: str = "auto",
    max_tokens: int | None = None,
    pad_to_multiple_of: int | None = None,
    cast_lm_head_to_fp32: bool = False,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    num_images: list[int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """TRL's per-token log-probs (and entropies) of a batch, from packed forwards.

    Column ``j`` of row ``b`` is the log-prob of ``input_ids[b, S - K + j]`` given everything
    before it in that row (``K = logits_to_keep``); padding positions hold 0.

    Args:
        model: a prepared causal LM (:func:`treepack.hf.prepare`).
        input_ids, attention_mask: [B, S], left-padded prompts then right-padded completions.
        logits_to_keep: K, the completion columns TRL scores.
        temperature: TRL's sampling temperature.
        compute_entropy, compute_aux_loss: as TRL's seam.
        backend: the attention backend.
        max_tokens: rows per forward (the batch planned into several packs); default one.
        pad_to_multiple_of: pad each pack's rows to a multiple of this.
        cast_lm_head_to_fp32: TRL's option of that name.
        pixel_values, image_grid_thw, num_images: a vision-language batch's images, as TRL
            hands them (one pixel row per patch, each row's images in order, each rollout
            with its copy; :class:`treepack.hf.Images`): the tree is keyed by image content
            and each distinct image encoded once per forward.

    Returns:
        ``(logps [B, K], entropies [B, K] or None, aux_loss or None)``.

    Raises:
        As :func:`treepack.hf.forward` and :func:`treepack.logprobs_from_hidden`.
    """
    return _packed_forwards(model, input_ids, attention_mask, logits_to_keep,
                            temperature=temperature, compute_entropy=compute_entropy,
                            compute_aux_loss=compute_aux_loss, backend=backend,
                            max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of,
                            cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                            images=_images(model, input_ids, attention_mask, pixel_values,
                                           image_grid_thw, num_images))[:3]


def _image_types(model, input_ids, attention_mask, token_type_ids) -> None:
    """Gemma 3's ``token_type_ids`` (1 on image tokens; the model makes each run of them a
    block that sees itself both ways) carry nothing the pack does not: its image rows are
    its blocks. Any other use of them is refused, naming the model."""
    if token_type_ids is None:
        return
    core = hf.unwrap(model)
    placeholder = getattr(core.config, "image_token_id", None)
    mask = attention_mask.bool()
    if placeholder is None or core.config.model_type not in BIDIRECTIONAL_FAMILIES or \
            not torch.equal(token_type_ids.bool() & mask, (input_ids == placeholder) & mask):
        raise NotImplementedError(
            f"{type(core).__name__} was given token_type_ids that are not its image tokens' "
            f"marks (1 exactly on image_token_id, {placeholder}): treepack's GRPO seam packs "
            f"those for {list(BIDIRECTIONAL_FAMILIES)} only. Use the stock GRPOTrainer for "
            "this model's inputs")


def _images(model, input_ids, attention_mask, pixel_values, image_grid_thw, num_images):
    """A vision-language batch's :class:`treepack.hf.Images` (None for text)."""
    if pixel_values is None and image_grid_thw is None:
        return None
    mask = attention_mask.bool()
    return hf.Images(model, [ids[m] for ids, m in zip(input_ids, mask)],
                     pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                     num_images=num_images)


def _packed_forwards(model, input_ids, attention_mask, logits_to_keep, *, temperature,
                     compute_entropy, compute_aux_loss, backend, max_tokens, pad_to_multiple_of,
                     cast_lm_head_to_fp32, images=None):
    """:func:`per_token_logps_and_entropies`, and the packs it ran (none when it ran the
    batch in parts)."""
    mask = attention_mask.bool()
    S = mask.shape[1]
    # TRL's column c of row b holds the row's (number of real tokens before c)-th token
    columns = (mask.cumsum(-1) - 1)[:, S - logits_to_keep:]
    keep = mask[:, S - logits_to_keep:]
    sequences = [ids[m] for ids, m in zip(input_ids, mask)]
    keys = None if images is None else images.keys
    oversize = max_tokens is not None and max(len(q) for q in sequences) > max_tokens
    planned = None if max_tokens is None or oversize else plan(
        sequences, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of,
        pair_cost=hf.pair_cost(model), device=input_ids.device, keys=keys)
    if _in_parts(planned, oversize, compute_aux_loss, pad_to_multiple_of, cast_lm_head_to_fp32):
        out = hf.logprobs_in_parts(model, sequences, max_tokens=max_tokens,
                                   temperature=temperature, entropy=compute_entropy,
                                   **({} if images is None else {"images": images}))
        return (take_columns(out.logprobs, columns, keep),
                take_columns(out.entropy, columns, keep) if compute_entropy else None, None, [])
    if max_tokens is None:
        packs = [TreePack.from_sequences(sequences, pad_to_multiple_of=pad_to_multiple_of,
                                         device=input_ids.device, keys=keys)]
    else:  # with a sequence over the budget, plan refuses it and says so
        packs = (planned or plan(sequences, max_tokens=max_tokens, keys=keys)).packs(0)
    width = int(mask.sum(-1).max())
    logps, entropies, router, seq_ids = [], [], [], []
    for pack in packs:
        extra = {} if images is None else {"images": images.select(pack.seq_ids)}
        if compute_aux_loss:
            extra["output_router_logits"] = True
        out = hf.logprobs(model, pack, entropy=compute_entropy, temperature=temperature,
                          backend=backend,
                          head_dtype=torch.float32 if cast_lm_head_to_fp32 else None, **extra)
        pad = width - out.logprobs.shape[1]  # every pack to the batch's longest row
        logps.append(torch.nn.functional.pad(out.logprobs, (0, pad)))
        if compute_entropy:
            entropies.append(torch.nn.functional.pad(out.entropy, (0, pad)))
        router.append(out.router_logits)
        seq_ids.append(pack.seq_ids)
    order = torch.cat(seq_ids).argsort()  # back to the trainer's row order
    out_logps = take_columns(torch.cat(logps)[order], columns, keep)
    out_ent = (take_columns(torch.cat(entropies)[order], columns, keep)
               if compute_entropy else None)
    aux_loss = hf.batch_router_aux_loss(model, packs, router) if compute_aux_loss else None
    return out_logps, out_ent, aux_loss, packs


def _in_parts(planned, oversize: bool, aux: bool, pad_to_multiple_of, fp32_head: bool) -> bool:
    """Whether a no-grad pass runs the batch in parts: a tree larger than the budget, which
    the plan (``planned``) splits and repeats, or a sequence longer than it (``oversize``).

    Only the no-grad passes (old and reference log-probs): the training pass's loss is
    TRL's, computed on the whole batch at once."""
    if not (oversize or planned is not None and planned.packed_rows > planned.min_rows):
        return False
    return not (torch.is_grad_enabled() or aux or pad_to_multiple_of or fp32_head)


class _MicroBatches(NamedTuple):
    """How the packed trainer orders a generation batch before TRL cuts it into
    ``steps_per_generation`` micro-batches (:func:`_plan_micro_batches`)."""

    whole_groups: bool  # deal whole groups (shuffle_whole_groups); False: TRL's own shuffle
    parts_per_step: int  # consecutive micro-batches that one optimizer step applies
    entropy_per_row: bool  # carry each row's stock micro-batch tokens for the entropy bonus
    kept_because: tuple[str, ...]  # why TRL's own micro-batches are kept (whole_groups False)


class _Settings(NamedTuple):
    """How a patched trainer packs (:func:`patch`'s keyword arguments) and orders its
    micro-batches."""

    backend: str
    max_tokens: int | None
    pad_to_multiple_of: int | None
    micro_batches: _MicroBatches


# the key of inputs that holds, per row, the completion tokens of the micro-batch stock TRL
# would have put the row in (its entropy bonus's denominator)
_STOCK_TOKENS = "treepack_stock_micro_batch_tokens"
_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "num_images")


@profiling_decorator  # TRL's timer of the method this replaces, under the same name
def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                       batch_size=None, compute_entropy=False,
                                       compute_aux_loss=False, **extra):
    """TRL's seam, packed (:func:`per_token_logps_and_entropies`); ``batch_size`` (TRL's chunk
    of rows for the no-grad passes) bounds each pack to the tokens of one of TRL's chunks."""
    images = {k: extra.pop(k, None) for k in _IMAGE_KEYS}
    extra.pop("mm_token_type_ids", None)  # the model's own rope index is computed from the ids
    _image_types(model, input_ids, attention_mask, extra.pop("token_type_ids", None))
    unsupported = sorted(k for k, v in extra.items() if v is not None)
    if unsupported:
        raise NotImplementedError(
            f"treepack's GRPO seam packs text and the images of treepack.hf.Images "
            f"(pixel_values, image_grid_thw); this batch has {unsupported}. Use the stock "
            "GRPOTrainer for this model's inputs"
        )
    settings: _Settings = self._treepack
    max_tokens = settings.max_tokens
    if max_tokens is None and batch_size is not None and batch_size < len(input_ids):
        max_tokens = batch_size * input_ids.shape[1]  # at most what one of TRL's chunks holds
    hf.prepare(model)  # the trainer may hand over a model patch() has not seen (a wrapper)
    images = _images(model, input_ids, attention_mask, **images)
    with self.accelerator.autocast():
        logps, entropies, aux_loss, packs = _packed_forwards(
            model, input_ids, attention_mask, logits_to_keep,
            temperature=self.temperature, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, backend=settings.backend, max_tokens=max_tokens,
            pad_to_multiple_of=settings.pad_to_multiple_of,
            cast_lm_head_to_fp32=getattr(self.args, "cast_lm_head_to_fp32", False),
            images=images)
    if torch.is_grad_enabled() and getattr(self, "_treepack_in_loss", False):
        # the training forward, inside the trainer's own loss on every process: the step's
        # report ends in a collective (a call by hand, on one process, logs nothing)
        _log_sharing(self, input_ids, attention_mask, logits_to_keep, packs, images)
        captured = getattr(self, "_treepack_entropies", None)
        if captured is not None:  # _compute_loss corrects the entropy bonus with them
            captured.append(entropies)
    return logps, entropies, aux_loss


def _log_sharing(trainer, input_ids, attention_mask, logits_to_keep, packs,
                 images=None) -> None:
    """What packing saved in the training forwards, and where sharing was lost
    (:func:`treepack.sharing.report`): this micro-batch's sequences join its optimizer step's;
    at the step's last micro-batch the step's report (rows per micro-batch and pack, groups by
    identical prompt), summed over every process, logs ``treepack/token_ratio`` (packed rows /
    tokens), ``treepack/{ideal,achievable,achieved}_ratio`` (each process's step as one
    forest; as computed) and ``treepack/lost_rows/{across_micro_batches,split_and_repeat}``."""
    step = getattr(trainer, "_treepack_step", None)
    if step is None:
        step = trainer._treepack_step = {"sequences": [], "keys": [], "prompts": [],
                                         "micro": [], "packs": [], "count": 0}
    mask = attention_mask.bool().cpu()
    sequences = unpadded(input_ids, mask, "input_ids", "attention_mask")
    step["sequences"] += sequences
    # a token is its (id, image) pair, as in the packs
    step["keys"] += (list(images.keys) if images is not None else
                     [np.zeros(len(q), dtype=np.int64) for q in sequences])
    step["prompts"] += mask[:, :mask.shape[1] - logits_to_keep].sum(-1).tolist()
    pack_of = np.zeros(len(mask), dtype=np.int64)
    for j, pack in enumerate(packs):
        pack_of[pack.seq_ids.cpu().numpy()] = j
    step["micro"] += [step["count"]] * len(mask)
    step["packs"] += pack_of.tolist()
    step["count"] += 1
    if not trainer.accelerator.sync_gradients:
        return
    trainer._treepack_step = None
    lost = sharing.report(step["sequences"], prompt_lengths=step["prompts"],
                          micro_batches=step["micro"], packs=step["packs"], keys=step["keys"])
    # every process runs each micro-batch's training forward, so all of them meet here
    counts = trainer.accelerator.reduce(
        torch.tensor(lost.counts(), device=trainer.accelerator.device), reduction="sum")
    metrics = sharing.metrics_from_counts(counts.tolist(), lost.measured)
    metrics["treepack/token_ratio"] = metrics["treepack/achieved_ratio"]
    for name, value in metrics.items():
        trainer._metrics["train"][name].append(value)


def _prepare_inputs(self, generation_batch):
    """TRL's ``_prepare_inputs``, whose shuffle before the split into ``steps_per_generation``
    micro-batches moves whole groups (:func:`shuffle_whole_groups`) instead of rows, each row
    kept in its optimizer step; TRL's own shuffle where an option needs TRL's micro-batches
    (:func:`_plan_micro_batches`)."""
    plan: _MicroBatches = self._treepack.micro_batches
    if not plan.whole_groups:
        return self._treepack_prepare_inputs(generation_batch)
    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = functools.partial(
        _shuffle, parts=self.args.steps_per_generation, parts_per_step=plan.parts_per_step,
        stock_tokens=plan.entropy_per_row)
    try:  # only for this call: nothing else sees the change
        return self._treepack_prepare_inputs(generation_batch)
    finally:
        grpo_trainer.shuffle_sequence_dict = original


def _compute_loss(self, model, inputs):
    """TRL's ``_compute_loss``, with its entropy bonus taken over the micro-batches TRL would
    have cut.

    TRL's bonus is ``entropy_coef`` x a micro-batch's summed completion entropy / its
    completion tokens (/ the accumulation steps). A packed micro-batch holds other rows than
    TRL's, so each row's entropy is moved from this micro-batch's mean into the mean over the
    micro-batch TRL would have put it in (its tokens in ``inputs[_STOCK_TOKENS]``, from the
    shuffle): the bonus, in value and gradient, is TRL's. Without that key (no bonus, TRL's own
    micro-batches, evaluation) this is TRL's method unchanged."""
    stock_tokens = inputs.get(_STOCK_TOKENS)
    self._treepack_in_loss = self.model.training  # the seam logs the step's sharing
    try:
        if stock_tokens is None or not self.model.training:
            return self._treepack_compute_loss(model, inputs)
        coef = _entropy_coef_applied(self)  # before TRL's adaptive controller moves it
        self._treepack_entropies = captured = []
        try:
            loss = self._treepack_compute_loss(model, inputs)
        finally:
            self._treepack_entropies = None
    finally:
        self._treepack_in_loss = False
    (entropies,) = captured  # [B, K], from the seam's training forward
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    per_row = (entropies * mask).sum(-1)  # [B]
    here = per_row.sum() / mask.sum().clamp(min=1.0)  # what TRL's bonus averaged
    stock = (per_row / stock_tokens.clamp(min=1.0)).sum()  # what stock TRL's micro-batches do
    return loss - coef * (stock - here) / self.current_gradient_accumulation_steps


def _entropy_coef_applied(trainer) -> float:
    """The coefficient TRL's entropy bonus applies in this micro-batch: ``entropy_coef``, or
    with ``use_adaptive_entropy`` 0 while the last step's entropy is above ``entropy_target``
    (TRL 1.16 ``_compute_loss``; read before it updates the coefficient at a step's end)."""
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


class _Order(NamedTuple):
    """A whole-group order of a batch (:func:`_whole_group_order`)."""

    permutation: Tensor  # [B] the batch's row at each new position
    stock_position: Tensor  # [B] where TRL's own shuffle puts that row


def _whole_group_order(batch: dict, parts: int, parts_per_step: int | None) -> _Order:
    """:func:`shuffle_whole_groups`'s order, and where stock TRL puts each row."""
    size = len(next(v for v in batch.values() if v is not None and
                    not (isinstance(v, Tensor) and v.ndim == 0)))
    parts_per_step = parts if parts_per_step is None else parts_per_step
    if parts % parts_per_step or size % parts:
        raise ValueError(f"{size} rows in parts={parts} of parts_per_step={parts_per_step}: "
                         "parts must be a multiple of parts_per_step and divide the rows (TRL's "
                         "steps_per_generation and gradient_accumulation_steps when it divides it)")
    permutation = torch.randperm(size)  # the draw stock TRL makes: its order of the rows
    prompts = (batch["prompt_ids"] * batch["prompt_mask"]).cpu()
    if batch.get("pixel_values") is not None:  # the same text on other images: another group
        prompts = torch.cat((prompts, _image_keys(batch)), dim=1)
    group = torch.unique(prompts, dim=0, return_inverse=True)[1]
    group = group[permutation]  # rows in TRL's order
    # a row stays in the optimizer step its place in TRL's order gives it; inside a step each
    # group is labelled by its first row in that order: a random order of groups
    rows_per_step = size // parts * parts_per_step
    key = torch.arange(size) // rows_per_step * (int(group.max()) + 1) + group
    first = torch.full((int(key.max()) + 1,), size).scatter_reduce(
        0, key, torch.arange(size), reduce="amin")
    label = first[key].numpy()
    order = np.concatenate([
        start + keep_groups_together(label[start:start + rows_per_step], np.ones(rows_per_step),
                                     parts_per_step).order
        for start in range(0, size, rows_per_step)])
    order = torch.from_numpy(order)
    return _Order(permutation[order], order)


def _image_keys(batch: dict) -> Tensor:
    """``[B, 1]``: a content key of each row's images (TRL splits ``pixel_values`` into one
    tensor per row before its shuffle), so rows group by prompt text and images."""
    pixels, grids = batch["pixel_values"], batch.get("image_grid_thw")
    if isinstance(pixels, Tensor):  # one tensor for the batch: split it by row
        counts = [int(c) for c in batch["num_images"]]
        if grids is None:  # one [C, H, W] tensor an image (LLaVA)
            pixels = torch.split(pixels, counts)
        else:  # one row a patch: each row's grids give its patches
            rows = torch.split(grids.prod(-1).cpu(), counts)
            pixels = torch.split(pixels, [int(r.sum()) for r in rows])
    grids = [np.zeros(0, np.int64)] * len(pixels) if not isinstance(grids, (list, tuple)) \
        else [np.asarray(g.cpu() if isinstance(g, Tensor) else g, dtype=np.int64) for g in grids]
    keys = [image_content_key(p, g) for p, g in zip(pixels, grids)]
    return torch.tensor(keys, dtype=torch.long)[:, None]


def _permute(batch: dict, permutation: Tensor) -> dict:
    """Every sequence of ``batch`` (tensors, lists) in ``permutation``'s order; scalars kept."""
    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.ndim == 0):
            return v
        if isinstance(v, Tensor):
            return v[permutation.to(v.device)]
        return [v[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


def _shuffle(batch: dict, *, parts: int, parts_per_step: int, stock_tokens: bool) -> dict:
    """:func:`shuffle_whole_groups`, and with ``stock_tokens`` each row's ``_STOCK_TOKENS``:
    the completion tokens (TRL's loss mask) of the micro-batch stock TRL would have put it in."""
    order = _whole_group_order(batch, parts, parts_per_step)
    out = _permute(batch, order.permutation)
    if stock_tokens:
        mask = out["completion_mask"]
        if out.get("tool_mask") is not None:
            mask = mask * out["tool_mask"]
        tokens = mask.sum(-1).float()  # [B], in the new order
        stock_part = (order.stock_position // (len(tokens) // parts)).to(tokens.device)
        per_part = torch.zeros(parts, device=tokens.device).index_add_(0, stock_part, tokens)
        out[_STOCK_TOKENS] = per_part[stock_part]
    return out


def shuffle_whole_groups(batch: dict, parts: int = 1, *,
                         parts_per_step: int | None = None) -> dict:
    """TRL's ``shuffle_sequence_dict`` moving whole groups: rows with the same prompt (the
    ``num_generations`` completions of one prompt) stay together in one of the ``parts``
    contiguous micro-batches TRL then cuts (where sizes allow; :func:`treepack.groups.
    keep_groups_together`), in a random order of groups and of rows inside a group.

    It draws the one ``torch.randperm`` TRL's shuffle draws, so the random stream, and with it
    every later sampling, is the same as stock TRL's. Rows move only between the micro-batches
    of one optimizer step (``parts_per_step`` consecutive parts): each row is applied in the
    optimizer step stock TRL's shuffle puts it in, so whatever TRL averages per row or over the
    step is unchanged; only which rows share a micro-batch differs.

    Args:
        batch: TRL's generation batch: ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` and other
            sequences of ``B`` rows (tensors, lists) or scalars.
        parts: the micro-batches it is cut into next (``steps_per_generation``).
        parts_per_step: how many consecutive parts one optimizer step applies
            (``gradient_accumulation_steps`` where it divides ``steps_per_generation``);
            default ``parts``: all of them.

    Returns:
        The batch with every sequence reordered alike.

    Raises:
        KeyError: no ``prompt_ids`` / ``prompt_mask``.
        ValueError: ``parts`` not a multiple of ``parts_per_step``, or not dividing the rows.

    Example:
        >>> import torch
        >>> prompts = torch.tensor([[5, 6], [7, 8], [5, 6], [7, 8]])
        >>> batch = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts),
        ...          "row": torch.arange(4)}
        >>> out = shuffle_whole_groups(batch, parts=2)
        >>> [part.unique(dim=0).shape[0] for part in out["prompt_ids"].split(2)]
        [1, 1]
    """
    return _permute(batch, _whole_group_order(batch, parts, parts_per_step).permutation)


def _plan_micro_batches(trainer) -> _MicroBatches:
    """Whether the packed trainer may deal whole groups to TRL's micro-batches and stay equal
    to stock TRL, and what it must carry for that.

    TRL's loss per micro-batch is a sum of per-row terms with weights that do not depend on
    which rows share the micro-batch for ``grpo``, ``sapo``, ``dr_grpo``, ``luspo`` (a mean
    over the fixed ``per_device_train_batch_size`` rows), ``dapo``, ``cispo``, ``vespo`` (over
    the whole batch's tokens), the KL term, sequence-level importance sampling, ``delta`` and
    the off-policy mask (per row): moving rows between micro-batches of one optimizer step
    changes none of them. The entropy bonus is a token mean per micro-batch: corrected per row
    (:func:`_compute_loss`). ``bnpo`` (each micro-batch's loss over its own tokens, inside TRL's
    clipped objective), ``top_entropy_quantile`` (a threshold over the micro-batch's entropies
    on every process) and the router load-balancing loss (over the micro-batch's tokens) depend
    on the micro-batch as a whole: with them TRL's own micro-batches are kept, as they are when
    an optimizer step's micro-batches do not line up with a generation batch's."""
    args = trainer.args
    parts, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
    if parts % accumulation == 0:
        per_step = accumulation  # several optimizer steps per generation batch
    elif accumulation % parts == 0:
        per_step = parts  # one step applies whole generation batches
    else:
        per_step = None
    kept = []
    if parts > 1:  # one micro-batch per generation batch: every order gives TRL's micro-batch
        if trainer.loss_type == "bnpo":
            kept.append("loss_type='bnpo' divides each micro-batch's loss by that micro-batch's "
                        "completion tokens")
        if trainer.top_entropy_quantile < 1.0:
            kept.append(f"top_entropy_quantile={trainer.top_entropy_quantile} takes its entropy "
                        "threshold over each micro-batch's tokens (on every process)")
        if getattr(trainer, "aux_loss_enabled", False):
            kept.append("the router load-balancing loss (router_aux_loss_coef="
                        f"{trainer.router_aux_loss_coef}) is computed over each micro-batch's "
                        "tokens")
        if per_step is None:
            kept.append(f"steps_per_generation={parts} and gradient_accumulation_steps="
                        f"{accumulation} do not divide one another, so an optimizer step's "
                        "micro-batches do not line up with a generation batch's")
    bonus = trainer.entropy_coef != 0.0 or getattr(trainer, "use_adaptive_entropy", False)
    whole = not kept
    return _MicroBatches(whole_groups=whole, parts_per_step=per_step or parts,
                         entropy_per_row=whole and bonus and (per_step or parts) > 1,
                         kept_because=tuple(kept))


def patch(trainer: GRPOTrainer, *, backend: str = "auto", max_tokens: int | None = None,
          pad_to_multiple_of: int | None = None) -> GRPOTrainer:
    """Make ``trainer`` compute per-token log-probs from packed forwards.

    The trainer's models (policy and reference; a PEFT model too) are prepared with
    :func:`treepack.hf.prepare`: their ordinary batches (generation) run as before. The
    shuffle before TRL splits a generation batch into ``steps_per_generation`` micro-batches
    moves whole groups (:func:`shuffle_whole_groups`), so a micro-batch holds whole groups,
    each row in the optimizer step stock TRL gives it, and TRL's entropy bonus is taken over
    the micro-batch stock TRL would have put each row in. With ``loss_type="bnpo"``,
    ``top_entropy_quantile < 1``, a router load-balancing loss, or ``steps_per_generation`` and
    ``gradient_accumulation_steps`` that do not divide one another, TRL's own micro-batches are
    kept (these depend on all of a micro-batch's rows) and a warning says so. Every option then
    trains as stock TRL does. The no-grad passes (old and reference log-probs) pack at most as
    many tokens per forward as one of TRL's chunks of ``per_device_train_batch_size`` rows.
    Each optimizer step logs ``treepack/token_ratio`` (packed rows / tokens of its training
    forwards, summed over its micro-batches and processes) with TRL's metrics, and where it
    lost sharing (``treepack/{ideal,achievable,achieved}_ratio``, ``treepack/lost_rows/*``:
    :func:`treepack.sharing.report`); a warning says where the sizes split groups.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or a subclass that keeps TRL's
            ``_get_per_token_logps_and_entropies``).
        backend: the attention backend (default ``"auto"``).
        max_tokens: rows of one forward (the batch is planned into several packs); by
            default the whole batch is one pack, and a no-grad pass one of TRL's chunks.
        pad_to_multiple_of: pad each pack's rows to a multiple of this.

    Returns:
        ``trainer`` itself.

    Raises:
        TypeError: not a GRPOTrainer, or a subclass that overrides
            ``_get_per_token_logps_and_entropies`` (treepack would replace the override).
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    own = type(trainer)._get_per_token_logps_and_entropies
    if own not in (GRPOTrainer._get_per_token_logps_and_entropies,
                   _get_per_token_logps_and_entropies):
        raise TypeError(
            f"{type(trainer).__name__} overrides _get_per_token_logps_and_entropies, which "
            "treepack.trl.patch replaces: move your change elsewhere (e.g. into compute_loss), "
            "or subclass TreepackGRPOTrainer and call its method from yours")
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            hf.prepare(model)
    plan = _plan_micro_batches(trainer)
    trainer._treepack = _Settings(backend, max_tokens, pad_to_multiple_of, plan)
    if own is GRPOTrainer._get_per_token_logps_and_entropies:  # an instance of plain TRL
        trainer._get_per_token_logps_and_entropies = types.MethodType(
            _get_per_token_logps_and_entropies, trainer)
    if "_treepack_prepare_inputs" not in vars(trainer):
        trainer._treepack_prepare_inputs = trainer._prepare_inputs
        trainer._prepare_inputs = types.MethodType(_prepare_inputs, trainer)
        trainer._treepack_compute_loss = trainer._compute_loss
        trainer._compute_loss = types.MethodType(_compute_loss, trainer)
    _warn_if_groups_straddle_processes(trainer)
    _warn_if_groups_split_in_processes(trainer, plan)
    return trainer


def _warn_if_groups_straddle_processes(trainer) -> None:
    """TRL's RepeatSampler lays a prompt's ``num_generations`` rows side by side and each
    process takes ``per_device_train_batch_size x steps_per_generation`` consecutive rows: a
    group stays on one process only when that is a multiple of ``num_generations``."""
    args = trainer.args
    per_process = args.per_device_train_batch_size * args.steps_per_generation
    group = trainer.num_generations
    if trainer.accelerator.num_processes > 1 and per_process % group:
        warnings.warn(
            f"treepack: each of the {trainer.accelerator.num_processes} processes takes "
            f"per_device_train_batch_size x steps_per_generation = {per_process} rows, not a "
            f"multiple of num_generations = {group}, so some prompts' completions are split "
            "across processes and their prompt is computed once per process; make "
            f"per_device_train_batch_size x steps_per_generation a multiple of {group} "
            f"(e.g. per_device_train_batch_size={math.lcm(per_process, group) // args.steps_per_generation}"
            ") to pack every group whole", stacklevel=3)


def _warn_if_groups_split_in_processes(trainer, plan: _MicroBatches) -> None:
    """Where a process's generation batch is cut into micro-batches that cannot hold whole
    groups, a group's prompt is computed once per micro-batch it lands in: say why, once, with
    the setting that packs every group whole."""
    args = trainer.args
    parts, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
    rows, group = args.per_device_train_batch_size, trainer.num_generations
    if parts == 1:
        return
    one_step = (f"one micro-batch per optimizer step (gradient_accumulation_steps=1 and "
                f"per_device_train_batch_size={rows * accumulation}, the same batch)")
    split = (f"a group's {group} rows are spread over the {parts} micro-batches of a "
             "generation batch and its prompt is computed in each it lands in")
    if not plan.whole_groups:
        fix = one_step
        if trainer.loss_type == "bnpo" and len(plan.kept_because) == 1:
            fix += (" or loss_type='dapo' (normalised by the tokens of the whole batch, which "
                    "packs whole groups)")
        warnings.warn(f"treepack keeps TRL's own micro-batches, as stock TRL cuts them, "
                      f"because {'; '.join(plan.kept_because)}: so {split} (the run equals stock "
                      f"TRL's). To pack whole groups, use {fix}", stacklevel=3)
    elif plan.parts_per_step < parts:
        warnings.warn(
            f"treepack: steps_per_generation={parts} > gradient_accumulation_steps="
            f"{accumulation}: each optimizer step applies the rows stock TRL's shuffle deals to "
            f"its {accumulation} micro-batches, and treepack keeps them there to equal stock "
            f"TRL, so a group's rows are spread over the {parts // accumulation} optimizer "
            "steps of a generation batch and its prompt is computed in each; with "
            "steps_per_generation <= gradient_accumulation_steps every group stays whole",
            stacklevel=3)
    elif rows % group:
        whole = math.lcm(rows, group)
        same = (f" and gradient_accumulation_steps={accumulation * rows // whole}, the same "
                "batch" if accumulation * rows % whole == 0 else "")
        warnings.warn(
            f"treepack: per_device_train_batch_size={rows} is not a multiple of "
            f"num_generations={group}, so a micro-batch cannot hold whole groups: {split}; use "
            f"per_device_train_batch_size={whole}{same} to pack every group whole",
            stacklevel=3)


@contextlib.contextmanager
def _reference_from_object(model, config, peft_config):
    """TRL (``beta != 0``) loads its reference model from the policy config's
    ``_name_or_path``; a model built in memory has none, and TRL's load fails (``Repo id must
    use alphanumeric chars``). Inside this context that load returns a copy of the model
    object, taken before TRL touches it: the policy's starting weights, as a load of a saved
    checkpoint of it gives. A model with a path, a PEFT model (TRL disables the adapter
    instead) or ``beta == 0`` leave TRL as it is."""
    if (isinstance(model, str) or config is None or config.beta == 0.0 or peft_config is not None
            or is_peft_model(model) or get_config_model_id(model.config)):
        yield
        return
    reference = copy.deepcopy(model).eval()  # from_pretrained gives a model in eval mode
    original = grpo_trainer.create_model_from_path

    def create_model_from_path(model_id, *args, **kwargs):
        return reference if model_id == "" else original(model_id, *args, **kwargs)

    grpo_trainer.create_model_from_path = create_model_from_path
    try:  # only while TRL builds the trainer
        yield
    finally:
        grpo_trainer.create_model_from_path = original


class TreepackGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs come from packed forwards
    (:func:`patch`).

    Extra keyword arguments: ``treepack_backend`` ('auto', 'varlen', 'segment', 'flex', 'dense'),
    ``treepack_max_tokens`` (rows per forward; default: the whole batch in one pack) and
    ``treepack_pad_to_multiple_of``. A model object built in memory (no path in its config)
    works with ``beta > 0`` too: the reference model is a copy of it as given, where stock TRL
    cannot load one.
    """

    _get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies

    def __init__(self, *args, treepack_backend: str = "auto",
                 treepack_max_tokens: int | None = None,
                 treepack_pad_to_multiple_of: int | None = None, **kwargs):
        given = inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs)
        with _reference_from_object(given.arguments.get("model"), given.arguments.get("args"),
                                    given.arguments.get("peft_config")):
            super().__init__(*args, **kwargs)
        patch(self, backend=treepack_backend, max_tokens=treepack_max_tokens,
              pad_to_multiple_of=treepack_pad_to_multiple_of)
