"""MoE routers on a tree: each packed row weighted by the original tokens it stands for, and
the rollout's routes replayed row by row.

Megatron's router averages over the tokens of a batch twice: the load-balancing losses count
tokens per expert and sum router probabilities, and the z-loss takes the mean of each token's
squared log-sum-exp. A packed row shared by k sequences is k tokens of the unpacked batch, so
on a tree every one of those sums weights the row by k (:func:`treepack.core.multiplicity
.row_multiplicity`; 0 for the copies that pad a rank's rows): the losses, their gradients and
the expert-bias counts are then the unpacked batch's. Routing itself is per token and needs
nothing.

:func:`install` gives each ``TopKRouter`` instance aux-loss, z-loss and expert-bias steps
that weight the rows during a tree forward (:func:`active`: the forward's weights for the
router's tokens, this TP rank's share under sequence parallelism); outside one they are
Megatron's own.

**Routing replay** (R3: ``moe_enable_routing_replay=True``, each router holding a
``RouterReplay``): a pack built with ``routes=`` keeps one route per row
(``pack.host.row_routes``, ``[rows, moe_layers, topk]``), and rows merge only where routes
agree, so replaying a row's route is replaying the route of every token it stands for. A
row whose route in a layer is -1 throughout (none recorded: verl's replay mask) takes that
layer router's own top-k, as verl's masked replay does.
During a tree forward (:func:`active` with a :class:`Routing` holding the forward's rows'
routes, this TP rank's share under sequence parallelism), each replaying router's top-k is
its MoE layer's column of them (the layer counted over the whole model by
``moe_layer_freq``, as rollout engines record routes, so a pipeline stage reads its own
layers), through the one seam every ``RouterReplay`` has (``get_replay_topk``, overridden on
the instance for that router call only): the replay state a caller set for unpacked
forwards (its targets, action and backward list) is neither read nor changed. The
probabilities are the router's scores at the replayed experts, as Megatron's replay gathers
them. Under full recomputation, Megatron runs each layer's forward again in the backward,
after the tree forward: the layer's tree attention runs first and hands the forward's
:class:`Routing` to its router (:func:`resume`), which weights and replays as before.

Refused on a tree, by name: ``seq_aux_loss`` (per sequence of the batch dimension; a pack is
one), recomputing the MoE layer alone (selective ``"moe"``: without its attention, the
router would run again without its rows' weights and routes), token dropping (an expert's capacity counts the forward's rows, and a
shared row is kept or dropped for every sequence it stands for), a fused router
(``moe_router_fusion`` routes in TransformerEngine, past the replay seam), and a pack whose
routes and model disagree (routes for a model that does not replay, or the other way round).
"""

from __future__ import annotations

import contextlib
import threading
import types

import torch
import torch.distributed as dist
from torch import Tensor

from treepack.adapters.megatron import compat
from treepack.adapters.megatron.attention import UnsupportedMegatron

__all__ = ["Routing", "install", "active", "resume", "has_moe", "replays", "check",
           "check_routes"]

_STATE = threading.local()


