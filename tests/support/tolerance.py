"""Tolerances derived from the dtype and the computation, never fitted to one machine.

The rule: two floating-point computations of the same quantity may differ by

    rounding(dtype, size, steps) = steps * eps(dtype) * size

- ``eps(dtype)``: ``torch.finfo(dtype).eps`` of the precision the computation *rounds in*. That
  is the run's dtype, except where a model computes in float32 even in a float64 run:
  transformers' RMSNorm upcasts and eager softmax, Kimi-Linear's float32 gates, the Mamba and
  Gated DeltaNet torch scans, float32 router losses, the float32 logits of Nemotron-H and
  Falcon-Mamba heads. There the float64 run is float32-accurate and eps is float32's: two
  runs round their nearly equal float64 values to float32 alike, except where the two straddle
  a float32 rounding, and there one of them is a float32 step off (Kimi-Linear's gates: 1e-8
  in the log-probs on an Intel Xeon, 1e-9 on an AMD EPYC, against float64's 1e-15).
- ``size``: the size of the values compared (``max |expected|``), or 1 for a relative error.
- ``steps``: how many roundings may accumulate between the two. A sum of n terms computed in
  two orders differs by at most n roundings of its largest partial sum (the worst case), and
  by about sqrt(n) where the roundings fall at random. The named allowances below give the
  tests' numbers; a test that needs another says where its steps come from.

bfloat16 follows the spec (STYLE.md, after flash-attn): packed bfloat16 against a float32
reference may be at most twice the unpacked bfloat16 run's own error (:func:`low_precision`).

The tools: the named allowances (``FLOAT64_EXACT``, ``FLOAT64_OP``, ``FLOAT32_INSIDE``,
``FLOAT32_OP``, ``FLOAT32_RELATIVE``), :func:`inside` (which of them a model's own ops call
for), :func:`assert_within` (every element within an allowance of the values' size),
:func:`within` (a hand-written check, recorded) and :func:`negative_control`.

Every allowance stays below the errors of the bugs the tests guard (siblings seeing each other,
a scan restarting from zeros, a wrong denominator), 1e-4 to 1e-1 of the values: where a float32
worst case would reach them, the roundings count as a random walk.

Measuring (opt-in): with ``TREEPACK_TOLERANCE_LOG=<path>`` set, every ``torch.testing.
assert_close``, ``pytest.approx`` comparison and :func:`within` called from tests/ appends one
JSON line (its site ``file:line``, the test, the measured error over the allowed one) to the
file, from spawned ranks too; ``python tests/support/tolerance.py <path>`` prints the worst
ratio per site. Unset, nothing is patched and :func:`within` is a plain comparison.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch

ENV = "TREEPACK_TOLERANCE_LOG"
TESTS = Path(__file__).resolve().parents[1]  # tests/: this file is in tests/support/


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
# float32 roundings on the way to a log-prob of a float64 run: 2 norms and a gate, scan or
# softmax a layer, 4 layers, the final norm and the head
INSIDE_STEPS = 16

# The float64 exact-comparison allowance: relative error of a float64 computation with no float32
# step done two ways (packed and alone, in parts and whole, on ranks and in one process), worst
# case: 1.8e-12. float64 affords the worst case; anything larger is a different computation.
FLOAT64_EXACT = rounding(torch.float64, steps=MODEL_STEPS)
# One float64 operation done two ways (a log-softmax, a loss over a pack's rows): 5.7e-14.
FLOAT64_OP = rounding(torch.float64, steps=OP_STEPS)
# The values of a float64 run of a model that rounds to float32 inside, row by row (most
# transformers models: their norms' variance; gates, an eager softmax; see ``inside``): 1.9e-6.
FLOAT32_INSIDE = rounding(torch.float32, steps=INSIDE_STEPS)
# One whole float32 operation on the values compared (a log-softmax of a head's float32 logits,
# a float32 router loss) or on the way to them (a float32 chunked scan): 3.1e-5.
FLOAT32_OP = rounding(torch.float32, steps=OP_STEPS)
# The float32-relative allowance: a float32 run of a model done two ways, and gradients of a
# float64 run through float32 steps (the backward of RMSNorm's cast rounds every gradient that
# passes to float32): 6.1e-5. The worst case (8192 roundings, 1e-3) would be the size of a bug.
FLOAT32_RELATIVE = rounding(torch.float32, steps=MODEL_STEPS_F32)
# flash-attn's rule for low precision: the packed run's error against a float32 reference is at
# most twice the unpacked low-precision run's error against the same reference.
LOW_PRECISION_FACTOR = 2.0


# float32 ops that sum across rows: a chunked scan's batched matrix products and cumulative sums
# (Mamba2's SSD, transformers' Gated DeltaNet and Kimi Delta kernels); a plain matrix product
# (a linear layer, a router) works row by row
ROW_SUMS = {"bmm", "baddbmm", "cumsum"}


def float_ops(model, **inputs) -> dict[torch.dtype, set[str]]:
    """The aten ops ``model``'s forward on ``inputs`` runs, by the floating dtype they
    produce, found by watching every op (a TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: dict[torch.dtype, set[str]] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.setdefault(t.dtype, set()).add(func.overloadpacket.__name__)
            return out

    with torch.no_grad(), Watch():
        model(**inputs)
    return seen


def rounds_in(model, **inputs) -> torch.dtype:
    """The lowest floating precision ``model``'s forward on ``inputs`` computes in: float32
    for a float64 transformers model whose norms upcast (most), float64 for one that never
    leaves it (GPT-2)."""
    return max(float_ops(model, **inputs), key=eps, default=torch.float64)


def inside(model, *, grads: bool = False, **inputs) -> float:
    """The allowance for a float64 model's values (``grads``: gradients) computed two ways,
    from the ops its forward runs: FLOAT64_EXACT where it never leaves float64; else
    FLOAT32_RELATIVE for gradients (the backward of every float32 cast rounds them);
    FLOAT32_OP for values where a float32 op sums across rows (a chunked scan, whose chunks
    start elsewhere in the two runs: ``ROW_SUMS``), FLOAT32_INSIDE where its float32 steps
    are row by row (norms, gates, a softmax)."""
    ops = float_ops(model, **(inputs or {"input_ids": torch.tensor([[3, 4, 5, 6]])}))
    low = {op for dtype, names in ops.items() if dtype != torch.float64 for op in names}
    if not low:
        return FLOAT64_EXACT
    if grads:
        return FLOAT32_RELATIVE
    return FLOAT32_OP if low & ROW_SUMS else FLOAT32_INSIDE


def assert_within(actual, expected, rel: float, msg=None, size: float | None = None) -> None:
    """Every element of ``actual`` within ``rel * size`` of ``expected``: an error relative to
    the values' size, which rounding is, not to each element's. ``size`` defaults to
    ``max |expected|``; a sum whose terms cancel (a gradient) is as large as its terms."""
    size = scale(expected) if size is None else size
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * size, msg=msg)


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


