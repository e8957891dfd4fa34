"""The GPU check: equivalence on CUDA for every backend, then speed, in one call.

    timeout 560 python bench/gpu.py   # on a GPU machine, from the checkout; about 6 minutes
    python bench/gpu.py --dry-run     # anywhere: the same code at toy sizes (a CPU check)

Every result row is written to $OUT/gpu.json as it is measured, so a run killed at a time
limit keeps what it measured; the parts stop starting new work once --budget seconds (360 by
default on a GPU; no limit on a CPU dry run, which checks every part) are spent, but a compile
or step already running finishes first.

Parts, each printed as a table (and written to $OUT/gpu.json, else ./gpu.json):

1. verify    ``treepack.verify`` on tiny random models: each backend, float32 and bfloat16,
             windows (Qwen2), soft-capping (Gemma 2), sinks (GPT-OSS on varlen / flex / auto),
             chunks (Llama 4 on varlen / auto) and image blocks (Gemma 3 with images on varlen
             / flex / auto). A refusal (varlen in float32, varlen with soft-capping) is
             recorded with its message: it must name the reason.
2. attention one layer's tree attention forward + backward (14/2 heads of 64, bfloat16) per
             backend, beside every sequence alone through FlashAttention varlen (no sharing);
             error against a float32 run; and with GPT-OSS's attention sinks, Llama 4's
             chunks (8192 depths at full size) and Gemma 3-like image blocks on varlen, flex
             (sinks and blocks) and segment, their errors.
3. lean      log-probs from hidden states vs full [T', V] logits (plain log_softmax, and
             treepack's chunked token_logprobs) at T' ~ 19k, V = 151,936.
4. flex      compile time over packs of many lengths (bucketed, so few compiles).
5. step      one training step of a random Qwen2.5-0.5B-shaped model in bfloat16 on three
             ragged RL batches: padded micro-batches of 4, padding-free packing and the tree
             pack (auto and flex backends, lean log-probs), with the FLOP-ratio limit.
6. hybrid    the same step on the hybrid preset (Qwen3.5's layer pattern).
7. parts     bench/parts.py's trees larger than one forward: parts (every row once) against
             the whole tree in one pack, the split-and-repeat plan and padding-free.
8. sp        bench/sp.py on two GPUs (nccl, ``--ranks 1 2``): sequence parallelism's per-rank
             activation memory, CUDA peak, step time and all-to-all bytes at SP=1 and SP=2,
             tree beside padding-free. Skipped, saying so, on fewer than 2 GPUs.
9. vlm       bench/vlm.py: vision-language GRPO (1-4 images a prompt) and a screenshot agent,
             tree vs padding-free vs padded, the FLOP-ratio limit with the vision tower, and
             the vision tower's share of the step.
10. megatron bench/megatron.py --device cuda, once per megatron-core wheel in .whl/ (the device
             image has none: carry ``.whl``; each wheel for this Python is unzipped into a
             folder of its own; without one, the installed megatron-core):
             the tree on a GPTModel against every sequence alone through Megatron's own
             attention (float32 flex / segment, bfloat16 varlen / flex in ``Float16Module``;
             GQA with rope, a sliding window, MoE replaying the rollout's routes,
             multi-latent attention with yarn, and a Gated DeltaNet hybrid: fla's kernels
             where fla is installed, else megatron-core's torch kernel),
             then tree vs padding-free vs padded training steps on the Qwen2.5-0.5B shape,
             and the tree under a quarter of its rows: in parts against the plan's split.
             Not in the default parts.
11. e2e      ``treepack bench --e2e`` on the GPU: whole GRPO runs with generation through
             transformers, stock TRL and TreepackGRPOTrainer taking their steps in turn, on
             the Qwen2.5-0.5B shape (the task's character vocabulary) in bfloat16 autocast;
             seconds per phase, the steps both runs sampled alike, the training and whole-run
             ratios. Needs TRL (the device image has none: carry its wheels, and datasets'
             (with pyarrow's) and accelerate's where missing, in ``.whl``). Not in the
             default parts.

The bars of the GPU-speed issue are checked at the end: the tree step within 1.15x of the
FLOP-ratio limit x the padded step, never slower than padding-free, and the lean head within
1.1x the time of full logits at no more than 1/10 of their memory; with 2 GPUs, SP=2's
per-rank activation memory at most 0.6x SP=1's on the trajectory and the SP tree step never
slower than padding-free; a tree in parts never slower than the plan's split (the parts
and megatron tables). Parts stop early when the time budget (--budget seconds) runs out,
saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))  # run from a checkout without installing

import treepack  # noqa: E402
from treepack import TreePack, benchmark, zoo  # noqa: E402
from treepack.attention import TreeAttention  # noqa: E402
from treepack.synthetic import agent_batch, grpo_batch  # noqa: E402

RESULTS: dict[str, list] = {}
META: dict = {}  # device, torch, dry run: written with the results
START = time.perf_counter()
BUDGET = [360.0]  # seconds for all parts (--budget)


HYBRID_PRESET = "qwen3.5-40m"  # Qwen3.5's layer pattern (zoo.MODELS)


def record(part: str, **row) -> dict:
    RESULTS.setdefault(part, []).append(row)
    print("RESULT " + json.dumps({"part": part, **row}, default=str), flush=True)
    save()  # every row at once: a run killed at its time limit keeps what it measured
    return row


def save(**extra) -> None:
    out = os.environ.get("OUT") or "."
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(dict(META, results=RESULTS, seconds=elapsed(), **extra), f, indent=1,
                  default=str)


def elapsed() -> float:
    return time.perf_counter() - START


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats=5):
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def peak_during(fn, device, before=None) -> float:
    """Peak extra MiB allocated by ``fn()`` (CUDA only; NaN elsewhere), measured from after
    ``before()`` (which frees what the previous call left, e.g. gradients)."""
    if before is not None:
        before()
    if device.type != "cuda":
        fn()
        return float("nan")
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


# ---------------------------------------------------------------------- 1. verify


def part_verify(device, dry, families=None):
    # every backend once before the budget can run out; flex compiles, so it goes early too
    plan = [("qwen2", b, d) for b in ("auto", "varlen", "segment", "dense")
            for d in (torch.float32, torch.bfloat16)]
    plan[2:2] = [("qwen2", "flex", torch.bfloat16), ("gemma2", "flex", torch.float32)]
    plan += [("gemma2", "auto", torch.bfloat16), ("gemma2", "varlen", torch.bfloat16),
             ("llama", "varlen", torch.bfloat16), ("mixtral", "auto", torch.bfloat16),
             ("phi3", "auto", torch.float32), ("gpt2", "auto", torch.bfloat16),
             # hybrids: the routed convolution and scans (transformers' kernels, or the
             # flash-linear-attention / mamba kernels they dispatch to where installed)
             ("qwen3_5", "auto", torch.bfloat16), ("qwen3_next", "auto", torch.float32),
             ("lfm2", "auto", torch.bfloat16), ("bamba", "auto", torch.bfloat16),
             # attention sinks: through varlen's and flex's log-sum-exp, and auto (flex)
             ("gpt_oss", "varlen", torch.bfloat16), ("gpt_oss", "flex", torch.bfloat16),
             ("gpt_oss", "auto", torch.bfloat16),
             # chunked attention (Llama 4): chains cut at chunk starts on varlen
             ("llama4", "varlen", torch.bfloat16), ("llama4", "auto", torch.bfloat16),
             # image blocks (Gemma 3 with images): two varlen calls, a flex mask_mod rule
             ("gemma3", "varlen", torch.bfloat16), ("gemma3", "flex", torch.bfloat16),
             ("gemma3", "auto", torch.bfloat16)]
    if families:
        plan = [p for p in plan if p[0] in families]
    for family, backend, dtype in plan:
        if elapsed() > BUDGET[0] / 3:
            record("verify", family=family, backend=backend, dtype=str(dtype), result="skipped",
                   seconds=0, message="a third of the time budget spent")
            continue
        t = time.perf_counter()
        row = dict(family=family, backend=backend, dtype=str(dtype).removeprefix("torch."))
        try:
            model, batch, images = verify_case(family, device)
            report = treepack.verify(model, batch, backend=backend, dtype=dtype, images=images)
            quantities = report.errors
            row.update(result="PASS" if report.passed else "FAIL",
                       grads=quantities["grads"].max_rel, logprobs=quantities["logprobs"].max_rel)
            if report.unpacked_errors is not None:
                row.update(grads_ratio=report.ratio("grads"),
                           logprobs_ratio=report.ratio("logprobs"))
        except (RuntimeError, ValueError, NotImplementedError) as e:
            message = str(e)
            refused = "cannot run here" in message
            row.update(result="refused" if refused else "ERROR", message=message[:300])
            if not refused:
                row["traceback"] = traceback.format_exc()[-1200:]
        row["seconds"] = round(time.perf_counter() - t, 1)
        record("verify", **row)


def verify_case(family: str, device):
    """The float32 model, batch and images (None for text) ``treepack verify`` checks for
    ``family``: a zoo family, the tiny GPT-OSS here or zoo's Llama 4, or a vision family
    with the verification batch's images."""
    from treepack.verification import verification_batch, verification_image_batch

    if family in zoo.VISION_FAMILIES:
        model = zoo.tiny_vision_model(family, dtype=torch.float32).to(device).eval()
        batch = verification_image_batch(family, dtype=torch.float32)
        pixels = batch.pixel_values.to(device)
        grid = None if batch.image_grid_thw is None else batch.image_grid_thw.to(device)
        images = treepack.hf.Images(model, batch.sequences, pixel_values=pixels,
                                    image_grid_thw=grid)
        return model, batch.sequences, images
    builders = {"gpt_oss": gpt_oss, "llama4": zoo.tiny_llama4}
    model = builders[family]() if family in builders else zoo.tiny_model(family)
    return model.to(device).eval(), verification_batch(zoo.VOCAB), None


