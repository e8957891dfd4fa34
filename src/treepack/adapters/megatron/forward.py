"""A megatron-core ``GPTModel`` over a :class:`~treepack.TreePack`: prepared once, then log-probs
from one forward over the tree's rows.

The model sees the pack's rows as one sequence (``[1, rows]``) at their depths
(:mod:`.rotary`), with every layer's core attention over the tree (:mod:`.attention`), which a
:class:`MegatronForward` reaches through ``packed_seq_params``. Megatron's own parallelism stays:

- **Tensor parallelism.** Each rank's core attention gets its heads; the LM head is
  vocab-parallel and the log-softmax runs on each rank's share of the vocabulary, its max,
  sum and picked logits all-reduced (:func:`treepack.core.softmax.normalise` with a
  ``vocab_group``): no rank holds ``[T', V]`` logits.
- **Megatron sequence parallelism** (``config.sequence_parallel``): the rows are split over the
  TP ranks for norms and dropout and gathered before attention, as Megatron does; a forward's
  rows are padded to a multiple of the TP size with copies of a row whose outputs nothing
  reads.
- **Context parallelism.** The pack's rows are split over the CP ranks (a contiguous slice
  each, padded the same way); each attention layer exchanges rows for heads all-to-all
  (:class:`treepack.attention.exchange.HeadExchange`), runs the tree over every row for its
  heads, and exchanges back. A multi-latent attention layer's keys and values travel as
  latents instead, up-projected on each rank for its heads (:mod:`.latent`); a Gated
  DeltaNet or Mamba2 layer's convolution and scan go through the same exchange
  (:mod:`.recurrent`).
  Each rank's predictions are placed in ``[N, L]`` and summed over the CP group, whose
  backward hands each rank its own share: each CP rank's parameter gradients are its rows'
  share, and their sum over the group (what Megatron's DDP reduces over data x context
  parallel ranks) is the pack's.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np
import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp

from treepack.adapters.megatron import compat, latent, moe, recurrent, rotary, vision
from treepack.adapters.megatron.attention import (TreePackedSeqParams, UnsupportedMegatron,
                                                  swap, tree_layers)
from treepack.attention.exchange import HeadExchange, rank_stream, sum_over
from treepack.core.agreement import agreement, pack_identity
from treepack.core.compat import replaced
from treepack.core.multiplicity import row_multiplicity
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.softmax import Head
from treepack.core.tree import TreePack
from treepack.forwards.mixers import PackForward, ShardedForward, TreeForward
from treepack.lean.predictions import forward_predictions, logprobs_at

__all__ = ["prepare", "logprobs", "forward_stage", "forward_step", "StageOutput", "unwrap",
           "MegatronForward", "is_prepared"]

_PREPARED: weakref.WeakSet = weakref.WeakSet()


def unwrap(model):
    """The language model inside Megatron's wrappers (DDP, ``Float16Module``, a list of one
    virtual-pipeline chunk): a ``GPTModel``, or a ``MambaModel`` (a hybrid of Mamba2,
    attention and MLP layers; ``HybridModel`` from megatron-core 0.19 on); in a
    vision-language model (a ``vision_model`` beside a ``language_model``), its language
    model (:mod:`.vision`).

    Raises:
        TypeError: no such model inside.
    """
    kinds = _model_classes()
    inner = model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model
    seen = 0
    while not isinstance(inner, kinds) and seen < 8:
        if isinstance(getattr(inner, "language_model", None), kinds):  # a vision-language
            inner = inner.language_model  # model: its language model (.vision)
            break
        if not hasattr(inner, "module"):
            break
        inner, seen = inner.module, seen + 1
    if not isinstance(inner, kinds):
        raise TypeError(f"treepack.megatron runs a megatron-core GPTModel or MambaModel (or a "
                        f"wrapper of one: DDP, Float16Module; or a vision-language model "
                        f"around one), got {type(model).__name__}")
    return inner


def _model_classes() -> tuple[type, ...]:
    """The megatron-core language models :func:`unwrap` finds."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    try:  # megatron-core 0.19 on: HybridModel (MambaModel a subclass of it)
        from megatron.core.models.hybrid.hybrid_model import HybridModel as Hybrid
    except ImportError:
        try:
            from megatron.core.models.mamba.mamba_model import MambaModel as Hybrid
        except ImportError:  # pragma: no cover - a megatron-core without either
            return (GPTModel,)
    return GPTModel, Hybrid


