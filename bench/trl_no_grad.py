"""TRL's no-grad log-prob passes (old and reference log-probs): stock vs treepack, side by side.

    python bench/trl_no_grad.py [--prompts 8] [--generations 8] [--batch-size 8] [--repeats 2]

GRPOTrainer scores a whole generation batch (``per_device_train_batch_size x
steps_per_generation`` rows) without gradients, in chunks of ``batch_size`` rows, through
``_get_per_token_logps_and_entropies``. This times that call and measures its peak memory on
the same batch, through a real trainer each (a Qwen2-like 40M model, float32): stock TRL, and
``treepack.trl.patch`` (packs of at most one chunk's tokens: ``batch_size`` x the padded
width). Rows: GRPO groups, a 256-token prompt each, ragged completions of 32-256 tokens,
left-padded prompts and right-padded completions as TRL builds them.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import treepack.trl
from treepack import zoo
from treepack.benchmark import measure, print_paths


def trl_batch(prompts: int, generations: int, vocab: int, seed: int = 0):
    """``(input_ids, attention_mask, logits_to_keep)`` shaped as TRL's generation batch."""
    rng = np.random.default_rng(seed)
    rows, prompt_len = [], 256
    for _ in range(prompts):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        rows += [(prompt, rng.integers(3, vocab, rng.integers(32, 257)).tolist())
                 for _ in range(generations)]
    keep = max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), prompt_len + keep, dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        ids[r, :prompt_len] = torch.tensor(p)
        ids[r, prompt_len:prompt_len + len(c)] = torch.tensor(c)
    return ids, (ids != 0).long(), keep


def trainer(model, out_dir: str) -> GRPOTrainer:
    """A GRPOTrainer as users build one (it never generates here: only its seam is called)."""
    words = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, "a": 2}, unk_token="a"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                        eos_token="<eos>")
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=8,
                      max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                      bf16=False)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        processing_class=tokenizer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_config(zoo.MODELS["qwen2-40m"](),
                                             attn_implementation="sdpa").eval()
    ids, mask, keep = trl_batch(args.prompts, args.generations, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as out:
        stock = trainer(model, out)
        packed = treepack.trl.patch(trainer(model, out))
    results, outputs = {}, {}
    for name, t in (("stock TRL", stock), ("treepack", packed)):
        def step(t=t, name=name):
            logps = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep,
                                                         batch_size=args.batch_size)[0]
            outputs[name] = logps
            return logps.sum()
        results[name] = measure(step, torch.device("cpu"), repeats=args.repeats)
    tokens = int(mask.sum())
    rows = treepack.TreePack.from_sequences([i[m.bool()] for i, m in zip(ids, mask)])
    print_paths(results, torch.device("cpu"),
                f"{len(ids)} rows ({args.prompts} prompts x {args.generations}), {tokens} "
                f"tokens, token ratio {rows.num_packed_rows / tokens:.3f}; TRL's chunks of "
                f"{args.batch_size} rows")
    error = float((outputs["treepack"] - outputs["stock TRL"]).abs().max())
    ratio_time = results["treepack"].seconds / results["stock TRL"].seconds
    ratio_peak = results["treepack"].peak_bytes / max(results["stock TRL"].peak_bytes, 1)
    print(f"treepack / stock: time {ratio_time:.2f}x, peak memory {ratio_peak:.2f}x; "
          f"max |log-prob difference| {error:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: m._asdict() for name, m in results.items()} |
                      {"time_ratio": ratio_time, "peak_ratio": ratio_peak, "error": error},
                      f, indent=2)


if __name__ == "__main__":
    main()
