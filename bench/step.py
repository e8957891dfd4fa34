"""Training-step benchmark on ragged RL batches: padded, padding-free and tree-packed, per
attention backend, side by side in one run.

    python bench/step.py [--device cpu|cuda] [--model qwen2-40m|qwen2.5-0.5b]
                         [--dtype float32|bfloat16] [--backends auto segment ...]
                         [--jitter J] [--scale S] [--repeats R] [--json OUT.json]

Workloads (``treepack.benchmark.rl_workloads``; every length divided by ``--scale``, default 8
on a CPU and 1 on a GPU): GRPO with a long prompt (2 x 8 rollouts, 4096-token prompts,
512-token responses +-50 %), GRPO with little sharing (4 x 8, 512-token prompts, 1536-token
responses +-60 %) and agent trajectories (4 x 8 steps of one 1024-token prompt, 256-token
responses and tool outputs +-30 %).

One step = forward, mean NLL over every original prediction, backward. Compared, per workload:
``padded`` (right-padded micro-batches of 4, SDPA, full logits), ``padding_free`` (every
sequence its own chain in one pack, lean log-probs, the backend under test) and ``tree`` (the
prefix-tree pack, lean log-probs), plus ``tree_logits`` (full logits) with ``--full-logits``.
Beside every time ratio: the FLOP-ratio limit, tree / unpacked FLOPs of the linear layers
(tokens) plus attention (visible pairs), forward + backward. The bar: the tree step within
1.15x of the limit x the padded step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))

from treepack import benchmark  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="qwen2-40m (CPU default) or qwen2.5-0.5b "
                        "(GPU default)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--jitter", type=float, default=None)
    parser.add_argument("--scale", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds after a warm-up round, every step once per round")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--full-logits", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    model = args.model or ("qwen2.5-0.5b" if gpu else "qwen2-40m")
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    scale = args.scale or (1 if gpu else 8)
    works = benchmark.rl_workloads(scale=scale, jitter=args.jitter)
    if args.workloads:
        works = [w for w in works if w.name in args.workloads]
    net = benchmark.bench_model(model, device, dtype)
    where = torch.cuda.get_device_name(device) if gpu else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; torch {torch.__version__}; model: random {model} "
          f"({sum(p.numel() for p in net.parameters()) / 1e6:.1f}M params), {dtype}; "
          f"scale 1/{scale}; medians of {args.repeats} interleaved rounds after a warm-up, "
          f"ratios median [lowest-highest round]")
    print(f"{'workload':<12}{'backend':<9}{'tokens':>8}{'rows':>8}{'padded s':>10}"
          f"{'pad-free s':>11}{'tree s':>9}{'tree/padded':>23}{'FLOP limit':>11}{'/limit':>8}"
          f"{'tree/pad-free':>23}{'loss diff':>10}")
    results = []
    for w in works:
        for backend in args.backends:
            steps = ["padded", "padding_free", "tree"] + (["tree_logits"] if args.full_logits
                                                          else [])
            r = benchmark.compare_step(net, w, backend=backend, repeats=args.repeats,
                                       micro_batch=args.micro_batch, steps=steps)
            r["backend"] = backend
            results.append(r)
            s = r["steps"]
            loss = max(x["loss_rel_error"] for x in s.values())
            print(f"{w.name:<12}{backend:<9}{r['original_tokens']:>8,}{r['packed_rows']:>8,}"
                  f"{s['padded']['seconds']:>10.2f}{s['padding_free']['seconds']:>11.2f}"
                  f"{s['tree']['seconds']:>9.2f}{benchmark.ratio_cell(r, 'tree_vs_padded'):>23}"
                  f"{r['flop_ratio_limit']:>11.3f}{r['over_limit']:>8.2f}"
                  f"{benchmark.ratio_cell(r, 'tree_vs_padding_free'):>23}{loss:>10.1e}",
                  flush=True)
    for line in benchmark.uncertain_note(results):
        print(line.strip())
    ok = all(r["over_limit"] <= 1.15 for r in results)
    print(f"bar: tree step within 1.15x of the FLOP-ratio limit x the padded step: "
          f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=where, torch=torch.__version__, model=model,
                           dtype=str(dtype), scale=scale, results=results), f, indent=2)


if __name__ == "__main__":
    main()
