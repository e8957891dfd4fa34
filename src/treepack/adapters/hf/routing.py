"""Routing: each layer's token mixer of a prepared model, with a pack or without.

:func:`treepack.hf.prepare` registers a treepack attention implementation per original one
(``treepack_sdpa``, ...). With a pack (a :class:`~treepack.forwards.TreeForward` passed as a forward keyword) it
runs the tree backend and counts the layers that took it; without one it runs the original
implementation, so one model object serves packed and ordinary batches. Hybrid models' other
mixers (linear attention, state-space, short convolutions) are routed here too, by layer type.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import re

import torch
from torch import Tensor

from treepack.adapters.hf import compat
from treepack.attention import dense
from treepack.forwards.mixers import TreeForward
from treepack.recurrent import decayed_linear_attention, level_chunk

__all__ = ["UnsupportedModel", "tree_forward", "registered_name", "check_calls",
           "text_config", "TREE_FORWARD_KWARG", "ATTENTION_LAYER_TYPES", "MIXER_LAYER_TYPES",
           "check_layer_types", "route_mixers", "unroute_mixers", "attention_share"]


TREE_FORWARD_KWARG = "treepack_tree_forward"  # the model keyword that carries a TreeForward
_PREFIX = "treepack_"
ORIGINAL: dict[str, str] = {}  # registered treepack name -> the original implementation
TREE_FORWARD = contextvars.ContextVar("treepack_tree_forward", default=False)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention",
                         "indexed_attention"}
# Layer types whose attention reads a mask of the forward's rows in its own code (DeepSeek
# sparse attention's indexer picks each query's top-k keys among those it may see): a tree
# forward hands them the pack's [T', T'] ancestor mask, and they attend densely with it.
MASKED_LAYER_TYPES = {"indexed_attention"}
_GDN = {"linear_attention": (False, ("conv", "gated_delta"))}
_MAMBA2 = {"linear_attention": (False, ("conv", "ssd"))}
_MAMBA = {"linear_attention": (False, ("conv", "selective"))}  # Mamba (v1)
# Hybrid families whose recurrent layers treepack routes (model_type): for each layer type
# beside attention, whether it attends too and the routed calls it makes per forward.
HYBRIDS = {
    "qwen3_5": _GDN, "qwen3_5_text": _GDN, "qwen3_5_moe": _GDN, "qwen3_5_moe_text": _GDN,
    "qwen3_next": _GDN, "olmo_hybrid": _GDN, "kimi_linear": _GDN, "bailing_hybrid": _GDN,
    "minimax": {"linear_attention": (False, ("lightning",))},
    "lfm2": {"conv": (False, ("conv",))}, "lfm2_moe": {"conv": (False, ("conv",))},
    "lfm3": {"conv": (False, ("conv",))},
    "bamba": _MAMBA2, "mamba2": _MAMBA2,
    "mamba": _MAMBA, "falcon_mamba": _MAMBA, "jamba": _MAMBA,
    "zamba": _MAMBA | {"hybrid": (True, _MAMBA["linear_attention"][1])},
    "nemotron_h": {**_MAMBA2, "mlp": (False, ()), "moe": (False, ())},
    "falcon_h1": {"hybrid": (True, ("conv", "ssd"))},  # attention and Mamba2 side by side
}
MIXER_LAYER_TYPES = sorted({t for kinds in HYBRIDS.values() for t in kinds})
# Families whose attention layers take no positions at all (order comes from their recurrent
# layers): nothing to read from position_ids, so prepare's position check does not apply.
NO_POSITIONS = {"nemotron_h", "mamba", "mamba2", "falcon_mamba", "jamba", "zamba",
                "kimi_linear"}
REFUSED_HYBRIDS: dict[str, str] = {}  # family -> why its recurrent layers are not routed


class UnsupportedModel(NotImplementedError, ValueError):
    """A model treepack cannot run exactly on a pack; the message says why and what to do.

    The one exception of "this model cannot run exactly". It is a ``NotImplementedError``
    (and so a ``RuntimeError``) and a ``ValueError``, the types earlier releases raised for
    these cases, so code that caught those still catches it.
    """


def registered_name(original: str) -> str:
    """The treepack implementation registered for ``original`` (registered on first use)."""
    # transformers treats any implementation whose name contains "flash" as flash attention,
    # so the registered name must not.
    name = _PREFIX + re.sub(r"[^a-z0-9]+", "_", original.lower().replace("flash", "fa"))
    if name not in ORIGINAL:
        ORIGINAL[name] = original
        compat.register(name, _attention, _mask)
    return name


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention: the tree backend with a pack, the original one without."""
    tree = kwargs.pop(TREE_FORWARD_KWARG, None)
    if tree is None:
        original = ORIGINAL[compat.attn_implementation(module.config)]
        if original in ("eager", "sdpa") and kwargs.get("indices") is not None:
            # DeepSeek sparse attention hands a renamed implementation its top-k as indices,
            # which these two do not read: masked here as the layer masks them for them
            attention_mask = _only_chosen(attention_mask, kwargs.pop("indices"), query)
        return compat.attention_function(module, original)(module, query, key, value,
                                                           attention_mask, **kwargs)
    sinks = kwargs.get("s_aux")
    chunk = _chunk_of(module)
    query = _temperature_at_depths(module, query, tree)
    if _carries_values(attention_mask):
        raise UnsupportedModel(
            f"{type(module).__name__} adds values of its own to the attention mask (a learned "
            "attention bias, as Doge's dynamic mask), which a tree's attention would drop: "
            "the log-probs would go wrong once those weights move, and their gradients would "
            "be missing. Run this model unpacked"
        )
    tree.calls += 1
    tree.windowed += kwargs.get("sliding_window") is not None
    indices = kwargs.pop("indices", None)
    config = getattr(module, "config", None)
    if indices is not None or config is not None and MASKED_LAYER_TYPES & set(
            compat.layer_types(config) or ()):
        # only these: any other mask a layer passes in a tree forward is the model's own
        # causal one over packed positions, which the tree's attention replaces
        out = _masked_attention(tree, query, key, value, attention_mask, indices, kwargs)
        return out.transpose(1, 2).contiguous(), None
    out = tree.attend(
        module, query, key, value,
        scale=kwargs.get("scaling"),
        softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"),
        dropout=kwargs.get("dropout", 0.0),
        **({} if sinks is None else {"sinks": sinks}),
        **({} if chunk is None else {"chunk": chunk}),
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T', H, D] as transformers expects


def _only_chosen(mask, indices, query):
    """``mask`` ``[B, 1, S, T]`` cut to the keys ``indices`` ``[B, S, k]`` chooses, as
    transformers' eager and SDPA paths of DeepSeek sparse attention cut it."""
    chosen = torch.zeros((*indices.shape[:2], mask.shape[-1]), dtype=torch.bool,
                         device=mask.device).scatter(-1, indices.long(), True)[:, None]
    if mask.dtype == torch.bool:
        return mask & chosen
    return mask.masked_fill(~chosen, torch.finfo(query.dtype).min)


def _masked_attention(tree, query, key, value, mask, indices, kwargs):
    """A layer that built its own mask from the pack's (:data:`MASKED_LAYER_TYPES`): dense
    attention with that mask, cut to the keys ``indices`` selects where given (DeepSeek
    sparse attention's top-k, ``[1, rows, k]``), as transformers' SDPA path masks them."""
    if mask is None or mask.dtype != torch.bool:
        mask = tree.dense_mask()[None, None]
    if indices is not None:
        mask = _only_chosen(mask, indices, query)
    if kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModel("a layer with its own mask of the pack (indexed attention) and "
                               "a sliding window or attention sinks: treepack runs neither "
                               "with such a mask")
    return dense.sdpa(query, key, value, mask, scale=kwargs.get("scaling"),
                      softcap=kwargs.get("softcap"), dropout=kwargs.get("dropout", 0.0))


def _chunk_of(module) -> int | None:
    """The chunk of depths a chunked-attention layer (Llama 4's ``chunked_attention``) attends
    within, or None for any other layer."""
    config = getattr(module, "config", None)
    types = compat.layer_types(config) if config is not None else None
    index = getattr(module, "layer_idx", None)
    if not types or "chunked_attention" not in types:
        return None
    if index is None:
        raise UnsupportedModel(
            f"{type(module).__name__} belongs to a model with chunked-attention layers but "
            "does not say which layer it is (no layer_idx): treepack cannot tell whether to "
            "chunk its attention")
    if types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _temperature_at_depths(module, query, tree):
    """Llama 4's attention temperature tuning (its no-rope layers scale each query by
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``) at each row's depth: the layer
    computed it at the row's packed index (``arange`` over the forward's rows), so the query
    is rescaled by the ratio, each scale computed in float32 as the layer does."""
    if not getattr(module, "attn_temperature_tuning", False) or \
            getattr(module, "use_rope", True):
        return query
    depths = getattr(tree, "depths", None)
    if depths is None or depths.shape[0] != query.shape[2]:
        raise UnsupportedModel(
            f"{type(module).__name__} tunes its attention temperature by position, and this "
            "tree forward does not hold its rows' depths: run it through treepack.hf's calls")

    def scales(positions):
        p = positions.float()
        return torch.log1p(torch.floor((p + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    index = torch.arange(query.shape[2], device=query.device)
    wide = torch.promote_types(query.dtype, torch.float32)  # no bias of a bf16 ratio
    ratio = scales(depths.to(query.device)).to(wide) / scales(index).to(wide)
    return (query.to(wide) * ratio[None, None, :, None]).to(query.dtype)


def _carries_values(mask) -> bool:
    """Whether an attention mask a layer passes in a tree forward (where treepack builds none)
    holds values besides 0 and -inf: a bias, not just which keys a query sees."""
    if mask is None or not torch.is_tensor(mask) or not mask.is_floating_point():
        return False
    return bool((torch.isfinite(mask) & (mask != 0)).any())


def _mask(*args, config=None, **kwargs):
    """No mask in a tree forward (the backend has the pack), but for layers that read one in
    their own code (:data:`MASKED_LAYER_TYPES`): the pack's ancestor mask, ``[1, 1, T', T']``;
    the original one otherwise."""
    tree = TREE_FORWARD.get()
    if tree:
        if tree is True or not MASKED_LAYER_TYPES & set(compat.layer_types(config) or ()):
            return None
        return tree.dense_mask()[None, None]
    mask = compat.mask_function(ORIGINAL[compat.attn_implementation(config)])
    if mask is None:
        return kwargs.get("attention_mask")  # transformers passes such masks through as-is
    return mask(*args, config=config, **kwargs)


# ---------------------------------------------------------------------- hybrid layers


def layer_kinds(model) -> dict[str, tuple[bool, tuple[str, ...]]]:
    """For each layer type ``model`` may have: whether it attends, and its routed calls."""
    config = text_config(model)
    kinds = {t: (True, ()) for t in ATTENTION_LAYER_TYPES}
    hybrid = HYBRIDS.get(getattr(config, "model_type", None), {})
    heads = getattr(config, "n_mamba_heads", 1)  # Zamba: one selective scan per Mamba head
    return kinds | {t: (attends, tuple(r for role in roles
                                        for r in [role] * (heads if role == "selective" else 1)))
                    for t, (attends, roles) in hybrid.items()}


def check_layer_types(model) -> None:
    """Refuse, by name and reason, a model with layers treepack does not route."""
    types = set(compat.layer_types(model.config) or ())
    other = sorted(types - ATTENTION_LAYER_TYPES)
    if not other:
        return
    kind = getattr(text_config(model), "model_type", None)
    if kind in REFUSED_HYBRIDS:
        reason = REFUSED_HYBRIDS[kind]
    elif not types <= set(layer_kinds(model)):
        reason = (f"its {other} layers are not ones treepack routes (it routes the "
                  f"recurrent layers of {sorted(HYBRIDS)})")
    else:
        return
    raise UnsupportedModel(
        f"{type(model).__name__} ({kind}) cannot run on a pack: {reason}, and a recurrent or "
        "linear state run across the whole packed forest would mix sequences. Run this model "
        "unpacked")


def attention_share(model) -> float:
    """The share of ``model``'s layers that attend (1 for a model of attention layers only):
    a hybrid's recurrent layers cost rows, not (query, key) pairs."""
    types = compat.layer_types(model.config)
    if not types:
        return 1.0
    kinds = layer_kinds(model)
    return sum(kinds.get(t, (True,))[0] for t in types) / len(types)


_HOLDERS: collections.Counter = collections.Counter()  # (module, function) -> prepared models


def route_mixers(model) -> list:
    """Wrap the mixer functions ``model``'s layers call so that, given a pack, they run on
    the tree; without one they are the originals. Two places hold them:

    - the modeling module (:data:`compat.MIXERS`, transformers 5.11 on): what is routed is
      read from the module itself (a wrapper carries ``treepack_original``), and an original
      goes back when no prepared model holds it. The wrappers read the pack from their own
      keywords or, where the mixer's module drops them (LFM2's short convolution in
      transformers 5.17), from its decoder layer's, taken by a pre-hook;
    - each layer (:data:`compat.LAYER_MIXERS`, transformers 5.10, the one verl 0.9 pins):
      the wrappers read the pack from the layer's own forward keywords, taken by a pre-hook,
      so that an activation-checkpointing recompute sees it as the first forward did.

    Returns:
        What :func:`unroute_mixers` releases.
    """
    held = []
    for module, name in compat.module_functions(model):
        current = compat.lookup(module, name)
        if not hasattr(current, "treepack_original"):
            compat.replace(module, name, _WRAPPERS[compat.MIXERS[name]](current))
        key = (module.__name__, name)
        _HOLDERS[key] += 1
        held.append(key)
    if held:
        held += [_hook_layer(layer) for layer in compat.decoder_layers(model)]
        held.append(_hook_layer(model, _model_enter, _model_leave))
    for layer, names in compat.layer_functions(model):
        held.append(_route_layer(layer, names))
    return held


def unroute_mixers(held: list) -> None:
    """Release what :func:`route_mixers` returned; module-level originals go back at their
    last holder, a layer's at once."""
    import sys

    for key in held:
        if isinstance(key, _RoutedLayer):
            key.release()
            continue
        _HOLDERS[key] -= 1
        if _HOLDERS[key] > 0:
            continue
        del _HOLDERS[key]
        module = sys.modules[key[0]]
        current = compat.lookup(module, key[1])
        if hasattr(current, "treepack_original"):
            compat.replace(module, key[1], current.treepack_original)


class _RoutedLayer:
    """What releasing one layer's routing puts back: its mixer attributes, without its
    hooks (found by identity, so a deep copy's copied hooks go too)."""

    def __init__(self, layer, originals: dict):
        self.layer, self.originals = layer, originals

    def release(self) -> None:
        for hooks, mine in ((self.layer._forward_pre_hooks, (_enter, _model_enter)),
                            (self.layer._forward_hooks, (_leave, _model_leave))):
            for key in [k for k, h in hooks.items() if h in mine]:
                del hooks[key]
        for name, original in self.originals.items():
            setattr(self.layer, name, original)
        replay = getattr(self.layer, "_gradient_checkpointing_func", None)
        if hasattr(replay, "treepack_original"):
            self.layer._gradient_checkpointing_func = replay.treepack_original


# The pack of the layer forward under way, for mixers held per layer. Set from the layer's
# keywords by a pre-hook, so that the wrappers and hooks are plain functions: a deep copy of
# a prepared model (a reference model) routes as the model does.
_LAYER_TREE: contextvars.ContextVar = contextvars.ContextVar("treepack_layer_tree",
                                                             default=None)
# The pack of the model forward under way, for layers the model calls without its keywords
# (Mamba's and Falcon-Mamba's blocks take only the hidden states, cache and mask).
_MODEL_TREE: contextvars.ContextVar = contextvars.ContextVar("treepack_model_tree",
                                                             default=None)


def _enter(layer, args, kwargs):
    tree = kwargs.get(TREE_FORWARD_KWARG)
    _LAYER_TREE.set(tree if tree is not None else _MODEL_TREE.get())
    replay = getattr(layer, "_gradient_checkpointing_func", None)
    if replay is not None and not hasattr(replay, "treepack_original"):
        layer._gradient_checkpointing_func = _replaying_the_pack(replay)


def _replaying_the_pack(checkpoint):
    """A layer's activation-checkpointing function whose recompute sees the pack its first
    forward saw: transformers (5.25) checkpoints a layer's ``forward``, not its call, so the
    pre-hook that took the pack does not run again when the backward recomputes it."""
    def checkpoint_with_pack(function, *args, **kwargs):
        tree = _LAYER_TREE.get()

        def run(*a, **k):
            token = _LAYER_TREE.set(tree)
            try:
                return function(*a, **k)
            finally:
                _LAYER_TREE.reset(token)

        return checkpoint(run, *args, **kwargs)

    checkpoint_with_pack.treepack_original = checkpoint
    return checkpoint_with_pack


def _leave(layer, args, kwargs, output):
    _LAYER_TREE.set(None)


def _model_enter(model, args, kwargs):
    _MODEL_TREE.set(kwargs.get(TREE_FORWARD_KWARG))


def _model_leave(model, args, kwargs, output):
    _MODEL_TREE.set(None)


def _hook_layer(layer, enter=_enter, leave=_leave) -> _RoutedLayer:
    """``layer``'s forward keywords' pack made the routed mixers' inside it (once: a deep copy
    of a hooked layer has the hooks already)."""
    if enter not in layer._forward_pre_hooks.values():
        layer.register_forward_pre_hook(enter, with_kwargs=True)
        layer.register_forward_hook(leave, with_kwargs=True, always_call=True)
    return _RoutedLayer(layer, {})


def _route_layer(layer, names: list[str]) -> _RoutedLayer:
    current = {name: getattr(layer, name) for name in names}
    if all(hasattr(f, "treepack_original") for f in current.values()):
        # a deep copy of a routed layer: its wrappers and hooks came with it
        return _RoutedLayer(layer, {n: f.treepack_original for n, f in current.items()})
    originals = current
    _hook_layer(layer)
    for name in names:
        wrapped = _WRAPPERS[compat.LAYER_MIXERS[name]](originals[name])
        setattr(layer, name, _layer_conv(wrapped, originals[name])
                if compat.LAYER_MIXERS[name] == "conv" else wrapped)
    return _RoutedLayer(layer, originals)


def _layer_conv(wrapped, original):
    """transformers 5.10's call, ``causal_conv1d_fn(x=..., weight=..., seq_idx=...)``, where
    the layer holds None without the causal-conv1d package and then runs its own
    ``silu(conv1d(x))``, which this reproduces off the tree."""
    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if seq_idx is not None:
            kwargs["seq_idx"] = seq_idx
        if original is None:
            activation = "silu"  # the layer's fallback applies silu whatever it was given
        return wrapped(x, weight, bias, activation=activation, **kwargs)

    causal_conv1d_fn.treepack_original = original
    return causal_conv1d_fn


def _tree(kwargs: dict) -> TreeForward | None:
    """The pack a routed mixer runs on: a forward keyword (module-level routing) or what
    its layer's pre-hook took (per-layer routing)."""
    return kwargs.pop(TREE_FORWARD_KWARG, None) or _LAYER_TREE.get()


def _unfused_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    """A depthwise causal convolution as transformers 5.10's layers run it without the
    causal-conv1d package (``conv1d(x)[..., :L]``)."""
    if kwargs.get("seq_idx") is not None:
        raise UnsupportedModel("seq_idx needs the causal-conv1d package")
    length = hidden_states.shape[-1]
    out = torch.nn.functional.conv1d(hidden_states, weight.unsqueeze(1), bias,
                                     padding=weight.shape[-1] - 1, groups=weight.shape[0])
    out = out[..., :length]
    return compat.activation(activation)(out) if activation is not None else out


def _conv(original):
    original = original or _unfused_conv

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        tree = _tree(kwargs)
        if tree is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        if kwargs.get("seq_idx") is not None:
            raise UnsupportedModel("a tree forward runs without sequence boundaries "
                                   "(seq_idx was given)")
        tree.mixer_calls["conv"] += 1
        x = hidden_states[0].transpose(0, 1).to(weight.dtype)  # [T', C]
        out = tree.conv(x, weight, bias)
        if activation is not None:
            out = compat.activation(activation)(out)
        return out.transpose(0, 1)[None].to(hidden_states.dtype)

    causal_conv1d_fn.treepack_original = original
    return causal_conv1d_fn


def _gated_delta(original):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, **kwargs):
        tree = _tree(kwargs)
        if tree is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                            initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        if initial_state is not None or kwargs.get("cu_seqlens") is not None:
            raise UnsupportedModel("a tree forward runs without a cache or sequence boundaries "
                                   "(initial_state / cu_seqlens were given)")
        kwargs.pop("cu_seqlens", None)
        tree.mixer_calls["gated_delta"] += 1

        def kernel(batch, state):  # zeros past a segment's end: beta = 0 and g = 0 keep it
            return original(batch["q"], batch["k"], batch["v"], g=batch["g"], beta=batch["b"],
                            chunk_size=level_chunk(chunk_size, batch["q"].shape[1]),
                            initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

        out = tree.scan(kernel, {"q": query[0], "k": key[0], "v": value[0], "g": g[0],
                                 "b": beta[0]})
        return out[None], None

    torch_chunk_gated_delta_rule.treepack_original = original
    return torch_chunk_gated_delta_rule


def _ssd(original):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                          initial_states=None, dt_softplus=False,
                          dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        tree = kwargs.pop(TREE_FORWARD_KWARG, None)
        if tree is None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, return_final_states=return_final_states,
                            **kwargs)
        if initial_states is not None or kwargs.get("seq_idx") is not None or \
                kwargs.get("cu_seqlens") is not None:
            raise UnsupportedModel("a tree forward runs without a cache or sequence boundaries "
                                   "(initial_states / seq_idx / cu_seqlens were given)")
        tree.mixer_calls["ssd"] += 1
        # The step size as the kernel makes it, so that past a segment's end it is exactly 0
        # (no decay, no input: the state carries over unchanged).
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = torch.nn.functional.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        everything = (float("-inf"), float("inf"))

        def kernel(batch, state):  # A and D: per head (a sequence-parallel rank's heads)
            return original(batch["x"], batch["dt"], batch["A"], batch["B"], batch["C"],
                            level_chunk(chunk_size, batch["x"].shape[1]), D=batch.get("D"),
                            dt_bias=None, initial_states=state, dt_softplus=False,
                            dt_limit=everything, return_final_states=True, **kwargs)

        # B and C are shared by groups of heads (head h reads group h // (heads / groups)):
        # a sequence-parallel rank repeats them up to its heads
        out = tree.scan(kernel, {"x": hidden_states[0], "dt": dt[0], "B": B[0], "C": C[0]},
                        per_head={"A": A, **({} if D is None else {"D": D})})[None]
        return (out, None) if return_final_states else out

    mamba2_chunk_scan.treepack_original = original
    return mamba2_chunk_scan


def _selective(original):
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                             delta_softplus=False, return_last_state=False, **kwargs):
        tree = _tree(kwargs)
        if tree is None:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            **kwargs)
        tree.mixer_calls["selective"] += 1
        # The step size as the kernel makes it, so that past a segment's end it is exactly 0
        # (decay exp(0 * A) = 1, no input: the state carries over unchanged).
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = torch.nn.functional.softplus(dt)

        def kernel(batch, state):  # [b, L, channels]; B and C [b, L, 1, N], one for all
            u, step = batch["u"].transpose(1, 2), batch["dt"].transpose(1, 2)
            b, c = (batch[k][:, :, 0].transpose(1, 2) for k in "BC")
            out, last = original(u, step, batch["A"], b, c, return_last_state=True, **kwargs)
            if state is not None:
                out, last = _from_state(out, last, state, batch["A"], step, c)
            return out.transpose(1, 2), last

        # the family's kernel starts from zeros; D and the gate act per row, after the scan
        out = tree.scan(kernel, {"u": hidden_states[0].T, "dt": dt[0].T, "B": B[0].T[:, None],
                                 "C": C[0].T[:, None]}, per_head={"A": A}, shared=("B", "C"))
        out = out.T[None].to(hidden_states.dtype)
        if D is not None:
            out = out + hidden_states * D[None, :, None]
        if z is not None:
            out = out * torch.nn.functional.silu(z)
        return (out, None) if return_last_state else out

    mamba_selective_scan.treepack_original = original
    return mamba_selective_scan


def _from_state(out: Tensor, last: Tensor, state: Tensor, A: Tensor, dt: Tensor, C: Tensor):
    """A selective scan's output and final state from ``state`` [b, D, N] instead of zeros,
    given them from zeros (the scan is linear in its state: h_t = exp(A * sum_{s<=t} dt_s) *
    state + the zero-start h_t), with ``dt`` [b, D, L] and ``C`` [b, N, L]."""
    decay = torch.exp(A[None, :, None, :] * dt.cumsum(-1)[..., None])  # [b, D, L, N]
    carried = decay * state[:, :, None, :].to(decay.dtype)
    out = out + torch.einsum("bdln,bnl->bdl", carried, C.to(carried.dtype)).to(out.dtype)
    return out, last + carried[:, :, -1].to(last.dtype)


def _lightning(original):
    def forward(self, hidden_states, *args, **kwargs):
        tree = _tree(kwargs)
        if tree is None:
            return original(self, hidden_states, *args, **kwargs)
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise UnsupportedModel("a tree forward runs without a cache (one was given to "
                                   f"{type(self).__name__})")
        tree.mixer_calls["lightning"] += 1
        # as the layer computes it: projections and activation, then per head a linear
        # attention decaying by exp(-slope) a step (its own blocks: the same sums), a norm,
        # a sigmoid output gate and the output projection
        rows, heads, dim = hidden_states.shape[1], self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states))[0].view(rows, heads, 3 * dim)
        q, k, v = torch.split(qkv, dim, dim=-1)
        slope = self.slope_rate.reshape(heads).to(q.dtype)
        g = (-slope)[None].expand(rows, heads)  # zero past a chain's end: the state is kept

        def kernel(batch, state):
            return decayed_linear_attention(batch["q"], batch["k"], batch["v"], batch["g"],
                                            state, chunk=level_chunk(64, batch["q"].shape[1]))

        out = tree.scan(kernel, {"q": q, "k": k, "v": v, "g": g}, layer=self.qkv_proj.weight)
        out = self.norm(out.reshape(1, rows, heads * dim))
        out = torch.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None

    forward.treepack_original = original
    return forward


