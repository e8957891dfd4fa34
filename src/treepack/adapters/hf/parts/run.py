"""One pass over a tree's parts: each part's forward (through the one packed forward,
:func:`treepack.adapters.hf.packed.packed_forward`), its children's, then its backward.

The parts form a tree; a pass walks it depth-first with an explicit stack (a trajectory of a
thousand parts is a chain a thousand deep). In training, a part that has parts below it with
parts below them runs its forward twice (``recompute="auto"``): once without gradients before
its children, keeping only what it hands them, and once with gradients just before its
backward, replaying the random generators' state so that dropout draws the same masks.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.head import check_lm_head, head_refusal
from treepack.adapters.hf.packed import packed_forward
from treepack.adapters.hf.parts.carried import Carried, PartForward
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.core.derived import derived_from_pack
from treepack.core.outputs import (TokenLogprobs, check_align, per_sequence_temperature,
                                   sequence_of)
from treepack.core.softmax import Head, Logits, normalise
from treepack.core.tree import TreePack
from treepack.planning.parts import Parts, split

__all__ = ["Run", "rng_state", "set_rng_state", "loss_tensor", "ROUTER_IN_PARTS"]


class Run:
    """One pass over ``parts``: forwards depth-first, each part's backward (``train``) after
    its children's. Afterwards ``logprobs`` / ``entropy`` hold every prediction in the pack's
    layout, ``loss`` the sum of the parts' losses, ``router`` each part's router logits."""

    def __init__(self, model, parts: Parts, *, temperature, entropy: bool, align: str,
                 train: bool, kwargs: dict, loss_fn=None, recompute: bool | str = False,
                 router_grads: dict | None = None):
        check_align(align)
        if recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={recompute!r}: use 'auto', True or False")
        self.model, self.parts, self.train, self.loss_fn = model, parts, train, loss_fn
        self.kwargs, self.want_entropy, self.align = kwargs, entropy, align
        self.router_grads = router_grads  # part -> per layer d(loss)/d(router logits)
        pack = parts.pack
        self.device = pack.device
        self.temperature = per_sequence_temperature(temperature, pack.num_sequences)
        self.children = collections.defaultdict(list)  # part -> the parts hanging off it
        for j, part in enumerate(parts.parts):
            self.children[part.parent].append(j)
        self.carried = Carried(parts, train)
        self.head = _head(model) if parts.parts else "hidden"
        self.recomputed = set()
        if train and recompute:
            below = {j for j in self.children if j >= 0}  # parts with parts below them
            self.recomputed = below if recompute is True else {
                j for j in below if any(c in below for c in self.children[j])}
        self.predictions = part_predictions(pack, parts.max_rows, align)
        dtype = torch.promote_types(unwrap(model).dtype, torch.float32)  # as normalise does
        self.logprobs = torch.zeros(tuple(pack.rows.shape), dtype=dtype, device=self.device)
        self.entropy = torch.zeros_like(self.logprobs) if entropy else None
        self.loss = torch.zeros((), dtype=dtype, device=self.device)
        self.router: dict[int, tuple] = {}  # part -> per layer [n, experts], no graph
        self._losses: dict[int, Tensor | None] = {}
        self._rng: dict[int, tuple] = {}

    def all(self) -> None:
        """Every part: its forward, its children's (depth-first, in order), its backward."""
        stack = [(i, False) for i in reversed(self.children[-1])]
        while stack:
            i, children_done = stack.pop()
            if children_done:
                self._leave(i)
                continue
            self._enter(i)
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(self.children[i]))

    def _enter(self, i: int) -> None:
        if i in self.recomputed:  # a first forward for the parts below only: no graph kept
            self._rng[i] = rng_state(self.device)
            with torch.no_grad(), self.carried.recomputed(i, "first"):
                self.forward(i)
        else:
            self._losses[i] = self.outputs(i, *self.forward(i))

    def _leave(self, i: int) -> None:
        if i in self.recomputed:  # again, with the same dropout masks, for the backward
            after = rng_state(self.device)
            set_rng_state(self._rng.pop(i))
            with self.carried.recomputed(i, "second"):
                self._losses[i] = self.outputs(i, *self.forward(i))
            set_rng_state(after)
        loss = self._losses.pop(i, None)
        if self.train:
            tensors, grads = self.carried.backward_inputs(i)
            if loss is not None and loss.requires_grad:
                tensors, grads = [loss, *tensors], [torch.ones_like(loss), *grads]
            if tensors:
                torch.autograd.backward(tensors, grads)
        self.carried.release(i)

    def forward(self, i: int):
        """Part ``i``'s forward: the packed forward's output and the part's router logits."""
        rows = torch.from_numpy(self.parts.parts[i].rows).to(self.device)
        out = packed_forward(self.model, self.parts.pack, self.kwargs, rows=rows,
                             mixers=PartForward(self.carried, i), output=self.head)
        router = getattr(out.output, "router_logits", None)
        if router is not None and self.train and self.router_grads is None:
            raise UnsupportedModel(ROUTER_IN_PARTS)
        return out, router

    def outputs(self, i: int, out, router) -> Tensor | None:
        """Part ``i``'s predictions placed in the pack's layout, and its loss."""
        where, seq, source, token, real = self.predictions[i]
        loss = None
        if router is not None:
            self.router[i] = tuple(r.detach() for r in router)
            grads = (self.router_grads or {}).get(i)
            if grads is not None:  # the surrogate of a whole-step router loss
                loss = sum((r * g).sum() for r, g in zip(router, grads) if g is not None)
        if source.shape[0] == 0:
            return loss
        # one normalised row per (source row, temperature), rows ascending
        normalised, pick = np.unique(np.stack((source, self.temperature[seq])), axis=1,
                                     return_inverse=True)
        pick = pick.reshape(-1)
        if self.head == "hidden":
            h = out.head
            logits = Head(out.hidden, h["weight"], h.get("bias"), scale=h.get("scale", 1.0),
                          softcap=h.get("softcap"))
        else:
            logits = Logits(out.output.logits[0])
        logp, ent = normalise(logits, normalised[0].astype(np.int64), normalised[1], pick,
                              token, entropy=self.want_entropy)
        if real is not None:  # a sequence's last row: its entropy only
            logp = logp.where(real, 0)
        shape, numel = self.logprobs.shape, self.logprobs.numel()
        mask = torch.zeros(numel, dtype=torch.bool, device=self.device)
        mask[where] = True
        logprobs = logp.new_zeros(numel).index_put((where,), logp)
        self.logprobs.view(-1)[where] = logp.detach().to(self.logprobs.dtype)
        entropy = None
        if ent is not None:
            ent = ent[torch.from_numpy(pick).to(ent.device)]  # per prediction
            entropy = ent.new_zeros(numel).index_put((where,), ent).view(shape)
            self.entropy.view(-1)[where] = ent.detach().to(self.entropy.dtype)
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


