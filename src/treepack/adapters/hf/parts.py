"""A tree larger than one forward, run in parts that each compute their rows once.

:func:`treepack.planning.parts.split` cuts the tree into parts of at most ``max_tokens``
rows. A part's forward runs its own rows only; each attention layer reads the keys and
values of the part's ancestor rows (its context) from the parts that computed them, kept
per layer, and adds its own. In training a part's keys and values go to the parts below it
as detached leaves: each of those parts' backward adds its gradient into them, and the
part's own backward runs once, after all of them, with its loss and those gradients. So the
loss and every gradient are those of one forward over the whole tree (and of every sequence
alone), while each forward holds one part's activations.

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
from treepack.adapters.hf.routing import (HYBRIDS, TREE_FORWARD_KWARG, TreeForward,
                                          UnsupportedModel, check_calls, text_config,
                                          tree_forward)
from treepack.attention.chains import Chains, subset_chains
from treepack.attention.segment import attend_groups, chain_groups
from treepack.core.outputs import TokenLogprobs, check_align, per_sequence_temperature
from treepack.core.softmax import Head, normalise
from treepack.core.tree import TreePack
from treepack.planning.parts import Parts, split

__all__ = ["backward_in_parts", "logprobs_in_parts", "PartsResult", "check_model"]


@dataclasses.dataclass(frozen=True)
class PartsResult:
    """What :func:`backward_in_parts` returns (its gradients are in the parameters)."""

    loss: Tensor  # the step's loss: the sum of the parts' (detached)
    logprobs: Tensor  # [N, L] in the ``align`` layout, every prediction (detached)
    entropy: Tensor | None  # the same shape, when asked for
    parts: int  # forwards run
    rows: int  # rows they computed: the tree's, each once


def backward_in_parts(model, sequences, loss_fn, *, max_tokens: int, temperature=1.0,
                      entropy: bool = False, align: str = "label") -> PartsResult:
    """One step's forward and backward over a tree too large for one forward.

    Args:
        model: a prepared transformers causal LM (attention layers only; activation
            checkpointing non-reentrant, transformers' default), or a DDP
            wrapper of one: each rank runs its own trees' parts and the gradients are
            averaged over the ranks once, at the end; or an FSDP2 (``fully_shard``) one:
            its parameters are gathered once for the step, the gradients reduce-scattered
            once at the end (every rank must call this, as any FSDP step).
        sequences: the step's token sequences (lists, arrays or 1-D tensors).
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
        UnsupportedModel: a hybrid model (its recurrent state at each cut is not carried
            yet), reentrant activation checkpointing, or an FSDP1-wrapped model.
        ValueError: an unprepared model, bad sequences or ``max_tokens``.
    """
    core = check_model(model)
    with _fsdp_unsharded(model):
        run = _Run(_local(model), core, sequences, max_tokens, temperature, entropy,
                   train=True, loss_fn=loss_fn, align=align)
        run.all()
    if _local(model) is not model:
        _average_gradients(model)
    return PartsResult(run.loss.detach(), run.logprobs.detach(),
                       None if run.entropy is None else run.entropy.detach(),
                       len(run.parts.parts), run.parts.rows_computed)


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
        UnsupportedModel: FSDP1 or a hybrid model (the reason in the message).
        ValueError: an unprepared model.
    """
    _refuse_distributed(model)
    core = unwrap(model)
    if not is_prepared(core):
        raise ValueError(f"{type(core).__name__} is not prepared: call "
                         "treepack.hf.prepare(model) first")
    if getattr(text_config(core), "model_type", None) in HYBRIDS:
        raise UnsupportedModel(
            f"{type(core).__name__} has recurrent layers: a part would need each layer's "
            "convolution tail and scan state at its cut, which treepack does not carry yet; "
            "plan this model's trees to fit one forward (treepack.plan)")
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
    parameters are resharded). So each rank runs its own
    sequence of parts, while the collectives (one all-gather per module, one reduce-scatter
    per module) line up across ranks."""
    from torch.distributed.fsdp import FSDPModule

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
        if train:  # reduce-scatters what the parts accumulated, and reshards
            empty = TreePack.empty(1, device=compute_device(model))
            (forward(model, empty).logits.sum() * 0.0).backward()
        else:
            for m in sharded:
                m.reshard()


def _refuse_distributed(model) -> None:
    """FSDP1 gathers parameters with collectives in every forward and backward, in an order
    the parts of each rank's trees would not keep the same across ranks."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise UnsupportedModel(
            f"{type(model).__name__} is wrapped with FSDP1 (FullyShardedDataParallel): its "
            "forwards and backwards gather parameters collectively, and each rank's parts "
            "would run a different sequence of them. Use FSDP2 (fully_shard) or DDP, which "
            "are supported, or plan trees that fit one forward (treepack.plan)")