def gpt_oss():
    """A tiny GPT-OSS (not a zoo family): attention sinks, sliding and full layers, MoE."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # each head's sink apart from the others (its init is near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2, 2, 4))
    return model


# ---------------------------------------------------------------------- 2. attention


def attention_workloads(scale):
    V = 32000
    return {
        "grpo_long": grpo_batch(groups=2, rollouts=8, prompt_len=4096 // scale,
                                response_len=512 // scale, jitter=0.5, vocab=V, seed=0),
        "low_sharing": grpo_batch(groups=4, rollouts=8, prompt_len=512 // scale,
                                  response_len=1536 // scale, jitter=0.6, vocab=V, seed=2),
        "agent": agent_batch(prompts=1, trajectories=4, steps=8, prompt_len=1024 // scale,
                             response_len=256 // scale, tool_len=256 // scale, jitter=0.3,
                             vocab=V, seed=1),
        "grpo_big": grpo_batch(groups=16, rollouts=16, prompt_len=1024 // scale,
                               response_len=1024 // scale, jitter=0.7, vocab=V, seed=4),
    }


def part_attention(device, dry, scale):
    Hq, Hk, D = 14, 2, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["varlen", "flex", "segment"] if device.type == "cuda" else ["varlen", "segment"]
    for name, seqs in attention_workloads(scale).items():
        if elapsed() > BUDGET[0]:
            record("attention", workload=name, error="skipped: time budget spent")
            continue
        seqs = [torch.as_tensor(s) for s in seqs]
        tree = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
        padding_free = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device,
                                               share_prefixes=False)
        row = dict(workload=name, rows=tree.num_packed_rows, tokens=tree.num_original_tokens)
        for label, pack, backends_here in (("tree", tree, backends),
                                           ("padding_free", padding_free, ["varlen"])):
            g = torch.Generator(device=device).manual_seed(0)
            T = pack.num_rows
            q, k, v = (torch.randn(1, h, T, D, device=device, generator=g, dtype=dtype)
                       .requires_grad_() for h in (Hq, Hk, Hk))
            reference = None
            if label == "tree" and T <= 60000:
                with torch.no_grad():
                    reference = TreeAttention(pack, "segment")(q.float(), k.float(), v.float())
            for backend in backends_here:
                attend = TreeAttention(pack, backend)

                def step():
                    q.grad = k.grad = v.grad = None
                    attend(q, k, v).sum().backward()

                key = f"{label}_{backend}"
                try:
                    row[f"{key}_ms"] = timed(step, device) * 1e3
                    if reference is not None:
                        with torch.no_grad():
                            out = attend(q, k, v).float()
                        row[f"{key}_err"] = float((out - reference).norm() / reference.norm())
                except Exception as e:  # noqa: BLE001 - a table cell, not a crash
                    row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]
        attention_kinds(row, tree, Hq, Hk, D, dtype, device, chunk=max(8192 // scale, 16))
        record("attention", **row)


def image_blocks(pack) -> torch.Tensor:
    """Gemma 3-like image blocks on a pack: in every segment of 32 rows or more, its rows from
    the 8th, up to 256 of them, one block (a block lies within one segment)."""
    import numpy as np

    h = pack.host
    blocks = np.full(pack.num_rows, -1, dtype=np.int64)
    for a, b in zip(h.segment_start.tolist(), h.segment_end.tolist()):
        if b - a >= 32:
            blocks[a + 8:a + 8 + min(256, b - a - 16)] = a
    return torch.from_numpy(blocks).to(pack.device)


def attention_kinds(row: dict, pack, Hq, Hk, D, dtype, device, chunk: int) -> None:
    """GPT-OSS's sinks, Llama 4's chunks (of ``chunk`` depths) and Gemma 3's image blocks on
    the tree: varlen (the kernel's log-sum-exp; chains cut at chunk starts; two calls for the
    blocks), flex on CUDA (its differentiable log-sum-exp; blocks as a mask_mod rule; no
    chunks) and segment, forward + backward, each against a float32 segment run of the same
    kind (the output, and the sinks' gradient)."""
    g = torch.Generator(device=device).manual_seed(1)
    T = pack.num_rows
    q, k, v = (torch.randn(1, h, T, D, device=device, generator=g, dtype=dtype)
               .requires_grad_() for h in (Hq, Hk, Hk))
    sinks = torch.randn(Hq, device=device, generator=g).requires_grad_()
    blocks = image_blocks(pack)
    for kind in ("sinks", "chunk", "blocks"):
        reference = None
        if T <= 60000:
            ref_in = [x.detach().float().requires_grad_() for x in (q, k, v, sinks)]
            extra = {"sinks": {"sinks": ref_in[3]}, "chunk": {"chunk": chunk},
                     "blocks": {"blocks": blocks}}[kind]
            out = TreeAttention(pack, "segment")(*ref_in[:3], **extra)
            out.sum().backward()
            reference = out.detach(), ref_in[3].grad
        flex = ("flex",) if device.type == "cuda" and kind != "chunk" else ()
        for backend in ("varlen", *flex, "segment"):
            attend = TreeAttention(pack, backend)
            key = f"tree_{backend}_{kind}"
            extra = {"sinks": {"sinks": sinks}, "chunk": {"chunk": chunk},
                     "blocks": {"blocks": blocks}}[kind]

            def step():
                q.grad = k.grad = v.grad = sinks.grad = None
                out = attend(q, k, v, **extra)
                out.sum().backward()
                return out

            try:
                row[f"{key}_ms"] = timed(step, device) * 1e3
                if reference is not None:
                    out = step().detach().float()
                    row[f"{key}_err"] = float((out - reference[0]).norm()
                                              / reference[0].norm())
                    if kind == "sinks":
                        row[f"{key}_sink_grad_err"] = float(
                            (sinks.grad - reference[1]).norm() / reference[1].norm())
            except Exception as e:  # noqa: BLE001 - a table cell, not a crash
                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]


