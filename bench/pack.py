"""Pack-building benchmark: treepack vs a naive packer, side by side in one run.

    python bench/pack.py [--repeats 5] [--json OUT.json]

Workloads (built-in, deterministic):
  grpo   8 groups x 8 rollouts, 2048-token prompts, 1024-token responses (196,608 tokens)
  agent  8 prompts x 8 trajectories x 8 steps, 1024-token prompts, 256-token responses,
         128-token tool outputs (1,343,488 tokens)

treepack: ``TreePack.from_sequences`` + ``block_mask(128)`` over the whole batch as one forest.
naive: what the known implementations do: a token-at-a-time dict trie, compressed, DFS
positions, a dense T x T mask filled node by node, and ``create_block_mask`` reading the
dense mask. A dense mask of the whole forest would need T^2 bytes (6.7 GB for grpo), so the
naive packer builds one tree per prompt group, as Claw-R1 does; that only flatters it.

Also measured: the extra peak memory (kernel high-water mark of the process's resident set)
of ``block_mask`` on a 65,536-row GRPO pack, in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import numpy as np
import torch

from treepack import TreePack
from treepack.benchmark import best_of
from treepack.synthetic import agent_batch, grpo_batch

WORKLOADS = {
    "grpo": lambda: grpo_batch(groups=8, rollouts=8, prompt_len=2048, response_len=1024),
    "agent": lambda: agent_batch(prompts=8, trajectories=8, steps=8, prompt_len=1024,
                                 response_len=256, tool_len=128),
}
GROUP_SIZE = {"grpo": 8, "agent": 64}  # sequences per prompt group, for the naive packer


def naive_pack(seqs):
    """Dict trie token by token, compressed nodes, DFS order, dense mask, BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    children, token = [{}], [-1]
    for seq in seqs:
        node = 0
        for tok in seq.tolist():
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(token)
                children[node][tok] = nxt
                children.append({})
                token.append(tok)
            node = nxt
    # DFS pre-order, compressing single-child chains into nodes of row ranges.
    ids, pos, nodes = [], [], []  # nodes: (start, end, ancestor row ranges)
    stack = [(c, 0, []) for c in reversed(list(children[0].values()))]
    while stack:
        node, depth, anc = stack.pop()
        start = len(ids)
        while True:
            ids.append(token[node])
            pos.append(depth)
            depth += 1
            if len(children[node]) != 1:
                break
            node = next(iter(children[node].values()))
        nodes.append((start, len(ids), anc))
        path = anc + [(start, len(ids))]
        for c in reversed(list(children[node].values())):
            stack.append((c, depth, path))
    T = len(ids)
    dense = torch.zeros(T, T, dtype=torch.bool)
    for start, end, anc in nodes:
        for a, b in anc:
            dense[start:end, a:b] = True
        dense[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    bm = create_block_mask(lambda b, h, q, kv: dense[q, kv], None, None, T, T, device="cpu")
    return torch.tensor(ids), torch.tensor(pos), bm


def bench_workload(name, repeats):
    seqs = WORKLOADS[name]()
    tokens = sum(len(s) for s in seqs)
    t_build, pack = best_of(lambda: TreePack.from_sequences(seqs), repeats)
    t_mask, _ = best_of(lambda: pack.block_mask(128), repeats)
    g = GROUP_SIZE[name]
    t_naive, naive = best_of(
        lambda: [naive_pack(seqs[i:i + g]) for i in range(0, len(seqs), g)], 1
    )
    naive_rows = sum(ids.shape[0] for ids, _, _ in naive)
    assert naive_rows == pack.num_packed_rows, (naive_rows, pack.num_packed_rows)
    ours = t_build + t_mask
    return {
        "workload": name,
        "sequences": len(seqs),
        "tokens": tokens,
        "rows": pack.num_packed_rows,
        "token_ratio": pack.token_ratio,
        "build_ms": t_build * 1e3,
        "block_mask_ms": t_mask * 1e3,
        "treepack_mtok_per_s": tokens / ours / 1e6,
        "naive_ms": t_naive * 1e3,
        "naive_mtok_per_s": tokens / t_naive / 1e6,
        "speedup_vs_naive": t_naive / ours,
    }


MEMORY_PROBE = """
import json
from treepack import TreePack
from treepack.synthetic import grpo_batch
# 8 groups x (1024-token prompt + 8 x 896-token responses) = 65,536 rows
pack = TreePack.from_sequences(grpo_batch(groups=8, rollouts=8, prompt_len=1024, response_len=896))
assert pack.num_rows == 65536
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
pack.block_mask(128)  # warm up lazy imports
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
bm = pack.block_mask(128)
peak = rss("VmHWM:")
print(json.dumps({"rows": pack.num_rows, "extra_peak_mb": (peak - before) / 2**20,
                  "block_tables_mb": sum(t.numel() * t.element_size() for t in bm.as_tuple()
                                         if isinstance(t, __import__("torch").Tensor)) / 2**20}))
"""


def bench_memory():
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = [bench_workload(name, args.repeats) for name in WORKLOADS]
    memory = bench_memory()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, numpy {np.__version__}")
    head = (f"{'workload':<8}{'tokens':>11}{'rows':>9}{'ratio':>7}{'build ms':>10}"
            f"{'mask ms':>9}{'Mtok/s':>8}{'naive ms':>10}{'naive Mtok/s':>13}{'speedup':>9}")
    print(head)
    for r in results:
        print(f"{r['workload']:<8}{r['tokens']:>11,}{r['rows']:>9,}{r['token_ratio']:>7.3f}"
              f"{r['build_ms']:>10.2f}{r['block_mask_ms']:>9.2f}{r['treepack_mtok_per_s']:>8.1f}"
              f"{r['naive_ms']:>10.0f}{r['naive_mtok_per_s']:>13.2f}{r['speedup_vs_naive']:>8.0f}x")
    print(f"block_mask of a {memory['rows']:,}-row pack: extra peak {memory['extra_peak_mb']:.1f} MB "
          f"(its tables: {memory['block_tables_mb']:.1f} MB; a dense T x T bool would be "
          f"{memory['rows'] ** 2 / 2**20:,.0f} MB)")
    ok_speed = all(r["treepack_mtok_per_s"] >= 10 for r in results)
    ok_mem = memory["extra_peak_mb"] < 100
    print(f"bars: >= 10 M tokens/s {'PASS' if ok_speed else 'FAIL'}; "
          f"< 100 MB extra peak {'PASS' if ok_mem else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workloads": results, "memory": memory}, f, indent=2)


if __name__ == "__main__":
    main()
