"""bench/megatron.py runs and measures what its table claims (the megatron environment)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


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
        assert abs(row["tree"]["loss"] - row["padded"]["loss"]) < 1e-5, workload
        assert row["tree"]["rows"] < row["padding_free"]["rows"] == row["tokens"]
    for workload, row in results["CP=2"].items():
        assert row["tree"]["exchange"] == row["formula"] > 0, workload
        assert "padded" not in row  # Megatron's local attention refuses CP
        assert abs(row["tree"]["loss"] - results["TP=1"][workload]["tree"]["loss"]) < 1e-5
