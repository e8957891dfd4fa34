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

from treepack.tree import TreePack, forest_stats

__all__ = ["Flops", "step_flops", "best_of", "Measurement", "measure", "unpacked_step", "packed_step",
           "Workload", "workload", "run_bench", "render", "plot", "claw_r1_scenarios"]


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
    from treepack import hf
    from treepack.logprobs import logprobs_from_hidden

    def step():
        model.zero_grad(set_to_none=True)
        if lean:
            hidden = hf.forward(model, pack, backend, return_hidden=True).last_hidden_state[0]
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


def claw_r1_scenarios() -> list[dict]:
    """Claw-R1's token-ratio table, measured: ``n_steps`` branches of ``branch_len`` tokens off
    one ``prefix_len``-token prompt (the shape of their own trie example)."""
    from treepack.synthetic import grpo_batch

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


def workload(*, quick: bool = False, prompts: int | None = None, rollouts: int | None = None,
             steps: int | None = None, prefix_len: int | None = None,
             branch_len: int | None = None, tool_len: int | None = None,
             seed: int = 0) -> Workload:
    """The bench workload: the built-in mix (GRPO groups + multi-turn agent trajectories with
    tool outputs), or, when any option is given, ``prompts x rollouts`` trajectories of
    ``steps`` steps (``steps=1``: GRPO rollouts) with ``prefix_len``-token prompts,
    ``branch_len``-token responses and ``tool_len``-token tool outputs between steps."""
    from treepack.synthetic import agent_batch, grpo_batch

    custom = [prompts, rollouts, steps, prefix_len, branch_len, tool_len]
    if all(v is None for v in custom):
        if quick:
            grpo = dict(groups=2, rollouts=4, prompt_len=256, response_len=96)
            agent = dict(prompts=1, trajectories=2, steps=3, prompt_len=256, response_len=64,
                         tool_len=48)
        else:
            grpo = dict(groups=2, rollouts=8, prompt_len=1024, response_len=256)
            agent = dict(prompts=1, trajectories=2, steps=4, prompt_len=1024, response_len=128,
                         tool_len=96)
        seqs = grpo_batch(**grpo, jitter=0.5, seed=seed) + \
            agent_batch(**agent, jitter=0.5, seed=seed + 1)
        desc = (f"{grpo['groups']} GRPO groups x {grpo['rollouts']} rollouts "
                f"(~{grpo['prompt_len']}-token prompts, ~{grpo['response_len']}-token responses) + "
                f"{agent['trajectories']} agent trajectories x {agent['steps']} steps "
                f"(~{agent['prompt_len']}-token prompt, ~{agent['response_len']}-token responses, "
                f"~{agent['tool_len']}-token tool outputs)")
        return Workload("mixed", seqs, desc)
    prompts, rollouts, steps = prompts or 1, rollouts or 8, steps or 1
    prefix_len, branch_len = prefix_len or 1024, branch_len or 256
    tool_len = 0 if tool_len is None else tool_len
    if steps == 1:
        seqs = grpo_batch(groups=prompts, rollouts=rollouts, prompt_len=prefix_len,
                          response_len=branch_len, seed=seed)
    else:
        seqs = agent_batch(prompts=prompts, trajectories=rollouts, steps=steps,
                           prompt_len=prefix_len, response_len=branch_len, tool_len=tool_len,
                           seed=seed)
    desc = (f"{prompts} prompts x {rollouts} rollouts x {steps} steps, {prefix_len}-token "
            f"prompts, {branch_len}-token branches, {tool_len}-token tool outputs")
    return Workload("custom", seqs, desc)


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def run_bench(work: Workload, *, device: torch.device, backend: str = "auto",
              repeats: int = 1, micro_batch: int = 8, progress: Callable | None = None) -> dict:
    """One training step of a random Qwen2-like model on ``work``, unpacked and packed."""
    import transformers

    from treepack import zoo

    say = progress or (lambda msg: None)
    seqs = [torch.as_tensor(s) for s in work.sequences]
    say("building the pack")
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
    say("building the model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(zoo.qwen2_40m_config()).to(device)
    unpacked_pairs = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    packed_pairs = int((pack.position_ids[: pack.num_tokens] + 1).sum())
    limit = (step_flops(model, pack.num_rows, packed_pairs).total
             / step_flops(model, pack.num_original_tokens, unpacked_pairs).total)
    say("unpacked step")
    base = measure(unpacked_step(model, seqs, micro_batch), device, repeats)
    base_grads = _grads(model)
    runs = {}
    for name, lean in (("packed", False), ("lean", True)):
        say(f"packed step ({backend}{', lean log-probs' if lean else ''})")
        m = measure(packed_step(model, pack, backend, lean=lean), device, repeats)
        grads = _grads(model)
        grad_err = max(((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                       for k, g in base_grads.items())
        runs[name] = dict(seconds=m.seconds, peak_mb=m.peak_bytes / 2**20,
                          time_ratio=m.seconds / base.seconds,
                          memory_ratio=m.peak_bytes / max(base.peak_bytes, 1),
                          loss_rel_error=abs(m.loss - base.loss) / abs(base.loss),
                          grad_max_rel_error=grad_err)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    packed, lean = runs["packed"], runs["lean"]
    return dict(
        workload=work.name, description=work.description, device=where, backend=backend,
        torch=torch.__version__, transformers=transformers.__version__,
        model_params=sum(p.numel() for p in model.parameters()),
        sequences=len(seqs), original_tokens=pack.num_original_tokens,
        packed_rows=pack.num_tokens, token_ratio=pack.token_ratio,
        flop_ratio_limit=limit, micro_batch=micro_batch,
        unpacked_seconds=base.seconds, unpacked_peak_mb=base.peak_bytes / 2**20,
        packed_seconds=packed["seconds"], packed_peak_mb=packed["peak_mb"],
        time_ratio=packed["time_ratio"], memory_ratio=packed["memory_ratio"],
        lean_seconds=lean["seconds"], lean_peak_mb=lean["peak_mb"],
        lean_time_ratio=lean["time_ratio"], lean_memory_ratio=lean["memory_ratio"],
        loss_rel_error=max(packed["loss_rel_error"], lean["loss_rel_error"]),
        grad_max_rel_error=max(packed["grad_max_rel_error"], lean["grad_max_rel_error"]),
        claw_r1=claw_r1_scenarios(),
    )


def render(result: dict) -> str:
    r = result
    lines = [
        f"treepack bench: {r['description']}",
        f"  {r['sequences']} sequences, {r['original_tokens']:,} tokens -> "
        f"{r['packed_rows']:,} packed rows; random Qwen2-like model "
        f"({r['model_params'] / 1e6:.1f}M params), {r['device']}, backend={r['backend']}",
        f"  unpacked: padded micro-batches of {r['micro_batch']}; packed: the whole batch in "
        "one forward; lean: packed, log-probs from hidden states (no [T', V] logits)",
        "",
        f"  {'':<18}{'unpacked':>10}{'packed':>10}{'ratio':>8}{'lean':>10}{'ratio':>8}",
        f"  {'step time (s)':<18}{r['unpacked_seconds']:>10.2f}{r['packed_seconds']:>10.2f}"
        f"{r['time_ratio']:>8.3f}{r['lean_seconds']:>10.2f}{r['lean_time_ratio']:>8.3f}",
        f"  {'peak memory (MB)':<18}{r['unpacked_peak_mb']:>10.0f}{r['packed_peak_mb']:>10.0f}"
        f"{r['memory_ratio']:>8.3f}{r['lean_peak_mb']:>10.0f}{r['lean_memory_ratio']:>8.3f}",
        f"  {'tokens / rows':<18}{r['original_tokens']:>10,}{r['packed_rows']:>10,}"
        f"{r['token_ratio']:>8.3f}",
        f"  {'FLOP-ratio limit':<18}{'':>20}{r['flop_ratio_limit']:>8.3f}",
        "",
        f"  equivalence: loss rel. error {r['loss_rel_error']:.1e}, largest gradient rel. error "
        f"{r['grad_max_rel_error']:.1e} (packed and lean vs unpacked, float32)",
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
    """A PNG: time, memory and rows packed vs unpacked; the Claw-R1 scenarios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    names = ["time", "time\n(lean)", "memory", "memory\n(lean)", "rows /\ntokens"]
    values = [r["time_ratio"], r["lean_time_ratio"], r["memory_ratio"],
              r["lean_memory_ratio"], r["token_ratio"]]
    bars = ax1.bar(names, values, color=["#3b7dd8", "#1c4f99", "#6aa84f", "#38761d", "#999999"])
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(r["flop_ratio_limit"], color="#cc0000", ls="--", lw=1,
                label=f"FLOP-ratio limit {r['flop_ratio_limit']:.2f}")
    for b, v in zip(bars, values):
        ax1.text(b.get_x() + b.get_width() / 2, v + 0.02, f"{v:.2f}", ha="center")
    ax1.set_ylim(0, 1.15)
    ax1.set_ylabel("packed / unpacked")
    ax1.set_title(f"one training step, {r['original_tokens']:,} tokens")
    ax1.legend(loc="upper right", fontsize=8)
    labels = [f"{c['n_steps']}/{c['prefix_len']}/{c['branch_len']}" for c in r["claw_r1"]]
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], [c["measured"] for c in r["claw_r1"]], 0.4,
            label="treepack, measured", color="#3b7dd8")
    ax2.bar([i + 0.2 for i in x], [c["published"] for c in r["claw_r1"]], 0.4,
            label="Claw-R1, published (~)", color="#bbbbbb")
    ax2.set_xticks(list(x), labels)
    ax2.set_xlabel("n_steps / prefix_len / branch_len")
    ax2.set_ylabel("token ratio (packed / original)")
    ax2.set_title("Claw-R1 scenarios")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
