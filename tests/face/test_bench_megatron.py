"""bench/megatron.py runs and measures what its table claims (the megatron environment)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tolerance import FLOAT32_OP, FLOAT32_RELATIVE, within

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


def same_loss(a: float, b: float) -> bool:
    """Two float32 runs' mean losses (tolerance.FLOAT32_RELATIVE of their size)."""
    return within(abs(a - b), FLOAT32_RELATIVE * abs(b))


def test_megatron_bench_quick_run(tmp_path):
    """Two layouts at lengths / 64: the tree's loss is the padded step's, its rows fewer
    than padding-free's, and at CP = 2 each layer's exchange is the formula's bytes."""
    out = tmp_path / "megatron.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "megatron.py"), "--quick",
                           "--layouts", "TP=1", "CP=2", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| TP=1 | agent |" in done.stdout and "| CP=2 | grpo_long |" in done.stdout
    results = json.loads(out.read_text())
    for workload, row in results["TP=1"].items():
        assert same_loss(row["tree"]["loss"], row["padded"]["loss"]), workload
        assert row["tree"]["rows"] < row["padding_free"]["rows"] == row["tokens"]
        # over a budget: parts compute the tree's rows once, the split repeats prefixes
        parts, split = row["in_parts"], row["split"]
        assert parts["rows"] == row["tree"]["rows"] <= split["rows"], workload
        assert parts["budget"] < row["tree"]["rows"], workload
        for got in (parts, split):
            assert same_loss(got["loss"], row["tree"]["loss"]), (workload, got)
    assert "| TP=1 | grpo_long | " in done.stdout.split("The tree over a budget")[1]
    for workload, row in results["CP=2"].items():
        assert row["tree"]["exchange"] == row["formula"] > 0, workload
        assert "padded" not in row  # Megatron's local attention refuses CP
        assert same_loss(row["tree"]["loss"], results["TP=1"][workload]["tree"]["loss"])


@pytest.mark.parametrize("model", ["gdn", "mamba"])
def test_megatron_bench_quick_run_of_a_recurrent_hybrid(tmp_path, model):
    """``--model gdn`` (Gated DeltaNet) and ``--model mamba`` (megatron-core's MambaModel)
    at TP = 1, lengths / 64: the tree's loss is Megatron's padded step's (padding-free is
    treepack's path without sharing: megatron-core packs neither layer on a CPU), its rows
    fewer than padding-free's, and in parts the same loss again."""
    out = tmp_path / f"{model}.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "megatron.py"), "--quick",
                           "--model", model, "--layouts", "TP=1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model {model}" in done.stdout
    for workload, row in json.loads(out.read_text())["TP=1"].items():
        assert same_loss(row["tree"]["loss"], row["padded"]["loss"]), workload
        assert same_loss(row["padding_free"]["loss"], row["padded"]["loss"]), workload
        assert row["tree"]["rows"] < row["padding_free"]["rows"] == row["tokens"]
        assert same_loss(row["in_parts"]["loss"], row["tree"]["loss"]), workload


def test_megatron_bench_one_device_verifies_and_steps(tmp_path):
    """``--device cpu`` runs the GPU part's code: the tree equals every sequence alone
    (float32 within FLOAT32_RELATIVE; bfloat16 within 1.5x of the model's own error), then
    the steps."""
    out = tmp_path / "one.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "megatron.py"), "--device",
                           "cpu", "--quick", "--shape", "tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["megatron_core"] and "transformer_engine" in report
    verify = report["verify"]
    assert {(r["model"], r["dtype"]) for r in verify} == {
        (m, d) for m in ("gqa-rope", "window-64", "moe-replay", "mla-yarn", "gdn-hybrid",
                         "mamba-hybrid") for d in ("float32", "bfloat16")}
    assert {r["backend"] for r in verify} == {"segment", "parts"}  # on a CPU
    for row in verify:
        assert row["result"] == "PASS", row
        if row["dtype"] == "float32" and row["model"] == "gdn-hybrid":
            # megatron-core's float32 scan sums across rows (FLOAT32_OP of the values); the
            # decay's gradients sum it over every row and head, so only the bench's bar holds
            # them here (test_megatron.py checks them at float64, within FLOAT32_RELATIVE)
            assert within(row["logprobs"], FLOAT32_OP), row
        elif row["dtype"] == "float32":
            assert within(row["logprobs"], FLOAT32_RELATIVE), row
            assert within(row["grads"], FLOAT32_RELATIVE), row
    for workload, row in report["step"].items():
        assert row["rows"] < row["padding_free_rows"] == row["tokens"], workload
        assert row["budget"] < row["rows"] <= row["split_rows"], workload
        losses = [row[k]["loss"] for k in ("tree", "padding_free", "padded", "in_parts",
                                           "split")]
        assert same_loss(max(losses), min(losses)), (workload, losses)


def test_gpu_script_megatron_part(tmp_path):
    """bench/gpu.py's megatron part (a dry run: the installed megatron-core, no wheel for this
    Python in .whl/) records every verify row and a step row per workload, and its bar."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run",
                           "--parts", "megatron"], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["results"]["megatron"]
    assert not [r for r in rows if "error" in r], rows
    assert sum(r.get("result") == "PASS" for r in rows) == 24  # 6 models x 2 dtypes x 2
    assert {r["workload"] for r in rows if r.get("model") == "megatron step"} == {
        "grpo_long", "low_sharing", "agent"}
    assert "bar: megatron tree equals each sequence alone: PASS (24/24)" in done.stdout