# ---------------------------------------------------------------------- 3. lean


def part_lean(device, dry):
    from treepack.logprobs import default_chunk_size

    V, H = (151936, 896) if not dry else (4096, 64)
    scale = 1 if not dry else 32
    seqs = grpo_batch(groups=2, rollouts=8, prompt_len=4096 // scale, response_len=512 // scale,
                      jitter=0.5, vocab=V - 1, seed=0)
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(pack.num_rows, H, device=device, generator=g, dtype=dtype)
    hidden.requires_grad_()
    weight = (torch.randn(V, H, device=device, generator=g, dtype=dtype) * 0.02)
    weight.requires_grad_()
    upstream = torch.randn(pack.rows.shape, device=device, generator=g)

    def full():  # treepack's full-logits path: rows normalised in chunks (treepack.softmax)
        hidden.grad = weight.grad = None
        (pack.token_logprobs(hidden @ weight.T) * upstream).sum().backward()

    def full_plain():  # the plain formula (the GPU-speed issue's "full logits" baseline)
        hidden.grad = weight.grad = None
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        src, tgt = pack.predictions.source, pack.predictions.target
        (pack.place(logp[src, tgt]) * upstream).sum().backward()

    def lean(chunk=None):
        def run():
            hidden.grad = weight.grad = None
            logps = treepack.logprobs_from_hidden(pack, hidden, weight, chunk_size=chunk)
            (logps * upstream).sum().backward()
        return run

    def matmuls():  # the three unavoidable matmuls: logits, grad hidden, grad weight
        z = hidden.detach() @ weight.detach().T
        z @ weight.detach()
        z.T @ hidden.detach()

    def clear():
        hidden.grad = weight.grad = None

    variants = [("full_plain", full_plain, None), ("full", full, None),
                ("lean", lean(), default_chunk_size(V, device)),
                ("lean_4096", lean(4096), 4096), ("matmuls_only", matmuls, None)]
    grads = {}
    for name, fn, chunk in variants:
        try:
            seconds = timed(fn, device, repeats=3)
            peak = peak_during(fn, device, before=clear)
            if name != "matmuls_only":
                grads[name] = (hidden.grad.float().clone(), weight.grad.float().clone())
            record("lean", variant=name, rows=pack.num_rows, vocab=V, hidden=H,
                   chunk=chunk,
                   ms=seconds * 1e3, peak_mb=peak)
        except Exception as e:  # noqa: BLE001
            record("lean", variant=name, error=f"{type(e).__name__}: {e}"[:300])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "full" in grads and "lean" in grads:
        err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads["lean"], grads["full"]))
        record("lean", variant="lean_vs_full_grad_rel_l2", value=err)


