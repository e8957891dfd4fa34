"""Measuring a training step packed vs unpacked: FLOP model, timing, peak memory.

Used by ``bench/step.py`` and ``treepack bench``. Times are compared as ratios measured side
by side in one process (these machines are noisy); peak memory is the CUDA allocator's peak
on a GPU, and the rise of the process's resident-set high-water mark on a CPU.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from treepack.core.forest import causal_pairs
from treepack.core.tree import TreePack, forest_stats

__all__ = ["Flops", "step_flops", "best_of", "Measurement", "measure", "unpacked_step", "packed_step",
           "Workload", "rl_workloads", "custom_workload", "STEPS", "compare_step", "bench_model",
           "run_bench", "render", "plot", "claw_r1_scenarios"]


class Flops(NamedTuple):
    """Forward + backward FLOPs of one step (3x the forward), split by where they go."""

    linear: float  # every matmul with a weight, LM head included: proportional to tokens
    attention: float  # QK^T and PV: proportional to visible (query, key) pairs

    @property
    def total(self) -> float:
        return self.linear + self.attention


def _linear_params_per_token(model: nn.Module) -> tuple[int, int, int]:
    """(weights applied to every token, attention width heads x head_dim, layers)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, nn.Linear) and id(m.weight) not in embeddings)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:  # tied LM head is still a matmul
        linear += head.weight.numel()
    return linear, config.num_attention_heads * head_dim, config.num_hidden_layers


def step_flops(model: nn.Module, tokens: int, pairs: int) -> Flops:
    """FLOPs of a forward + backward over ``tokens`` rows with ``pairs`` visible pairs/layer."""
    linear, width, layers = _linear_params_per_token(model)
    return Flops(linear=3 * 2 * linear * tokens, attention=3 * 4 * width * layers * pairs)


def best_of(fn: Callable, repeats: int = 3):
    """``(fastest wall time in seconds, last result)`` of ``repeats`` calls of ``fn``."""
    times = []
    out = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