def _fused(original):
    def fused_kernel(*args, **kwargs):
        if kwargs.get(TREE_FORWARD_KWARG) is not None or _LAYER_TREE.get() is not None or \
                _MODEL_TREE.get() is not None:
            return None  # the layer's unfused path, whose convolution and scan are routed
        return original(*args, **kwargs)

    fused_kernel.__name__ = getattr(original, "__name__", "fused_kernel")
    fused_kernel.treepack_original = original
    return fused_kernel


_WRAPPERS = {"conv": _conv, "gated_delta": _gated_delta, "ssd": _ssd, "selective": _selective,
             "lightning": _lightning, "fused": _fused}


@contextlib.contextmanager
def tree_forward(tree: TreeForward | None = None):
    """While it lasts, mask functions return no mask (the backend has the pack), but the
    pack's ``tree`` ancestor mask for layers that read one (:data:`MASKED_LAYER_TYPES`)."""
    token = TREE_FORWARD.set(tree or True)
    try:
        yield
    finally:
        TREE_FORWARD.reset(token)


def text_config(model):
    """The config of a model's language part (a multimodal model's ``text_config``)."""
    return compat.text_config(model.config)


def _expected_windowed_calls(config) -> int:
    """Layers the model gives a sliding window, by its config."""
    if getattr(config, "sliding_window", None) is None:
        return 0
    types = getattr(config, "layer_types", None)
    if types:
        return sum(t == "sliding_attention" for t in types)
    return config.num_hidden_layers if getattr(config, "use_sliding_window", True) else 0


