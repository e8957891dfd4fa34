"""The batches the benchmarks run on: three ragged RL workloads, a custom one, Claw-R1's
token-ratio scenarios and the pack of the log-prob benchmarks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from treepack.core.tree import TreePack, forest_stats

CLAW_R1 = (  # (n_steps, prefix_len, branch_len) -> published token ratio (Claw-R1 docs, "~")
    ((4, 256, 128), 0.53),
    ((8, 1024, 256), 0.35),
    ((4, 1024, 128), 0.28),
)


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
