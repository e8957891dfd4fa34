"""The ``treepack`` command line: ``bench``, ``stats`` and ``verify``.

The parser is built without importing torch (``treepack --help`` answers at once); each
command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from treepack.planning.jsonl import InputError, JsonlBatch, read_batch

# Building the parser imports no torch: treepack.zoo is torch-free at import, and the backend
# names are listed here (tests/face/test_cli.py checks them against treepack.attention.CHOICES).
BACKEND_CHOICES = ("auto", "segment", "varlen", "flex", "dense")

BUILTIN_DESCRIPTION = (
    "built-in agentic batch: 4 GRPO groups x 8 rollouts, 4 prompts x 4 trajectories x 4 "
    "agent steps with tool outputs"
)

CAUSE_LABELS = {"false_forks": "false forks", "across_ranks": "across ranks",
                "across_micro_batches": "across micro-batches",
                "split_and_repeat": "split-and-repeat packs",
                "differing_routes": "differing MoE routes"}
CAUSE_FIELD = {"across_ranks": "rank", "across_micro_batches": "micro_batch",
               "split_and_repeat": "pack"}
CAUSE_FIX = {  # what to change, one line each (docs/sharing.md says more)
    "differing_routes": "route a group's shared prompt once in the rollout engine (prefix "
                        "caching), so its rollouts record one route for it",
    "false_forks": "give every rollout of a group the same prompt ids (each group below)",
    "across_ranks": "keep each group on one rank (verl: external_lib=treepack.verl; TRL: "
                    "per_device_train_batch_size x steps_per_generation a multiple of "
                    "num_generations)",
    "across_micro_batches": "keep each group in one micro-batch (verl: external_lib="
                            "treepack.verl, actor.shuffle=false; TRL: "
                            "per_device_train_batch_size a multiple of num_generations)",
    "split_and_repeat": "raise max_tokens above the largest tree, or run trees over it in "
                        "parts (hf.backward_in_parts)",
}


def _stats(args) -> int:
    from treepack.core.tree import forest_stats
    from treepack.data.synthetic import agentic_batch
    from treepack.planning.sharing import CAUSES, report

    if args.file is None:
        batch = JsonlBatch(agentic_batch(), None, None, None, None, None, None)
        source = BUILTIN_DESCRIPTION
    else:
        batch, source = read_batch(args.file), args.file
    st = forest_stats(batch.sequences, keys=batch.keys)
    sharing = report(batch.sequences, groups=batch.groups, prompt_lengths=batch.prompt_lengths,
                     ranks=batch.ranks, micro_batches=batch.micro_batches, packs=batch.packs,
                     keys=batch.keys, sessions=batch.sessions)
    result = {
        "source": source,
        "num_sequences": st.num_sequences,
        "original_tokens": st.original_tokens,
        "packed_rows": st.packed_rows,
        "packed_tokens": st.packed_rows,  # the earlier name, kept one release
        "token_ratio": st.token_ratio,
        "attention_pairs_ratio": st.attention_ratio,
        "packed_attention_pairs": st.packed_attention_pairs,
        "unpacked_attention_pairs": st.unpacked_attention_pairs,
        "trees": st.trees,
        "sharing": sharing.as_dict(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"treepack stats: {source}")
    if sharing.groups is None:
        grouped = "no group keys and no prompts: no groups"
    else:
        by = "identical prompt" if batch.groups is None else repr(batch.group_field)
        grouped = f"in {sharing.groups:,} group{'s' * (sharing.groups != 1)} by {by}"
    rows = [
        ("sequences", f"{st.num_sequences:,}", grouped),
        ("original tokens", f"{st.original_tokens:,}", ""),
        ("packed rows", f"{st.packed_rows:,}", f"one per distinct prefix, in {st.trees:,} tree{'s' * (st.trees != 1)}"),
        ("token ratio", f"{st.token_ratio:.3f}",
         f"packed / original: {1 / st.token_ratio:.2f}x fewer rows"),
        ("attention pairs ratio", f"{st.attention_ratio:.3f}",
         "visible query-key pairs, packed / unpacked"),
    ]
    for name, value, note in rows:
        print(f"  {name:<24}{value:>12}   {note}".rstrip())
    _print_sharing(sharing, batch, CAUSES)
    return 0


def _print_sharing(sharing, batch, causes) -> None:
    """The decomposition, a line per cause, then the false-fork groups."""
    if not any(sharing.measured):
        print("\nwhere sharing was lost: not measured; the lines need group keys ('uid' or "
              "'group') with prompts, or a placement ('rank', 'micro_batch', 'pack'); see "
              "docs/sharing.md")
        _print_sessions(sharing)
        return
    print("\nwhere sharing was lost (packed rows; each cause adds the rows its cut costs, in "
          "this order)")

    def total(name, rows, note):
        ratio = rows / sharing.original_tokens
        print(f"  {name:<24}{rows:>12,}   token ratio {ratio:.3f}   {note}")

    if sharing.measured.false_forks:
        total("ideal", sharing.ideal_rows, "one forest, every group's prompts the same")
    lines = list(zip(causes, sharing.lost, sharing.shares, sharing.measured,
                     sharing.groups_hit))
    # in attribution order: differing routes (the batch's routes, where it has them) before
    # the placement's cuts
    lines.insert(1, lines.pop(causes.index("differing_routes")))
    for cause, rows, share, measured, groups in lines:
        label = f"+ {CAUSE_LABELS[cause]}"
        if cause == "differing_routes" and not measured:
            pass  # a batch without routes: nothing to say
        elif not measured:
            why = ("needs group keys ('uid' / 'group') and prompts" if cause == "false_forks"
                   else f"no {CAUSE_FIELD[cause]!r} field")
            print(f"  {label:<24}{'-':>12}   not measured: {why}")
        else:
            hit = (f", {groups:,} group{'s' * (groups != 1)}" if sharing.groups is not None
                   else "")
            print(f"  {label:<24}{rows:>12,}   {100 * share:5.1f} % of the rows lost{hit}")
            if rows:
                print(f"  {'':<39}fix: {CAUSE_FIX[cause]}")
        if cause == "differing_routes":
            total("= achievable", sharing.achievable_rows, "one forest of the step as given")
    total("= achieved", sharing.achieved_rows, "what this placement computes")
    if sharing.false_forks:
        print("\nfalse forks: groups whose prompts differ in their tokens (most rows first)")
    for f in sharing.false_forks:
        length = (f"a {f.prompt_length:,}-token prompt" if f.shortest_prompt == f.prompt_length
                  else f"{f.shortest_prompt:,}- to {f.prompt_length:,}-token prompts")
        tokens = " vs ".join(str(t) for t in f.tokens)
        print(f"  {batch.group_field or 'group'} {f.group!r}: {f.sequences:,} sequences, "
              f"{f.variants:,} prompts, diverge at token {f.depth:,} of {length} ({tokens}): "
              f"{f.rows:,} rows")
        print(f"      likely: {f.hint}")
    _print_sessions(sharing)


def _print_sessions(sharing) -> None:
    """The sessions whose later turns do not extend the earlier ones."""
    if sharing.sessions is None:
        return
    if not sharing.session_forks:
        print(f"\nsessions: {sharing.sessions:,}, every turn extends the previous one's ids")
        return
    rows = sum(f.rows for f in sharing.session_forks)
    print(f"\nfalse forks in later turns: {len(sharing.session_forks):,} of "
          f"{sharing.sessions:,} sessions re-render their history ({rows:,} rows, each "
          "session's forest alone; most rows first)")
    for f in sharing.session_forks:
        tokens = " vs ".join(str(t) for t in f.tokens)
        print(f"  session {f.session!r}: turn {f.turn:,} of {f.turns:,} shares {f.depth:,} of "
              f"the previous turn's {f.previous_length:,} tokens ({tokens}); {f.breaks:,} "
              f"turn{'s' * (f.breaks != 1)} like it: {f.rows:,} rows")
    print(f"      likely: {sharing.session_forks[0].hint}")


DTYPES = ("float64", "float32", "bfloat16", "float16")
BENCH_TOLERANCE = 1e-4  # largest relative gradient error accepted from a float32 bench step
QUICK_CPU_SCALE = 64  # --quick on a CPU: lengths / 64, so 3 timed rounds fit in about a minute


E2E_QUICK_STEPS = 24  # --e2e --quick: the reward visibly rises, both workloads in ~2 min
E2E_STEPS = 100


def _bench(args) -> int:
    import time

    import torch

    from treepack.face import benchmark

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InputError("treepack bench runs a transformers model: pip install "
                         "'treepack[bench]'") from None
    stem = "treepack-e2e" if args.e2e else "treepack-bench"
    args.json = args.json or f"{stem}.json"
    args.plot = args.plot or f"{stem}.png"
    for option, path in (("--json", args.json), ("--plot", None if args.no_plot else args.plot)):
        if path is not None:  # checked now: writing fails only after the whole run
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise InputError(f"{option} {path}: cannot write there ({folder} is not a "
                                 "writable folder); give a path in one that is")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: this torch sees no CUDA device (torch "
                         f"{torch.__version__}); leave --device out to run on the CPU")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    step_only = [f"--{k.replace('_', '-')}" for k in ("scale", "jitter", "prompts", "rollouts",
                                                    "steps", "prefix_len", "branch_len",
                                                    "tool_len") if getattr(args, k) is not None]
    if args.e2e and step_only:
        raise InputError(f"{' '.join(step_only)}: the step benchmark's options; --e2e runs "
                         "built-in GRPO runs (--e2e-steps sets their length)")
    if not args.e2e and args.e2e_steps is not None:
        raise InputError("--e2e-steps is for --e2e (add it to run whole GRPO runs)")
    if args.e2e:
        return _bench_e2e(args, device)
    if args.dtype == "float64":
        raise InputError("--dtype float64 is for --e2e (whole runs that must sample alike); "
                         "the step benchmark runs float32 or bfloat16")
    if args.model == "qwen2-1m":
        raise InputError("--model qwen2-1m is --e2e's CPU model (a character vocabulary); the "
                         "step benchmark runs qwen2-40m, qwen2.5-0.5b or qwen3.5-40m")
    args.model = args.model or "qwen2-40m"
    e2e_only = sorted(set(args.workloads or ()) & {"long_prompt", "long_completion"})
    if e2e_only:
        raise InputError(f"--workloads {' '.join(e2e_only)}: these are --e2e's; the step "
                         "benchmark runs grpo_long, low_sharing, agent")
    scale = args.scale or ((8 if args.quick else 1) if device.type == "cuda" else
                           (QUICK_CPU_SCALE if args.quick else 8))
    custom = {k: getattr(args, k) for k in ("prompts", "rollouts", "steps", "prefix_len",
                                            "branch_len", "tool_len")}
    if any(v is not None for v in custom.values()):
        given = {k: v for k, v in custom.items() if v is not None}
        jitter = 0.5 if args.jitter is None else args.jitter
        works = [benchmark.custom_workload(**given, jitter=jitter)]
    else:
        works = benchmark.rl_workloads(scale=scale, jitter=args.jitter)
        if args.workloads:
            works = [w for w in works if w.name in args.workloads]
    steps = [s for s in benchmark.STEPS if s != "tree_logits" or not args.quick]
    start = time.perf_counter()

    def progress(msg):  # one line each: readable in a terminal and in a log file alike
        print(f"treepack bench [{time.perf_counter() - start:4.0f} s] {msg}", file=sys.stderr,
              flush=True)

    try:
        result = benchmark.run_bench(works, device=device, model=args.model,
                                     dtype=getattr(torch, args.dtype), backend=args.backend,
                                     repeats=args.repeats, micro_batch=args.micro_batch,
                                     steps=steps, progress=progress)
    except (RuntimeError, ValueError) as e:
        raise InputError(str(e)) from None
    progress("done")
    _report(args, result, benchmark.render, benchmark.plot)
    worst = max(x["grad_max_rel_error"] for w in result["workloads"] for x in w["steps"].values())
    if args.dtype == "float32" and worst > BENCH_TOLERANCE:
        print(f"  FAIL: gradients differ by more than {BENCH_TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


def _report(args, result: dict, render, plot) -> None:
    """Print a benchmark's report, write its JSON and (unless --no-plot) its plot."""
    print(render(result))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    written = [args.json]
    if not args.no_plot:
        try:
            plot(result, args.plot)
            written.append(args.plot)
        except ImportError:
            print("  (no plot: pip install matplotlib, or 'treepack[bench]')", file=sys.stderr)
    print(f"\n  wrote {', '.join(written)}")


