import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_and_checks_itself(script):
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unpacked" in result.stdout
