"""TRL's log-prob seam, packed: ``GRPOTrainer._get_per_token_logps_and_entropies`` from one
packed forward per batch (or a plan's packs, or parts), and the sharing each training step
logs.

TRL calls the seam with each prompt + completion row (left-padded prompts, right-padded
completions) and expects ``[B, logits_to_keep]`` log-probs (and entropies) aligned with its
completion mask. Here the padding is stripped, the rows are merged into one prefix forest (or
planned into packs under ``max_tokens``), and the log-probs come from
:func:`treepack.hf.logprobs` with TRL's temperature.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from treepack.adapters import hf
from treepack.adapters.hf.vision import BIDIRECTIONAL_FAMILIES
from treepack.adapters.trl.compat import profiling_decorator
from treepack.core.outputs import take_columns
from treepack.core.tree import TreePack
from treepack.planning import sharing
from treepack.planning.collation import unpadded
from treepack.planning.planner import plan

# _get_per_token_logps_and_entropies keeps the name of the method it replaces: TRL's timer
# (profiling_decorator) reports it under that name
__all__ = ["per_token_logps_and_entropies", "_get_per_token_logps_and_entropies"]


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
    settings = self._treepack  # patch.Settings
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
