"""Run transformers causal LMs on a TreePack (transformers >= 5; imported lazily).

    out = treepack.hf.forward(model, pack)            # out.logits: [1, T', V]
    logps = pack.token_logprobs(out.logits[0])        # [N, L]

``forward`` prepares the model once (:func:`prepare`): its attention implementation becomes a
treepack one that runs the tree backend when a pack is given and the model's original
attention (sdpa, eager, flex, ...) otherwise, so one model object serves packed and ordinary
padded batches. The pack reaches every attention layer as a forward keyword argument, so
gradient checkpointing recomputes the same tree attention.

What would be silently wrong is refused with an error naming the fix: a model whose layers do
not all go through transformers' attention interface (custom attention code, recurrent or
linear-attention layers), a model that ignores ``position_ids``, attention sinks, caches,
``labels`` (the loss would count packed rows), and keyword arguments that would hand sequence
boundaries to a flash "padding-free" path. An MoE router auxiliary loss is recomputed with each
packed row weighted by the number of original tokens it stands for, so it equals the
unpacked one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import weakref

import torch
from torch import Tensor

from treepack.adapters.hf import compat
from treepack.attention import TreeAttention
from treepack.core.tree import TreePack

__all__ = ["forward", "forward_hidden", "HiddenOutput", "prepare", "restore", "prepared",
           "unprepare", "is_prepared", "original_attention", "unwrap", "lm_head",
           "row_multiplicity", "router_aux_loss", "batch_router_aux_loss", "UnsupportedModel",
           "compute_device", "forward_lean"]

TREE_FORWARD_KWARG = "treepack_tree_forward"  # the model keyword that carries a _TreeForward
_PREFIX = "treepack_"
_ORIGINAL: dict[str, str] = {}  # registered treepack name -> the original implementation
_TREE_FORWARD = contextvars.ContextVar("treepack_tree_forward", default=False)

# Keyword arguments that would give the model another notion of sequence boundaries or a
# cache, or a loss over packed rows.
_REFUSED_KWARGS = {
    "input_ids": "the pack supplies input_ids",
    "inputs_embeds": "the pack supplies input_ids",
    "attention_mask": "the pack's tree structure is the attention mask",
    "position_ids": "the pack supplies position_ids (depths)",
    "cache_position": "a pack is one forward from scratch, without a cache",
    "past_key_values": "a pack is one forward from scratch, without a cache",
    "cache": "a pack is one forward from scratch, without a cache",
    "labels": "the model's loss would average over packed rows; compute log-probs with "
              "pack.token_logprobs(out.logits[0]) and your loss on the [N, L] layout",
    "cu_seq_lens_q": "flash 'padding-free' boundaries would let siblings see each other",
    "cu_seq_lens_k": "flash 'padding-free' boundaries would let siblings see each other",
    "max_length_q": "flash 'padding-free' boundaries would let siblings see each other",
    "max_length_k": "flash 'padding-free' boundaries would let siblings see each other",
    "seq_idx": "flash 'padding-free' boundaries would let siblings see each other",
}
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


class UnsupportedModel(NotImplementedError):
    """A model treepack cannot run exactly on a pack; the message says why and what to do."""


# ---------------------------------------------------------------------- registration


def _registered_name(original: str) -> str:
    # transformers treats any implementation whose name contains "flash" as flash attention,
    # so the registered name must not.
    name = _PREFIX + re.sub(r"[^a-z0-9]+", "_", original.lower().replace("flash", "fa"))
    if name not in _ORIGINAL:
        _ORIGINAL[name] = original
        compat.register(name, _attention, _mask)
    return name


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention: the tree backend with a pack, the original one without."""
    tree = kwargs.pop(TREE_FORWARD_KWARG, None)
    if tree is None:
        original = _ORIGINAL[compat.attn_implementation(module.config)]
        return compat.attention_function(module, original)(module, query, key, value,
                                                           attention_mask, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModel(
            f"{type(module).__name__} uses attention sinks (s_aux), which treepack's backends "
            "do not implement yet; run this model unpacked"
        )
    tree.calls += 1
    tree.windowed += kwargs.get("sliding_window") is not None
    out = tree.attention(
        query, key, value,
        scale=kwargs.get("scaling"),
        softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"),
        dropout=kwargs.get("dropout", 0.0),
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T', H, D] as transformers expects


def _mask(*args, config=None, **kwargs):
    """No mask in a tree forward (the backend has the pack); the original one otherwise."""
    if _TREE_FORWARD.get():
        return None
    mask = compat.mask_function(_ORIGINAL[compat.attn_implementation(config)])
    if mask is None:
        return kwargs.get("attention_mask")  # transformers passes such masks through as-is
    return mask(*args, config=config, **kwargs)


# ---------------------------------------------------------------------- preparing a model


def is_prepared(model) -> bool:
    """Whether :func:`prepare` routed ``model``'s attention through treepack.

    Args:
        model: a transformers causal LM (or wrapper).

    Returns:
        True when prepared.

    Raises:
        TypeError: not a transformers model (:func:`unwrap`).
    """
    return compat.attn_implementation(unwrap(model).config) in _ORIGINAL


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
    return _ORIGINAL.get(name, name)


def prepare(model, *, check: bool = True):
    """Route ``model``'s attention through treepack, reversibly.

    Call it once before :func:`forward` (or use :func:`prepared` for a block of code). It
    sets the model's attention implementation to ``treepack_<original>``, which runs the
    tree backend when a pack is passed and the original implementation otherwise, so the
    model still runs ordinary batches exactly as before. :func:`restore` undoes it.
    Idempotent.

    Args:
        model: a transformers causal LM, or a DDP / FSDP / ``torch.compile`` wrapper of one.
        check: run two 2-token forwards, once, that verify the model reads
            ``position_ids`` (treepack's depths reach the model only that way) and that its
            own code runs a tree forward. They run through ``model`` as given, so with a
            sharded wrapper (FSDP) call ``prepare`` on every rank, as any forward.

    Returns:
        ``model`` itself.

    Raises:
        ValueError / UnsupportedModel: a model treepack cannot run exactly (recurrent or
            linear-attention layers, positions not read from ``position_ids``, attention
            that bypasses transformers' interface, ALiBi, attention sinks); the model is
            left unchanged.
    """
    core = unwrap(model)
    if is_prepared(core):
        return model
    config = core.config
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types <= _ATTENTION_LAYER_TYPES:
        other = sorted(layer_types - _ATTENTION_LAYER_TYPES)
        raise ValueError(
            f"{type(core).__name__} has {other} layers: their recurrent or linear state would "
            "run across the whole packed forest, mixing sequences. treepack supports models "
            f"whose layers are all {sorted(_ATTENTION_LAYER_TYPES)}; run this one unpacked"
        )
    original = compat.attn_implementation(config)
    compat.set_attn_implementation(config, _registered_name(original))
    if check:
        try:
            _check_reads_position_ids(model, core)
        except Exception:
            compat.set_attn_implementation(config, original)
            raise
    return model


def restore(model):
    """Undo :func:`prepare`: the model runs its original attention implementation again.

    Args:
        model: a model (or wrapper), prepared or not.

    Returns:
        ``model`` itself.

    Raises:
        Nothing of its own.
    """
    if is_prepared(model):
        compat.set_attn_implementation(unwrap(model).config, original_attention(model))
    return model


unprepare = restore  # the name of earlier releases


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
def _eval_no_grad(model):
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
    ids = torch.tensor([[1, 2]], device=device) % _text_config(core).vocab_size
    pack = TreePack.from_sequences([[1, 2]], device=device)
    outs = []
    with _eval_no_grad(model):
        for positions in ([0, 1], [0, 7]):  # same chain, keys 1 vs 7 positions back
            tree = _TreeForward(pack, "dense")
            try:
                with _tree_forward():
                    out = model(input_ids=ids, use_cache=False, **{TREE_FORWARD_KWARG: tree},
                                position_ids=torch.tensor([positions], device=device))
            except UnsupportedModel:
                raise
            except Exception as e:  # the model's own code failed on a tree forward
                raise UnsupportedModel(
                    f"{type(core).__name__} cannot run a tree forward: its own code raised "
                    f"{type(e).__name__} ({str(e)[:200]}) when given treepack's attention and "
                    "depth position_ids, as models with ALiBi biases or custom attention code "
                    "do. treepack supports models whose layers all attend through "
                    "transformers' attention interface and take positions from position_ids "
                    "(rotary or learned); run this one unpacked"
                ) from e
            _check_calls(core, tree)
            outs.append(out.logits)
    if torch.equal(outs[0], outs[1]):
        raise ValueError(
            f"{type(core).__name__} ignores position_ids (the output did not change when "
            "they did): packed rows would get positions from their packed index instead of "
            "their depth. treepack supports models that take positions from position_ids "
            "(rotary or learned absolute); run this one unpacked"
        )


# ---------------------------------------------------------------------- forward


class _TreeForward:
    """The per-forward object every attention layer receives: the backend and a call count."""

    def __init__(self, pack: TreePack, backend: str, block_size: int = 128):
        self.attention = TreeAttention(pack, backend, block_size=block_size)
        self.calls = 0
        self.windowed = 0  # calls that passed a sliding window


@contextlib.contextmanager
def _tree_forward():
    token = _TREE_FORWARD.set(True)
    try:
        yield
    finally:
        _TREE_FORWARD.reset(token)


def _text_config(model):
    return compat.text_config(model.config)


def _expected_windowed_calls(config) -> int:
    """Layers the model gives a sliding window, by its config."""
    if getattr(config, "sliding_window", None) is None:
        return 0
    types = getattr(config, "layer_types", None)
    if types:
        return sum(t == "sliding_attention" for t in types)
    return config.num_hidden_layers if getattr(config, "use_sliding_window", True) else 0


def _check_calls(model, tree: _TreeForward) -> None:
    config = _text_config(model)
    expected = config.num_hidden_layers
    if tree.calls != expected:
        raise RuntimeError(
            f"{type(model).__name__} has {expected} layers but {tree.calls} of them attended "
            "through transformers' attention interface: the others would attend across the "
            "packed forest (siblings would see each other). treepack supports models whose "
            "every layer uses the attention interface; run this one unpacked"
        )
    windowed = _expected_windowed_calls(config)
    if tree.windowed != windowed:
        raise NotImplementedError(
            f"{type(model).__name__} uses a sliding window of {config.sliding_window} on "
            f"{windowed} layers, but {tree.windowed} of them passed it to the attention "
            "interface (the model applies it through its own mask, which a tree forward "
            "cannot use): those layers would attend without their window. Run this model "
            "unpacked"
        )


def _check_rope(model, pack: TreePack) -> None:
    """Refuse rotary scalings whose frequencies depend on the longest position in the batch
    (dynamic NTK, LongRoPE) once the pack reaches the length where they change: every
    sequence of the pack would get the frequencies of its longest one."""
    config = _text_config(model)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return
    nested = all(isinstance(v, dict) for v in params.values()) and params
    for p in (params.values() if nested else [params]):
        kind = str(p.get("rope_type", p.get("type", "default")))
        if "dynamic" not in kind and kind != "longrope":
            continue
        limit = (p.get("original_max_position_embeddings")
                 or getattr(config, "original_max_position_embeddings", None)
                 or config.max_position_embeddings)
        if pack.max_length > limit:
            raise NotImplementedError(
                f"{type(model).__name__} uses rope_type={kind!r}, whose rotary frequencies "
                f"change once a batch reaches {limit} positions, and this pack's longest "
                f"sequence has {pack.max_length}: packed together, every sequence would get "
                "the longest one's frequencies, unlike each run alone. Plan packs with "
                f"sequences of at most {limit} tokens, or run these unpacked"
            )


@dataclasses.dataclass
class HiddenOutput:
    """What :func:`forward` returns with ``return_hidden=True``."""

    last_hidden_state: Tensor  # [1, T', H]: the input of the LM head (after the final norm)
    aux_loss: Tensor | None = None  # MoE load-balancing loss of the original tokens
    router_logits: tuple | None = None


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


def forward(model, pack: TreePack, backend: str = "auto", *, return_hidden: bool = False,
            block_size: int = 128, **kwargs):
    """Run a prepared causal LM once over ``pack`` and return the model's output.

    The model sees ``pack.input_ids`` with depth ``position_ids`` and tree attention from
    ``backend``, without a cache. ``model`` may be wrapped (DDP, FSDP, ``torch.compile``):
    the call goes through the wrapper, so its gradient synchronisation runs as usual.

    Args:
        model: a transformers causal LM on which :func:`prepare` was called.
        pack: the :class:`~treepack.TreePack`, on the model's device.
        backend: ``"auto"`` (the default: FlashAttention varlen on a GPU where it applies,
            else flex, else segment), ``"varlen"``, ``"segment"``, ``"flex"`` or ``"dense"``;
            see :mod:`treepack.attention`.
        return_hidden: kept for earlier releases; use :func:`forward_hidden`.
        block_size: FlexAttention's block size (``flex`` only).
        **kwargs: passed to the model (e.g. ``output_router_logits=True``).

    Returns:
        The model's output: ``.logits`` ``[1, T', V]``; for an MoE model with router logits,
        ``.aux_loss`` is the load-balancing loss of the original tokens
        (:func:`router_aux_loss`).

    Raises:
        ValueError: an unprepared model, a pack on another device or with ids past the
            embedding, or keyword arguments that would break the tree (caches, labels,
            attention masks, flash boundaries, ``output_attentions``).
        RuntimeError / NotImplementedError: a layer that bypassed the tree attention, a
            window the model keeps in its own mask, a rotary scaling that reads the longest
            position, or a backend that cannot run these inputs (with every reason).
    """
    if return_hidden:
        return forward_hidden(model, pack, backend, block_size=block_size, **kwargs)
    out, aux = _run(model, pack, backend, block_size, kwargs)
    if aux is not None:
        out.aux_loss = aux
    return out


def forward_hidden(model, pack: TreePack, backend: str = "auto", *, block_size: int = 128,
                   **kwargs) -> HiddenOutput:
    """:func:`forward` without the ``[T', V]`` logits, for :func:`treepack.logprobs_from_hidden`.

    The LM head runs on one row only; the input of the head comes back instead.

    Args:
        model, pack, backend, block_size, **kwargs: as :func:`forward`.

    Returns:
        A :class:`HiddenOutput`: ``.last_hidden_state`` ``[1, T', H]`` (after the final
        norm), and for an MoE model ``.aux_loss`` / ``.router_logits``.

    Raises:
        As :func:`forward`.
    """
    _named_outputs(kwargs, "forward_hidden")
    kwargs = {**kwargs, "logits_to_keep": 1, "output_hidden_states": True}
    out, aux = _run(model, pack, backend, block_size, kwargs)
    return HiddenOutput(out.hidden_states[-1], aux, getattr(out, "router_logits", None))


def forward_lean(model, pack: TreePack, backend: str = "auto", *, temperature: float = 1.0,
                 with_entropy: bool = False, chunk_size: int | None = None,
                 block_size: int = 128, **kwargs):
    """The model over the pack with the lean head computed inside its forward.

    For this one forward the model's output layer is replaced by
    :func:`treepack.row_logprobs_from_hidden` on its own weight, so the ``[T', V]`` logits
    never exist, and the head's weight is used while the model's wrapper has it in place:
    FSDP1 and FSDP2 (sharded, or offloaded to the CPU) gather and reduce its gradient as for
    the ordinary head, where :func:`lm_head` would have to gather it outside the forward.
    Models that change logits after the head (soft-capping, logit scaling) are refused. An
    MoE model's router loss is not returned (use :func:`forward_hidden` for it).

    Args:
        model, pack, backend, block_size, **kwargs: as :func:`forward`.
        temperature, with_entropy, chunk_size: as :func:`treepack.row_logprobs_from_hidden`.

    Returns:
        :class:`treepack.logprobs.RowLogprobs` per packed row: ``logprobs`` [T'] (of each
        row's token given its parent row) and ``entropy`` [T'] or None.

    Raises:
        NotImplementedError: an output layer that is not ``Linear``, or logits the model
            transforms after its head.
        ValueError: as :func:`forward`.
    """
    from treepack.lean.logprobs import RowLogprobs, row_logprobs_from_hidden

    core = unwrap(model)
    head = core.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"{type(core).__name__}'s output layer is a {type(head).__name__}, not a Linear "
            "layer; use hf.forward and pack.token_logprobs")
    transforms = {k: v for k, v in _lm_head_kwargs(core, gather=False).items()
                  if k in ("softcap", "scale")}
    if transforms:
        raise NotImplementedError(
            f"{type(core).__name__} transforms its logits after the head ({transforms}); "
            "forward_lean would hand them its log-probs. Use hf.forward_hidden with "
            "treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model)) instead")
    rows = {}

    def lean(hidden: Tensor) -> Tensor:  # [1, T', H] -> [1, T', 2], inside the forward
        out = row_logprobs_from_hidden(pack, hidden[0], head.weight, bias=head.bias,
                                       temperature=temperature, chunk_size=chunk_size,
                                       with_entropy=with_entropy)
        entropy = out.entropy if with_entropy else torch.zeros_like(out.logprobs)
        rows["out"] = torch.stack([out.logprobs, entropy], dim=-1)[None]
        return rows["out"]

    _named_outputs(kwargs, "forward_lean")
    with _forward_replaced(head, lean):  # this instance, this forward only
        out, _ = _run(model, pack, backend, block_size, kwargs)
    if out.logits is not rows.get("out"):  # it must be the model's output, unchanged, so
        raise NotImplementedError(  # that a wrapper's backward hooks see it
            f"{type(core).__name__} changes the output of its head before returning it; "
            "use hf.forward_hidden with treepack.logprobs_from_hidden instead")
    result = out.logits[0]
    return RowLogprobs(result[:, 0], result[:, 1] if with_entropy else None)


def _named_outputs(kwargs: dict, caller: str) -> None:
    """Refuse ``return_dict=False``: these calls read the model's named outputs."""
    if kwargs.get("return_dict", True) is False:
        raise ValueError(f"hf.{caller} reads the model's named outputs and returns its own "
                         "named result: drop return_dict=False")


@contextlib.contextmanager
def _forward_replaced(module, forward):
    """``module`` computing ``forward`` instead of its own, then exactly what was there again.

    An instance may carry a forward of its own: accelerate's hooks (``device_map``, CPU or
    disk offload) set ``module.forward`` to a wrapper that loads the weights, calls
    ``module._old_forward`` and offloads them again. There the wrapper's inner forward is
    replaced, so the hook still runs around ``forward``; elsewhere ``module.forward``."""
    name = "_old_forward" if "forward" in vars(module) and hasattr(module, "_old_forward") \
        else "forward"
    missing = object()
    saved = vars(module).get(name, missing)
    setattr(module, name, forward)
    try:
        yield
    finally:
        if saved is missing:
            delattr(module, name)
        else:
            setattr(module, name, saved)


def _run(model, pack: TreePack, backend: str, block_size: int, kwargs: dict):
    """The model over the pack: its output and the router loss of the original tokens."""
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack, got {type(pack).__name__}: build one with "
                        "treepack.TreePack.from_sequences(sequences)")
    for key in kwargs:
        if key in _REFUSED_KWARGS:
            raise ValueError(f"treepack.hf.forward does not take {key!r}: {_REFUSED_KWARGS[key]}")
    if kwargs.pop("use_cache", False):
        raise ValueError("use_cache=True: a pack is one forward from scratch, without a cache")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: treepack's attention backends never form the "
                         "attention weights (the varlen, segment and flex kernels are fused); "
                         "run the model unpacked to inspect them")
    core = unwrap(model)
    if not is_prepared(core):
        raise ValueError(
            f"{type(core).__name__} is not prepared: call treepack.hf.prepare(model) once "
            "before hf.forward (it routes the model's attention through treepack; ordinary "
            "batches still run the original attention, and hf.restore(model) undoes it), or "
            "run the forward inside `with treepack.hf.prepared(model):`"
        )
    device = compute_device(model)
    if pack.device != device:
        raise ValueError(f"the model ({type(core).__name__}) computes on {device} but the pack "
                         f"is on {pack.device}; move the pack with pack.to({str(device)!r})")
    vocab = core.get_input_embeddings().num_embeddings
    if pack.max_token_id >= vocab:
        raise ValueError(
            f"the pack has token id {pack.max_token_id} but {type(core).__name__}'s embedding "
            f"has {vocab} rows: tokenize with the model's own tokenizer (ids 0 .. {vocab - 1})"
        )
    _check_rope(core, pack)
    tree = _TreeForward(pack, backend, block_size)
    with _tree_forward():
        out = model(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None],
                    use_cache=False, **{TREE_FORWARD_KWARG: tree}, **kwargs)
    _check_calls(core, tree)
    aux = None
    if getattr(out, "aux_loss", None) is not None:
        aux = router_aux_loss(core, pack, out.router_logits)
    return out, aux


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


