"""Measuring a training step packed vs unpacked: FLOP model, timing, peak memory, workloads,
report. Used by ``treepack bench`` and the scripts in ``bench/``.

- :mod:`.flops`: what a step costs in arithmetic; the FLOP-ratio limit.
- :mod:`.timing`: steps interleaved round by round, ratios as medians with spread; best-of.
- :mod:`.memory`: peak memory of one call (CUDA allocator, or the resident set via /proc).
- :mod:`.steps`: the compared steps (padded, padding-free, tree) and the random model.
- :mod:`.workloads`: the ragged RL batches, Claw-R1's scenarios, the log-prob bench pack.
- :mod:`.compare`: :func:`compare_step` and :func:`run_bench`, the side-by-side runs.
- :mod:`.report`: the printed table and the plot.
- :mod:`.e2e`: ``treepack bench --e2e``, whole GRPO runs through TRL, stock and treepack;
  :mod:`.e2e_report` what they show, printed and drawn; :mod:`.turns` two runs in two
  processes taking their steps in turn.
- :mod:`.precision`: float64 all the way through (the e2e bench's float64 runs, the tests).

Every name is importable from here (``treepack.benchmark.rl_workloads``).
"""

from treepack.face.benchmark.compare import compare_step, run_bench
from treepack.face.benchmark.e2e import E2E_WORKLOADS, plot_e2e, render_e2e, run_e2e
from treepack.face.benchmark.flops import Flops, step_flops
from treepack.face.benchmark.memory import peak_memory
from treepack.face.benchmark.report import plot, print_paths, ratio_cell, render, uncertain_note
from treepack.face.benchmark.steps import STEPS, bench_model, packed_step, unpacked_step
from treepack.face.benchmark.timing import (Measurement, Spread, best_of, interleave, measure,
                                            ratio, synced)
from treepack.face.benchmark.workloads import (CLAW_R1, Workload, claw_r1_scenarios,
                                               custom_workload, head_bench_pack, rl_workloads)

__all__ = ["Flops", "step_flops", "best_of", "Spread", "interleave", "ratio", "synced",
           "Measurement", "measure", "peak_memory", "unpacked_step", "packed_step", "STEPS",
           "bench_model", "Workload", "rl_workloads", "custom_workload", "CLAW_R1",
           "claw_r1_scenarios", "head_bench_pack", "compare_step", "run_bench", "render",
           "ratio_cell", "uncertain_note", "plot", "print_paths", "run_e2e", "render_e2e",
           "plot_e2e", "E2E_WORKLOADS"]
