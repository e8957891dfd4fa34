"""megatron-core on a tree: step time, activation memory per rank and the context-parallel
exchange of a GPTModel on the ragged RL workloads, tree vs padding-free vs padded, at TP = 1,
TP = 2 and CP = 2, in one run (gloo on this CPU).

    python bench/megatron.py            # lengths / 16 (the workloads of treepack bench)
    python bench/megatron.py --quick    # lengths / 64, one round: a CPU check

Runs where megatron-core is installed (``pip install -e ".[test-megatron]"``, the
environment ``.ci/run`` makes); megatron-core's CUDA assumptions are stood in for as the tests
do (``tests/megatron_cpu.py``).

Each layout runs in fresh processes holding the same random model (float32: hidden 256,
2 layers, 8 query / 2 key-value heads of 32, intermediate 512, vocabulary 4,096, rope).
Steps, one training step each (forward, mean NLL over every original prediction, backward):

- ``tree``: ``treepack.megatron.logprobs`` on ``TreePack.from_sequences`` (one pack);
- ``padding_free``: the same on ``TreePack.from_sequences(..., share_prefixes=False)``: every
  sequence its own chain, the same kernels, nothing shared (THD packing without
  TransformerEngine, which does not run on a CPU);
- ``padded``: Megatron's own path, a right-padded ``[B, L]`` batch with a causal mask through
  the stock core attention and full vocabulary-parallel logits (its loss on a copy of them,
  as ``vocab_parallel_cross_entropy`` changes its input); Megatron's local attention refuses
  context parallelism, so not at CP = 2.

Per layout and workload: the median step time over ``--repeats`` interleaved rounds on the
slowest rank, the ratios round by round; the bytes each rank saves for its backward during
the forward (the rank that holds the most); and at CP = 2 the bytes each attention layer's
forward hands the all-to-all per rank, against the formula ``(h + 2 k' + h) · d · w`` elements
(``h`` query heads and ``k' = lcm(k, CP)`` key/value heads of the TP rank, ``w`` rows per CP
rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# this file is megatron.py: its own folder off the path, or `import megatron` finds it
sys.path[:] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")] + [
    p for p in sys.path if os.path.abspath(p or ".") != HERE]

from treepack import TreePack  # noqa: E402
from treepack.face.benchmark.memory import saved_storages  # noqa: E402
from treepack.face.benchmark.timing import Spread, interleave  # noqa: E402
from treepack.face.benchmark.traffic import Traffic  # noqa: E402
from treepack.face.benchmark.workloads import rl_workloads  # noqa: E402

VOCAB = 4096
MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
             kv_channels=32, ffn_hidden_size=512)
LAYOUTS = {"TP=1": dict(tp=1, cp=1), "TP=2": dict(tp=2, cp=1), "CP=2": dict(tp=1, cp=2)}
STEPS = ("tree", "padding_free", "padded")


def build(tp: int, cp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import treepack.megatron as tm

    config = TransformerConfig(
        **MODEL, use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        context_parallel_size=cp)
    spec = tm.layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=1 << 16,
                     position_embedding_type="rope")
    return tm.prepare(model)


def tree_step(model, pack: TreePack):
    import treepack.megatron as tm

    mask, count = pack.prediction_mask, pack.num_predictions

    def forward():
        return -tm.logprobs(model, pack).logprobs.where(mask, 0).sum() / count

    return forward


def padded_step(model, sequences: list):
    """Megatron's own step on a right-padded batch: full logits, its loss on a copy."""
    from megatron.core import tensor_parallel

    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    real = torch.zeros(len(sequences), width, dtype=torch.bool)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq)], real[b, :len(seq)] = torch.as_tensor(seq), True
    positions = torch.arange(width).expand(len(sequences), -1)
    i = torch.arange(width)
    causal = (i[None, :] > i[:, None])[None, None]
    labels = torch.roll(ids, -1, 1)
    predicted = real & torch.roll(real, -1, 1)
    predicted[:, -1] = False
    count = int(predicted.sum())

    def forward():
        logits = model(ids, positions, causal)  # [B, L, V / tp]
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels)
        return nll.where(predicted, 0).sum() / count

    return forward


