"""SFT and policy-gradient losses on the original ``[N, L]`` layout, with original semantics.

Everything here takes per-occurrence tensors in the label-aligned layout that
:meth:`TreePack.token_logprobs` returns (``logps[s, p] = log p(seq_s[p] | seq_s[:p])``) and a
``mask`` of the predictions that count. Per-occurrence inputs (advantages, old and reference
log-probs, weights) stay in that layout too, so nothing is ever averaged across the
occurrences of a shared row before a nonlinear loss: each occurrence gets its own ratio, clip
and advantage, and the gradients of all occurrences meet in the shared row by the chain rule.

Denominators decide what "mean" means. Within one pack they default to the pack's own counts;
for a step spread over several packs (gradient accumulation) and data-parallel ranks, compute
them once with :func:`global_denominators` and pass them to every call, and the sum of the
per-pack losses is exactly the loss of the single unpacked batch (and DDP/FSDP's gradient
averaging is undone by ``world_size``).

Aggregation modes (as in verl):

``token-mean``               sum over every masked token / number of masked tokens
``seq-mean-token-sum``       sum over tokens per sequence, mean over sequences
``seq-mean-token-mean``      mean over tokens per sequence, mean over sequences
``seq-mean-token-sum-norm``  sum over tokens per sequence, summed, / a constant ``norm_length``
                             (Dr. GRPO: the generation budget; never a padded width)

"Sequences" are those with at least one masked token.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from treepack.core.checks import positive_finite
from treepack.core.denominators import Denominators, global_denominators
from treepack.core.denominators import check_layout as _check

# Denominators and global_denominators live in treepack.denominators (core); re-exported here.
__all__ = ["MODES", "Denominators", "global_denominators", "aggregate",
           "sft_loss", "policy_loss", "PolicyLoss", "kl_penalty", "entropy_bonus"]

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean", *,
              denominators: Denominators | None = None,
              norm_length: float | None = None) -> Tensor:
    """Reduce per-token ``values`` at ``mask`` to a scalar loss (see the modes above).

    Args:
        values: [N, L] per-token losses in a dense pack's layout.
        mask: [N, L] bool, the predictions that count.
        mode: one of :data:`MODES`.
        denominators: the step's counts (:func:`global_denominators`); default: this
            mask's own.
        norm_length: the constant of ``seq-mean-token-sum-norm``.

    Returns:
        A scalar tensor, multiplied by ``denominators.world_size`` (undoing DDP / FSDP
        gradient averaging).

    Raises:
        ValueError / TypeError: shapes that differ, a non-bool mask, an unknown mode, or a
            missing / non-positive ``norm_length``.
    """
    _check(values, mask)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    den = denominators or Denominators.of(mask)
    v = torch.where(mask, values, values.new_zeros(()))  # masked-out values never reach a sum
    if mode == "token-mean":
        total = v.sum() / max(den.tokens, 1.0)
    elif mode == "seq-mean-token-sum":
        total = v.sum() / max(den.sequences, 1.0)
    elif mode == "seq-mean-token-mean":
        per_seq = v.sum(-1) / mask.sum(-1).clamp(min=1)
        total = per_seq.sum() / max(den.sequences, 1.0)
    else:
        if norm_length is None:
            raise ValueError(
                "mode='seq-mean-token-sum-norm' divides by a constant length (Dr. GRPO: the "
                "generation budget); pass norm_length=... (a padded width would change with "
                "the packing)"
            )
        norm_length = positive_finite(norm_length, "norm_length",
                                      hint=" (the generation budget in tokens)")
        total = v.sum() / norm_length
    return total * den.world_size


def sft_loss(logps: Tensor, mask: Tensor, *, weights: Tensor | None = None,
             mode: str = "token-mean", denominators: Denominators | None = None,
             norm_length: float | None = None) -> Tensor:
    """Negative log-likelihood of the masked predictions.

    Args:
        logps: [N, L] log-probs (``pack.token_logprobs``).
        mask: [N, L] bool, the predictions that count.
        weights: optional, per token [N, L] or per sequence [N].
        mode, denominators, norm_length: as :func:`aggregate`.

    Returns:
        A scalar loss.

    Raises:
        ValueError / TypeError: as :func:`aggregate`, or weights of another shape.
    """
    nll = -logps
    if weights is not None:
        nll = nll * _per_token(weights, logps, "weights")
    return aggregate(nll, mask, mode, denominators=denominators, norm_length=norm_length)


def _per_token(x: Tensor, like: Tensor, name: str) -> Tensor:
    if x.dim() == 1 and x.shape[0] == like.shape[0]:
        return x[:, None]
    if x.shape != like.shape:
        raise ValueError(f"{name} must be [N] (per sequence) or [N, L]={tuple(like.shape)} (per "
                         f"token), got {tuple(x.shape)}")
    return x


class PolicyLoss(NamedTuple):
    loss: Tensor  # scalar
    ratio: Tensor  # [N, L] importance ratio (sequence-level values for ratio="sequence")
    clip_fraction: Tensor  # share of masked tokens whose ratio was clipped
    dual_clip_fraction: Tensor  # share of masked tokens capped by the dual clip
    approx_kl: Tensor  # mean of old - new log-prob over masked tokens


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    mode: str = "token-mean",
    denominators: Denominators | None = None,
    norm_length: float | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate on every occurrence, aggregated with ``mode``.

    ``ratio = exp(logps - old_logps)`` per token, or with ``ratio="sequence"`` GSPO's
    sequence-level ratio ``exp(mean_t(logps - old_logps))`` (token form: its value on every
    token, its gradient through each token). Clipped to ``[1 - clip, 1 + clip_high]``
    (``clip_high`` defaults to ``clip``; DAPO's clip-higher sets it larger). ``dual_clip``
    (c > 1) caps the loss of negative advantages at ``-advantage * c``.

    Args:
        logps: [N, L] log-probs of the current policy.
        old_logps: [N, L] log-probs of the behaviour policy (detached).
        advantages: [N] per sequence or [N, L] per token, never averaged across sequences
            sharing a row.
        mask: [N, L] bool, the predictions that count.
        clip, clip_high: finite numbers >= 0.
        dual_clip: None or a number > 1.
        ratio: ``"token"`` (PPO) or ``"sequence"`` (GSPO).
        mode, denominators, norm_length: as :func:`aggregate`.

    Returns:
        :class:`PolicyLoss`: the loss, the ratio, clip fractions and an approximate KL.

    Raises:
        ValueError / TypeError: shapes that differ, a bad clip, dual clip or ratio kind, or
            as :func:`aggregate`.
    """
    _check(logps, mask, "logps")
    _check(old_logps, mask, "old_logps")
    adv = _per_token(advantages, logps, "advantages")
    clip_high = clip if clip_high is None else clip_high
    for name, value in (("clip", clip), ("clip_high", clip_high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                0 <= value < math.inf):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (the ratio is "
                             "clipped to [1 - clip, 1 + clip_high], e.g. 0.2 and 0.28)")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip={dual_clip!r} must be > 1 (e.g. 3.0)")
    old_logps = old_logps.detach()
    log_ratio = (logps - old_logps).clamp(-20.0, 20.0)
    if ratio == "sequence":
        m = mask.to(log_ratio.dtype)
        seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # [N]
        log_ratio = (logps - logps.detach() + seq.detach()[:, None]).clamp(max=10.0)
    elif ratio != "token":
        raise ValueError(f"ratio={ratio!r}; choose 'token' (PPO) or 'sequence' (GSPO)")
    r = torch.exp(log_ratio)
    unclipped = -adv * r
    clipped = -adv * r.clamp(1.0 - clip, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    capped = torch.zeros_like(was_clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = dict(
            clip_fraction=(was_clipped & mask).sum() / n,
            dual_clip_fraction=(capped & mask).sum() / n,
            approx_kl=torch.where(mask, -(logps - old_logps), 0).sum() / n,
        )
    total = aggregate(loss, mask, mode, denominators=denominators, norm_length=norm_length)
    return PolicyLoss(loss=total, ratio=r, **stats)


def kl_penalty(logps: Tensor, ref_logps: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    ``k1 = logp - ref`` (unbiased, high variance), ``k2 = (logp - ref)^2 / 2``,
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative, low variance).
    Aggregate it with :func:`aggregate` and add ``beta *`` it to the loss.

    Args:
        logps: [N, L] log-probs of the policy.
        ref_logps: [N, L] log-probs of the reference model (detached).
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        [N, L] estimates.

    Raises:
        ValueError: shapes that differ, or an unknown kind.
    """
    if logps.shape != ref_logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and ref_logps {tuple(ref_logps.shape)} "
                         "must have the same [N, L] shape")
    diff = logps - ref_logps.detach()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    if kind == "k3":
        d = (-diff).clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1
    raise ValueError(f"kind={kind!r}; choose one of {KL_KINDS}")


def entropy_bonus(entropy: Tensor, mask: Tensor, mode: str = "token-mean", *,
                  denominators: Denominators | None = None,
                  norm_length: float | None = None) -> Tensor:
    """The aggregated entropy of the masked predictions; subtract ``coef *`` it from the loss.

    Args:
        entropy: [N, L] (``pack.token_entropy`` / ``logprobs_and_entropy_from_hidden``).
        mask, mode, denominators, norm_length: as :func:`aggregate`.

    Returns:
        A scalar.

    Raises:
        As :func:`aggregate`.
    """
    return aggregate(entropy, mask, mode, denominators=denominators, norm_length=norm_length)
