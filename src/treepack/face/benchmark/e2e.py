"""``treepack bench --e2e``: a whole GRPO run twice, stock TRL and treepack, side by side.

Both runs are TRL's ``GRPOTrainer.train()`` with generation, from one saved random model, one
seed and one dataset: ``trl.GRPOTrainer`` and :class:`treepack.trl.TreepackGRPOTrainer`. They
take their steps in turn, in two threads of one process (:class:`_Baton`): run A's step 1,
then run B's step 1, then A's step 2, and so on, each run with its own random state, so a
load that comes and goes on the machine lands on both runs alike, and each run samples from
the random state it would have had alone. As long as their weights agree they sample the
same completions; each step records a digest of its completions to show where they part.

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
a completion earns the count of that letter over its length. A random-init model learns it in
a few dozen steps on a CPU.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from treepack.face.benchmark.precision import float64_throughout

__all__ = ["E2EWorkload", "E2E_WORKLOADS", "E2E_MODELS", "PHASES", "run_e2e", "render_e2e",
           "plot_e2e", "e2e_model"]

PHASES = ("generate", "score", "logprobs", "update")
RUNS = ("stock", "treepack")


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


def e2e_model(name: str, folder: str, dtype: torch.dtype, vocab_size: int, seed: int = 0) -> str:
    """Save a random-init model of shape ``name`` (:data:`E2E_MODELS`, or a shape of
    ``treepack.zoo.MODELS`` with the task's vocabulary) in ``dtype`` to ``folder``; returns
    the folder (TRL loads the policy and its reference model from a path)."""
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
    model.save_pretrained(folder)
    return folder


class _Baton:
    """Two runs in two processes taking optimizer steps in turn: only the holder runs. A run
    hands the baton to the other at the end of each step and waits for it back; a run that
    finishes hands it over for good (``done``), and the other then runs on alone."""

    def __init__(self, context, names: tuple[str, ...]):
        self.names = names
        self.go = {name: context.Semaphore(0) for name in names}
        self.done = context.Array("b", len(names))
        self.over = context.Event()  # both runs reported: their processes may end

    def _other(self, name: str) -> str:
        return self.names[1 - self.names.index(name)]

    def take(self, name: str) -> None:
        self.go[name].acquire()

    def start(self) -> None:
        self.go[self.names[0]].release()

    def give(self, name: str, *, finished: bool = False) -> None:
        other = self._other(name)
        if finished:
            self.done[self.names.index(name)] = 1
            self.go[other].release()
        elif not self.done[self.names.index(other)]:
            self.go[other].release()
            self.take(name)


class _Phases:
    """Per optimizer step of one trainer: the seconds of each of :data:`PHASES` and a digest
    of the completions it sampled. Wraps the trainer's methods on the instance; a TRL
    callback (:meth:`callback`) marks the steps and passes the :class:`_Baton`."""

    def __init__(self, trainer, name: str, baton: _Baton, device: torch.device):
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


def _train(name: str, cls, model_path: str, tokenizer, dataset, reward, work: E2EWorkload, *,
           steps: int, num_generations: int, prompts_per_step: int, learning_rate: float,
           beta: float, seed: int, device: torch.device, dtype: torch.dtype, folder: str,
           baton: _Baton, trainer_kwargs: dict) -> dict:
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
    baton.take(name)
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


def _summary(runs: dict, steps: int) -> dict:
    """What a workload's two runs show: where they sample alike, how far their losses are
    apart while they do, whether the reward rose, and the seconds per phase (every step but
    the first, a warm-up) with treepack's over stock's."""
    stock, tree = runs["stock"]["steps"], runs["treepack"]["steps"]
    same = 0
    while same < len(stock) and stock[same]["completions"] == tree[same]["completions"]:
        same += 1
    scale = max(abs(s["loss"]) for s in stock) or 1.0
    loss_gap = max((abs(s["loss"] - t["loss"]) for s, t in zip(stock[:same], tree[:same])),
                   default=0.0)
    quarter = max(1, steps // 4)
    out = {"identical_steps": same, "steps": steps,
           "max_loss_difference": loss_gap, "max_loss_difference_relative": loss_gap / scale}
    timed = slice(1, None) if steps > 1 else slice(None)
    for name, run in runs.items():
        rewards = [s["reward"] for s in run["steps"]]
        seconds = {p: sum(s["seconds"][p] for s in run["steps"][timed]) for p in PHASES}
        run["reward_first_quarter"] = float(np.mean(rewards[:quarter]))
        run["reward_last_quarter"] = float(np.mean(rewards[-quarter:]))
        run["seconds"] = seconds
        run["training_seconds"] = seconds["logprobs"] + seconds["update"]
        run["total_seconds"] = sum(seconds.values())
    ratios = [s["token_ratio"] for s in tree if "token_ratio" in s]
    if ratios:
        out["token_ratio"] = float(np.mean(ratios))
    s, t = runs["stock"], runs["treepack"]
    out["training_ratio"] = t["training_seconds"] / s["training_seconds"]
    out["run_ratio"] = t["total_seconds"] / s["total_seconds"]
    out["stock_training_share"] = s["training_seconds"] / s["total_seconds"]
    out["phase_ratios"] = {p: t["seconds"][p] / s["seconds"][p] if s["seconds"][p] else None
                           for p in PHASES}
    # step k of both runs ran back to back: their ratio saw the same load (a burst on the
    # machine shows in one step's ratio, not in the median)
    for key, phases in (("training", ("logprobs", "update")), ("run", PHASES)):
        per_step = [sum(b["seconds"][p] for p in phases) / sum(a["seconds"][p] for p in phases)
                    for a, b in zip(stock[timed], tree[timed])]
        out[f"{key}_ratio_per_step"] = {"median": float(np.median(per_step)),
                                        "low": float(min(per_step)), "high": float(max(per_step))}
    if same < steps:  # after the runs part: the same learning, statistically
        after = {name: np.array([x["reward"] for x in run["steps"][same:]])
                 for name, run in runs.items()}
        out["after_split"] = {
            "steps": steps - same,
            "reward_mean": {name: float(v.mean()) for name, v in after.items()},
            # the difference of the means in units of its standard error (Welch)
            "reward_difference_in_standard_errors": float(
                (after["treepack"].mean() - after["stock"].mean()) / max(np.sqrt(
                    sum(v.var(ddof=1) / len(v) for v in after.values()) if steps - same > 1
                    else 0.0), 1e-12))}
    return out


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
    from treepack.data import tasks

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tasks.char_tokenizer()
    result = {"model": model, "dtype": str(dtype).removeprefix("torch."), "device": _where(device),
              "torch": torch.__version__, "steps": steps, "num_generations": num_generations,
              "prompts_per_step": prompts_per_step, "learning_rate": learning_rate, "beta": beta,
              "seed": seed, "backend": backend, "workloads": []}
    import transformers
    import trl

    result["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__}
    with tempfile.TemporaryDirectory(prefix="treepack-e2e-") as folder:
        weights = torch.float32 if dtype == torch.bfloat16 else dtype  # bfloat16: autocast
        path = e2e_model(model, os.path.join(folder, "model"), weights, len(tokenizer), seed=seed)
        result["model_params"] = sum(p.numel() for p in transformers.AutoModelForCausalLM
                                     .from_pretrained(path).parameters())
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
                     "agreement": _summary(runs, steps)}
            result["workloads"].append(entry)
    result["runs"] = result["workloads"][0]["runs"]
    return result


def _pair(work, path, *, steps, num_generations, prompts_per_step, learning_rate, beta, seed,
          device, dtype, folder, backend, progress) -> dict:
    """The two runs of one workload, each in a process of its own, steps in turn
    (:class:`_Baton`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh process: no inherited state
    baton = _Baton(context, RUNS)
    results = context.Queue()
    options = dict(steps=steps, num_generations=num_generations,
                   prompts_per_step=prompts_per_step, learning_rate=learning_rate, beta=beta,
                   seed=seed, device=device, dtype=dtype, folder=folder, backend=backend)
    started = time.perf_counter()
    workers = [context.Process(target=_worker, args=(name, work, path, options, baton, results),
                               name=f"treepack-e2e-{name}") for name in RUNS]
    for w in workers:
        w.start()
    ready = [results.get() for _ in RUNS]  # both imported torch, TRL and transformers
    if any(kind != "ready" for kind, *_ in ready):
        raise RuntimeError(f"an e2e run failed to start: {ready}")
    baton.start()
    runs, errors = {}, {}
    for _ in RUNS:
        kind, name, payload = results.get()
        (runs if kind == "run" else errors)[name] = payload
    baton.over.set()
    for w in workers:
        w.join()
    if errors:
        name, error = next(iter(errors.items()))
        raise RuntimeError(f"the {name} run of {work.name} failed:\n{error}")
    if progress:
        progress(f"{work.name}: both runs, {steps} steps each, in "
                 f"{time.perf_counter() - started:.0f} s")
    return {name: runs[name] for name in RUNS}


def _worker(name: str, work: E2EWorkload, path: str, options: dict, baton: _Baton,
            results) -> None:
    """One run in its own process (:func:`_pair`): reports ``("ready", name, None)``, then
    ``("run", name, result)`` or ``("error", name, traceback)``."""
    import traceback

    from datasets import Dataset
    from trl import GRPOTrainer

    from treepack.adapters.trl import TreepackGRPOTrainer
    from treepack.data import tasks

    results.put(("ready", name, None))
    cls, kwargs = {"stock": (GRPOTrainer, {}),
                   "treepack": (TreepackGRPOTrainer,
                                {"treepack_backend": options["backend"]})}[name]
    try:
        tokenizer = tasks.char_tokenizer()
        data = tasks.letter_prompts(work.letters, instruction_repeats=work.instruction_repeats)
        # enough rows that the sampler never runs out within the run
        copies = options["steps"] * options["prompts_per_step"] // len(data["prompt"]) + 1
        dataset = Dataset.from_dict({k: v * copies for k, v in data.items()})
        torch.manual_seed(options["seed"])
        precision = (float64_throughout() if options["dtype"] == torch.float64 else
                     contextlib.nullcontext())
        with precision:
            run = _train(name, cls, path, tokenizer, dataset,
                         tasks.letter_reward(work.completion_length), work, baton=baton,
                         trainer_kwargs=kwargs,
                         **{k: v for k, v in options.items() if k != "backend"})
        results.put(("run", name, run))
    except BaseException:
        results.put(("error", name, traceback.format_exc()))
    finally:
        gc.collect()  # freed while this run holds the baton: not timed against the other's
        baton.give(name, finished=True)
        baton.over.wait()  # nor is this process's exit


def _where(device: torch.device) -> str:
    import platform

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def render_e2e(result: dict) -> str:
    """The printed report of :func:`run_e2e`'s result."""
    r = result
    lines = [f"treepack bench --e2e: GRPO with generation, stock trl.GRPOTrainer vs "
             f"treepack.trl.TreepackGRPOTrainer, a random {r['model']} "
             f"({r['model_params'] / 1e6:.1f}M params), {r['dtype']}, {r['device']}",
             f"  {r['steps']} steps of {r['prompts_per_step']} prompts x {r['num_generations']} "
             f"completions, lr {r['learning_rate']:g}, beta {r['beta']:g}; the runs take their "
             "steps in turn, from one seed", ""]
    head = (f"  {'workload':<17}{'run':<10}{'reward first→last quarter':>27}"
            + "".join(f"{p:>10}" for p in PHASES) + f"{'train':>9}{'total':>9}")
    lines += ["  seconds over every step but the first (phases: generate, score, no-grad "
              "log-probs, loss + backward + optimizer):", head]
    for w in r["workloads"]:
        for name in RUNS:
            run = w["runs"][name]
            rewards = f"{run['reward_first_quarter']:.3f} → {run['reward_last_quarter']:.3f}"
            lines.append(f"  {w['workload']:<17}{name:<10}{rewards:>27}"
                         + "".join(f"{run['seconds'][p]:>10.2f}" for p in PHASES)
                         + f"{run['training_seconds']:>9.2f}{run['total_seconds']:>9.2f}")
    lines += ["", f"  {'workload':<17}{'token ratio':>12}{'train ratio':>24}{'run ratio':>24}"
              f"{'train share':>13}{'same samples':>14}{'loss gap':>10}"]

    def cell(spread):
        return f"{spread['median']:.3f} [{spread['low']:.3f}-{spread['high']:.3f}]"

    for w in r["workloads"]:
        a = w["agreement"]
        lines.append(f"  {w['workload']:<17}{a.get('token_ratio', float('nan')):>12.3f}"
                     f"{cell(a['training_ratio_per_step']):>24}"
                     f"{cell(a['run_ratio_per_step']):>24}{a['stock_training_share']:>13.2f}"
                     f"{a['identical_steps']:>8} of {a['steps']:<4}"
                     f"{a['max_loss_difference_relative']:>10.1e}")
    lines += ["  train ratio: treepack's (no-grad log-probs + update) seconds over stock's, step "
              "by step (the steps ran back to back): median [lowest-highest step];",
              "  run ratio: the same of whole steps; train share: stock's training seconds over "
              "its steps'; same samples: the leading steps whose completions",
              "  are identical in both runs; loss gap: the largest loss difference over those "
              "steps, relative to the largest loss"]
    for w in r["workloads"]:
        split = w["agreement"].get("after_split")
        if split:
            m = split["reward_mean"]
            lines.append(
                f"  {w['workload']}: from step {w['agreement']['identical_steps'] + 1} the runs "
                f"sample differently; mean reward over the {split['steps']} steps after: stock "
                f"{m['stock']:.3f}, treepack {m['treepack']:.3f} "
                f"({split['reward_difference_in_standard_errors']:+.1f} standard errors)")
    return "\n".join(lines)


def plot_e2e(result: dict, path: str) -> None:
    """A PNG, a row per workload: reward and loss of both runs overlaid, and the seconds per
    phase stacked per step (stock left, treepack right of each step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = result["workloads"]
    fig, axes = plt.subplots(len(works), 3, figsize=(14, 3.6 * len(works)), dpi=110,
                             squeeze=False)
    colors = {"stock": "#888888", "treepack": "#1c4f99"}
    phase_colors = dict(zip(PHASES, ("#f4b942", "#a0c878", "#7fb3e0", "#1c4f99")))
    for row, w in zip(axes, works):
        for name in RUNS:
            steps = w["runs"][name]["steps"]
            x = range(1, len(steps) + 1)
            style = dict(color=colors[name], lw=1.4 if name == "treepack" else 3, alpha=0.9,
                         ls="-" if name == "stock" else "--", label=name)
            row[0].plot(x, [s["reward"] for s in steps], **style)
            row[1].plot(x, [s["loss"] for s in steps], **style)
        row[0].set_title(f"{w['workload']}: reward", fontsize=9)
        row[1].set_title(f"{w['workload']}: loss", fontsize=9)
        same = w["agreement"]["identical_steps"]
        for ax in row[:2]:
            ax.set_xlabel("step")
            if same < w["agreement"]["steps"]:
                ax.axvline(same + 0.5, color="#cc4444", lw=0.8, ls=":")
            ax.legend(fontsize=7)
        ax = row[2]
        width = 0.4
        for offset, name in ((-0.2, "stock"), (0.2, "treepack")):
            steps = w["runs"][name]["steps"]
            bottom = np.zeros(len(steps))
            x = np.arange(1, len(steps) + 1) + offset
            for p in PHASES:
                values = np.array([s["seconds"][p] for s in steps])
                ax.bar(x, values, width, bottom=bottom, color=phase_colors[p],
                       label=p if name == "stock" else None,
                       hatch=None if name == "stock" else "//", edgecolor="white", lw=0)
                bottom += values
        ax.set_title(f"{w['workload']}: seconds per step, stock | treepack (hatched)", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO run, {result['model']}, {result['dtype']}, {result['device']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