_LM_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lm_head(model, *, check: bool = True) -> dict:
    """The LM head of ``model`` as keyword arguments of :func:`treepack.logprobs_from_hidden`.

    ``weight`` and ``bias`` of the output projection, plus what the model does to the logits
    after it: ``softcap`` (Gemma 2's ``final_logit_softcapping``) and ``scale`` (Cohere's
    ``logit_scale``, Granite's ``1 / logits_scaling``)::

        hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
        logps = treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model))

    A sharded (FSDP2) head weight is gathered.

    Args:
        model: a transformers causal LM (or wrapper).
        check: the first call per model runs one 3-token forward and compares these
            keywords' logits with the model's own.

    Returns:
        ``dict(weight=..., bias=..., [softcap=...], [scale=...])``.

    Raises:
        NotImplementedError: an output layer that is not ``Linear``, or a logit transform
            treepack does not know (the check failed).
    """
    model = unwrap(model)
    kwargs = _lm_head_kwargs(model)
    if check and model not in _LM_HEAD_CHECKED:
        _check_lm_head(model, kwargs)
        _LM_HEAD_CHECKED[model] = True
    return kwargs


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_lm_head(model, kwargs: dict) -> None:
    from treepack.lean.logprobs import head_logits

    device = kwargs["weight"].device
    ids = torch.tensor([[1, 2, 3]], device=device) % _text_config(model).vocab_size
    with _eval_no_grad(model):
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1][0]
        if not torch.is_autocast_enabled(device.type):
            hidden = hidden.to(kwargs["weight"].dtype)
        z = head_logits(hidden, kwargs["weight"], kwargs.get("bias"),
                          kwargs.get("scale", 1.0), kwargs.get("softcap"), 1.0)
    logits = out.logits[0].to(z.dtype)
    tol = (1e-2 if kwargs["weight"].dtype in (torch.bfloat16, torch.float16) else 1e-4)
    if not torch.allclose(z, logits, rtol=tol, atol=tol * float(logits.abs().max())):
        raise NotImplementedError(
            f"{type(model).__name__} transforms its logits after the LM head in a way "
            "treepack.hf.lm_head does not know (it knows final_logit_softcapping, logit_scale "
            "and logits_scaling): log-probs from hidden states would be wrong. Use "
            "pack.token_logprobs(hf.forward(model, pack).logits[0]) for this model"
        )