class Routing:
    """What the routers of one tree forward on this rank read: each router token's weight
    (the forward's rows; this TP rank's ``1 / tp_size`` of them where ``split``, Megatron's
    sequence parallelism) and, for a replaying model, each one's route (``[rows,
    moe_layers, topk]``, split alike; None: a model that does not replay)."""

    def __init__(self, model, weights: Tensor, routes: Tensor | None, tp_rank: int,
                 tp_size: int, split: bool, unrecorded=()):
        def share(rows):
            return rows.chunk(tp_size)[tp_rank] if split and tp_size > 1 else rows

        self.weights = share(weights)
        self.routes = None if routes is None else share(routes)
        self.column = {} if routes is None else route_columns(model.config, routes.shape[1])
        self.unrecorded = set(unrecorded)  # the columns where some row's route is -1
        self.replayed: dict[int, int] = {}  # layer number -> replays in the forward

    def weights_for(self, tokens: int) -> Tensor:
        if self.weights.shape[0] != tokens:
            raise UnsupportedMegatron(
                f"an MoE router saw {tokens} tokens where the tree forward has "
                f"{self.weights.shape[0]} rows on this rank: a router over another split of "
                "the rows is not supported")
        return self.weights

    @contextlib.contextmanager
    def replaying(self, router):
        """During the block, ``router`` (if it replays) takes its top-k from its MoE layer's
        routes, through the instance's ``get_replay_topk`` (module doc)."""
        replay = getattr(router, "router_replay", None)
        if replay is None or self.routes is None:
            yield
            return
        layer = router.layer_number
        target = self.routes[:, self.column[layer]].long()
        native = self.column[layer] in self.unrecorded

        def get_replay_topk(scores: Tensor, topk: int, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            self.replayed[layer] = self.replayed.get(layer, 0) + 1
            if scores.shape[0] != target.shape[0] or topk != target.shape[1]:
                raise UnsupportedMegatron(
                    f"the router of layer {layer} scored {scores.shape[0]} tokens for top-"
                    f"{topk} where the tree forward replays {tuple(target.shape)} routes on "
                    "this rank: a router over another split of the rows is not supported")
            index = target.to(scores.device)
            if native:  # rows without a recorded route: the router's own top-k
                _, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
                index = torch.where(index[:, :1] >= 0, index, own)
            return scores.gather(1, index), index

        object.__setattr__(replay, "get_replay_topk", get_replay_topk)
        try:
            yield
        finally:
            vars(replay).pop("get_replay_topk", None)


@contextlib.contextmanager
def active(model, routing: Routing):
    """During the block (a tree forward), ``model``'s routers weight and replay by
    ``routing``; after it, every replaying router must have replayed once."""
    saved = getattr(_STATE, "routing", None)
    _STATE.routing = routing
    try:
        yield
    finally:
        _STATE.routing = saved
    if routing.routes is not None:
        layers = [r.layer_number for r in routers(model)
                  if getattr(r, "router_replay", None) is not None]
        missed = sorted(n for n in layers if routing.replayed.get(n) != 1)
        if missed:
            raise UnsupportedMegatron(
                f"the routers of layers {missed} did not replay their routes once in the tree "
                "forward (another routing_type than top-k routes past RouterReplay): route "
                "with top-k for tree forwards")


def resume(attention, routing: Routing | None) -> None:
    """A recomputed layer's tree attention (Megatron's activation recomputation runs the
    layer's forward again in the backward, after the tree forward) hands its forward's
    ``routing`` to the router of its layer, which runs next and takes it (module doc)."""
    if routing is not None and getattr(_STATE, "routing", None) is None and getattr(
            attention, "_tree_router", False):
        attention._tree_resumed = routing


class _TreeRouter:
    """The steps of a router that a tree forward weights and replays (module doc;
    :data:`.compat.ROUTER_STEPS`), bound to each router instance of a prepared model by
    :func:`install`, so every other model keeps Megatron's own; each calls the router's own
    step, ``self._stock<name>``, outside a tree forward."""

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None):
        routing = getattr(_STATE, "routing", None)
        if routing is None:  # a recomputation's, handed on by its layer's tree attention
            attention = getattr(self, "_tree_attention", None)
            routing = None if attention is None else vars(attention).pop("_tree_resumed", None)
        if routing is None:
            return self._stock_routing(logits, padding_mask=padding_mask)
        tokens = logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]
        w = routing.weights_for(tokens)
        if padding_mask is not None:
            raise UnsupportedMegatron("a padding_mask on a tree forward: a pack has no padding "
                                      "the router should skip (its padding rows weigh 0)")
        self._tree_weights = w.to(logits.dtype)
        self._tree_counted = False
        try:
            with routing.replaying(self):
                probs, routing_map = self._stock_routing(logits, padding_mask=None)
        finally:
            self._tree_weights = None
        if not self._tree_counted and self.enable_expert_bias and torch.is_grad_enabled():
            # a routing step that counts the tokens per expert itself, one per row (verl's
            # replay patch of TopKRouter.routing), not through _apply_expert_bias: add the
            # rows' other w - 1 tokens
            with torch.no_grad():
                self.local_tokens_per_expert += (routing_map.to(w.dtype) * (w - 1)[:, None]).sum(
                    0).to(self.local_tokens_per_expert.dtype)
        return probs, routing_map

    def _tree(self) -> Tensor | None:
        return getattr(self, "_tree_weights", None)

    def apply_z_loss(self, logits: Tensor, padding_mask=None):
        w = self._tree()
        if w is None:
            return self._stock_apply_z_loss(logits, padding_mask=padding_mask)
        from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler,
                                                             save_to_aux_losses_tracker)

        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        # the weighted mean over the tokens of every rank of the TP x CP group: each rank adds
        # its rows' share, so that their sum is the unpacked batch's mean
        total = _summed(w.sum(), self.tp_cp_group)
        z_loss = coeff * (w * torch.logsumexp(logits, dim=-1).square()).sum() / total
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number,
                                   self.config.num_layers)
        return logits

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        w = self._tree()
        if w is None:
            return self._stock_apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                              with_padding_mask=with_padding_mask)
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        aux_loss, local = self._weighted_loss(scores_for_aux_loss, routing_map, w, coeff,
                                              self.tp_cp_group)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=local)

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask=False):
        if self._tree() is not None and self.get_aux_loss_coeff("seq_aux_loss") != 0:
            raise UnsupportedMegatron(
                "seq_aux_loss balances experts per sequence of the batch dimension, and a pack "
                "is one sequence of many: use aux_loss or global_aux_loss on trees")
        return self._stock_apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map,
                                              seq_length, bsz, with_padding_mask=with_padding_mask)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map,
                               with_padding_mask=False):
        w = self._tree()
        if w is None:
            return self._stock_apply_global_aux_loss(probs, scores_for_aux_loss, routing_map,
                                                     with_padding_mask=with_padding_mask)
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs

        def running_mean(tokens):  # over the steps since Megatron last reset the counts
            self.global_tokens_per_expert += tokens.to(self.global_tokens_per_expert.dtype)
            self.ga_steps += 1
            return self.global_tokens_per_expert / self.ga_steps

        aux_loss, local = self._weighted_loss(scores_for_aux_loss, routing_map, w, coeff,
                                              self.tp_dp_cp_group, running_mean)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "global_load_balancing_loss", self.tp_dp_cp_group,
            reduce_group_has_dp=True, valid_token_count=local)

    def _weighted_loss(self, scores: Tensor, routing_map: Tensor, w: Tensor, coeff: float,
                       group, counts=lambda tokens: tokens):
        """Megatron's switch load-balancing loss with every token weighted: the tokens per
        expert (through ``counts``) and their total summed over ``group``, this rank's
        probabilities weighted. Returns the loss and this rank's weighted token count."""
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

        tokens = counts(_summed((routing_map.to(w.dtype) * w[:, None]).sum(0), group))
        total = _summed(w.sum(), group)
        loss = switch_load_balancing_loss_func(
            probs=scores * w[:, None], tokens_per_expert=tokens, total_num_tokens=total,
            topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=False)
        return loss, w.sum()

    def _apply_expert_bias(self, routing_map: Tensor, padding_mask=None):
        w = self._tree()
        if w is None:
            return self._stock_apply_expert_bias(routing_map, padding_mask=padding_mask)
        self._tree_counted = True
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += (routing_map.to(w.dtype) * w[:, None]).sum(
                    0).to(self.local_tokens_per_expert.dtype)


