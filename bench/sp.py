"""Sequence parallelism (Ulysses) on a tree: per-rank activation memory, step time and
all-to-all traffic at P = 1, 2 and 4 ranks, the tree beside padding-free, in one run.

    python bench/sp.py              # the measurement: gloo on this CPU (16 min on 2 cores)
    python bench/sp.py --quick      # tiny shapes, ~45 s (--ranks 1 2: 16 s): a CPU check
    python bench/sp.py --device cuda --ranks 1 2 --scale 4    # nccl, a GPU a rank (gpu.py)

Each P runs in P fresh processes (``torch.multiprocessing.spawn``, ``tcp://127.0.0.1``), all
holding the same random model and the same packs. P = 1 is the ordinary path
(``sequence_parallel=None``); P > 1 passes the world group to ``treepack.hf.logprobs``. On a
CPU each rank gets ``cores // P`` threads (at least 1: P = 4 on 2 cores shares them).

Workloads (ragged lengths, as RL makes them; ``--scale`` multiplies every length):

- ``trajectory``: one agent trajectory of 8 steps over a 4,096-token prompt, 832-token
  responses and tool outputs (+-30 %); each step's sequence repeats the whole history, so the
  tree is one chain of about 16k rows and padding-free computes every step's history again;
- ``grpo``: one GRPO group, a 4,096-token prompt and 8 rollouts of 512 tokens (+-50 %).

Layouts: ``tree`` (``TreePack.from_sequences``) and ``padding_free``
(``TreePack.from_sequences(..., share_prefixes=False)``: every sequence its own chain, one row
per token; the same kernels, no sharing).

The model: ``zoo.tiny_model("qwen2")`` at hidden 256, 2 layers, GQA 8 query / 2 key-value
heads of 32, intermediate 512, vocabulary 4,096, float32 (bfloat16 on CUDA); 3.2M parameters.
One step: forward through ``hf.logprobs``, mean NLL over every original prediction, backward.

Measured per rank, and reported for the rank that holds the most:

- activation bytes: the storages saved for backward during the forward (a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook; each storage once; parameters and
  buffers skipped), plus the ``[N, L]`` log-probs the forward returns: what a rank holds at
  the end of its forward. Device-independent. Cross-check, the peak of a step: the rise of
  the process's resident set (CPU), or ``torch.cuda.max_memory_allocated`` above what was
  allocated before it (CUDA): parameters and the pack excluded, gradients and temporaries in;
- step time: the median over ``--repeats`` rounds after a warm-up, the tree and padding-free
  steps interleaved (``treepack.benchmark.interleave``), each step started after a barrier
  and timed on the slowest rank; the tree / padding-free ratio is taken round by round;
- all-to-all bytes per attention layer, forward and backward: what ``_all_to_all`` is handed
  (counted by wrapping it), against the formula (the docstring of ``formula_bytes``).

The bars (the sequence-parallelism issue): per-rank activation memory at P = 2 at most 0.6x
P = 1 on the trajectory (tree), and the tree step never slower than padding-free under the
same P.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))  # run from a checkout without installing

from treepack import TreePack, hf, zoo  # noqa: E402
from treepack.data.synthetic import agent_batch, grpo_batch  # noqa: E402
from treepack.face.benchmark.memory import peak_memory, saved_storages  # noqa: E402
from treepack.face.benchmark.traffic import Traffic  # noqa: E402
from treepack.face.benchmark.timing import Spread, interleave  # noqa: E402

LAYOUTS = ("tree", "padding_free")
MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=4096, layers=2)
QUICK_MODEL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=97, layers=2)


def workloads(quick: bool, scale: float = 1.0) -> dict[str, list]:
    """The sequences of each workload (numpy int64 arrays), lengths times ``scale``."""
    def n(tokens):
        return max(2, int(tokens * scale / (64 if quick else 1)))

    vocab = (QUICK_MODEL if quick else MODEL)["vocab_size"]
    steps = 4 if quick else 8
    return {
        "trajectory": agent_batch(prompts=1, trajectories=1, steps=steps, prompt_len=n(4096),
                                  response_len=n(832), tool_len=n(832), jitter=0.3,
                                  vocab=vocab, seed=1),
        "grpo": grpo_batch(groups=1, rollouts=8, prompt_len=n(4096), response_len=n(512),
                           jitter=0.5, vocab=vocab, seed=0),
    }


def model_shape(quick: bool) -> dict:
    """The keyword arguments of ``zoo.tiny_config("qwen2", ...)`` for the bench model."""
    return dict(QUICK_MODEL if quick else MODEL, use_sliding_window=False,
                max_position_embeddings=1 << 17)


def bench_model(quick: bool, dtype: torch.dtype):
    model = zoo.tiny_model("qwen2", seed=0, dtype=dtype, **model_shape(quick))
    hf.prepare(model)
    return model


def formula_bytes(rows: int, ranks: int, config, itemsize: int) -> dict:
    """What each rank hands ``_all_to_all`` per attention layer in one direction (the forward;
    the backward exchanges the same gradients back), and the part of it that leaves the rank.

    A rank holds ``w = ceil(T' / P)`` rows. Its query, key and value heads go out in one
    exchange, ``(H + 2 K') · D · w`` elements, where ``K' = lcm(K, P)`` are the key/value heads
    after repeating each up to a multiple of P; the attention's output comes back as
    ``H/P`` heads of all ``P · w`` rows: ``H · D · w`` elements. Piece j of each goes to rank
    j, so ``(P - 1) / P`` of it leaves the rank. (Over the group, P times this.)
    """
    if ranks == 1:
        return {"sent": 0, "leaving": 0}
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    width = -(-rows // ranks)
    elements = (heads + 2 * math.lcm(kv, ranks)) * dim * width + heads * dim * width
    return {"sent": elements * itemsize, "leaving": elements * itemsize * (ranks - 1) // ranks}


# ------------------------------------------------------------------------ what is measured


def step_of(model, pack: TreePack, group):
    """The forward of one step: ``(loss, log-probs)``; the caller runs the backward."""
    mask, count = pack.prediction_mask, pack.num_predictions

    def forward():
        logps = hf.logprobs(model, pack, sequence_parallel=group).logprobs
        return -logps.where(mask, 0).sum() / count, logps

    return forward


def measure_rank(model, packs: dict, group, device, repeats: int, grads_to: str | None):
    """One rank's measurements of one workload's packs (every rank runs this in step)."""
    steps = {name: step_of(model, pack, group) for name, pack in packs.items()}
    result = {}
    for name, forward in steps.items():  # the warm-up: held bytes, traffic, loss, gradients
        model.zero_grad(set_to_none=True)
        traffic = Traffic()
        with traffic.counting():
            with saved_storages(model) as held:  # the hook off before the backward
                loss, logps = forward()
            storage = logps.untyped_storage()
            held.setdefault(storage.data_ptr(), storage.nbytes())
            activations = sum(held.values())
            traffic.phase = "backward"
            loss.backward()
        if group is not None:
            hf.average_gradients(model, group)
        if grads_to is not None:
            torch.save(torch.cat([p.grad.detach().float().flatten().cpu()
                                  for p in model.parameters() if p.grad is not None]),
                       f"{grads_to}-{name}.pt")
        result[name] = dict(activation_bytes=activations, saved_storages=len(held),
                            loss=loss.item(), traffic=traffic.counts)
    peaks: dict = {name: [] for name in steps}

    @contextlib.contextmanager
    def around(name):  # outside the clock: gradients freed, memory mark reset, ranks together
        model.zero_grad(set_to_none=True)
        with peak_memory(device, peaks[name]):
            if group is not None:
                dist.barrier(group)
            yield

    def run(forward):
        def step():
            loss, _ = forward()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return step

    times = interleave({name: run(f) for name, f in steps.items()}, repeats, around=around)
    for name in steps:
        result[name].update(seconds=times[name], peak_bytes=min(peaks[name]))
    model.zero_grad(set_to_none=True)
    return result


def worker(rank: int, world: int, port: int, config: dict) -> None:
    device = torch.device(config["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    torch.set_num_threads(config["threads"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD if world > 1 else None  # P = 1: the ordinary path
        dtype = getattr(torch, config["dtype"])
        model = bench_model(config["quick"], dtype).to(device)
        out = {}
        for name, seqs in workloads(config["quick"], config["scale"]).items():
            if config["workloads"] and name not in config["workloads"]:
                continue
            seqs = [torch.as_tensor(s) for s in seqs]
            packs = {layout: TreePack.from_sequences(seqs, share_prefixes=layout == "tree",
                                                     device=device) for layout in LAYOUTS}
            grads = os.path.join(config["dir"], f"grads-{name}-P{world}") if rank == 0 else None
            out[name] = measure_rank(model, packs, group, device, config["repeats"], grads)
            for layout, pack in packs.items():
                out[name][layout].update(rows=pack.num_rows, tokens=pack.num_original_tokens)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        with open(os.path.join(config["dir"], f"P{world}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the run and tables


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ranks: int, config: dict) -> list[dict]:
    """Spawn ``ranks`` processes; every rank's results."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    config = dict(config, threads=max(1, (cores or 1) // ranks))
    os.environ["OMP_NUM_THREADS"] = str(config["threads"])
    mp.spawn(worker, args=(ranks, free_port(), config), nprocs=ranks, join=True)
    paths = [os.path.join(config["dir"], f"P{ranks}-rank{r}.json") for r in range(ranks)]
    every = []
    for path in paths:
        with open(path) as f:
            every.append(json.load(f))
    return every


def combine(every: list[dict], model_config, itemsize: int) -> dict:
    """One row per workload and layout: the rank that holds the most, the slowest rank per
    round, and traffic per attention layer against the formula."""
    ranks, layers = len(every), model_config.num_hidden_layers
    rows = {}
    for name in every[0]:
        rows[name] = {}
        for layout in LAYOUTS:
            per = [r[name][layout] for r in every]
            rounds = [max(t) for t in zip(*(p["seconds"] for p in per))]
            traffic = {phase: {k: max(p["traffic"][phase][k] for p in per) / layers
                               for k in ("sent", "leaving", "calls")}
                       for phase in ("forward", "backward")}
            rows[name][layout] = dict(
                rows=per[0]["rows"], tokens=per[0]["tokens"], loss=per[0]["loss"],
                activation_bytes=max(p["activation_bytes"] for p in per),
                peak_bytes=max(p["peak_bytes"] for p in per), round_seconds=rounds,
                seconds=statistics.median(rounds), traffic=traffic,
                formula=formula_bytes(per[0]["rows"], ranks, model_config, itemsize))
        tree, free = rows[name]["tree"], rows[name]["padding_free"]
        tree["vs_padding_free"] = Spread.of(  # round by round, as interleave timed them
            a / b for a, b in zip(tree["round_seconds"], free["round_seconds"]))._asdict()
    return rows


def gradient_error(directory: str, name: str, layout: str, ranks: int) -> float:
    """Largest difference of the group-averaged gradients at P from P = 1's tree gradients,
    relative to the largest of those."""
    reference = torch.load(os.path.join(directory, f"grads-{name}-P1-tree.pt"))
    got = torch.load(os.path.join(directory, f"grads-{name}-P{ranks}-{layout}.pt"))
    return float((got - reference).abs().max() / reference.abs().max())


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def kib(x: float) -> str:
    return f"{x / 2**10:,.1f}"


def tables(results: dict, errors: dict) -> list[str]:
    base = {name: results[1][name] for name in results[1]} if 1 in results else {}
    lines = ["| workload | P | rows tree / padding-free | activation MiB per rank: tree "
             "(vs P=1) | padding-free (vs P=1) | tree / padding-free memory | step s: tree "
             "| padding-free | tree / padding-free time [range] | peak MiB tree / padding-free "
             "| grad. rel. error vs P=1 |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for ranks, rows in sorted(results.items()):
        for name, row in rows.items():
            t, f = row["tree"], row["padding_free"]

            def vs(layout, r=row, n=name):
                one = base.get(n, {}).get(layout)
                return f" ({r[layout]['activation_bytes'] / one['activation_bytes']:.2f}x)" \
                    if one else ""

            per_round = Spread(**t["vs_padding_free"])
            err = max(errors.get((name, layout, ranks), float("nan")) for layout in LAYOUTS)
            lines.append(
                f"| {name} | {ranks} | {t['rows']:,} / {f['rows']:,} | "
                f"{mib(t['activation_bytes'])}{vs('tree')} | "
                f"{mib(f['activation_bytes'])}{vs('padding_free')} | "
                f"{t['activation_bytes'] / f['activation_bytes']:.3f} | {t['seconds']:.2f} | "
                f"{f['seconds']:.2f} | {per_round.median:.3f} [{per_round.low:.3f}–"
                f"{per_round.high:.3f}]{'*' if per_round.uncertain else ''} | "
                f"{mib(t['peak_bytes'])} / {mib(f['peak_bytes'])} | {err:.1e} |")
    lines += ["", "| workload | layout | P | rows T' | w = ceil(T'/P) | all-to-all KiB per "
              "attention layer, forward: handed / leaving the rank | formula | backward: "
              "handed / leaving | calls per layer fwd / bwd |",
              "|---|---|---:|---:|---:|---|---|---|---|"]
    for ranks, rows in sorted(results.items()):
        if ranks == 1:
            continue
        for name, row in rows.items():
            for layout in LAYOUTS:
                r = row[layout]
                fw, bw, fm = r["traffic"]["forward"], r["traffic"]["backward"], r["formula"]
                lines.append(
                    f"| {name} | {layout} | {ranks} | {r['rows']:,} | {-(-r['rows'] // ranks):,}"
                    f" | {kib(fw['sent'])} / {kib(fw['leaving'])} | {kib(fm['sent'])} / "
                    f"{kib(fm['leaving'])} | {kib(bw['sent'])} / {kib(bw['leaving'])} | "
                    f"{fw['calls']:g} / {bw['calls']:g} |")
    return lines


def bars(results: dict) -> list[str]:
    out = []
    if 1 in results and 2 in results and "trajectory" in results[1]:
        got = (results[2]["trajectory"]["tree"]["activation_bytes"]
               / results[1]["trajectory"]["tree"]["activation_bytes"])
        out.append(f"bar: per-rank activation memory at P=2 <= 0.6x P=1 (trajectory, tree): "
                   f"{'PASS' if got <= 0.6 else 'FAIL'} ({got:.3f}x)")
    worst = max(((row["tree"]["vs_padding_free"]["median"], name, ranks)
                 for ranks, rows in results.items() for name, row in rows.items()), default=None)
    if worst:
        out.append(f"bar: the tree step never slower than padding-free under the same P: "
                   f"{'PASS' if worst[0] <= 1 else 'FAIL'} (worst {worst[0]:.3f}, {worst[1]} "
                   f"at P={worst[2]})")
    exact = all(r[layout]["traffic"][phase]["sent"] == r[layout]["formula"]["sent"]
                and r[layout]["traffic"][phase]["leaving"] == r[layout]["formula"]["leaving"]
                for ranks, rows in results.items() if ranks > 1 for r in rows.values()
                for layout in LAYOUTS for phase in ("forward", "backward"))
    if any(ranks > 1 for ranks in results):
        out.append(f"check: all-to-all bytes per layer equal the formula, forward and "
                   f"backward: {'PASS' if exact else 'FAIL'}")
    return out


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    return f"{os.cpu_count()}-core {name}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (3; quick 1)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length")
    parser.add_argument("--workloads", nargs="+", choices=["trajectory", "grpo"],
                        help="run only these (default: both)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", help="where to write the results (default $OUT/sp.json "
                                       "or ./sp.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model_config = zoo.tiny_config("qwen2", **model_shape(args.quick))
    for ranks in args.ranks:
        if model_config.num_attention_heads % ranks:
            parser.error(f"P={ranks} does not divide the model's "
                         f"{model_config.num_attention_heads} attention heads")
    if device.type == "cuda" and max(args.ranks) > torch.cuda.device_count():
        parser.error(f"--ranks {max(args.ranks)} needs that many GPUs "
                     f"(found {torch.cuda.device_count()})")
    repeats = args.repeats or (1 if args.quick else 3)
    when = datetime.date.today().isoformat()
    print(f"# bench/sp.py{' --quick' if args.quick else ''}: {when}, {machine(device)}, torch "
          f"{torch.__version__}, {dtype}, ranks {args.ranks}, {repeats} rounds", flush=True)
    results, errors, load, started = {}, {}, {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        config = dict(device=args.device, quick=args.quick, scale=args.scale, dtype=dtype,
                      repeats=repeats, workloads=args.workloads, dir=directory)
        for ranks in sorted(set(args.ranks)):
            t = time.perf_counter()
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            results[ranks] = combine(run_ranks(ranks, config), model_config, itemsize)
            load[ranks] = os.getloadavg()[0]  # the 1-minute load at the end: was it quiet?
            print(f"-- P={ranks}: {time.perf_counter() - t:.0f} s, load {load[ranks]:.1f}",
                  file=sys.stderr, flush=True)
        if 1 in results:
            for ranks, rows in results.items():
                for name in rows:
                    for layout in LAYOUTS:
                        errors[(name, layout, ranks)] = gradient_error(directory, name, layout,
                                                                       ranks)
    lines = tables(results, errors) + [""] + bars(results)
    print("\n".join(lines))
    path = args.json or os.path.join(os.environ.get("OUT") or ".", "sp.json")
    with open(path, "w") as f:
        json.dump(dict(date=when, machine=machine(device), torch=torch.__version__,
                       dtype=dtype, quick=args.quick, scale=args.scale, repeats=repeats,
                       seconds=time.perf_counter() - started, load=load,
                       results={str(k): v for k, v in results.items()},
                       gradient_errors={f"{n}/{layout}/P{p}": e
                                        for (n, layout, p), e in errors.items()},
                       summary=lines), f, indent=1)
    return results


if __name__ == "__main__":
    main()
