"""The model over a pack: its output, its hidden states, or its log-probs.

:func:`logprobs` is the one way to get log-probs (and entropies) from a model on a pack; it
returns :class:`treepack.TokenLogprobs` whichever head computes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
from torch import Tensor

from treepack.adapters.hf import sequence_parallel as sp
from treepack.adapters.hf.head import (HEADS, check_head, head_after, head_refusal,
                                       head_weights, logit_transforms)
from treepack.adapters.hf.moe import router_aux_loss
from treepack.adapters.hf.packed import check_pack, packed_forward
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.core import deprecation
from treepack.core.compat import replaced
from treepack.core.outputs import (RowLogprobs, TokenLogprobs, from_logits,
                                   per_sequence_temperature)
from treepack.core.tree import TreePack
from treepack.lean.logprobs import outputs_from_hidden, rows_from_hidden

__all__ = ["logprobs", "forward", "forward_hidden", "forward_lean", "HiddenOutput", "HEADS",
           "inside_refusal"]


@dataclasses.dataclass
class HiddenOutput:
    """What :func:`forward` returns with ``return_hidden=True``."""

    last_hidden_state: Tensor  # [1, T', H]: the input of the LM head (after the final norm)
    aux_loss: Tensor | None = None  # MoE load-balancing loss of the original tokens
    router_logits: tuple | None = None


def forward(model, pack: TreePack, backend: str = "auto", *, return_hidden: bool = False,
            block_size: int = 128, **kwargs):
    """Run a prepared causal LM once over ``pack`` and return the model's output.

    The model sees ``pack.input_ids`` with depth ``position_ids`` and tree attention from
    ``backend``, without a cache. ``model`` may be wrapped (DDP, FSDP, ``torch.compile``):
    the call goes through the wrapper, so its gradient synchronisation runs as usual.

    Args:
        model: a transformers causal LM on which :func:`prepare` was called.
        pack: the :class:`~treepack.TreePack`, on the model's device.
        backend: ``"auto"`` (the default: FlashAttention varlen on a GPU where it applies,
            else flex, else segment), ``"varlen"``, ``"segment"``, ``"flex"`` or ``"dense"``;
            see :mod:`treepack.attention`.
        return_hidden: deprecated; use :func:`forward_hidden`.
        block_size: FlexAttention's block size (``flex`` only).
        **kwargs: passed to the model (e.g. ``output_router_logits=True``).

    Returns:
        The model's output: ``.logits`` ``[1, T', V]``; for an MoE model with router logits,
        ``.aux_loss`` is the load-balancing loss of the original tokens
        (:func:`router_aux_loss`).

    Raises:
        ValueError: an unprepared model, a pack on another device or with ids past the
            embedding, or keyword arguments that would break the tree (caches, labels,
            attention masks, flash boundaries, ``output_attentions``).
        UnsupportedModel: a layer that bypassed the tree attention, a
            window the model keeps in its own mask, a rotary scaling that reads the longest
            position, or a backend that cannot run these inputs (with every reason).
    """
    if return_hidden:
        deprecation.warn("hf.forward(..., return_hidden=True)", "hf.forward_hidden")
        return forward_hidden(model, pack, backend, block_size=block_size, **kwargs)
    out, aux = run(model, pack, backend, block_size, kwargs)
    return _with_aux(out.output, aux)


def forward_hidden(model, pack: TreePack, backend: str = "auto", *, block_size: int = 128,
                   **kwargs) -> HiddenOutput:
    """:func:`forward` without the ``[T', V]`` logits, for :func:`treepack.logprobs_from_hidden`.

    The LM head runs on one row only; the input of the head comes back instead.

    Args:
        model, pack, backend, block_size, **kwargs: as :func:`forward`.

    Returns:
        A :class:`HiddenOutput`: ``.last_hidden_state`` ``[1, T', H]`` (after the final
        norm), and for an MoE model ``.aux_loss`` / ``.router_logits``.

    Raises:
        As :func:`forward`.
    """
    out, aux = run(model, pack, backend, block_size, kwargs, output="hidden")
    return HiddenOutput(out.hidden[None], aux, getattr(out.output, "router_logits", None))


def logprobs(model, pack: TreePack, *, head: str = "auto", entropy: bool = False,
             temperature=1.0, align: str = "label", backend: str = "auto",
             chunk_size: int | None = None, head_dtype: torch.dtype | None = None,
             block_size: int = 128, sequence_parallel=None, **kwargs) -> TokenLogprobs:
    """Every next-token log-prob (and entropy) of the pack's sequences, from one forward.

    The one way to get log-probs from a model on a pack; the TRL and verl adapters call it
    too. Each packed row is normalised once per temperature, however many sequences share
    it, in chunks of rows, never as a float32 copy of ``[T', V]`` logits. ``head`` says where
    the LM head's logits come from:

    - ``"inside"``: the lean head replaces the model's output layer for this forward, on its
      own weight, so the ``[T', V]`` logits never exist and a wrapper (FSDP1 / FSDP2,
      sharded or offloaded; DeepSpeed ZeRO-3) gathers and reduces the head's weight as for
      the ordinary head. Needs a ``Linear`` output layer, logits the model does not
      transform after it, and one temperature.
    - ``"hidden"``: the model returns its hidden states and the lean head runs after the
      forward on :func:`lm_head` (which knows soft-capping and logit scales, and gathers an
      FSDP2 weight; not for FSDP1 or ZeRO-3, whose weights exist only inside the forward).
    - ``"logits"``: the model's own ``[T', V]`` logits. Any model.
    - ``"auto"`` (the default): ``"inside"`` where it applies, else ``"logits"``.

    Args:
        model: a transformers causal LM on which :func:`prepare` was called (or a wrapper).
        pack: the :class:`~treepack.TreePack`, on the model's device.
        head: ``"auto"``, ``"inside"``, ``"hidden"`` or ``"logits"`` (above).
        entropy: also compute the entropy of each prediction's distribution.
        temperature: logits are divided by it: a finite number > 0, or one per sequence of
            the pack (``"inside"``: one).
        align: ``"label"`` (``[s, p]`` holds the log-prob of token p, as
            :meth:`TreePack.token_logprobs`) or ``"prediction"`` (verl's: of token p + 1,
            and the entropy at every position); see :mod:`treepack.core.outputs`.
        backend: the attention backend, as :func:`forward`.
        chunk_size: rows per chunk of the log-softmax (default: by bytes, 1 GiB of float32
            logits on CUDA, 64 MiB elsewhere).
        head_dtype: run the head's matmul in this dtype (TRL's ``cast_lm_head_to_fp32``:
            ``torch.float32``); ``"inside"`` and ``"hidden"`` only (``"auto"`` then takes
            ``"hidden"`` where ``"inside"`` does not apply, and refuses a head treepack
            cannot read rather than run it in the model's dtype).
        block_size: FlexAttention's block size (``flex`` only).
        sequence_parallel: a ``torch.distributed`` process group (Ulysses, see
            docs/sequence-parallel.md): every rank of it passes the same pack and computes a
            slice of its rows; each attention layer (and short convolution, Gated DeltaNet
            scan) exchanges rows for heads across the group. Every rank gets the whole
            result; each one's parameter gradients are then P times its rows' share, so
            averaging them over the group (DDP / FSDP over a mesh holding it, or
            :func:`treepack.hf.average_gradients`) gives the pack's. The head runs after
            the forward on each rank's rows (``"auto"`` and ``"inside"``: ``"hidden"``
            where the head can be read, else ``"logits"``).
        **kwargs: passed to the model (e.g. ``output_router_logits=True``).

    Returns:
        :class:`treepack.TokenLogprobs`: ``logprobs`` [N, L] (flat layout: [total]), 0 where
        nothing is predicted; ``entropy`` the same or None; for an MoE model with router
        logits, ``aux_loss`` (the load-balancing loss of the original tokens) and
        ``router_logits``.

    Raises:
        ValueError: a ``head`` or ``align`` that is not one of those, a bad temperature,
            ``head_dtype`` with ``"logits"``, or anything :func:`forward` refuses; under
            ``sequence_parallel``, ranks of the group given different packs or arguments
            (:class:`treepack.core.agreement.Disagreement`), or a refusal on any rank of it
            (raised on every rank).
        UnsupportedModel: ``head="inside"`` on a model it does not apply to (the message
            says why), or a model treepack cannot run exactly.
    """
    if sequence_parallel is not None:  # every check inside the group's agreement
        return sp.logprobs(model, pack, sp.sequence_parallel(sequence_parallel), head=head,
                           entropy=entropy, temperature=temperature, align=align,
                           backend=backend, chunk_size=chunk_size, head_dtype=head_dtype,
                           block_size=block_size, kwargs=kwargs)
    check_head(head, head_dtype)
    check_pack(pack)
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    one_temperature = float(temps[0]) if len(temps) else 1.0  # an empty pack has none
    auto = head == "auto"
    if auto:
        head = "inside" if inside_refusal(model, temps) is None else "logits"
        if head == "logits" and head_dtype is not None:  # the lean head after the forward
            if head_after(model) == "logits":  # honours it where it can read the head
                raise UnsupportedModel(sp.head_dtype_refusal(model, head_dtype))
            head = "hidden"
    if head == "inside":
        refusal = inside_refusal(model, temps)
        if refusal is not None:
            raise UnsupportedModel(refusal)
        try:
            rows, out = _inside(model, pack, backend, block_size, kwargs, one_temperature,
                                entropy, chunk_size, head_dtype)
            result = rows.in_layout(pack, align)
        except _ChangedOutput as e:  # found out by one forward; remembered for the model
            _NO_INSIDE[unwrap(model)] = str(e)
            if not auto:
                raise
            head = "logits"
    if head == "hidden":
        packed, aux = run(model, pack, backend, block_size, kwargs, output="hidden")
        out = _with_aux(packed.output, aux)
        hidden, weights = packed.hidden, packed.head
        if head_dtype is not None:
            hidden = hidden.to(head_dtype)
            weights = {k: v.to(head_dtype) if isinstance(v, Tensor) else v
                       for k, v in weights.items()}
        result = outputs_from_hidden(pack, hidden, temperature=temps, entropy=entropy,
                                     align=align, chunk_size=chunk_size, **weights)
    elif head == "logits":
        out = forward(model, pack, backend, block_size=block_size, **kwargs)
        result = from_logits(pack, out.logits[0], temperature=temps, entropy=entropy,
                             align=align, chunk_size=chunk_size)
    return dataclasses.replace(result, aux_loss=getattr(out, "aux_loss", None),
                               router_logits=getattr(out, "router_logits", None))


class _ChangedOutput(UnsupportedModel):
    """The model changed its head's output before returning it (found after a forward)."""


