"""verl's worker driven as ``main_ppo`` drives it, for tests/adapters/test_verl.py.

Two halves, each in its own processes:

- **The trainer's side** (:func:`trainer_batches`, run in a subprocess that starts Ray and
  TransferQueue): rows written the way verl's agent loop writes them
  (``AgentLoopWorkerTQ._agent_loop_postprocess``: every field it stores, ``multi_modal_inputs
  = {}`` included, through ``list_of_dict_to_tensordict`` and ``tq.kv_batch_put``), ordered
  by the v1 trainer's own ``_balance_batch``, cut per data-parallel rank by verl's dispatch
  (``BatchData.chunk``) and read back with the worker decorator's own conversion
  (``transferqueue_utils._meta_to_realdata``): what each rank's ``compute_log_prob``,
  ``compute_ref_log_prob`` and ``update_actor`` receive, with the ``extra_info`` the v1
  trainer sets for each. The v0 trainer's batch: a padded ``DataProto``, its
  ``_balance_batch``, ``left_right_2_no_padding`` and the same dispatch.
- **The workers** (:func:`compare_workers`, one process per rank over gloo): verl's real
  ``ActorRolloutRefWorker`` for roles ``actor`` and ``ref``, built from the docs' GRPO
  command composed with verl's Hydra config plus :data:`CPU_OVERRIDES`, once with verl's
  stock engine and once with ``external_lib=treepack.verl``; then what the trainer calls:
  ``init_model``, ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``,
  ``compute_log_prob``.

Test-only adjustments beyond those of :mod:`verl_workers` (CPU platform), none of which
changes verl's code: verl registers engines for cuda / npu only, so the ``cpu`` key of its
engine registry names the engine under test; and FSDP2's ``CPUOffloadPolicy(pin_memory=True)``,
which verl gives the reference model, is built with ``pin_memory=False`` (pinning needs an
accelerator). The reference model is still offloaded the way verl offloads it.
"""

from __future__ import annotations

import re
import shlex
import uuid
from pathlib import Path

import torch

from verl_workers import EOS, VOCAB, init, row_routes

DOCS = Path(__file__).resolve().parents[3] / "docs" / "integrations.md"
N = 4  # rollout.n
MINI_BATCH_PROMPTS = 2  # actor.ppo_mini_batch_size
BUDGET = 192  # every token budget (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu)
TEMPERATURE = 0.9

FP32 = "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"
CPU_OVERRIDES = [  # the docs' command on a CPU, on a tiny local model, in float32
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn here
    f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
    f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.ref.use_torch_compile=false",
    f"actor_rollout_ref.rollout.n={N}",
    f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={BUDGET}",
    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={BUDGET}",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    # SGD: a step linear in the gradient, so the log-probs after it agree to float32 rounding
    # (AdamW's first step turns rounding in a near-zero gradient into a share of lr)
    "actor_rollout_ref.actor.optim.optimizer=SGD",
]


def docs_command() -> list[str]:
    """The GRPO command of docs/integrations.md's verl section, as words."""
    command = re.search(r"## verl\n.*?```bash\n(.*?)```", DOCS.read_text(), re.S).group(1)
    return shlex.split(command.replace("\\\n", " "))


def compose_config(model_dir: str, *, treepack: bool, world: int, extra=(), drop=()):
    """verl's trainer config from the docs' command, on ``world`` CPU ranks; ``treepack=False``
    drops the treepack line (stock verl), ``drop`` the lines (of the command and
    :data:`CPU_OVERRIDES`) that start with any of its prefixes."""
    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo

    if not treepack:
        drop = (*drop, "actor_rollout_ref.model.external_lib=")
    overrides = [w for w in docs_command()[3:] + CPU_OVERRIDES if not w.startswith(tuple(drop))]
    overrides += [f"actor_rollout_ref.model.path={model_dir}",
                  f"trainer.n_gpus_per_node={world}", *extra]
    config_dir = Path(main_ppo.__file__).parent / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


# ------------------------------------------------------------------------- the trainer's side

