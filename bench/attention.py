"""Tree attention on ragged batches vs the same batches with uniform lengths, side by side.

    python bench/attention.py [--backend segment] [--jitter 0.5] [--repeats 3]

For each workload (the RL batches of ``treepack.benchmark.rl_workloads`` at 1/8 scale, plus
16 prompts x 16 rollouts of 64 + 64 tokens, many small chains), one layer's tree attention
forward + backward, float32 on the CPU, at two widths (4 heads of 16: launch-bound; 8 heads
of 64 with 2 key/value heads: the bench model's). Ragged (``--jitter``) and uniform lengths
are built from the same generator, so they hold about the same rows; time is compared per row
and per visible (query, key) pair. ``calls`` is the number of attention calls the backend
makes (for ``segment``: its shape groups after merging).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))

from treepack import TreePack, benchmark  # noqa: E402
from treepack.attention import TreeAttention  # noqa: E402
from treepack.attention.chains import chains  # noqa: E402
from treepack.attention.segment import shape_groups  # noqa: E402
from treepack.synthetic import grpo_batch  # noqa: E402


def batches(jitter: float | None):
    out = {w.name: w.sequences for w in benchmark.rl_workloads(scale=8, jitter=jitter)}
    many = 0.7 if jitter is None else jitter
    out["many_small"] = grpo_batch(groups=16, rollouts=16, prompt_len=64, response_len=64,
                                   jitter=many, seed=4)
    return out


def layer_time(pack, backend, heads, kv_heads, dim, repeats):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, pack.num_rows, dim, generator=g).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    attend = TreeAttention(pack, backend)

    def step():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).sum().backward()

    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="segment")
    parser.add_argument("--jitter", type=float, default=None,
                        help="ragged spread (default: each workload's own)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ragged, uniform = batches(args.jitter), batches(0.0)
    print(f"torch {torch.__version__}, CPU {torch.get_num_threads()} threads, backend "
          f"{args.backend}, forward + backward of one layer, best of {args.repeats}")
    print(f"{'workload':<12}{'width':>8}{'rows u/r':>14}{'calls u/r':>11}{'uniform ms':>12}"
          f"{'ragged ms':>11}{'per row':>9}{'per pair':>10}")
    for name in ragged:
        packs = [TreePack.from_sequences(batch[name], pad_to_multiple_of=128)
                 for batch in (uniform, ragged)]
        for heads, kv_heads, dim in ((4, 2, 16), (8, 2, 64)):
            times = [layer_time(p, args.backend, heads, kv_heads, dim, args.repeats)
                     for p in packs]
            rows = [p.num_packed_rows for p in packs]
            pairs = [p.visible_pairs for p in packs]
            calls = [len(shape_groups(p, None, heads * dim).groups) if args.backend == "segment"
                     else len(chains(p).start) for p in packs]
            per_row = (times[1] / rows[1]) / (times[0] / rows[0])
            per_pair = (times[1] / pairs[1]) / (times[0] / pairs[0])
            print(f"{name:<12}{f'{heads}x{dim}':>8}{f'{rows[0]}/{rows[1]}':>14}"
                  f"{f'{calls[0]}/{calls[1]}':>11}{times[0] * 1e3:>12.1f}{times[1] * 1e3:>11.1f}"
                  f"{per_row:>9.2f}{per_pair:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