_NO_INSIDE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why not


def inside_refusal(model, temps=None) -> str | None:
    """Why the lean head cannot run inside this model's forward (at these per-sequence
    temperatures, if given), or None."""
    core = unwrap(model)
    if core in _NO_INSIDE:
        return _NO_INSIDE[core]
    refusal = head_refusal(core.get_output_embeddings())
    if refusal is not None:
        return f"{type(core).__name__}: {refusal}; use head='logits'"
    transforms = logit_transforms(core)
    if transforms:
        return (f"{type(core).__name__} transforms its logits after the head ({transforms}), "
                "which would change the lean head's log-probs: use head='hidden' (or "
                "'logits')")
    if temps is not None and len(set(temps.tolist())) > 1:
        return ("the sequences have different temperatures, and the head inside the forward "
                "returns one value per packed row: use head='logits' or 'hidden'")
    return None


def _inside(model, pack, backend, block_size, kwargs, temperature, entropy, chunk_size,
            head_dtype):
    """The model over the pack with the lean head as its output layer, for this forward:
    the per-row values and the model's output (whose ``logits`` are them, [1, T', 2])."""
    core = unwrap(model)
    head = core.get_output_embeddings()
    rows = {}

    def lean(hidden: Tensor) -> Tensor:  # [1, T', H] -> [1, T', 2], inside the forward
        weight, bias = head_weights(head)
        if head_dtype is not None:
            hidden, weight = hidden.to(head_dtype), weight.to(head_dtype)
            bias = None if bias is None else bias.to(head_dtype)
        out = rows_from_hidden(pack, hidden[0], weight, bias=bias, temperature=temperature,
                               chunk_size=chunk_size, entropy=entropy)
        ent = out.entropy if entropy else torch.zeros_like(out.logprobs)
        rows["out"] = torch.stack([out.logprobs, ent], dim=-1)[None]
        return rows["out"]

    with _forward_replaced(head, lean):  # this instance, this forward only
        out, aux = run(model, pack, backend, block_size, kwargs)
    out = _with_aux(out.output, aux)
    if out.logits is not rows.get("out"):  # it must be the model's output, unchanged, so
        raise _ChangedOutput(  # that a wrapper's backward hooks see it
            f"{type(core).__name__} changes the output of its head before returning it: use "
            "head='hidden' or 'logits'")
    result = out.logits[0]
    return RowLogprobs(result[:, 0], result[:, 1] if entropy else None), out


