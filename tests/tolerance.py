"""Tolerances derived from the dtype and the computation, never fitted to one machine.

The rule: two floating-point computations of the same quantity may differ by

    rounding(dtype, scale, steps) = steps * eps(dtype) * scale

- ``eps(dtype)``: ``torch.finfo(dtype).eps`` of the precision the computation *rounds in*. That
  is the run's dtype, except where a model computes inside float32 even in a float64 run
  (transformers' eager softmax and RMSNorm upcasts, Kimi-Linear's float32 gates, the Mamba and
  Gated DeltaNet torch scans, float32 router losses, the float32 logits of Nemotron-H and
  Falcon-Mamba heads): such a float64 run is float32-accurate, and eps is float32's.
- ``scale``: the size of the values compared (``max |expected|``), or 1 for a relative error.
- ``steps``: how many roundings may accumulate between the two. A sum of n terms computed in
  two orders differs by at most ``n`` roundings of its largest partial sum (the worst case),
  and by about ``sqrt(n)`` for roundings that fall at random. The named allowances below give
  every test's number; a test that needs another says why where it uses it.

bfloat16 follows the spec (STYLE.md, after flash-attn): packed bfloat16 against a float32
reference may be at most twice the unpacked bfloat16 run's own error (``LOW_PRECISION_FACTOR``).

Every allowance stays far below the errors of the bugs the tests guard (siblings seeing each
other, a scan restarting from zeros, a wrong denominator): those are 1e-4 to 1e-1 of the values.

Measuring (opt-in): with ``TREEPACK_TOLERANCE_LOG=<path>`` set, every ``torch.testing.
assert_close``, ``pytest.approx`` comparison and :func:`within` called from tests/ appends one
JSON line (its site ``file:line``, the test, the measured error over the allowed one) to the
file, from spawned ranks too; ``python tests/tolerance.py <path>`` prints the worst ratio per
site. Unset, nothing is patched and :func:`within` is a plain comparison.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

ENV = "TREEPACK_TOLERANCE_LOG"
TESTS = Path(__file__).resolve().parent


def eps(dtype: torch.dtype) -> float:
    """The distance from 1 to the next number of ``dtype``: one rounding's relative error."""
    return torch.finfo(dtype).eps


def rounding(dtype: torch.dtype, size=1.0, steps: float = 1) -> float:
    """``steps`` roundings of ``dtype`` on values of size ``size`` (a tensor: its max |.|)."""
    return steps * eps(dtype) * (scale(size) if isinstance(size, torch.Tensor) else abs(size))


# ---- the allowances ---------------------------------------------------------------------------
# The tests' models are tiny (2 to 4 layers, hidden 64, MLP 96, vocabulary 97) and their packs
# short (at most 256 rows): a reduction sums at most TERMS terms, and an output or a gradient is
# reached through at most REDUCTIONS of them (8 a layer: norm, q/k/v, scores, softmax, values,
# output, two MLP; 2 layers; forward and backward).
TERMS = 256
REDUCTIONS = 32
OP_STEPS = TERMS  # one operation (a sum, a softmax, a log-softmax), worst case
MODEL_STEPS = REDUCTIONS * TERMS  # a model computed two ways, worst case: 8192
MODEL_STEPS_F32 = REDUCTIONS * math.isqrt(TERMS)  # the same, roundings as a random walk: 512

# The float64 exact-comparison allowance: relative error of one float64 model computation done
# two ways (packed and alone, in parts and whole, on ranks and in one process), worst case:
# 1.8e-12. float64 affords the worst case; anything larger is a different computation.
FLOAT64_EXACT = rounding(torch.float64, steps=MODEL_STEPS)
# One float64 operation done two ways (a log-softmax, a loss over a pack's rows): 5.7e-14.
FLOAT64_OP = rounding(torch.float64, steps=OP_STEPS)
# The float32-relative allowance: a float32 run of a model done two ways, and what a float64 run
# keeps of a model's float32 steps when they round gradients (RMSNorm's float32 backward summing
# rows): 6.1e-5. The worst case (8192 float32 roundings, 1e-3) would be the size of a bug, so the
# roundings count as a random walk; the bugs the tests guard (1e-4 and up) stay outside.
FLOAT32_RELATIVE = rounding(torch.float32, steps=MODEL_STEPS_F32)
# One float32 operation inside a float64 run (transformers' eager float32 softmax, a head's
# float32 logits and their log-softmax, Kimi-Linear's float32 gates over a scan): 3.1e-5.
FLOAT32_OP = rounding(torch.float32, steps=OP_STEPS)
# flash-attn's rule for low precision: the packed run's error against a float32 reference is at
# most twice the unpacked low-precision run's error against the same reference.
LOW_PRECISION_FACTOR = 2.0


