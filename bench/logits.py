"""Log-probs and entropies from packed logits: chunked rows vs plain autograd, side by side.

    python bench/logits.py [--rows 8192] [--vocab 32768] [--dtype bfloat16] [--repeats 2]

Both turn [T', V] logits of a GRPO-shaped pack (one 1024-token prompt, 8 responses filling the
rows) into label-aligned log-probs and entropies and backpropagate a weighted sum into the
logits (what a policy loss with an entropy bonus does after a full-logits forward):

  plain    z = logits.float(); log_softmax(z); gather; entropy from the [T', V] log-probs
           (the formula TreePack.token_logprobs used before treepack.softmax)
  chunked  pack.token_logprobs_and_entropy(logits): treepack.softmax, one pass
"""

from __future__ import annotations

import argparse

import torch

from treepack.benchmark import head_bench_pack, measure, print_paths


def plain(pack, logits):
    """The unchunked formula: every [T', V] intermediate kept by autograd."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    src, tgt = pack.predictions.source, pack.predictions.target
    entropy = -(logp.exp() * logp.masked_fill(logp.isneginf(), 0)).sum(-1)
    return pack.place(logp[src, tgt]), pack.place(entropy[src])


def chunked(pack, logits):
    return pack.token_logprobs_and_entropy(logits)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pack = head_bench_pack(args.rows, args.vocab, device)
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(pack.num_rows, args.vocab, device=device, generator=g) * 2).to(
        getattr(torch, args.dtype)).requires_grad_()
    w = torch.randn(pack.rows.shape, device=device, generator=g)
    results, grads = {}, {}
    for name, fn in (("plain", plain), ("chunked", chunked)):
        def step():
            logits.grad = None
            logp, entropy = fn(pack, logits)
            loss = ((logp + 0.01 * entropy) * w).sum()
            loss.backward()
            return loss.detach()
        results[name] = measure(step, device, repeats=args.repeats)
        grads[name] = logits.grad.float().clone()
    print_paths(results, device, f"T'={pack.num_rows} V={args.vocab}, {args.dtype} logits, "
                "forward + backward of log-probs and entropies")
    p, c = results["plain"], results["chunked"]
    err = ((grads["chunked"] - grads["plain"]).abs().max() / grads["plain"].abs().max()).item()
    print(f"chunked / plain: time {c.seconds / p.seconds:.2f}x, peak memory "
          f"{c.peak_bytes / p.peak_bytes:.3f}x; loss difference {abs(c.loss - p.loss):.1e}, "
          f"largest relative gradient difference {err:.1e}")


if __name__ == "__main__":
    main()
