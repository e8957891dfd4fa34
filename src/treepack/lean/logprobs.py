"""Log-probs from hidden states and the LM head, without the ``[T', V]`` logits.

Chunk by chunk over packed rows, the head's logits are computed, normalised and dropped, and
recomputed in backward (:class:`treepack.core.softmax.Head`), so memory is
O(chunk x V) plus the ``[V, H]`` weight gradient, whatever T'. The values are those of
``pack.token_logprobs(hidden @ weight.T + bias)``: both go through
:func:`treepack.core.outputs.token_outputs`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treepack.core import deprecation
from treepack.core.checks import floating, positive_finite, positive_int
from treepack.core.outputs import (ALIGNMENTS, RowLogprobs, TokenLogprobs, row_outputs,
                                   token_outputs)
from treepack.core.softmax import Head, default_chunk_size, head_logits
from treepack.core.tree import TreePack

__all__ = ["outputs_from_hidden", "logprobs_from_hidden", "logprobs_and_entropy_from_hidden",
           "token_logprobs", "token_entropy", "row_logprobs_from_hidden", "TokenLogprobs",
           "RowLogprobs", "head_logits", "ALIGNMENTS"]


def token_logprobs(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """``[s, p] = log p(seq_s[p] | seq_s[:p])`` from packed logits [T', V]: the function form
    of :meth:`TreePack.token_logprobs`."""
    return pack.token_logprobs(logits, temperature=temperature)


def token_entropy(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of each prediction's distribution: the function form of
    :meth:`TreePack.token_entropy`."""
    return pack.token_entropy(logits, temperature=temperature)


def outputs_from_hidden(
    pack: TreePack,
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    temperature=1.0,
    entropy: bool = False,
    align: str = "label",
    chunk_size: int | None = None,
    softcap: float | None = None,
    scale: float = 1.0,
) -> TokenLogprobs:
    """Log-probs (and entropies) of a pack from hidden states [T', H] and the LM head [V, H].

    The weight gradient is accumulated in one float32 buffer (on CUDA by cuBLAS directly,
    without a per-chunk [V, H] product). The matmul runs in the head's dtype (hidden states
    are cast to it), or under autocast in autocast's; the rest in float32 at least. Backward
    recomputes under the forward's autocast state, so its gradient is that of the computed
    forward.

    Args:
        pack: the pack the hidden states were computed on.
        hidden: [T', H] the input of the LM head (``hf.forward_hidden(...)
            .last_hidden_state[0]``).
        weight: [V, H] the LM head's weight; ``bias`` [V] its bias, if any.
        temperature: logits are divided by it: a finite number > 0, or one per sequence.
        entropy: also compute the entropy of each prediction's distribution.
        align: ``"label"`` (``[s, p]`` holds the log-prob of token p, as
            :meth:`TreePack.token_logprobs`) or ``"prediction"`` (verl's: of token p + 1);
            see :mod:`treepack.core.outputs`.
        chunk_size: rows per chunk; default
            :func:`~treepack.core.softmax.default_chunk_size` (1 GiB of float32 logits per
            chunk on CUDA, 64 MiB elsewhere).
        softcap, scale: what models do to logits after the head (Gemma 2's
            ``final_logit_softcapping``; Cohere's ``logit_scale``): logits are
            ``softcap(scale * (hidden @ weight.T + bias)) / temperature``; see
            :func:`treepack.hf.lm_head`. ``softcap`` None or 0: none.

    Returns:
        :class:`TokenLogprobs`, each tensor [N, L] (flat layout: [total]), 0 where nothing is
        predicted.

    Raises:
        ValueError: shapes, devices or dtypes that do not fit the pack, a token id beyond V,
            or a bad number (the message names it).
    """
    source = _head(pack, hidden, weight, bias, softcap, scale)
    return token_outputs(pack, source, temperature=temperature, entropy=entropy, align=align,
                         chunk_size=_chunk(chunk_size, weight, hidden))


def logprobs_from_hidden(pack: TreePack, hidden: Tensor, weight: Tensor, *,
                         with_entropy: bool = False, **head) -> Tensor:
    """Label-aligned log-probs [N, L] from hidden states [T', H] and the LM head weight [V, H]:
    :func:`outputs_from_hidden`'s ``logprobs``.

    Args:
        pack, hidden, weight: as :func:`outputs_from_hidden`.
        with_entropy: deprecated; use :func:`logprobs_and_entropy_from_hidden`.
        **head: ``bias``, ``temperature``, ``chunk_size``, ``softcap``, ``scale``, as
            :func:`outputs_from_hidden`.

    Returns:
        [N, L] log-probs (flat layout: [total]), 0 where :attr:`TreePack.prediction_mask` is
        False.

    Raises:
        As :func:`outputs_from_hidden`; TypeError for another keyword.
    """
    _head_keywords(head, "logprobs_from_hidden")
    if with_entropy:
        deprecation.warn("logprobs_from_hidden(..., with_entropy=True)",
                         "logprobs_and_entropy_from_hidden")
        return outputs_from_hidden(pack, hidden, weight, entropy=True, **head)
    return outputs_from_hidden(pack, hidden, weight, **head).logprobs


def logprobs_and_entropy_from_hidden(pack: TreePack, hidden: Tensor, weight: Tensor,
                                     **head) -> TokenLogprobs:
    """:func:`logprobs_from_hidden` and the entropy of each prediction's distribution, from
    the same chunks, in the same layout.

    Args:
        pack, hidden, weight: as :func:`outputs_from_hidden`.
        **head: ``bias``, ``temperature``, ``chunk_size``, ``softcap``, ``scale``, as
            :func:`outputs_from_hidden`.

    Returns:
        :class:`TokenLogprobs` ``(logprobs, entropy)``, each [N, L] (flat: [total]).

    Raises:
        As :func:`logprobs_from_hidden`.
    """
    _head_keywords(head, "logprobs_and_entropy_from_hidden")
    return outputs_from_hidden(pack, hidden, weight, entropy=True, **head)


def row_logprobs_from_hidden(pack: TreePack, hidden: Tensor, weight: Tensor, *,
                             with_entropy: bool = False, **head) -> RowLogprobs:
    """Deprecated: the lean head's values per packed row; use
    ``treepack.hf.logprobs(model, pack, head="inside")``, or
    :meth:`RowLogprobs.in_layout` on :func:`treepack.core.outputs.row_outputs`.

    Args:
        pack, hidden, weight: as :func:`outputs_from_hidden`.
        with_entropy: also compute the entropies.
        **head: as :func:`logprobs_from_hidden`.

    Returns:
        :class:`RowLogprobs` ``(logprobs [T'], entropy [T'] or None)``.

    Raises:
        As :func:`logprobs_from_hidden`.
    """
    deprecation.warn("row_logprobs_from_hidden", "treepack.hf.logprobs(model, pack, "
                     "head='inside')")
    return rows_from_hidden(pack, hidden, weight, entropy=with_entropy, **head)


def rows_from_hidden(pack: TreePack, hidden: Tensor, weight: Tensor, *, entropy: bool = False,
                     **head) -> RowLogprobs:
    """:func:`treepack.core.outputs.row_outputs` of hidden states and an LM head, checked (the
    lean head inside a model's forward, :func:`treepack.hf.logprobs` ``head="inside"``)."""
    _head_keywords(head, "rows_from_hidden")
    source = _head(pack, hidden, weight, head.get("bias"), head.get("softcap"),
                   head.get("scale", 1.0))
    return row_outputs(pack, source, temperature=head.get("temperature", 1.0), entropy=entropy,
                       chunk_size=_chunk(head.get("chunk_size"), weight, hidden))


def _head_keywords(head: dict, caller: str) -> None:
    unknown = set(head) - {"bias", "temperature", "chunk_size", "softcap", "scale"}
    if unknown:
        raise TypeError(f"{caller} got unknown keywords {sorted(unknown)}")


def _chunk(chunk_size, weight: Tensor, hidden: Tensor) -> int:
    if chunk_size is None:
        return default_chunk_size(weight.shape[0], hidden.device)
    return positive_int(chunk_size, "chunk_size", hint=" (rows per chunk)")


def _head(pack: TreePack, hidden: Tensor, weight: Tensor, bias, softcap, scale) -> Head:
    """The LM head as a source of logits, every argument checked against the pack."""
    if hidden.dim() != 2 or hidden.shape[0] != pack.num_rows:
        hint = "; for a model output [1, T', H] pass out.last_hidden_state[0]" if (
            hidden.dim() == 3 and hidden.shape[0] == 1) else ""
        raise ValueError(f"hidden must be [T'={pack.num_rows}, H], got {tuple(hidden.shape)}"
                         f"{hint}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}] (the LM head's), got "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
    pack.check_device(hidden, "hidden")
    pack.check_device(weight, "weight (the LM head)")
    floating(hidden, "hidden")
    floating(weight, "weight (the LM head)")
    if bias is not None:
        floating(bias, "bias")
    scale = positive_finite(scale, "scale") if scale != 1.0 else 1.0
    softcap = None if softcap in (None, 0) else positive_finite(
        softcap, "softcap", hint=" (or None / 0 for no soft-capping)")
    pack.check_vocabulary(weight.shape[0])
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(weight.dtype)  # the head's dtype decides (e.g. an fp32 LM head)
    return Head(hidden, weight, bias, scale=scale, softcap=softcap)

