"""The one packed forward: a prepared model over rows of a pack.

Every forward treepack runs goes through :func:`packed_forward`: the whole pack
(:func:`treepack.hf.forward`, :func:`treepack.hf.logprobs`), one part of a tree larger than a
forward (:mod:`treepack.adapters.hf.parts`), and any other way of cutting a pack's rows over
forwards. It checks the inputs against the whole pack once per forward (keyword arguments,
preparation, device, vocabulary, rotary scaling), runs the model on the rows asked for with
depth positions and the per-forward token mixers (:class:`~treepack.forwards.PackForward`, or a part's),
checks afterwards that every layer took them, and returns the model's output with what the
head asked for: the logits, or the LM head's input and the head as the forward saw it.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from treepack.adapters.hf.head import check_lm_head, lm_head
from treepack.adapters.hf.prepare import compute_device, hold_routing, is_prepared, unwrap
from treepack.adapters.hf.vision import image_blocks, image_token_ids, vision_forward
from treepack.adapters.hf.routing import (TREE_FORWARD_KWARG, UnsupportedModel,
                                          check_calls, text_config, tree_forward)
from treepack.core.derived import derived_from_pack
from treepack.core.softmax import Head, Logits
from treepack.core.tree import TreePack
from treepack.forwards.mixers import PackForward, TreeForward

__all__ = ["packed_forward", "PackedOutput", "check_inputs", "check_pack", "OUTPUTS"]

OUTPUTS = ("logits", "hidden")

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
_NOT_TEXT = ("a pack takes its images as images=treepack.hf.Images(model, sequences, "
             "pixel_values=..., image_grid_thw=...), built with the pack "
             "(images.pack()), which encodes each distinct image once and keys the tree by "
             "image content; video and audio inputs do not pack yet: run those unpacked")
for _key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
             "image_sizes", "input_features", "mm_token_type_ids", "mm_encoder_outputs"):
    _REFUSED_KWARGS[_key] = _NOT_TEXT


class PackedOutput(NamedTuple):
    """What one packed forward returns."""

    output: object  # the model's output (``.logits`` [1, n, V] for ``output="logits"``)
    hidden: Tensor | None  # [n, H] the LM head's input, for ``output="hidden"``
    head: dict | None  # the LM head as the forward saw it (lm_head's keywords), likewise

    def source(self) -> Head | Logits:
        """What the forward's predictions are normalised from (:mod:`treepack.core.softmax`):
        its hidden states and head (``output="hidden"``), or its logits."""
        if self.hidden is None:
            return Logits(self.output.logits[0])
        h = self.head
        return Head(self.hidden, h["weight"], h.get("bias"), scale=h.get("scale", 1.0),
                    softcap=h.get("softcap"))

    def zero(self) -> Tensor:
        """0, as a function of everything the forward's predictions would read: the loss of
        a sequence-parallel rank that predicts nothing, so that its backward runs the
        exchanges the other ranks' do and its gradients are the same set of parameters
        (zeros), as theirs."""
        if self.hidden is None:
            return self.output.logits.sum() * 0
        head = [t.sum() for t in self.head.values() if isinstance(t, Tensor)]
        return (self.hidden.sum() + sum(head)) * 0


def packed_forward(model, pack: TreePack, kwargs: dict, *, rows: Tensor | None = None,
                   mixers: TreeForward | None = None, backend: str = "auto",
                   block_size: int = 128, output: str = "logits") -> PackedOutput:
    """The model over ``pack``'s ``rows``: the one forward every treepack call runs.

    Args:
        model: a prepared causal LM, or a wrapper of one (DDP, FSDP, compile, PEFT).
        pack: the whole pack (the checks read it whole, whatever ``rows`` holds).
        kwargs: keyword arguments for the model (checked; ``return_dict=False`` refused).
        rows: the pack's rows this forward computes, ascending (default: all of them).
        mixers: the forward's token mixers; default ``PackForward(pack, backend,
            block_size)`` (``rows`` must then be all rows).
        backend, block_size: the attention backend of the default mixers.
        output: ``"logits"`` (the model's own output) or ``"hidden"`` (the head runs on one
            row; the LM head's input and the head's weights as the forward saw them come
            back, for a lean head after the forward).

    Returns:
        :class:`PackedOutput`.

    Raises:
        ValueError: anything :func:`check_inputs` refuses.
        UnsupportedModel: a layer that bypassed the tree (:func:`.routing.check_calls`), a
            rotary scaling that reads the longest position, or a head ``"hidden"`` cannot
            read.
    """
    images = kwargs.get("images")
    kwargs = {k: v for k, v in kwargs.items() if k != "images"}
    core = check_inputs(model, pack, kwargs, images=images)
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r} must be one of {OUTPUTS}")
    if mixers is None:
        mixers = PackForward(pack, backend, block_size)
    pad = getattr(text_config(core), "pad_token_id", None)  # CodeGen's config has none
    ids, positions = _input_ids(pack, pad), pack.position_ids
    if rows is not None:
        ids, positions = ids[rows], positions[rows]
    mixers.depths = positions  # the rows' depths (Llama 4's temperature tuning reads them)
    blocks = image_blocks(core, pack, images)
    if blocks is not None and bool((blocks >= 0).any()):
        mixers.set_blocks(blocks)
    heads, hook = [], None
    if output == "hidden":
        check_lm_head(core)  # once per model, by a forward of its own
        kwargs = {**kwargs, "logits_to_keep": 1, "output_hidden_states": True}
        # read inside the forward: FSDP1's root points its parameters back at their shards
        # when its forward returns
        hook = core.register_forward_hook(
            lambda module, args, out: heads.append(lm_head(model, check=False)))
    try:
        with tree_forward(mixers), vision_forward(model, pack, images, rows) as rope:
            positions = positions[None] if rope is None else rope
            out = model(input_ids=ids[None], position_ids=positions, use_cache=False,
                        **{TREE_FORWARD_KWARG: mixers}, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    check_calls(core, mixers)
    if output == "hidden":
        return PackedOutput(out, out.hidden_states[-1][0], heads[-1])
    return PackedOutput(out, None, None)


def check_pack(pack) -> None:
    """Refuse anything but a TreePack, naming how to build one, and a pack with routes
    (transformers' routers route every row themselves: the routes would be dropped)."""
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack, got {type(pack).__name__}: build one with "
                        "treepack.TreePack.from_sequences(sequences)")
    if pack.host.row_routes is not None:
        raise ValueError("the pack carries routes (TreePack.from_sequences(..., routes=...)), "
                         "and treepack.hf does not replay routes: a transformers model's "
                         "routers route every row themselves, so they would be dropped. Build "
                         "the pack without routes= (rows then merge on ids and keys alone)")


