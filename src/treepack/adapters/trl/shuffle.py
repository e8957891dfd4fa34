"""The group-keeping shuffle: TRL's shuffle of a generation batch before it is cut into
``steps_per_generation`` micro-batches, moving whole groups instead of rows, each row kept in
the optimizer step stock TRL's shuffle gives it (:func:`shuffle_whole_groups`), and whether a
trainer's options allow it (:func:`plan_micro_batches`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.vision import content_key as image_content_key
from treepack.planning.groups import keep_groups_together

__all__ = ["shuffle_whole_groups", "shuffle_in_step", "plan_micro_batches", "MicroBatches",
           "STOCK_TOKENS"]


class MicroBatches(NamedTuple):
    """How the packed trainer orders a generation batch before TRL cuts it into
    ``steps_per_generation`` micro-batches (:func:`plan_micro_batches`)."""

    whole_groups: bool  # deal whole groups (shuffle_whole_groups); False: TRL's own shuffle
    parts_per_step: int  # consecutive micro-batches that one optimizer step applies
    entropy_per_row: bool  # carry each row's stock micro-batch tokens for the entropy bonus
    kept_because: tuple[str, ...]  # why TRL's own micro-batches are kept (whole_groups False)


# the key of inputs that holds, per row, the completion tokens of the micro-batch stock TRL
# would have put the row in (its entropy bonus's denominator)
STOCK_TOKENS = "treepack_stock_micro_batch_tokens"


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


def shuffle_in_step(batch: dict, *, parts: int, parts_per_step: int,
                    stock_tokens: bool) -> dict:
    """:func:`shuffle_whole_groups`, and with ``stock_tokens`` each row's ``STOCK_TOKENS``:
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
        out[STOCK_TOKENS] = per_part[stock_part]
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


def plan_micro_batches(trainer) -> MicroBatches:
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
    return MicroBatches(whole_groups=whole, parts_per_step=per_step or parts,
                         entropy_per_row=whole and bonus and (per_step or parts) > 1,
                         kept_because=tuple(kept))