# ---------------------------------------------------------------------- 4. flex compiles


def part_flex(device, dry):
    if device.type != "cuda":
        record("flex", note="skipped: FlexAttention backward needs a GPU")
        return
    rng = torch.Generator().manual_seed(0)
    Hq, Hk, D = 14, 2, 64
    for i in range(8):  # 8 packs of different lengths between ~6k and ~9k rows
        if elapsed() > BUDGET[0]:
            record("flex", pack=i, error="skipped: time budget spent")
            continue
        n = 6000 + int(torch.randint(0, 3000, (1,), generator=rng))
        seqs = grpo_batch(groups=2, rollouts=8, prompt_len=n // 4, response_len=n // 32,
                          jitter=0.3, seed=i)
        pack = TreePack.from_sequences(seqs, device=device)
        q, k, v = (torch.randn(1, h, pack.num_rows, D, device=device, dtype=torch.bfloat16)
                   .requires_grad_() for h in (Hq, Hk, Hk))
        synchronize(device)
        t = time.perf_counter()
        TreeAttention(pack, "flex")(q, k, v).sum().backward()
        synchronize(device)
        from treepack.attention.flex import bucket_length

        record("flex", pack=i, rows=pack.num_rows,
               bucket=bucket_length(pack.num_rows, 128), first_call_s=time.perf_counter() - t)


# ---------------------------------------------------------------------- 5. step


def part_step(device, dry, scale, repeats, preset=None, flex=True):
    """One training step per RL workload: padded, padding-free and tree (auto; then flex on
    a GPU unless ``flex`` is False)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = preset or ("qwen2.5-0.5b" if not dry else "qwen2-40m")
    model = benchmark.bench_model(preset, device, dtype)
    works = benchmark.rl_workloads(scale=scale)
    runs = [(w, "auto") for w in works]
    if device.type == "cuda" and flex:
        runs += [(w, "flex") for w in works]  # after every auto row: flex compiles take time
    for w, backend in runs:
        if elapsed() > BUDGET[0]:
            record("step", workload=w.name, backend=backend, model=preset,
                   error="skipped: time budget spent")
            continue
        steps = ("padded", "padding_free", "tree") if backend == "auto" else ("padded", "tree")
        try:
            r = benchmark.compare_step(model, w, backend=backend, repeats=repeats,
                                       micro_batch=4, steps=steps)
        except Exception as e:  # noqa: BLE001
            record("step", workload=w.name, backend=backend, model=preset,
                   error=f"{type(e).__name__}: {e}"[:300],
                   traceback=traceback.format_exc()[-1200:])
            continue
        s = r["steps"]
        record("step", workload=w.name, backend=backend, model=preset,
               tokens=r["original_tokens"], rows=r["packed_rows"],
               token_ratio=r["token_ratio"], limit=r["flop_ratio_limit"],
               padded_s=s["padded"]["seconds"],
               padding_free_s=s.get("padding_free", {}).get("seconds"),
               tree_s=s["tree"]["seconds"], tree_vs_padded=r["tree_vs_padded"],
               tree_vs_padding_free=r.get("tree_vs_padding_free"),
               over_limit=r["over_limit"],
               peak_mb={k: round(v["peak_mb"]) for k, v in s.items()},
               loss_rel_error=max(v["loss_rel_error"] for v in s.values()),
               grad_rel_error=max(v.get("grad_max_rel_error", 0.0) for v in s.values()))
        if device.type == "cuda":
            torch.cuda.empty_cache()


def part_parts(device, dry, scale, repeats):
    """bench/parts.py's workloads: a tree larger than one forward, in parts (every row once)
    against the whole tree in one pack, today's split-and-repeat plan and padding-free."""
    import importlib.util

    from treepack.face.benchmark.timing import interleave, ratio, synced

    spec = importlib.util.spec_from_file_location("bench_parts",
                                                  os.path.join(ROOT, "bench", "parts.py"))
    bench_parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_parts)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = "qwen2.5-0.5b" if not dry else "qwen2-40m"
    model = benchmark.bench_model(preset, device, dtype)
    for name, (seqs, budget) in bench_parts.workloads(scale).items():
        if elapsed() > BUDGET[0]:
            record("parts", workload=name, error="skipped: time budget spent")
            continue
        try:
            steps, rows = bench_parts.steps_for(model, seqs, budget)
            steps = {k: synced(v, device) for k, v in steps.items()}
            peaks = {k: peak_during(v, device) for k, v in steps.items()}  # also a warm-up
            times = interleave(steps, repeats)
        except Exception as e:  # noqa: BLE001
            record("parts", workload=name, error=f"{type(e).__name__}: {e}"[:300],
                   traceback=traceback.format_exc()[-1200:])
            continue
        record("parts", workload=name, model=preset, budget=budget, rows=rows,
               **{f"parts/{k}": ratio(times, "parts", k).median for k in steps if k != "parts"},
               peak_mb={k: round(v) if v == v else None for k, v in peaks.items()})
        if device.type == "cuda":
            torch.cuda.empty_cache()


