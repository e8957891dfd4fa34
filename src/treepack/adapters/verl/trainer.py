"""verl's trainer: keep each prompt's rollouts on one data-parallel rank and in one mini-batch.

Every step, verl 0.9.1's trainers reorder the batch across data-parallel ranks by sequence
length alone (``_balance_batch``: Karmarkar-Karp with equal row counts, ``uid`` ignored), the
dispatch hands each rank a contiguous equal chunk, and each rank cuts its chunk into contiguous
mini-batches. The rollout.n rows of one prompt, which share the prompt as a prefix, are
scattered over ranks, and treepack, which merges shared prefixes inside one rank's forward,
loses most of its saving (256 prompts x 8 rollouts of 512-token prompts on 8 ranks: packed
rows / tokens 0.72 instead of 0.34; ``bench/verl_balance.py``).

:func:`install` replaces ``_balance_batch`` on verl's v1 ``PPOTrainer``
(``verl.trainer.ppo.v1.trainer_base``) and v0 ``RayPPOTrainer``
(``verl.trainer.ppo.ray_trainer``). When the trainer's config names treepack in
``actor_rollout_ref.model.external_lib`` (``treepack.verl`` or ``treepack.verl_lean``, alone or
in a list), the batch is ordered by :func:`treepack.groups.keep_groups_together`; otherwise
verl's own method runs unchanged. ``import treepack.verl`` installs it, and that import
happens in the trainer process before the first step: v1's ``PPOTrainer._setup`` calls
``_init_tokenizer``, which builds ``HFModelConfig`` from ``actor_rollout_ref.model``, whose
``__post_init__`` calls ``import_external_libs(external_lib)``; v0's ``TaskRunner.run`` builds
the same ``HFModelConfig`` before it creates the trainer. Nothing else is to set.

Kept from verl: v1's upsampling to a multiple of lcm(dp, mini-batch rows)
(``upsample_batch_to_divisible_size``), the workload of a row (``calculate_workload(seq_len)``),
``batch.reorder`` and the ``global_seqlen/*`` metrics of ``log_seqlen_unbalance``, so the
numbers users watch stay comparable. Added: ``treepack/groups_split_ranks`` and
``treepack/groups_split_minibatches``, the groups cut across ranks and across mini-batches,
and (v0, whose trainer holds the token ids) ``treepack/step/*``: where the step's sharing
was lost, in rows (:func:`treepack.sharing.report`).

- **Groups.** v1: the ``uid`` of the key ``{uid}_{session_id}_{index}``, so an agent
  session's several outputs stay with their prompt's group; padding rows (tag ``is_padding``)
  share one ``pad<hex>`` uid but are independent no-op rows, so each is a group of its own.
  v0: ``non_tensor_batch["uid"]``; a batch without it groups rows with identical ``prompts``.
- **Mini-batches.** A rank's rows are ordered for the actor's mini-batches of
  ``ppo_mini_batch_size x rollout.n / dp`` rows, contiguous as verl's ``train_mini_batch``
  cuts them while ``actor.shuffle`` is false (its default); where they do not divide a rank's
  rows, only ranks count (a critic with another mini-batch size cuts at its own boundaries).
  ``actor.shuffle=true`` shuffles a rank's rows first: groups stay whole per rank (the
  log-prob passes) but no order keeps them whole per mini-batch; a warning says so once.
- **Groups that do not fit.** A group larger than a rank's share fills whole ranks and its
  remainder is placed like a group; with unequal group sizes or a group count that does not
  divide the ranks, a group that finds no rank with room is cut over the ranks with the most
  room (the fewest pieces). The metrics count them.
- v0 skips verl's within-rank sort by workload for pipeline bubbles (as verl's own
  PrefixGrouper path does: it would scatter the groups again); verl's decoupled mode
  (``keep_minibatch=True``, which no verl 0.9.1 trainer passes) runs verl's method.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from treepack.planning import sharing
from treepack.planning.collation import unpadded
from treepack.planning.groups import GroupOrder, keep_groups_together

from treepack.adapters.verl.compat import (calculate_workload, log_seqlen_unbalance,
                                           ray_trainer, trainer_base)
from treepack.adapters.verl.log import say_once

__all__ = ["install", "uninstall", "TREEPACK_LIBS"]

TREEPACK_LIBS = ("treepack.verl", "treepack.verl_lean")


def install() -> None:
    """Put the group-keeping ``_balance_batch`` on verl's v1 and v0 trainers, verl's own kept
    as its ``__wrapped__``.

    :func:`treepack.adapters.verl.install` calls it (importing :mod:`treepack.verl` installs);
    installing twice wraps once. A trainer whose ``actor_rollout_ref.model.external_lib``
    names no treepack module still runs verl's own method, unchanged.
    """
    for cls, balance in _PATCHES:
        own = cls.__dict__["_balance_batch"]
        if own is not balance:
            balance.__wrapped__ = own
            cls._balance_batch = balance


def uninstall() -> None:
    """Give verl's trainers back their own ``_balance_batch``."""
    for cls, balance in _PATCHES:
        if cls.__dict__["_balance_batch"] is balance:
            cls._balance_batch = balance.__wrapped__


