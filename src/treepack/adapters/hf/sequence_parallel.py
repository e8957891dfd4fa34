"""Sequence parallelism on a tree (Ulysses): one pack over the ranks of a process group.

Every rank of the group holds the whole pack (its tree is O(T') integers) and computes a
contiguous slice of its rows: rank r the rows ``r·w .. (r + 1)·w - 1`` with ``w = ⌈T' / P⌉``
(the last ranks pad their slice with copies of a row whose outputs nothing reads).
Everything row-wise (embeddings, norms, MLPs, rotary at each row's depth, the LM head) runs
on the slice. Each token mixer exchanges its inputs across the group, all-to-all, from (own
rows, all heads) to (all rows, own heads), runs the tree over every row for its heads and
sends the result back the same way: attention by query and key/value heads (key/value heads
repeated up to a multiple of P where there are fewer), a short convolution by channels, a
Gated DeltaNet scan by heads. Each exchange is an autograd function whose backward is the
reverse exchange, so the backward is the tree's.

The log-probs of a prediction are computed on the rank holding its source row and summed
over the group into the caller's layout; that sum's backward hands each rank the gradient of
its own predictions times P. So each rank's parameter gradients are P times its rows' share,
and averaging them over the group, what DDP and FSDP do over a mesh that holds it (verl's
``dp × sp``), gives the gradient of the whole pack; :func:`average_gradients` does it for a
model that is not wrapped.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from treepack.adapters.fsdp import sync
from treepack.adapters.hf.head import check_head, head_after, head_refusal
from treepack.adapters.hf.moe import weighted_router_aux_loss
from treepack.adapters.hf.packed import check_inputs, check_pack, packed_forward
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import UnsupportedModel
from treepack.attention import exchange
from treepack.core.agreement import (Label, PackIdentity, agreement, pack_identity,
                                     parameters_fingerprint)
from treepack.core.multiplicity import row_multiplicity
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.tree import TreePack
from treepack.forwards.mixers import PackForward, ShardedForward, TreeForward
from treepack.forwards.plans import part_predictions
from treepack.lean.predictions import logprobs_at

__all__ = ["SequenceParallel", "sharded", "sequence_parallel", "sum_over",
           "average_gradients", "agreed", "pack_identity", "PackIdentity", "logprobs",
           "head_dtype_refusal", "ROUTER_UNDER_SP", "HINTS"]


class SequenceParallel:
    """A process group over which each pack's rows are split; this rank's place in it."""

    def __init__(self, group):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("sequence_parallel needs torch.distributed: call "
                             "torch.distributed.init_process_group first")
        outside = group is dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives others
        if not outside and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"sequence_parallel must be a torch.distributed ProcessGroup "
                            f"(dist.new_group(ranks)), got {type(group).__name__}")
        rank = -1 if outside else dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the "
                "sequence_parallel group it was given: every rank calls dist.new_group for "
                "every group, and passes the one that holds it")
        self.group, self.rank, self.size = group, rank, dist.get_world_size(group)

    @contextlib.contextmanager
    def own_random_stream(self, model, device: torch.device):
        """While it lasts, this rank draws its random numbers (the dropout masks of its rows,
        and of its heads in attention) from a stream of its own
        (:func:`treepack.attention.exchange.rank_stream`); the parts calls replay the draw by
        restoring the global generators. A model in eval mode draws nothing: the global
        generators are left as they are."""
        if not unwrap(model).training:
            yield
            return
        with exchange.rank_stream(self.rank, device):
            yield

    def share(self, total: int) -> tuple[int, int, int]:
        """``(start, stop, width)``: this rank's rows among ``total`` (``start .. stop - 1``)
        and the rows every rank computes (its own, padded)."""
        width = max(1, -(-total // self.size))
        start = min(total, self.rank * width)
        return start, min(total, start + width), width

    def rows(self, rows: Tensor) -> tuple[Tensor, int, int]:
        """This rank's slice of ``rows`` (a forward's rows of the pack), padded to the group's
        width with copies of a row; and where it starts and stops among them."""
        start, stop, width = self.share(rows.shape[0])
        mine = rows[start:stop]
        if mine.shape[0] < width:
            fill = rows[-1:] if rows.shape[0] else torch.zeros(1, dtype=rows.dtype,
                                                               device=rows.device)
            mine = torch.cat((mine, fill.expand(width - mine.shape[0])))
        return mine, start, stop


def sequence_parallel(group) -> SequenceParallel | None:
    """``group`` as a :class:`SequenceParallel` (None stays None)."""
    if group is None or isinstance(group, SequenceParallel):
        return group
    return SequenceParallel(group)


# ------------------------------------------------------------------------ the exchanges


def sum_over(x: Tensor, sp: SequenceParallel) -> Tensor:
    """Every rank's ``x`` (its own predictions, zeros elsewhere) summed over the group; the
    gradient back is P times the caller's (each rank's parameters then hold P times its
    share, whose average over the group is the whole pack's)."""
    return exchange.sum_over(x, sp.group, sp.size)


