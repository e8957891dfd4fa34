"""``treepack bench --e2e``: a whole GRPO run twice, stock TRL and treepack, side by side.

Both runs are TRL's ``GRPOTrainer.train()`` with generation, from one saved random model, one
seed and one dataset: ``trl.GRPOTrainer`` and :class:`treepack.trl.TreepackGRPOTrainer`. Each
runs in a process of its own and they take their steps in turn (:mod:`.turns`): run A's step
1, then run B's step 1, then A's step 2, and so on, so a load that comes and goes on the
machine lands on both runs alike. As long as their weights agree they sample the same
completions; each step records a digest of its completions to show where they part.

Per step: the mean reward, TRL's logged loss, and seconds in four phases:

- ``generate``: ``model.generate`` (TRL's ``_generate``);
- ``score``: the reward functions (``_calculate_rewards``);
- ``logprobs``: the passes without gradient (the reference model's log-probs with
  ``beta > 0``; old log-probs where TRL needs them);
- ``update``: the rest of the optimizer step: the loss's forward and backward and the
  optimizer (and TRL's bookkeeping around them).

In float64 both runs are float64 throughout (:func:`~.precision.float64_throughout`: TRL's
log-prob head and transformers' norms compute in float32 otherwise), so they agree to float64's
rounding and must sample alike at every step; their seconds carry the mode's overhead, and
they run without gradient checkpointing (TRL's default, on in the other dtypes), whose
recompute would run outside the mode.

The task (:mod:`treepack.data.tasks`): each prompt names a letter after a shared instruction;
a completion earns the count of that letter over the longest a completion may be. A
random-init model learns it in a few dozen steps on a CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from treepack.face.benchmark.e2e_report import PHASES, RUNS, plot_e2e, render_e2e, summarize
from treepack.face.benchmark.precision import float64_throughout
from treepack.face.benchmark.turns import Baton, run_in_turn

__all__ = ["E2EWorkload", "E2E_WORKLOADS", "E2E_MODELS", "PHASES", "run_e2e", "render_e2e",
           "plot_e2e", "e2e_model"]  # the report's, re-exported: what the command line calls



@dataclass(frozen=True)
class E2EWorkload:
    """One GRPO run's shape: the letter task with ``instruction_repeats`` copies of the shared
    instruction in every prompt and completions of up to ``completion_length`` tokens."""

    name: str
    description: str
    instruction_repeats: int
    completion_length: int
    letters: str = "ab"


E2E_WORKLOADS = (
    E2EWorkload("long_prompt", "GRPO, a long shared prompt, short completions (high sharing)",
                instruction_repeats=3, completion_length=24),
    E2EWorkload("long_completion", "GRPO, a short prompt, long completions (low sharing)",
                instruction_repeats=1, completion_length=96),
)


def _qwen2_e2e(vocab_size: int):
    import transformers

    return transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=128,
                                    intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=2048, tie_word_embeddings=True,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


# name -> config of a model with the task's vocabulary: the CPU default, and zoo's shapes
E2E_MODELS = {"qwen2-1m": _qwen2_e2e}


def e2e_model(name: str, folder: str, dtype: torch.dtype, vocab_size: int,
              seed: int = 0) -> int:
    """Save a random-init model of shape ``name`` (:data:`E2E_MODELS`, or a shape of
    ``treepack.zoo.MODELS`` with the task's vocabulary) in ``dtype`` to ``folder`` (TRL loads
    the policy and its reference model from a path); returns its number of parameters."""
    import transformers

    from treepack.data import zoo

    if name in E2E_MODELS:
        config = E2E_MODELS[name](vocab_size)
    elif name in zoo.MODELS:
        config = zoo.MODELS[name]()
        config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id = \
            vocab_size, 0, 1, 2
        config.tie_word_embeddings = True
    else:
        raise ValueError(f"model={name!r}: choose one of "
                         f"{sorted(E2E_MODELS) + sorted(zoo.MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the saving's: not the report's
    try:
        model.save_pretrained(folder)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model.num_parameters()


class _Phases:
    """Per optimizer step of one trainer: the seconds of each of :data:`PHASES` and a digest
    of the completions it sampled. Wraps the trainer's methods on the instance; a TRL
    callback (:meth:`callback`) marks the steps and passes the :class:`~.turns.Baton`."""

    def __init__(self, trainer, name: str, baton: Baton, device: torch.device):
        self.name, self.baton, self.device = name, baton, device
        self.steps: list[dict] = []
        self.current: dict | None = None
        self.started = 0.0
        self._wrap(trainer, "_generate", "generate")
        self._wrap(trainer, "_calculate_rewards", "score", digest=True)
        self._wrap(trainer, "_get_per_token_logps_and_entropies", "logprobs", no_grad_only=True)
        loss_of = trainer.compute_loss

        def compute_loss(*args, **kwargs):  # the loss in the model's precision (the trainer
            loss = loss_of(*args, **kwargs)  # logs it summed in float32)
            if self.current is not None and torch.is_grad_enabled():
                value = loss[0] if isinstance(loss, tuple) else loss
                self.current["loss"] += value.detach().item()
            return loss

        trainer.compute_loss = compute_loss

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, trainer, method: str, phase: str, *, digest: bool = False,
              no_grad_only: bool = False) -> None:
        inner = getattr(trainer, method)

        def timed(*args, **kwargs):
            if self.current is None or (no_grad_only and torch.is_grad_enabled()):
                return inner(*args, **kwargs)
            if digest:  # (inputs, prompts, completions, completion_ids_list)
                ids = args[3] if len(args) > 3 else kwargs["completion_ids_list"]
                text = repr([list(map(int, c)) for c in ids]).encode()
                self.current["completions"] = hashlib.sha1(text).hexdigest()[:12]
            start = self._clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current["seconds"][phase] += self._clock() - start

        setattr(trainer, method, timed)

    def callback(self):
        from transformers import TrainerCallback

        phases = self

        class Marks(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                phases.current = {"seconds": dict.fromkeys(PHASES, 0.0), "completions": None,
                                  "loss": 0.0, "began": time.time()}
                phases.started = phases._clock()

            def on_step_end(self, args, state, control, **kwargs):
                step = phases.current
                total = phases._clock() - phases.started
                step["seconds"]["update"] = total - sum(step["seconds"].values())
                phases.steps.append(step)
                phases.current = None
                if state.global_step < state.max_steps:
                    phases.baton.give(phases.name)

        return Marks()


def _train(*, name: str, cls, model_path: str, tokenizer, dataset, reward, work: E2EWorkload,
           steps: int, num_generations: int, prompts_per_step: int, learning_rate: float,
           beta: float, seed: int, device: torch.device, dtype: torch.dtype, folder: str,
           baton: Baton, trainer_kwargs: dict) -> dict:
    """One run: TRL's ``train()`` of ``cls`` taking its steps in turn with the other run."""
    from transformers import PrinterCallback, ProgressCallback
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=os.path.join(folder, name), per_device_train_batch_size=num_generations *
        prompts_per_step, num_generations=num_generations,
        max_completion_length=work.completion_length, max_steps=steps, learning_rate=learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, beta=beta, temperature=1.0, seed=seed,
        logging_steps=1, report_to="none", save_strategy="no", fp16=False,
        bf16=dtype == torch.bfloat16,  # on a GPU: float32 weights under bfloat16 autocast
        use_cpu=device.type == "cpu", model_init_kwargs={"dtype": "auto"},
        # completions between half and all of the workload's length: ragged, and the run
        # keeps the shape it was sized for (an early end-of-text would shrink it)
        generation_kwargs={"min_new_tokens": work.completion_length // 2}, disable_tqdm=True,
        # TRL's default; in float64 off: its recompute in the backward runs outside the
        # float64 mode
        gradient_checkpointing=dtype != torch.float64)
    trainer = cls(model=model_path, reward_funcs=reward, args=args, train_dataset=dataset,
                  processing_class=tokenizer, **trainer_kwargs)
    phases = _Phases(trainer, name, baton, device)
    trainer.add_callback(phases.callback())
    for quiet in (PrinterCallback, ProgressCallback):  # the report prints what matters
        trainer.remove_callback(quiet)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if len(logs) != len(phases.steps):
        raise RuntimeError(f"{name}: {len(logs)} logged steps for {len(phases.steps)} timed")
    if any(step["completions"] is None for step in phases.steps):  # the runs' agreement
        raise RuntimeError(f"{name}: a step's completions were not seen (TRL's "  # rests on it
                           "_calculate_rewards(inputs, prompts, completions, "
                           "completion_ids_list) moved?)")
    out = []
    for log, step in zip(logs, phases.steps):
        entry = {"reward": float(log["reward"]), "loss": step["loss"],
                 "grad_norm": float(log["grad_norm"]),
                 "seconds": step["seconds"], "completions": step["completions"],
                 "began": step["began"]}  # the wall clock: the two runs' steps interleave
        if "treepack/token_ratio" in log:
            entry["token_ratio"] = float(log["treepack/token_ratio"])
        out.append(entry)
    return {"steps": out, "parameters": str(next(trainer.model.parameters()).dtype)}