def agent_loop_rows(seed: int = 0, scale: int = 1, model_dir: str | None = None,
                    routes: tuple[int, int, int] | None = None):
    """(keys, fields, tags) as ``AgentLoopWorkerTQ._agent_loop_postprocess`` writes them: GRPO
    prompts with ``N`` ragged sessions each, and agent prompts whose sessions emit one output
    per turn (key index > 0), each turn's prompt the whole history, tool tokens masked.
    ``scale`` multiplies the GRPO prompts' and responses' lengths. With ``model_dir`` a
    vision-language model (:func:`verl_workers.make_model_dir`): every prompt holds an image
    (prompts 0 and 1 the same text on two images, prompt 2 the first image again, the agent
    prompt a screenshot), each row its copy in ``multi_modal_inputs``, and ``position_ids``
    verl's ``[4, length]`` (text positions, then the model's rope index, as verl's processor
    computes them). With ``routes`` (layers, experts, top-k), an MoE rollout's
    ``routed_experts`` as the agent loop writes them (:func:`verl_workers.row_routes`; one
    GRPO session's prompt routed differently)."""
    g = torch.Generator().manual_seed(seed)
    images = _image_prompts(model_dir) if model_dir is not None else None

    def tokens(n):
        top = VOCAB if images is None else 100  # text below the image placeholders
        return torch.randint(4, top, (n,), generator=g).tolist()

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    keys, fields, tags = [], [], []

    def emit(uid, session, index, prompt, response, mask, prompt_index):
        prompts, responses = torch.tensor(prompt), torch.tensor(response)
        input_ids = torch.cat([prompts, responses])
        keys.append(f"{uid}_{session}_{index}")
        shown = [] if images is None else images.shown(prompt_index)
        fields.append({
            "prompts": prompts, "responses": responses,
            "response_mask": torch.tensor(mask), "loss_mask": torch.tensor(mask),
            "input_ids": input_ids,
            "position_ids": (torch.arange(len(input_ids)) if images is None
                             else images.positions(input_ids, shown)),
            "multi_modal_inputs": {} if images is None else images.inputs(shown),
            "num_turns": 2 * index + 2,
            "metrics": {"generate_sequences": 0.01, "tool_calls": 0.0},
            "extra_fields": {"min_global_steps": 1, "max_global_steps": 1},
            "rm_scores": torch.zeros(len(response)).index_fill_(0, torch.tensor([len(response) - 1]),
                                                            float(between(0, 1))),
            "raw_prompt": [{"role": "user", "content": f"question {prompt_index}"}],
            "data_source": "openai/gsm8k", "ability": "math", "index": prompt_index,
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": prompt_index},
            "agent_name": "tool_agent" if index or uid.startswith("a") else "single_turn_agent",
            "uid": uid, "session_id": session, "global_steps": 1,
        })
        if routes is not None:
            fields[-1]["routed_experts"] = row_routes(
                input_ids.tolist(), routes, 4 if (prompt_index, session) == (0, N - 1) else None)
        tags.append({"status": "success", "prompt_len": len(prompt), "response_len": len(response),
                     "seq_len": len(input_ids), "global_steps": 1, "min_global_steps": 1,
                     "max_global_steps": 1})

    question = tokens(scale * between(8, 14))
    for p in range(3):  # GRPO: one prompt, ragged responses
        uid, prompt = f"g{uuid.UUID(int=p)}", tokens(scale * between(8, 14))
        if images is not None:  # prompts 0 and 1: one question on two images
            prompt = tokens(2) + images.placed(p) + (question if p < 2 else prompt)
        for session in range(N):
            response = tokens(scale * between(2, 10)) + [EOS]
            emit(uid, session, 0, prompt, response, [1] * len(response), p)
    for p in range(3, 4):  # an agent prompt: each session emits one output per turn
        uid, system = f"a{uuid.UUID(int=p)}", tokens(10)
        if images is not None:  # a screenshot in the system prompt
            system = system + images.placed(p)
        for session in range(N):
            history = list(system)
            for turn in range(2):
                said, tool, more = tokens(between(2, 4)), tokens(3), tokens(between(1, 2)) + [EOS]
                emit(uid, session, turn, history, said + tool + more,
                     [1] * len(said) + [0] * len(tool) + [1] * len(more), p)
                history = history + said + tool + more + tokens(2)
    return keys, fields, tags