def _bench_e2e(args, device) -> int:
    """``treepack bench --e2e``: a whole GRPO run, stock TRL and treepack, steps in turn."""
    import time

    import torch

    from treepack.face.benchmark import e2e

    try:
        import trl  # noqa: F401  (is it installed?)
    except ImportError:
        raise InputError("treepack bench --e2e runs TRL's GRPOTrainer: pip install "
                         "'treepack[bench]'") from None
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise InputError("--e2e --dtype bfloat16 trains under a GPU's bfloat16 autocast; on a "
                         "CPU use float32 or float64")
    steps = args.e2e_steps or (E2E_QUICK_STEPS if args.quick else E2E_STEPS)
    model = args.model or ("qwen2.5-0.5b" if device.type == "cuda" else "qwen2-1m")
    start = time.perf_counter()

    def progress(msg):
        print(f"treepack bench --e2e [{time.perf_counter() - start:4.0f} s] {msg}",
              file=sys.stderr, flush=True)

    works = [w for w in e2e.E2E_WORKLOADS if not args.workloads or w.name in args.workloads]
    if not works:
        raise InputError(f"--workloads {' '.join(args.workloads)}: --e2e runs "
                         f"{', '.join(w.name for w in e2e.E2E_WORKLOADS)}")
    progress(f"{len(works)} workloads x 2 runs x {steps} steps, model {model}, {args.dtype}")
    result = e2e.run_e2e(works, model=model, dtype=dtype, steps=steps, device=device,
                         backend=args.backend, progress=progress)
    _report(args, result, e2e.render_e2e, e2e.plot_e2e)
    parted = [w["workload"] for w in result["workloads"]
              if w["agreement"]["identical_steps"] < steps]
    if dtype == torch.float64 and parted:
        print(f"  FAIL: in float64 the runs sampled different completions ({', '.join(parted)}): "
              "their weights differ by more than rounding", file=sys.stderr)
        return 1
    return 0


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