def sharded(inner: TreeForward, sp: SequenceParallel, total: int) -> ShardedForward:
    """``inner``'s mixers (over all ``total`` rows of the forward) for this rank's slice of
    the rows: every mixer's inputs exchanged to this rank's heads (:class:`~treepack.forwards
    .ShardedForward`)."""
    return ShardedForward(inner, exchange.HeadExchange(sp.group, sp.rank, sp.size, total,
                                                       sp.share(total)[2],
                                                       error=UnsupportedModel))


# --------------------------------------------------------------------------- log-probs


ROUTER_UNDER_SP = (
    "the model returns router logits (output_router_logits, in its config or given), and in "
    "parts under sequence parallelism the load-balancing loss, a function of every row's "
    "routing, is held by no part of any rank: run the tree in one forward (hf.logprobs with "
    "sequence_parallel= returns it as aux_loss) or pass output_router_logits=False")


def logprobs(model, pack: TreePack, sp: SequenceParallel, *, head: str, entropy: bool,
             temperature, align: str, backend: str, chunk_size: int | None,
             head_dtype: torch.dtype | None, block_size: int, kwargs: dict) -> TokenLogprobs:
    """:func:`treepack.hf.logprobs` with the pack's rows split over ``sp``: this rank's
    slice through the one packed forward, its predictions' log-probs, and all of them summed
    over the group into the pack's layout (every rank gets the whole result). Every rank
    checks its inputs, then the group agrees on them (:func:`agreed`) before the first
    exchange."""
    with agreed(sp, "logprobs", model, pack, kwargs) as fields:
        check_head(head, head_dtype)
        temps = per_sequence_temperature(temperature, pack.num_sequences)
        check_align(align)
        check_inputs(model, pack, {k: v for k, v in kwargs.items() if k != "images"},
                     images=kwargs.get("images"))
        output = head_after(model) if head in ("auto", "inside") else head
        if head_dtype is not None and output == "logits":
            raise UnsupportedModel(head_dtype_refusal(model, head_dtype))
        fields.update(head=head, output=output, entropy=entropy, temperature=temps,
                      align=align, backend=backend, head_dtype=head_dtype,
                      block_size=block_size)
    rows, start, stop = sp.rows(torch.arange(pack.num_rows, device=pack.device))
    mixers = sharded(PackForward(pack, backend, block_size), sp, pack.num_rows)
    with sp.own_random_stream(model, pack.device):
        out = packed_forward(model, pack, kwargs, rows=rows, mixers=mixers, output=output)
    aux, router = _router_loss(model, pack, sp, out.output, start, stop)
    if head_dtype is not None:
        out = out._replace(hidden=out.hidden.to(head_dtype), head={
            k: v.to(head_dtype) if isinstance(v, Tensor) else v for k, v in out.head.items()})
    shape = tuple(pack.rows.shape)
    numel = math.prod(shape)
    dtype = torch.promote_types(unwrap(model).dtype, torch.float32)
    mine = part_predictions(pack, None, align)[0].within(start, stop)
    if mine.source.shape[0]:
        logp, ent = logprobs_at(mine, out.source(), temps, entropy=entropy, numel=numel,
                                chunk_size=chunk_size)
    else:  # nothing predicted from these rows; the backward still runs their exchanges
        logp = torch.zeros(numel, dtype=dtype, device=pack.device) + out.zero()
        ent = logp if entropy else None
    logp = sum_over(logp.to(dtype), sp).view(shape)
    ent = None if ent is None else sum_over(ent.to(dtype), sp).view(shape)
    return TokenLogprobs(logp, ent, align, aux_loss=aux, router_logits=router)


