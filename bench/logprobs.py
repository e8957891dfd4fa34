"""Lean log-probs from hidden states vs the full-logits path, side by side in one run.

    python bench/logprobs.py [--rows 8192] [--hidden 256] [--vocab 32768] [--repeats 3]

Both compute label-aligned log-probs of a GRPO-shaped pack (one 1024-token prompt, 8 responses
filling the rows) and backpropagate a weighted sum into the hidden states and the LM head
weight (float32, CPU or GPU):

  full   logits = hidden @ weight.T  ([T', V]), then pack.token_logprobs(logits)
  lean   treepack.logprobs_from_hidden(pack, hidden, weight): [chunk, V] at a time
"""

from __future__ import annotations

import argparse
import json

import torch

import treepack
from treepack.benchmark import head_bench_pack, measure, print_paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pack = head_bench_pack(args.rows, args.vocab, device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device=device, generator=g, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=g) * 0.05
              ).requires_grad_()
    w = torch.randn(pack.rows.shape, device=device, generator=g)

    def full():
        hidden.grad = weight.grad = None
        loss = (pack.token_logprobs(hidden @ weight.T) * w).sum()
        loss.backward()
        return loss.detach()

    def lean():
        hidden.grad = weight.grad = None
        logps = treepack.logprobs_from_hidden(pack, hidden, weight, chunk_size=args.chunk_size)
        loss = (logps * w).sum()
        loss.backward()
        return loss.detach()

    results = {}
    grads = {}
    for name, step in (("full", full), ("lean", lean)):
        results[name] = measure(step, device, repeats=args.repeats)
        grads[name] = (hidden.grad.clone(), weight.grad.clone())
    err = max((a - b).abs().max().item() / b.abs().max().item()
              for a, b in zip(grads["lean"], grads["full"]))
    f, l = results["full"], results["lean"]
    print_paths(results, device, f"T'={args.rows} H={args.hidden} V={args.vocab}, float32, "
                "forward + backward")
    mem, time = l.peak_bytes / f.peak_bytes, l.seconds / f.seconds
    print(f"lean / full: time {time:.2f}x, peak memory {mem:.3f}x; max relative gradient "
          f"difference {err:.1e}; loss difference {abs(l.loss - f.loss):.1e}")
    print(f"bars: memory <= 1/8 {'PASS' if mem <= 1 / 8 else 'FAIL'}; time <= 1.3x "
          f"{'PASS' if time <= 1.3 else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"full": f._asdict(), "lean": l._asdict(), "time_ratio": time,
                       "memory_ratio": mem, "grad_rel_diff": err}, fh, indent=2)


if __name__ == "__main__":
    main()
