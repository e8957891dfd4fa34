"""The benchmark scripts run as they stand (at toy sizes), so a GPU session can trust them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert all(key not in results for key in ("skipped",))


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
    assert "lean <= 1.1x full time at <= 1/10 memory: INCOMPLETE" in bars
    assert "PASS" not in bars
    assert (tmp_path / "gpu.json").exists()  # written as the rows came in
