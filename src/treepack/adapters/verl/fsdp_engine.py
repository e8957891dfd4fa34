"""verl's FSDP / FSDP2 language-model engine with tree-packed micro-batches
(:class:`TreepackEngine`), and the same with the lean head (:class:`TreepackLeanEngine`): what
:mod:`treepack.verl` registers. The package docstring says what changes and what does not.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import Tensor

from treepack.adapters import hf
from treepack.adapters.hf import vision
from treepack.adapters.hf.forwarding import inside_refusal
from treepack.adapters.verl import compat
from treepack.adapters.verl.batches import in_parts as vb_in_parts
from treepack.adapters.verl.batches import (collect, host_sequences, image_inputs,
                                            image_refusal, log_sharing, micro_batches,
                                            note_pass, output_refusal, positions_refusal,
                                            temperature_refusal, text_positions, token_budget,
                                            verl_device)
from treepack.adapters.verl.compat import (FSDPEngineWithLMHead, detach_tree,
                                           extract_multi_modal_inputs, get_device_id,
                                           get_device_name, transformers_forwards, tu)
from treepack.adapters.verl.log import say_once
from treepack.core import deprecation
from treepack.core.outputs import from_logits, per_sequence_temperature
from treepack.core.tree import TreePack
from treepack.planning.parts import split
from treepack.planning.planner import plan

__all__ = ["TreepackEngine", "TreepackLeanEngine", "register", "verl_log_probs"]


class TreepackEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine with tree-packed micro-batches (module doc)."""

    treepack_backend = "auto"  # the attention backend of the packed forwards
    lean_head = False  # log-probs from hidden states inside the forward (TreepackLeanEngine)

    def initialize(self):
        super().initialize()
        self._treepack_refused = None
        try:
            with transformers_forwards():
                hf.prepare(self.module)
        except (TypeError, hf.UnsupportedModel) as e:
            self._treepack_refused = f"{_model_name(self.module)}: {e}"

    # ---------------------------------------------------------------- the seam

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        reason = self._stock_reason(data)
        # every rank takes the same path, or their collectives would not line up
        anyone = torch.tensor([reason is not None], dtype=torch.int32, device=verl_device())
        torch.distributed.all_reduce(anyone, op=torch.distributed.ReduceOp.MAX,
                                     group=self.get_data_parallel_group())
        if anyone.item():
            say_once("running verl's stock engine path: "
                      + (reason or "another data-parallel rank's batch cannot be tree-packed"))
            return super().forward_backward_batch(data, loss_function, forward_only)
        # packed forwards run transformers' own forwards where verl patched a family's
        # classes (restored for the step's backward too: checkpointing recomputes them)
        with transformers_forwards():
            return self._packed_step(data, loss_function, forward_only)

    def _packed_step(self, data, loss_function, forward_only):
        """:meth:`forward_backward_batch` on tree packs (the batch can be packed)."""
        group = self.get_data_parallel_group()
        if not tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True):
            say_once("use_remove_padding=false has no effect: tree packs never hold padding")
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        # verl's loss normalisation: the global count of loss tokens, and the DP size
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(),
                             dp_size=self.get_data_parallel_size())
        sequences = host_sequences(data)
        images = self._images(data, sequences)
        keys = None if images is None else images.keys
        planned = self._plan(data, sequences, keys=keys)
        if self._in_parts(planned, group):
            collected = self._parts_step(data, sequences, loss_function, forward_only, images)
            if not forward_only:  # parts compute every row of the rank's batch once
                log_sharing(collected, data, sequences,
                                  np.zeros(len(sequences), dtype=np.int64), group, keys)
            return collected
        micro = micro_batches(planned)
        count = torch.tensor([len(micro)], device=verl_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
        count = int(count.item())
        if len(micro) < count:  # as many real micro-batches as every other rank: verl
            # aggregates metrics per micro-batch index
            micro = micro_batches(self._plan(data, sequences, count, keys))
        keep_outputs = forward_only or tu.get_non_tensor_data(
            data=data, key="return_model_output", default=False)  # verl drops them in training
        grad = contextlib.nullcontext() if not forward_only else torch.no_grad()
        scaler = getattr(self, "scaler", None)
        outputs = []
        for i in range(count):
            sync = contextlib.nullcontext() if forward_only else self._gradient_sync_context(
                is_last_micro_batch=i == count - 1)
            with grad, sync, torch.profiler.record_function(f"micro_batch{i}"):
                if not micro:  # no sequences: an empty pack keeps the collectives in step
                    loss, out = self._idle_step()
                else:  # past its packs (fewer than the others), a rank reruns one, weight 0
                    real = i < len(micro)
                    picked = micro[i] if real else micro[0][:1]
                    batch = tu.index_select_tensor_dict(data, torch.from_numpy(picked))
                    loss, out = self._tree_step(
                        batch, [sequences[r] for r in picked], loss_function, forward_only,
                        None if images is None else images.select(picked))
                    if not real:
                        loss, out["loss"] = loss * 0.0, 0.0
                        out.pop("model_output")
                        out.pop("sizes")
                if not forward_only:
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            if not keep_outputs:
                out.pop("model_output", None)
            outputs.append(out)
        collected = collect(outputs, micro)
        if not forward_only:
            pack_of = np.zeros(len(sequences), dtype=np.int64)
            for j, rows in enumerate(micro):
                pack_of[rows] = j
            log_sharing(collected, data, sequences, pack_of, group, keys)
        packed, tokens = np.sum([out["sizes"] for out in outputs if "sizes" in out] or [[0, 0]],
                                axis=0)
        note_pass(self, collected, forward_only, packed / max(tokens, 1))
        return collected

    def _stock_reason(self, data) -> str | None:
        """Why this batch runs verl's stock path, or None to pack it."""
        if self._treepack_refused:
            return f"the model cannot be tree-packed ({self._treepack_refused})"
        reason = output_refusal(data)
        if reason:
            return reason
        # read as verl's own forward reads it: every row carries one, ``{}`` for text
        inputs = extract_multi_modal_inputs(data.get("multi_modal_inputs", []))
        if inputs:
            refusal = self._images_refusal(inputs)
            if refusal:
                return refusal
        positions = data["position_ids"]
        if positions.dim() == 3:
            # verl's mrope ids, [4, length] a row: text positions, then (t, h, w); the tree
            # gives the text ones (depths) and hf.Images the others, as the model computes them
            if self._images_refusal({}) is not None:
                return "multi-dimensional (mrope) position ids of a model without images"
            positions = text_positions(positions)
        return positions_refusal(positions) or temperature_refusal(data)

    def _images_refusal(self, inputs: dict) -> str | None:
        """Why a batch with these multi-modal inputs (``{}``: none) cannot pack, or None."""
        try:
            vision.check_family(hf.unwrap(self.module))
        except hf.UnsupportedModel as e:
            return f"multi-modal inputs ({e})"
        return image_refusal(inputs)

    def _images(self, data, sequences):
        """The batch's images as :class:`treepack.hf.Images` (each row's
        ``multi_modal_inputs``), or None for a batch without any."""
        inputs = image_inputs(data)
        return None if inputs is None else hf.Images(self.module, sequences, **inputs)

    def _budget(self, data) -> int:
        """Packed rows per micro-batch: verl's token budget, which a pack never exceeds."""
        return token_budget(data, self.ulysses_sequence_parallel_size)

    def _plan(self, data, sequences: list[np.ndarray], count: int = 1, keys=None):
        """The rank's packs: one per micro-batch, trees kept together, at least ``count`` of
        them where there are that many sequences (None for no sequences); over (id, key)
        pairs with an image batch's ``keys``."""
        if not sequences:
            return None
        return plan(sequences, max_tokens=self._budget(data), min_packs=count,
                    pair_cost=hf.pair_cost(self.module), keys=keys)

    # ------------------------------------------------------------ trees over budget

    def _in_parts(self, planned, group) -> bool:
        """Whether this batch runs in parts (every row once, :mod:`treepack.hf.parts`): some
        rank's plan repeats rows (a tree larger than the budget), and every rank can."""
        return vb_in_parts(planned, self._parts_refusal(), group)

    def _parts_refusal(self) -> str | None:
        """Why this engine cannot run trees in parts, or None."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if getattr(self, "scaler", None) is not None:
            return "a gradient scaler (float16) is on"
        if not isinstance(self.module, (FSDPModule, FullyShardedDataParallel)):
            return "parts run under FSDP (strategy=fsdp or fsdp2); this engine is not"
        return None

    def _parts_step(self, data, sequences, loss_function, forward_only, images=None):
        """The rank's batch as one micro-batch, its trees run in parts of at most the budget.

        verl's losses normalise per sequence (``seq-mean-token-mean``), which a part holding
        some of a sequence's tokens cannot, so training is :func:`treepack.hf.step_in_parts`:
        the log-probs without gradients, verl's ``loss_function`` on them as leaves (its
        value, metrics and gradient with respect to every log-prob and entropy), then the
        parts' forwards and backwards with that gradient as their loss: exactly the step's
        gradient, at the cost of one more forward over the tree's rows (each once). The tree
        is built and cut once, in verl's flat layout, for both passes.
        """
        temperature = per_sequence_temperature(data["temperature"], len(sequences))
        entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
        device = verl_device()
        offsets = data["input_ids"].offsets().to(device)
        parts = split(TreePack.from_sequences(
            sequences, layout="flat", device=device,
            keys=None if images is None else images.keys), self._budget(data))
        tokens = parts.pack.num_original_tokens
        metrics = {"treepack/token_ratio": parts.pack.num_packed_rows / max(tokens, 1),
                   "treepack/parts": len(parts.parts)}
        batch = data.to(device)

        def nested(out) -> dict:  # flat values, as verl's model output
            values = {"log_probs": out.logprobs}
            if entropy:
                values["entropy"] = out.entropy
            return {k: torch.nested.nested_tensor_from_jagged(v, offsets)
                    for k, v in values.items()}

        def loss_fn(out):
            loss, loss_metrics = loss_function(model_output=nested(out), data=batch,
                                               dp_group=self.get_data_parallel_group())
            metrics.update(loss_metrics)
            return loss

        settings = dict(temperature=temperature, entropy=entropy, align="prediction",
                        sequence_parallel=self._sequence_parallel(),
                        **({} if images is None else {"images": images}))
        with self._autocast():
            if forward_only:
                out = hf.logprobs_in_parts(self.module, parts, **settings)
                loss = loss_fn(out) if loss_function is not None else torch.tensor(1.0)
            else:
                assert loss_function is not None, "a training pass needs its loss_function"
                out = hf.step_in_parts(self.module, parts, loss_fn, **settings)
                loss = out.loss
        keep = forward_only or tu.get_non_tensor_data(data=data, key="return_model_output",
                                                      default=False)
        result = {"loss": float(loss.detach()), "metrics": metrics,
                  "sizes": (parts.pack.num_packed_rows, tokens)}
        if keep:
            result["model_output"] = {k: v.detach() for k, v in nested(out).items()}
        collected = collect([result], [np.arange(len(sequences))])
        note_pass(self, collected, forward_only, metrics["treepack/token_ratio"])
        return collected

    def _tree_step(self, micro_batch, sequences, loss_function, forward_only, images=None):
        """One packed forward over ``micro_batch``, whose token ids ``sequences`` are on the
        host already (the pack is built there), with its ``images`` (an hf.Images) if any."""
        temperature = micro_batch["temperature"]  # read on the host, before the move
        micro_batch = micro_batch.to(get_device_id())
        ids = micro_batch["input_ids"]
        offsets, values = ids.offsets(), ids.values()
        entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy",
                                         default=False)
        with self._autocast():
            pack = TreePack.from_sequences(sequences, layout="flat", device=values.device,
                                           keys=None if images is None else images.keys)
            out = hf.logprobs(self.module, pack, head=self._head(pack, temperature),
                              entropy=entropy, temperature=temperature,
                              align="prediction", backend=self.treepack_backend,
                              sequence_parallel=self._sequence_parallel(),
                              **({} if images is None else {"images": images}))
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(out.logprobs,
                                                                                offsets)}
            if entropy:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy,
                                                                                 offsets)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=values.device), {}
        metrics = dict(metrics)
        metrics["treepack/token_ratio"] = pack.num_packed_rows / max(pack.num_original_tokens, 1)
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(),
                      "metrics": metrics,
                      "sizes": (pack.num_packed_rows, pack.num_original_tokens)}

    def _sequence_parallel(self):
        """The Ulysses group whose ranks split each pack's rows (verl's ``sp`` mesh
        dimension), or None. Its ranks hold the same batch (verl dispatches one data-parallel
        share to all of them), so they plan the same packs."""
        return self.ulysses_parallel_group if self.use_ulysses_sp else None

    def _head(self, pack, temperature) -> str:
        """Where the log-probs come from: the lean head inside the forward (the lean engine)
        where it applies, else the model's logits (said once, with the reason)."""
        if not self.lean_head or getattr(self, "_lean_refused", None):
            return "logits"
        if len(np.unique(per_sequence_temperature(temperature, pack.num_sequences))) > 1:
            say_once("per-row temperatures: the lean head takes one; using full logits")
            return "logits"
        refusal = inside_refusal(self.module)
        if refusal is not None:
            self._lean_refused = refusal
            say_once(f"the lean head does not apply ({refusal}); using full logits")
            return "logits"
        return "inside"

    def _idle_step(self):
        """An empty pack through the model: collectives in step, nothing learned."""
        device = verl_device()
        with self._autocast():
            logits = hf.forward(self.module, TreePack.empty(1, device=device)).logits
        return logits.sum() * 0.0, {"loss": 0.0, "metrics": {}}

    def _autocast(self):
        """The engine's autocast, as its stock forward_step uses it."""
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=get_device_name(), dtype=dtype)