def check_inputs(model, pack: TreePack, kwargs: dict, images=None):
    """Refuse what would make a packed forward wrong: a non-pack, keyword arguments that
    break the tree, an unprepared model, another device, token ids past the embedding, a
    rotary scaling that reads the longest position, or image placeholders without their
    ``images``. Returns the transformers model."""
    check_pack(pack)
    for key in kwargs:
        if key in _REFUSED_KWARGS:
            raise ValueError(f"treepack.hf.forward does not take {key!r}: {_REFUSED_KWARGS[key]}")
    if kwargs.get("use_cache"):
        raise ValueError("use_cache=True: a pack is one forward from scratch, without a cache")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: treepack's attention backends never form the "
                         "attention weights (the varlen, segment and flex kernels are fused); "
                         "run the model unpacked to inspect them")
    if kwargs.get("return_dict", True) is False:
        raise ValueError("treepack reads the model's named outputs and returns its own named "
                         "result: drop return_dict=False")
    kwargs.pop("use_cache", None)
    core = unwrap(model)
    if not is_prepared(core):
        raise ValueError(
            f"{type(core).__name__} is not prepared: call treepack.hf.prepare(model) once "
            "before hf.forward (it routes the model's attention through treepack; ordinary "
            "batches still run the original attention, and hf.restore(model) undoes it), or "
            "run the forward inside `with treepack.hf.prepared(model):`"
        )
    hold_routing(core)
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
    _check_placeholders(core, pack, images)
    return core


def _check_placeholders(model, pack: TreePack, images) -> None:
    """Refuse a pack holding a multimodal model's placeholder ids that no input fills: the
    model would embed them as text tokens, without their image, and say nothing."""
    if images is not None:
        # image placeholders are the images' (each one checked when they were built); any
        # other placeholder id (a video id a policy sampled into its completion) the model
        # embeds as text without its input, and so does the pack
        return
    fields = image_token_ids(model.config)
    ids = set(fields.values())
    if not ids or not pack.num_packed_rows:
        return
    found = _placeholders(pack, tuple(sorted(ids)))
    if found:
        raise UnsupportedModel(
            f"the pack holds {type(model).__name__}'s non-text placeholder token ids "
            f"{found} (its {[f for f, i in fields.items() if i in found]}): {_NOT_TEXT}")


@derived_from_pack
def _placeholders(pack: TreePack, ids: tuple) -> list[int]:
    rows = pack.host.input_ids[:pack.num_packed_rows]
    return [i for i in ids if (rows == i).any()]


@derived_from_pack
def _input_ids(pack: TreePack, pad_token_id: int | None) -> Tensor:
    """The pack's ids for the model: its padding rows (id 0, seen by nothing but themselves,
    predicting nothing) get an id other than the model's ``pad_token_id``, so transformers'
    "your input_ids may be padded, pass an attention_mask" check (GPT-2 and others) does not
    fire on padding the tree attention already isolates. Real rows are the user's ids."""
    if pack.num_rows == pack.num_packed_rows or pad_token_id is None or pad_token_id != 0:
        return pack.input_ids
    ids = pack.input_ids.clone()
    ids[pack.num_packed_rows:] = 1  # any id of the vocabulary but the pad id (0)
    return ids


def _check_rope(model, pack: TreePack) -> None:
    """Refuse rotary scalings whose frequencies depend on the longest position in the batch
    (dynamic NTK, LongRoPE) once the pack reaches the length where they change: every
    sequence of the pack would get the frequencies of its longest one (and every part of a
    tree those of its own longest row)."""
    config = text_config(model)
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
            raise UnsupportedModel(
                f"{type(model).__name__} uses rope_type={kind!r}, whose rotary frequencies "
                f"change once a batch reaches {limit} positions, and this pack's longest "
                f"sequence has {pack.max_length}: packed together, every sequence would get "
                "the longest one's frequencies, unlike each run alone. Plan packs with "
                f"sequences of at most {limit} tokens, or run these unpacked"
            )
