"""The trainer patch: :func:`patch` makes a ``trl.GRPOTrainer`` compute its per-token
log-probs from packed forwards (:mod:`.seam`), deal whole groups to its micro-batches
(:mod:`.shuffle`) and take its entropy bonus over the micro-batches stock TRL would have cut;
it warns, once, where the trainer's sizes split groups.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from typing import NamedTuple

from treepack.adapters import hf
from treepack.adapters.trl import compat
from treepack.adapters.trl.compat import GRPOTrainer, grpo_trainer
from treepack.adapters.trl.seam import _get_per_token_logps_and_entropies
from treepack.adapters.trl.shuffle import (STOCK_TOKENS, MicroBatches, plan_micro_batches,
                                           shuffle_in_step)

__all__ = ["patch", "Settings"]


class Settings(NamedTuple):
    """How a patched trainer packs (:func:`patch`'s keyword arguments) and orders its
    micro-batches."""

    backend: str
    max_tokens: int | None
    pad_to_multiple_of: int | None
    micro_batches: MicroBatches


def _prepare_inputs(self, generation_batch):
    """TRL's ``_prepare_inputs``, whose shuffle before the split into ``steps_per_generation``
    micro-batches moves whole groups (:func:`shuffle_whole_groups`) instead of rows, each row
    kept in its optimizer step; TRL's own shuffle where an option needs TRL's micro-batches
    (:func:`plan_micro_batches`)."""
    plan: MicroBatches = self._treepack.micro_batches
    if not plan.whole_groups:
        return self._treepack_prepare_inputs(generation_batch)
    original = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = functools.partial(
        shuffle_in_step, parts=self.args.steps_per_generation, parts_per_step=plan.parts_per_step,
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
    micro-batch TRL would have put it in (its tokens in ``inputs[STOCK_TOKENS]``, from the
    shuffle): the bonus, in value and gradient, is TRL's. Without that key (no bonus, TRL's own
    micro-batches, evaluation) this is TRL's method unchanged."""
    stock_tokens = inputs.get(STOCK_TOKENS)
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
    compat.check()
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
    plan = plan_micro_batches(trainer)
    trainer._treepack = Settings(backend, max_tokens, pad_to_multiple_of, plan)
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


def _warn_if_groups_split_in_processes(trainer, plan: MicroBatches) -> None:
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
