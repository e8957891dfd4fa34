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

import treepack
from treepack import hf

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
    """``(logps [B, K], entropies [B, K] or None, aux_loss or None)`` for TRL's layout.

    Column ``j`` of row ``b`` is the log-prob of ``input_ids[b, S - K + j]`` given everything
    before it in that row (``K = logits_to_keep``); padding positions hold 0.
    """
    B, S = input_ids.shape
    mask = attention_mask.bool()
    sequences = [ids[m] for ids, m in zip(input_ids, mask)]
    if max_tokens is None:
        packs = [treepack.TreePack.from_sequences(sequences, pad_to_multiple_of=pad_to_multiple_of,
                                                  device=input_ids.device)]
    else:
        packs = treepack.plan(sequences, max_tokens=max_tokens,
                              pad_to_multiple_of=pad_to_multiple_of,
                              device=input_ids.device).packs(0)
    head = hf.lm_head(model)
    width = int(mask.sum(-1).max())
    dtype = torch.float32 if cast_lm_head_to_fp32 else None
    logps = []
    entropies = []
    aux = []
    seq_ids = []
    for pack in packs:
        out = hf.forward(model, pack, backend, return_hidden=True,
                         **({"output_router_logits": True} if compute_aux_loss else {}))
        hidden = out.last_hidden_state[0]
        kw = dict(head)
        if dtype is not None:
            hidden = hidden.to(dtype)
            kw.update(weight=kw["weight"].to(dtype),
                      bias=None if kw["bias"] is None else kw["bias"].to(dtype))
        res = treepack.logprobs_from_hidden(pack, hidden, temperature=temperature,
                                            with_entropy=compute_entropy, **kw)
        lp, ent = (res.logprobs, res.entropy) if compute_entropy else (res, None)
        pad = width - lp.shape[1]
        logps.append(torch.nn.functional.pad(lp, (0, pad)))
        if ent is not None:
            entropies.append(torch.nn.functional.pad(ent, (0, pad)))
        if compute_aux_loss:
            aux.append(out.router_logits)
        seq_ids.append(pack.seq_ids)
    order = torch.cat(seq_ids).argsort()  # back to the trainer's row order
    logps = torch.cat(logps)[order]  # [B, width] label-aligned, padding stripped
    # Row b's token at input column c is its (number of real tokens before c)-th token.
    pos = (mask.cumsum(-1) - 1)[:, S - logits_to_keep:].clamp(min=0)  # [B, K]
    keep = mask[:, S - logits_to_keep:]
    zero = logps.new_zeros(())
    out_logps = torch.where(keep, logps.gather(1, pos), zero)
    out_ent = None
    if compute_entropy:
        out_ent = torch.where(keep, torch.cat(entropies)[order].gather(1, pos), zero)
    aux_loss = hf.router_aux_loss(model, packs, aux) if compute_aux_loss else None
    return out_logps, out_ent, aux_loss


def _seam(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
          compute_entropy=False, compute_aux_loss=False, *, backend, max_tokens,
          pad_to_multiple_of, **extra):
    unsupported = sorted(k for k, v in extra.items() if v is not None)
    if unsupported:
        raise NotImplementedError(
            f"treepack's GRPO seam packs text only; this batch has {unsupported}. Use the stock "
            "GRPOTrainer for multimodal models"
        )
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
    """Make ``trainer`` compute per-token log-probs from packed forwards; returns it.

    ``max_tokens`` bounds the rows of one forward (the batch is planned into several packs);
    by default the whole batch is one pack.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch expects a trl.GRPOTrainer, got {type(trainer).__name__}")
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
