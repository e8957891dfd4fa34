"""Preparing a model for packs, reversibly, and the checks that it runs them exactly."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from treepack.adapters.hf import compat
from treepack.adapters.hf.routing import (NO_POSITIONS, ORIGINAL, TREE_FORWARD_KWARG,
                                          UnsupportedModel, attention_share, check_calls,
                                          check_layer_types,
                                          registered_name, route_mixers, text_config,
                                          tree_forward, unroute_mixers)
from treepack.core import deprecation
from treepack.core.tree import TreePack
from treepack.forwards.mixers import PackForward
from treepack.planning.planner import PAIR_COST

__all__ = ["prepare", "restore", "prepared", "unprepare", "is_prepared", "original_attention",
           "unwrap", "compute_device", "eval_no_grad", "pair_cost", "hold_routing"]


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> routed mixers


def unwrap(model):
    """The transformers model inside DDP / FSDP / ``torch.compile`` / PEFT wrappers.

    A PEFT model (LoRA and the other adapters peft injects into the base model's layers)
    unwraps to its base model (``get_base_model()``): the injected layers run inside it, so
    the adapters take part in every forward, and ``disable_adapter()`` works as usual.

    Args:
        model: a ``PreTrainedModel`` or a wrapper of one (``.module``, ``._orig_mod``,
            ``get_base_model()``).

    Returns:
        The innermost ``PreTrainedModel``.

    Raises:
        TypeError: no transformers model inside.
    """
    from transformers import PreTrainedModel

    seen = model
    while not isinstance(seen, PreTrainedModel):
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if inner is None and callable(getattr(seen, "get_base_model", None)):
            inner = seen.get_base_model()  # peft
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(
                f"{type(model).__name__} is not a transformers PreTrainedModel (nor a DDP / FSDP "
                "/ torch.compile / PEFT wrapper of one); treepack.hf runs transformers causal "
                "LMs — "
                "use treepack.attention.TreeAttention in your own model"
            )
        seen = inner
    return seen


def compute_device(model) -> torch.device:
    """The device ``model`` computes on: its parameters' device, or, for an FSDP wrapper that
    offloads parameters to the CPU, the device it moves them to for the forward.

    Args:
        model: a causal LM, or a DDP / FSDP1 / FSDP2 / compile wrapper of one.

    Returns:
        A :class:`torch.device` (with its index for an accelerator).

    Raises:
        TypeError: as :func:`unwrap` for something that is not a model.
    """
    device = getattr(model, "compute_device", None)  # FSDP1 (CPUOffload keeps params on CPU)
    if isinstance(device, torch.device):
        return device
    param = next(unwrap(model).parameters())
    mesh = getattr(param, "device_mesh", None)  # FSDP2 shards are DTensors on a device mesh
    if mesh is not None and mesh.device_type != param.device.type:  # CPUOffloadPolicy
        return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
    return param.device


def is_prepared(model) -> bool:
    """Whether :func:`prepare` routed ``model``'s attention through treepack.

    Args:
        model: a transformers causal LM (or wrapper).

    Returns:
        True when prepared.

    Raises:
        TypeError: not a transformers model (:func:`unwrap`).
    """
    return compat.attn_implementation(unwrap(model).config) in ORIGINAL


def original_attention(model) -> str:
    """The attention implementation ``model`` runs without a pack.

    Args:
        model: a transformers causal LM (or wrapper), prepared or not.

    Returns:
        Its own implementation's name (``"sdpa"``, ``"eager"``, ...).

    Raises:
        TypeError: not a transformers model.
    """
    name = compat.attn_implementation(unwrap(model).config)
    return ORIGINAL.get(name, name)


def prepare(model, *, check: bool = True):
    """Route ``model``'s attention through treepack, reversibly.

    Call it once before :func:`forward` (or use :func:`prepared` for a block of code). It
    sets the model's attention implementation to ``treepack_<original>``, which runs the
    tree backend when a pack is passed and the original implementation otherwise, so the
    model still runs ordinary batches exactly as before. A hybrid model's recurrent layers
    (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Bamba's Mamba2, ...) are routed the
    same way: their modeling module's convolution and scan functions run on the tree given a
    pack (:mod:`treepack.recurrent`). :func:`restore` undoes both. Idempotent.

    Args:
        model: a transformers causal LM, or a DDP / FSDP / ``torch.compile`` wrapper of one.
        check: run two 2-token forwards, once, that verify the model reads
            ``position_ids`` (treepack's depths reach the model only that way) and that its
            own code runs a tree forward. They run through ``model`` as given, so with a
            sharded wrapper (FSDP) call ``prepare`` on every rank, as any forward.

    Returns:
        ``model`` itself.

    Raises:
        UnsupportedModel: a model treepack cannot run exactly (recurrent layers of a family
            it does not route, positions not read from ``position_ids``, attention that
            bypasses transformers' interface, ALiBi), or one that fails an ordinary
            forward as well (layers of several dtypes, named); the model is left
            unchanged.
    """
    core = unwrap(model)
    if is_prepared(core):
        hold_routing(core)  # a deep copy of a prepared model: prepared, its routing not held
        return model
    config = core.config
    check_layer_types(core)
    original = compat.attn_implementation(config)
    compat.set_attn_implementation(config, registered_name(original))
    _HELD[core] = route_mixers(core)
    if check:
        try:
            _check_reads_position_ids(model, core)
            _check_causal_from_zero(model, core)
        except Exception:
            compat.set_attn_implementation(config, original)
            unroute_mixers(_HELD.pop(core))
            raise
    return model


def restore(model):
    """Undo :func:`prepare`: the model runs its original attention implementation again.

    Args:
        model: a model (or wrapper), prepared or not.

    Returns:
        ``model`` itself.
    """
    if is_prepared(model):
        core = unwrap(model)
        compat.set_attn_implementation(core.config, original_attention(model))
        hold_routing(core)
        unroute_mixers(_HELD.pop(core))
    return model


def hold_routing(core) -> None:
    """Make this prepared model hold its mixers' routing. A deep copy of a prepared model (a
    reference model) comes prepared, but not among the holders of its modeling module's
    routed functions, which restoring the original would otherwise put back under it."""
    if core not in _HELD:
        _HELD[core] = route_mixers(core)


def unprepare(model):
    """Deprecated: :func:`restore`."""
    deprecation.warn("hf.unprepare", "hf.restore")
    return restore(model)


@contextlib.contextmanager
def prepared(model, *, check: bool = True):
    """``with hf.prepared(model):`` — :func:`prepare` for the block, then :func:`restore`.

    A model that was already prepared stays prepared. Keep gradient-checkpointed backward
    passes inside the block: they recompute attention through the prepared model.

    Args:
        model: a transformers causal LM (or wrapper).
        check: as :func:`prepare`.

    Returns:
        A context manager yielding ``model``.

    Raises:
        As :func:`prepare`.
    """
    already = is_prepared(model)
    prepare(model, check=check)
    try:
        yield model
    finally:
        if not already:
            restore(model)


@contextlib.contextmanager
def eval_no_grad(model):
    """``model`` in eval mode without gradients, then every submodule's own train/eval flag
    back (``model.train(flag)`` would set them all to the root's)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def _check_reads_position_ids(model, core) -> None:
    """Two forwards through ``model`` as given: a sharded wrapper (FSDP) gathers its
    parameters only in its own forward, so every rank runs them together."""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2]], device=device) % text_config(core).vocab_size
    pack = TreePack.from_sequences([[1, 2]], device=device)
    outs = []
    with eval_no_grad(model):
        for positions in ([0, 1], [0, 7]):  # same chain, keys 1 vs 7 positions back
            tree = PackForward(pack, "dense")
            tree.depths = torch.tensor(positions, device=device)
            try:
                with tree_forward(tree):
                    out = model(input_ids=ids, use_cache=False, **{TREE_FORWARD_KWARG: tree},
                                position_ids=torch.tensor([positions], device=device))
            except UnsupportedModel:
                raise
            except Exception as e:  # the model's own code failed on a tree forward
                raise _tree_forward_refusal(model, core, ids, e) from e
            check_calls(core, tree)
            outs.append(out.logits)
    if torch.equal(outs[0], outs[1]) and getattr(text_config(core), "model_type",
                                                 None) not in NO_POSITIONS:
        raise UnsupportedModel(
            f"{type(core).__name__} ignores position_ids (the output did not change when "
            "they did): packed rows would get positions from their packed index instead of "
            "their depth. treepack supports models that take positions from position_ids "
            "(rotary or learned absolute); run this one unpacked"
        )


def _tree_forward_refusal(model, core, ids: Tensor, error: Exception) -> UnsupportedModel:
    """The refusal of a model whose own code raised on the check's tree forward, saying what
    was seen: the model failing an ordinary forward as well (naming the modules whose
    parameters are of another dtype than the rest, where that is so), or failing on the tree
    forward alone, as ALiBi biases and custom attention code do."""
    name = type(core).__name__
    raised = f"its own code raised {type(error).__name__} ({str(error)[:200]})"
    mixed = _dtype_mix(core)
    try:
        with eval_no_grad(model):
            model(input_ids=ids, use_cache=False,
                  position_ids=torch.arange(ids.shape[1], device=ids.device)[None])
    except Exception as ordinary:
        if mixed:
            return UnsupportedModel(
                f"{name} cannot run a tree forward: {raised}, and on an ordinary forward "
                f"without a pack too. Its parameters are of several dtypes: {mixed}; a "
                "layer whose weights are of another dtype than the activations it is given "
                "fails, with or without a pack. Cast the model to one dtype (e.g. "
                "model.to(torch.float32)) and prepare it again")
        return UnsupportedModel(
            f"{name} cannot run a tree forward: {raised}, and an ordinary forward without a "
            f"pack raised {type(ordinary).__name__} ({str(ordinary)[:200]}): the model does "
            "not run as it is. Make model(input_ids=...) run, then prepare it again")
    return UnsupportedModel(
        f"{name} cannot run a tree forward: {raised} when given treepack's attention and "
        "depth position_ids, though it runs an ordinary forward, as models with ALiBi biases "
        "or custom attention code do"
        + (f" (its parameters are of several dtypes: {mixed})" if mixed else "")
        + ". treepack supports models whose layers all attend through transformers' "
        "attention interface and take positions from position_ids (rotary or learned); run "
        "this one unpacked")


def _dtype_mix(core, shown: int = 4) -> str | None:
    """Where a model's floating parameters are not all of one dtype, which are of which (the
    outermost modules wholly of a dtype other than most parameters'), else None."""
    by_dtype: dict[torch.dtype, list[tuple[str, int]]] = {}
    for name, p in core.named_parameters():
        if p.is_floating_point():
            by_dtype.setdefault(p.dtype, []).append((name, p.numel()))
    if len(by_dtype) < 2:
        return None
    main = max(by_dtype, key=lambda d: sum(n for _, n in by_dtype[d]))
    found: list[tuple[str, torch.dtype]] = []  # pre-order: a module before its children

    def inside(name):
        return any(name.startswith(f"{f}.") for f, _ in found)

    for name, module in core.named_modules():
        dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
        if name and len(dtypes) == 1 and main not in dtypes and not inside(name):
            found.append((name, dtypes.pop()))
    for dtype, params in by_dtype.items():  # one of a module's own parameters (a bias)
        if dtype != main:
            found += [(n, dtype) for n, _ in params if not inside(n)]
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return (f"most in {main}, " + ", ".join(f"{n} in {d}" for n, d in found[:shown]) + more)


def _check_causal_from_zero(model, core) -> None:
    """Three ordinary 2-token forwards (no tree) through ``model`` as given: the first token's
    logits must not change with the second token (the model is causal), and the logits must
    not change when ``position_ids = [0, 1]`` is given instead of left to the model (its own
    positions for an unpadded sequence start at 0, as a tree's depths do)."""
    device = next(model.parameters()).device
    vocab = text_config(core).vocab_size
    ids, other = (torch.tensor([pair], device=device) % vocab for pair in ([1, 2], [1, 3]))
    positions = torch.tensor([[0, 1]], device=device)
    try:
        with eval_no_grad(model):
            given = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            changed = model(input_ids=other, position_ids=positions, use_cache=False).logits
            default = model(input_ids=ids, use_cache=False).logits
    except Exception:  # a model that needs more than ids to run ordinarily (a vision-language
        return  # model's processor inputs): the tree forward's checks above stand
    name = type(core).__name__

    def moved(a: Tensor, b: Tensor) -> bool:
        return bool((a.float() - b.float()).abs().max()
                    > 1e-4 * b.float().abs().max().clamp_min(1e-6))

    if moved(changed[0, 0], given[0, 0]):
        raise UnsupportedModel(
            f"{name} is not causal: its first token's logits changed with the second token "
            "(bidirectional attention, as a BERT-style encoder without is_decoder=True). On a "
            "pack its attention would become causal, a different model. Build it as a "
            "decoder (config.is_decoder=True) or run it unpacked")
    if moved(default, given):
        raise UnsupportedModel(
            f"{name} gives an unpadded sequence positions other than 0 .. L-1 when none are "
            "passed (RoBERTa-style models count from padding_idx + 1): a tree's depths start "
            "at 0, so every position would be shifted. Run this model unpacked")


def pair_cost(model) -> float:
    """What one visible attention pair costs ``model``, in packed rows, for
    ``treepack.plan(..., pair_cost=)``: the planner's default scaled by the share of layers
    that attend. A hybrid's linear-attention, state-space and convolution layers cost rows
    (one scan step per row), not pairs; a Qwen3.5 (one attention layer in four) pays a
    quarter.

    Args:
        model: a transformers causal LM (or wrapper).

    Returns:
        The pair cost.
    """
    return PAIR_COST * attention_share(unwrap(model))