def _summed(x: Tensor, group) -> Tensor:
    """``x`` summed over ``group`` (as Megatron sums token counts: without a gradient)."""
    if group is None or dist.get_world_size(group) == 1:
        return x.detach()
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def replays(model) -> bool:
    """Whether ``model`` replays routes: built with ``moe_enable_routing_replay`` (verl's
    patched config: ``enable_routing_replay``), or routers that hold a ``RouterReplay``. A
    pipeline stage without MoE layers says what its model does."""
    config = model.config
    return bool(getattr(config, "moe_enable_routing_replay", False)
                or getattr(config, "enable_routing_replay", False)) or any(
        getattr(r, "router_replay", None) is not None for r in routers(model))


def moe_layers(config) -> list[int]:
    """The layer numbers (1-based, over the whole model) of the MoE layers, in order: the
    pattern of ``config.moe_layer_freq``, as Megatron's layer specs build them and a rollout
    engine records one route per MoE layer."""
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = ([int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int)
               else list(freq))
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def route_columns(config, width: int) -> dict[int, int]:
    """Each MoE layer's column of routes ``width`` layers wide (layer number -> column): one
    column per MoE layer (slime's, verl's R2), or one per layer of the model, a dense
    layer's unread (vLLM's ``routed_experts`` as verl's R3 replays them)."""
    layers = moe_layers(config)
    if width == config.num_layers:
        return {n: n - 1 for n in layers}
    return {n: i for i, n in enumerate(layers)}