def _image_prompts(model_dir: str):
    """The image prompts for the vision-language model at ``model_dir``: mbridge's Qwen2.5-VL
    (verl's Megatron engine; Qwen's ids) or a transformers one."""
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(model_dir).model_type == "qwen2_5_vl":
        from verl_megatron_vision import ImagePrompts

        return ImagePrompts()
    return _ImagePrompts(model_dir)


class _ImagePrompts:
    """The images of :func:`agent_loop_rows`'s prompts for a vision-language model: prompt
    ``p`` shows image ``IMAGE_OF[p]``."""

    IMAGE_OF = {0: 0, 1: 1, 2: 0, 3: 2}

    def __init__(self, model_dir: str):
        from transformers import AutoModelForImageTextToText

        from treepack import zoo

        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).model
        batch = zoo.image_batch([[("image", k)] for k in range(3)])
        self.runs = batch.sequences
        sizes = batch.image_grid_thw.prod(-1).tolist()
        self.pixels = list(torch.split(batch.pixel_values, sizes))
        self.grids = list(batch.image_grid_thw.split(1))

    def placed(self, p: int) -> list[int]:
        return list(self.runs[self.IMAGE_OF[p]])

    def shown(self, p: int) -> list[int]:
        return [self.IMAGE_OF[p]]

    def inputs(self, shown: list[int]) -> dict:
        grid = torch.cat([self.grids[k] for k in shown])
        return {"pixel_values": torch.cat([self.pixels[k] for k in shown]),
                "image_grid_thw": grid, "images_seqlens": grid.prod(-1)}

    def positions(self, input_ids, shown: list[int]):
        from treepack import zoo

        ids = input_ids[None]
        rope, _ = self.model.get_rope_index(
            ids, mm_token_type_ids=(ids == zoo.VISION_IDS["image_token_id"]).long(),
            image_grid_thw=torch.cat([self.grids[k] for k in shown]))
        return torch.cat([torch.arange(ids.shape[1])[None], rope[:, 0]])


class _TrainerStandIn:
    """The attributes of verl's trainers that their ``_balance_batch`` reads."""


def v1_trainer(config, world: int):
    """The v1 trainer ``main_ppo`` runs (``trainer.v1.trainer_mode``), not initialised: only the
    state its ``_balance_batch`` reads."""
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils import hf_tokenizer

    trainer = object.__new__(get_trainer_cls(config.trainer.v1.trainer_mode))
    trainer.config, trainer.use_critic, trainer.global_steps = config, False, 1
    trainer.tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    wg = _TrainerStandIn()
    wg._dispatch_info = {"actor": list(range(world))}
    trainer.actor_rollout_wg = wg
    return trainer