def _model_name(module) -> str:
    try:
        return type(hf.unwrap(module)).__name__
    except TypeError:
        return type(module).__name__


def verl_log_probs(pack: TreePack, logits: Tensor, temperature: float | Tensor,
                   entropy_too: bool = False) -> tuple[Tensor, Tensor | None]:
    """Deprecated: ``treepack.hf.logprobs(model, pack, align="prediction", ...)``, or for
    logits at hand ``treepack.core.outputs.from_logits(pack, logits, align="prediction")``.

    Args:
        pack: a pack built with ``layout="flat"``.
        logits: [T', V] its logits (one row per row of the pack, its padding included).
        temperature: a finite number > 0, or one per sequence ([N] or [1]).
        entropy_too: also return the entropies.

    Returns:
        ``(log_probs [total], entropy [total] or None)`` in verl's prediction-aligned layout.

    Raises:
        ValueError: a dense pack, or as ``from_logits``.
    """
    deprecation.warn("treepack.verl.verl_log_probs",
                     "treepack.core.outputs.from_logits(pack, logits, align='prediction')")
    if pack.layout != "flat":
        raise ValueError("verl_log_probs takes a pack built with layout='flat'")
    out = from_logits(pack, logits, temperature=temperature, entropy=entropy_too,
                      align="prediction", what="verl_log_probs")
    return out.logprobs, out.entropy