def _balance_v1(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """verl v1 ``PPOTrainer._balance_batch`` keeping GRPO groups whole (module docstring)."""
    if not _treepack_on(self.config):
        return _balance_v1.__wrapped__(self, batch, metrics, logging_prefix, keep_minibatch)
    dp = _dp_size(self.actor_rollout_wg)
    batch = trainer_base.upsample_batch_to_divisible_size(
        batch, self._get_required_batch_multiple(dp), self.tokenizer.eos_token_id)
    seqlen = torch.tensor([tag["seq_len"] for tag in batch.tags], dtype=torch.int64)
    groups = [key if tag.get("is_padding", False) else _uid_of_key(key)
              for key, tag in zip(batch.keys, batch.tags)]
    placed = _keep_groups(self.config, np.asarray(groups), seqlen, dp, metrics, logging_prefix)
    batch.reorder(placed.order.tolist())
    return batch


def _balance_v0(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """verl v0 ``RayPPOTrainer._balance_batch`` keeping GRPO groups whole (module docstring)."""
    if keep_minibatch or not _treepack_on(self.config):
        return _balance_v0.__wrapped__(self, batch, metrics, logging_prefix, keep_minibatch)
    mask = batch.batch["attention_mask"]
    seqlen = mask.view(mask.shape[0], -1).sum(-1)
    if "uid" in batch.non_tensor_batch:
        groups = np.asarray(batch.non_tensor_batch["uid"])
    else:  # the rollouts of one prompt carry the same (left-padded) prompt row
        groups = np.unique(batch.batch["prompts"].cpu().numpy(), axis=0,
                           return_inverse=True)[1].reshape(-1)
    dp = _dp_size(self.actor_rollout_wg)
    placed = _keep_groups(self.config, groups, seqlen, dp, metrics, logging_prefix)
    if "input_ids" in batch.batch.keys():  # groups by prompt row cannot have false forks
        _log_sharing(self.config, batch, groups if "uid" in batch.non_tensor_batch else None,
                     placed, dp, metrics, getattr(self, "processor", None))
    batch.reorder(torch.from_numpy(placed.order))


def _log_sharing(config, batch, groups, placed: GroupOrder, dp: int, metrics: dict,
                 processor=None) -> None:
    """Where the step's sharing was lost, as the trainer places its rows
    (:func:`treepack.sharing.report` with the ranks and mini-batches of ``placed``):
    ``treepack/step/{ideal,achievable,achieved}_ratio`` and ``treepack/step/lost_rows/*``,
    the rows cut across ranks and mini-batches among them (the workers' packs are theirs:
    ``treepack/lost_rows/split_and_repeat``). Rows with images are counted over (id, image)
    pairs, as the workers' packs are built (:func:`_image_keys`)."""
    mask = batch.batch["attention_mask"].bool().cpu().numpy()
    sequences = unpadded(batch.batch["input_ids"], mask, "input_ids", "attention_mask")
    keys = _image_keys(batch, sequences, processor)
    prompt_lengths = None
    if "prompts" in batch.batch.keys():
        prompt_lengths = mask[:, :batch.batch["prompts"].shape[1]].sum(1)
    position = np.empty(len(placed.order), dtype=np.int64)
    position[placed.order] = np.arange(len(placed.order))  # where each row goes
    per_rank = len(placed.order) // dp
    actor = config.actor_rollout_ref.actor
    minibatch = _minibatch_rows(actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n,
                                dp, per_rank)
    lost = sharing.report(sequences, groups=None if groups is None else list(groups),
                          prompt_lengths=prompt_lengths,
                          ranks=position // per_rank,
                          micro_batches=None if minibatch is None else
                          position % per_rank // minibatch, keys=keys)
    metrics.update(lost.metrics(prefix="treepack/step/"))


def _image_keys(batch, sequences, processor) -> list | None:
    """Per-token content keys of the rows' images (``multi_modal_inputs``: each row's
    ``pixel_values``, and ``image_grid_thw`` for Qwen-VL), keyed as the workers' packs key
    them; None for a batch without images. Without a processor that names its placeholder
    (``image_token_id``), or with rows whose placeholders do not match their images, the
    step's rows are counted over ids alone, and the log says so once."""
    rows = batch.non_tensor_batch.get("multi_modal_inputs")
    if rows is None or not any(r and "pixel_values" in r for r in rows):
        return None
    image_token_id = getattr(processor, "image_token_id", None)
    if image_token_id is None:
        say_once("treepack/step/* count rows with images over their token ids alone: the "
                  "trainer has no processor that names its image placeholder "
                  "(processor.image_token_id)")
        return None
    from treepack.adapters.hf.vision import placeholder_keys

    images = []
    for r in rows:
        pixels = (r or {}).get("pixel_values")
        if pixels is None:
            images.append([])
            continue
        grid = r.get("image_grid_thw")
        if grid is None:  # one [C, H, W] tensor per image
            images.append([(pixels[i:i + 1], None) for i in range(pixels.shape[0])])
        else:
            images.append(list(zip(torch.split(pixels, grid.prod(-1).tolist()), grid)))
    try:
        return placeholder_keys(sequences, int(image_token_id), images)
    except ValueError as e:
        say_once(f"treepack/step/* count rows with images over their token ids alone: {e}")
        return None


def _keep_groups(config, groups: np.ndarray, seqlen: torch.Tensor, dp: int, metrics: dict,
                 logging_prefix: str) -> GroupOrder:
    """The group-keeping order, verl's balance metrics and treepack's own."""
    actor = config.actor_rollout_ref.actor
    minibatch = _minibatch_rows(actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n,
                                dp, len(groups) // dp)
    placed = keep_groups_together(groups, calculate_workload(seqlen).numpy(), dp,
                                  rows_per_minibatch=minibatch)
    say_once(f"_balance_batch keeps each prompt's rows (uid) on one of {dp} data-parallel "
             f"ranks and in one mini-batch of {minibatch or len(groups) // dp} rows where "
             "sizes allow, ranks balanced by verl's calculate_workload (metrics "
             "treepack/groups_split_*)", level=logging.INFO)
    if actor.get("shuffle", False):
        say_once("actor.shuffle=true shuffles each rank's rows before verl cuts mini-batches, "
                 "so GRPO groups stay whole per rank but not per mini-batch; set "
                 "actor.shuffle=false to pack them whole")
    metrics.update(log_seqlen_unbalance(seqlen_list=seqlen.tolist(),
                                        partitions=placed.order.reshape(dp, -1).tolist(),
                                        prefix=logging_prefix))
    metrics["treepack/groups_split_ranks"] = placed.groups_split_across_parts
    metrics["treepack/groups_split_minibatches"] = placed.groups_split_across_minibatches
    return placed


def _treepack_on(config) -> bool:
    """Whether ``external_lib`` (one name or a list) names a treepack module."""
    libs = config.actor_rollout_ref.model.get("external_lib")
    libs = [libs] if libs is None or isinstance(libs, str) else list(libs)
    return any(lib in TREEPACK_LIBS for lib in libs)


def _dp_size(worker_group) -> int:
    """The actor's data-parallel size, read as verl's ``_balance_batch`` reads it."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


def _minibatch_rows(global_rows: int, dp: int, rows_per_rank: int) -> int | None:
    """Rows of one actor mini-batch on a rank, as ``train_mini_batch`` cuts them; None where
    they do not cut a rank's rows evenly (e.g. no actor update yet: critic warm-up)."""
    rows, rest = divmod(global_rows, dp)
    return rows if rows and not rest and rows_per_rank % rows == 0 else None


def _uid_of_key(key: str) -> str:
    """``{uid}_{session_id}_{index}`` -> uid (verl's own reading: ``key.rsplit("_", 2)``)."""
    parts = key.rsplit("_", 2)
    return parts[0] if len(parts) == 3 else key


# each trainer class and the method that replaces its _balance_batch
_PATCHES = ((trainer_base.PPOTrainer, _balance_v1), (ray_trainer.RayPPOTrainer, _balance_v0))
