"""A tree larger than one forward on a megatron-core ``GPTModel``, run in parts that each
compute their rows once (what :mod:`treepack.hf`'s parts do for transformers).

:func:`treepack.planning.parts.split` cuts the tree into parts of at most ``max_tokens`` rows.
A part's forward is the model over its own rows only (at their depths); each layer's core
attention reads the keys and values of the part's ancestor rows (its context) from the parts
that computed them (:class:`treepack.forwards.Carried`: each TP rank its own heads;
under CP, each rank the heads it attends after the row/head exchange). In training those go
to the parts below as detached leaves; each of those parts' backward adds its gradient into
them, and the part's own backward runs once, after all of them, with its loss and those
gradients. So the loss and every gradient are those of one forward over the whole tree, while
each forward holds one part's activations.

Tensor parallelism, Megatron's sequence parallelism and context parallelism run inside each
part as in :func:`treepack.megatron.logprobs` (every rank of the TP and CP groups passes the
same whole pack; each CP rank's gradients are its rows' share). Pipeline parallelism is
refused: a part's backward must follow its children's, and Megatron's schedules run
backwards in the order of the forwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel

from treepack.adapters.megatron import moe, vision
from treepack.adapters.megatron.attention import UnsupportedMegatron
from treepack.attention import check_backend
from treepack.adapters.megatron.forward import (MegatronForward, _agreement_group, _check,
                                                _groups, _place, run_forward, unwrap)
from treepack.core.agreement import agreement, pack_identity
from treepack.core.outputs import TokenLogprobs
from treepack.core.tree import TreePack
from treepack.forwards import Carried, PartForward, PartsResult, Walk, part_predictions
from treepack.planning.parts import Parts, split

__all__ = ["backward_in_parts", "step_in_parts", "logprobs_in_parts", "PartsResult"]


def _no_reentrant() -> UnsupportedMegatron:
    return UnsupportedMegatron(
        "a layer ran its forward without gradients during a training step in parts "
        "(activation recomputation: recompute_granularity), whose backward would not see the "
        "gradients the parts below add to this part's keys and values: run parts with "
        "recompute_granularity=None (the parts bound each forward's activations already)")


class _Run:
    """One pass over the parts: forwards depth-first, each part's backward (``train``) after
    its children's. Afterwards ``logprobs`` / ``entropy`` hold every prediction in the pack's
    layout, ``loss`` the sum of the parts' losses."""

    def __init__(self, model, parts: Parts, temps, *, entropy: bool, align: str, train: bool,
                 loss_fn, recompute, chunk_size, images=None, backend: str = "auto"):
        self.model, self.core, self.parts = model, unwrap(model), parts
        self.backend = backend  # how each part attends (treepack.forwards.attend_part)
        self.images = images
        self.temps, self.want_entropy, self.align = temps, entropy, align
        self.train, self.loss_fn, self.chunk_size = train, loss_fn, chunk_size
        self.tp, self.cp = _groups()
        self.multiple = self.tp["size"] if self.core.config.sequence_parallel else 1
        pack = parts.pack
        self.walk = Walk(parts, train, recompute)
        self.carried = Carried(parts, train, _no_reentrant)
        self.predictions = part_predictions(pack, parts.max_rows, align)
        dtype = torch.promote_types(next(self.core.parameters()).dtype, torch.float32)
        self.logprobs = torch.zeros(tuple(pack.rows.shape), dtype=dtype, device=pack.device)
        self.entropy = torch.zeros_like(self.logprobs) if entropy else None
        self.loss = torch.zeros((), dtype=dtype, device=pack.device)

    def all(self) -> None:
        self.walk.run_parts(self.carried, self._forward, self._outputs,
                            (_rng_state, _set_rng_state), train=self.train)

    def _forward(self, i: int):
        cp = self.cp
        rows = torch.from_numpy(self.parts.parts[i].rows).to(self.parts.pack.device)
        forward = MegatronForward(PartForward(self.carried, i, UnsupportedMegatron,
                                              self.backend),
                                  cp["group"], cp["rank"], cp["size"], self.multiple, rows=rows)
        forward.images = self.images  # each part encodes the images its rows need
        return (forward, *run_forward(self.model, forward, self.tp))

    def _outputs(self, i: int, forward, output, head) -> Tensor | None:
        """Part ``i``'s predictions placed in the pack's layout, and its loss."""
        every = self.predictions[i]
        if every.where.shape[0] == 0:
            return None  # nothing predicted from this part's rows (on any rank)
        out = _place(self.core, self.parts.pack, forward, output, head, self.temps,
                     self.want_entropy, self.align, self.chunk_size, self.tp, self.cp,
                     every=every)
        where = every.where
        dtype = self.logprobs.dtype
        self.logprobs.view(-1)[where] = out.logprobs.reshape(-1)[where].detach().to(dtype)
        if out.entropy is not None:
            self.entropy.view(-1)[where] = out.entropy.reshape(-1)[where].detach().to(dtype)
        if self.loss_fn is None:
            return None
        mask = torch.zeros(self.logprobs.numel(), dtype=torch.bool, device=where.device)
        mask[where] = True
        loss = self.loss_fn(out, mask.view(self.logprobs.shape))
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor computed from the outputs it "
                            f"is given, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                               else ""))
        self.loss = self.loss + loss.detach().to(self.loss.dtype)
        return loss


