"""TRL integration: GRPOTrainer's per-token log-probs from one packed forward.

    from treepack.trl import TreepackGRPOTrainer        # a GRPOTrainer, packed
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

TRL's asynchronous GRPO trainer (``trl.AsyncGRPOTrainer``; ``trl.experimental.async_grpo`` in
TRL 1.16) has its packed counterpart, imported on first use so that this module imports
without it::

    from treepack.trl import TreepackAsyncGRPOTrainer  # an AsyncGRPOTrainer, packed by treepack

(:mod:`.async_grpo`: one pack per process, exact forks, hybrids and attention sinks).

One module per job: :mod:`.seam` (the log-prob seam), :mod:`.shuffle` (the group-keeping
shuffle), :mod:`.patch` (:func:`patch`: the trainer patch), :mod:`.trainer`
(:class:`TreepackGRPOTrainer`), :mod:`.async_grpo` (``TreepackAsyncGRPOTrainer``), and
:mod:`.compat` (every TRL internal treepack touches, and the version it was written against).
"""

from treepack.adapters.trl.patch import patch
from treepack.adapters.trl.seam import per_token_logps_and_entropies
from treepack.adapters.trl.shuffle import shuffle_whole_groups
from treepack.adapters.trl.trainer import TreepackGRPOTrainer

__all__ = ["TreepackGRPOTrainer", "patch", "per_token_logps_and_entropies",
           "shuffle_whole_groups"]


def __getattr__(name: str):
    """``TreepackAsyncGRPOTrainer``, imported on first use: TRL's asynchronous trainer (and its
    dependencies) may be absent where the rest of this module works."""
    if name == "TreepackAsyncGRPOTrainer":
        from treepack.adapters.trl.async_grpo import TreepackAsyncGRPOTrainer

        return TreepackAsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