def v0_trainer(config, world: int):
    """verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``), not initialised: only the
    state its ``_balance_batch`` reads."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.use_prefix_grouper = config, False
    wg = _TrainerStandIn()
    wg._dispatch_info = {"actor": list(range(world))}
    trainer.actor_rollout_wg = wg
    return trainer


def padded_batch(fields) -> "DataProto":  # noqa: F821
    """The rows as the legacy agent loop hands them to the v0 trainer: prompts left-padded,
    responses right-padded, ``uid`` and ``multi_modal_inputs`` among the non-tensor fields."""
    import numpy as np
    from torch.nn.utils.rnn import pad_sequence

    from verl.protocol import DataProto

    def right(key, value=0):
        return pad_sequence([f[key] for f in fields], batch_first=True, padding_value=value)

    prompts = pad_sequence([f["prompts"].flip(0) for f in fields], batch_first=True).flip(1)
    prompt_mask = pad_sequence([torch.ones_like(f["prompts"]) for f in fields],
                               batch_first=True).flip(1)
    responses, response_mask = right("responses"), right("response_mask")
    attention_mask = torch.cat([prompt_mask, right("responses", -1).ne(-1).long()], dim=1)
    tensors = {"prompts": prompts, "responses": responses, "response_mask": response_mask,
               "input_ids": torch.cat([prompts, responses], dim=1),
               "attention_mask": attention_mask,
               "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0)}
    non_tensors = {key: np.array([f[key] for f in fields], dtype=object)
                   for key in ("uid", "multi_modal_inputs", "data_source", "reward_model")}
    non_tensors["__num_turns__"] = np.array([f["num_turns"] for f in fields], dtype=np.int32)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _rank_batches(meta, world: int) -> list:
    """Each rank's TensorDict as the worker's ``tqbridge`` decorator materialises it."""
    from verl.protocol import BatchData
    from verl.utils.transferqueue_utils import _meta_to_realdata

    return [_meta_to_realdata(chunk) for chunk in BatchData(meta).chunk(chunks=world)]


def trainer_batches(model_dir: str, world: int, out_path: str, scale: int = 1,
                    images: bool = False, routes: tuple[int, int, int] | None = None) -> None:
    """The v1 trainer's three worker calls' batches, per rank, saved to ``out_path``
    (``scale``: as :func:`agent_loop_rows`; ``images``: its rows with images, for the
    vision-language model at ``model_dir``, v1 only; ``routes``: an MoE rollout's routed
    experts, v1 only)."""
    import ray
    import transfer_queue as tq
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta

    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_to_nested

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        tq.init()
        config = compose_config(model_dir, treepack=True, world=world)
        import treepack.verl  # noqa: F401  (what HFModelConfig's external_lib does in the trainer)

        keys, fields, tags = agent_loop_rows(scale=scale,
                                             model_dir=model_dir if images else None,
                                             routes=routes)
        tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields),
                        tags=tags)
        batch = KVBatchMeta(keys=keys, tags=tags, partition_id="train")
        batch.extra_info["temperature"] = TEMPERATURE
        metrics: dict = {}
        batch = v1_trainer(config, world)._balance_batch(batch, metrics=metrics)

        # old log-probs (the trainer's _compute_old_log_prob)
        batch.extra_info.update(calculate_entropy=True, compute_loss=False, temperature=TEMPERATURE)
        log_prob = _rank_batches(batch, world)
        # reference log-probs (_compute_ref_log_prob)
        batch.extra_info.update(calculate_entropy=False, compute_loss=False)
        ref = _rank_batches(batch, world)
        # the update (_compute_advantage wrote these back, _update_actor sets the rest)
        data = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                               select_fields=["response_mask", "responses"])
        mask = data["response_mask"].to_padded_tensor(0)
        g = torch.Generator().manual_seed(1)
        noise = torch.randn(mask.shape, generator=g)
        written = {"old_log_probs": -1.0 + 0.3 * noise, "ref_log_prob": -1.0 + 0.2 * noise.flip(1),
                   "advantages": mask * torch.randn(len(mask), 1, generator=g)}
        tq.kv_batch_put(keys=batch.keys, partition_id="train", fields=TensorDict(
            {k: response_to_nested(v.float(), data["response_mask"]) for k, v in written.items()},
            batch_size=len(batch)))
        mini = MINI_BATCH_PROMPTS * N
        batch.extra_info.update(
            calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
            global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=42,
            dataloader_kwargs={"shuffle": False}, temperature=TEMPERATURE)
        update = _rank_batches(batch, world)
        v1 = {"log_prob": log_prob, "ref": ref, "update": update, "keys": batch.keys,
              "metrics": metrics}
        paths = ({"v1": v1} if images or routes else
                 {"v1": v1, "v0": v0_batches(config, fields, world)})
        torch.save(paths, out_path)
    finally:
        tq.close()
        ray.shutdown()


def v0_batches(config, fields, world: int) -> dict:
    """The v0 trainer's worker batches per rank: its ``_balance_batch`` (balance_batch=true),
    ``left_right_2_no_padding`` and the flags its ``_compute_old_log_prob``,
    ``_compute_ref_log_prob`` and ``_update_actor`` set."""
    from verl.protocol import BatchData
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    last = {(f["uid"], f["session_id"]): f for f in fields}  # one row per session in v0
    batch = padded_batch(list(last.values()))
    metrics: dict = {}
    v0_trainer(config, world)._balance_batch(batch, metrics=metrics)
    mask = batch.batch["response_mask"]
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(mask.shape, generator=g)
    batch.batch["old_log_probs"] = (-1.0 + 0.3 * noise) * mask
    batch.batch["ref_log_prob"] = (-1.0 + 0.2 * noise.flip(1)) * mask
    batch.batch["advantages"] = mask * torch.randn(len(mask), 1, generator=g)
    batch.meta_info["temperature"] = TEMPERATURE

    def per_rank(**flags):
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, **flags)
        return BatchData(td).chunk(chunks=world)

    mini = MINI_BATCH_PROMPTS * N
    return {"log_prob": per_rank(calculate_entropy=True, calculate_sum_pi_squared=False,
                                 compute_loss=False),
            "ref": per_rank(calculate_entropy=False, compute_loss=False),
            "update": per_rank(calculate_entropy=True, distillation_use_topk=False,
                               distillation_only=False, global_batch_size=mini,
                               mini_batch_size=mini, epochs=1, seed=42,
                               dataloader_kwargs={"shuffle": False}, compute_loss=True),
            "metrics": metrics}


# ------------------------------------------------------------------------------ the workers

def _workers(config, engine, backends=("fsdp", "fsdp2")):
    """verl's ActorRolloutRefWorker for roles actor and ref, built as main_ppo builds them, on
    the given engine (the ``cpu`` key of verl's engine registry for ``backends``)."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker

    for backend in backends:
        EngineRegistry._engines["language_model"][backend]["cpu"] = engine
    built = {}
    for role in ("actor", "ref"):
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role=role)
        worker.init_model()
        built[role] = worker
    return built["actor"], built["ref"]