_NEGATIVE = []  # inside negative_control(): checks that are meant to fail


@contextlib.contextmanager
def negative_control():
    """Checks made inside are a negative control's (a test run on purpose on broken code,
    ``with pytest.raises(AssertionError), negative_control():``): not recorded."""
    _NEGATIVE.append(True)
    try:
        yield
    finally:
        _NEGATIVE.pop()


def _record(kind: str, ratio: float, error: float, allowed: str, site=None) -> None:
    site = site or _site()
    if site is None or _NEGATIVE:  # the library's or a framework's call; a negative control
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


def low_precision(error, own) -> bool:
    """The rule for low precision (STYLE.md, after flash-attn): the packed run's error against
    a higher-precision reference is at most LOW_PRECISION_FACTOR times the unpacked run's own
    error there. Checked, and recorded, as what packing adds: ``error - own`` within
    ``(LOW_PRECISION_FACTOR - 1) * own`` (a packed run as good as the unpacked one adds 0)."""
    return within(max(float(error) - float(own), 0.0), (LOW_PRECISION_FACTOR - 1) * float(own))


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


def summary(*paths: str) -> tuple[list[dict], list[dict]]:
    """The worst passing record per site over the logs ``paths``, worst first; and the records
    above their allowance (a failing test's, or a negative control's not marked as one)."""
    worst: dict[str, dict] = {}
    counts: dict[str, int] = {}
    failed = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r["ratio"] > 1:
                failed.append(r)
                continue
            counts[r["site"]] = counts.get(r["site"], 0) + 1
            if r["site"] not in worst or r["ratio"] > worst[r["site"]]["ratio"]:
                worst[r["site"]] = r
    rows = sorted(worst.values(), key=lambda r: -r["ratio"])
    for r in rows:
        r["checks"] = counts[r["site"]]
    return rows, failed


if __name__ == "__main__":
    rows, failed = summary(*(sys.argv[1:] or [os.environ[ENV]]))
    print(f"{len(rows)} sites, {sum(r['checks'] for r in rows)} checks; the worst measured error "
          "over its allowance per site:")
    for r in rows:
        print(f"{r['ratio']:9.2e}  {r['site']:<44} {r['kind']:<20} err {r['error']:.2e}  "
              f"allowed {r['allowed']:<22} x{r['checks']:<5} {r['test'].split(' ')[0]}")
    if failed:
        print(f"{len(failed)} checks above their allowance:")
        for r in failed:
            print(f"{r['ratio']:9.2e}  {r['site']:<44} {r['test'].split(' ')[0]}")
