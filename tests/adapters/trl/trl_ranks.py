"""One TRL GRPO run on every process of an ``accelerate launch`` (CPU, gloo), for
tests/adapters/test_trl.py: stock ``GRPOTrainer`` or ``TreepackGRPOTrainer`` from the same checkpoint
and seed. Rank 0 saves the weights after training, the training history and, per process,
the prompts, packed rows and tokens of every training micro-batch (to OUT.0, OUT.1, ...).
CONFIG (optional) is JSON of further GRPOConfig fields.

    accelerate launch --multi_gpu --num_processes 2 tests/trl_ranks.py MODE MODEL_DIR OUT \\
        PER_DEVICE_BATCH GRADIENT_ACCUMULATION [CONFIG]
"""

import json
import sys
import warnings

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import treepack.trl
from treepack.adapters.trl import seam


def main(mode, model_dir, out, per_device, accumulation, config):
    state = PartialState()
    dataset = Dataset.from_dict({"prompt": ["w5 w6 w7 w8 w9", "w10 w11 w12", "w13 w14 w15 w16",
                                            "w5 w6 w7", "w20 w21", "w22 w23 w24 w25 w26 w27",
                                            "w30 w31 w32", "w33"] * 2})

    def reward(completions, **kw):
        return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]

    args = GRPOConfig(**dict(output_dir=out + ".run", per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accumulation, num_generations=4,
                             max_completion_length=6, max_steps=2, report_to="none",
                             save_strategy="no", use_cpu=True, bf16=False, temperature=0.7, seed=0,
                             learning_rate=0.1, optim="sgd", beta=0.04, logging_steps=1) | config)
    cls = treepack.trl.TreepackGRPOTrainer if mode == "packed" else GRPOTrainer
    micro_batches = []
    real = seam._packed_forwards

    def recording(model, input_ids, attention_mask, logits_to_keep, **kw):
        out = real(model, input_ids, attention_mask, logits_to_keep, **kw)
        if torch.is_grad_enabled():
            width = input_ids.shape[1] - logits_to_keep
            prompts = sorted({tuple(p[m.bool()].tolist()) for p, m in
                              zip(input_ids[:, :width], attention_mask[:, :width])})
            micro_batches.append((prompts, sum(p.num_packed_rows for p in out[3]),
                                  sum(p.num_original_tokens for p in out[3])))
        return out

    seam._packed_forwards = recording
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = cls(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                      processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))
    torch.manual_seed(0)
    trainer.train()
    # Each process writes its own micro-batches, no collective after training: gloo's
    # allgather work, freed on its own thread, takes the GIL and deadlocks (or aborts) the
    # group's teardown at exit (torch 2.13).
    torch.save(micro_batches, f"{out}.{state.process_index}")
    if state.is_main_process:
        torch.save({"params": {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
                    "history": trainer.state.log_history,
                    "warnings": [str(w.message) for w in said if "treepack" in str(w.message)],
                    "processes": state.num_processes}, out)
    state.wait_for_everyone()
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    mode, model_dir, out, per_device, accumulation = sys.argv[1:6]
    main(mode, model_dir, out, int(per_device), int(accumulation),
         json.loads(sys.argv[6]) if len(sys.argv) > 6 else {})
