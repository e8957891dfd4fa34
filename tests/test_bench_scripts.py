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