def _rng_state() -> tuple:
    """The generators a forward draws dropout from: the CPU's, the device's, and Megatron's
    model-parallel tracker's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None,
            tensor_parallel.get_cuda_rng_tracker().get_states())


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    # a copy: the tracker keeps the dict it is given and writes its forks into it
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state[2]))


def _parts_of(sequences, max_tokens, device, images=None) -> Parts:
    if isinstance(sequences, Parts):
        if max_tokens is not None and max_tokens != sequences.max_rows:
            raise ValueError(f"max_tokens={max_tokens} but the Parts were cut at "
                             f"{sequences.max_rows} rows: pass one of them")
        return sequences
    if max_tokens is None:
        raise ValueError("max_tokens is required (the most rows one forward computes), unless "
                         "sequences is a Parts from treepack.planning.parts.split")
    pack = sequences if isinstance(sequences, TreePack) else TreePack.from_sequences(
        sequences, device=device, keys=None if images is None else images.keys)
    return split(pack, max_tokens)


def _prepare_call(name: str, model, sequences, max_tokens, temperature, align, entropy,
                  recompute, train: bool, images=None):
    """The checks every rank of the TP x CP group agrees on; the parts and temperatures."""
    core = unwrap(model)
    tp, cp = _groups()
    device = next(core.parameters()).device
    with agreement(_agreement_group(tp, cp), "tensor- and context-parallel group",
                   {"pack": "every rank of a group must pass the same sequences"}) as fields:
        if not (parallel_state.is_pipeline_first_stage()
                and parallel_state.is_pipeline_last_stage()):
            raise UnsupportedMegatron(
                f"treepack.megatron.{name} runs a whole model on one pipeline stage: a part's "
                "backward follows its children's, and Megatron's pipeline schedules run "
                "backwards in the order of the forwards. With pipeline parallelism, split "
                "trees over the budget with treepack.plan (each pack repeats its prefix)")
        if recompute not in (True, False, "auto"):  # before any rank's collective
            raise ValueError(f"recompute={recompute!r}: use 'auto', True or False")
        if train and core.config.recompute_granularity is not None:
            raise _no_reentrant()
        refusal = parts_refusal(core, train)
        if refusal is not None:
            raise UnsupportedMegatron(f"treepack.megatron.{name}: {refusal}")
        parts = _parts_of(sequences, max_tokens, device, images)
        temps = _check(core, parts.pack, temperature, align)
        vision.check(model, parts.pack, images)
        fields.update(call=name, pack=pack_identity(parts.pack), max_rows=parts.max_rows,
                      temperature=temps, align=align, entropy=entropy, recompute=recompute,
                      training=core.training,
                      images=None if images is None else images.num_images)
    return parts, temps


def parts_refusal(core, train: bool = True) -> str | None:
    """What of the model ``core`` parts cannot run (besides pipeline parallelism and
    activation recomputation), or None."""
    experts = getattr(core.config, "expert_model_parallel_size", 1) or 1
    if experts > 1 and moe.has_moe(core):
        return (f"expert parallelism (expert_model_parallel_size={experts}): every forward's "
                "token all-to-all spans the expert-parallel ranks, which hold different trees "
                "and so run different numbers of parts, and a rank would wait on a forward "
                "its peers never run: split trees over the budget with treepack.plan (every "
                "rank as many packs)")
    losses = router_losses(core.config) if train and moe.has_moe(core) else None
    if losses:
        return (f"the MoE router's {losses} is a function of every row's routing, which no "
                "part holds alone: train trees over the budget without it "
                "(moe_aux_loss_coeff=0, moe_z_loss_coeff=None), or split them with "
                "treepack.plan")
    return None


def router_losses(config) -> str | None:
    """The MoE router losses ``config`` turns on (``"aux_loss and z_loss"``), or None: each
    is a function of every row's routing, which no part holds alone."""
    kinds = config.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeff = config.moe_aux_loss_coeff
    coeffs = [coeff] * len(kinds) if not isinstance(coeff, (list, tuple)) else list(coeff)
    losses = [k for k, c in zip(kinds, coeffs) if k != "none" and c]
    if config.moe_z_loss_coeff:
        losses.append("z_loss")
    return " and ".join(losses) or None


