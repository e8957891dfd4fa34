"""The calls: a step's forward and backward in parts, a whole-batch loss in two passes, and
log-probs without gradients; each takes sequences, a pack, or a built :class:`Parts`."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from treepack.adapters.fsdp import sync
from treepack.adapters.hf.forwarding import forward
from treepack.adapters.hf.head import head_after
from treepack.adapters.hf.moe import router_logits_on, row_multiplicity, weighted_router_aux_loss
from treepack.adapters.hf.packed import check_inputs
from treepack.adapters.hf.parts.run import (ROUTER_IN_PARTS, Run, loss_tensor, rng_state,
                                            set_rng_state)
from treepack.adapters.hf.prepare import compute_device, is_prepared, unwrap
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.attention import check_backend
from treepack.adapters.hf.sequence_parallel import (ROUTER_UNDER_SP, agreed,
                                                    sequence_parallel as sequence_parallel_of)
from treepack.core.agreement import fingerprint, pack_identity
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.tree import TreePack
from treepack.forwards.walk import PartsResult
from treepack.planning.parts import Parts, split

__all__ = ["backward_in_parts", "step_in_parts", "logprobs_in_parts", "PartsResult",
           "check_model", "surrogate", "tree_parts"]


def backward_in_parts(model, sequences, loss_fn, *, max_tokens: int | None = None,
                      temperature=1.0, entropy: bool = False, align: str = "label",
                      recompute: bool | str = "auto", sequence_parallel=None,
                      backend: str = "auto", **kwargs) -> PartsResult:
    """One step's forward and backward over a tree too large for one forward.

    Args:
        model: a prepared transformers causal LM (hybrids included; activation
            checkpointing non-reentrant, transformers' default), or a DDP
            wrapper of one: each rank runs its own trees' parts and the gradients are
            averaged over the ranks once, at the end; or an FSDP2 (``fully_shard``) or FSDP1
            (``FullyShardedDataParallel``) one: its parameters are gathered once for the
            step, the gradients reduce-scattered once at the end (every rank must call
            this, as any FSDP step; a rank without sequences passes an empty pack).
        sequences: the step's token sequences (lists, arrays or 1-D tensors), a
            :class:`~treepack.TreePack` of them (its sequences in its order and layout: a
            ``treepack.collate(..., parts=True)`` batch's ``batch.pack``, whose fields then
            line up with the outputs; ``TreePack.empty`` for none), or the
            :class:`~treepack.planning.parts.Parts` of a pack (``split(pack, max_rows)``,
            built once for several passes).
        loss_fn: ``loss_fn(outputs, mask) -> scalar tensor``: ``outputs`` a
            :class:`~treepack.TokenLogprobs` in the pack's layout (``[N, L]``, flat
            ``[total]``) with the log-probs (and entropies) of one part's predictions, 0
            elsewhere; ``mask`` bool, where they are. The step's loss is the sum over
            parts, so the loss must be a sum over predictions (a token mean divides by the
            step's token count); for any other loss use :func:`step_in_parts`.
        max_tokens: the most rows one forward computes (given by ``sequences`` when it is a
            ``Parts``).
        temperature: logits are divided by it: a number, or one per sequence.
        entropy: also pass (and return) the entropies.
        align: ``"label"`` (``[s, p]`` of token p) or ``"prediction"`` (verl's: at p, of
            token p + 1, and the entropy at every position; the mask then holds every
            position of the part's rows, a sequence's last with its entropy only).
        recompute: ``"auto"`` (a part with grandchildren runs its forward twice, keeping
            only what it hands below in between), ``True`` (every part with children) or
            ``False`` (none: every part's activations kept until its backward).
        sequence_parallel: a ``torch.distributed`` process group whose ranks split each
            part's rows (as :func:`treepack.hf.logprobs`'s): every rank passes the same
            sequences; ``loss_fn`` sees the rank's own predictions of each part; the loss,
            log-probs and entropies returned are the whole step's on every rank, and the
            gradients P times the rank's share (average them over the group).
        backend: how each part attends: ``"auto"`` (FlashAttention varlen where it applies,
            a part's chains and its context's keys in one call; else the segment backend's
            grouped calls), ``"varlen"`` (sinks too, through the kernel's log-sum-exp; on a
            CPU its exact reference) or ``"segment"``; chunked attention always runs on
            segment.
        **kwargs: passed to the model's forward, checked as :func:`treepack.hf.logprobs`
            checks them.

    Returns:
        :class:`PartsResult`; the gradients are accumulated into the parameters, as
        ``loss.backward()`` would.

    Raises:
        RuntimeError: gradients are off (``torch.no_grad()``).
        TypeError: ``loss_fn`` returned something other than a tensor.
        UnsupportedModel: reentrant activation checkpointing; router logits on (the
            load-balancing loss is the whole step's: use :func:`step_in_parts`); or what
            :func:`treepack.hf.logprobs` refuses (a rotary scaling that reads the longest
            position, layers that bypass the tree).
        ValueError: an unprepared model, bad sequences, ``max_tokens`` or keywords.
    """
    sp = sequence_parallel_of(sequence_parallel)
    with _agreed(sp, "backward_in_parts", model, sequences, max_tokens, kwargs, temperature,
                 entropy, align, recompute) as parts:
        _needs_gradients("backward_in_parts")
        if router_logits_on(model, kwargs):
            raise UnsupportedModel(f"backward_in_parts: {ROUTER_IN_PARTS}")
    return _train(model, parts, loss_fn, temperature, entropy, align, recompute, kwargs,
                  sp=sp, backend=backend)


def step_in_parts(model, sequences, loss_fn, *, max_tokens: int | None = None,
                  temperature=1.0, entropy: bool = False, align: str = "label",
                  recompute: bool | str = "auto", sequence_parallel=None,
                  backend: str = "auto", **kwargs) -> PartsResult:
    """:func:`backward_in_parts` for any loss of the whole batch's outputs: a per-sequence
    mean (``seq-mean-token-mean``), GSPO's sequence ratio, an MoE router loss, anything a
    part holding some of a sequence's tokens cannot compute by itself.

    Two passes: every log-prob (and entropy, and router logit) without gradients, in parts;
    ``loss_fn`` on them as leaves, whose backward gives the loss's gradient with respect to
    each of them; then the parts' forwards and backwards with ``sum(gradient * value)`` as
    their loss. The chain rule makes that the loss's gradient, for one more forward over the
    tree's rows (each once). The second pass replays the first's random generators, so with
    dropout on the gradient is that of the loss returned.

    Args:
        model, sequences, max_tokens, temperature, entropy, align, recompute, **kwargs: as
            :func:`backward_in_parts` (``output_router_logits=True`` allowed, but not with
            ``sequence_parallel``).
        sequence_parallel: as :func:`backward_in_parts`; ``loss_fn`` sees every log-prob
            of the step on every rank.
        loss_fn: ``loss_fn(outputs) -> scalar tensor``, ``outputs`` a
            :class:`~treepack.TokenLogprobs` of every log-prob (and entropy) of the batch,
            as one forward over it would give, and with router logits on, ``aux_loss``: the
            load-balancing loss of the batch's original tokens.

    Returns:
        :class:`PartsResult`: the loss ``loss_fn`` returned; the gradients are accumulated
        into the parameters.

    Raises:
        ValueError: a loss that depends on nothing with a gradient (not on the outputs it
            was given); and as :func:`backward_in_parts`.
    """
    sp = sequence_parallel_of(sequence_parallel)
    with _agreed(sp, "step_in_parts", model, sequences, max_tokens, kwargs, temperature,
                 entropy, align, recompute) as parts:
        _needs_gradients("step_in_parts")
    replay = rng_state(parts.pack.device)
    first = _score(model, parts, temperature, entropy, align, kwargs, sp, backend)
    logprobs = first.logprobs.requires_grad_()
    ent = None if first.entropy is None else first.entropy.requires_grad_()
    router = {i: tuple(r.requires_grad_() for r in layers) for i, layers in first.router.items()}
    aux = _aux_loss(model, parts, router)
    loss = loss_tensor(loss_fn(TokenLogprobs(logprobs, ent, align, aux_loss=aux)))
    if not loss.requires_grad:
        raise ValueError("step_in_parts: loss_fn's loss does not depend on the log-probs, "
                         "entropies or router loss it was given (nor on anything with a "
                         "gradient): compute it from outputs.logprobs (or .entropy, "
                         ".aux_loss)")
    loss.backward()
    router_grads = {i: tuple(r.grad for r in layers) for i, layers in router.items()}
    set_rng_state(replay)  # the same dropout masks as the first pass
    step = _train(model, parts, surrogate(logprobs.grad, None if ent is None else ent.grad),
                  temperature, entropy, align, recompute, kwargs, router_grads=router_grads,
                  sp=sp, backend=backend)
    return PartsResult(loss.detach(), first.logprobs.detach(),
                       None if first.entropy is None else first.entropy.detach(),
                       step.parts, step.rows)


def surrogate(grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None):
    """A part's loss whose gradient is a whole-batch loss's: ``sum(grad * value)`` over the
    part's predictions, given that loss's gradients (in the pack's layout) with respect to
    every log-prob and entropy (None: it does not depend on them)."""
    def loss_fn(out: TokenLogprobs, mask: Tensor) -> Tensor:
        total = out.logprobs.new_zeros(())
        if grad_logprobs is not None:
            total = total + (out.logprobs * grad_logprobs).where(mask, 0).sum()
        if grad_entropy is not None:
            total = total + (out.entropy * grad_entropy).where(mask, 0).sum()
        return total

    return loss_fn


def logprobs_in_parts(model, sequences, *, max_tokens: int | None = None, temperature=1.0,
                      entropy: bool = False, align: str = "label", sequence_parallel=None,
                      backend: str = "auto", **kwargs) -> TokenLogprobs:
    """Every next-token log-prob of ``sequences`` without gradients (old and reference
    log-probs, scoring), each row of their tree computed once, in forwards of at most
    ``max_tokens`` rows.

    Args:
        model, sequences, max_tokens, temperature, entropy, align, sequence_parallel,
            **kwargs: as :func:`backward_in_parts` (``output_router_logits=True`` allowed,
            but not with ``sequence_parallel``).

    Returns:
        :class:`~treepack.TokenLogprobs` in the pack's layout and ``align``; with router
        logits on, ``aux_loss``: the load-balancing loss of the original tokens.

    Raises:
        As :func:`backward_in_parts`.
    """
    sp = sequence_parallel_of(sequence_parallel)
    with _agreed(sp, "logprobs_in_parts", model, sequences, max_tokens, kwargs, temperature,
                 entropy, align) as parts:
        pass
    with torch.no_grad():
        run = _score(model, parts, temperature, entropy, align, kwargs, sp, backend)
        aux = _aux_loss(model, parts, run.router)
    return TokenLogprobs(run.logprobs, run.entropy, align, aux_loss=aux)


def check_model(model):
    """The transformers model inside ``model`` if its trees can run in parts.

    Raises:
        ValueError: an unprepared model.
    """
    core = unwrap(model)
    if not is_prepared(core):
        raise ValueError(f"{type(core).__name__} is not prepared: call "
                         "treepack.hf.prepare(model) first")
    return core


def tree_parts(model, sequences, max_tokens: int | None, kwargs: dict | None = None) -> Parts:
    """The :class:`Parts` to run for ``sequences`` (sequences, a pack or parts) on ``model``'s
    device, its pack checked as every packed forward checks it.

    Raises:
        ValueError: ``max_tokens`` missing, or other than the given parts' budget; and what
            :func:`treepack.adapters.hf.packed.check_inputs` refuses.
    """
    check_model(model)
    device = compute_device(model)
    if isinstance(sequences, Parts):
        if max_tokens is not None and max_tokens != sequences.max_rows:
            raise ValueError(f"max_tokens={max_tokens} but the parts were split at "
                             f"{sequences.max_rows} rows a forward: drop max_tokens, or split "
                             "the pack again at that budget")
        parts = sequences if sequences.pack.device == device else \
            split(sequences.pack.to(device), sequences.max_rows)
    else:
        if max_tokens is None:
            raise ValueError("max_tokens (the most rows one forward computes) is needed, "
                             "unless sequences is the Parts of a pack "
                             "(treepack.planning.parts.split(pack, max_rows))")
        images = (kwargs or {}).get("images")
        parts = split(_as_pack(sequences, device, images), max_tokens)
    kwargs = dict(kwargs or {})
    check_inputs(model, parts.pack, {k: v for k, v in kwargs.items() if k != "images"},
                 images=kwargs.get("images"))
    return parts


def _as_pack(sequences, device, images=None) -> TreePack:
    """``sequences`` as a pack on ``device`` without padding rows (but an empty pack), keyed
    by their ``images`` where given."""
    if isinstance(sequences, TreePack):
        pack = sequences if sequences.device == device else sequences.to(device)
        if pack.num_sequences and pack.num_rows != pack.num_packed_rows:
            h = pack.host  # its sequences, in its order and layout, without the padding
            rows = ([h.rows[a:b] for a, b in zip(h.offsets[:-1], h.offsets[1:])]
                    if pack.layout == "flat" else
                    [h.rows[s, :n] for s, n in enumerate(h.lengths)])
            keys = None if h.row_keys is None else [h.row_keys[r] for r in rows]
            pack = TreePack.from_sequences([h.input_ids[r] for r in rows], layout=pack.layout,
                                           seq_ids=pack.seq_ids, device=device, keys=keys)
        return pack
    sequences = list(sequences)
    if not sequences:
        return TreePack.empty(1, device=device)
    keys = getattr(images, "keys", None)
    return TreePack.from_sequences(sequences, device=device, keys=keys)


def _needs_gradients(caller: str) -> None:
    if not torch.is_grad_enabled():
        raise RuntimeError(f"{caller} runs a training step's backward, but gradients are off "
                           "(under torch.no_grad() or torch.inference_mode()): call it outside "
                           "them, or use hf.logprobs_in_parts for log-probs without gradients")


class PartsIdentity(NamedTuple):
    """A pack's parts as the ranks of a group compare them: the budget, the count, and a
    digest of each part's rows and parent."""

    max_rows: int
    parts: int
    digest: int

    def __repr__(self) -> str:
        return f"max_tokens={self.max_rows} ({self.parts} parts)"


def parts_identity(parts: Parts) -> PartsIdentity:
    return PartsIdentity(parts.max_rows, len(parts.parts), fingerprint(
        [(part.parent, part.rows) for part in parts.parts]))


@contextlib.contextmanager
def _agreed(sp, call: str, model, sequences, max_tokens, kwargs, temperature, entropy, align,
            recompute="auto"):
    """The parts of ``sequences`` (:func:`tree_parts`), built and checked inside the
    sequence-parallel group's agreement (:func:`.sequence_parallel.agreed`): the pack, the
    parts' budget and cut, and the call's arguments agree on every rank before the first
    collective, or every rank refuses. The block runs the call's own checks. Yields the
    parts."""
    pack = sequences.pack if isinstance(sequences, Parts) else None
    with agreed(sp, call, model, pack, kwargs) as fields:
        check_align(align)
        if recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={recompute!r}: use 'auto', True or False")
        parts = tree_parts(model, sequences, max_tokens, kwargs)
        if sp is not None:
            if router_logits_on(model, kwargs):
                raise UnsupportedModel(ROUTER_UNDER_SP)
            fields.update(pack=pack_identity(parts.pack), parts=parts_identity(parts),
                          recompute=recompute, entropy=entropy, align=align,
                          temperature=per_sequence_temperature(temperature,
                                                               parts.pack.num_sequences),
                          head=head_after(model) if parts.parts else "hidden")
        yield parts


def _train(model, parts: Parts, loss_fn, temperature, entropy, align, recompute, kwargs,
           router_grads=None, sp=None, backend="auto") -> PartsResult:
    with sync.unsharded(model, lambda: _empty_step(model)):
        run = Run(sync.local(model), parts, temperature=temperature, entropy=entropy,
                  align=align, train=True, kwargs=kwargs, loss_fn=loss_fn,
                  recompute=recompute, router_grads=router_grads, sp=sp,
                  backend=check_backend(backend))
        run.all()
    sync.finish(model)
    return PartsResult(run.loss.detach(), run.logprobs.detach(),
                       None if run.entropy is None else run.entropy.detach(),
                       len(parts.parts), parts.rows_computed)


def _empty_step(model) -> None:
    """An empty pack's forward and backward through ``model``: nothing learned, every
    collective of a data-parallel wrapper in step (:func:`treepack.adapters.fsdp.sync.
    unsharded` ends a step in parts with it)."""
    empty = TreePack.empty(1, device=compute_device(model))
    (forward(model, empty).logits.sum() * 0.0).backward()


def _score(model, parts: Parts, temperature, entropy, align, kwargs, sp=None,
           backend="auto") -> Run:
    """Every output of the parts without gradients (a pass that keeps each part's router
    logits)."""
    with sync.unsharded(model, lambda: _empty_step(model), train=False), torch.no_grad():
        run = Run(sync.local(model), parts, temperature=temperature, entropy=entropy,
                  align=align, train=False, kwargs=kwargs, sp=sp, backend=check_backend(backend))
        run.all()
    return run


def _aux_loss(model, parts: Parts, router: dict) -> Tensor | None:
    """The load-balancing loss of the tree's original tokens from every part's router
    logits (each row weighted by the tokens it stands for), or None without them."""
    if not router:
        return None
    order = sorted(router)
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*(router[i] for i in order)))
    weights = row_multiplicity(parts.pack)
    rows = torch.cat([torch.from_numpy(parts.parts[i].rows) for i in order]).to(weights.device)
    return weighted_router_aux_loss(model, layers, weights[rows])
