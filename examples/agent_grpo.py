"""A multi-turn agent trained with GRPO, unpacked and with treepack, side by side.

    python examples/agent_grpo.py          # tiny: a few steps, the two runs checked equal
    python examples/agent_grpo.py --full   # the run in docs/BENCHMARKS.md, with a plot

Claw-R1's case. An environment (a letter game) talks with the model for several turns: each
turn it names a letter, the model answers, the environment scores the answer (the share of
its characters that are that letter) and names the next letter. Every turn is its own
training sample: the whole history so far, then that turn's answer, whose tokens are the
sample's loss tokens. Samples arrive in a data pool keyed by the task's ``uid``; when all of a
task's trajectories have ended the group is ready, its trajectories' mean scores become GRPO
advantages (normalised within the group), and every turn sample of a trajectory carries its
trajectory's advantage.

A group's samples share almost everything: the prompt, and each turn repeats every earlier
turn. The unpacked run computes every sample alone (right-padded micro-batches); the treepack
run plans the step's samples into packs (``treepack.plan``; the tasks share the game's rules,
so the step is one tree with a branch per task), computes each distinct prefix once
(``hf.logprobs``), and takes the same loss (``treepack.losses``) on the same ``[N, L]``
log-probs. Both runs start from one model and one seed and take their
steps in turn, each with its own random state, so they sample the same conversations as
long as their weights agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import numpy as np
import torch
import transformers

import treepack
from treepack import hf, losses, sharing, tasks

LETTERS = "abcdefgh"
# float32 rounding of one model computed two ways: 512 roundings (tests/support/tolerance.py)
ALLOWED = 512 * 2.0**-24
RULES = ("you are playing a game. each turn the game names a letter: answer with that letter, "
         "as many times as your answer allows.\n")


class LetterGame:
    """A task: a fixed sequence of letters, one a turn, the same for every trajectory of it."""

    def __init__(self, uid: int, turns: int, answer_length: int, rng: np.random.Generator):
        self.uid, self.answer_length = uid, answer_length
        self.letters = [LETTERS[i] for i in rng.integers(0, len(LETTERS), size=turns)]

    def opening(self) -> str:
        return f"{RULES}game {self.uid}. turn 1: say {self.letters[0]}.\n>"

    def step(self, turn: int, answer: str) -> tuple[float, str | None]:
        """The answer's score and the environment's next message (None: the game ended)."""
        score = answer.count(self.letters[turn]) / self.answer_length
        if turn + 1 == len(self.letters):
            return score, None
        return score, f"\nturn {turn + 2}: say {self.letters[turn + 1]}.\n>"


def model_config(vocab_size: int, full: bool):
    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4) if full else \
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    return transformers.Qwen2Config(vocab_size=vocab_size, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=4096,
                                    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, **size)


def rollouts(model, tokenizer, games, group: int, answer_length: int, pool: dict) -> None:
    """Play every game ``group`` times, all turns batched; each turn's sample goes to
    ``pool[uid]`` as it is made: ``(token ids, prompt length, trajectory, score)``."""
    players = [(game, g) for game in games for g in range(group)]
    history = [tokenizer(game.opening()).input_ids for game, _ in players]
    scores = [[] for _ in players]
    for turn in range(len(games[0].letters)):
        width = max(len(h) for h in history)  # left-padded, as generation wants
        ids = torch.tensor([[0] * (width - len(h)) + h for h in history])
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in history])
        with torch.no_grad():  # answers of answer_length characters: no special tokens
            out = model.generate(ids, attention_mask=mask, do_sample=True,
                                 max_new_tokens=answer_length, min_new_tokens=answer_length,
                                 suppress_tokens=[0, 1, 2], pad_token_id=0)
        for i, ((game, g), answer) in enumerate(zip(players, out[:, width:].tolist())):
            score, message = game.step(turn, tokenizer.decode(answer))
            pool.setdefault(game.uid, []).append((history[i] + answer, len(history[i]), g, score))
            scores[i].append(score)
            if message is not None:
                history[i] = history[i] + answer + tokenizer(message).input_ids


def ready_batch(pool: dict, group: int):
    """The pool's groups as one step's samples: ids, prompt lengths, GRPO advantages (each
    trajectory's mean score, normalised within its group) and the groups' uids."""
    sequences, prompt_lengths, advantages, uids = [], [], [], []
    for uid, samples in pool.items():
        per_trajectory = np.zeros(group)
        for _, _, g, score in samples:
            per_trajectory[g] += score
        normalised = (per_trajectory - per_trajectory.mean()) / (per_trajectory.std() + 1e-4)
        for ids, prompt, g, _ in samples:
            sequences.append(ids)
            prompt_lengths.append(prompt)
            advantages.append(normalised[g])
            uids.append(uid)
    rewards = [np.mean([s for *_, s in samples]) for samples in pool.values()]
    return sequences, prompt_lengths, torch.tensor(advantages), uids, float(np.mean(rewards))


def unpacked_update(model, sequences, prompt_lengths, advantages, micro_batch: int) -> float:
    """Every sample alone: right-padded micro-batches, full logits, the same loss."""
    L = max(len(s) for s in sequences)
    masks = torch.zeros(len(sequences), L, dtype=torch.bool)
    for s, (seq, prompt) in enumerate(zip(sequences, prompt_lengths)):
        masks[s, prompt:len(seq)] = True  # the turn's answer; label-aligned as treepack's
    den = losses.global_denominators([masks])
    total = 0.0
    for start in range(0, len(sequences), micro_batch):
        rows = list(range(start, min(start + micro_batch, len(sequences))))
        width = max(len(sequences[s]) for s in rows)  # each micro-batch to its own longest
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, :len(sequences[s])] = torch.tensor(sequences[s])
            attention[r, :len(sequences[s])] = 1
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        logps = torch.nn.functional.pad(logp, (1, L - width))  # [n, L]: column p scores token p
        loss = losses.policy_loss(logps, logps.detach(), advantages[rows], masks[rows],
                                  mode="token-mean", denominators=den).loss
        loss.backward()
        total += loss.item()
    return total


def treepack_update(model, sequences, prompt_lengths, advantages, max_tokens: int):
    """The step's samples planned into packs, one forward each (the groups share the game's
    rules: one tree, a branch per task, while it fits a pack); returns the loss and the
    packs."""
    plan = treepack.plan(sequences, max_tokens=max_tokens)
    packs = plan.packs(0)
    prompts = torch.tensor(prompt_lengths)
    masks = [pack.completion_mask(prompts[pack.seq_ids].tolist()) for pack in packs]
    den = losses.global_denominators(masks)  # every pack of the step adds up to one batch
    total = 0.0
    for pack, mask in zip(packs, masks):
        logps = hf.logprobs(model, pack).logprobs  # [n, L] of this pack's samples
        loss = losses.policy_loss(logps, logps.detach(), advantages[pack.seq_ids], mask,
                                  mode="token-mean", denominators=den).loss
        loss.backward()
        total += loss.item()
    return total, packs


def token_ratio(sequences, prompt_lengths, uids, packs) -> float:
    """Packed rows over tokens of the step as its packs computed it (``sharing.report``)."""
    pack_of = np.zeros(len(sequences), dtype=np.int64)
    for j, pack in enumerate(packs):
        pack_of[pack.seq_ids.cpu().numpy()] = j
    report = sharing.report(sequences, groups=uids, prompt_lengths=prompt_lengths,
                            packs=pack_of.tolist())
    return report.achieved_rows / report.original_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the run in docs/BENCHMARKS.md")
    parser.add_argument("--json", default=None, help="write the curves here")
    parser.add_argument("--plot", default=None, help="write the curves' PNG here")
    args = parser.parse_args()
    games_per_step, group, turns, answer_length, steps = \
        (4, 8, 4, 6, 40) if args.full else (2, 4, 3, 4, 4)

    tokenizer = tasks.char_tokenizer()
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(
        model_config(len(tokenizer), args.full), attn_implementation="sdpa")
    runs = {name: {"model": hf.prepare(copy.deepcopy(base)) if name == "treepack" else
                   copy.deepcopy(base), "rng": torch.get_rng_state(), "steps": []}
            for name in ("unpacked", "treepack")}
    for run in runs.values():
        run["optimizer"] = torch.optim.AdamW(run["model"].parameters(), lr=3e-3)
    tasks_rng = np.random.default_rng(0)
    for step in range(steps):
        games = [LetterGame(step * games_per_step + i, turns, answer_length, tasks_rng)
                 for i in range(games_per_step)]
        for name, run in runs.items():  # in turn, each from its own random state
            torch.set_rng_state(run["rng"])
            model, started = run["model"], time.perf_counter()
            pool: dict = {}
            rollouts(model, tokenizer, games, group, answer_length, pool)
            generated = time.perf_counter()
            sequences, prompts, advantages, uids, reward = ready_batch(pool, group)
            run["optimizer"].zero_grad(set_to_none=True)
            packs = None
            if name == "unpacked":
                loss = unpacked_update(model, sequences, prompts, advantages, 8)
            else:
                loss, packs = treepack_update(model, sequences, prompts, advantages,
                                              max_tokens=4096)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
            if step == 0:  # the one step both runs take from the same weights
                run["first_grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
            run["optimizer"].step()
            updated = time.perf_counter()
            run["rng"] = torch.get_rng_state()
            ratio = 1.0 if packs is None else token_ratio(sequences, prompts, uids, packs)
            run["steps"].append({"reward": reward, "loss": loss, "grad_norm": grad_norm,
                                 "token_ratio": ratio,
                                 "samples": len(sequences),
                                 "tokens": sum(len(s) for s in sequences),
                                 "rollout_seconds": generated - started,
                                 "update_seconds": updated - generated,
                                 "rollouts": hash(tuple(map(tuple, sequences)))})
        a, b = runs["unpacked"]["steps"][-1], runs["treepack"]["steps"][-1]
        print(f"step {step + 1:3d}: {a['samples']} turn samples, {a['tokens']} tokens, reward "
              f"{a['reward']:.3f} / {b['reward']:.3f}, grad norm {a['grad_norm']:.6f} / "
              f"{b['grad_norm']:.6f} (unpacked / treepack), token ratio {b['token_ratio']:.3f}, "
              f"update {a['update_seconds']:.2f} s / {b['update_seconds']:.2f} s", flush=True)

    unpacked, packed = runs["unpacked"]["steps"], runs["treepack"]["steps"]
    same = next((i for i, (a, b) in enumerate(zip(unpacked, packed))
                 if a["rollouts"] != b["rollouts"]), steps)
    timed = slice(1, None)  # the first step warms up
    update = [sum(s["update_seconds"] for s in r[timed]) for r in (unpacked, packed)]
    total = [sum(s["update_seconds"] + s["rollout_seconds"] for s in r[timed])
             for r in (unpacked, packed)]
    quarter = max(1, steps // 4)
    print(f"\nthe runs sampled the same conversations for {same} of {steps} steps; mean reward "
          f"{np.mean([s['reward'] for s in unpacked[:quarter]]):.3f} -> "
          f"{np.mean([s['reward'] for s in unpacked[-quarter:]]):.3f} (first -> last quarter, "
          "unpacked)")
    print(f"update seconds treepack / unpacked: {update[1] / update[0]:.3f}; whole steps: "
          f"{total[1] / total[0]:.3f}; mean token ratio "
          f"{np.mean([s['token_ratio'] for s in packed]):.3f}")
    first = runs["unpacked"]["first_grads"], runs["treepack"]["first_grads"]
    worst = max(((first[1][k] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
                for k, g in first[0].items())
    norms = max((abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
                 for a, b in zip(unpacked[:same], packed[:same])), default=0.0)
    print(f"first step (same weights): gradients within {worst:.1e} of the unpacked run's "
          f"(relative); grad norms while the conversations agreed: within {norms:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: r["steps"] for name, r in runs.items()}, f, indent=1)
    if args.plot:
        plot(unpacked, packed, args.plot)
    if not args.full and (same < steps or worst > ALLOWED):
        sys.exit(f"the runs differ: conversations alike for {same} of {steps} steps, first "
                 f"gradients within {worst:.1e} (allowed {ALLOWED:.1e})")


def plot(unpacked, packed, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=110)
    x = range(1, len(unpacked) + 1)
    for steps, name, style in ((unpacked, "unpacked", dict(color="#888888", lw=3)),
                               (packed, "treepack", dict(color="#1c4f99", lw=1.4, ls="--"))):
        axes[0].plot(x, [s["reward"] for s in steps], label=name, **style)
        axes[1].plot(x, [s["grad_norm"] for s in steps], label=name, **style)
        axes[2].plot(x, [s["update_seconds"] for s in steps], label=name, **style)
    for ax, title in zip(axes, ("reward", "gradient norm", "update seconds per step")):
        ax.set_title(f"agent GRPO: {title}", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
