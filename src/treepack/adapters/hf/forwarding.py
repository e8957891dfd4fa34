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

from treepack.adapters.hf.head import lm_head, lm_head_kwargs
from treepack.adapters.hf.moe import router_aux_loss
from treepack.adapters.hf.prepare import compute_device, is_prepared, unwrap
from treepack.adapters.hf.routing import (TREE_FORWARD_KWARG, TreeForward, UnsupportedModel,
                                          check_calls, text_config, tree_forward)
from treepack.core import deprecation
from treepack.core.outputs import (RowLogprobs, TokenLogprobs, from_logits,
                                   per_sequence_temperature)
from treepack.core.tree import TreePack, derived_from_pack
from treepack.lean.logprobs import outputs_from_hidden, rows_from_hidden

__all__ = ["logprobs", "forward", "forward_hidden", "forward_lean", "HiddenOutput", "HEADS",
           "inside_refusal"]


# Keyword arguments that would give the model another notion of sequence boundaries or a
# cache, or a loss over packed rows.
_REFUSED_KWARGS = {
    "input_ids": "the pack supplies input_ids",
    "inputs_embeds": "the pack supplies input_ids",
    "attention_mask": "the pack's tree structure is the attention mask",
    "position_ids": "the pack supplies position_ids (depths)",
    "cache_position": "a pack is one forward from scratch, without a cache",
    "past_key_values": "a pack is one forward from scratch, without a cache",
    "cache": "a pack is one forward from scratch, without a cache",
    "labels": "the model's loss would average over packed rows; compute log-probs with "
              "pack.token_logprobs(out.logits[0]) and your loss on the [N, L] layout",
    "cu_seq_lens_q": "flash 'padding-free' boundaries would let siblings see each other",
    "cu_seq_lens_k": "flash 'padding-free' boundaries would let siblings see each other",
    "max_length_q": "flash 'padding-free' boundaries would let siblings see each other",
    "max_length_k": "flash 'padding-free' boundaries would let siblings see each other",
    "seq_idx": "flash 'padding-free' boundaries would let siblings see each other",
}


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
    if aux is not None:
        out.aux_loss = aux
    return out


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
    named_outputs(kwargs, "forward_hidden")
    kwargs = {**kwargs, "logits_to_keep": 1, "output_hidden_states": True}
    out, aux = run(model, pack, backend, block_size, kwargs)
    return HiddenOutput(out.hidden_states[-1], aux, getattr(out, "router_logits", None))


HEADS = ("auto", "inside", "hidden", "logits")


def logprobs(model, pack: TreePack, *, head: str = "auto", entropy: bool = False,
             temperature=1.0, align: str = "label", backend: str = "auto",
             chunk_size: int | None = None, head_dtype: torch.dtype | None = None,
             block_size: int = 128, **kwargs) -> TokenLogprobs:
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
            ``torch.float32``); ``"inside"`` and ``"hidden"`` only.
        block_size: FlexAttention's block size (``flex`` only).
        **kwargs: passed to the model (e.g. ``output_router_logits=True``).

    Returns:
        :class:`treepack.TokenLogprobs`: ``logprobs`` [N, L] (flat layout: [total]), 0 where
        nothing is predicted; ``entropy`` the same or None; for an MoE model with router
        logits, ``aux_loss`` (the load-balancing loss of the original tokens) and
        ``router_logits``.

    Raises:
        ValueError: a ``head`` or ``align`` that is not one of those, a bad temperature,
            ``head_dtype`` with ``"logits"``, or anything :func:`forward` refuses.
        UnsupportedModel: ``head="inside"`` on a model it does not apply to (the message
            says why), or a model treepack cannot run exactly.
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r} must be one of {HEADS}")
    if head_dtype is not None and head == "logits":
        raise ValueError("head_dtype applies to the lean head (head='inside' or 'hidden'); "
                         "with head='logits' the model's own head runs in its own dtype")
    named_outputs(kwargs, "logprobs")
    check_pack(pack)
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    auto = head == "auto"
    if auto:
        head = "inside" if inside_refusal(model, temps) is None else "logits"
    if head == "inside":
        refusal = inside_refusal(model, temps)
        if refusal is not None:
            raise UnsupportedModel(refusal)
        try:
            rows, out = _inside(model, pack, backend, block_size, kwargs, float(temps[0]),
                                entropy, chunk_size, head_dtype)
            result = rows.in_layout(pack, align)
        except _ChangedOutput as e:  # found out by one forward; remembered for the model
            _NO_INSIDE[unwrap(model)] = str(e)
            if not auto:
                raise
            head = "logits"
    if head == "hidden":
        out = forward_hidden(model, pack, backend, block_size=block_size, **kwargs)
        hidden, weights = out.last_hidden_state[0], lm_head(model)
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
    head = core.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return (f"{type(core).__name__}'s output layer is a {type(head).__name__}, not a "
                "Linear layer: use head='logits'")
    transforms = {k: v for k, v in lm_head_kwargs(core, gather=False).items()
                  if k in ("softcap", "scale")}
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
        weight, bias = head.weight, head.bias
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
    if out.logits is not rows.get("out"):  # it must be the model's output, unchanged, so
        raise _ChangedOutput(  # that a wrapper's backward hooks see it
            f"{type(core).__name__} changes the output of its head before returning it: use "
            "head='hidden' or 'logits'")
    if aux is not None:
        out.aux_loss = aux
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
    named_outputs(kwargs, "forward_lean")
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    refusal = inside_refusal(model, temps)
    if refusal is not None:
        raise UnsupportedModel(refusal)
    return _inside(model, pack, backend, block_size, kwargs, float(temps[0]), with_entropy,
                   chunk_size, None)[0]


