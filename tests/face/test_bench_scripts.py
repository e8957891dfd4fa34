"""The benchmark scripts run as they stand (at toy sizes), so a GPU session can trust them;
and the timing they share (``treepack.benchmark.timing``) holds up on a fake clock."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(args, tmp_path, timeout):
    env = {**os.environ, "OUT": str(tmp_path)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=timeout)


def test_gpu_script_dry_run_checks_equivalence_and_the_lean_head(tmp_path):
    pytest.importorskip("transformers")
    result = run_script([str(ROOT / "bench" / "gpu.py"), "--dry-run", "--parts", "verify",
                         "lean"], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bar: every backend verifies or refuses with its reason: PASS" in result.stdout
    report = json.loads((tmp_path / "gpu.json").read_text())
    verify = report["results"]["verify"]
    assert {r["backend"] for r in verify} >= {"auto", "varlen", "segment", "dense", "flex"}
    refused = [r for r in verify if r["result"] == "refused"]
    assert refused and all("cannot run here" in r["message"] for r in refused)
    assert {r["variant"] for r in report["results"]["lean"]} >= {"full", "lean"}


@pytest.mark.slow
def test_gpu_script_dry_run_every_part(tmp_path):
    pytest.importorskip("transformers")
    result = run_script([str(ROOT / "bench" / "gpu.py"), "--dry-run"], tmp_path, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    for bar in ("tree step <= 1.15 x limit x padded", "tree never slower than padding-free",
                "every backend verifies"):
        assert bar in result.stdout
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert results["step"] and not any("error" in row for row in results["step"])
    assert [row["workload"] for row in results["vlm"]] == ["grpo", "agent"]
    assert all(0 < row["tree_over_padding_free"] < 1 for row in results["vlm"])
    assert all(key not in results for key in ("skipped",))


def test_gpu_script_skips_the_parts_its_budget_leaves_no_time_for(tmp_path):
    """With the budget spent, each part left is recorded as skipped and named, and the run
    ends normally (it raised a TypeError there; a CPU dry run has no budget by default)."""
    pytest.importorskip("transformers")
    result = run_script([str(ROOT / "bench" / "gpu.py"), "--dry-run", "--budget", "0",
                         "--parts", "lean", "flex"], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = json.loads((tmp_path / "gpu.json").read_text())["results"]["skipped"]
    assert [row["skipped"] for row in skipped] == ["lean", "flex"]
    assert all("time budget of 0 s spent" in row["reason"] for row in skipped)


def test_gpu_script_reports_failures_and_gaps_instead_of_passing_them(monkeypatch, tmp_path):
    """A part that fails as a whole, a skipped check or an errored measurement never reads as
    PASS, and the summary survives rows that lack a part's usual fields."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu.record("verify", family="qwen2", backend="auto", dtype="bfloat16", result="PASS",
               seconds=1, grads=1e-2)
    gpu.record("verify", family="qwen2", backend="flex", dtype="bfloat16", result="skipped",
               seconds=0, message="a third of the time budget spent")
    gpu.record("step", error="KeyError: 'x'", traceback="...")  # the part failed as a whole
    gpu.record("attention", workload="agent", rows=5, tree_varlen_ms=1.0,
               tree_flex_error="RuntimeError: boom")
    gpu.record("lean", variant="full", error="OutOfMemoryError")
    gpu.record("lean", variant="lean", rows=1, vocab=2, hidden=1, chunk=3, ms=1.0, peak_mb=1.0)
    lines = gpu.summary()
    assert any("KeyError" in line for line in lines)
    bars = "\n".join(gpu.bars())
    assert "part step ran: FAIL" in bars
    assert "every attention backend ran: FAIL" in bars
    assert "every backend verifies or refuses with its reason: INCOMPLETE" in bars
    assert "lean <= 1.1x full time: INCOMPLETE" in bars
    assert "PASS" not in bars
    assert (tmp_path / "gpu.json").exists()  # written as the rows came in


def fake_steps(cost: dict, burst: dict | None = None):
    """Steps that only advance a fake clock: ``cost[name]`` seconds, times ``burst[(round,
    name)]`` in a round where the machine is busy; and the clock, and the order they ran in."""
    now, ran, calls = [0.0], [], {name: 0 for name in cost}

    def step(name):
        def run():
            factor = (burst or {}).get((calls[name], name), 1.0)
            calls[name] += 1
            ran.append(name)
            now[0] += cost[name] * factor
        return run

    return {name: step(name) for name in cost}, (lambda: now[0]), ran


COST = {"padded": 4.0, "padding_free": 3.0, "tree": 1.0}