def assert_within(actual, expected, rel: float, msg=None) -> None:
    """Every element of ``actual`` within ``rel * max |expected|`` of ``expected`` (an error
    relative to the values' size, which rounding is, not to each element's)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale(expected), msg=msg)


def scale(x) -> float:
    """The size of the values compared: ``max |x|`` (0 for an empty tensor)."""
    x = torch.as_tensor(x)
    return float(x.detach().abs().max()) if x.numel() else 0.0


# ---- recording (opt-in) -----------------------------------------------------------------------
def _site() -> tuple[str, str] | None:
    """``file:line`` of the innermost frame in tests/ (not this file), and of the outermost."""
    frame, inner, outer = sys._getframe(2), None, None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent == TESTS or TESTS in path.parents:
            if path.name != "tolerance.py":
                where = f"{path.relative_to(TESTS.parent)}:{frame.f_lineno}"
                inner = inner or where
                outer = where
        frame = frame.f_back
    return (inner, outer) if inner else None


def _record(kind: str, ratio: float, error: float, allowed: str, site=None) -> None:
    site = site or _site()
    if site is None:  # a call from the library or a framework, not a tolerance of ours
        return
    line = json.dumps(dict(site=site[0], caller=site[1], kind=kind, ratio=ratio, error=error,
                           allowed=allowed, test=os.environ.get("PYTEST_CURRENT_TEST", ""),
                           pid=os.getpid()))
    with open(os.environ[ENV], "a") as f:  # one short line per write: O_APPEND keeps it whole
        f.write(line + "\n")


def within(error, allowed) -> bool:
    """``error <= allowed``, recorded when measuring: ``assert within(err, tol), msg``."""
    error, allowed = float(error), float(allowed)
    if os.environ.get(ENV):
        ratio = error / allowed if allowed > 0 else (0.0 if error == 0 else math.inf)
        _record("within", ratio, error, f"{allowed:.3g}")
    return error <= allowed


def _leaves(x):
    from torch.utils._pytree import tree_leaves

    return [torch.as_tensor(v) for v in tree_leaves(x)]


def _assert_close_ratio(actual, expected, rtol, atol, site):
    from torch.testing._comparison import default_tolerances

    error, ratio, default = 0.0, 0.0, rtol is None
    for a, e in zip(_leaves(actual), _leaves(expected), strict=True):
        if not (a.is_floating_point() or e.is_floating_point()) or a.shape != e.shape:
            continue
        r, t = (rtol, atol) if not default else default_tolerances(a, e)
        a, e = a.detach().cpu().double(), e.detach().cpu().double()
        diff = torch.where(a == e, 0.0, (a - e).abs()).nan_to_num(0.0)
        allowed = t + r * e.abs()
        ratios = torch.where(allowed > 0, diff / allowed,
                             torch.where(diff > 0, math.inf, 0.0))
        if diff.numel():
            error, ratio = max(error, float(diff.max())), max(ratio, float(ratios.max()))
    kind = "assert_close default" if default else (
        "assert_close exact" if rtol == 0 and atol == 0 else "assert_close")
    _record(kind, ratio, error, "default" if default else f"rtol={rtol:.3g} atol={atol:.3g}",
            site)


def install() -> None:
    """Patch ``torch.testing.assert_close`` and ``pytest.approx``'s scalar comparison to record
    (idempotent; only when ``TREEPACK_TOLERANCE_LOG`` is set)."""
    if not os.environ.get(ENV) or getattr(torch.testing.assert_close, "_recording", False):
        return
    original = torch.testing.assert_close

    def assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        site = _site()
        try:
            return original(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)
        finally:
            if site is not None:
                try:
                    _assert_close_ratio(actual, expected, rtol, atol, site)
                except Exception:  # noqa: BLE001  recording never changes a test's outcome
                    pass

    assert_close._recording = True
    assert_close.__wrapped__ = original
    torch.testing.assert_close = assert_close

    try:
        from _pytest.approx import ApproxScalar  # pytest's private scalar comparison
    except ImportError:
        return
    scalar_eq = ApproxScalar.__eq__

    def __eq__(self, actual):
        result = scalar_eq(self, actual)
        try:
            tol, error = float(self.tolerance), abs(float(actual) - float(self.expected))
            ratio = error / tol if tol > 0 else (0.0 if error == 0 else math.inf)
            _record("approx", ratio, error, f"{tol:.3g}")
        except Exception:  # noqa: BLE001  non-numeric values: strict equality, nothing to record
            pass
        return result

    ApproxScalar.__eq__ = __eq__


install()  # spawned ranks import this module through their workers: they record too


def summary(*paths: str, top: int | None = None) -> list[dict]:
    """The worst record per site over the logs ``paths``, worst first."""
    worst: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            counts[r["site"]] = counts.get(r["site"], 0) + 1
            if r["site"] not in worst or r["ratio"] > worst[r["site"]]["ratio"]:
                worst[r["site"]] = r
    rows = sorted(worst.values(), key=lambda r: -r["ratio"])
    for r in rows:
        r["checks"] = counts[r["site"]]
    return rows[:top]


if __name__ == "__main__":
    paths = sys.argv[1:] or [os.environ[ENV]]
    rows = summary(*paths)
    print(f"{len(rows)} sites; worst measured error / allowed per site:")
    for r in rows:
        print(f"{r['ratio']:9.2e}  {r['site']:<42} {r['kind']:<21} err {r['error']:.2e} "
              f"allowed {r['allowed']:<22} x{r['checks']:<5} {r['test'].split(' ')[0]}")