def _average_gradients(model) -> None:
    """What DDP's reducer does once per step: every gradient averaged over its process
    group. A parameter without a gradient on this rank adds zeros (the ranks' parameter
    lists must line up)."""
    import torch.distributed as dist

    group = model.process_group
    world = dist.get_world_size(group)
    for p in model.module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad /= world


class _Run:
    """One pass over the parts: forwards depth-first, each part's backward after its
    children's."""

    def __init__(self, model, core, sequences, max_tokens, temperature, entropy, *, train,
                 loss_fn=None, align="label"):
        check_align(align)
        self.model, self.core, self.train, self.loss_fn = model, core, train, loss_fn
        self.want_entropy, self.align = entropy, align
        device = compute_device(model)
        pack = TreePack.from_sequences(sequences, device=device)
        self.temperature = per_sequence_temperature(temperature, pack.num_sequences)
        self.parts = split(pack, max_tokens)
        self.children = collections.defaultdict(list)  # part -> the parts hanging off it
        for j, part in enumerate(self.parts.parts):
            self.children[part.parent].append(j)
        self.kv = _KeysValues(self.parts, train)
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
        rows = self.parts.parts[i].rows
        pack = self.parts.pack
        tree = _PartForward(pack, self.kv, i)
        index = torch.from_numpy(rows).to(pack.device)
        with tree_forward():
            out = self.model(input_ids=pack.input_ids[index][None],
                             position_ids=pack.position_ids[index][None], use_cache=False,
                             logits_to_keep=1, output_hidden_states=True,
                             **{TREE_FORWARD_KWARG: tree})
        check_calls(self.core, tree)
        loss = self.outputs(i, out.hidden_states[-1][0])
        for child in self.children[i]:
            self.part(child)
        if self.train:
            tensors, grads = self.kv.backward_inputs(i)
            if loss is not None and loss.requires_grad:
                tensors, grads = [loss, *tensors], [torch.ones_like(loss), *grads]
            if tensors:
                torch.autograd.backward(tensors, grads)
        self.kv.release(i)

    def outputs(self, i: int, hidden: Tensor) -> Tensor | None:
        where, seq, source, token, real = self.predictions[i]
        if source.shape[0] == 0:
            return None
        # one normalised row per (source row, temperature), rows ascending
        normalised, pick = np.unique(np.stack((source, self.temperature[seq])), axis=1,
                                     return_inverse=True)
        pick = pick.reshape(-1)
        head = lm_head(self.model)
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


