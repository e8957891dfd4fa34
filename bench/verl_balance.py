"""verl's batch balancing against treepack's: how much each rank's forwards can share.

    .venv-verl/bin/python bench/verl_balance.py [--json OUT.json]

Every step, verl 0.9.1's trainer reorders the batch across data-parallel ranks
(``PPOTrainer._balance_batch``), its dispatch hands rank r the r-th contiguous equal chunk,
and the rank cuts contiguous mini-batches of ``ppo_mini_batch_size x n / ranks`` rows. This
runs verl's real ``_balance_batch`` (as shipped, and with :mod:`treepack.verl_trainer`
installed) on a ``KVBatchMeta`` tagged as verl's agent loop tags it, splits it as the dispatch
does (``KVBatchMeta.chunk``, the split ``BatchData.chunk`` makes) and cuts mini-batches with
verl's ``tu.make_iterator``; then counts the packed rows of every forward (sort + LCP).

Workloads: 256 prompts x 8 rollouts, ``ppo_mini_batch_size=64``, seed 0.
  a    512-token prompts, responses of 64-256 tokens
  b    gsm8k-like: prompts of 100-300 tokens, responses of 50-2048

Columns: token ratio = packed rows / tokens when each rank packs its whole share (the
log-prob passes) and when it packs each mini-batch alone (the update); the 1-rank row is the
most a batch can share. ``max/mean``: the most loaded rank's tokens over the mean (verl's
``global_seqlen/balanced_max`` / ``global_seqlen/mean``). ``split``: groups cut across ranks /
across mini-batches. ``verl groups`` is verl's own uid-keeping balancer
(``get_group_balanced_partitions``, v0's PrefixGrouper path) on the same batch, for the
imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import uuid
import warnings
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

warnings.filterwarnings("ignore", message=".* engine is not available")

from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.seqlen_balancing import (  # noqa: E402
    get_group_balanced_partitions,
    log_seqlen_unbalance,
)

from treepack import verl_trainer  # noqa: E402
from treepack.forest import sort_and_lcp  # noqa: E402

PROMPTS, N, MINI_BATCH, VOCAB = 256, 8, 64, 32000
WORKLOADS = {  # name: (prompt lengths, response lengths), inclusive ranges
    "a": ((512, 512), (64, 256)),
    "b": ((100, 300), (50, 2048)),
}


class Batch(NamedTuple):
    """A GRPO batch: every row's tokens, and the KVBatchMeta verl's trainer balances."""

    tokens: list[np.ndarray]  # [rows] prompt + response ids
    meta: KVBatchMeta  # keys {uid}_{session}_0, agent-loop tags, rows group by group


def grpo_batch(workload: str, prompts: int = PROMPTS, n: int = N, seed: int = 0,
               padding: int = 0) -> Batch:
    """``prompts x n`` rows of ragged random tokens (the n rollouts of a prompt share it
    exactly), plus ``padding`` rows as ``upsample_batch_to_divisible_size`` appends them."""
    (p_lo, p_hi), (r_lo, r_hi) = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    tokens, keys, tags = [], [], []
    for _ in range(prompts):
        uid = str(uuid.UUID(bytes=rng.bytes(16), version=4))
        prompt = rng.integers(1, VOCAB, int(rng.integers(p_lo, p_hi + 1)))
        for session in range(n):
            response = rng.integers(1, VOCAB, int(rng.integers(r_lo, r_hi + 1)))
            tokens.append(np.concatenate([prompt, response]))
            keys.append(f"{uid}_{session}_0")
            tags.append(_tag(len(prompt), len(response)))
    pad_uid = f"pad{uuid.UUID(bytes=rng.bytes(16)).hex}"
    for i in range(padding):  # one uid for all, as verl makes them: 127 eos + 1 eos
        tokens.append(np.full(128, 2))
        keys.append(f"{pad_uid}_{i}_0")
        tags.append({**_tag(127, 1), "is_padding": True})
    return Batch(tokens, KVBatchMeta(keys=keys, tags=tags, partition_id="train"))


def _tag(prompt_len: int, response_len: int) -> dict:
    return {"status": "success", "prompt_len": prompt_len, "response_len": response_len,
            "seq_len": prompt_len + response_len, "global_steps": 1, "min_global_steps": 1,
            "max_global_steps": 1}


def v1_trainer(ranks: int, external_lib=None, *, mini_batch: int = MINI_BATCH, n: int = N,
               shuffle: bool = False) -> PPOTrainerSync:
    """verl's default (v1) trainer with only what ``_balance_batch`` reads."""
    trainer = object.__new__(PPOTrainerSync)
    trainer.config = OmegaConf.create({
        "actor_rollout_ref": {"model": {"external_lib": external_lib},
                              "actor": {"ppo_mini_batch_size": mini_batch, "shuffle": shuffle},
                              "rollout": {"n": n}},
        "trainer": {"critic_warmup": 0},
    })
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(ranks))})
    trainer.tokenizer = SimpleNamespace(eos_token_id=2)
    trainer.use_critic = False
    trainer.global_steps = 1
    return trainer