def _lm_head_kwargs(model, gather: bool = True) -> dict:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(
            f"{type(model).__name__}'s output layer is a {type(head).__name__}, not a Linear "
            "layer; compute log-probs from out.logits with pack.token_logprobs instead"
        )
    config = _text_config(model)
    full = _full if gather else (lambda t: t)
    kwargs = {"weight": full(head.weight), "bias": None if head.bias is None else full(head.bias)}
    if getattr(config, "final_logit_softcapping", None):
        kwargs["softcap"] = float(config.final_logit_softcapping)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    if scale != 1.0:
        kwargs["scale"] = scale
    return kwargs


# ---------------------------------------------------------------------- MoE


def row_multiplicity(pack: TreePack) -> Tensor:
    """How many original tokens each packed row stands for.

    Args:
        pack: a :class:`~treepack.TreePack`.

    Returns:
        [T'] float: occurrences of each row (0 for padding).

    Raises:
        Nothing of its own.
    """
    rows = pack.rows[pack.rows >= 0]
    return torch.bincount(rows, minlength=pack.num_rows).float()


def router_aux_loss(model, pack, router_logits) -> Tensor:
    """The MoE load-balancing loss of one pack's original tokens, from its router logits.

    Uses the model's own ``load_balancing_loss_func`` with every packed row weighted by the
    number of original tokens it stands for, which is what the unpacked batch computes.
    (A list of packs with a list of router logits is still accepted, as in earlier releases:
    it means :func:`batch_router_aux_loss`.)

    Args:
        model: the MoE model (or wrapper).
        pack: the pack the router logits came from.
        router_logits: the model output's ``router_logits`` (one tensor per layer).

    Returns:
        A scalar loss tensor.

    Raises:
        NotImplementedError: a model whose router loss treepack does not know how to weight.
    """
    if isinstance(pack, (list, tuple)):
        return batch_router_aux_loss(model, pack, router_logits)
    return batch_router_aux_loss(model, [pack], [router_logits])