def _head(model) -> str:
    """Where a part's log-probs come from: the LM head from the part's hidden states where
    treepack can read it (:func:`treepack.hf.lm_head`), else the model's own logits for the
    part's rows (a head it cannot read, a LoRA head with dropout)."""
    if head_refusal(unwrap(model).get_output_embeddings()) is not None:  # as it is now
        return "logits"
    try:
        check_lm_head(model)
    except UnsupportedModel:
        return "logits"
    return "hidden"


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


class PartPredictions(NamedTuple):
    """One part's predictions: where they go in the pack's (flattened) layout, their
    sequences and source rows among the part's rows (host), their target tokens, and which of
    them predict a token (None: all; ``"prediction"`` alignment also normalises each
    sequence's last row, for its entropy)."""

    where: Tensor
    seq: np.ndarray
    source: np.ndarray
    token: Tensor
    real: Tensor | None


@derived_from_pack
def part_predictions(pack: TreePack, budget: int, align: str) -> list[PartPredictions]:
    parts = split(pack, budget)
    h = pack.host
    if align == "label":
        where, source, token = h.prediction_index, h.prediction_source, h.prediction_target
        real = np.ones(where.shape[0], dtype=bool)
    else:  # every position; the log-prob of the next token where there is one
        flat_rows = h.rows.reshape(-1)
        where = np.flatnonzero(flat_rows >= 0)
        source = flat_rows[where]
        token_at = np.zeros(flat_rows.shape[0], dtype=np.int64)
        real_at = np.zeros(flat_rows.shape[0], dtype=bool)
        token_at[h.prediction_index - 1] = h.prediction_target
        real_at[h.prediction_index - 1] = True
        token, real = token_at[where], real_at[where]
    seq = sequence_of(h, where)
    local = parts.local[source]
    order = np.lexsort((local, parts.part_of[source]))  # by part, then source row
    counts = np.bincount(parts.part_of[source], minlength=len(parts.parts))
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(pack.device)  # noqa: E731
    return [PartPredictions(move(where[sel]), seq[sel], local[sel], move(token[sel]),
                            None if real[sel].all() else move(real[sel]))
            for sel in np.split(order, np.cumsum(counts)[:-1])]


def rng_state(device: torch.device) -> tuple:
    """The random generators a forward draws dropout from: the CPU's, and the device's."""
    cuda = device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None, device


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], state[2])
