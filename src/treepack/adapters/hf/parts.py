"""A tree larger than one forward, run in parts that each compute their rows once.

:func:`treepack.planning.parts.split` cuts the tree into parts of at most ``max_tokens``
rows. A part's forward runs its own rows only; each layer reads what it needs of the
part's ancestor rows (its context) from the parts that computed them, kept per layer: an
attention layer their keys and values, a short convolution the inputs of the K - 1 rows
above each path's cut, a recurrent scan its state after the row a root chain continues
from (a part's scan chains end at every such row). In training what a part keeps goes to
the parts below it as detached leaves: each of those parts' backward adds its gradient
into them, and the part's own backward runs once, after all of them, with its loss and
those gradients. So the loss and every gradient are those of one forward over the whole
tree (and of every sequence alone), while each forward holds one part's activations.

The loss must be a sum over predictions, as for gradient accumulation: ``loss_fn`` is
called once per part with that part's log-probs (0 elsewhere) and the mask of the
predictions it made, and the step's loss is the sum of what it returns.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np
import torch
from torch import Tensor

from treepack.adapters.hf.forwarding import forward
from treepack.adapters.hf.head import lm_head
from treepack.adapters.hf.prepare import compute_device, is_prepared, unwrap
from treepack.adapters.hf.routing import (TREE_FORWARD_KWARG, TreeForward, UnsupportedModel,
                                          check_calls, tree_forward)
from treepack.attention.chains import Chains, subset_chains
from treepack.attention.segment import attend_groups, chain_groups
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.softmax import Head, normalise
from treepack.core.tree import TreePack
from treepack.planning.parts import Parts, split
from treepack.recurrent import ancestor_table, path_conv1d, row_levels, scan_levels

__all__ = ["backward_in_parts", "step_in_parts", "logprobs_in_parts", "PartsResult",
           "check_model", "surrogate"]


@dataclasses.dataclass(frozen=True)
class PartsResult:
    """What :func:`backward_in_parts` returns (its gradients are in the parameters)."""

    loss: Tensor  # the step's loss: the sum of the parts' (detached)
    logprobs: Tensor  # [N, L] in the ``align`` layout, every prediction (detached)
    entropy: Tensor | None  # the same shape, when asked for
    parts: int  # forwards run
    rows: int  # rows they computed: the tree's, each once


def backward_in_parts(model, sequences, loss_fn, *, max_tokens: int, temperature=1.0,
                      entropy: bool = False, align: str = "label",
                      recompute: bool | str = "auto") -> PartsResult:
    """One step's forward and backward over a tree too large for one forward.

    Args:
        model: a prepared transformers causal LM (hybrids included; activation
            checkpointing non-reentrant, transformers' default), or a DDP
            wrapper of one: each rank runs its own trees' parts and the gradients are
            averaged over the ranks once, at the end; or an FSDP2 (``fully_shard``) or FSDP1
            (``FullyShardedDataParallel``) one: its parameters are gathered once for the
            step, the gradients reduce-scattered once at the end (every rank must call
            this, as any FSDP step).
        sequences: the step's token sequences (lists, arrays or 1-D tensors), or a
            :class:`~treepack.TreePack` of them (its sequences in its order: a
            ``treepack.collate(..., parts=True)`` batch's ``batch.pack``, whose ``[N, L]``
            fields then line up with the outputs).
        loss_fn: ``loss_fn(outputs, mask) -> scalar``: ``outputs`` a
            :class:`~treepack.TokenLogprobs` with ``[N, L]`` label-aligned log-probs (and
            entropies) of one part's predictions, 0 elsewhere; ``mask`` ``[N, L]`` bool,
            where they are. The step's loss is the sum over parts, so the loss must be a
            sum over predictions (a token mean divides by the step's token count).
        max_tokens: the most rows one forward computes.
        temperature: logits are divided by it: a number, or one per sequence.
        entropy: also pass (and return) the entropies.
        align: ``"label"`` (``[s, p]`` of token p) or ``"prediction"`` (verl's: at p, of
            token p + 1, and the entropy at every position; the mask then holds every
            position of the part's rows, a sequence's last with its entropy only).

    Returns:
        :class:`PartsResult`; the gradients are accumulated into the parameters, as
        ``loss.backward()`` would.

    Raises:
        UnsupportedModel: reentrant activation checkpointing.
        ValueError: an unprepared model, bad sequences or ``max_tokens``.
    """
    core = check_model(model)
    with _fsdp_unsharded(model):
        run = _Run(_local(model), core, sequences, max_tokens, temperature, entropy,
                   train=True, loss_fn=loss_fn, align=align, recompute=recompute)
        run.all()
    if _local(model) is not model:
        _average_gradients(model)
    return PartsResult(run.loss.detach(), run.logprobs.detach(),
                       None if run.entropy is None else run.entropy.detach(),
                       len(run.parts.parts), run.parts.rows_computed)


def step_in_parts(model, sequences, loss_fn, *, max_tokens: int, temperature=1.0,
                  entropy: bool = False, align: str = "label",
                  recompute: bool | str = "auto") -> PartsResult:
    """:func:`backward_in_parts` for any loss of the whole batch's outputs: a per-sequence
    mean (``seq-mean-token-mean``), GSPO's sequence ratio, anything a part holding some of a
    sequence's tokens cannot compute by itself.

    Two passes: every log-prob (and entropy) without gradients, in parts; ``loss_fn`` on
    them as leaves, whose backward gives the loss's gradient with respect to each of them;
    then the parts' forwards and backwards with ``sum(gradient * value)`` as their loss. The
    chain rule makes that the loss's gradient, for one more forward over the tree's rows
    (each once).

    Args:
        model, sequences, max_tokens, temperature, entropy, align, recompute: as
            :func:`backward_in_parts`.
        loss_fn: ``loss_fn(outputs) -> scalar``, ``outputs`` a
            :class:`~treepack.TokenLogprobs` of every ``[N, L]`` log-prob (and entropy) of
            the batch, as one forward over it would give.

    Returns:
        :class:`PartsResult`: the loss ``loss_fn`` returned; the gradients are accumulated
        into the parameters.

    Raises:
        As :func:`backward_in_parts`.
    """
    first = logprobs_in_parts(model, sequences, max_tokens=max_tokens,
                              temperature=temperature, entropy=entropy, align=align)
    leaves = TokenLogprobs(first.logprobs.requires_grad_(),
                           None if first.entropy is None else first.entropy.requires_grad_(),
                           align)
    loss = loss_fn(leaves)
    loss.backward()
    step = backward_in_parts(model, sequences, surrogate(leaves.logprobs.grad,
                                                         None if first.entropy is None
                                                         else leaves.entropy.grad),
                             max_tokens=max_tokens, temperature=temperature, entropy=entropy,
                             align=align, recompute=recompute)
    return PartsResult(loss.detach(), first.logprobs.detach(),
                       None if first.entropy is None else first.entropy.detach(),
                       step.parts, step.rows)


def surrogate(grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None):
    """A part's loss whose gradient is a whole-batch loss's: ``sum(grad * value)`` over the
    part's predictions, given that loss's ``[N, L]`` gradients with respect to every
    log-prob and entropy (None: it does not depend on them)."""
    def loss_fn(out: TokenLogprobs, mask: Tensor) -> Tensor:
        total = out.logprobs.new_zeros(())
        if grad_logprobs is not None:
            total = total + (out.logprobs * grad_logprobs).where(mask, 0).sum()
        if grad_entropy is not None:
            total = total + (out.entropy * grad_entropy).where(mask, 0).sum()
        return total

    return loss_fn


def logprobs_in_parts(model, sequences, *, max_tokens: int, temperature=1.0,
                      entropy: bool = False, align: str = "label") -> TokenLogprobs:
    """Every next-token log-prob of ``sequences`` without gradients (old and reference
    log-probs, scoring), each row of their tree computed once, in forwards of at most
    ``max_tokens`` rows.

    Args:
        model, sequences, max_tokens, temperature, entropy, align: as
            :func:`backward_in_parts`.

    Returns:
        :class:`~treepack.TokenLogprobs`: ``[N, L]`` in the ``align`` layout.

    Raises:
        As :func:`backward_in_parts`.
    """
    core = check_model(model)
    with _fsdp_unsharded(model, train=False), torch.no_grad():
        run = _Run(_local(model), core, sequences, max_tokens, temperature, entropy,
                   train=False, align=align)
        run.all()
    return TokenLogprobs(run.logprobs, run.entropy, align)


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


def _local(model):
    """The module a rank runs its parts on: the one inside DDP (whose per-backward reduction
    and per-forward buffer broadcast would need every rank to run as many parts; the
    gradients are averaged once at the end instead, as DDP would), else ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def _fsdp_unsharded(model, train: bool = True):
    """FSDP2: every module's parameters gathered once, up front, and kept while the parts
    run, their gradients accumulated unsharded without reduction; then one empty forward
    and backward on every rank reduce-scatters them and reshards (without ``train``: the
    parameters are resharded). So each rank runs its own sequence of parts, while the
    collectives (one all-gather per module, one reduce-scatter per module) line up across
    ranks. FSDP1: :func:`_fsdp1_unsharded`."""
    from torch.distributed.fsdp import FSDPModule

    if _fsdp1_root(model) is not None:
        with _fsdp1_unsharded(model, train):
            yield
        return
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        yield
        return
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_forward(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        if train:
            _sync_step(model)
        else:
            for m in sharded:
                m.reshard()


def _sync_step(model) -> None:
    """One empty forward and backward, the same on every rank: with FSDP's gradient sync
    back on, it reduce-scatters what the parts accumulated unsharded, and reshards."""
    empty = TreePack.empty(1, device=compute_device(model))
    (forward(model, empty).logits.sum() * 0.0).backward()


def _fsdp1_root(model):
    """The outermost FSDP1 (``FullyShardedDataParallel``) module in ``model``, or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


@contextlib.contextmanager
def _fsdp1_unsharded(model, train: bool):
    """FSDP1, as FSDP2 above: every handle's flat parameter gathered once, up front (in
    handle order on every rank), then kept while the parts run: FSDP1 skips its all-gather
    when the unsharded parameter is still allocated, and it frees it only for the
    reshard-after-forward strategies or when syncing gradients, so the handles run as
    ``SHARD_GRAD_OP`` with gradient sync off (``no_sync``'s flag; gradients accumulate
    unsharded). Then, strategies and sync back, one empty forward and backward on every rank
    reduce-scatters the accumulated gradients and reshards (without ``train``: every handle
    reshards). These are FSDP1's internals (torch.distributed.fsdp._runtime_utils,
    _traversal_utils), as of torch 2.11-2.13."""
    from torch.distributed.fsdp import _runtime_utils, _traversal_utils
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    root = _fsdp1_root(model)
    _runtime_utils._lazy_init(root, root)
    states = _traversal_utils._get_fsdp_states(root)
    strategies = []
    for state in states:
        handle = state._handle
        state._sync_gradients = False
        if handle is None:
            continue
        _runtime_utils._unshard(state, handle, state._unshard_stream,
                                state._pre_unshard_stream)
        strategies.append((handle, handle._sharding_strategy))
        if handle.uses_sharded_strategy:
            handle._sharding_strategy = HandleShardingStrategy.SHARD_GRAD_OP
    try:
        yield
    finally:
        for handle, strategy in strategies:
            handle._sharding_strategy = strategy
        for state in states:
            state._sync_gradients = True
        if train:
            _sync_step(model)
        else:
            for state in states:
                if state._handle is not None:
                    _runtime_utils._reshard(state, state._handle, True)


def _average_gradients(model, bucket_bytes: int = 25 * 2**20) -> None:
    """What DDP's reducer does once per step: every gradient averaged over its process
    group, in flat buckets of about ``bucket_bytes`` (DDP's default size: a few collectives,
    not one per parameter). A parameter without a gradient on this rank adds zeros (the
    ranks' parameter lists must line up)."""
    import torch.distributed as dist

    group = model.process_group
    world = dist.get_world_size(group)
    grads = []
    for p in model.module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    buckets: list[list[Tensor]] = []
    size = 0
    for g in grads:  # consecutive runs of one dtype and device, up to the size
        fits = buckets and buckets[-1][0].dtype == g.dtype and buckets[-1][0].device == g.device
        if not fits or size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= world
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


class _Run:
    """One pass over the parts: forwards depth-first, each part's backward after its
    children's."""

    def __init__(self, model, core, sequences, max_tokens, temperature, entropy, *, train,
                 loss_fn=None, align="label", recompute=False):
        check_align(align)
        if recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={recompute!r}: use 'auto', True or False")
        self.model, self.core, self.train, self.loss_fn = model, core, train, loss_fn
        self.want_entropy, self.align = entropy, align
        device = compute_device(model)
        pack = TreePack.from_sequences(_sequences(sequences), device=device)
        self.temperature = per_sequence_temperature(temperature, pack.num_sequences)
        self.parts = split(pack, max_tokens)
        self.children = collections.defaultdict(list)  # part -> the parts hanging off it
        for j, part in enumerate(self.parts.parts):
            self.children[part.parent].append(j)
        self.carried = _Carried(self.parts, train)
        lm_head(model)  # checked once per model, by a forward of its own
        self.recomputed = set()
        if train and recompute:
            below = {j for j in self.children if j >= 0}  # parts with parts below them
            self.recomputed = below if recompute is True else {
                j for j in below if any(c in below for c in self.children[j])}
        self.predictions = _predictions(self.parts, align)
        shape = tuple(pack.rows.shape)
        dtype = torch.promote_types(core.dtype, torch.float32)  # as normalise computes
        self.logprobs = torch.zeros(shape, dtype=dtype, device=device)
        self.entropy = torch.zeros(shape, dtype=dtype, device=device) if entropy else None
        self.loss = torch.zeros((), dtype=dtype, device=device)

    def all(self) -> None:
        for i in self.children[-1]:
            self.part(i)

    def part(self, i: int) -> None:
        if i in self.recomputed:  # a first forward for the parts below only: no graph kept
            rng = _rng_state(self.parts.pack.device)
            with torch.no_grad(), self.carried.recomputed(i, "first"):
                self.forward(i)
        else:
            loss = self.outputs(i, self.forward(i))
        for child in self.children[i]:
            self.part(child)
        if i in self.recomputed:  # again, with the same dropout masks, for the backward
            after = _rng_state(self.parts.pack.device)
            _set_rng_state(rng)
            with self.carried.recomputed(i, "second"):
                loss = self.outputs(i, self.forward(i))
            _set_rng_state(after)
        if self.train:
            tensors, grads = self.carried.backward_inputs(i)
            if loss is not None and loss.requires_grad:
                tensors, grads = [loss, *tensors], [torch.ones_like(loss), *grads]
            if tensors:
                torch.autograd.backward(tensors, grads)
        self.carried.release(i)

    def forward(self, i: int) -> Tensor:
        """Part ``i``'s forward: its rows' last hidden states ``[n, H]``."""
        rows = self.parts.parts[i].rows
        pack = self.parts.pack
        tree = _PartForward(pack, self.carried, i)
        index = torch.from_numpy(rows).to(pack.device)
        # the LM head as the forward sees it: FSDP1's root points its parameters back at
        # their shards when its forward returns
        heads = []
        hook = self.core.register_forward_hook(
            lambda module, args, output: heads.append(lm_head(self.model, check=False)))
        try:
            with tree_forward():
                out = self.model(input_ids=pack.input_ids[index][None],
                                 position_ids=pack.position_ids[index][None], use_cache=False,
                                 logits_to_keep=1, output_hidden_states=True,
                                 **{TREE_FORWARD_KWARG: tree})
        finally:
            hook.remove()
        check_calls(self.core, tree)
        self.head = heads[-1]
        return out.hidden_states[-1][0]

    def outputs(self, i: int, hidden: Tensor) -> Tensor | None:
        where, seq, source, token, real = self.predictions[i]
        if source.shape[0] == 0:
            return None
        # one normalised row per (source row, temperature), rows ascending
        normalised, pick = np.unique(np.stack((source, self.temperature[seq])), axis=1,
                                     return_inverse=True)
        pick = pick.reshape(-1)
        head = self.head
        logp, ent = normalise(Head(hidden, head["weight"], head.get("bias"),
                                   scale=head.get("scale", 1.0), softcap=head.get("softcap")),
                              normalised[0].astype(np.int64), normalised[1], pick, token,
                              entropy=self.want_entropy)
        if real is not None:  # a sequence's last row: its entropy only
            logp = logp.where(real, 0)
        mask = torch.zeros(self.logprobs.shape, dtype=torch.bool, device=hidden.device)
        mask[where] = True
        logprobs = torch.zeros(self.logprobs.shape, dtype=logp.dtype, device=hidden.device)
        logprobs = logprobs.index_put(where, logp)
        self.logprobs[where] = logp.detach().to(self.logprobs.dtype)
        entropy = None
        if ent is not None:
            ent = ent[torch.from_numpy(pick).to(ent.device)]  # per prediction
            entropy = torch.zeros_like(logprobs).index_put(where, ent)
            self.entropy[where] = ent.detach().to(self.entropy.dtype)
        if self.loss_fn is None:
            return None
        loss = self.loss_fn(TokenLogprobs(logprobs, entropy, self.align), mask)
        self.loss = self.loss + loss.detach()
        return loss


def _sequences(sequences):
    """The token sequences to run: ``sequences``, or a pack's, in its order."""
    if not isinstance(sequences, TreePack):
        return sequences
    h = sequences.host
    if sequences.layout == "flat":
        return [h.input_ids[h.rows[a:b]] for a, b in zip(h.offsets[:-1], h.offsets[1:])]
    return [h.input_ids[h.rows[s, :n]] for s, n in enumerate(h.lengths)]


def _predictions(parts: Parts, align: str) -> list[tuple]:
    """Per part: where its predictions go in ``[N, L]``, their sequences and source rows
    among the part's rows (host), their target tokens, and which of them predict a token
    (``"prediction"`` alignment also normalises each sequence's last row, for its entropy)."""
    pack = parts.pack
    h = pack.host
    if align == "label":
        s, p = np.nonzero(h.prediction_mask)
        source = h.rows[s, p - 1]
        real = np.ones(s.shape[0], dtype=bool)
        token = h.input_ids[h.rows[s, p]]
    else:
        s, p = np.nonzero(h.rows >= 0)
        source = h.rows[s, p]
        real = p + 1 < h.lengths[s]
        token = np.where(real, h.input_ids[h.rows[s, np.minimum(p + 1, h.rows.shape[1] - 1)]], 0)
    local = parts.local[source]
    order = np.lexsort((local, parts.part_of[source]))  # by part, then source row
    counts = np.bincount(parts.part_of[source], minlength=len(parts.parts))
    move = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(pack.device)  # noqa: E731
    return [((move(s[sel]), move(p[sel])), s[sel], local[sel], move(token[sel]),
             None if real[sel].all() else move(real[sel]))
            for sel in np.split(order, np.cumsum(counts)[:-1])]


class _Carried:
    """What the parts run so far carry to the parts below them, per layer: every attention
    layer's keys and values, every short convolution's inputs, every recurrent scan's state
    after the rows other parts continue from; and each part's plans (its attention chains,
    convolution paths and scan chains over its context and own rows)."""

    def __init__(self, parts: Parts, train: bool):
        self.parts, self.train = parts, train
        self.leaves: dict = collections.defaultdict(dict)  # part -> layer key -> leaves
        self.own: dict = collections.defaultdict(dict)  # part -> layer key -> with graph
        self.plans: dict = {}
        self.first = self.second = None  # the part in its first / second of two forwards
        h, n = parts.pack.host, parts.pack.num_rows
        parent = h.parent_row[:n]
        handed = (parent >= 0) & (parts.part_of[np.maximum(parent, 0)] != parts.part_of)
        self.exported = np.zeros(n, dtype=bool)  # rows other parts continue a scan from
        self.exported[parent[handed]] = True

    @contextlib.contextmanager
    def recomputed(self, i: int, which: str):
        """Part ``i``'s ``"first"`` forward, without gradients (what it hands below, no
        graph), or its ``"second"``, with gradients: its tensors replace the first's (the
        same values) as what the leaves' gradients flow back through; the leaves stay."""
        setattr(self, which, i)
        try:
            yield
        finally:
            setattr(self, which, None)

    def put(self, i: int, key, *tensors: Tensor) -> None:
        """Part ``i``'s tensors for the layer ``key`` (an attention module, or a
        convolution's / scan's key), kept for the parts below it."""
        if key in self.own[i]:
            if i == self.second and not self.own[i][key][0].requires_grad:
                self.own[i][key] = tensors
            return  # an activation-checkpointing recompute: the forward's are kept
        if self.train and not torch.is_grad_enabled() and i != self.first:
            raise UnsupportedModel(
                "a layer ran its forward without gradients during a training step: "
                "reentrant activation checkpointing, whose backward would not see the "
                "gradients the parts below add to this part's keys and values. Use "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})")
        self.own[i][key] = tensors
        if self.train:
            tensors = tuple(t.detach().requires_grad_() for t in tensors)
        self.leaves[i][key] = tensors

    def gather(self, key, grouped: list[tuple[int, Tensor]], dim: int) -> list[Tensor] | None:
        """The tensors of ``key`` at the rows ``grouped`` (``(part, its rows)``), concatenated
        along ``dim`` in that order; None without rows."""
        if not grouped:
            return None
        pieces = zip(*[[t.index_select(dim, rows) for t in self.leaves[j][key]]
                       for j, rows in grouped])
        return [torch.cat(p, dim) for p in pieces]

    def context(self, i: int, module, window) -> tuple[Tensor, Tensor]:
        """The part's context keys and values for ``module``: ``[1, Hkv, C, D]`` each."""
        got = self.gather(module, self.chains(i, window)[1], 2)
        return (None, None) if got is None else tuple(got)

    def _grouped(self, ctx: np.ndarray) -> list[tuple[int, Tensor]]:
        """Rows of other parts, ordered by part then row, as ``(part, its local rows)``."""
        parts, device = self.parts, self.parts.pack.device
        return [(int(j), torch.from_numpy(parts.local[ctx[parts.part_of[ctx] == j]]).to(device))
                for j in np.unique(parts.part_of[ctx])]

    def _outside(self, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, list]:
        """For ``rows`` (the tree's): which lie in other parts, each one's index among its
        part's rows (own) or among those other rows (ordered by part, then row), how many
        other rows there are, and them grouped by part (:meth:`_grouped`)."""
        parts = self.parts
        outside = parts.part_of[rows] != i
        ctx = np.unique(rows[outside])
        ctx = ctx[np.lexsort((parts.local[ctx], parts.part_of[ctx]))]  # part, then row
        where = np.empty(rows.shape[0], dtype=np.int64)
        where[~outside] = parts.local[rows[~outside]]
        where[outside] = _positions(ctx, rows[outside])
        return outside, where, ctx.shape[0], self._grouped(ctx)

    def chains(self, i: int, window) -> tuple[Chains, list[tuple[int, Tensor]]]:
        """Part ``i``'s chains, their keys as slots of (context, then own rows), and its
        context rows: ``(part, rows of that part)`` in slot order."""
        if (i, window) not in self.plans:
            c = subset_chains(self.parts.pack, self.parts.parts[i].rows, window)
            outside, slot, context, grouped = self._outside(i, c.key_rows)
            slot[~outside] += context
            self.plans[i, window] = (Chains(c.start, c.length, c.context, slot), grouped)
        return self.plans[i, window]

    def groups(self, i: int, window, width: int):
        """Part ``i``'s chains grouped into attention calls for head width ``width``."""
        if (i, window, width) not in self.plans:
            chains = self.chains(i, window)[0]
            self.plans[i, window, width] = chain_groups(
                chains, self.parts.parts[i].rows.shape[0], self.parts.pack.device, width)
        return self.plans[i, window, width]

    def conv_paths(self, i: int, taps: int) -> tuple[Tensor, list[tuple[int, Tensor]]]:
        """Part ``i``'s convolution paths: ``[taps, n]`` slots of (own rows, then the
        ancestors of other parts they reach, grouped by part), the sink past them."""
        if ("conv", i, taps) not in self.plans:
            parts = self.parts
            rows = parts.parts[i].rows
            n = parts.pack.num_rows
            table = ancestor_table(parts.pack.host.parent_row[:n], taps)[:, rows]
            real = table < n
            outside, slot, context, grouped = self._outside(i, table[real])
            slot[outside] += rows.shape[0]
            index = np.full(table.shape, rows.shape[0] + context, dtype=np.int64)  # the sink
            index[real] = slot
            self.plans["conv", i, taps] = (torch.from_numpy(index).to(parts.pack.device),
                                           grouped)
        return self.plans["conv", i, taps]

    def scan_plan(self, i: int):
        """Part ``i``'s scan chains (cut after every row a part below continues from), where
        each root chain's state comes from (``(part, its exported rows' positions)`` and
        which root chains), and where its own exported rows' states are."""
        if ("scan", i) not in self.plans:
            parts = self.parts
            rows = parts.parts[i].rows
            device = parts.pack.device
            parent = parts.pack.host.parent_row[rows]
            inside = (parent >= 0) & (parts.part_of[np.maximum(parent, 0)] == i)
            local_parent = np.where(inside, parts.local[np.maximum(parent, 0)], -1)
            plan = row_levels(local_parent, self.exported[rows], device)
            # root chains start, in order, at the rows whose parent is not in this part
            above = parent[local_parent < 0]
            carried = np.flatnonzero(above >= 0)
            grouped = []
            for j in np.unique(parts.part_of[above[carried]]):
                sel = carried[parts.part_of[above[carried]] == j]
                position = np.searchsorted(self._exports(int(j)), above[sel])
                grouped.append((int(j), torch.from_numpy(position).to(device),
                                torch.from_numpy(sel).to(device)))
            # this part's exported rows: the level and chain whose last row each one is
            exports = parts.local[self._exports(i)]
            picks, order = [], []
            for d, level in enumerate(plan.levels):
                hit = np.flatnonzero(np.isin(level.last, exports))
                if hit.shape[0]:
                    picks.append((d, torch.from_numpy(hit).to(device)))
                    order.append(level.last[hit])
            reorder = (torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))
                       .to(device) if order else None)
            self.plans["scan", i] = (plan, grouped, len(above), picks, reorder)
        return self.plans["scan", i]

    def _exports(self, i: int) -> np.ndarray:
        """The tree rows of part ``i`` that parts below it continue a scan from, ascending."""
        rows = self.parts.parts[i].rows
        return rows[self.exported[rows]]

    def backward_inputs(self, i: int) -> tuple[list[Tensor], list[Tensor]]:
        """The part's carried tensors whose leaves got gradients from parts below it."""
        tensors, grads = [], []
        for key, own in self.own[i].items():
            for t, leaf in zip(own, self.leaves[i][key]):
                if leaf.grad is not None and t.requires_grad:  # frozen below (LoRA): none
                    tensors.append(t)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self, i: int) -> None:
        self.leaves.pop(i, None)
        self.own.pop(i, None)