def balance(trainer, batch: Batch) -> tuple[KVBatchMeta, dict]:
    """The trainer's ``_balance_batch`` on a copy of the batch: (balanced batch, metrics)."""
    metrics = {}
    meta = KVBatchMeta(keys=list(batch.meta.keys), tags=batch.meta.tags,
                       partition_id=batch.meta.partition_id)
    return trainer._balance_batch(meta, metrics=metrics), metrics


def forwards(meta: KVBatchMeta, ranks: int, rows_per_minibatch: int) -> list[list[list[str]]]:
    """The keys of every mini-batch of every rank: verl's dispatch split, then each rank's
    contiguous mini-batches (``tu.make_iterator``, ``shuffle=False``)."""
    out = []
    for chunk in meta.chunk(ranks):
        rows = TensorDict({"row": torch.arange(len(chunk))}, batch_size=[len(chunk)])
        cut = tu.make_iterator(rows, mini_batch_size=rows_per_minibatch, epochs=1, seed=42,
                               dataloader_kwargs={"shuffle": False})
        out.append([[chunk.keys[i] for i in mb["row"].tolist()] for mb in cut])
    return out


def token_ratio(batch: Batch, forwards_keys: list[list[str]]) -> float:
    """Packed rows over tokens when each list of keys is packed as one prefix forest."""
    index = {k: i for i, k in enumerate(batch.meta.keys)}
    packed = tokens = 0
    for keys in forwards_keys:
        seqs = [batch.tokens[index[k]] for k in keys]
        length = sum(len(s) for s in seqs)
        packed += length - int(sort_and_lcp(seqs)[1].sum())
        tokens += length
    return packed / tokens


def measure(batch: Batch, meta: KVBatchMeta, metrics: dict, ranks: int) -> dict:
    """Token ratios per rank and per mini-batch, imbalance and split groups of a balanced
    batch."""
    per_rank = forwards(meta, ranks, MINI_BATCH * N // ranks)
    uid = [k.rsplit("_", 2)[0] for k in batch.meta.keys]
    group = dict(zip(batch.meta.keys, uid))

    def split(chunks):
        where = {}
        for c, keys in enumerate(chunks):
            for k in keys:
                where.setdefault(group[k], set()).add(c)
        return sum(len(s) > 1 for s in where.values())

    return {
        "rank_ratio": token_ratio(batch, [sum(r, []) for r in per_rank]),
        "minibatch_ratio": token_ratio(batch, [mb for r in per_rank for mb in r]),
        "max_over_mean": metrics["global_seqlen/balanced_max"] / metrics["global_seqlen/mean"],
        "split_ranks": split([sum(r, []) for r in per_rank]),
        "split_minibatches": split([mb for r in per_rank for mb in r]),
    }


def verl_group_balanced(batch: Batch, ranks: int) -> tuple[KVBatchMeta, dict]:
    """verl's own uid-keeping partition (v0's PrefixGrouper path) applied to the batch."""
    seqlen = [t["seq_len"] for t in batch.meta.tags]
    uid = [k.rsplit("_", 2)[0] for k in batch.meta.keys]
    parts = get_group_balanced_partitions(seqlen_list=seqlen, uid_list=uid, k_partitions=ranks)
    meta = KVBatchMeta(keys=list(batch.meta.keys), tags=batch.meta.tags)
    meta.reorder([i for p in parts for i in p])
    return meta, log_seqlen_unbalance(seqlen_list=seqlen, partitions=parts,
                                      prefix="global_seqlen")


def run() -> list[dict]:
    rows = []
    for workload in WORKLOADS:
        batch = grpo_batch(workload)
        for ranks in (1, 2, 4, 8):
            verl_trainer.uninstall()
            runs = {"verl": balance(v1_trainer(ranks), batch)}
            verl_trainer.install()
            runs["treepack"] = balance(v1_trainer(ranks, "treepack.verl"), batch)
            runs["verl groups"] = verl_group_balanced(batch, ranks)
            for method, (meta, metrics) in runs.items():
                rows.append({"workload": workload, "ranks": ranks, "balancing": method,
                             **measure(batch, meta, metrics, ranks)})
    verl_trainer.uninstall()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = run()
    print(f"# {platform.machine()}, {os.cpu_count()} CPU cores, verl's real _balance_batch, "
          f"{PROMPTS} prompts x {N}, ppo_mini_batch_size={MINI_BATCH}")
    print("| workload | ranks | balancing | ratio per rank | ratio per mini-batch | "
          "max/mean tokens | split ranks / mini-batches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['ranks']} | {r['balancing']} | {r['rank_ratio']:.3f} | "
              f"{r['minibatch_ratio']:.3f} | {r['max_over_mean']:.4f} | "
              f"{r['split_ranks']} / {r['split_minibatches']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