def batch_router_aux_loss(model, packs, router_logits) -> Tensor:
    """The load-balancing loss of a whole batch spread over several packs.

    Packs without tokens (``TreePack.empty``) contribute nothing; with no tokens at all the
    loss is a zero still connected to the router.

    Args:
        model: the MoE model (or wrapper).
        packs: the batch's packs.
        router_logits: for each pack, its per-layer router logits.

    Returns:
        The batch's loss (not a mean of per-pack losses), a scalar tensor.

    Raises:
        NotImplementedError: as :func:`router_aux_loss`.
    """
    packs, per_pack = list(packs), list(router_logits)
    live = [(p, r) for p, r in zip(packs, per_pack) if p.num_original_tokens > 0]
    if not live:
        return sum(layer.sum() for r in per_pack for layer in r) * 0.0
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*(r for _, r in live)))
    weights = torch.cat([row_multiplicity(p) for p, _ in live])[None]  # [1, rows]
    model = unwrap(model)
    loss_fn = compat.model_function(model, "load_balancing_loss_func")
    if loss_fn is None:
        raise NotImplementedError(
            f"{type(model).__name__} has an auxiliary router loss treepack does not know how to "
            "weight by original tokens; disable it (output_router_logits=False) or run unpacked"
        )
    config = _text_config(model)
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    return loss_fn(layers, num_experts, config.num_experts_per_tok, weights)