def _router_loss(model, pack: TreePack, sp: SequenceParallel, output, start: int, stop: int):
    """An MoE model's load-balancing loss of the pack's original tokens and its router
    logits of every row, or ``(None, None)``. The loss is a function of every row's routing,
    so each rank's rows' logits (``start .. stop - 1``; the slice's padding copies dropped)
    are summed over the group into the whole pack's, on every rank, whose gradient comes
    back to each rank's own rows as the log-probs' does (:func:`sum_over`)."""
    router = getattr(output, "router_logits", None)
    if router is None:
        return None, None
    whole = []
    for layer in router:
        layer = layer.reshape(-1, layer.shape[-1])[:stop - start]
        at = torch.arange(start, stop, device=layer.device)
        rows = layer.new_zeros((pack.num_rows, layer.shape[-1])).index_copy(0, at, layer)
        whole.append(sum_over(rows, sp))
    whole = tuple(whole)
    return weighted_router_aux_loss(model, whole, row_multiplicity(pack)), whole


def head_dtype_refusal(model, head_dtype) -> str:
    """Why ``head_dtype`` cannot be honoured: the lean head cannot read this model's head, so
    its logits come from the model's own head, in the model's dtype."""
    core = unwrap(model)
    why = head_refusal(core.get_output_embeddings()) or (
        "it transforms its logits after the head in a way treepack does not know")
    return (f"head_dtype={head_dtype} runs the LM head's matmul in that dtype through "
            f"treepack's lean head, which cannot read {type(core).__name__}'s head ({why}): "
            "drop head_dtype (TRL: cast_lm_head_to_fp32=False, which TRL itself requires for "
            "a head carrying a PEFT adapter), or make the head a plain Linear")


# ----------------------------------------------------------------------------- checks


HINTS = {  # what to change when a field differs between the ranks of a group
    "pack": "they were given different packs, and every rank of a group must pass the same "
            "pack, built from the same sequences in "
            "the same order (give each group's ranks the same batch, as verl's dispatch and "
            "treepack.plan do)",
    "weights": "the ranks hold different weights (checked the first time each model meets "
               "a group): give every rank of the group the same model (load one checkpoint, "
               "seed alike, or let DDP / FSDP broadcast it)",
    "gradients": "call under torch.no_grad() on every rank of the group, or on none",
    "training": "put the model in train() or eval() mode alike on every rank",
}


def _digest(value) -> Label:
    return Label(value if isinstance(value, str) else f"checksum {value:016x}")


@contextlib.contextmanager
def agreed(sp: SequenceParallel | None, call: str, model, pack: TreePack | None,
           kwargs: dict):
    """:func:`treepack.core.agreement.agreement` over ``sp``'s group (nothing without one),
    with the fields every sequence-parallel call shares: the call, the pack (None: the block
    builds it and adds ``pack``), the weights, the model's keyword arguments, the images,
    gradient mode and train mode. The block runs this rank's own checks and adds the call's
    other arguments."""
    with agreement(None if sp is None else sp.group, "sequence_parallel group", HINTS) as fields:
        if sp is not None:
            if pack is not None:
                check_pack(pack)
                fields["pack"] = pack_identity(pack)
            core = unwrap(model)
            images = kwargs.get("images")
            fields.update(call=call,
                          weights=_digest(parameters_fingerprint(core)),
                          kwargs={k: v for k, v in kwargs.items() if k != "images"},
                          images=None if images is None else list(images.keys),
                          gradients=torch.is_grad_enabled(), training=core.training)
        yield fields


def average_gradients(model, group) -> None:
    """Average ``model``'s gradients over ``group``: for a model outside DDP / FSDP after a
    backward under sequence parallelism, the whole pack's gradient on every rank.

    Args:
        model: the model whose parameters' ``.grad`` to average (in place); a parameter
            without one on this rank is left alone, so every rank must have the same ones
            (a sequence-parallel backward gives every rank the same).
        group: the ``torch.distributed`` process group of the backward's
            ``sequence_parallel``.

    Returns:
        None; one all-reduce per bucket of about 25 MiB of one dtype, as DDP's reducer.
    """
    sync.average_gradients(model, group)