MAX_VERIFY_LAYERS = 64  # a tiny model's layers: more checks nothing new and takes hours


def _layers(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_VERIFY_LAYERS:
        raise argparse.ArgumentTypeError(
            f"{value} is more than {MAX_VERIFY_LAYERS}: verify builds a tiny random model, and "
            "every layer runs the same code; a few layers check what many would")
    return value


def _seed(text: str) -> int:
    value = _integer(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**32)")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1): lengths spread over "
                                         "len x (1 +- jitter)")
    return value


def _census(args) -> int:
    from treepack.face import census

    outcomes, texts = [], []
    for mapping in census.MAPPINGS:
        found = census.census(timeout=args.timeout, mapping=mapping)
        texts.append(census.table(found, mapping))
        print(texts[-1], flush=True)
        outcomes += found
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(texts))
    return int(any(o.status in ("wrong", "crash", "hang") for o in outcomes))


def _verify(args) -> int:
    if args.all:
        return _census(args)
    import torch

    from treepack.adapters import hf
    from treepack.data import zoo
    from treepack.face.verification import verification_batch, verification_image_batch, verify

    dtype = getattr(torch, args.dtype)
    # Low-precision runs are compared against float32 copies: build the model in float32.
    build = dtype if dtype in (torch.float64, torch.float32) else torch.float32
    try:
        if args.family in zoo.VISION_FAMILIES:
            model = zoo.tiny_vision_model(args.family, layers=args.layers, seed=args.seed,
                                          dtype=build)
            batch = verification_image_batch(args.family, seed=args.seed, dtype=build)
            sequences = batch.sequences
            images = hf.Images(model, sequences, pixel_values=batch.pixel_values,
                               image_grid_thw=batch.image_grid_thw)
        else:
            model = zoo.tiny_model(args.family, layers=args.layers, seed=args.seed, dtype=build)
            sequences, images = verification_batch(zoo.VOCAB, seed=args.seed), None
        report = verify(model.eval(), sequences, backend=args.backend, dtype=dtype,
                        pad_to_multiple_of=args.pad_to_multiple_of, images=images)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise InputError(str(e)) from None
    print(report)
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    from treepack.version import __version__
    from treepack.data.zoo import FAMILIES, MODELS, VISION_FAMILIES

    parser = argparse.ArgumentParser(
        prog="treepack",
        description="Exact prefix-tree packing for LLM training on prefix-sharing data.",
    )
    parser.add_argument("--version", action="version", version=f"treepack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="one training step padded, padding-free and tree-packed on a random model",
        description="Run one training step (forward, mean NLL, backward) of a random model "
        "on three ragged RL batches (GRPO with a long prompt, GRPO with little sharing, "
        "multi-turn agent trajectories), four ways side by side: right-padded micro-batches, "
        "padding-free packing, the prefix-tree pack with full logits and with lean log-probs, "
        "interleaved over --repeats rounds (a busy machine slows every step of a round alike). "
        "Prints median times, ratios against both baselines with their spread beside the "
        "FLOP-ratio limit, peak "
        "memory, equivalence errors and Claw-R1's token-ratio scenarios. Lengths are the GPU "
        "sizes divided by --scale (default 8 on a CPU, 1 on a GPU). Workload options "
        "(--prompts ...) replace the three with PROMPTS x ROLLOUTS trajectories of STEPS "
        "steps.",
    )
    bench.add_argument("--quick", action="store_true", help="8x shorter sequences (lengths / "
                       "64 on a CPU, / 8 on a GPU) and no full-logits tree step (about a minute "
                       "on 2 CPU cores)")
    bench.add_argument("--e2e", action="store_true",
                       help="a whole GRPO run instead of one step: TRL's GRPOTrainer with "
                       "generation on a built-in task with a rule reward, stock and "
                       "TreepackGRPOTrainer from one seed taking their steps in turn; reward "
                       "and loss curves, seconds per phase (generate, score, no-grad "
                       "log-probs, update), where the runs' samples part; writes "
                       "treepack-e2e.json and treepack-e2e.png (--quick: "
                       f"{E2E_QUICK_STEPS} steps, else {E2E_STEPS})")
    bench.add_argument("--e2e-steps", type=_positive_int, default=None,
                       help="--e2e: optimizer steps per run")
    bench.add_argument("--workloads", nargs="+",
                       choices=("grpo_long", "low_sharing", "agent", "long_prompt",
                                "long_completion"),
                       help="run only these of the workloads (the step benchmark: grpo_long, "
                       "low_sharing, agent; --e2e: long_prompt, long_completion)")
    bench.add_argument("--jitter", type=_fraction, default=None,
                       help="spread every length over len x (1 +- J) (default: 0.5, 0.6, 0.3 "
                       "per workload; 0: uniform)")
    bench.add_argument("--scale", type=_positive_int, default=None,
                       help="divide every length by this")
    for flag, what in (("--prompts", "distinct prompts"), ("--rollouts", "rollouts per prompt"),
                       ("--steps", "steps per trajectory (1: GRPO rollouts)"),
                       ("--prefix-len", "prompt tokens"), ("--branch-len", "tokens per response"),
                       ("--tool-len", "tool-output tokens between steps")):
        bench.add_argument(flag, type=_positive_int, default=None, help=what)
    bench.add_argument("--model", default=None, choices=sorted(MODELS) + ["qwen2-1m"],
                       help="random-weight model shape (default qwen2-40m; qwen2.5-0.5b for a "
                       "GPU; --e2e: qwen2-1m on a CPU, qwen2.5-0.5b on a GPU, with the task's "
                       "character vocabulary)")
    bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"),
                       help="float64: --e2e only (the runs must sample alike at every step)")
    bench.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    bench.add_argument("--device", default=None, choices=("cpu", "cuda"),
                       help="default: cuda if present")
    bench.add_argument("--micro-batch", type=_positive_int, default=4,
                       help="sequences per padded micro-batch (default 4)")
    bench.add_argument("--repeats", type=_positive_int, default=3,
                       help="timed rounds after a warm-up round, each running every step once "
                       "(default 3): times are medians, ratios the median of the per-round "
                       "ratios with their range, flagged where it crosses 1")
    bench.add_argument("--json", default=None,
                       help="results file (default treepack-bench.json; --e2e: treepack-e2e.json)")
    bench.add_argument("--plot", default=None,
                       help="PNG plot file (default treepack-bench.png; --e2e: treepack-e2e.png)")
    bench.add_argument("--no-plot", action="store_true")
    bench.set_defaults(run=_bench)

    stats = sub.add_parser(
        "stats",
        help="what packing a batch saves, and where a step lost sharing",
        description="Token and attention savings of packing FILE into one prefix forest, and "
        "where a step's sharing was lost: false forks (rollouts of one group whose prompts "
        "differ), groups split across ranks and micro-batches, trees cut into packs. FILE: "
        "JSON lines, each a list of token ids or an object with 'input_ids', 'prompt' and "
        "'completion', or 'prompt_ids' and 'completion_ids' (TRL), optionally a group key "
        "'uid' (verl) or 'group' and a placement 'rank', 'micro_batch', 'pack'; other fields "
        "are ignored. '-' reads standard input. Without FILE: a built-in synthetic agentic "
        "batch. docs/sharing.md explains every number and how to dump a TRL or verl batch.",
    )
    stats.add_argument("file", nargs="?", metavar="FILE.jsonl")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(run=_stats)

    verify = sub.add_parser(
        "verify",
        help="packed vs unpacked equivalence of one training step on a tiny random model",
        description="Build a tiny random model of FAMILY, run one training step (loss, "
        "backward, AdamW) packed and with every sequence alone, and compare log-probs, loss, "
        "gradients and parameters. A vision-language FAMILY runs a built-in batch with images "
        "(each sequence alone gets its own images; the vision tower's gradients are "
        "compared too). Exit status 1 when above tolerance. --all runs the census: every "
        "family of the installed transformers' causal-LM mapping, tiny and random, in float64, "
        "each in a process of its own, classed exact / refused / not built / wrong / crash / "
        "hang, then every family of its image-text-to-text mapping with images; exit status "
        "1 if any is wrong, crashed or hung.",
    )
    which = verify.add_mutually_exclusive_group(required=True)
    which.add_argument("--family", choices=sorted(FAMILIES) + sorted(VISION_FAMILIES))
    which.add_argument("--all", action="store_true",
                       help="the census of every causal-LM and image-text-to-text family of "
                            "the installed transformers")
    verify.add_argument("--timeout", type=_positive_int, default=120,
                        help="--all: seconds per family before it counts as a hang")
    verify.add_argument("--markdown", default=None, metavar="FILE",
                        help="--all: also write the table to FILE")
    verify.add_argument("--layers", type=_layers, default=2,
                        help=f"layers of the tiny model (1 .. {MAX_VERIFY_LAYERS})")
    verify.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    verify.add_argument("--dtype", default="float32", choices=DTYPES)
    verify.add_argument("--seed", type=_seed, default=0)
    verify.add_argument("--pad-to-multiple-of", type=_positive_int, default=None)
    verify.set_defaults(run=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except InputError as e:
        print(f"treepack {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
