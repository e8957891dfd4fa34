"""Planner benchmark: rows vs the one-forest minimum, rank balance, planning time.

    python bench/plan.py [--json OUT.json]

Workloads (built-in, deterministic):
  mixed  32 GRPO groups x 8 rollouts (prompts ~1024, responses ~512, +-50 %) and
         16 agent prompts x 4 trajectories x 4 steps (prompts ~1024, responses ~256, tool
         outputs ~192, +-50 %): 512 sequences
  64k    6144 GRPO groups x 8 rollouts (prompts ~64, responses ~32) and 1024 agent prompts x
         4 trajectories x 4 steps (prompts ~48, responses ~16, tools ~8): 65,536 sequences,
         planned at budgets 8192, 16384 and 160 rows (cut to 160 tokens for the last)
  grpo   4k / 8k / 16k sequences: 512-token prompts x 8 rollouts of 1000-3500 tokens, 4096
         rows per pack, 8 ranks
  scale  50k-400k sequences that share only a BOS (one tree cut into runs) at 20 rows, 1 and
         4,096 ranks; 65,536 GRPO sequences (8 per 65-token prompt) at 160 rows, 8 and 4,096
         ranks
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np

import treepack
from treepack.benchmark import best_of
from treepack.planner import plan
from treepack.synthetic import agent_batch, grpo_batch


def mixed():
    return grpo_batch(groups=32, rollouts=8, prompt_len=1024, response_len=512, jitter=0.5) + \
        agent_batch(prompts=16, trajectories=4, steps=4, prompt_len=1024, response_len=256,
                    tool_len=192, jitter=0.5, seed=1)


def many():
    return grpo_batch(groups=6144, rollouts=8, prompt_len=64, response_len=32, jitter=0.5) + \
        agent_batch(prompts=1024, trajectories=4, steps=4, prompt_len=48, response_len=16,
                    tool_len=8, jitter=0.5, seed=3)


def largest_tree(seqs) -> int:
    firsts = {}
    for s in seqs:
        firsts.setdefault(int(s[0]), []).append(s)
    return max(treepack.forest_stats(group).packed_rows for group in firsts.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"rows": [], "balance": [], "speed": []}

    seqs = mixed()
    tokens = sum(len(s) for s in seqs)
    big = largest_tree(seqs)
    print(f"mixed: {len(seqs)} sequences, {tokens:,} tokens, one-forest minimum "
          f"{treepack.forest_stats(seqs).packed_rows:,} rows, largest tree {big:,} rows")
    print(f"  {'budget':>8} {'x largest':>9} {'ranks':>6} {'packs/rank':>10} {'rows / min':>10} "
          f"{'imbalance':>9}")
    for budget in (big // 2, big, 2 * big, 4 * big):
        for world in (1, 8):
            p = plan(seqs, max_tokens=budget, world_size=world)
            row = dict(budget=budget, x_largest=budget / big, world=world,
                       packs_per_rank=p.packs_per_rank, efficiency=p.efficiency,
                       imbalance=p.imbalance)
            results["rows"].append(row)
            print(f"  {budget:>8,} {budget / big:>9.2f} {world:>6} {p.packs_per_rank:>10} "
                  f"{p.efficiency:>10.4f} {p.imbalance:>9.3f}")
    for world in (2, 4, 8, 16):
        p = plan(seqs, max_tokens=16384, world_size=world)
        results["balance"].append(dict(world=world, imbalance=p.imbalance,
                                       packs_per_rank=p.packs_per_rank))
    print("  imbalance at 16,384 rows per pack: " + ", ".join(
        f"{r['world']} ranks {r['imbalance']:.3f}" for r in results["balance"]))

    seqs = many()
    tokens = sum(len(s) for s in seqs)
    print(f"64k: {len(seqs):,} sequences, {tokens:,} tokens")
    for budget, world in ((8192, 1), (8192, 8), (160, 8), (16384, 8)):
        if budget == 160:  # the tight budget of the reliability issue: every sequence fits
            seqs = [s[:160] for s in seqs]
        seconds, p = best_of(lambda: plan(seqs, max_tokens=budget, world_size=world))
        build, _ = best_of(lambda: p.packs(0), repeats=1)
        results["speed"].append(dict(workload="64k", budget=budget, world=world,
                                     seconds=seconds, packs=p.packs_per_rank,
                                     efficiency=p.efficiency, imbalance=p.imbalance,
                                     build_rank0_s=build))
        print(f"  budget {budget:>6,}, {world} ranks: planned in {seconds:.3f} s "
              f"({p.packs_per_rank} packs per rank, rows / min {p.efficiency:.4f}, imbalance "
              f"{p.imbalance:.3f}); building rank 0's packs {build:.3f} s")
    for n in (4096, 8192, 16384):  # GRPO: 512-token prompts, 1000-3500-token responses
        rng = np.random.default_rng(5)
        seqs = [np.concatenate((prompt, rng.integers(1, 32000, size=rng.integers(1000, 3501))))
                for prompt in (rng.integers(1, 32000, size=512) for _ in range(n // 8))
                for _ in range(8)]
        seconds, p = best_of(lambda: plan(seqs, max_tokens=4096, world_size=8))
        results["speed"].append(dict(workload=f"grpo{n}", budget=4096, world=8,
                                     seconds=seconds, packs=p.packs_per_rank,
                                     efficiency=p.efficiency, imbalance=p.imbalance))
        print(f"  GRPO {n:,} sequences (512 + 1000-3500 tokens), budget 4,096, 8 ranks: "
              f"{seconds:.3f} s ({p.packs_per_rank} packs per rank, rows / min "
              f"{p.efficiency:.4f}, imbalance {p.imbalance:.3f})")

    # scale: one huge tree cut into many runs (sequences sharing only a BOS, budget 20), and
    # many ranks; the time must grow linearly with the sequences, not with runs x sequences
    rng = np.random.default_rng(7)
    bos = [np.concatenate(([1], rng.integers(2, 32000, size=rng.integers(3, 12))))
           for _ in range(400_000)]
    groups = [np.concatenate((prompt, rng.integers(2, 32000, size=rng.integers(10, 60))))
              for prompt in (rng.integers(2, 32000, size=65) for _ in range(65536 // 8))
              for _ in range(8)]
    plan(bos[:1000], max_tokens=20)  # the first call's one-time costs, outside the timings
    for name, seqs, budget, world in (
            *((f"bos{n // 1000}k", bos[:n], 20, 1) for n in (50_000, 100_000, 200_000, 400_000)),
            ("bos200k", bos[:200_000], 20, 4096), ("bos64k", bos[:65536], 20, 4096),
            ("grpo65-64k", groups, 160, 8), ("grpo65-64k", groups, 160, 4096)):
        seconds, p = best_of(lambda: plan(seqs, max_tokens=budget, world_size=world))
        results["speed"].append(dict(workload=name, budget=budget, world=world,
                                     seconds=seconds, packs=p.packs_per_rank,
                                     efficiency=p.efficiency, imbalance=p.imbalance))
        print(f"  {name}: {len(seqs):,} sequences, budget {budget}, {world} ranks: "
              f"{seconds:.3f} s ({p.packs_per_rank} packs per rank)")
    by = {(r["workload"], r["world"]): r["seconds"] for r in results["speed"]}
    growth = by["bos400k", 1] / by["bos50k", 1]

    ok_rows = all(r["efficiency"] <= 1.05 for r in results["rows"] if r["x_largest"] >= 2)
    ok_bal = all(r["imbalance"] <= 1.1 for r in results["balance"])
    ok_speed = all(r["seconds"] < 1.0 for r in results["speed"]
                   if r["workload"] in ("64k", "bos64k", "grpo65-64k"))
    ok_linear = growth <= 10  # 8x the sequences
    print(f"machine: {platform.machine()}, numpy {np.__version__}")
    print(f"bars: rows <= 1.05 x min at budgets >= 2 x the largest tree "
          f"{'PASS' if ok_rows else 'FAIL'}; imbalance <= 1.1 {'PASS' if ok_bal else 'FAIL'}; "
          f"planning 64k sequences < 1 s at every budget and rank count "
          f"{'PASS' if ok_speed else 'FAIL'}; 8x the sequences in <= 10x the time "
          f"({growth:.1f}x) {'PASS' if ok_linear else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