def test_interleave_runs_every_step_once_per_round_starting_at_a_rotating_step():
    from treepack.benchmark import interleave

    steps, clock, ran = fake_steps(COST)
    heard, wrapped = [], []

    @contextlib.contextmanager
    def around(name):
        wrapped.append(name)
        yield

    times = interleave(steps, 3, clock=clock, around=around,
                       after_round=lambda r, seconds: heard.append((r, seconds)))
    assert ran == ["padded", "padding_free", "tree", "padding_free", "tree", "padded",
                   "tree", "padded", "padding_free"]
    assert wrapped == ran  # every timed call, and only those
    assert times == {name: [cost] * 3 for name, cost in COST.items()}
    assert heard == [(r, COST) for r in range(3)]  # progress after every round


def test_a_busy_round_slows_both_sides_of_its_ratio_and_leaves_it_alone():
    """Interleaved, a load that triples every step of round 1 moves the times' spread but no
    per-round ratio: the ratio's spread stays 0 and nothing is flagged."""
    from treepack.benchmark import Spread, interleave, ratio

    steps, clock, _ = fake_steps(COST, burst={(1, name): 3.0 for name in COST})
    times = interleave(steps, 3, clock=clock)
    assert Spread.of(times["padded"]) == (4.0, 4.0, 12.0)
    assert ratio(times, "tree", "padded") == (0.25, 0.25, 0.25)
    assert not ratio(times, "tree", "padded").uncertain


def test_a_burst_on_one_step_moves_the_spread_not_the_median_and_is_flagged_across_1():
    """Issue 18: the tree step once read 3.9x slower than padded on a busy machine. A burst
    that slows round 1's tree step 5x makes that round's ratio 1.25: the median stays 0.25, the
    range [0.25, 1.25] crosses 1, and the ratio is flagged."""
    from treepack.benchmark import interleave, ratio

    steps, clock, _ = fake_steps(COST, burst={(1, "tree"): 5.0})
    r = ratio(interleave(steps, 3, clock=clock), "tree", "padded")
    assert r == (0.25, 0.25, 1.25) and r.uncertain


def test_spread_median_range_and_the_flag():
    from treepack.benchmark import Spread

    assert Spread.of([0.3, 0.1, 0.2]) == (0.2, 0.1, 0.3)
    assert Spread.of([0.5, 0.7]) == (0.6, 0.5, 0.7)  # an even count: the middle two's mean
    assert Spread.of([0.5]) == (0.5, 0.5, 0.5) and not Spread.of([0.5]).uncertain
    assert Spread.of([0.9, 1.1]).uncertain
    assert not Spread.of([1.0, 1.2]).uncertain  # a round at exactly 1 decides nothing
    assert not Spread.of([0.2, 0.9]).uncertain and not Spread.of([1.1, 3.0]).uncertain


def test_flop_model_counts_pairs_on_attention_layers_and_scans_per_row():
    """A hybrid's recurrent layers cost rows, not pairs: half the layers of the tiny Qwen3.5
    attend, so its attention FLOPs are half those of the same model counted as all attention,
    and a scan term grows with rows."""
    from treepack import zoo
    from treepack.benchmark import step_flops

    hybrid = zoo.tiny_model("qwen3_5", layers=4)
    flops = step_flops(hybrid, tokens=100, pairs=1000)
    as_attention = zoo.tiny_model("qwen3_5", layers=4,
                                  layer_types=["full_attention"] * 4)
    assert flops.attention == step_flops(as_attention, 100, 1000).attention / 2
    assert step_flops(hybrid, 200, 1000).linear == 2 * flops.linear
    plain = step_flops(zoo.tiny_model("llama", layers=4), 100, 1000)
    assert plain.attention == 3 * 4 * 64 * 4 * 1000  # every layer attends, heads x dim = 64


def test_padding_free_packs_keep_every_sequence_in_order_within_the_budget():
    """The padding-free baseline packs to a token budget (one pack of 96k tokens ran out of
    memory on an H200): every sequence once, in order, each its own chain, no pack over the
    budget unless it holds one longer sequence alone."""
    from treepack.face.benchmark.steps import padding_free_packs

    seqs = [[1] * n for n in (5, 3, 9, 2, 2, 12, 1, 4)]
    packs = padding_free_packs(seqs, 8)
    assert [len(p.host.lengths) for p in packs] == [2, 1, 2, 1, 2]
    assert [int(n) for p in packs for n in p.host.lengths] == [len(s) for s in seqs]
    for p in packs:
        assert p.num_packed_rows == p.num_original_tokens  # nothing shared
        assert p.num_original_tokens <= 8 or len(p.host.lengths) == 1


def test_gpu_script_dry_run_e2e(tmp_path):
    """The e2e part (not in the default parts): treepack bench --e2e in a subprocess, a row
    per workload with the runs' agreement and ratios."""
    pytest.importorskip("trl")
    result = run_script([str(ROOT / "bench" / "gpu.py"), "--dry-run", "--parts", "e2e"],
                        tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu.json").read_text())["results"]["e2e"]
    assert "error" not in row, row
    assert row["workload"] == "long_prompt" and row["same_samples"] == row["steps"] == 2
    assert 0 < row["token_ratio"] < 1 and row["training_ratio"] > 0
    assert (tmp_path / "e2e.png").stat().st_size > 0