def part_sp(device, dry):
    """bench/sp.py at SP=1 and SP=2, one process per GPU (nccl), in a subprocess held to the
    time budget; its rows recorded here."""
    import subprocess

    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count < 2:
        record("sp", note=f"skipped: sequence parallelism needs 2 GPUs, found {count}")
        return
    out = os.path.join(os.environ.get("OUT") or ".", "sp.json")
    command = [sys.executable, os.path.join(ROOT, "bench", "sp.py"), "--device", "cuda",
               "--ranks", "1", "2", "--json", out] + (["--quick"] if dry else ["--scale", "4"])
    timeout = min(240.0, max(120.0, BUDGET[0] - elapsed()))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        record("sp", error=f"bench/sp.py exited {done.returncode}: {done.stderr[-300:]}")
        return
    print(done.stdout, flush=True)  # bench/sp.py's own tables
    with open(out) as f:
        record_sp(json.load(f))


def part_vlm(device, dry):
    """bench/vlm.py in a subprocess held to the time budget; one row per workload."""
    import subprocess

    out = os.path.join(os.environ.get("OUT") or ".", "vlm.json")
    command = [sys.executable, os.path.join(ROOT, "bench", "vlm.py"), "--device", str(device),
               "--json", out] + (["--quick", "--repeats", "1"] if dry else [])
    timeout = min(180.0, max(60.0, BUDGET[0] - elapsed()))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        record("vlm", error=f"bench/vlm.py exited {done.returncode}: {done.stderr[-300:]}")
        return
    print(done.stdout, flush=True)
    with open(out) as f:
        for name, row in json.load(f)["workloads"].items():
            record("vlm", workload=name, tree_over_padding_free=row["tree/padding_free"]["median"],
                   tree_over_padded=row["tree/padded"]["median"], flop_limit=row["flop_limit"],
                   over_limit=row["tree/padding_free over limit"],
                   vision_share=row["vision_share"]["tree"])


def part_e2e(device, dry, steps: int):
    """``treepack bench --e2e`` in a subprocess held to the time budget; one row per
    workload. TRL and what it needs come from ``.whl`` where the image lacks them."""
    import subprocess

    out = os.path.join(os.environ.get("OUT") or ".", "e2e.json")
    path = [os.path.join(ROOT, "src"), *wheel_folders(("trl", "datasets", "accelerate"))]
    argv = ["bench", "--e2e", "--e2e-steps", str(steps), "--json", out, "--plot",
            out[:-len(".json")] + ".png", "--device", device.type]
    argv += (["--workloads", "long_prompt"] if dry else
             ["--model", "qwen2.5-0.5b", "--dtype", "bfloat16"])
    code = (f"import sys; sys.path[:0] = {path!r}; from treepack.face.cli import main; "
            f"sys.exit(main({argv!r}))")
    timeout = min(480.0, max(60.0, BUDGET[0] - elapsed()))
    # a session of its own: on a timeout its two run processes end with it
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   path + [os.environ.get("PYTHONPATH", "")])})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        record("e2e", error=f"treepack bench --e2e ran past {timeout:.0f} s: stopped")
        return
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    print(done.stdout, flush=True)  # the e2e report
    if done.returncode:
        record("e2e", error=f"treepack bench --e2e exited {done.returncode}: "
                            f"{done.stderr[-600:]}")
        return
    with open(out) as f:
        result = json.load(f)
    for w in result["workloads"]:
        a = w["agreement"]
        record("e2e", workload=w["workload"], model=result["model"], dtype=result["dtype"],
               steps=a["steps"], same_samples=a["identical_steps"],
               token_ratio=a.get("token_ratio"),
               training_ratio=a["training_ratio_per_step"]["median"],
               run_ratio=a["run_ratio_per_step"]["median"],
               stock_training_share=a["stock_training_share"],
               **{f"{run}_{phase}_s": w["runs"][run]["seconds"][phase]
                  for run in ("stock", "treepack")
                  for phase in ("generate", "logprobs", "update")})