def backward_in_parts(model, sequences, loss_fn, *, max_tokens: int | None = None,
                      temperature=1.0, entropy: bool = False, align: str = "label",
                      recompute: bool | str = "auto", chunk_size: int | None = None,
                      images=None, backend: str = "auto") -> PartsResult:
    """One step's forward and backward over a tree too large for one forward, each row
    computed once (module doc): the loss and every gradient of one forward over the tree.

    Args:
        model: a prepared ``GPTModel`` (:func:`treepack.megatron.prepare`), or Megatron's
            wrapper of one, holding the whole model (no pipeline parallelism), without
            activation recomputation.
        sequences: the step's token sequences, a :class:`~treepack.TreePack` of them, or the
            :class:`~treepack.planning.parts.Parts` of one (built once for several passes).
            Every rank of the TP and CP groups passes the same.
        loss_fn: ``loss_fn(out, mask) -> scalar tensor``: ``out`` a
            :class:`~treepack.TokenLogprobs` (``[N, L]``) with one part's log-probs (and
            entropies), 0 elsewhere; ``mask`` bool, where they are. The step's loss is the
            sum over parts, so it must be a sum over predictions (for any other loss use
            :func:`step_in_parts`).
        max_tokens: the most rows one forward computes.
        temperature, entropy, align, chunk_size, images: as
            :func:`treepack.megatron.logprobs` (with ``images``, raw ``sequences`` are packed
            with their keys; each part encodes the images its rows need).
        backend: how each part attends (:func:`treepack.hf.backward_in_parts`'s): ``"auto"``
            (varlen where it applies, else segment's grouped calls), ``"varlen"`` or
            ``"segment"``.
        recompute: ``"auto"`` (a part with grandchildren runs its forward twice, keeping only
            what it hands below in between), ``True`` (every part with children) or ``False``.

    Returns:
        :class:`PartsResult`; gradients accumulated into the parameters (each CP rank its
        rows' share, as :func:`treepack.megatron.logprobs`).

    Raises:
        UnsupportedMegatron: pipeline parallelism, activation recomputation, MoE router
            losses; what :func:`treepack.megatron.logprobs` refuses.
        ValueError / Disagreement: as :func:`treepack.megatron.logprobs`; a missing
            ``max_tokens``.
    """
    if not torch.is_grad_enabled():
        raise RuntimeError("backward_in_parts needs gradients: call it outside torch.no_grad()")
    parts, temps = _prepare_call("backward_in_parts", model, sequences, max_tokens,
                                 temperature, align, entropy, recompute, train=True,
                                 images=images)
    run = _Run(model, parts, temps, entropy=entropy, align=align, train=True, loss_fn=loss_fn,
               recompute=recompute, chunk_size=chunk_size, images=images,
               backend=check_backend(backend))
    run.all()
    return PartsResult(run.loss, run.logprobs, run.entropy, len(parts.parts),
                       parts.rows_computed)