def _unpinned_cpu_offload():
    """FSDP2's CPUOffloadPolicy as verl builds it for the reference model, without pinning
    (which needs an accelerator)."""
    from verl.workers.engine.fsdp import transformer_impl

    real = transformer_impl.CPUOffloadPolicy
    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True: real(pin_memory=False)


def _calls(actor, ref, batches: dict, rank: int) -> dict:
    """What the trainer calls, in its order; each call gets its own copy of the batch
    (``rank``: the data-parallel rank whose share it is)."""
    import copy

    def batch(name):
        return copy.deepcopy(batches[name][rank])

    out = {"log_prob": actor.compute_log_prob(batch("log_prob")),
           "ref": ref.compute_ref_log_prob(batch("ref")),
           "update": actor.update_actor(batch("update"))}
    out["log_prob_after"] = actor.compute_log_prob(batch("log_prob"))
    return out


def _rows(log_probs) -> list[torch.Tensor]:
    """Every rank's rows of a nested log-prob output, without the last position (it predicts
    nothing; stock verl fills it from the next row of its micro-batch)."""
    from verl_workers import gather_rows

    return [t[:-1] for t in gather_rows(log_probs)]


def budget_overrides(budget: int) -> list[str]:
    """Every token budget of the worker at ``budget``."""
    return [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}"]