def prepare(model):
    """Ready a built ``GPTModel`` (or a wrapper of one) for trees: its layers' core attention
    becomes :class:`~.attention.TreeCoreAttention` (already so for a model built from
    :func:`~.attention.layer_spec`; the built stock module stays its path for ordinary
    batches), and its rotary embedding gives tree forwards their rows' depths. Idempotent.

    Args:
        model: the model, or Megatron's wrapper of it.

    Returns:
        ``model``.

    Raises:
        UnsupportedMegatron: multi-token prediction, CUDA graphs, YaRN as the model's
            position embedding or MLA's fused rope (:func:`.rotary.position_kind`), a
            token-mixing layer other than attention, Gated DeltaNet and Mamba2, or an MoE model
            with recomputed MoE layers, token dropping or a fused router under routing
            replay (:func:`.moe.check`).
        TypeError: not a ``GPTModel`` or ``MambaModel``.
    """
    compat.check()
    core = unwrap(model)
    config = core.config
    if getattr(config, "mtp_num_layers", None):
        raise UnsupportedMegatron(
            f"mtp_num_layers={config.mtp_num_layers}: multi-token prediction heads read the "
            "next rows of the sequence, which on a tree are a sibling's: build the model "
            "without MTP for training on trees")
    graphs = getattr(config, "cuda_graph_impl", "none")
    if graphs not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        raise UnsupportedMegatron(f"cuda_graph_impl={graphs!r}: a CUDA graph takes tensors "
                                  "only, and a tree forward passes its tree to every layer")
    rotary.position_kind(core)
    layers = len(core.decoder.layers)
    # a hybrid's MLP and MoE layers mix no tokens (their self-attention is an IdentityOp)
    mixing = layers - sum(isinstance(getattr(layer, "self_attention", None), IdentityOp)
                          for layer in core.decoder.layers)
    found = swap(core) + recurrent.install(core)
    if found != mixing:
        raise UnsupportedMegatron(
            f"{type(core).__name__} has {mixing} token-mixing layers on this stage but "
            f"{found} core attentions, Gated DeltaNet and Mamba2 layers: a layer of another "
            "token mixer would mix the packed rows of different sequences. Run it unpacked")
    rotary.install(core)
    if getattr(config, "multi_latent_attention", False):
        latent.install(core)
    if moe.has_moe(core):
        moe.check(config)
        moe.install(core)
    _PREPARED.add(core)
    return model


def is_prepared(model) -> bool:
    """Whether :func:`prepare` readied ``model``."""
    return unwrap(model) in _PREPARED