def check_routes(model, routes) -> None:
    """Refuse a pack whose routes (``pack.host.row_routes``, or None) and ``model`` disagree:
    routes for a model that does not replay them, a replaying model without routes, or routes
    of another shape than the model's (MoE layers, top-k, experts).

    Raises:
        ValueError: the disagreement, naming both sides and the fix.
    """
    replaying = replays(model)
    if routes is None:
        if replaying:
            raise ValueError(
                "the model replays routes (moe_enable_routing_replay=True) but the pack has "
                "none: build it with TreePack.from_sequences(..., routes=) from the rollout's "
                "routed experts, or build the model without moe_enable_routing_replay")
        return
    if not replaying:
        raise ValueError(
            "the pack carries routes (TreePack.from_sequences(..., routes=...)) but the model "
            "does not replay routes (it was built without moe_enable_routing_replay), so "
            "they would be dropped: build the model with moe_enable_routing_replay=True, or "
            "the pack without routes=")
    config = model.config
    layers = moe_layers(config)
    stray = sorted({r.layer_number for r in routers(model)} - set(layers))
    if stray:
        raise UnsupportedMegatron(
            f"routers in layers {stray}, which moe_layer_freq={config.moe_layer_freq!r} does "
            f"not make MoE layers (those are {layers}): a route's MoE layer is counted by "
            "moe_layer_freq, so build the layers it names")
    width, topk = routes.shape[1:]
    if width not in (len(layers), config.num_layers) or topk != config.moe_router_topk:
        raise ValueError(
            f"the pack's routes are [rows, {width}, {topk}] but the model has {len(layers)} "
            f"MoE layers of {config.num_layers} routing top-{config.moe_router_topk}: give "
            f"each token's route as [len, {len(layers)}, {config.moe_router_topk}] (one row of "
            f"experts per MoE layer) or [len, {config.num_layers}, "
            f"{config.moe_router_topk}] (one per layer)")
    if routes.size and int(routes.max()) >= config.num_moe_experts:
        raise ValueError(
            f"the pack's routes name expert {int(routes.max())} but the model has "
            f"{config.num_moe_experts} experts: record routes with this model's experts")


def routers(model) -> list:
    """The model's ``TopKRouter`` modules."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def has_moe(model) -> bool:
    return bool(routers(model))


def install(model) -> None:
    """Give every ``TopKRouter`` of ``model`` the weighted steps of a tree forward (module
    doc). Idempotent."""
    for router in routers(model):
        if "_stock_routing" in vars(router):
            continue
        for name in compat.ROUTER_STEPS:
            stock = "_stock" + (name if name.startswith("_") else "_" + name)
            object.__setattr__(router, stock, getattr(router, name))  # bound: the class's
            object.__setattr__(router, name, types.MethodType(getattr(_TreeRouter, name),
                                                              router))
        object.__setattr__(router, "_tree", types.MethodType(_TreeRouter._tree, router))
        object.__setattr__(router, "_weighted_loss",
                           types.MethodType(_TreeRouter._weighted_loss, router))
    for layer in getattr(getattr(model, "decoder", None), "layers", ()):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        attention = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if router is not None and attention is not None:  # a recomputed layer's (resume)
            object.__setattr__(router, "_tree_attention", attention)
            object.__setattr__(attention, "_tree_router", True)


def check(config) -> None:
    """Refuse what an MoE model cannot run on a tree (module doc).

    Raises:
        UnsupportedMegatron: ``"moe"`` among the selective ``recompute_modules``; an
            ``moe_expert_capacity_factor`` (token dropping); ``moe_router_fusion`` with
            routing replay.
    """
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        raise UnsupportedMegatron(
            f"moe_expert_capacity_factor={capacity} (token dropping) on a tree: an expert's "
            "capacity is counted over the forward's packed rows, not the unpacked batch's "
            "tokens, and a shared row is kept or dropped for every sequence it stands for, so "
            "which tokens drop differs from the unpacked run. Set "
            "moe_expert_capacity_factor=None (dropless) for tree forwards (or run unpacked)")
    if getattr(config, "moe_enable_routing_replay", False) and getattr(
            config, "moe_router_fusion", False):
        raise UnsupportedMegatron(
            "moe_router_fusion=True with moe_enable_routing_replay: the fused router routes "
            "in TransformerEngine, past RouterReplay, so the pack's routes would not be "
            "replayed. Set moe_router_fusion=False for tree forwards")
    modules = getattr(config, "recompute_modules", None) or ()
    if getattr(config, "recompute_granularity", None) == "selective" and "moe" in modules:
        raise UnsupportedMegatron(
            "recompute_modules with 'moe' on a tree: the MoE layer alone would run again in "
            "the backward, after the tree forward, without its rows' weights and routes (a "
            "whole recomputed layer gets them from its attention). Recompute whole layers "
            "(recompute_granularity='full'), or other modules (e.g. recompute_modules="
            "['core_attn', 'moe_act'])")