def named_outputs(kwargs: dict, caller: str) -> None:
    """Refuse ``return_dict=False``: these calls read the model's named outputs."""
    if kwargs.get("return_dict", True) is False:
        raise ValueError(f"hf.{caller} reads the model's named outputs and returns its own "
                         "named result: drop return_dict=False")


@contextlib.contextmanager
def _forward_replaced(module, forward):
    """``module`` computing ``forward`` instead of its own, then exactly what was there again.

    An instance may carry a forward of its own: accelerate's hooks (``device_map``, CPU or
    disk offload) set ``module.forward`` to a wrapper that loads the weights, calls
    ``module._old_forward`` and offloads them again. There the wrapper's inner forward is
    replaced, so the hook still runs around ``forward``; elsewhere ``module.forward``."""
    name = "_old_forward" if "forward" in vars(module) and hasattr(module, "_old_forward") \
        else "forward"
    missing = object()
    saved = vars(module).get(name, missing)
    setattr(module, name, forward)
    try:
        yield
    finally:
        if saved is missing:
            delattr(module, name)
        else:
            setattr(module, name, saved)


@derived_from_pack
def _input_ids(pack: TreePack, pad_token_id: int | None) -> Tensor:
    """The pack's ids for the model: its padding rows (id 0, seen by nothing but themselves,
    predicting nothing) get an id other than the model's ``pad_token_id``, so transformers'
    "your input_ids may be padded, pass an attention_mask" check (GPT-2 and others) does not
    fire on padding the tree attention already isolates. Real rows are the user's ids."""
    if pack.num_rows == pack.num_packed_rows or pad_token_id is None or pad_token_id != 0:
        return pack.input_ids
    ids = pack.input_ids.clone()
    ids[pack.num_packed_rows:] = 1  # any id of the vocabulary but the pad id (0)
    return ids


def check_pack(pack) -> None:
    """Refuse anything but a TreePack, naming how to build one."""
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack, got {type(pack).__name__}: build one with "
                        "treepack.TreePack.from_sequences(sequences)")


def run(model, pack: TreePack, backend: str, block_size: int, kwargs: dict):
    """The model over the pack: its output and the router loss of the original tokens."""
    check_pack(pack)
    for key in kwargs:
        if key in _REFUSED_KWARGS:
            raise ValueError(f"treepack.hf.forward does not take {key!r}: {_REFUSED_KWARGS[key]}")
    if kwargs.pop("use_cache", False):
        raise ValueError("use_cache=True: a pack is one forward from scratch, without a cache")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: treepack's attention backends never form the "
                         "attention weights (the varlen, segment and flex kernels are fused); "
                         "run the model unpacked to inspect them")
    core = unwrap(model)
    if not is_prepared(core):
        raise ValueError(
            f"{type(core).__name__} is not prepared: call treepack.hf.prepare(model) once "
            "before hf.forward (it routes the model's attention through treepack; ordinary "
            "batches still run the original attention, and hf.restore(model) undoes it), or "
            "run the forward inside `with treepack.hf.prepared(model):`"
        )
    device = compute_device(model)
    if pack.device != device:
        raise ValueError(f"the model ({type(core).__name__}) computes on {device} but the pack "
                         f"is on {pack.device}; move the pack with pack.to({str(device)!r})")
    vocab = core.get_input_embeddings().num_embeddings
    if pack.max_token_id >= vocab:
        raise ValueError(
            f"the pack has token id {pack.max_token_id} but {type(core).__name__}'s embedding "
            f"has {vocab} rows: tokenize with the model's own tokenizer (ids 0 .. {vocab - 1})"
        )
    _check_rope(core, pack)
    tree = TreeForward(pack, backend, block_size)
    with tree_forward():
        out = model(input_ids=_input_ids(pack, text_config(core).pad_token_id)[None],
                    position_ids=pack.position_ids[None],
                    use_cache=False, **{TREE_FORWARD_KWARG: tree}, **kwargs)
    check_calls(core, tree)
    aux = None
    if getattr(out, "aux_loss", None) is not None:
        aux = router_aux_loss(core, pack, out.router_logits)
    return out, aux


def _check_rope(model, pack: TreePack) -> None:
    """Refuse rotary scalings whose frequencies depend on the longest position in the batch
    (dynamic NTK, LongRoPE) once the pack reaches the length where they change: every
    sequence of the pack would get the frequencies of its longest one."""
    config = text_config(model)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return
    nested = all(isinstance(v, dict) for v in params.values()) and params
    for p in (params.values() if nested else [params]):
        kind = str(p.get("rope_type", p.get("type", "default")))
        if "dynamic" not in kind and kind != "longrope":
            continue
        limit = (p.get("original_max_position_embeddings")
                 or getattr(config, "original_max_position_embeddings", None)
                 or config.max_position_embeddings)
        if pack.max_length > limit:
            raise UnsupportedModel(
                f"{type(model).__name__} uses rope_type={kind!r}, whose rotary frequencies "
                f"change once a batch reaches {limit} positions, and this pack's longest "
                f"sequence has {pack.max_length}: packed together, every sequence would get "
                "the longest one's frequencies, unlike each run alone. Plan packs with "
                f"sequences of at most {limit} tokens, or run these unpacked"
            )
