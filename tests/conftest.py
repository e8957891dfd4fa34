import os
from pathlib import Path

# Compiled FlexAttention tests reuse one inductor cache inside the work tree (ignored by git).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor")
)

# CI runs the same examples every time (a failure there reproduces locally with CI=1).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# TREEPACK_TOLERANCE_LOG=<path>: record every tolerance check (tests/support/tolerance.py);
# unset: nothing.
import tolerance  # noqa: E402, F401
