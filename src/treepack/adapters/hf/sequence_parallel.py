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
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from treepack.adapters.hf.head import check_head, head_after, head_refusal
from treepack.adapters.hf.packed import check_inputs, check_pack, packed_forward
from treepack.adapters.hf.predictions import part_predictions, place, zero_of
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import TreeForward, UnsupportedModel
from treepack.core.agreement import Label, agreement, fingerprint, parameters_fingerprint
from treepack.core.derived import derived_from_pack
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.tree import TreePack

__all__ = ["SequenceParallel", "ShardedForward", "sequence_parallel", "sum_over",
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
        and of its heads in attention) from a stream of its own: seeded from one draw of the
        global CPU generator, the same on every rank seeded alike, and this rank. Ranks seeded
        alike would otherwise draw one mask for row i on rank 0 and row i + w on rank 1.
        Recomputation replays it: activation checkpointing saves the generators' state inside
        the stream, and the parts calls replay the draw by restoring the global state. A
        model in eval mode draws nothing: the global generators are left as they are."""
        if not unwrap(model).training:
            yield
            return
        draw = int(torch.randint(0, 2**62, (1,)).item())
        seed = (draw * 0x9E3779B97F4A7C15 + self.rank + 1) % 2**63
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            if devices:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
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


def _all_to_all(x: Tensor, scatter: int, gather: int, group) -> Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), gather)


class _Exchange(torch.autograd.Function):
    """All-to-all: ``x`` cut into P pieces along ``scatter``, piece j to rank j, the pieces
    received joined along ``gather`` in rank order. Its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter: int, gather: int, group) -> Tensor:
        ctx.dims, ctx.group = (scatter, gather), group
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter, gather = ctx.dims
        return _all_to_all(grad, gather, scatter, ctx.group), None, None, None


class _Sum(torch.autograd.Function):
    """The sum over the group of every rank's ``x``; its backward hands each rank the
    gradient times ``scale`` (every rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, scale: float) -> Tensor:
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None, None


def sum_over(x: Tensor, sp: SequenceParallel) -> Tensor:
    """Every rank's ``x`` (its own predictions, zeros elsewhere) summed over the group; the
    gradient back is P times the caller's (each rank's parameters then hold P times its
    share, whose average over the group is the whole pack's)."""
    return _Sum.apply(x, sp.group, float(sp.size))


