"""One pass over a tree's parts: each part's forward (through the one packed forward,
:func:`treepack.adapters.hf.packed.packed_forward`), its children's, then its backward.

The parts form a tree; a pass walks it depth-first with an explicit stack (a trajectory of a
thousand parts is a chain a thousand deep). In training, a part that has parts below it with
parts below them runs its forward twice (``recompute="auto"``): once without gradients before
its children, keeping only what it hands them, and once with gradients just before its
backward, replaying the random generators' state so that dropout draws the same masks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from treepack.adapters.hf.head import head_after
from treepack.adapters.hf.packed import packed_forward
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.adapters.hf.sequence_parallel import ROUTER_UNDER_SP, SequenceParallel, sharded
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.forwards import Carried, PartForward, Walk, part_predictions
from treepack.lean.predictions import logprobs_at
from treepack.planning.parts import Parts

__all__ = ["Run", "rng_state", "set_rng_state", "loss_tensor", "ROUTER_IN_PARTS",
           "reentrant_checkpoint"]


def reentrant_checkpoint() -> UnsupportedModel:
    """The refusal of a layer that runs without gradients during a training step."""
    return UnsupportedModel(
        "a layer ran its forward without gradients during a training step: reentrant "
        "activation checkpointing, whose backward would not see the gradients the parts below "
        "add to this part's keys and values. Use model.gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})")


class Run:
    """One pass over ``parts``: forwards depth-first, each part's backward (``train``) after
    its children's. Afterwards ``logprobs`` / ``entropy`` hold every prediction in the pack's
    layout, ``loss`` the sum of the parts' losses, ``router`` each part's router logits."""

    def __init__(self, model, parts: Parts, *, temperature, entropy: bool, align: str,
                 train: bool, kwargs: dict, loss_fn=None, recompute: bool | str = False,
                 router_grads: dict | None = None, sp: SequenceParallel | None = None,
                 backend: str = "auto"):
        check_align(align)
        self.backend = backend  # how each part attends (treepack.forwards.attend_part)
        self.model, self.parts, self.train, self.loss_fn = model, parts, train, loss_fn
        self.kwargs, self.want_entropy, self.align = kwargs, entropy, align
        self.router_grads = router_grads  # part -> per layer d(loss)/d(router logits)
        self.sp = sp  # each part's rows split over a sequence-parallel group
        self.slices: dict[int, tuple[int, int]] = {}  # part -> this rank's rows of it
        pack = parts.pack
        self.device = pack.device
        self.temperature = per_sequence_temperature(temperature, pack.num_sequences)
        self.walk = Walk(parts, train, recompute)
        self.carried = Carried(parts, train, reentrant_checkpoint)
        self.head = head_after(model) if parts.parts else "hidden"
        self.predictions = part_predictions(pack, parts.max_rows, align)
        dtype = torch.promote_types(unwrap(model).dtype, torch.float32)  # as normalise does
        self.logprobs = torch.zeros(tuple(pack.rows.shape), dtype=dtype, device=self.device)
        self.entropy = torch.zeros_like(self.logprobs) if entropy else None
        self.loss = torch.zeros((), dtype=dtype, device=self.device)
        self.router: dict[int, tuple] = {}  # part -> per layer [n, experts], no graph

    def all(self) -> None:
        """Every part: its forward, its children's (depth-first, in order), its backward."""
        # a part's loss is P times a rank's share under sequence parallelism, as sum_over's
        # backward
        self.walk.run_parts(self.carried, self.forward, self.outputs,
                            (lambda: rng_state(self.device), set_rng_state), train=self.train,
                            seed=1 if self.sp is None else self.sp.size)
        if self.sp is not None:  # every rank's predictions, everywhere
            for t in (self.logprobs, self.entropy, self.loss):
                if t is not None:
                    dist.all_reduce(t, group=self.sp.group)

    def forward(self, i: int):
        """Part ``i``'s forward: the packed forward's output and the part's router logits."""
        rows = torch.from_numpy(self.parts.parts[i].rows).to(self.device)
        mixers = PartForward(self.carried, i, UnsupportedModel, self.backend)
        if self.sp is not None:
            mixers = sharded(mixers, self.sp, rows.shape[0])
            rows, *self.slices[i] = self.sp.rows(rows)
        stream = contextlib.nullcontext() if self.sp is None else \
            self.sp.own_random_stream(self.model, self.device)
        with stream:
            out = packed_forward(self.model, self.parts.pack, self.kwargs, rows=rows,
                                 mixers=mixers, output=self.head)
        router = getattr(out.output, "router_logits", None)
        if router is not None and self.sp is not None:
            raise UnsupportedModel(ROUTER_UNDER_SP)
        if router is not None and self.train and self.router_grads is None:
            raise UnsupportedModel(ROUTER_IN_PARTS)
        return out, router

    def outputs(self, i: int, out, router) -> Tensor | None:
        """Part ``i``'s predictions placed in the pack's layout, and its loss."""
        predictions = self.predictions[i]
        if self.sp is not None:
            predictions = predictions.within(*self.slices[i])
        where, source = predictions.where, predictions.source
        loss = None
        if router is not None:
            self.router[i] = tuple(r.detach() for r in router)
            grads = (self.router_grads or {}).get(i)
            if grads is not None:  # the surrogate of a whole-step router loss
                loss = sum((r * g).sum() for r, g in zip(router, grads) if g is not None)
        if source.shape[0] == 0:
            if self.sp is not None and self.train and loss is None:
                loss = out.zero()
            return loss
        shape, numel = self.logprobs.shape, self.logprobs.numel()
        logprobs, entropy = logprobs_at(predictions, out.source(), self.temperature,
                                        entropy=self.want_entropy, numel=numel)
        mask = torch.zeros(numel, dtype=torch.bool, device=self.device)
        mask[where] = True
        self.logprobs.view(-1)[where] = logprobs[where].detach().to(self.logprobs.dtype)
        if entropy is not None:
            self.entropy.view(-1)[where] = entropy[where].detach().to(self.entropy.dtype)
            entropy = entropy.view(shape)
        if self.loss_fn is None:
            return loss
        part_loss = loss_tensor(self.loss_fn(TokenLogprobs(logprobs.view(shape), entropy,
                                                           self.align), mask.view(shape)))
        self.loss = self.loss + part_loss.detach()
        return part_loss if loss is None else part_loss + loss


ROUTER_IN_PARTS = (
    "the model returns router logits (output_router_logits, in its config or given), and the "
    "load-balancing loss of a step is a function of every row's routing, which no part holds "
    "alone: use hf.step_in_parts (its loss gets the step's router loss as outputs.aux_loss), "
    "or pass output_router_logits=False to train without it")


def loss_tensor(value, name: str = "loss_fn") -> Tensor:
    """``value`` if it is a scalar tensor; else the error naming what it is."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} returned a {type(value).__name__}: it must return a scalar "
                        "tensor computed from the outputs it is given, e.g. "
                        "(-out.logprobs * weights).where(mask, 0).sum()")
    if value.dim() != 0:
        raise ValueError(f"{name} returned a tensor of shape {tuple(value.shape)}: reduce it "
                         "to a scalar (a sum over predictions)")
    return value


def rng_state(device: torch.device) -> tuple:
    """The random generators a forward draws dropout from: the CPU's, and the device's."""
    cuda = device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None, device


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], state[2])