def check_calls(model, tree: TreeForward) -> None:
    """Refuse a forward in which some layers bypassed the tree attention or the routed
    recurrent mixers, or dropped their sliding window."""
    config = text_config(model)
    types = compat.layer_types(model.config)
    kinds = layer_kinds(model)
    expected = config.num_hidden_layers if not types else sum(kinds[t][0] for t in types)
    if tree.calls != expected:
        raise UnsupportedModel(
            f"{type(model).__name__} has {expected} attention layers but {tree.calls} of them "
            "attended through transformers' attention interface: the others would attend "
            "across the packed forest (siblings would see each other). treepack supports "
            "models whose every attention layer uses the attention interface; run this one "
            "unpacked"
        )
    roles = collections.Counter(role for t in types or () for role in kinds[t][1])
    if roles != +tree.mixer_calls:
        raise UnsupportedModel(
            f"{type(model).__name__}'s recurrent layers should make {dict(roles)} routed calls "
            f"per forward but made {dict(tree.mixer_calls)}: a layer computed its convolution "
            "or scan another way (a fused kernel, another transformers version), which would "
            "run across the packed forest. Run this model unpacked"
        )
    windowed = _expected_windowed_calls(config)
    if tree.windowed != windowed:
        raise UnsupportedModel(
            f"{type(model).__name__} uses a sliding window of {config.sliding_window} on "
            f"{windowed} layers, but {tree.windowed} of them passed it to the attention "
            "interface (the model applies it through its own mask, which a tree forward "
            "cannot use): those layers would attend without their window. Run this model "
            "unpacked"
        )