class ShardedForward(TreeForward):
    """The token mixers of one rank's slice: every mixer's inputs exchanged to (all rows,
    this rank's heads or channels), ``inner``'s mixer over all rows, and back.

    Args:
        inner: the mixers over all the forward's rows (the pack's :class:`TreeForward`, or a
            part's :class:`~.parts.carried.PartForward`).
        sp: the group.
        total: the forward's rows (the pack's, or the part's).
    """

    def __init__(self, inner: TreeForward, sp: SequenceParallel, total: int):
        self.inner, self.sp, self.total, self.pack = inner, sp, total, inner.pack
        self.calls = 0
        self.windowed = 0
        self.mixer_calls = type(inner.mixer_calls)()

    def _split(self, count: int, what: str, owner: str) -> tuple[int, int]:
        if count % self.sp.size:
            raise UnsupportedModel(
                f"{owner} has {count} {what}, which sequence parallelism over "
                f"{self.sp.size} ranks cannot split evenly: use a group size that divides "
                f"{count}")
        each = count // self.sp.size
        return self.sp.rank * each, (self.sp.rank + 1) * each

    def _to_heads(self, x: Tensor, heads: int, rows: int) -> Tensor:
        """(own rows, all heads) -> (all rows, own heads), ``rows`` cut to the forward's."""
        x = _Exchange.apply(x.contiguous(), heads, rows, self.sp.group)
        return x.narrow(rows, 0, self.total)

    def _to_rows(self, x: Tensor, rows: int, heads: int) -> Tensor:
        """(all rows, own heads) -> (own rows, all heads)."""
        width = self.sp.share(self.total)[2]
        pad = width * self.sp.size - self.total
        if pad:
            shape = list(x.shape)
            shape[rows] = pad
            x = torch.cat((x, x.new_zeros(shape)), rows)
        return _Exchange.apply(x.contiguous(), rows, heads, self.sp.group)

    def attend(self, module, query, key, value, **kwargs):
        owner = type(module).__name__
        heads, kv = query.shape[1], key.shape[1]
        self._split(heads, "attention heads", owner)
        if kv % self.sp.size:  # fewer key/value heads than ranks: repeat each one
            repeat = math.lcm(kv, self.sp.size) // kv
            if heads % (kv * repeat):
                self._split(kv, "key/value heads", owner)
            key = key.repeat_interleave(repeat, 1)
            value = value.repeat_interleave(repeat, 1)
        q, k, v = self._qkv_to_heads(query, key, value)
        return self._to_rows(self.inner.attend(module, q, k, v, **kwargs), 2, 1)

    def _qkv_to_heads(self, query: Tensor, key: Tensor, value: Tensor):
        """The three in one exchange where their head widths agree: each rank's piece holds
        its query, key and value heads side by side."""
        if not query.shape[3] == key.shape[3] == value.shape[3]:
            return tuple(self._to_heads(t, 1, 2) for t in (query, key, value))
        p, (_, h, n, d), kv = self.sp.size, query.shape, key.shape[1]
        joined = torch.cat([t.reshape(1, p, t.shape[1] // p, n, d) for t in (query, key, value)],
                           2).reshape(1, -1, n, d)
        return self._to_heads(joined, 1, 2).split((h // p, kv // p, kv // p), 1)

    def conv(self, x, weight, bias):
        lo, hi = self._split(x.shape[1], "channels", "a short convolution")
        out = self.inner.conv(self._to_heads(x, 1, 0), weight[lo:hi],
                              None if bias is None else bias[lo:hi])
        return self._to_rows(out, 0, 1)

    def scan(self, kernel, inputs):
        # a Gated DeltaNet scan repeats its query / key heads up to the value heads inside
        # the kernel (transformers 5.11 on): repeated here instead, so that a rank's heads
        # are whole
        counts = sorted({t.shape[1] for t in inputs.values()})
        heads = counts[-1]
        if any(heads % c for c in counts):
            raise UnsupportedModel(f"a recurrent scan whose inputs have {counts} heads: "
                                   "sequence parallelism splits a scan by heads")
        self._split(heads, "heads", "a recurrent scan (Gated DeltaNet)")
        inputs = {k: self._to_heads(t if t.shape[1] == heads else
                                    t.repeat_interleave(heads // t.shape[1], 1), 1, 0)
                  for k, t in inputs.items()}
        return self._to_rows(self.inner.scan(kernel, inputs), 0, 1)


# --------------------------------------------------------------------------- log-probs


ROUTER_UNDER_SP = (
    "the model returns router logits (output_router_logits, in its config or given), and the "
    "load-balancing loss is a function of every row's routing, which no rank of a "
    "sequence-parallel group holds alone: pass output_router_logits=False")


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
    mixers = ShardedForward(TreeForward(pack, backend, block_size), sp, pack.num_rows)
    with sp.own_random_stream(model, pack.device):
        out = packed_forward(model, pack, kwargs, rows=rows, mixers=mixers, output=output)
    if getattr(out.output, "router_logits", None) is not None:
        raise UnsupportedModel(ROUTER_UNDER_SP)
    if head_dtype is not None:
        out = out._replace(hidden=out.hidden.to(head_dtype), head={
            k: v.to(head_dtype) if isinstance(v, Tensor) else v for k, v in out.head.items()})
    shape = tuple(pack.rows.shape)
    numel = math.prod(shape)
    dtype = torch.promote_types(unwrap(model).dtype, torch.float32)
    mine = part_predictions(pack, None, align)[0].within(start, stop)
    if mine.source.shape[0]:
        logp, ent = place(mine, out, temps, entropy=entropy, numel=numel,
                          chunk_size=chunk_size)
    else:  # nothing predicted from these rows; the backward still runs their exchanges
        logp = torch.zeros(numel, dtype=dtype, device=pack.device) + zero_of(out)
        ent = logp if entropy else None
    logp = sum_over(logp.to(dtype), sp).view(shape)
    ent = None if ent is None else sum_over(ent.to(dtype), sp).view(shape)
    return TokenLogprobs(logp, ent, align)


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


class PackIdentity(NamedTuple):
    """A pack as the ranks of a group compare it: its rows and a digest of its contents."""

    rows: int
    digest: int

    def __repr__(self) -> str:
        return f"{self.rows} rows"


@derived_from_pack
def pack_identity(pack: TreePack) -> PackIdentity:
    """The pack's rows and a digest of its ids, structure, layout and content keys."""
    h = pack.host
    keys = () if h.row_keys is None else (h.row_keys,)
    return PackIdentity(pack.num_rows, fingerprint(
        [h.input_ids, h.parent_row, h.position_ids, h.rows, *keys]))


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
        None; one all-reduce per gradient dtype.
    """
    size = dist.get_world_size(group)
    by_dtype: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():  # one collective per dtype
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