class MegatronForward:
    """One tree forward of a Megatron model on this rank: its rows, their depths, and each
    layer's core attention in Megatron's layout, through the row/head exchange over the CP
    group, into the forward's token mixers (:class:`~treepack.forwards.TreeForward`).

    Args:
        mixers: the token mixers over every row of the forward: the whole pack's
            (:class:`~treepack.forwards.PackForward`), or one part's
            (:class:`~treepack.forwards.PartForward`, :mod:`.parts`).
        cp: the context-parallel group (None: one rank); ``cp_rank``, ``cp_size``.
        multiple: the rows of a forward are padded to a multiple of this (Megatron's sequence
            parallelism splits them over the TP ranks).
        rows: the pack's rows this forward computes (ascending; None: every row), as one
            part of a tree in parts does; ``start`` / ``stop`` count among them.
    """

    def __init__(self, mixers: TreeForward, cp, cp_rank: int, cp_size: int, multiple: int,
                 rows: Tensor | None = None):
        pack = mixers.pack
        self.pack, self.cp, self.mixers = pack, cp, mixers
        whole = rows is None
        every = torch.arange(pack.num_rows, device=pack.device) if whole else rows
        total = every.shape[0]
        width = -(-total // cp_size) if total else 1
        width = -(-width // multiple) * multiple
        self.start = min(total, cp_rank * width)
        self.stop = min(total, self.start + width)
        rows = every[self.start:self.stop]
        if rows.shape[0] < width:  # copies of a row whose outputs nothing reads
            fill = rows[-1:] if rows.shape[0] else torch.zeros(1, dtype=torch.long,
                                                                device=pack.device)
            rows = torch.cat((rows, fill.expand(width - rows.shape[0])))
        self.rows, self.width, self.total = rows, width, total
        self.depths = pack.position_ids[rows]
        # the original tokens each row stands for (an MoE router's weights); 0 for the copies
        weights = row_multiplicity(pack)[rows]
        self.weights = weights.masked_fill(torch.arange(width, device=pack.device)
                                           >= self.stop - self.start, 0)
        self.exchange = None if cp is None else HeadExchange(
            cp, cp_rank, cp_size, total, width, error=UnsupportedMegatron)
        # a recurrent layer's convolution and scan under CP: every row for this rank's
        # channels and heads
        self.sharded = None if cp is None else ShardedForward(mixers, self.exchange)
        self.routing: moe.Routing | None = None  # what its MoE routers read (run_forward)
        self.images = None  # a vision-language model's images of the pack (.vision)
        self.calls = 0

    @property
    def own(self) -> int:
        """This rank's real rows (the rest of its ``width`` are padding)."""
        return self.stop - self.start

    def core_attention(self, module, query: Tensor, key: Tensor, value: Tensor, *,
                       scale: float, window: int | None, dropout: float,
                       sinks: Tensor | None = None) -> Tensor:
        """A layer's tree attention: ``query`` ``[width, 1, h, d]``, ``key`` and ``value``
        ``[width, 1, g, d]`` (TP-local heads; ``[width, h, d]`` from multi-latent attention,
        whose values are narrower than its queries and keys; under CP, where its keys and
        values travel as latents, ``[total, h / CP, d]``: every row, this rank's heads) in,
        ``[width, 1, h * d_v]`` out; ``sinks`` ``[h]``, a sink logit per head (attention
        sinks), or None."""
        self.calls += 1
        moe.resume(module, self.routing)  # a recomputed layer's router reads the forward's
        latent = self.latent_keys(module) is not None  # k, v: every row, this rank's heads
        if query.dim() == 3:  # multi-latent attention drops the batch dimension where
            query = query.unsqueeze(1)  # packed_seq_params are given
            if not latent:
                key, value = key.unsqueeze(1), value.unsqueeze(1)
        if query.shape[0] != self.width or query.shape[1] != 1:
            raise UnsupportedMegatron(
                f"the core attention got q of shape {tuple(query.shape)} where the tree "
                f"forward has {self.width} rows in one sequence: a layer that changes the "
                "sequence dimension before attention is not supported")
        q = query.permute(1, 2, 0, 3)  # [1, heads, rows, d]
        k, v = (t.permute(1, 0, 2)[None] if latent else t.permute(1, 2, 0, 3)
                for t in (key, value))

        options = dict(scale=scale, window=window, dropout=dropout)
        if self.exchange is None:  # every row of the forward here, then the padding rows
            out = self.mixers.attend(module, *(t.narrow(2, 0, self.total) for t in (q, k, v)),
                                     sinks=sinks, **options)
            return self._padded(out.permute(2, 0, 1, 3)).reshape(self.width, 1, -1)
        with self._own_stream(dropout):
            if latent:  # the keys and values came as latents (.latent): the queries travel
                mine = None if sinks is None else \
                    sinks.chunk(self.exchange.size)[self.exchange.rank]
                out = self.exchange.to_rows(self.mixers.attend(
                    module, self.exchange.to_heads(q, 1, 2), k, v, sinks=mine, **options), 2, 1)
            else:
                out = self.sharded.attend(module, q, k, v, sinks=sinks, **options)
        return out.permute(2, 0, 1, 3).reshape(self.width, 1, -1)

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """A short causal convolution along each row's path (a recurrent layer's):
        ``x`` ``[width, C]``, this rank's rows, in and out (under CP through the exchange to
        this rank's channels)."""
        if self.sharded is not None:
            return self.sharded.conv(x, weight, bias)
        return self._padded(self.mixers.conv(x.narrow(0, 0, self.total), weight, bias))

    def scan(self, kernel, inputs: dict[str, Tensor], per_head: dict | None = None) -> Tensor:
        """A recurrent scan over every path, each chain from its parent's state
        (:meth:`treepack.forwards.TreeForward.scan`): ``inputs`` ``{name: [width, heads,
        ...]}``, this rank's rows (under CP through the exchange to this rank's heads; an
        input with fewer heads, Mamba2's ``B`` and ``C`` by groups, repeated up to them);
        ``per_head``: per-head parameters the kernel reads in its batch (Mamba2's ``A``,
        ``D``)."""
        if self.sharded is not None:
            return self.sharded.scan(kernel, inputs, per_head)
        return self._padded(self.mixers.scan(
            kernel, {k: t.narrow(0, 0, self.total) for k, t in inputs.items()}, per_head))

    def _padded(self, out: Tensor) -> Tensor:
        """``out`` for every row of the forward, then zeros for the rows that pad it."""
        if self.width > self.total:
            out = torch.cat((out, out.new_zeros((self.width - self.total, *out.shape[1:]))))
        return out

    def latent_keys(self, module):
        """The :class:`~.latent.LatentKeys` of a layer's tree core attention ``module`` where
        its keys and values travel as latents in this forward (under CP), else None."""
        return None if self.exchange is None else getattr(module, "latent", None)

    def _own_stream(self, dropout: float):
        """With attention dropout under CP, this rank's heads draw from a stream of their own
        (:func:`treepack.attention.exchange.rank_stream`; ranks seeded alike would draw one
        mask for different heads); recomputation replays it, as Megatron restores every
        generator around a recomputed region."""
        if dropout <= 0:
            return contextlib.nullcontext()
        return rank_stream(self.exchange.rank, self.pack.device)

    def params(self) -> TreePackedSeqParams:
        """What ``GPTModel.forward`` takes as ``packed_seq_params`` for this forward. Its
        ``cp_group`` is one rank: Megatron's rotary embeddings slice their positions per CP
        rank of the ``cp_group`` they are given, and this rank's rows are its own already."""
        return TreePackedSeqParams(qkv_format="sbhd", max_seqlen_q=self.width,
                                   max_seqlen_kv=self.width, cp_group=_OneRank(), tree=self)


class _OneRank:
    """A process group of one, as far as Megatron's rotary embeddings ask (``size()``)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def _hidden_out(model):
    """For one forward, the output layer returns its input (the final norm's output) and
    records the weight it would multiply: the log-probs are computed after the forward from
    the vocabulary-parallel weight, never as ``[T', V]`` logits."""
    layer = model.output_layer
    seen = {}

    def forward(input_, weight=None, runtime_gather_output=None, **kwargs):
        seen["weight"] = layer.weight if weight is None else weight
        seen["bias"] = getattr(layer, "bias", None)
        return input_, None

    with replaced(layer, "forward", forward):
        yield seen


def logprobs(model, pack: TreePack, *, temperature=1.0, entropy: bool = False,
             align: str = "label", backend: str = "auto", chunk_size: int | None = None,
             block_size: int = 128, images=None) -> TokenLogprobs:
    """Every next-token log-prob (and entropy) of the pack's sequences, from one forward of a
    prepared ``GPTModel`` over the tree, in the ``[N, L]`` layout :func:`treepack.hf.logprobs`
    gives.

    Every rank of the tensor- and context-parallel groups (read from
    ``megatron.core.parallel_state``) passes the same whole pack and gets the whole result.
    With CP, each rank's parameter gradients are its rows' share: their sum over the CP group
    (Megatron's DDP reduces over data x context parallel ranks) is the pack's gradient.

    Args:
        model: a prepared ``GPTModel`` (:func:`prepare`), or Megatron's wrapper of one, that
            holds the whole model (for pipeline parallelism see :func:`forward_step`).
        pack: the :class:`~treepack.TreePack`, on the model's device.
        temperature: logits are divided by it: a number, or one per sequence.
        entropy: also compute each prediction's entropy.
        align: ``"label"`` or ``"prediction"`` (verl's), as :func:`treepack.hf.logprobs`.
        backend, block_size: the tree attention backend (``"auto"``: FlashAttention varlen
            on a GPU where it applies, else flex, else segment).
        chunk_size: rows per chunk of the vocabulary-parallel log-softmax.
        images: a vision-language model's images of the pack's sequences
            (:class:`treepack.megatron.Images`; the pack built with ``images.pack()``), or
            None for text.

    Returns:
        :class:`treepack.TokenLogprobs`: ``logprobs`` ``[N, L]`` (flat: ``[total]``), 0 where
        nothing is predicted; ``entropy`` the same or None.

    A model built with ``moe_enable_routing_replay`` replays the pack's routes row by row
    (``TreePack.from_sequences(..., routes=)``; :mod:`.moe`).

    Raises:
        ValueError: an unprepared model, a pack on another device or with ids past the
            vocabulary, a bad temperature or ``align``, a pack whose routes and the model
            disagree (routes without replay, replay without routes, another shape); ranks
            of the TP / CP groups given
            different packs or arguments (:class:`treepack.core.agreement.Disagreement`, on
            every rank), or a refusal on any of them (on every rank).
        UnsupportedMegatron: what the model cannot run on a tree (heads the CP size does not
            split, an attention bias, attention sinks), or a model split over pipeline
            stages.
    """
    if not parallel_state.is_pipeline_first_stage() or not parallel_state.is_pipeline_last_stage():
        raise UnsupportedMegatron(
            "treepack.megatron.logprobs runs a whole model on one pipeline stage; with "
            "pipeline parallelism use treepack.megatron.forward_step (a forward_step_func for "
            "Megatron's get_forward_backward_func)")
    return forward_stage(model, pack, temperature=temperature, entropy=entropy, align=align,
                         backend=backend, chunk_size=chunk_size, block_size=block_size,
                         images=images).logprobs()


class StageOutput:
    """One pipeline stage's forward of a pack: ``output``, what the stage hands on (its hidden
    states; the last stage's, the final norm's output), and on the last stage
    :meth:`logprobs`, the pack's log-probs from it."""

    def __init__(self, output: Tensor, compute):
        self.output, self._compute = output, compute

    @property
    def is_last(self) -> bool:
        return self._compute is not None

    def logprobs(self) -> TokenLogprobs:
        """The pack's :class:`~treepack.TokenLogprobs` (the last stage only)."""
        if self._compute is None:
            raise UnsupportedMegatron("log-probs come from the last pipeline stage: this stage "
                                      "hands its hidden states on")
        return self._compute()


def forward_stage(model, pack: TreePack, *, temperature=1.0, entropy: bool = False,
                  align: str = "label", backend: str = "auto", chunk_size: int | None = None,
                  block_size: int = 128, images=None) -> StageOutput:
    """This pipeline stage's forward of ``pack`` (the whole model without pipeline
    parallelism): what :func:`logprobs` and :func:`forward_step` run.

    Every rank of the stage's tensor- and context-parallel groups agrees on the pack and the
    arguments first (one all-gather), or every one of them refuses.

    Args:
        model, pack, temperature, entropy, align, backend, chunk_size, block_size, images: as
            :func:`logprobs`.

    Returns:
        :class:`StageOutput`.

    Raises:
        As :func:`logprobs`.
    """
    core = unwrap(model)
    tp, cp = _groups()
    with agreement(_agreement_group(tp, cp), "tensor- and context-parallel group",
                   {"pack": "every rank of a group must pass the same pack"}) as fields:
        temps = _check(core, pack, temperature, align)
        vision.check(model, pack, images)
        fields.update(call="forward_stage", pack=pack_identity(pack), temperature=temps,
                      align=align, entropy=entropy, backend=backend,
                      gradients=torch.is_grad_enabled(), training=core.training,
                      images=None if images is None else images.num_images)
    forward = MegatronForward(PackForward(pack, backend, block_size), cp["group"], cp["rank"],
                              cp["size"], tp["size"] if core.config.sequence_parallel else 1)
    forward.images = images
    output, head = run_forward(model, forward, tp)
    if not core.post_process:
        return StageOutput(output, None)
    return StageOutput(output, lambda: _place(core, pack, forward, output, head, temps,
                                              entropy, align, chunk_size, tp, cp))


def run_forward(model, forward: MegatronForward, tp: dict) -> tuple[Tensor, dict]:
    """The stage's model over ``forward``'s rows at their depths: its output, and on the last
    stage the output layer's weight (``head``; the output is the final norm's)."""
    core = unwrap(model)
    kind = rotary.position_kind(core)
    routes, unrecorded = forward.pack.host.row_routes, ()
    if routes is not None:  # the forward's rows' routes, replayed (.moe)
        routes = routes[forward.rows.cpu().numpy()]
        unrecorded = np.flatnonzero((routes[..., 0] < 0).any(0))  # layers routing some rows
        routes = torch.from_numpy(routes).to(forward.pack.device)  # themselves
    forward.routing = moe.Routing(core, forward.weights, routes, tp["rank"], tp["size"],
                                  core.config.sequence_parallel, unrecorded)
    routed = moe.active(core, forward.routing)
    vl = vision.vision_language(model)
    with _hidden_out(core) if core.post_process else contextlib.nullcontext({}) as head, \
            routed:
        if vl is not None:  # its vision tower, then its language model (.vision)
            output = vision.run(vl, forward)
        else:
            output = model(input_ids=forward.pack.input_ids[forward.rows][None],
                           position_ids=rotary.position_ids(kind, forward.depths),
                           attention_mask=None, packed_seq_params=forward.params())
    layers = len(tree_layers(core)) + len(recurrent.tree_mixers(core))
    if forward.calls != layers:
        raise UnsupportedMegatron(
            f"{forward.calls} of the stage's {layers} tree token mixers ran: a layer "
            "bypassed its core attention, its Gated DeltaNet or its Mamba2 mixer")
    return output, head


def forward_step(loss_fn, **options):
    """A ``forward_step_func`` for Megatron's ``get_forward_backward_func()`` whose
    micro-batches are packs: each stage runs :func:`forward_stage` on the pack it draws, and
    the last stage's loss is ``loss_fn(logprobs, pack)``.

    Every stage must draw the same packs in the same order (Megatron's schedules assume it of
    any data); set ``config.variable_seq_lengths = True``, since packs differ in rows. A
    vision-language model's micro-batches are ``(pack, images)`` pairs.

        step = treepack.megatron.forward_step(my_loss, temperature=1.0, entropy=True)
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter(packs),
                                    model=model, num_microbatches=len(packs),
                                    seq_length=1, micro_batch_size=1, forward_only=False)

    Args:
        loss_fn: ``loss_fn(out, pack)`` with ``out`` the pack's
            :class:`~treepack.TokenLogprobs`; returns what Megatron's loss functions return:
            ``(loss, reduced)`` (the schedule multiplies the loss by the CP size and divides
            it by the micro-batches) or ``(loss, num_tokens, reduced)``.
        **options: :func:`forward_stage`'s ``temperature``, ``entropy``, ``align``,
            ``backend``, ``chunk_size``, ``block_size``.

    Returns:
        ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.
    """
    def step(data_iterator, model):
        pack = next(data_iterator)
        images = None
        if isinstance(pack, tuple):  # a vision-language model's (pack, images)
            pack, images = pack
        stage = forward_stage(model, pack, images=images, **options)
        return stage.output, lambda output_tensor: loss_fn(stage.logprobs(), pack)

    return step


def _place(core, pack, forward: MegatronForward, hidden: Tensor, head: dict, temps, entropy,
           align, chunk_size, tp: dict, cp: dict, every=None) -> TokenLogprobs:
    """The forward's predictions (``every``: those of its rows, sources counted among them;
    None: the pack's) from its hidden states (``[1, rows, H]``, or this TP rank's rows of them
    under sequence parallelism) and the vocabulary-parallel head, placed in the pack's layout
    and summed over the CP group."""
    hidden = hidden[0]  # [rows, H]: GPTModel returns its output layer's output batch-first
    group = tp["group"] if tp["size"] > 1 else None
    if core.config.sequence_parallel and tp["size"] > 1:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden[:, None], tensor_parallel_output_grad=True, group=tp["group"])[:, 0]
    elif group is not None:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group)
    hidden = hidden[:forward.own]
    weight = head["weight"]
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(weight.dtype)
    source = Head(hidden, weight, head.get("bias"), vocab_group=group,
                  vocab_start=tp["rank"] * weight.shape[0])
    shape = tuple(pack.rows.shape)
    numel = math.prod(shape)
    every = forward_predictions(pack, align) if every is None else every
    mine = every.within(forward.start, forward.stop)
    logp, ent = logprobs_at(mine, source, temps, entropy=entropy, numel=numel,
                            chunk_size=chunk_size)
    if cp["size"] > 1:
        logp = sum_over(logp, cp["group"])
        ent = None if ent is None else sum_over(ent, cp["group"])
    return TokenLogprobs(logp.view(shape), None if ent is None else ent.view(shape), align)


def _check(core, pack, temperature, align) -> np.ndarray:
    """This rank's checks of a call's inputs; the per-sequence temperatures."""
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack, got {type(pack).__name__}: build one with "
                        "treepack.TreePack.from_sequences(sequences)")
    if core not in _PREPARED:
        raise ValueError(f"{type(core).__name__} is not prepared: call "
                         "treepack.megatron.prepare(model) once first")
    check_align(align)
    temps = per_sequence_temperature(temperature, pack.num_sequences)
    if moe.has_moe(core):
        moe.check(core.config)
    moe.check_routes(core, pack.host.row_routes)
    device = next(core.parameters()).device
    if pack.device != device:
        raise ValueError(f"the model computes on {device} but the pack is on {pack.device}; "
                         f"move the pack with pack.to({str(device)!r})")
    vocab = core.vocab_size
    if pack.max_token_id >= vocab:
        raise ValueError(f"the pack has token id {pack.max_token_id} but the model's "
                         f"vocabulary has {vocab}: tokenize with the model's tokenizer")
    return temps


def _groups() -> tuple[dict, dict]:
    """This rank's tensor- and context-parallel groups, ranks and sizes."""
    tp = dict(group=parallel_state.get_tensor_model_parallel_group(),
              rank=parallel_state.get_tensor_model_parallel_rank(),
              size=parallel_state.get_tensor_model_parallel_world_size())
    size = parallel_state.get_context_parallel_world_size()
    cp = dict(group=parallel_state.get_context_parallel_group() if size > 1 else None,
              rank=parallel_state.get_context_parallel_rank(), size=size)
    return tp, cp


def _agreement_group(tp: dict, cp: dict):
    """The group whose ranks must agree on a call: tensor x context parallel (None: one)."""
    if tp["size"] * cp["size"] == 1:
        return None
    if cp["size"] == 1:
        return tp["group"]
    if tp["size"] == 1:
        return cp["group"]
    return parallel_state.get_tensor_and_context_parallel_group()
