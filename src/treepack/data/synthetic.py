"""Built-in synthetic workloads shaped like RL-for-LLM batches (no downloads, deterministic).

- GRPO: ``groups`` prompts, each sampled ``rollouts`` times; every rollout repeats its prompt.
- Multi-turn agent: per prompt, ``trajectories`` rollouts of ``steps`` steps; step i's input is
  the prompt, then for every earlier step its response and the tool's output, then step i's
  response. Each step repeats the whole history, so step i is a prefix of step i+1.

Token ids are random in ``[1, vocab)`` (0 is left free for padding), so sharing comes only from
the structure, never from chance collisions in a long sequence.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grpo_batch", "agent_batch", "agentic_batch"]


def _lengths(rng: np.random.Generator, mean: int, n: int, jitter: float) -> np.ndarray:
    if jitter == 0:
        return np.full(n, mean)
    lo = max(1, int(mean * (1 - jitter)))
    hi = max(lo, int(mean * (1 + jitter)))
    return rng.integers(lo, hi + 1, size=n)


def grpo_batch(
    *,
    groups: int = 8,
    rollouts: int = 8,
    prompt_len: int = 2048,
    response_len: int = 1024,
    jitter: float = 0.0,
    vocab: int = 32000,
    seed: int = 0,
) -> list[np.ndarray]:
    """``groups * rollouts`` sequences: a shared prompt then an independent response.

    Args:
        groups: distinct prompts.
        rollouts: responses per prompt.
        prompt_len, response_len: mean lengths.
        jitter: spreads every length uniformly over ``len * (1 +- jitter)``.
        vocab: token ids are drawn from ``[1, vocab)``.
        seed: the generator's seed (the batch is deterministic).

    Returns:
        A list of int64 numpy arrays, group by group.
    """
    rng = np.random.default_rng(seed)
    out = []
    for plen in _lengths(rng, prompt_len, groups, jitter):
        prompt = rng.integers(1, vocab, size=plen)
        for rlen in _lengths(rng, response_len, rollouts, jitter):
            out.append(np.concatenate((prompt, rng.integers(1, vocab, size=rlen))))
    return out


def agent_batch(
    *,
    prompts: int = 4,
    trajectories: int = 4,
    steps: int = 4,
    prompt_len: int = 1024,
    response_len: int = 256,
    tool_len: int = 128,
    jitter: float = 0.0,
    vocab: int = 32000,
    seed: int = 0,
) -> list[np.ndarray]:
    """``prompts * trajectories * steps`` sequences, one per agent step (see the module doc).

    Args:
        prompts, trajectories, steps: the batch's shape.
        prompt_len, response_len, tool_len: mean lengths.
        jitter: spreads every length uniformly over ``len * (1 +- jitter)``.
        vocab: token ids are drawn from ``[1, vocab)``.
        seed: the generator's seed.

    Returns:
        A list of int64 numpy arrays; step i of a trajectory is a prefix of step i + 1.
    """
    rng = np.random.default_rng(seed)
    out = []
    for plen in _lengths(rng, prompt_len, prompts, jitter):
        prompt = rng.integers(1, vocab, size=plen)
        for _ in range(trajectories):
            history = prompt
            resp = _lengths(rng, response_len, steps, jitter)
            tool = _lengths(rng, tool_len, steps, jitter)
            for i in range(steps):
                step = np.concatenate((history, rng.integers(1, vocab, size=resp[i])))
                out.append(step)
                history = np.concatenate((step, rng.integers(1, vocab, size=tool[i])))
    return out


def agentic_batch(seed: int = 0) -> list[np.ndarray]:
    """The default built-in batch: GRPO groups plus multi-turn agent trajectories.

    4 GRPO groups of 8 rollouts (prompts ~1024 tokens, responses ~384) and 4 agent prompts x
    4 trajectories x 4 steps (prompts ~512, responses ~128, tool outputs ~96), lengths jittered
    by 50 %: 96 sequences, about 120k tokens.

    Args:
        seed: the generator's seed.

    Returns:
        A list of int64 numpy arrays.
    """
    grpo = grpo_batch(groups=4, rollouts=8, prompt_len=1024, response_len=384, jitter=0.5,
                      seed=seed)
    agent = agent_batch(prompts=4, trajectories=4, steps=4, prompt_len=512, response_len=128,
                        tool_len=96, jitter=0.5, seed=seed + 1)
    return grpo + agent
