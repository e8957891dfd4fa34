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
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.adapters import hf
from treepack.core.outputs import take_columns
from treepack.core.tree import TreePack
from treepack.planning.groups import keep_groups_together
from treepack.planning.planner import plan

try:
    from trl import GRPOTrainer
    from trl.extras.profiling import profiling_decorator
    from trl.trainer import grpo_trainer
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

    Returns:
        ``(logps [B, K], entropies [B, K] or None, aux_loss or None)``.

    Raises:
        As :func:`treepack.hf.forward` and :func:`treepack.logprobs_from_hidden`.
    """
    return _packed_forwards(model, input_ids, attention_mask, logits_to_keep,
                            temperature=temperature, compute_entropy=compute_entropy,
                            compute_aux_loss=compute_aux_loss, backend=backend,
                            max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of,
                            cast_lm_head_to_fp32=cast_lm_head_to_fp32)[:3]


def _packed_forwards(model, input_ids, attention_mask, logits_to_keep, *, temperature,
                     compute_entropy, compute_aux_loss, backend, max_tokens, pad_to_multiple_of,
                     cast_lm_head_to_fp32):
    """:func:`per_token_logps_and_entropies`, and the packs it ran (none when it ran the
    batch in parts)."""
    mask = attention_mask.bool()
    S = mask.shape[1]
    # TRL's column c of row b holds the row's (number of real tokens before c)-th token
    columns = (mask.cumsum(-1) - 1)[:, S - logits_to_keep:]
    keep = mask[:, S - logits_to_keep:]
    sequences = [ids[m] for ids, m in zip(input_ids, mask)]
    oversize = max_tokens is not None and max(len(q) for q in sequences) > max_tokens
    planned = None if max_tokens is None or oversize else plan(
        sequences, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of,
        pair_cost=hf.pair_cost(model), device=input_ids.device)
    if _in_parts(planned, oversize, compute_aux_loss, pad_to_multiple_of, cast_lm_head_to_fp32):
        out = hf.logprobs_in_parts(model, sequences, max_tokens=max_tokens,
                                   temperature=temperature, entropy=compute_entropy)
        return (take_columns(out.logprobs, columns, keep),
                take_columns(out.entropy, columns, keep) if compute_entropy else None, None, [])
    if max_tokens is None:
        packs = [TreePack.from_sequences(sequences, pad_to_multiple_of=pad_to_multiple_of,
                                         device=input_ids.device)]
    else:  # with a sequence over the budget, plan refuses it and says so
        packs = (planned or plan(sequences, max_tokens=max_tokens)).packs(0)
    width = int(mask.sum(-1).max())
    logps, entropies, router, seq_ids = [], [], [], []
    for pack in packs:
        out = hf.logprobs(model, pack, entropy=compute_entropy, temperature=temperature,
                          backend=backend,
                          head_dtype=torch.float32 if cast_lm_head_to_fp32 else None,
                          **({"output_router_logits": True} if compute_aux_loss else {}))
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


class _Settings(NamedTuple):
    """How a patched trainer packs (:func:`patch`'s keyword arguments)."""

    backend: str
    max_tokens: int | None
    pad_to_multiple_of: int | None


@profiling_decorator  # TRL's timer of the method this replaces, under the same name
def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                       batch_size=None, compute_entropy=False,
                                       compute_aux_loss=False, **extra):
    """TRL's seam, packed (:func:`per_token_logps_and_entropies`); ``batch_size`` (TRL's chunk
    of rows for the no-grad passes) bounds each pack to the tokens of one of TRL's chunks."""
    unsupported = sorted(k for k, v in extra.items() if v is not None)
    if unsupported:
        raise NotImplementedError(
            f"treepack's GRPO seam packs text only; this batch has {unsupported}. Use the stock "
            "GRPOTrainer for multimodal models"
        )
    settings: _Settings = self._treepack
    max_tokens = settings.max_tokens
    if max_tokens is None and batch_size is not None and batch_size < len(input_ids):
        max_tokens = batch_size * input_ids.shape[1]  # at most what one of TRL's chunks holds
    hf.prepare(model)  # the trainer may hand over a model patch() has not seen (a wrapper)
    with self.accelerator.autocast():
        logps, entropies, aux_loss, packs = _packed_forwards(
            model, input_ids, attention_mask, logits_to_keep,
            temperature=self.temperature, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, backend=settings.backend, max_tokens=max_tokens,
            pad_to_multiple_of=settings.pad_to_multiple_of,
            cast_lm_head_to_fp32=getattr(self.args, "cast_lm_head_to_fp32", False),
        )
    if torch.is_grad_enabled():  # the training forward: what packing saved there
        rows = sum(pack.num_packed_rows for pack in packs)
        tokens = sum(pack.num_original_tokens for pack in packs)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["treepack/token_ratio"].append(rows / max(tokens, 1))
    return logps, entropies, aux_loss