class _KeysValues:
    """Every attention layer's keys and values of the parts run so far, and the attention
    plan of each part (its chains over its context and own rows)."""

    def __init__(self, parts: Parts, train: bool):
        self.parts, self.train = parts, train
        self.leaves: dict = collections.defaultdict(dict)  # part -> module -> (k, v) leaves
        self.own: dict = collections.defaultdict(dict)  # part -> module -> (k, v) with graph
        self.plans: dict = {}

    def put(self, i: int, module, key: Tensor, value: Tensor) -> None:
        if module in self.own[i]:
            return  # an activation-checkpointing recompute: the forward's are kept
        if self.train and not torch.is_grad_enabled():
            raise UnsupportedModel(
                "a layer ran its forward without gradients during a training step: "
                "reentrant activation checkpointing, whose backward would not see the "
                "gradients the parts below add to this part's keys and values. Use "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})")
        self.own[i][module] = (key, value)
        if self.train:
            key, value = (t.detach().requires_grad_() for t in (key, value))
        self.leaves[i][module] = (key, value)

    def context(self, i: int, module, window) -> tuple[Tensor, Tensor]:
        """The part's context keys and values for ``module``: ``[1, Hkv, C, D]`` each."""
        keys, values = [], []
        for j, local in self.chains(i, window)[1]:
            k, v = self.leaves[j][module]
            keys.append(k.index_select(2, local))
            values.append(v.index_select(2, local))
        return (torch.cat(keys, 2), torch.cat(values, 2)) if keys else (None, None)

    def chains(self, i: int, window) -> tuple[Chains, list[tuple[int, Tensor]]]:
        """Part ``i``'s chains, their keys as slots of (context, then own rows), and its
        context rows: ``(part, rows of that part)`` in slot order."""
        if (i, window) not in self.plans:
            parts = self.parts
            c = subset_chains(parts.pack, parts.parts[i].rows, window)
            outside = parts.part_of[c.key_rows] != i
            ctx = np.unique(c.key_rows[outside])
            ctx = ctx[np.lexsort((parts.local[ctx], parts.part_of[ctx]))]  # part, then row
            slot = np.empty(c.key_rows.shape[0], dtype=np.int64)
            slot[~outside] = ctx.shape[0] + parts.local[c.key_rows[~outside]]
            slot[outside] = _positions(ctx, c.key_rows[outside])
            device = parts.pack.device
            grouped = [(int(j), torch.from_numpy(parts.local[ctx[parts.part_of[ctx] == j]])
                        .to(device)) for j in np.unique(parts.part_of[ctx])]
            self.plans[i, window] = (Chains(c.start, c.length, c.context, slot), grouped)
        return self.plans[i, window]

    def groups(self, i: int, window, width: int):
        """Part ``i``'s chains grouped into attention calls for head width ``width``."""
        if (i, window, width) not in self.plans:
            chains = self.chains(i, window)[0]
            self.plans[i, window, width] = chain_groups(
                chains, self.parts.parts[i].rows.shape[0], self.parts.pack.device, width)
        return self.plans[i, window, width]

    def backward_inputs(self, i: int) -> tuple[list[Tensor], list[Tensor]]:
        """The part's keys and values whose leaves got gradients from parts below it."""
        tensors, grads = [], []
        for module, own in self.own[i].items():
            for t, leaf in zip(own, self.leaves[i][module]):
                if leaf.grad is not None and t.requires_grad:  # frozen below (LoRA): none
                    tensors.append(t)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self, i: int) -> None:
        self.leaves.pop(i, None)
        self.own.pop(i, None)


def _positions(sorted_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Index of each of ``rows`` in ``sorted_rows`` (ordered by part then row, not by row)."""
    order = np.argsort(sorted_rows, kind="stable")
    return order[np.searchsorted(sorted_rows[order], rows)]


class _PartForward(TreeForward):
    """The per-forward object of one part: attention over the part's context and own rows."""

    def __init__(self, pack: TreePack, kv: _KeysValues, index: int):
        self.pack = pack
        self.kv, self.index = kv, index
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()

    def attend(self, module, query, key, value, *, scale, softcap, window, dropout):
        self.kv.put(self.index, module, key, value)
        groups = self.kv.groups(self.index, window, query.shape[1] * query.shape[3])
        k_ctx, v_ctx = self.kv.context(self.index, module, window)
        if k_ctx is not None:
            key, value = torch.cat((k_ctx, key), 2), torch.cat((v_ctx, value), 2)
        return attend_groups(query, key, value, groups, scale=scale, softcap=softcap,
                             window=window, dropout=dropout)
