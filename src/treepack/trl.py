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
or, with ``max_tokens``, planned into several packs — and log-probs come from hidden states
without ``[T', V]`` logits, with TRL's temperature. Everything else in the trainer is TRL's own.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from treepack import hf
from treepack.logprobs import logprobs_and_entropy_from_hidden, logprobs_from_hidden
from treepack.planner import plan
from treepack.tree import TreePack

try:
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without trl
    raise ImportError("treepack.trl needs TRL: pip install trl") from e

__all__ = ["TreepackGRPOTrainer", "patch", "per_token_logps_and_entropies"]


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
    mask = attention_mask.bool()
    packs = _packs(input_ids, mask, max_tokens, pad_to_multiple_of)
    head = hf.lm_head(model)
    if cast_lm_head_to_fp32:
        head = {k: v if k not in ("weight", "bias") or v is None else v.float()
                for k, v in head.items()}
    width = int(mask.sum(-1).max())
    logps, entropies, router, seq_ids = [], [], [], []
    for pack in packs:
        out = hf.forward_hidden(model, pack, backend,
                                **({"output_router_logits": True} if compute_aux_loss else {}))
        hidden = out.last_hidden_state[0]
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        if compute_entropy:
            lp, ent = logprobs_and_entropy_from_hidden(pack, hidden, temperature=temperature,
                                                       **head)
        else:
            lp, ent = logprobs_from_hidden(pack, hidden, temperature=temperature, **head), None
        pad = width - lp.shape[1]  # every pack to the batch's longest row
        logps.append(torch.nn.functional.pad(lp, (0, pad)))
        if ent is not None:
            entropies.append(torch.nn.functional.pad(ent, (0, pad)))
        router.append(out.router_logits)
        seq_ids.append(pack.seq_ids)
    order = torch.cat(seq_ids).argsort()  # back to the trainer's row order
    out_logps = _completion_columns(torch.cat(logps)[order], mask, logits_to_keep)
    out_ent = (_completion_columns(torch.cat(entropies)[order], mask, logits_to_keep)
               if compute_entropy else None)
    aux_loss = hf.batch_router_aux_loss(model, packs, router) if compute_aux_loss else None
    return out_logps, out_ent, aux_loss


def _packs(input_ids: Tensor, mask: Tensor, max_tokens, pad_to_multiple_of) -> list[TreePack]:
    """The batch's rows, padding stripped, as one pack or planned into several."""
    sequences = [ids[m] for ids, m in zip(input_ids, mask)]
    if max_tokens is None:
        return [TreePack.from_sequences(sequences, pad_to_multiple_of=pad_to_multiple_of,
                                        device=input_ids.device)]
    return plan(sequences, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of,
                device=input_ids.device).packs(0)


def _completion_columns(values: Tensor, mask: Tensor, logits_to_keep: int) -> Tensor:
    """[B, width] label-aligned values (padding stripped) -> TRL's [B, K] columns: input
    column c of row b holds the row's (number of real tokens before c)-th token."""
    S = mask.shape[1]
    pos = (mask.cumsum(-1) - 1)[:, S - logits_to_keep:].clamp(min=0)  # [B, K]
    keep = mask[:, S - logits_to_keep:]
    return torch.where(keep, values.gather(1, pos), values.new_zeros(()))


def _seam(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
          compute_entropy=False, compute_aux_loss=False, *, backend, max_tokens,
          pad_to_multiple_of, **extra):
    unsupported = sorted(k for k, v in extra.items() if v is not None)
    if unsupported:
        raise NotImplementedError(
            f"treepack's GRPO seam packs text only; this batch has {unsupported}. Use the stock "
            "GRPOTrainer for multimodal models"
        )
    hf.prepare(model)  # the trainer may hand over a model patch() has not seen (a wrapper)
    with self.accelerator.autocast():
        return per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep,
            temperature=self.temperature, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, backend=backend, max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            cast_lm_head_to_fp32=getattr(self.args, "cast_lm_head_to_fp32", False),
        )


def patch(trainer: GRPOTrainer, *, backend: str = "auto", max_tokens: int | None = None,
          pad_to_multiple_of: int | None = None) -> GRPOTrainer:
    """Make ``trainer`` compute per-token log-probs from packed forwards.

    The trainer's models (policy and reference) are prepared with
    :func:`treepack.hf.prepare`: their ordinary batches (generation) run as before.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or subclass).
        backend: the attention backend (default ``"auto"``).
        max_tokens: rows of one forward (the batch is planned into several packs); by
            default the whole batch is one pack.
        pad_to_multiple_of: pad each pack's rows to a multiple of this.

    Returns:
        ``trainer`` itself.

    Raises:
        TypeError: not a GRPOTrainer.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            hf.prepare(model)
    seam = functools.partial(_seam, backend=backend, max_tokens=max_tokens,
                             pad_to_multiple_of=pad_to_multiple_of)
    trainer._get_per_token_logps_and_entropies = types.MethodType(seam, trainer)
    return trainer


class TreepackGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs come from packed forwards.

    Extra keyword arguments: ``treepack_backend`` ('auto', 'varlen', 'segment', 'flex', 'dense'),
    ``treepack_max_tokens`` (rows per forward; default: the whole batch in one pack) and
    ``treepack_pad_to_multiple_of``.
    """

    def __init__(self, *args, treepack_backend: str = "auto",
                 treepack_max_tokens: int | None = None,
                 treepack_pad_to_multiple_of: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        patch(self, backend=treepack_backend, max_tokens=treepack_max_tokens,
              pad_to_multiple_of=treepack_pad_to_multiple_of)