def forward_lean(model, pack: TreePack, backend: str = "auto", *, temperature: float = 1.0,
                 with_entropy: bool = False, chunk_size: int | None = None,
                 block_size: int = 128, **kwargs) -> RowLogprobs:
    """Deprecated: ``logprobs(model, pack, head="inside")``, which returns the values in the
    pack's layout.

    Args:
        model, pack, backend, block_size, **kwargs: as :func:`forward`.
        temperature, with_entropy, chunk_size: as :func:`logprobs`'s ``temperature``,
            ``entropy`` and ``chunk_size``.

    Returns:
        :class:`treepack.core.outputs.RowLogprobs` per packed row (its
        :meth:`~treepack.core.outputs.RowLogprobs.in_layout` places them).

    Raises:
        As :func:`logprobs` with ``head="inside"``.
    """
    deprecation.warn("hf.forward_lean", "hf.logprobs(model, pack, head='inside')")
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    refusal = inside_refusal(model, temps)
    if refusal is not None:
        raise UnsupportedModel(refusal)
    return _inside(model, pack, backend, block_size, kwargs, float(temps[0]), with_entropy,
                   chunk_size, None)[0]


@contextlib.contextmanager
def _forward_replaced(module, forward):
    """``module`` computing ``forward`` instead of its own, then exactly what was there again.

    An instance may carry a forward of its own: accelerate's hooks (``device_map``, CPU or
    disk offload) set ``module.forward`` to a wrapper that loads the weights, calls
    ``module._old_forward`` and offloads them again. There the wrapper's inner forward is
    replaced, so the hook still runs around ``forward``; elsewhere ``module.forward``."""
    name = "_old_forward" if "forward" in vars(module) and hasattr(module, "_old_forward") \
        else "forward"
    with replaced(module, name, forward):
        yield


def run(model, pack: TreePack, backend: str, block_size: int, kwargs: dict, *,
        output: str = "logits"):
    """The model over the whole pack (:func:`.packed.packed_forward`), and the router loss
    of the original tokens (None for a model without one)."""
    out = packed_forward(model, pack, kwargs, backend=backend, block_size=block_size,
                         output=output)
    aux = None
    if getattr(out.output, "aux_loss", None) is not None:
        aux = router_aux_loss(unwrap(model), pack, out.output.router_logits)
    return out, aux


def _with_aux(out, aux):
    if aux is not None:
        out.aux_loss = aux
    return out
