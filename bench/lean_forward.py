"""A training step's log-probs three ways through a real model, side by side in one run.

    python bench/lean_forward.py [--rows 4096] [--model qwen2-40m] [--repeats 2]

One GRPO-shaped pack (a 1024-token prompt and 8 responses filling the rows) through a random
model (float32 on CPU, bfloat16 on CUDA); forward, log-probs and entropies of every
prediction, a weighted sum, backward:

  logits   hf.forward -> pack.token_logprobs_and_entropy(logits)   ([T', V] logits)
  hidden   hf.forward_hidden -> logprobs_and_entropy_from_hidden(**hf.lm_head(model))
  inside   hf.forward_lean: the lean head inside the model's forward (what verl_lean runs)
"""

from __future__ import annotations

import argparse

import torch

import treepack
from treepack import hf
from treepack.benchmark import bench_model, head_bench_pack, measure, print_paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--model", default="qwen2-40m")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = bench_model(args.model, device, dtype)
    vocab = model.config.vocab_size
    pack = head_bench_pack(args.rows, vocab, device)
    w = torch.randn(pack.rows.shape, device=device, generator=torch.Generator(device=device)
                    .manual_seed(0))

    def logits():
        return pack.token_logprobs_and_entropy(hf.forward(model, pack).logits[0])

    def hidden():
        h = hf.forward_hidden(model, pack).last_hidden_state[0]
        return treepack.logprobs_and_entropy_from_hidden(pack, h, **hf.lm_head(model))

    def inside():
        rows = hf.forward_lean(model, pack, with_entropy=True)
        child = pack.rows.reshape(-1)[pack.predictions.index]  # each predicted token's row
        return (pack.place(rows.logprobs[child]),
                pack.place(rows.entropy[pack.predictions.source]))

    results, grads = {}, {}
    for name, fn in (("logits", logits), ("hidden", hidden), ("inside", inside)):
        def step():
            model.zero_grad(set_to_none=True)
            logp, entropy = fn()
            loss = ((logp + 0.01 * entropy) * w).sum()
            loss.backward()
            return loss.detach()
        results[name] = measure(step, device, repeats=args.repeats)
        grads[name] = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
    print_paths(results, device, f"{args.model}, T'={pack.num_rows}, V={vocab}, {dtype}, one "
                "step's forward + log-probs + entropies + backward")
    base = results["logits"]
    for name in ("hidden", "inside"):
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(grads[name], grads["logits"]))
        r = results[name]
        print(f"{name} / logits: time {r.seconds / base.seconds:.2f}x, peak memory "
              f"{r.peak_bytes / base.peak_bytes:.3f}x; largest relative gradient difference "
              f"{err:.1e}")


if __name__ == "__main__":
    main()