class TreepackLeanEngine(TreepackEngine):
    """:class:`TreepackEngine` with the lean head: log-probs and entropies come from hidden
    states inside the model's forward (:func:`treepack.hf.logprobs`, ``head="inside"``), so
    the ``[T', V]`` logits never exist. Switched on by ``external_lib=treepack.verl_lean``. Micro-batches
    whose rows have different temperatures, and models that transform logits after their
    head, use full logits (logged once)."""

    lean_head = True


def register(devices=("cuda", "npu"), engine: type = TreepackEngine) -> None:
    """Make ``engine`` (:class:`TreepackEngine`) verl's FSDP / FSDP2 language-model engine.

    :func:`treepack.adapters.verl.install` does it (importing :mod:`treepack.verl` installs).
    Every registry entry that names verl's stock ``FSDPEngineWithLMHead`` or a treepack engine
    (any device, any vendor) now names ``engine``, and so do the plain ``devices`` keys (call
    it with ``devices=("cpu",)`` to run verl's engine on CPU, as the tests do).

    Args:
        devices: device names to register for, besides those the stock engine holds.
        engine: :class:`TreepackEngine` or :class:`TreepackLeanEngine`.
    """
    compat.register_engine(("fsdp", "fsdp2"), FSDPEngineWithLMHead, TreepackEngine, engine,
                           devices)