class Measurement(NamedTuple):
    seconds: float  # best of the timed repeats
    peak_bytes: int  # peak extra memory of one step
    loss: float


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so the next step's peak shows in RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _peak_memory(device: torch.device, out: list):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        out.append(torch.cuda.max_memory_allocated(device) - base)
        return
    _release_freed_memory()
    base = _rss("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark
    except OSError:
        pass
    yield
    out.append(max(0, _rss("VmHWM:") - base))


def measure(step: Callable[[], torch.Tensor], device: torch.device, repeats: int = 2,
            warmup: int = 1) -> Measurement:
    """Time ``step`` (which runs forward + backward and returns the loss) and its peak memory."""
    loss = None
    for _ in range(warmup):
        loss = step()
    times, peaks = [], []
    for _ in range(repeats):
        with _peak_memory(device, peaks):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    return Measurement(min(times), min(peaks), float(loss))


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    return z.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(z, dim=-1)


def unpacked_step(model: nn.Module, sequences: list[torch.Tensor], micro_batch: int,
                  ) -> Callable[[], torch.Tensor]:
    """One step the usual way: right-padded micro-batches (similar lengths together), SDPA
    causal attention with the padding mask, mean NLL over every original prediction."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches = []
    for i in range(0, len(order), micro_batch):
        chunk = [sequences[j] for j in order[i:i + micro_batch]]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, : len(s)], mask[r, : len(s)] = torch.as_tensor(s), 1
        batches.append((ids.to(device), mask.to(device)))
    predictions = sum(len(s) - 1 for s in sequences)

    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, mask in batches:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            logp = _logprobs_of(logits[:, :-1], ids[:, 1:]) * mask[:, 1:]
            loss = -logp.sum() / predictions
            loss.backward()
            total += loss.detach()
        return total

    return step


def packed_step(model: nn.Module, pack: TreePack, backend: str, *, lean: bool = False
                ) -> Callable[[], torch.Tensor]:
    """One step on the pack: one forward, log-probs back in [N, L], the same mean NLL.

    With ``lean`` the log-probs come from hidden states (``logprobs_from_hidden``), never
    materialising the [T', V] logits."""
    from treepack.adapters import hf
    from treepack.lean.logprobs import logprobs_from_hidden

    def step():
        model.zero_grad(set_to_none=True)
        if lean:
            hidden = hf.forward_hidden(model, pack, backend).last_hidden_state[0]
            logps = logprobs_from_hidden(pack, hidden, **hf.lm_head(model))
        else:
            logps = pack.token_logprobs(hf.forward(model, pack, backend).logits[0])
        loss = -(logps * pack.prediction_mask).sum() / pack.num_predictions
        loss.backward()
        return loss.detach()

    return step


# ---------------------------------------------------------------------- treepack bench

CLAW_R1 = (  # (n_steps, prefix_len, branch_len) -> published token ratio (Claw-R1 docs, "~")
    ((4, 256, 128), 0.53),
    ((8, 1024, 256), 0.35),
    ((4, 1024, 128), 0.28),
)


def head_bench_pack(rows: int, vocab: int, device: torch.device) -> TreePack:
    """The pack of the log-prob benchmarks (``bench/logprobs.py``, ``bench/logits.py``): one
    1024-token prompt and 8 responses filling ``rows`` rows."""
    from treepack.data.synthetic import grpo_batch

    prompt = 1024
    seqs = grpo_batch(groups=1, rollouts=8, prompt_len=prompt, response_len=(rows - prompt) // 8,
                      vocab=vocab)
    pack = TreePack.from_sequences(seqs, device=device)
    if pack.num_rows != rows:
        raise ValueError(f"rows={rows}: use 1024 + a multiple of 8")
    return pack


def print_paths(results: dict, device: torch.device, what: str) -> None:
    """Print the device line and one ``seconds / peak MB`` row per path of a side-by-side
    benchmark (``results``: name -> :func:`measure`'s result)."""
    import platform

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; torch {torch.__version__}; {what}")
    width = max(len(name) for name in results) + 2
    print(f"{'path':<{width}}{'seconds':>10}{'peak MB':>10}")
    for name, m in results.items():
        print(f"{name:<{width}}{m.seconds:>10.3f}{m.peak_bytes / 2**20:>10.0f}")


def claw_r1_scenarios() -> list[dict]:
    """Claw-R1's token-ratio table, measured: ``n_steps`` branches of ``branch_len`` tokens off
    one ``prefix_len``-token prompt (the shape of their own trie example)."""
    from treepack.data.synthetic import grpo_batch

    out = []
    for (steps, prefix, branch), published in CLAW_R1:
        seqs = grpo_batch(groups=1, rollouts=steps, prompt_len=prefix, response_len=branch)
        stats = forest_stats(seqs)
        out.append(dict(n_steps=steps, prefix_len=prefix, branch_len=branch,
                        published=published, measured=stats.token_ratio))
    return out


class Workload(NamedTuple):
    name: str
    sequences: list
    description: str


def rl_workloads(*, scale: int = 1, jitter: float | None = None, seed: int = 0,
                 vocab: int = 32000) -> list[Workload]:
    """Three ragged RL batches, every length divided by ``scale`` (8 on a CPU):

    - ``grpo_long``: 2 prompts x 8 rollouts, 4096-token prompts, 512-token responses (+-50 %);
    - ``low_sharing``: 4 x 8, 512-token prompts, 1536-token responses (+-60 %): little to share;
    - ``agent``: 4 trajectories x 8 steps of one 1024-token prompt, 256-token responses and
      tool outputs (+-30 %); each step repeats the whole history.

    ``jitter`` replaces every default spread (0: uniform lengths).
    """
    from treepack.data.synthetic import agent_batch, grpo_batch

    def j(default):
        return default if jitter is None else jitter

    def n(tokens):
        return max(1, tokens // scale)

    grpo = dict(groups=2, rollouts=8, prompt_len=n(4096), response_len=n(512), jitter=j(0.5))
    low = dict(groups=4, rollouts=8, prompt_len=n(512), response_len=n(1536), jitter=j(0.6))
    agent = dict(prompts=1, trajectories=4, steps=8, prompt_len=n(1024), response_len=n(256),
                 tool_len=n(256), jitter=j(0.3))

    def spread(w):
        return f" (+-{w['jitter']:.0%})" if w["jitter"] else ""

    return [
        Workload("grpo_long", grpo_batch(**grpo, vocab=vocab, seed=seed),
                 f"GRPO, 2 x 8 rollouts, {grpo['prompt_len']}-token prompts, "
                 f"{grpo['response_len']}-token responses{spread(grpo)}"),
        Workload("low_sharing", grpo_batch(**low, vocab=vocab, seed=seed + 2),
                 f"GRPO, 4 x 8 rollouts, {low['prompt_len']}-token prompts, "
                 f"{low['response_len']}-token responses{spread(low)}"),
        Workload("agent", agent_batch(**agent, vocab=vocab, seed=seed + 1),
                 f"agent, 4 trajectories x 8 steps, {agent['prompt_len']}-token prompt, "
                 f"{agent['response_len']}-token responses and tool outputs{spread(agent)}"),
    ]


def custom_workload(*, prompts: int = 1, rollouts: int = 8, steps: int = 1,
                    prefix_len: int = 1024, branch_len: int = 256, tool_len: int = 0,
                    jitter: float = 0.5, seed: int = 0, vocab: int = 32000) -> Workload:
    """``prompts x rollouts`` trajectories of ``steps`` steps (``steps=1``: GRPO rollouts)
    with ``prefix_len``-token prompts, ``branch_len``-token responses and ``tool_len``-token
    tool outputs between steps, lengths spread by ``jitter``."""
    from treepack.data.synthetic import agent_batch, grpo_batch

    if steps == 1:
        seqs = grpo_batch(groups=prompts, rollouts=rollouts, prompt_len=prefix_len,
                          response_len=branch_len, jitter=jitter, vocab=vocab, seed=seed)
    else:
        seqs = agent_batch(prompts=prompts, trajectories=rollouts, steps=steps,
                           prompt_len=prefix_len, response_len=branch_len, tool_len=tool_len,
                           jitter=jitter, vocab=vocab, seed=seed)
    desc = (f"{prompts} prompts x {rollouts} rollouts x {steps} steps, {prefix_len}-token "
            f"prompts, {branch_len}-token branches, {tool_len}-token tool outputs"
            + (f" (+-{jitter:.0%})" if jitter else ""))
    return Workload("custom", seqs, desc)


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _grad_error(grads: dict, reference: dict) -> float:
    """The largest gradient difference over the model's largest reference gradient. Not over
    each tensor's own: one whose gradient is zero in exact arithmetic (a key bias, which
    softmax's shift invariance cancels) holds only rounding in both runs, and its own scale
    would call that rounding a 300 % error (``treepack verify`` judges tensors one by one)."""
    scale = max(g.float().abs().max() for g in reference.values()).clamp_min(1e-30)
    return max(((grads[k].float() - g.float()).abs().max() / scale).item()
               for k, g in reference.items())


STEPS = {  # what each compared step is, for tables and docs
    "padded": "right-padded micro-batches, SDPA, full logits (the usual unpacked step)",
    "padding_free": "every sequence its own chain in one pack (share_prefixes=False), lean "
                    "log-probs: padding-free packing through the same kernels",
    "tree_logits": "the prefix-tree pack, log-probs from full [T', V] logits",
    "tree": "the prefix-tree pack, lean log-probs from hidden states",
}


def compare_step(model: nn.Module, work: Workload, *, backend: str = "auto", repeats: int = 1,
                 micro_batch: int = 4, steps=("padded", "padding_free", "tree_logits", "tree"),
                 progress: Callable | None = None) -> dict:
    """One training step of ``model`` on ``work`` each way of :data:`STEPS`, side by side.

    Returns times, peaks and losses per step, gradient errors against the padded step, the
    token ratio and the FLOP-ratio limit (tree / unpacked FLOPs)."""
    say = progress or (lambda msg: None)
    device = next(model.parameters()).device
    seqs = [torch.as_tensor(s) for s in work.sequences]
    tree = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
    flat = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device,
                                   share_prefixes=False)
    unpacked_pairs = int(causal_pairs(tree.host.lengths).sum())
    tree_pairs = tree.visible_pairs
    limit = (step_flops(model, tree.num_packed_rows, tree_pairs).total  # padding excluded:
             / step_flops(model, tree.num_original_tokens, unpacked_pairs).total)  # the ideal
    makers = {
        "padded": lambda: unpacked_step(model, seqs, micro_batch),
        "padding_free": lambda: packed_step(model, flat, backend, lean=True),
        "tree_logits": lambda: packed_step(model, tree, backend, lean=False),
        "tree": lambda: packed_step(model, tree, backend, lean=True),
    }
    runs, reference = {}, None
    for name in ("padded", *(s for s in steps if s != "padded")):
        say(f"{work.name}: {name.replace('_', ' ')} step")
        m = measure(makers[name](), device, repeats)
        grads = _grads(model)
        reference = reference or grads
        runs[name] = dict(seconds=m.seconds, peak_mb=m.peak_bytes / 2**20, loss=m.loss,
                          grad_max_rel_error=_grad_error(grads, reference))
    base = runs["padded"]
    for r in runs.values():
        r["loss_rel_error"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
    out = dict(workload=work.name, description=work.description, sequences=len(seqs),
               original_tokens=tree.num_original_tokens, packed_rows=tree.num_packed_rows,
               token_ratio=tree.token_ratio, flop_ratio_limit=limit, steps=runs)
    if "tree" in runs:
        t = runs["tree"]["seconds"]
        out["tree_vs_padded"] = t / base["seconds"]
        out["over_limit"] = out["tree_vs_padded"] / limit
        if "padding_free" in runs:
            out["tree_vs_padding_free"] = t / runs["padding_free"]["seconds"]
    return out


def bench_model(preset: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A random-weight model of the ``preset`` shape (see ``treepack.zoo.MODELS``), prepared
    for tree forwards (:func:`treepack.hf.prepare`; padded batches run as before)."""
    import transformers

    from treepack.adapters import hf, zoo

    if preset not in zoo.MODELS:
        raise ValueError(f"model={preset!r}: choose one of {sorted(zoo.MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            zoo.MODELS[preset](), attn_implementation="sdpa", dtype=dtype).to(device)
    return hf.prepare(model)


def run_bench(works: list[Workload], *, device: torch.device, model: str = "qwen2-40m",
              dtype: torch.dtype = torch.float32, backend: str = "auto", repeats: int = 1,
              micro_batch: int = 4, steps=tuple(STEPS), progress: Callable | None = None
              ) -> dict:
    """:func:`compare_step` on each workload with a random ``model`` preset; one result."""
    import transformers

    say = progress or (lambda msg: None)
    say("building the model")
    net = bench_model(model, device, dtype)
    results = [compare_step(net, w, backend=backend, repeats=repeats, micro_batch=micro_batch,
                            steps=steps, progress=progress) for w in works]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    return dict(device=where, torch=torch.__version__, transformers=transformers.__version__,
                model=model, model_params=sum(p.numel() for p in net.parameters()),
                dtype=str(dtype).removeprefix("torch."), backend=backend,
                micro_batch=micro_batch, repeats=repeats, workloads=results,
                claw_r1=claw_r1_scenarios())


def render(result: dict) -> str:
    r = result
    steps = [s for s in STEPS if s in r["workloads"][0]["steps"]]
    lines = [
        f"treepack bench: one training step (forward, mean NLL over every prediction, "
        f"backward) of a random {r['model']} ({r['model_params'] / 1e6:.1f}M params), "
        f"{r['dtype']}, {r['device']}, backend={r['backend']}",
    ]
    lines += [f"  {s:<13}{STEPS[s]}" for s in steps]
    lines += ["", "  step time (s), lower is better; ratios are tree / baseline, measured side "
              "by side:"]
    head = (f"  {'workload':<12}{'tokens':>8}{'rows':>8}{'ratio':>7}"
            + "".join(f"{s.replace('_', '-'):>13}" for s in steps)
            + f"{'vs padded':>11}{'vs pad-free':>12}{'FLOP-ratio limit':>18}")
    lines.append(head)
    for w in r["workloads"]:
        lines.append(
            f"  {w['workload']:<12}{w['original_tokens']:>8,}{w['packed_rows']:>8,}"
            f"{w['token_ratio']:>7.3f}"
            + "".join(f"{w['steps'][s]['seconds']:>13.2f}" for s in steps)
            + f"{w.get('tree_vs_padded', float('nan')):>11.3f}"
            + f"{w.get('tree_vs_padding_free', float('nan')):>12.3f}"
            + f"{w['flop_ratio_limit']:>18.3f}")
    lines += ["", "  peak memory (MB):"]
    lines.append(f"  {'workload':<12}" + "".join(f"{s.replace('_', '-'):>13}" for s in steps))
    for w in r["workloads"]:
        lines.append(f"  {w['workload']:<12}"
                     + "".join(f"{w['steps'][s]['peak_mb']:>13.0f}" for s in steps))
    loss = max(x["loss_rel_error"] for w in r["workloads"] for x in w["steps"].values())
    grad = max(x["grad_max_rel_error"] for w in r["workloads"] for x in w["steps"].values())
    lines += ["", f"  equivalence against the padded step: loss rel. error {loss:.1e}, largest "
              f"gradient rel. error {grad:.1e} ({r['dtype']})"]
    for w in r["workloads"]:
        lines.append(f"  {w['workload']}: {w['description']}")
    lines += [
        "",
        "  Claw-R1 token-ratio scenarios (n_steps branches of branch_len tokens off one "
        "prefix_len prompt):",
        f"  {'n_steps':>9}{'prefix':>8}{'branch':>8}{'measured':>10}{'published':>11}",
    ]
    for c in r["claw_r1"]:
        lines.append(f"  {c['n_steps']:>9}{c['prefix_len']:>8}{c['branch_len']:>8}"
                     f"{c['measured']:>10.3f}{'~' + format(c['published'], '.2f'):>11}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """A PNG: per workload, the tree step's time against both baselines beside the FLOP-ratio
    limit; and Claw-R1's token-ratio scenarios measured beside their published values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = result["workloads"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120,
                                   gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(works))
    series = [("tree_vs_padded", "tree / padded", "#1c4f99"),
              ("tree_vs_padding_free", "tree / padding-free", "#6aa84f"),
              ("flop_ratio_limit", "FLOP-ratio limit", "#bbbbbb")]
    width = 0.8 / len(series)
    top = 1.0
    for i, (key, label, color) in enumerate(series):
        values = [w.get(key, float("nan")) for w in works]
        bars = ax1.bar([j + (i - 1) * width for j in x], values, width, label=label, color=color)
        for b, v in zip(bars, values):
            ax1.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom",
                     fontsize=7)
        top = max([top, *(v for v in values if v == v)])
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_ylim(0, top * 1.15)
    ax1.set_xticks(list(x), [w["workload"].replace("_", " ") for w in works])
    ax1.set_ylabel("step time ratio (lower is better)")
    ax1.set_title(f"one training step, {result['model']}, {result['device']}", fontsize=9)
    ax1.legend(fontsize=7, loc="upper left")
    claw = result["claw_r1"]
    labels = [f"{c['n_steps']} x {c['branch_len']}\non {c['prefix_len']}" for c in claw]
    cx = range(len(labels))
    ax2.bar([i - 0.2 for i in cx], [c["measured"] for c in claw], 0.4,
            label="treepack, measured", color="#3b7dd8")
    ax2.bar([i + 0.2 for i in cx], [c["published"] for c in claw], 0.4,
            label="Claw-R1 docs (approximate)", color="#bbbbbb")
    ax2.set_xticks(list(cx), labels, fontsize=8)
    ax2.set_xlabel("branches x branch tokens on a shared prompt of N tokens", fontsize=8)
    ax2.set_ylabel("packed rows / original tokens (lower is better)", fontsize=8)
    ax2.set_title("token ratio on Claw-R1's scenarios", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