def formula_bytes(rows: int, cp: int, tp: int, itemsize: int) -> int:
    """What a CP rank hands the all-to-all per attention layer in the forward: q, k and v of
    its rows out, ``(h + 2 k') d w`` elements, the output back, ``h d w`` (module doc)."""
    if cp == 1:
        return 0
    h, k = MODEL["num_attention_heads"] // tp, MODEL["num_query_groups"] // tp
    d, w = MODEL["kv_channels"], -(-rows // cp)
    return (h + 2 * math.lcm(k, cp) + h) * d * w * itemsize


def worker(rank: int, world: int, port: int, config: dict) -> None:
    import megatron_cpu
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    torch.set_num_threads(config["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    megatron_cpu.install()
    layout = LAYOUTS[config["layout"]]
    ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"],
                                 context_parallel_size=layout["cp"])
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        torch.manual_seed(0)
        model = build(layout["tp"], layout["cp"])
        out = {}
        for w in rl_workloads(scale=config["scale"], vocab=VOCAB):
            seqs = [list(map(int, s)) for s in w.sequences]
            packs = {"tree": TreePack.from_sequences(seqs),
                     "padding_free": TreePack.from_sequences(seqs, share_prefixes=False)}
            steps = {name: tree_step(model, pack) for name, pack in packs.items()}
            if layout["cp"] == 1:
                steps["padded"] = padded_step(model, seqs)
            result = {}
            for name, forward in steps.items():  # warm-up: held bytes, traffic, the loss
                model.zero_grad(set_to_none=True)
                traffic = Traffic()
                with traffic.counting(), saved_storages(model) as held:
                    loss = forward()
                traffic.phase = "backward"
                with traffic.counting():
                    loss.backward()
                result[name] = dict(loss=loss.item(), held=sum(held.values()),
                                    traffic=traffic.counts,
                                    rows=packs[name].num_rows if name in packs else None)

            @contextlib.contextmanager
            def around(name):  # outside the clock: gradients freed, the ranks together
                model.zero_grad(set_to_none=True)
                dist.barrier()
                yield

            def run(forward):
                return lambda: forward().backward()

            times = interleave({n: run(f) for n, f in steps.items()}, config["repeats"],
                               around=around)
            for name in steps:
                result[name]["seconds"] = times[name]
            out[w.name] = dict(result, tokens=sum(map(len, seqs)))
        with open(os.path.join(config["dir"], f"{config['layout']}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_layout(name: str, config: dict) -> list[dict]:
    from launch import free_port

    layout = LAYOUTS[name]
    world = layout["tp"] * layout["cp"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    config = dict(config, layout=name, threads=max(1, (cores or 1) // world))
    os.environ["OMP_NUM_THREADS"] = str(config["threads"])
    mp.spawn(worker, args=(world, free_port(), config), nprocs=world, join=True)
    every = []
    for r in range(world):
        with open(os.path.join(config["dir"], f"{name}-rank{r}.json")) as f:
            every.append(json.load(f))
    return every


def combine(name: str, every: list[dict]) -> dict:
    """Per workload and step: the slowest rank per round, the rank holding the most."""
    layout = LAYOUTS[name]
    rows = {}
    for w in every[0]:
        steps = [s for s in STEPS if s in every[0][w]]
        row = {"tokens": every[0][w]["tokens"]}
        for s in steps:
            per = [r[w][s] for r in every]
            rounds = [max(t) for t in zip(*(p["seconds"] for p in per))]
            forward = max(p["traffic"]["forward"]["sent"] for p in per) / MODEL["num_layers"]
            row[s] = dict(seconds=statistics.median(rounds), rounds=rounds, loss=per[0]["loss"],
                          held=max(p["held"] for p in per), rows=per[0]["rows"],
                          exchange=forward)
        for base in ("padding_free", "padded"):
            if base in row:
                row[f"tree/{base}"] = Spread.of(
                    a / b for a, b in zip(row["tree"]["rounds"], row[base]["rounds"]))._asdict()
        row["formula"] = formula_bytes(row["tree"]["rows"], layout["cp"], layout["tp"], 4)
        rows[w] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths / 64, one round")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args()
    config = dict(scale=64 if args.quick else 16,
                  repeats=args.repeats or (1 if args.quick else 3))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.layouts:
            results[name] = combine(name, run_layout(name, dict(config, dir=d)))
    print(f"bench/megatron.py: {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, lengths / {config['scale']}, {config['repeats']} rounds")
    print("| layout | workload | tokens | rows tree / padding-free | step s tree | padding-free "
          "| padded | tree / padding-free [range] | tree / padded [range] | MiB held per rank "
          "tree / padding-free / padded | exchange KiB per layer (formula) | loss tree / "
          "padded |")
    print("|---|---|---:|---|---:|---:|---:|---|---|---|---|---|")
    for name, rows in results.items():
        for w, row in rows.items():
            t, f, p = row["tree"], row["padding_free"], row.get("padded")

            def spread(key, r=row):
                s = r.get(key)
                return f"{s['median']:.3f} [{s['low']:.3f}–{s['high']:.3f}]" if s else "n/a"

            held = " / ".join(f"{x['held'] / 2**20:.1f}" if x else "n/a" for x in (t, f, p))
            exchange = (f"{t['exchange'] / 1024:.1f} ({row['formula'] / 1024:.1f})"
                        if row["formula"] else "–")
            padded = f"{p['seconds']:.2f}" if p else "n/a"
            loss = f"{t['loss']:.4f} / " + (f"{p['loss']:.4f}" if p else "n/a")
            print(f"| {name} | {w} | {row['tokens']:,} | {t['rows']:,} / {f['rows']:,} | "
                  f"{t['seconds']:.2f} | {f['seconds']:.2f} | {padded} | "
                  f"{spread('tree/padding_free')} | {spread('tree/padded')} | {held} | "
                  f"{exchange} | {loss} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
