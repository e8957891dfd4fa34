"""Training-step benchmark: unpacked vs packed with each attention backend, side by side.

    python bench/step.py [--repeats 2] [--quick] [--json OUT.json]

Model: a random Qwen2-like model of ~39M parameters (8 layers, hidden 512, GQA 8/2, vocabulary
32000, tied embedding). Workloads:
  grpo   8 rollouts of one 1024-token prompt, 256-token responses
  agent  2 trajectories x 4 steps of one 1024-token prompt, 128-token responses, 128-token
         tool outputs (each step repeats the whole history)

One step = forward, mean NLL over every original prediction, backward. Unpacked: right-padded
micro-batches of similar lengths, SDPA causal with the padding mask. Packed: one TreePack,
``treepack.hf.forward`` with each backend that can train here (flex needs a GPU for
backward). Beside every time ratio: the FLOP-ratio limit, packed / unpacked FLOPs of the linear
layers (tokens) plus attention (visible pairs), forward + backward.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from treepack import TreePack, zoo
from treepack.benchmark import measure, packed_step, step_flops, unpacked_step
from treepack.synthetic import agent_batch, grpo_batch


def workloads(quick: bool):
    scale = 4 if quick else 1
    return {
        "grpo": grpo_batch(groups=1, rollouts=8, prompt_len=1024 // scale,
                           response_len=256 // scale, seed=0),
        "agent": agent_batch(prompts=1, trajectories=2, steps=4, prompt_len=1024 // scale,
                             response_len=128 // scale, tool_len=128 // scale, seed=1),
    }


def run(name, seqs, model, device, backends, repeats, micro_batch):
    seqs = [torch.as_tensor(s) for s in seqs]
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
    unpacked_tokens = pack.num_original_tokens
    unpacked_pairs = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    packed_pairs = int((pack.position_ids[: pack.num_tokens] + 1).sum())
    flops_unpacked = step_flops(model, unpacked_tokens, unpacked_pairs)
    flops_packed = step_flops(model, pack.num_rows, packed_pairs)
    limit = flops_packed.total / flops_unpacked.total

    base = measure(unpacked_step(model, seqs, micro_batch), device, repeats)
    rows = []
    for backend in backends:
        m = measure(packed_step(model, pack, backend), device, repeats)
        rows.append({
            "workload": name, "backend": backend,
            "unpacked_s": base.seconds, "packed_s": m.seconds,
            "time_ratio": m.seconds / base.seconds,
            "flop_ratio_limit": limit,
            "time_over_limit": m.seconds / base.seconds / limit,
            "unpacked_peak_mb": base.peak_bytes / 2**20, "packed_peak_mb": m.peak_bytes / 2**20,
            "memory_ratio": m.peak_bytes / max(base.peak_bytes, 1),
            "loss_rel_diff": abs(m.loss - base.loss) / abs(base.loss),
            "sequences": len(seqs), "tokens": unpacked_tokens, "rows": pack.num_tokens,
            "token_ratio": pack.token_ratio,
        })
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="4x shorter sequences")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["segment", "flex", "dense"] if device.type == "cuda" else ["segment", "dense"]
    torch.manual_seed(0)
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(zoo.qwen2_40m_config()).to(device)
    results = []
    for name, seqs in workloads(args.quick).items():
        results += run(name, seqs, model, device, backends, args.repeats, args.micro_batch)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; torch {torch.__version__}; model: Qwen2-like "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
    print(f"{'workload':<8}{'backend':<9}{'tokens':>8}{'rows':>7}{'unpacked s':>11}"
          f"{'packed s':>10}{'time ratio':>11}{'FLOP limit':>11}{'/limit':>8}"
          f"{'mem ratio':>10}{'loss diff':>10}")
    for r in results:
        print(f"{r['workload']:<8}{r['backend']:<9}{r['tokens']:>8,}{r['rows']:>7,}"
              f"{r['unpacked_s']:>11.2f}{r['packed_s']:>10.2f}{r['time_ratio']:>11.3f}"
              f"{r['flop_ratio_limit']:>11.3f}{r['time_over_limit']:>8.2f}"
              f"{r['memory_ratio']:>10.2f}{r['loss_rel_diff']:>10.1e}")
    seg = [r for r in results if r["backend"] == "segment"]
    ok = all(r["time_over_limit"] <= 1.15 for r in seg)
    print(f"bar: segment time ratio within 1.15x of the FLOP-ratio limit: "
          f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