def wheel_folders(names) -> list[str]:
    """For each of ``names`` the image cannot import, its wheels in ``.whl`` unzipped into a
    temporary folder each (not under $OUT, whose files travel back). TRL and accelerate are
    pure Python; datasets needs pyarrow, a compiled wheel for the image's Python."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    wheels = os.path.join(ROOT, ".whl")
    return [unzipped(os.path.join(wheels, wheel), wheel[:-4]) for name in missing
            for wheel in (sorted(os.listdir(wheels)) if os.path.isdir(wheels) else [])
            if wheel.startswith(f"{name}-") and wheel.endswith(".whl")]


def megatron_versions() -> list[tuple[str, str | None]]:
    """``(name, folder)`` per megatron-core to run: each wheel in .whl/ unzipped into a folder
    of its own (a wheel is a zip; nothing to install), else the installed one (folder None)."""
    import glob

    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"  # wheels for this Python
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", f"megatron_core-*-{tag}-*.whl")))
    if not wheels:
        return [("installed", None)]
    return [(os.path.basename(wheel).split("-")[1], unzipped(wheel, "mcore-"))
            for wheel in wheels]


def unzipped(wheel: str, prefix: str) -> str:
    """A wheel (a zip: nothing to install) unzipped into a temporary folder of its own."""
    import tempfile
    import zipfile

    folder = tempfile.mkdtemp(prefix=prefix)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(folder)
    return folder


def part_megatron(device, dry, parts=("verify", "step")):
    """bench/megatron.py on this one device per megatron-core (module doc, part 10)."""
    import subprocess

    for version, folder in megatron_versions():
        out = os.path.join(os.environ.get("OUT") or ".", f"megatron-{version}.json")
        command = [sys.executable, os.path.join(ROOT, "bench", "megatron.py"), "--device",
                   str(device), "--json", out, "--parts", *parts] + (
                       ["--quick", "--shape", "tiny"] if dry else [])
        env = dict(os.environ)
        if folder:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (folder, env.get("PYTHONPATH"))))
        timeout = min(300.0, max(120.0, BUDGET[0] - elapsed()))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired:
            done = None
        print(done.stdout if done else "", flush=True)
        if not os.path.exists(out):
            reason = (f"exited {done.returncode}: {done.stderr[-400:]}" if done
                      else f"timed out after {timeout:.0f} s")
            record("megatron", version=version, error=f"bench/megatron.py {reason}")
            continue
        with open(out) as f:
            report = json.load(f)
        for row in report.get("verify") or []:
            record("megatron", version=report["megatron_core"], **row)
        for name, row in (report.get("step") or {}).items():
            record("megatron", version=report["megatron_core"], workload=name,
                   model="megatron step", tokens=row["tokens"], rows=row["rows"],
                   **{f"{k}_s": row[k]["seconds"] for k in ("tree", "padding_free", "padded")},
                   **{f"{k}_peak_mib": row[k].get("peak_mib")
                      for k in ("tree", "padding_free", "padded")},
                   tree_vs_padding_free=row["tree/padding_free"]["median"],
                   tree_vs_padded=row["tree/padded"]["median"],
                   budget=row["budget"], split_rows=row["split_rows"],
                   **{f"{k}_s": row[k]["seconds"] for k in ("in_parts", "split")},
                   **{f"{k}_peak_mib": row[k].get("peak_mib") for k in ("in_parts", "split")},
                   parts_vs_split=row["in_parts/split"]["median"],
                   parts_vs_tree=row["in_parts/tree"]["median"],
                   loss_tree=row["tree"]["loss"], loss_padded=row["padded"]["loss"])
        if done is not None and done.returncode:
            record("megatron", version=version,
                   error=f"bench/megatron.py exited {done.returncode}: {done.stderr[-400:]}")
        record("megatron", version=report["megatron_core"],
               note=f"transformer_engine: {report['transformer_engine']}")


def record_sp(report: dict) -> None:
    """One ``sp`` row per P and workload of bench/sp.py's JSON report."""
    errors = report["gradient_errors"]
    for ranks, rows in report["results"].items():
        for name, row in rows.items():
            tree, free = row["tree"], row["padding_free"]
            record("sp", workload=name, ranks=int(ranks), rows=tree["rows"],
                   padding_free_rows=free["rows"],
                   activation_mb={k: round(row[k]["activation_bytes"] / 2**20, 1) for k in row},
                   peak_mb={k: round(row[k]["peak_bytes"] / 2**20, 1) for k in row},
                   tree_s=tree["seconds"], padding_free_s=free["seconds"],
                   tree_vs_padding_free=tree["vs_padding_free"]["median"],
                   alltoall_forward_mb=tree["traffic"]["forward"]["sent"] / 2**20,
                   alltoall_formula_mb=tree["formula"]["sent"] / 2**20,
                   grad_rel_error=max(errors[f"{name}/{k}/P{ranks}"] for k in row))


# ---------------------------------------------------------------------- summary


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


# a row without its part's key: the part failed whole
ROW_KEYS = {"verify": "family", "attention": "workload", "lean": "variant", "flex": "pack",
            "step": "workload", "sp": "workload", "vlm": "workload", "megatron": "workload",
            "e2e": "workload", "parts": "workload"}


def summary() -> list[str]:
    lines = []
    for part, rows in RESULTS.items():
        for row in rows:
            if ROW_KEYS.get(part) not in row:
                lines.append(f"{part:<10}" + ", ".join(
                    f"{k}={v}" for k, v in row.items() if k != "traceback"))
    for row in rows_of("verify"):
        extra = row.get("message", "") if row["result"] not in ("PASS", "FAIL") \
            else f"grads {fmt(row.get('grads'), '.1e')}" + (
                f", ratio {fmt(row.get('grads_ratio'), '.2f')}" if "grads_ratio" in row else "")
        lines.append(f"verify    {row['family']:<8}{row['backend']:<8}{row['dtype']:<9}"
                     f"{row['result']:<8}{row['seconds']:>6}s  {extra[:110]}")
    for row in rows_of("attention"):
        cells = "  ".join(f"{k[:-3]} {v:.1f}ms" for k, v in row.items() if k.endswith("_ms"))
        errs = "  ".join(f"{k[:-4]} {v:.1e}" for k, v in row.items() if k.endswith("_err"))
        fails = "  ".join(f"{k}: {v}" for k, v in row.items() if k.endswith("error"))
        lines.append(f"attention {row['workload']:<12}rows {row.get('rows', '-'):>7}  {cells}  "
                     f"err: {errs}{'  ' + fails if fails else ''}")
    for row in rows_of("lean"):
        if "value" in row:
            lines.append(f"lean      lean vs full gradient rel. L2 {row['value']:.1e}")
        elif "error" in row:
            lines.append(f"lean      {row['variant']:<13}{row['error']}")
        else:
            lines.append(f"lean      {row['variant']:<13}{row['ms']:>9.1f} ms {row['peak_mb']:>10.0f}"
                         f" MiB  (T'={row['rows']}, V={row['vocab']}, chunk={row['chunk']})")
    for row in rows_of("flex"):
        lines.append("flex      " + ", ".join(f"{k}={fmt(v)}" for k, v in row.items()))
    for row in rows_of("step"):
        if "error" in row:
            lines.append(f"step      {row['workload']:<12}{row['backend']:<6}{row['error']}")
            continue
        lines.append(
            f"step      {row.get('model', ''):<13}{row['workload']:<12}{row['backend']:<6}"
            f"ratio {row['token_ratio']:.3f}  "
            f"padded {row['padded_s']:.3f}s  padding-free {fmt(row['padding_free_s'])}s  "
            f"tree {row['tree_s']:.3f}s  tree/padded {row['tree_vs_padded']:.3f} "
            f"(limit {row['limit']:.3f}, {row['over_limit']:.2f}x)  "
            f"tree/padding-free {fmt(row['tree_vs_padding_free'])}  loss {row['loss_rel_error']:.1e}"
            f"  grads {row['grad_rel_error']:.1e}")
    for row in rows_of("sp"):
        cells = ", ".join(f"{k} {fmt(v)}" for k, v in row.items() if k != "workload")
        lines.append(f"sp        {row['workload']:<12}{cells}")
    for row in rows_of("vlm"):
        cells = ", ".join(f"{k} {fmt(v)}" for k, v in row.items() if k != "workload")
        lines.append(f"vlm       {row['workload']:<12}{cells}")
    for row in rows_of("megatron"):
        cells = ", ".join(f"{k} {fmt(v, '.3g')}" for k, v in row.items() if k != "workload")
        lines.append(f"megatron  {row['workload']:<12}{cells}")
    for row in rows_of("parts"):
        cells = ", ".join(f"{k} {fmt(v, '.3g')}" for k, v in row.items() if k != "workload")
        lines.append(f"parts     {row['workload']:<12}{cells}")
    for row in rows_of("e2e"):
        cells = ", ".join(f"{k} {fmt(v, '.3g')}" for k, v in row.items() if k != "workload")
        lines.append(f"e2e       {row['workload']:<12}{cells}")
    return lines