def _prepare_inputs(self, generation_batch):
    """TRL's ``_prepare_inputs``, whose shuffle before the split into ``steps_per_generation``
    micro-batches moves whole groups (:func:`shuffle_whole_groups`) instead of rows."""
    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = functools.partial(
        shuffle_whole_groups, parts=self.args.steps_per_generation)
    try:  # only for this call: nothing else sees the change
        return self._treepack_prepare_inputs(generation_batch)
    finally:
        grpo_trainer.shuffle_sequence_dict = original


def shuffle_whole_groups(batch: dict, parts: int = 1) -> dict:
    """TRL's ``shuffle_sequence_dict`` moving whole groups: rows with the same prompt (the
    ``num_generations`` completions of one prompt) stay together in one of the ``parts``
    contiguous micro-batches TRL then cuts (where sizes allow; :func:`treepack.groups.
    keep_groups_together`), in a random order of groups and of rows inside a group.

    It draws the one ``torch.randperm`` TRL's shuffle draws, so the random stream, and with it
    every later sampling, is the same as stock TRL's. The training objective is unchanged:
    which rows share a micro-batch was random and stays random, only the partition differs.

    Args:
        batch: TRL's generation batch: ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` and other
            sequences of ``B`` rows (tensors, lists) or scalars.
        parts: the micro-batches it is cut into next (``steps_per_generation``).

    Returns:
        The batch with every sequence reordered alike.

    Raises:
        KeyError: no ``prompt_ids`` / ``prompt_mask``.
    """
    size = len(next(v for v in batch.values() if v is not None and
                    not (isinstance(v, Tensor) and v.ndim == 0)))
    permutation = torch.randperm(size)  # the draw stock TRL makes
    prompts = batch["prompt_ids"] * batch["prompt_mask"]
    group = torch.unique(prompts.cpu(), dim=0, return_inverse=True)[1]
    group = group[permutation]  # rows in the random order
    # each group labelled by its first row in that order: a random order of groups
    first = torch.full((int(group.max()) + 1,), size).scatter_reduce(
        0, group, torch.arange(size), reduce="amin")
    order = keep_groups_together(first[group].numpy(), np.ones(size), parts).order
    permutation = permutation[torch.from_numpy(order)]

    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.ndim == 0):
            return v
        if isinstance(v, Tensor):
            return v[permutation.to(v.device)]
        return [v[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


def patch(trainer: GRPOTrainer, *, backend: str = "auto", max_tokens: int | None = None,
          pad_to_multiple_of: int | None = None) -> GRPOTrainer:
    """Make ``trainer`` compute per-token log-probs from packed forwards.

    The trainer's models (policy and reference; a PEFT model too) are prepared with
    :func:`treepack.hf.prepare`: their ordinary batches (generation) run as before. The
    shuffle before TRL splits a generation batch into ``steps_per_generation`` micro-batches
    moves whole groups (:func:`shuffle_whole_groups`), so a micro-batch holds whole groups.
    The no-grad passes (old and reference log-probs) pack at most as many tokens per forward
    as one of TRL's chunks of ``per_device_train_batch_size`` rows. Each training forward logs
    ``treepack/token_ratio`` (packed rows / tokens) with TRL's metrics.

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
    trainer._treepack = _Settings(backend, max_tokens, pad_to_multiple_of)
    if own is GRPOTrainer._get_per_token_logps_and_entropies:  # an instance of plain TRL
        trainer._get_per_token_logps_and_entropies = types.MethodType(
            _get_per_token_logps_and_entropies, trainer)
    if "_treepack_prepare_inputs" not in vars(trainer):
        trainer._treepack_prepare_inputs = trainer._prepare_inputs
        trainer._prepare_inputs = types.MethodType(_prepare_inputs, trainer)
    _warn_if_groups_straddle_processes(trainer)
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


class TreepackGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs come from packed forwards
    (:func:`patch`).

    Extra keyword arguments: ``treepack_backend`` ('auto', 'varlen', 'segment', 'flex', 'dense'),
    ``treepack_max_tokens`` (rows per forward; default: the whole batch in one pack) and
    ``treepack_pad_to_multiple_of``.
    """

    _get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies

    def __init__(self, *args, treepack_backend: str = "auto",
                 treepack_max_tokens: int | None = None,
                 treepack_pad_to_multiple_of: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        patch(self, backend=treepack_backend, max_tokens=treepack_max_tokens,
              pad_to_multiple_of=treepack_pad_to_multiple_of)
