"""MoE routers on a tree: each packed row weighted by the original tokens it stands for.

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
Megatron's own. Refused on a tree, by name: ``seq_aux_loss`` (per sequence of the batch
dimension; a pack is one), recomputing MoE layers (the router would run again after the tree
forward, without its weights), routing replay (recorded routes are per token of a batch;
a packed row is several tokens, whose recorded routes may differ) and token dropping (an
expert's capacity counts the forward's rows, and a shared row is kept or dropped for every
sequence it stands for).
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

__all__ = ["install", "active", "has_moe", "check"]

_STATE = threading.local()


@contextlib.contextmanager
def active(weights: Tensor, tp_rank: int, tp_size: int, split: bool):
    """During the block, routers weight their tokens by ``weights`` (the forward's rows; this
    TP rank's ``1 / tp_size`` of them where ``split``, Megatron's sequence parallelism)."""
    saved = getattr(_STATE, "weights", None)
    _STATE.weights = weights.chunk(tp_size)[tp_rank] if split and tp_size > 1 else weights
    try:
        yield
    finally:
        _STATE.weights = saved


def _weights(tokens: int) -> Tensor | None:
    w = getattr(_STATE, "weights", None)
    if w is None:
        return None
    if w.shape[0] != tokens:
        raise UnsupportedMegatron(
            f"an MoE router saw {tokens} tokens where the tree forward has {w.shape[0]} rows "
            "on this rank: a router over another split of the rows is not supported")
    return w


class _TreeRouter:
    """The steps of a router that a tree forward weights (module doc; :data:`.compat.
    ROUTER_STEPS`), bound to each router instance of a prepared model by :func:`install`, so
    every other model keeps Megatron's own; each calls the router's own step,
    ``self._stock<name>``, outside a tree forward."""

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None):
        w = _weights(logits.shape[0] * logits.shape[1]) if logits.dim() == 3 else \
            _weights(logits.shape[0])
        if w is None:
            return self._stock_routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            raise UnsupportedMegatron("a padding_mask on a tree forward: a pack has no padding "
                                      "the router should skip (its padding rows weigh 0)")
        self._tree_weights = w.to(logits.dtype)
        try:
            return self._stock_routing(logits, padding_mask=None)
        finally:
            self._tree_weights = None

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


def check(config) -> None:
    """Refuse what an MoE model cannot run on a tree (module doc).

    Raises:
        UnsupportedMegatron: ``moe_enable_routing_replay``; ``recompute_granularity="full"``
            or ``"moe"`` among the selective ``recompute_modules``; an
            ``moe_expert_capacity_factor`` (token dropping).
    """
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        raise UnsupportedMegatron(
            f"moe_expert_capacity_factor={capacity} (token dropping) on a tree: an expert's "
            "capacity is counted over the forward's packed rows, not the unpacked batch's "
            "tokens, and a shared row is kept or dropped for every sequence it stands for, so "
            "which tokens drop differs from the unpacked run. Set "
            "moe_expert_capacity_factor=None (dropless) for tree forwards (or run unpacked)")
    if getattr(config, "moe_enable_routing_replay", False):
        raise UnsupportedMegatron(
            "moe_enable_routing_replay on a tree: replayed routes are recorded per token of "
            "the unpacked batch, and a packed row stands for several tokens whose routes may "
            "differ. Set moe_enable_routing_replay=False for tree forwards (or run unpacked)")
    modules = getattr(config, "recompute_modules", None) or ()
    if getattr(config, "recompute_granularity", None) == "full" or (
            getattr(config, "recompute_granularity", None) == "selective" and "moe" in modules):
        raise UnsupportedMegatron(
            "recomputing MoE layers on a tree: the router would run again in the backward, "
            "after the tree forward, without the rows' weights of its load-balancing losses. "
            "Recompute other modules (e.g. recompute_modules=['core_attn', 'moe_act']) or none")