def rows_of(part: str) -> list[dict]:
    """The part's rows that measured something (or failed one item of it)."""
    return [r for r in RESULTS.get(part, []) if ROW_KEYS[part] in r]


def verdict(ok: bool, inputs: list[dict]) -> str:
    """PASS / FAIL, or INCOMPLETE when a row the bar needs errored or was skipped."""
    broken = [r for r in inputs if "error" in r or r.get("result") == "skipped"]
    if broken:
        return f"INCOMPLETE ({len(broken)} of {len(inputs)} errored or skipped)"
    return "PASS" if ok else "FAIL"


def bars() -> list[str]:
    out = []
    for part in RESULTS:  # a part that failed as a whole fails every bar it feeds
        for row in RESULTS[part]:
            if ROW_KEYS.get(part) not in row and "error" in row:
                out.append(f"bar: part {part} ran: FAIL ({row['error'][:120]})")
    auto = [r for r in rows_of("step") if r["backend"] == "auto"]
    hybrid = [r for r in auto if r.get("model") == HYBRID_PRESET]
    hybrid_ok = [r for r in hybrid if "error" not in r]
    if hybrid:
        worst = max((r["over_limit"] for r in hybrid_ok), default=float("nan"))
        out.append(f"bar: hybrid ({HYBRID_PRESET}) tree step <= 1.2 x limit x padded: "
                   f"{verdict(worst <= 1.2, hybrid)} (worst {worst:.2f}x)")
    all_steps = [r for r in auto if r.get("model") != HYBRID_PRESET]
    steps = [r for r in all_steps if "error" not in r]
    if all_steps:
        worst = max((r["over_limit"] for r in steps), default=float("nan"))
        out.append(f"bar: tree step <= 1.15 x limit x padded: "
                   f"{verdict(worst <= 1.15, all_steps)} (worst {worst:.2f}x)")
        pf = [r["tree_vs_padding_free"] for r in steps if r["tree_vs_padding_free"] is not None]
        worst_pf = max(pf, default=float("nan"))
        out.append(f"bar: tree never slower than padding-free: "
                   f"{verdict(worst_pf <= 1.0, all_steps)} (worst {worst_pf:.3f})")
        grad = max((r["grad_rel_error"] for r in steps), default=float("nan"))
        loss = max((r["loss_rel_error"] for r in steps), default=float("nan"))
        # bfloat16 steps: packed vs padded differ by rounding; a broken gradient is O(1) off
        out.append(f"bar: step loss and gradients equal padded (loss <= 1e-2, grads <= 0.1): "
                   f"{verdict(loss <= 1e-2 and grad <= 0.1, all_steps)} "
                   f"(loss {loss:.1e}, grads {grad:.1e})")
    lean_rows = rows_of("lean")
    lean = {r["variant"]: r for r in lean_rows if "ms" in r}
    # against plain full logits: time and memory; against treepack's chunked full logits
    # (already lean in memory: ~0.4x plain) the time alone
    for full, memory_bar in (("full_plain", 0.1), ("full", None)):
        what = f"lean <= 1.1x {full} time" + (" at <= 1/10 memory" if memory_bar else "")
        needed = [r for r in lean_rows if r["variant"] in (full, "lean")]
        if not needed:
            continue
        if full not in lean or "lean" not in lean:
            out.append(f"bar: {what}: INCOMPLETE ({full} or lean not measured)")
            continue
        t = lean["lean"]["ms"] / lean[full]["ms"]
        m = lean["lean"]["peak_mb"] / lean[full]["peak_mb"]
        if memory_bar is None:
            v = verdict(t <= 1.1, needed)
        else:
            v = ("n/a (no CUDA memory stats)" if m != m
                 else verdict(t <= 1.1 and m <= memory_bar, needed))
        out.append(f"bar: {what}: {v} (time {t:.2f}x, memory {m:.3f}x)")
    grad = [r for r in lean_rows if r["variant"] == "lean_vs_full_grad_rel_l2"]
    if grad:
        out.append(f"bar: lean gradients equal full (rel. L2 <= 5e-2): "
                   f"{verdict(grad[0]['value'] <= 5e-2, grad)} ({grad[0]['value']:.1e})")
    attention = rows_of("attention")
    if attention:
        failed = [k for r in attention for k in r if k.endswith("_error")]
        out.append(f"bar: every attention backend ran: "
                   f"{verdict(not failed, [r for r in attention if 'error' in r])}"
                   f"{' (' + ', '.join(failed) + ')' if failed else ''}")
    sp = rows_of("sp")
    trajectory = {r["ranks"]: r for r in sp if r["workload"] == "trajectory"}
    if 1 in trajectory and 2 in trajectory:
        m = trajectory[2]["activation_mb"]["tree"] / trajectory[1]["activation_mb"]["tree"]
        out.append(f"bar: SP=2 per-rank activation memory <= 0.6x SP=1 (trajectory): "
                   f"{verdict(m <= 0.6, sp)} ({m:.3f}x)")
    if sp:
        worst = max(r["tree_vs_padding_free"] for r in sp)
        out.append(f"bar: SP tree step never slower than padding-free: "
                   f"{verdict(worst <= 1.0, sp)} (worst {worst:.3f})")
    mverify = [r for r in rows_of("megatron") if "result" in r]
    if mverify:
        bad = [r for r in mverify if r["result"] != "PASS"]
        out.append(f"bar: megatron tree equals each sequence alone: "
                   f"{verdict(not bad, mverify)} ({len(mverify) - len(bad)}/{len(mverify)})")
    # every parts row (an errored one makes the bar INCOMPLETE), and Megatron's step rows
    split_rows = rows_of("parts") + [r for r in RESULTS.get("megatron", [])
                                     if "parts_vs_split" in r or "error" in r]
    split = [(r.get("parts/split", r.get("parts_vs_split")), r.get("workload"),
              "megatron" if "parts_vs_split" in r else "transformers") for r in split_rows
             if "parts/split" in r or "parts_vs_split" in r]
    if split:
        worst = max(split, key=lambda item: item[0])
        out.append(f"bar: parts never slower than the plan's split: "
                   f"{verdict(worst[0] <= 1.0, split_rows)} (worst {worst[0]:.3f}, "
                   f"{worst[1]} on {worst[2]})")
    elif split_rows:
        v = verdict(True, split_rows)
        out.append("bar: parts never slower than the plan's split: " + (
            v if v.startswith("INCOMPLETE") else "n/a (no workload has a split)"))
    verify = rows_of("verify")
    if verify:
        bad = [r for r in verify if r["result"] in ("FAIL", "ERROR")]
        v = verdict(not bad, verify)
        out.append(f"bar: every backend verifies or refuses with its reason: {v} "
                   f"({len(verify) - len(bad)}/{len(verify)} not failed)")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes (for a CPU)")
    parser.add_argument("--parts", nargs="+", default=["verify", "lean", "step", "attention",
                                                       "flex", "hybrid", "parts", "sp",
                                                       "vlm"])
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all parts (default 360 on a GPU, where the lease "
                             "counts; none on a CPU dry run, which checks every part)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", nargs="+", default=None,
                        help="verify only these families (a rerun of what failed)")
    parser.add_argument("--no-flex-step", action="store_true",
                        help="the step part on the auto backend only")
    parser.add_argument("--e2e-steps", type=int, default=12,
                        help="the e2e part's optimizer steps per run")
    parser.add_argument("--megatron-parts", nargs="+", default=["verify", "step"],
                        help="the megatron part's own parts (bench/megatron.py --parts)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = args.dry_run or device.type != "cuda"
    if args.budget is None:
        args.budget = float("inf") if dry else 360.0
    BUDGET[0] = args.budget
    scale = 32 if dry else 1
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    META.update(device=where, torch=torch.__version__, dry_run=dry)
    print(f"treepack bench/gpu.py: {where}, torch {torch.__version__}, "
          f"{'dry run' if dry else 'full sizes'}", flush=True)
    parts = {
        "verify": lambda: part_verify(device, dry, args.families),
        "attention": lambda: part_attention(device, dry, scale),
        "lean": lambda: part_lean(device, dry),
        "flex": lambda: part_flex(device, dry),
        "step": lambda: part_step(device, dry, 64 if dry else 1, 1 if dry else args.repeats,
                                  flex=not args.no_flex_step),
        # the hybrid preset (Qwen3.5's layer pattern): its step on the same workloads
        "hybrid": lambda: part_step(device, dry, 64 if dry else 1, 1 if dry else args.repeats,
                                    preset=HYBRID_PRESET, flex=False),
        # a tree larger than one forward (bench/parts.py): parts vs whole, split, padding-free
        "parts": lambda: part_parts(device, dry, 64 if dry else 1, 1 if dry else args.repeats),
        # sequence parallelism over 2 GPUs (bench/sp.py): SP=1 vs SP=2, tree vs padding-free
        "sp": lambda: part_sp(device, dry),
        # vision-language models (bench/vlm.py): tree vs padding-free vs padded
        "vlm": lambda: part_vlm(device, dry),
        # megatron-core (bench/megatron.py --device): tree vs each sequence alone, then steps
        "megatron": lambda: part_megatron(device, dry, args.megatron_parts),
        # a whole GRPO run, stock TRL vs treepack (treepack bench --e2e): not by default
        "e2e": lambda: part_e2e(device, dry, 2 if dry else args.e2e_steps),
    }
    for name in args.parts:
        if elapsed() > BUDGET[0]:
            record("skipped", skipped=name, reason=f"time budget of {args.budget:.0f} s spent")
            continue
        t = time.perf_counter()
        try:
            parts[name]()
        except Exception as e:  # noqa: BLE001 - report and go on to the next part
            record(name, error=f"{type(e).__name__}: {e}"[:300],
                   traceback=traceback.format_exc()[-1500:])
        print(f"-- {name}: {time.perf_counter() - t:.0f} s", flush=True)
    lines = summary() + [""] + bars()
    print("\n" + "\n".join(lines))
    save(summary=lines)


if __name__ == "__main__":
    main()