def run_e2e(workloads=E2E_WORKLOADS, *, model: str = "qwen2-1m",
            dtype: torch.dtype = torch.float32, steps: int = 40, num_generations: int = 8,
            prompts_per_step: int = 2, learning_rate: float = 3e-3, beta: float = 0.04,
            seed: int = 0, device: torch.device | None = None, backend: str = "auto",
            progress: Callable[[str], None] | None = None) -> dict:
    """Run each workload's GRPO run twice, stock TRL and treepack, steps in turn (the module
    doc); returns the ``treepack-e2e.json`` result.

    ``{"runs": {"stock": {"steps": [{"reward", "loss", "seconds": {phase: s}, "completions"},
    ...], ...}, "treepack": {...}}, "dtype", "model", "workloads": [{"workload", "runs",
    "agreement": ...}, ...]}``; the top-level ``runs`` are the first workload's."""
    import transformers
    import trl

    from treepack.data import tasks

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tasks.char_tokenizer()
    result = {"model": model, "dtype": str(dtype).removeprefix("torch."), "device": _where(device),
              "torch": torch.__version__, "steps": steps, "num_generations": num_generations,
              "prompts_per_step": prompts_per_step, "learning_rate": learning_rate, "beta": beta,
              "seed": seed, "backend": backend, "workloads": []}
    result["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__}
    with tempfile.TemporaryDirectory(prefix="treepack-e2e-") as folder:
        weights = torch.float32 if dtype == torch.bfloat16 else dtype  # bfloat16: autocast
        path = os.path.join(folder, "model")
        result["model_params"] = e2e_model(model, path, weights, len(tokenizer), seed=seed)
        for work in workloads:
            runs = _pair(work, path, steps=steps, num_generations=num_generations,
                         prompts_per_step=prompts_per_step, learning_rate=learning_rate,
                         beta=beta, seed=seed, device=device, dtype=dtype,
                         folder=os.path.join(folder, work.name), backend=backend,
                         progress=progress)
            prompt = tasks.letter_prompts(work.letters,
                                          instruction_repeats=work.instruction_repeats)["prompt"][0]
            entry = {"workload": work.name, **asdict(work),
                     "prompt_tokens": len(tokenizer(prompt).input_ids), "runs": runs,
                     "agreement": summarize(runs, steps)}
            result["workloads"].append(entry)
    result["runs"] = result["workloads"][0]["runs"]
    return result


def _pair(work, path, *, steps, num_generations, prompts_per_step, learning_rate, beta, seed,
          device, dtype, folder, backend, progress) -> dict:
    """The two runs of one workload, each in a process of its own, steps in turn
    (:func:`~.turns.run_in_turn`)."""
    options = dict(steps=steps, num_generations=num_generations,
                   prompts_per_step=prompts_per_step, learning_rate=learning_rate, beta=beta,
                   seed=seed, device=device, dtype=dtype, folder=folder, backend=backend)
    started = time.perf_counter()
    try:
        runs = run_in_turn(RUNS, _prepare, _run, (work, path, options))
    except RuntimeError as e:
        raise RuntimeError(f"{work.name}: {e}") from None
    if progress:
        progress(f"{work.name}: both runs, {steps} steps each, in "
                 f"{time.perf_counter() - started:.0f} s")
    return {name: runs[name] for name in RUNS}


def _prepare(name: str, work: E2EWorkload, path: str, options: dict) -> dict:
    """One run's process, before its first turn: TRL imported, the data built."""
    import warnings

    import transformers
    from datasets import Dataset
    from trl import GRPOTrainer

    # the libraries' deprecation notices and load bars, once per run: not the report's
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.utils.logging.disable_progress_bar()

    from treepack.adapters.trl import TreepackGRPOTrainer
    from treepack.data import tasks

    data = tasks.letter_prompts(work.letters, instruction_repeats=work.instruction_repeats)
    # enough rows that the sampler never runs out within the run
    copies = options["steps"] * options["prompts_per_step"] // len(data["prompt"]) + 1
    cls, kwargs = {"stock": (GRPOTrainer, {}),
                   "treepack": (TreepackGRPOTrainer,
                                {"treepack_backend": options["backend"]})}[name]
    return dict(name=name, cls=cls, model_path=path, tokenizer=tasks.char_tokenizer(),
                dataset=Dataset.from_dict({k: v * copies for k, v in data.items()}),
                reward=tasks.letter_reward(work.completion_length), work=work,
                trainer_kwargs=kwargs, **{k: v for k, v in options.items() if k != "backend"})


def _run(prepared: dict, baton: Baton) -> dict:
    """One run, from its first turn: float64 throughout in float64."""
    torch.manual_seed(prepared["seed"])
    precision = (float64_throughout() if prepared["dtype"] == torch.float64 else
                 contextlib.nullcontext())
    with precision:
        return _train(baton=baton, **prepared)


def _where(device: torch.device) -> str:
    import platform

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
