"""verl's Megatron engine on tree packs: ``actor_rollout_ref.actor.strategy=megatron`` together
with ``actor_rollout_ref.model.external_lib=treepack.verl``.

Importing :mod:`treepack.verl` (:func:`treepack.adapters.verl.install`) registers
:class:`TreepackMegatronEngine` as verl's Megatron language-model engine where megatron-core is
installed (``treepack.verl.register_megatron()`` does it from a launch script). Written
against verl 0.9.1 and megatron-core 0.16.

What changes, and what does not:

- **Micro-batches are trees.** Each data-parallel rank's rows are planned with
  :func:`treepack.plan` under verl's budget for a micro-batch (``max_token_len_per_gpu`` times
  the context-parallel size, or ``micro_batch_size_per_gpu`` times the longest row), so the
  rollouts of one prompt and the turns of one trajectory share one pack; every data-parallel
  rank runs as many micro-batches (the count is all-reduced, as verl's
  ``same_micro_num_in_dp``).
- **The packs go through Megatron's own schedule** (``get_forward_backward_func``, with
  pipeline and virtual pipeline stages as verl configures them): each stage (each model
  chunk of an interleaved schedule) runs :func:`treepack.megatron.forward_stage` on the
  pack, with the tree as every layer's core
  attention, rows at their depths, and tensor, sequence, context and expert parallelism as
  :mod:`treepack.megatron` does them. The last stage's log-probs and entropies come from the
  vocabulary-parallel head in verl's prediction-aligned layout, each row at its temperature,
  and feed verl's own ``postprocess_micro_batch_func``: its loss, its loss scaling
  (``num_micro_batch``, the per-token regime) and its metrics are unchanged.
- **Outputs in the batch's order**, nested, as verl's stock engine returns them.
- **Metrics**: ``treepack/token_ratio`` per micro-batch, ``treepack/log_prob_token_ratio``
  and the sharing report (``treepack/*_ratio``, ``treepack/lost_rows/*``,
  ``treepack/session_forks/*``) as the FSDP engine reports them (:mod:`treepack.verl`).
- **Routing replay (R3).** Under ``router_replay.mode=R3`` each row's ``routed_experts`` (the
  rollout's) become its pack's routes, aligned and masked as verl's R3 replay does
  (:func:`.batches.host_routes`): rows merge only where routes agree, and each replays its
  route through :mod:`treepack.megatron`'s replay. A batch verl does not replay
  (``compute_ref_log_prob``: its ``enable_routing_replay`` flag off) routes natively (routes
  -1 throughout), as verl's does.
- **Images.** On a vision-language model (mbridge's ``Qwen2_5VLModel``, what verl's
  ``vanilla_mbridge`` builds for Qwen2.5-VL) a batch's images (each row's
  ``multi_modal_inputs``: ``pixel_values``, ``image_grid_thw``) pack with its rows as
  :class:`treepack.megatron.Images`: rows keyed by each placeholder's image content, every
  distinct image a pack's rows need encoded once per forward, the mrope positions (verl's
  ``[4, length]`` ids: their text row must be ``0 .. length - 1``) from the model's own
  ``get_rope_index`` per sequence; in parts, each part encodes the images its rows need.
- **verl's fused kernels** (``use_fused_kernels``) are served by treepack's lean head; where
  verl replaced each chunk's ``forward`` with its fused one (megatron-core before 0.18),
  packed steps run megatron-core's own and verl's is put back after.
- **Transparent fallback, by name.** verl's stock path runs (one log line, logger
  ``treepack.verl``) for a model :func:`treepack.megatron.prepare` refuses on any stage
  (multi-token prediction, CUDA graphs, YaRN as the model's embedding, MoE layers
  recomputed alone, token dropping), routing replay R2 (it records routes in a log-prob
  pass), dynamic context parallelism, multi-modal inputs or mrope ids for a text model,
  multi-modal inputs other than images (videos), distillation outputs, position ids other
  than ``0 .. length - 1``, a temperature that is not finite and > 0, and a data-parallel
  rank without rows. The decision is all-reduced over every rank, since a refusal can hold
  on one pipeline stage only.
- **Trees over the budget run in parts** (:func:`treepack.megatron.step_in_parts`, every row
  once) where a rank's plan would repeat rows: the rank's batch is one micro-batch of
  Megatron's schedule, whose forward step runs the parts (the log-probs without gradients,
  verl's loss and its gradient with respect to each log-prob and entropy, then each part's
  forward and backward with that gradient, inside DDP's ``no_sync``) and hands the schedule a
  zero loss over every parameter, so Megatron finalises and reduces the gradients as for any
  step. The loss is scaled as the schedule scales verl's (times the CP size; in the per-token
  regime not at all). Under pipeline parallelism, activation recomputation or MoE router
  losses, which parts refuse, the plan splits such a tree, its prefix repeated in each pack
  (said once). The choice is all-reduced over every rank. ``treepack/parts`` reports the
  forwards.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from treepack.adapters import megatron as tm
from treepack.adapters.megatron import parts as tm_parts
from treepack.adapters.megatron import vision
from treepack.adapters.verl import batches as vb
from treepack.adapters.verl import compat
from treepack.adapters.verl.compat import extract_multi_modal_inputs, get_device_id, tu
from treepack.adapters.verl.log import say_once
from treepack.core.outputs import per_sequence_temperature
from treepack.core.tree import TreePack
from treepack.planning.parts import split
from treepack.planning.planner import plan

MegatronEngineWithLMHead, make_batch_generator = compat.megatron_engine()

__all__ = ["TreepackMegatronEngine", "register"]


class TreepackMegatronEngine(MegatronEngineWithLMHead):
    """verl's Megatron language-model engine with tree-packed micro-batches (module doc)."""

    treepack_backend = "auto"  # the attention backend of the packed forwards

    def initialize(self):
        super().initialize()
        self._treepack_refused = None
        # a vision-language model (mbridge's Qwen2.5-VL): its images pack with its rows
        self._vision = any(vision.vision_language(chunk) is not None for chunk in self.module)
        try:
            for chunk in self.module:  # each virtual pipeline chunk of this stage
                tm.prepare(chunk)
        except (TypeError, tm.UnsupportedMegatron) as e:
            self._treepack_refused = str(e)

    # ---------------------------------------------------------------- the seam

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        reason = self._stock_reason(data)
        # every rank of every stage takes the same path: a model can be refused on one
        # pipeline stage only, and the schedule's collectives span all of them
        anyone = torch.tensor([reason is not None], dtype=torch.int32, device=vb.verl_device())
        torch.distributed.all_reduce(anyone, op=torch.distributed.ReduceOp.MAX)
        if anyone.item():
            say_once("running verl's stock Megatron engine path: "
                     + (reason or "another rank's batch or model stage cannot be tree-packed"))
            return super().forward_backward_batch(data, loss_function, forward_only)
        return self._packed_step(data, loss_function, forward_only)

    def _stock_reason(self, data) -> str | None:
        """Why this batch runs verl's stock path on this rank, or None to pack it."""
        if self._treepack_refused:
            return f"the model cannot be tree-packed ({self._treepack_refused})"
        config = self.engine_config
        if config.dynamic_context_parallel:
            return "dynamic_context_parallel (not run on trees)"
        mode = self._replay_mode()
        if mode not in ("disabled", "R3"):
            return (f"router_replay.mode={mode!r} (R2 records the routes of a log-prob pass "
                    "on verl's stock path; R3, the rollout's routes, runs on trees)")
        if len(data) == 0:
            return "a data-parallel rank without rows"
        inputs = extract_multi_modal_inputs(data.get("multi_modal_inputs", []))
        if inputs:
            if not self._vision:
                return (f"multi-modal inputs {sorted(inputs)} of a text model "
                        f"({type(tm.unwrap(self.module[0])).__name__})")
            refusal = vb.image_refusal(inputs)
            if refusal:
                return refusal
        positions = data["position_ids"]
        if positions.dim() == 3:
            # verl's mrope ids, [4, length] a row: text positions, then (t, h, w); the tree
            # gives the text ones (depths), the model's get_rope_index the others
            if not self._vision:
                return "multi-dimensional (mrope) position ids of a model without images"
            positions = vb.text_positions(positions)
        return (vb.output_refusal(data, served=("use_fused_kernels",))
                or vb.positions_refusal(positions) or vb.temperature_refusal(data))

    def _replay_mode(self) -> str:
        """verl's ``router_replay.mode`` of this engine (``"disabled"``, ``"R2"``, ``"R3"``)."""
        replay = getattr(self.engine_config, "router_replay", None)
        return "disabled" if replay is None else str(replay.mode)

    def _routes(self, data, sequences) -> list[np.ndarray] | None:
        """Each row's routes for its pack under routing replay (module doc), or None. Where
        verl replays (the batch's ``enable_routing_replay``: ``compute_log_prob`` and
        ``update_actor``), the rollout's ``routed_experts`` as verl's R3 aligns and masks them
        (:func:`.batches.host_routes`); where it does not (``compute_ref_log_prob``), -1
        throughout: every router routes by itself, as verl's does then.

        Raises:
            ValueError: a replaying batch without ``routed_experts``.
        """
        if not self.enable_routing_replay:
            return None
        if tu.get_non_tensor_data(data, key="enable_routing_replay", default=False):
            if "routed_experts" not in data.keys():
                raise ValueError(
                    "router_replay.mode='R3' replays the rollout's routes, but this batch has "
                    "no 'routed_experts': switch the rollout's routing record on "
                    "(actor_rollout_ref.rollout.enable_rollout_routing_replay=True)")
            return vb.host_routes(data)
        config = self.tf_config
        shape = (config.num_layers, config.moe_router_topk)
        return [np.full((len(s), *shape), -1, dtype=np.int16) for s in sequences]

    # ---------------------------------------------------------------- packed steps

    def _packed_step(self, data, loss_function, forward_only):
        """:meth:`forward_backward_batch` on tree packs (every rank can pack)."""
        group = self.get_data_parallel_group()
        cp = self.engine_config.context_parallel_size
        tu.assign_non_tensor(data, sp_size=cp)
        self._loss_normalisers(data, group)
        sequences = vb.host_sequences(data)
        routes = self._routes(data, sequences)
        images = self._images(data, sequences)
        keys = None if images is None else images.keys
        budget = vb.token_budget(data, cp)
        planned = plan(sequences, max_tokens=budget, routes=routes, keys=keys)
        with compat.unfused(self.module):  # verl's fused head: treepack's serves it
            if self._in_parts(planned, forward_only):
                micro = [np.arange(len(sequences))]
                losses = self._parts_step(data, sequences, routes, images, budget,
                                          loss_function, forward_only)
            else:
                micro, losses = self._tree_steps(data, sequences, routes, images, budget,
                                                 planned, loss_function, forward_only, group)
        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return {}  # as verl's stock engine: outputs on the last stage
        keep = forward_only or tu.get_non_tensor_data(data=data, key="return_model_output",
                                                      default=False)
        if not keep:
            for out in losses:
                out.pop("model_output", None)
        collected = vb.collect(losses, micro)
        if not forward_only:
            pack_of = np.zeros(len(sequences), dtype=np.int64)
            for j, rows in enumerate(micro):
                pack_of[rows] = j
            vb.log_sharing(collected, data, sequences, pack_of, group, keys=keys,
                           routes=routes)
        packed, tokens = np.sum([out["sizes"] for out in losses if "sizes" in out] or [[0, 0]],
                                axis=0)
        vb.note_pass(self, collected, forward_only, packed / max(tokens, 1))
        return collected

    def _images(self, data, sequences) -> vision.Images | None:
        """The batch's images (each row's ``multi_modal_inputs``) as
        :class:`treepack.megatron.Images` of this stage's model, or None for a batch without
        any."""
        inputs = vb.image_inputs(data)
        return None if inputs is None else vision.Images(self.module[0], sequences, **inputs)

    def _tree_steps(self, data, sequences, routes, images, budget, planned, loss_function,
                    forward_only, group):
        """The rank's rows as tree packs under the budget, each a micro-batch of Megatron's
        schedule: the packs (rows per micro-batch) and the schedule's outputs."""
        micro = vb.micro_batches(planned)
        count = torch.tensor([len(micro)], device=vb.verl_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
        count = int(count.item())
        group_size = self._microbatch_group()
        count = -(-count // group_size) * group_size  # the interleaved schedule's groups
        if len(micro) < count:  # as many real micro-batches as the others where it can
            micro = vb.micro_batches(plan(sequences, max_tokens=budget, min_packs=count,
                                          routes=routes,
                                          keys=None if images is None else images.keys))
        items = []
        for i in range(count):  # past its packs, a rank reruns one at weight 0
            real = i < len(micro)
            picked = micro[i] if real else micro[0][:1]
            batch = tu.index_select_tensor_dict(data, torch.from_numpy(picked))
            tu.assign_non_tensor(batch, num_micro_batch=count)
            items.append((batch, [sequences[r] for r in picked],
                          None if routes is None else [routes[r] for r in picked],
                          None if images is None else images.select(picked), real))
        step = functools.partial(self._tree_forward_step, loss_function=loss_function,
                                 forward_only=forward_only)
        return micro, get_forward_backward_func()(
            forward_step_func=step, data_iterator=make_batch_generator(items, len(self.module)),
            model=self.module, num_microbatches=count, seq_length=1, micro_batch_size=1,
            forward_only=forward_only)

    # ---------------------------------------------------------------- trees in parts

    def _in_parts(self, planned, forward_only: bool) -> bool:
        """Whether this step runs in parts: some rank's plan repeats rows (a tree larger
        than the budget) and no rank refuses parts (decided over every rank)."""
        return vb.in_parts(planned, self._parts_refusal(train=not forward_only))

    def _parts_refusal(self, train: bool = True) -> str | None:
        """Why this engine cannot run trees in parts (a training pass if ``train``), or
        None."""
        config = self.tf_config
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            return ("pipeline parallelism (a part's backward follows its children's, and "
                    "Megatron's schedules run backwards in the order of the forwards)")
        if train and config.recompute_granularity is not None:
            return ("activation recomputation (recompute_granularity="
                    f"{config.recompute_granularity!r})")
        for chunk in self.module:
            refusal = tm_parts.parts_refusal(tm.unwrap(chunk), train)
            if refusal is not None:
                return refusal
        return None

    def _parts_step(self, data, sequences, routes, images, budget, loss_function,
                    forward_only) -> list:
        """The rank's batch as one micro-batch of Megatron's schedule, its trees in parts of
        at most ``budget`` rows (module doc): the schedule's outputs."""
        temperature = per_sequence_temperature(data["temperature"], len(sequences))
        entropy = bool(tu.get_non_tensor_data(data, key="calculate_entropy", default=False))
        tu.assign_non_tensor(data, num_micro_batch=1)
        batch = data.to(get_device_id())
        offsets = batch["input_ids"].offsets()
        parts = split(TreePack.from_sequences(sequences, layout="flat", device=offsets.device,
                                              routes=routes,
                                              keys=None if images is None else images.keys),
                      budget)
        cp = mpu.get_context_parallel_world_size()
        settings = dict(temperature=temperature, entropy=entropy, align="prediction",
                        images=images)
        state = {}

        def postprocess(out, only: bool):
            values = {"log_probs": out.logprobs}
            if entropy:
                values["entropy"] = out.entropy
            model_output = {k: torch.nested.nested_tensor_from_jagged(v, offsets)
                            for k, v in values.items()}
            state["result"] = self.postprocess_micro_batch_func(
                output=model_output, data=batch, forward_only=only,
                loss_function=loss_function)
            return state["result"]

        scale = getattr(self.tf_config, "grad_scale_func", None)  # the optimizer's loss scale

        def loss_fn(out, mask):  # verl's loss, scaled as the schedule would scale it
            *loss, _ = postprocess(out, False)
            loss = loss[0] if len(loss) == 2 else loss[0] * cp
            return loss if scale is None else scale(loss).reshape(())  # verl: shape [1]

        def step(batch_iter, model):
            next(batch_iter)
            if forward_only:
                postprocess(tm.logprobs_in_parts(model, parts, **settings), True)
                zero = torch.zeros((), device=offsets.device)
            else:
                no_sync = getattr(model, "no_sync", None)
                with no_sync() if no_sync is not None else contextlib.nullcontext():
                    tm.step_in_parts(model, parts, loss_fn, **settings)
                # the gradients are in place: the schedule's backward adds zeros to every
                # parameter, so DDP sees each one ready and reduces as for any step
                zero = sum((p * 0).sum() for p in model.parameters() if p.requires_grad)

            def loss_func(output_tensor):
                *loss, output = state["result"]
                output["metrics"] = dict(output["metrics"])
                output["metrics"]["treepack/token_ratio"] = (
                    parts.pack.num_packed_rows / max(parts.pack.num_original_tokens, 1))
                output["metrics"]["treepack/parts"] = len(parts.parts)
                output["sizes"] = (parts.pack.num_packed_rows, parts.pack.num_original_tokens)
                return (output_tensor, *loss[1:], output)

            return zero, loss_func

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=make_batch_generator([None], len(self.module)),
            model=self.module, num_microbatches=1, seq_length=1, micro_batch_size=1,
            forward_only=forward_only)

    def _loss_normalisers(self, data, group) -> None:
        """What verl's stock ``forward_backward_batch`` hands its loss: the global count of
        loss tokens, the data-parallel size and, in Megatron's per-token regime, the global
        count of routed tokens."""
        loss_mask = data["loss_mask"]
        tokens = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum())
        tokens = tokens.to(get_device_id())
        torch.distributed.all_reduce(tokens, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(),
                             dp_size=self.get_data_parallel_size())
        if self.tf_config is not None and self.tf_config.calculate_per_token_loss:
            routed = self._routed_num_tokens(data).to(get_device_id())
            torch.distributed.all_reduce(routed, group=group)
            tu.assign_non_tensor(data, routed_num_tokens=routed.item())

    def _microbatch_group(self) -> int:
        """The micro-batch count's divisor: the interleaved (virtual pipeline) schedule runs
        micro-batches in groups of ``microbatch_group_size_per_vp_stage``, as verl's stock
        path divides them; else 1."""
        vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
        if vpp is not None and vpp > 1:
            return int(self.tf_config.microbatch_group_size_per_vp_stage)
        return 1

    def _tree_forward_step(self, batch_iter, model, loss_function, forward_only):
        """Megatron's ``forward_step_func`` on a tree micro-batch: this stage's forward of
        the pack, and on the last stage verl's loss on its log-probs."""
        batch, sequences, routes, images, real = next(batch_iter)
        temperature = per_sequence_temperature(batch["temperature"], len(sequences))
        batch = batch.to(get_device_id())
        offsets = batch["input_ids"].offsets()
        entropy = bool(tu.get_non_tensor_data(batch, key="calculate_entropy", default=False))
        pack = TreePack.from_sequences(sequences, layout="flat", device=offsets.device,
                                       routes=routes,
                                       keys=None if images is None else images.keys)
        stage = tm.forward_stage(model, pack, temperature=temperature, entropy=entropy,
                                 align="prediction", backend=self.treepack_backend,
                                 images=images)

        def loss_func(output_tensor):
            out = stage.logprobs()
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(
                out.logprobs, offsets)}
            if entropy:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(
                    out.entropy, offsets)
            *loss, output = self.postprocess_micro_batch_func(
                output=model_output, data=batch, forward_only=forward_only,
                loss_function=loss_function)
            output["metrics"] = dict(output["metrics"])
            output["metrics"]["treepack/token_ratio"] = (
                pack.num_packed_rows / max(pack.num_original_tokens, 1))
            output["sizes"] = (pack.num_packed_rows, pack.num_original_tokens)
            if not real:  # a rerun: nothing learned (nor counted), nothing returned
                loss = [x * 0 for x in loss]
                output["loss"] = 0.0
                output.pop("model_output", None)
                output.pop("sizes")
            return (*loss, output)

        return stage.output, loss_func


def register(devices=("cuda", "npu"), engine: type = TreepackMegatronEngine) -> None:
    """Make ``engine`` verl's Megatron language-model engine: every registry entry that names
    verl's stock ``MegatronEngineWithLMHead`` (any device, any vendor), and the plain
    ``devices`` keys (``("cpu",)`` in the tests). :func:`treepack.adapters.verl.install` does
    it where megatron-core is installed.
    """
    compat.register_engine(("megatron",), MegatronEngineWithLMHead, TreepackMegatronEngine,
                           engine, devices)