def compare_workers(rank: int, world: int, port: int, model_dir: str, batches_path: str,
                    out_path: str, budget: int | None = None) -> None:
    """Stock verl and treepack through verl's worker on the trainer's batches; rank 0 saves
    every output of both (rows in global batch order) and the update metrics. ``budget``:
    the worker's token budgets (stock and treepack only), else :data:`BUDGET`, and verl's
    PrefixGrouper switch as a third run."""
    import torch.distributed as dist

    from verl_workers import captured_log, gather_rows, save

    init(rank, world, port)
    try:
        _unpinned_cpu_offload()
        records = captured_log()
        batches = torch.load(batches_path, weights_only=False)
        import treepack.verl as treepack_verl
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        result = {}
        # verl's own prefix sharing, switched on as its docs say (actor.use_prefix_grouper),
        # runs on the stock engine: in verl 0.9.1 only the legacy trainer's balancing reads it
        grouper = ["actor_rollout_ref.actor.use_prefix_grouper=true"]
        runs = [("stock", FSDPEngineWithLMHead, ()), ("tree", treepack_verl.TreepackEngine, ()),
                ("prefix_grouper", FSDPEngineWithLMHead, grouper)]
        if budget is not None or "v0" not in batches:
            extra = () if budget is None else budget_overrides(budget)
            runs = [(label, engine, extra) for label, engine, _ in runs[:2]]
        for label, engine, extra in runs:
            config = compose_config(model_dir, treepack=label == "tree", world=world, extra=extra)
            actor, ref = _workers(config, engine)
            result[f"engines_{label}"] = (type(actor.actor.engine).__name__,
                                          type(ref.ref.engine).__name__)
            for path in batches:  # the v0 calls start from the v1 update's weights
                out = _calls(actor, ref, batches[path], rank)
                result[label, path] = {
                    "log_probs": _rows(out["log_prob"]["log_probs"]),
                    "entropy": gather_rows(out["log_prob"]["entropy"]),
                    "ref_log_probs": _rows(out["ref"]["log_probs"]),
                    "log_probs_after": _rows(out["log_prob_after"]["log_probs"]),
                    "update_metrics": out["update"]["metrics"],
                    "log_prob_metrics": out["log_prob"]["metrics"],
                }
            del actor, ref
        save(result, records, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def ulysses_overrides(size: int) -> list[str]:
    """verl's Ulysses switch for the actor and the reference model."""
    return [f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}",
            f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={size}"]


def compare_ulysses(rank: int, world: int, port: int, model_dir: str, batches_path: str,
                    out_path: str, sp: int, budget: int | None = None) -> None:
    """verl's worker on one data-parallel share (the trainer's batches for one rank): stock
    verl without sequence parallelism (``sp=1``, one rank), or treepack under Ulysses with
    ``sp`` ranks holding that share. Rank 0 saves the outputs, update metrics and log; with
    treepack every rank records, per forward, the rows of the pack, the rows it computes, and
    the rows its embedding layer took. ``budget``: every token budget per rank (verl's
    Ulysses budget for a forward is it times ``sp``)."""
    import torch.distributed as dist

    from verl_workers import captured_log, save

    init(rank, world, port)
    try:
        _unpinned_cpu_offload()
        records = captured_log()
        batches = torch.load(batches_path, weights_only=False)
        import treepack.verl as treepack_verl
        from treepack.adapters.hf import sequence_parallel
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        slices, embedded = [], []
        real_rows = sequence_parallel.SequenceParallel.rows

        def rows(self, all_rows):  # what each rank computes of each forward
            mine, start, stop = real_rows(self, all_rows)
            slices.append((int(all_rows.shape[0]), stop - start, int(mine.shape[0])))
            return mine, start, stop

        sequence_parallel.SequenceParallel.rows = rows
        tree = sp > 1
        engine = treepack_verl.TreepackEngine if tree else FSDPEngineWithLMHead
        extra = ulysses_overrides(sp) + (budget_overrides(budget) if budget else [])
        config = compose_config(model_dir, treepack=tree, world=world, extra=extra)
        actor, ref = _workers(config, engine)
        def embed(module, args, out):  # a packed forward's rows (not the head's 3-token check)
            if args[0].shape[-1] != 3 or args[0].flatten().tolist() != [1, 2, 3]:
                embedded.append(int(args[0].numel()))

        for worker in (actor.actor, ref.ref):
            worker.engine.module.get_input_embeddings().register_forward_hook(embed)
        result = {"engines": (type(actor.actor.engine).__name__, type(ref.ref.engine).__name__),
                  "sp": (actor.actor.engine.ulysses_sequence_parallel_size,
                         ref.ref.engine.ulysses_sequence_parallel_size)}
        share = rank // sp  # every rank of a Ulysses group holds its data-parallel share
        for path in ("v1", "v0"):
            out = _calls(actor, ref, batches[path], share)

            def local(nested, last=True):  # this share's rows (every rank of it holds all)
                return [t.detach().float()[:-1] if last else t.detach().float()
                        for t in nested.unbind()]

            if out["log_prob"] is None:  # verl collects from each group's first rank only
                continue
            result[path] = {"log_probs": local(out["log_prob"]["log_probs"]),
                            "entropy": local(out["log_prob"]["entropy"], last=False),
                            "ref_log_probs": local(out["ref"]["log_probs"]),
                            "log_probs_after": local(out["log_prob_after"]["log_probs"]),
                            "update_metrics": out["update"]["metrics"],
                            "log_prob_metrics": out["log_prob"]["metrics"]}
        every = [None] * world
        dist.all_gather_object(every, {"slices": slices, "embedded": embedded})
        result["ranks"] = every
        save(result, records, rank, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()