def logprobs_in_parts(model, sequences, *, max_tokens: int | None = None, temperature=1.0,
                      entropy: bool = False, align: str = "label",
                      chunk_size: int | None = None, images=None,
                      backend: str = "auto") -> TokenLogprobs:
    """:func:`treepack.megatron.logprobs` of a tree too large for one forward, without
    gradients: every row computed once, in parts of at most ``max_tokens`` rows (arguments as
    :func:`backward_in_parts`)."""
    parts, temps = _prepare_call("logprobs_in_parts", model, sequences, max_tokens,
                                 temperature, align, entropy, False, train=False, images=images)
    run = _Run(model, parts, temps, entropy=entropy, align=align, train=False, loss_fn=None,
               recompute=False, chunk_size=chunk_size, images=images, backend=check_backend(backend))
    with torch.no_grad():
        run.all()
    return TokenLogprobs(run.logprobs, run.entropy, align)


def step_in_parts(model, sequences, loss_fn, *, max_tokens: int | None = None,
                  temperature=1.0, entropy: bool = False, align: str = "label",
                  recompute: bool | str = "auto", chunk_size: int | None = None,
                  images=None, backend: str = "auto") -> PartsResult:
    """:func:`backward_in_parts` for any loss of the whole batch's outputs (a per-sequence
    mean, a sequence-level ratio): every log-prob (and entropy) without gradients, in parts;
    ``loss_fn(out, mask)`` once on them as leaves (``out`` the whole pack's
    :class:`~treepack.TokenLogprobs`, ``mask`` every prediction), its gradient with respect to
    each log-prob and entropy; then the parts' forwards and backwards with that gradient as
    their loss. The loss and every gradient are the whole batch's."""
    if not torch.is_grad_enabled():
        raise RuntimeError("step_in_parts needs gradients: call it outside torch.no_grad()")
    parts, temps = _prepare_call("step_in_parts", model, sequences, max_tokens, temperature,
                                 align, entropy, recompute, train=True, images=images)
    first = _Run(model, parts, temps, entropy=entropy, align=align, train=False,
                 loss_fn=None, recompute=False, chunk_size=chunk_size, images=images,
                 backend=check_backend(backend))
    replay = _rng_state()  # the second pass draws the first's dropout masks
    with torch.no_grad():
        first.all()
    logp = first.logprobs.requires_grad_()
    ent = None if first.entropy is None else first.entropy.requires_grad_()
    mask = torch.zeros(logp.numel(), dtype=torch.bool, device=logp.device)
    mask[torch.cat([p.where for p in first.predictions])] = True
    loss = loss_fn(TokenLogprobs(logp, ent, align), mask.view(logp.shape))
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError("loss_fn's loss does not depend on the log-probs or entropies it was "
                         "given: compute it from out.logprobs / out.entropy")
    leaves = [t for t in (logp, ent) if t is not None]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g_logp, g_ent = grads[0], (grads[1] if ent is not None else None)

    def surrogate(out: TokenLogprobs, part_mask: Tensor) -> Tensor:
        total = (out.logprobs * g_logp.where(part_mask, 0)).sum() \
            if g_logp is not None else out.logprobs.sum() * 0
        if g_ent is not None and out.entropy is not None:
            total = total + (out.entropy * g_ent.where(part_mask, 0)).sum()
        return total

    second = _Run(model, parts, temps, entropy=entropy, align=align, train=True,
                  loss_fn=surrogate, recompute=recompute, chunk_size=chunk_size, images=images,
                  backend=backend)
    after = _rng_state()
    _set_rng_state(replay)
    second.all()
    _set_rng_state(after)
    return PartsResult(loss.detach(), first.logprobs.detach(),
                       None if first.entropy is None else first.entropy.detach(),
                       len(parts.parts), parts.rows_computed)
