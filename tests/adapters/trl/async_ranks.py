"""TRL's asynchronous GRPO trainer on every process of an ``accelerate launch`` (CPU, gloo),
for tests/adapters/trl/test_trl_async.py: stock ``AsyncGRPOTrainer`` and
``TreepackAsyncGRPOTrainer`` trained one after the other from the same checkpoint on the same
scripted rollouts, with each planner (PLANNERS: JSON of AsyncGRPOConfig fields per run). Rank
0 saves each run (async_workers.Run: logged losses, gradient norms, metrics, weights) to OUT.

    accelerate launch --multi_gpu --num_processes 2 tests/adapters/trl/async_ranks.py \\
        MODEL_DIR OUT PLANNERS
"""

import json
import sys

import torch
from accelerate import PartialState

import async_workers
from treepack.adapters.trl import compat
from treepack.trl import TreepackAsyncGRPOTrainer


def main(model_dir, out, planners):
    state = PartialState()
    stock, _ = compat.async_grpo()
    runs = {}
    for name, fields in planners.items():
        for mode, cls in (("stock", stock), ("packed", TreepackAsyncGRPOTrainer)):
            run = async_workers.train(cls, model_dir, f"{out}.{mode}.{name}", **fields)
            runs[mode, name] = run
    if state.is_main_process:
        torch.save({"runs": runs, "processes": state.num_processes}, out)
    state.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
