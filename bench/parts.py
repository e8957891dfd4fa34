"""Trees larger than one forward: parts (every row once) against today's split-and-repeat
plan, padding-free packing and the whole tree in one pack, side by side in one run.

    python bench/parts.py [--device cpu|cuda] [--model qwen2-40m] [--scale S] [--repeats R]
                          [--json OUT.json]

Workloads (every length divided by ``--scale``, default 8 on a CPU, 1 on a GPU):

- ``long_prompt``: a GRPO group, an 8,192-token prompt and 16 responses of 2,048-4,096
  tokens, at a budget of 16,384 tokens a forward (the prompt is half the budget);
- ``agent``: an agent trajectory of 8 steps over one 4,096-token prompt, each step adding a
  1,024-token turn (+-30 %) and ending with a 512-token answer, at 8,192 tokens a forward (the
  last steps are longer than the budget);
- ``long_trajectory``: 16 steps of 1,024-token turns (+-30 %) over a 4,096-token prompt, each
  ending with a 256-token answer, at 4,096 tokens a forward: a chain of trunk parts, each
  with its step's answer hanging off it (what ``recompute`` is for).

Steps, each forward + backward of a mean NLL over every original prediction:

- ``whole``: one pack of the whole tree, no budget (the limit: the same rows and pairs);
- ``parts``: ``treepack.hf.backward_in_parts`` within the budget (``recompute="auto"``: a
  chain of trunk parts runs each one's forward again before its backward);
- ``parts_kept``: the same, every part's activations kept until its backward
  (``recompute=False``);
- ``split``: ``treepack.plan`` within the budget, one pack after another, every pack
  repeating the prefix above its cut (where plan runs: it refuses a sequence longer than
  the budget);
- ``padding_free``: every sequence its own chain, greedy packs within the budget (a sequence
  longer than it alone).

Printed: rows computed, and per step the median of interleaved per-round time ratios with
their range, and peak memory. The bar (issue 19): ``parts`` computes the tree's rows and runs
within 1.15x of ``whole``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))

from treepack import hf  # noqa: E402
from treepack.face.benchmark.memory import peak_memory  # noqa: E402
from treepack.face.benchmark.steps import bench_model, padding_free_packs  # noqa: E402
from treepack.face.benchmark.timing import Spread, interleave, ratio, synced  # noqa: E402
from treepack.planner import plan  # noqa: E402
from treepack.tree import TreePack  # noqa: E402


def workloads(scale: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(3, 30000, max(1, int(n) // scale)).tolist()

    prompt = tokens(8192)
    grpo = [prompt + tokens(rng.integers(2048, 4097)) for _ in range(16)]
    history, agent = tokens(4096), []
    for _ in range(8):
        history = history + tokens(1024 * rng.uniform(0.7, 1.3))
        agent.append(history + tokens(512 * rng.uniform(0.7, 1.3)))
    history, trajectory = tokens(4096), []
    for _ in range(16):
        history = history + tokens(1024 * rng.uniform(0.7, 1.3))
        trajectory.append(history + tokens(256 * rng.uniform(0.7, 1.3)))
    return {"long_prompt": (grpo, 16384 // scale), "agent": (agent, 8192 // scale),
            "long_trajectory": (trajectory, 4096 // scale)}


def nll(out, mask, count):
    return -(out.logprobs.where(mask, 0)).sum() / count


def steps_for(model, seqs, budget):
    device = next(model.parameters()).device
    whole = TreePack.from_sequences(seqs, device=device)
    count = whole.num_predictions

    def run_pack(pack):
        out = hf.logprobs(model, pack, head="hidden")
        loss = nll(out, pack.prediction_mask, count)
        loss.backward()
        return loss.detach()

    try:
        split_packs = plan(seqs, max_tokens=budget, device=device).packs(0)
    except ValueError:  # a sequence longer than the budget: plan never splits a sequence
        split_packs = None
    free = padding_free_packs(seqs, budget, device=device)

    def many(packs):
        def step():
            model.zero_grad(set_to_none=True)
            return sum(run_pack(p) for p in packs)
        return step

    def parts(recompute):
        def step():
            model.zero_grad(set_to_none=True)
            return hf.backward_in_parts(model, seqs, lambda out, mask: nll(out, mask, count),
                                        max_tokens=budget, recompute=recompute).loss
        return step

    steps = {"whole": many([whole]), "parts": parts("auto"), "parts_kept": parts(False),
             "padding_free": many(free)}
    rows = {"whole": whole.num_packed_rows, "parts": whole.num_packed_rows,
            "parts_kept": whole.num_packed_rows,
            "padding_free": sum(p.num_packed_rows for p in free)}
    if split_packs is not None:
        steps["split"] = many(split_packs)
        rows["split"] = sum(p.num_packed_rows for p in split_packs)
    return steps, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="qwen2-40m")
    parser.add_argument("--scale", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 8)
    model = bench_model(args.model, device,
                        torch.bfloat16 if device.type == "cuda" else torch.float32)
    result = {"model": args.model, "device": str(device), "scale": scale, "workloads": {}}
    for name, (seqs, budget) in workloads(scale).items():
        if args.workloads and name not in args.workloads:
            continue
        steps, rows = steps_for(model, seqs, budget)
        steps = {k: synced(v, device) for k, v in steps.items()}
        losses = {k: float(v()) for k, v in steps.items()}  # warm-up, and the same loss
        peaks: dict = {k: [] for k in steps}
        times = interleave(steps, args.repeats,
                           around=lambda k: peak_memory(device, peaks[k]))
        work = {"budget": budget, "sequences": len(seqs), "rows": rows, "loss": losses,
                "peak_mib": {k: min(v) / 2**20 for k, v in peaks.items()}}
        others = [k for k in ("whole", "parts_kept", "split", "padding_free") if k in steps]
        for other in others:
            work[f"parts/{other}"] = ratio(times, "parts", other)._asdict()
        result["workloads"][name] = work
        print(f"{name}: {len(seqs)} sequences, budget {budget}; rows "
              + ", ".join(f"{k} {v}" for k, v in rows.items()))
        if "split" not in steps:
            print("  split: treepack.plan refuses (a sequence is longer than the budget)")
        for other in others:
            s = Spread(**work[f"parts/{other}"])
            print(f"  parts / {other:13s} {s.median:.3f}  [{s.low:.3f}, {s.high:.3f}]")
        print("  peak MiB " + ", ".join(f"{k} {v:.0f}" for k, v in work["peak_mib"].items()))
        print("  loss " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