def _rng_state(device: torch.device) -> tuple:
    """The random generators a forward draws dropout from: the CPU's, and the device's."""
    cuda = device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None, device


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], state[2])


def _positions(sorted_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Index of each of ``rows`` in ``sorted_rows`` (ordered by part then row, not by row)."""
    order = np.argsort(sorted_rows, kind="stable")
    return order[np.searchsorted(sorted_rows[order], rows)]


class _PartForward(TreeForward):
    """The per-forward object of one part: every token mixer over the part's context and
    own rows."""

    def __init__(self, pack: TreePack, carried: _Carried, index: int):
        self.pack = pack
        self.carried, self.index = carried, index
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()
        self.layer = None  # the recurrent layer under way: its convolution's weight

    def attend(self, module, query, key, value, *, scale, softcap, window, dropout):
        carried = self.carried
        carried.put(self.index, module, key, value)
        groups = carried.groups(self.index, window, query.shape[1] * query.shape[3])
        k_ctx, v_ctx = carried.context(self.index, module, window)
        if k_ctx is not None:
            key, value = torch.cat((k_ctx, key), 2), torch.cat((v_ctx, value), 2)
        return attend_groups(query, key, value, groups, scale=scale, softcap=softcap,
                             window=window, dropout=dropout)

    def conv(self, x, weight, bias):
        # a layer's convolution weight names it, in every forward and recompute of the step
        self.layer = ("conv", weight.data_ptr())
        self.carried.put(self.index, self.layer, x)
        index, grouped = self.carried.conv_paths(self.index, weight.shape[1])
        context = self.carried.gather(self.layer, grouped, 0)
        if context is not None:
            x = torch.cat((x, *context))
        return path_conv1d(x, index, weight, bias)

    def scan(self, kernel, inputs):
        if self.layer is None:
            raise UnsupportedModel("a recurrent scan ran before its layer's convolution: "
                                   "treepack cannot tell which layer's state to carry")
        key = ("scan", self.layer[1])
        plan, grouped, roots, picks, reorder = self.carried.scan_plan(self.index)
        initial = None
        if grouped:  # root chains continuing another part's state; the others from zeros
            states = [self.carried.leaves[j][key][0].index_select(0, position)
                      for j, position, _ in grouped]
            which = torch.cat([chains for _, _, chains in grouped])
            initial = states[0].new_zeros((roots, *states[0].shape[1:]))
            initial = initial.index_copy(0, which, torch.cat(states))
        out, finals = scan_levels(plan, kernel, inputs, initial)
        if picks:
            exported = torch.cat([finals[d].index_select(0, hit) for d, hit in picks])
            self.carried.put(self.index, key, exported.index_select(0, reorder))
        return out
