"""The one chunked log-softmax every log-prob of treepack goes through.

``log_softmax(logits.float(), -1)`` over ``[T', V]`` logits keeps a ``[T', V]`` float32 tensor
for backward (and the entropy two more): at T' = 16k rows and V = 152k that is 10 GB each,
more than the bfloat16 logits themselves. :func:`normalise` computes only what a loss reads
(the log-prob of each picked token, and optionally each row's entropy) one chunk of rows at a
time, and recomputes the chunk in backward. The logits come from a *source*:

- :class:`Logits`: the model's ``[T', V]`` logits, read a chunk at a time (kept for backward,
  as any use of them is);
- :class:`Head`: hidden states ``[T', H]`` and the LM head, whose chunk of logits is computed
  here and recomputed in backward, so no ``[T', V]`` tensor ever exists.

Values and gradients are computed in float32 at least; a source's gradient is rounded to its
dtype once per element (the head's weight gradient is accumulated in one float32 buffer).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["normalise", "Logits", "Head", "head_logits", "log_softmax_rows",
           "default_chunk_size", "to_device", "CHUNK_BYTES", "DEFAULT_CHUNK_BYTES",
           "FUSED_DEVICES"]

# Bytes of float32 logits per chunk, by device type. On a GPU the chunk must be large for the
# per-chunk work (and, from a head, its three matmuls) to run near peak and to amortise
# (measured on an H200 at V = 151,936: 110-row chunks took 3.3x the time of full logits,
# 4096-row chunks 1.1x); 1 GiB is ~1,770 rows there. The peak is a few chunks, never growing
# with T'.
CHUNK_BYTES = {"cuda": 1 << 30}
DEFAULT_CHUNK_BYTES = 1 << 26  # 64 MiB elsewhere: on CPU larger chunks gain little


def default_chunk_size(vocab: int, device: torch.device | str | None = None) -> int:
    """Rows per chunk: ``CHUNK_BYTES`` of float32 logits on ``device``'s type (1 GiB on CUDA,
    64 MiB elsewhere), at least one row.

    Args:
        vocab: V, the logits per row.
        device: where the chunks are computed (default: the CPU).

    Returns:
        The number of rows.
    """
    kind = torch.device(device).type if device is not None else "cpu"
    return max(1, CHUNK_BYTES.get(kind, DEFAULT_CHUNK_BYTES) // (4 * vocab))


# ---------------------------------------------------------------------- sources of logits


class Logits:
    """Logits ``[T', V]`` as they are: a chunk is a view (or a gather) of their rows."""

    keeps_logits = False  # backward needs nothing of a chunk once its gradient is formed
    vocab_group, vocab_start = None, 0  # the whole vocabulary (see Head)

    def __init__(self, logits: Tensor):
        self.tensors = (logits,)
        self.vocab, self.device, self.dtype = logits.shape[1], logits.device, logits.dtype

    def logits(self, tensors, rows) -> tuple[Tensor, bool]:
        """A chunk's logits, and whether they are a fresh tensor (may change in place)."""
        return tensors[0][rows], isinstance(rows, Tensor)

    def recompute(self):
        return contextlib.nullcontext()

    def grad_buffers(self, tensors) -> list:
        return [torch.zeros_like(tensors[0])]

    def add_grad(self, buffers, tensors, chunk: _Chunk, gz: Tensor, z: Tensor) -> None:
        grad = buffers[0]
        if chunk.distinct is not None:  # a row at several temperatures: sum, round once
            uniq, inverse = chunk.distinct
            summed = gz.new_zeros(len(uniq), gz.shape[1]).index_add_(0, inverse, gz)
            grad.index_copy_(0, uniq, summed.to(grad.dtype))
        elif isinstance(chunk.rows, slice):
            grad[chunk.rows] = gz
        else:
            grad.index_copy_(0, chunk.rows, gz.to(grad.dtype))

    def grads(self, buffers, tensors) -> tuple:
        return (buffers[0],)


class Head:
    """Logits ``softcap(scale * (hidden @ weight.T + bias))`` computed a chunk at a time.

    The matmul runs in the head's dtype (or under autocast in autocast's, which backward
    recomputes under too), the rest in float32 at least. ``softcap`` and ``scale`` are what
    models do after their head (Gemma 2's ``final_logit_softcapping``, Cohere's
    ``logit_scale``); the caller validates them.

    A vocabulary-parallel head (Megatron's output layer under tensor parallelism) gives
    ``vocab_group``, the process group over which the vocabulary is split, and
    ``vocab_start``, the first token of this rank's ``weight`` rows: :func:`normalise` then
    all-reduces each row's max, its sum of exponentials and its picked logit (and entropy)
    over the group, and every rank gets every value. The gradient of ``hidden`` is this
    rank's share (its vocabulary's): the caller sums it over the group, as Megatron's
    column-parallel layer does for its input.
    """

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                 scale: float = 1.0, softcap: float | None = None, vocab_group=None,
                 vocab_start: int = 0):
        self.tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
        self.vocab, self.device, self.dtype = weight.shape[0], hidden.device, weight.dtype
        self.scale, self.softcap = scale, softcap
        # a vocabulary-parallel head: this rank's rows vocab_start .. vocab_start + vocab - 1
        # of the vocabulary, the rest on the other ranks of vocab_group (normalise reduces)
        self.vocab_group, self.vocab_start = vocab_group, vocab_start
        self.keeps_logits = softcap is not None  # its derivative reads the capped logits
        kind = hidden.device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def logits(self, tensors, rows) -> tuple[Tensor, bool]:
        bias = tensors[2] if len(tensors) > 2 else None
        return head_logits(tensors[0][rows], tensors[1], bias, self.scale, self.softcap), True

    def fusable(self, entropy: bool) -> bool:
        """Whether a chunk's normalisation runs as compiled kernels on the matmul's own
        low-precision output (:func:`_fused`): a plain head (no soft-capping or
        scale; a bias and temperatures are fine) on a GPU, log-probs without entropies."""
        return (self.device.type in FUSED_DEVICES and self.softcap is None
                and self.scale == 1.0 and not entropy and self.vocab_group is None
                and self.tensors[0].dtype in (torch.float16, torch.bfloat16)
                and not self.autocast[1])

    def matmul(self, tensors, rows) -> Tensor:
        """A chunk's ``hidden @ weight.T`` in the head's dtype (no bias): what the fused
        kernels read."""
        return tensors[0][rows] @ tensors[1].T

    def recompute(self):
        kind, enabled, dtype = self.autocast
        return torch.autocast(kind, dtype=dtype, enabled=enabled)

    def grad_buffers(self, tensors) -> list:
        acc = torch.promote_types(tensors[1].dtype, torch.float32)
        return [torch.zeros_like(tensors[0])] + [torch.zeros(t.shape, dtype=acc, device=t.device)
                                                 for t in tensors[1:]]

    def add_grad(self, buffers, tensors, chunk: _Chunk, gz: Tensor, z: Tensor) -> None:
        hidden, weight = tensors[:2]
        if self.softcap is not None:  # z = cap * tanh(u / cap): dz/du = 1 - (z / cap)^2
            capped = z / self.softcap
            gz *= 1 - capped * capped
        if self.scale != 1.0:
            gz *= self.scale
        if len(buffers) > 2:
            buffers[2] += gz.sum(0, dtype=buffers[2].dtype)
        kind, autocast, autocast_dtype = self.autocast
        mm = autocast_dtype if autocast else weight.dtype  # the forward's matmul dtype
        gz = gz.to(mm)
        with torch.autocast(kind, enabled=False):
            grad_h = gz @ weight.to(mm)
            if isinstance(chunk.rows, slice):
                buffers[0][chunk.rows] = grad_h
            else:  # a hidden row read at several temperatures adds up
                buffers[0].index_add_(0, chunk.rows, grad_h.to(buffers[0].dtype))
            _add_matmul(buffers[1], gz.T, hidden[chunk.rows].to(mm))

    def grads(self, buffers, tensors) -> tuple:
        return (buffers[0], *(b.to(t.dtype) for b, t in zip(buffers[1:], tensors[1:])))


def head_logits(h: Tensor, weight: Tensor, bias: Tensor | None = None, scale: float = 1.0,
                softcap: float | None = None, temperature: float = 1.0) -> Tensor:
    """Logits ``softcap(scale * (h W^T + b)) / temperature`` of hidden states ``h`` [C, H], in
    float32 at least (the matmul in the input dtype): what a :class:`Head` computes per
    chunk.

    Args:
        h: [C, H] hidden states; ``weight`` [V, H] and ``bias`` [V] the head's.
        scale, softcap, temperature: as :class:`Head` (``softcap`` None: none).

    Returns:
        [C, V] logits.
    """
    z = h @ weight.T
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if bias is not None:
        z += bias.to(z.dtype)
    if scale != 1.0:
        z *= scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:
        z /= temperature
    return z


_FUSED_ACCUMULATE: dict[torch.device, bool] = {}  # addmm(out_dtype=float32) works there


def _add_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` in place, with ``out`` float32 and ``a``, ``b`` possibly lower.

    Same dtypes: ``addmm_``. Lower-precision inputs on CUDA: cuBLAS writes the float32 sum
    straight into ``out`` (``addmm(..., out_dtype=float32)``, PyTorch >= 2.8), so no [V, H]
    product is rounded to bfloat16 or copied; elsewhere the product is added in place.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if out.is_cuda and _FUSED_ACCUMULATE.get(out.device, True):
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            _FUSED_ACCUMULATE[out.device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FUSED_ACCUMULATE[out.device] = False  # this torch lacks it: the plain way
    out.add_(a @ b)


# ---------------------------------------------------------------------- the normalisation


def normalise(source: Logits | Head, rows: np.ndarray, temperature: np.ndarray | float,
              pick: np.ndarray, token: Tensor, *, entropy: bool = False,
              chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Picked log-probs (and row entropies) of ``log_softmax(source rows / temperature)``.

    Normalised row ``i`` is the source's row ``rows[i]`` divided by ``temperature[i]``; a
    source row may be normalised several times (at different temperatures), its repeats
    adjacent.

    Args:
        source: :class:`Logits` or :class:`Head`.
        rows: [R] host int array, nondecreasing: the source row of each normalised row.
        temperature: [R] host array of finite values > 0, or one number for every row
            (validated by the caller).
        pick: [P] host int array: the normalised row of each wanted log-prob.
        token: [P] token ids on the source's device: ``out[j] = logp[pick[j], token[j]]``.
        entropy: also return every normalised row's entropy (a ``-inf`` logit adds 0).
        chunk_size: normalised rows per chunk (default :func:`default_chunk_size`).

    Returns:
        ``(logp [P], entropy [R] or None)`` in float32 at least (float64 stays float64);
        autograd flows to the source's tensors.
    """
    work = torch.promote_types(source.dtype, torch.float32)
    plan = _ChunkPlan(rows, pick, temperature, work,
                      chunk_size or default_chunk_size(source.vocab, source.device),
                      source.device)
    out = _Normalise.apply(plan, source, token, entropy, *source.tensors)
    return (out[0], out[1]) if entropy else (out, None)


def log_softmax_rows(logits: Tensor, rows: np.ndarray, temperature: np.ndarray | float,
                     pick: np.ndarray, token: Tensor, *, with_entropy: bool = False,
                     chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Deprecated: ``normalise(Logits(logits), ...)``.

    Args:
        logits: [T', V] floating-point logits.
        rows, temperature, pick, token, chunk_size: as :func:`normalise`.
        with_entropy: its ``entropy``.

    Returns:
        As :func:`normalise`.
    """
    from treepack.core import deprecation

    deprecation.warn("treepack.softmax.log_softmax_rows",
                     "treepack.core.softmax.normalise(Logits(logits), ...)")
    return normalise(Logits(logits), rows, temperature, pick, token, entropy=with_entropy,
                     chunk_size=chunk_size)


class _Chunk(NamedTuple):
    a: int  # normalised rows [a, b)
    b: int
    lo: int  # its picks, in sorted order [lo, hi)
    hi: int
    rows: slice | Tensor  # its source rows
    temperature: Tensor | None  # [C, 1], or None at temperature 1
    distinct: tuple[Tensor, Tensor] | None  # distinct source rows and each row's among them


class _ChunkPlan:
    """Host-side chunking of the normalised rows, and device copies of the indices.

    Chunks never split a source row's repeats, so each row's gradient is summed in float32
    and rounded once. The picks are sorted by normalised row so that each chunk's picks are
    one contiguous range. A chunk of consecutive source rows reads them as a view, and a chunk
    at temperature 1 divides by nothing. Every index reaches the device in one copy, from
    pinned memory on a GPU, so building the plan does not wait for the GPU.
    """

    def __init__(self, rows, pick, temperature, work: torch.dtype, chunk: int, device):
        rows = np.asarray(rows, dtype=np.int64)
        pick = np.asarray(pick, dtype=np.int64)
        n = len(rows)
        temps = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,))
        bounds, a = [], 0
        while a < n:
            b = min(a + chunk, n)
            b = int(np.searchsorted(rows, rows[b - 1], side="right"))  # keep repeats together
            bounds.append((a, b))
            a = b
        order = np.argsort(pick, kind="stable")
        pick_sorted = pick[order]
        starts = np.searchsorted(pick_sorted, [a for a, _ in bounds] + [n])
        host = [rows, order, pick_sorted]
        distinct = []  # per chunk: its distinct source rows and each row's among them, or None
        for a, b in bounds:
            uniq, inverse = np.unique(rows[a:b], return_inverse=True)
            distinct.append(None if len(uniq) == b - a else (len(host), len(host) + 1))
            if len(uniq) < b - a:
                host += [uniq, inverse.reshape(-1)]
        ints = to_device(host, torch.int64, device)
        self.rows, self.order, self.pick_sorted = ints[:3]
        self.num_picks = len(pick)
        self.temperature = to_device([temps], torch.float64, device)[0].to(work)
        self.work = work
        self.chunks = []
        for i, (a, b) in enumerate(bounds):
            consecutive = distinct[i] is None and rows[b - 1] - rows[a] == b - a - 1
            self.chunks.append(_Chunk(
                a, b, int(starts[i]), int(starts[i + 1]),
                slice(int(rows[a]), int(rows[b - 1]) + 1) if consecutive else self.rows[a:b],
                None if (temps[a:b] == 1).all() else self.temperature[a:b, None],
                None if distinct[i] is None else tuple(ints[j] for j in distinct[i])))

    def logits(self, source, tensors, chunk: _Chunk, *, keep: bool) -> tuple[Tensor, Tensor,
                                                                               bool]:
        """The chunk's source logits, the same divided by the temperature in the work dtype,
        and whether the second may change in place (``keep``: the first must survive)."""
        z, fresh = source.logits(tensors, chunk.rows)
        scaled = z
        if scaled.dtype != self.work:
            scaled = scaled.to(self.work)
        if chunk.temperature is not None:
            scaled = scaled / chunk.temperature
        return z, scaled, scaled is not z or (fresh and not keep)


class _Normalise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _ChunkPlan, source, token, with_entropy, *tensors):
        group = source.vocab_group
        if group is not None:
            return _Normalise._forward_parallel(ctx, plan, source, token, with_entropy, tensors)
        n = plan.rows.shape[0]
        lse = tensors[0].new_empty(n, dtype=plan.work)
        entropy = tensors[0].new_empty(n, dtype=plan.work) if with_entropy else None
        logp = tensors[0].new_empty(plan.num_picks, dtype=plan.work)
        token_sorted = token[plan.order]
        fused = isinstance(source, Head) and source.fusable(with_entropy)
        for c in plan.chunks:
            if fused:
                _fused_forward(plan, source, tensors, c, token_sorted, lse, logp)
                continue
            _, z, fresh = plan.logits(source, tensors, c, keep=False)  # [C, V]
            lse[c.a:c.b] = torch.logsumexp(z, dim=-1)
            if c.hi > c.lo:
                local = plan.pick_sorted[c.lo:c.hi] - c.a
                logp[plan.order[c.lo:c.hi]] = (z[local, token_sorted[c.lo:c.hi]]
                                               - lse[c.a:c.b][local])
            if with_entropy:  # H = -sum p logp, a -inf logit adding 0
                logz = z.sub_(lse[c.a:c.b, None]) if fresh else z - lse[c.a:c.b, None]
                p = logz.exp()
                entropy[c.a:c.b] = p.mul_(logz.masked_fill_(logz.isneginf(), 0)).sum(-1).neg_()
        ctx.save_for_backward(token_sorted, None, lse, entropy, *tensors)
        ctx.plan, ctx.source = plan, source
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def _forward_parallel(ctx, plan: _ChunkPlan, source, token, with_entropy, tensors):
        """:meth:`forward` on one rank's share of the vocabulary: per chunk, the rows' max and
        sum of exponentials all-reduced (their log-sum-exp), then the picked logits (held
        by the rank whose share has the token, 0 elsewhere) and the entropies' shares in one
        all-reduce."""
        group = source.vocab_group
        n = plan.rows.shape[0]
        lse = tensors[0].new_empty(n, dtype=plan.work)
        entropy = tensors[0].new_empty(n, dtype=plan.work) if with_entropy else None
        logp = tensors[0].new_empty(plan.num_picks, dtype=plan.work)
        local_token = token[plan.order] - source.vocab_start
        owned = (local_token >= 0) & (local_token < source.vocab)
        local_token = local_token.clamp(0, source.vocab - 1)
        for c in plan.chunks:
            _, z, fresh = plan.logits(source, tensors, c, keep=False)  # [C, V / group]
            top = z.amax(-1)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            top = top.masked_fill(top.isneginf(), 0)  # a row of -inf everywhere: lse -inf
            total = (z - top[:, None]).exp().sum(-1)
            dist.all_reduce(total, group=group)
            lse[c.a:c.b] = top + total.log()
            picks = plan.pick_sorted[c.lo:c.hi] - c.a
            picked = z[picks, local_token[c.lo:c.hi]].where(owned[c.lo:c.hi], 0)
            if with_entropy:
                logz = z.sub_(lse[c.a:c.b, None]) if fresh else z - lse[c.a:c.b, None]
                share = logz.exp().mul_(logz.masked_fill_(logz.isneginf(), 0)).sum(-1).neg_()
                both = torch.cat((picked, share))
                dist.all_reduce(both, group=group)
                picked, entropy[c.a:c.b] = both[:picked.shape[0]], both[picked.shape[0]:]
            else:
                dist.all_reduce(picked, group=group)
            logp[plan.order[c.lo:c.hi]] = picked - lse[c.a:c.b][picks]
        ctx.save_for_backward(local_token, owned, lse, entropy, *tensors)
        ctx.plan, ctx.source = plan, source
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    @once_differentiable  # the backward recomputes in chunks: no graph for a second order
    def backward(ctx, grad_logp, grad_entropy=None):
        token_sorted, owned, lse, entropy, *tensors = ctx.saved_tensors
        plan, source = ctx.plan, ctx.source
        if grad_logp is None and grad_entropy is None:
            return (None, None, None, None, *([None] * len(tensors)))
        with source.recompute():
            grads = _Normalise._backward(plan, source, tensors, token_sorted, owned, lse,
                                         entropy, grad_logp, grad_entropy)
        return (None, None, None, None, *grads)

    @staticmethod
    def _backward(plan, source, tensors, token_sorted, owned, lse, entropy, grad_logp,
                  grad_entropy):
        """Every gradient, a chunk at a time; on a share of the vocabulary (``owned``: the
        picks whose token is this rank's) the same formulas with the global log-sum-exp and
        entropy, so each rank's gradients are its share's."""
        buffers = source.grad_buffers(tensors)
        # d logp[j] / d z[pick j] = onehot(token j) - softmax: each row needs its picks' sum
        g_row = lse.new_zeros(lse.shape[0])
        g_pick = None
        if grad_logp is not None:
            g_pick = grad_logp.to(lse.dtype)[plan.order]  # sorted by normalised row
            g_row.index_add_(0, plan.pick_sorted, g_pick)
        fused = isinstance(source, Head) and entropy is None and source.fusable(False)
        for c in plan.chunks:
            if fused:
                gz = _fused_backward(plan, source, tensors, c, token_sorted, lse, g_row, g_pick)
                source.add_grad(buffers, tensors, c, gz, None)
                continue
            z, scaled, fresh = plan.logits(source, tensors, c, keep=source.keeps_logits)
            logz = scaled.sub_(lse[c.a:c.b, None]) if fresh else scaled - lse[c.a:c.b, None]
            if grad_entropy is None:  # softmax and its gradient in place
                gz = logz.exp_().mul_(-g_row[c.a:c.b, None])
            else:  # dH/dz = -p * (logp + H): gz = -p * (g_row + g_H * (logp + H)), in place
                p = logz.exp()
                gz = (logz.masked_fill_(logz.isneginf(), 0).add_(entropy[c.a:c.b, None])
                      .mul_(grad_entropy[c.a:c.b, None]).add_(g_row[c.a:c.b, None])
                      .mul_(p).neg_())
            if g_pick is not None and c.hi > c.lo:
                g = g_pick[c.lo:c.hi] if owned is None else \
                    g_pick[c.lo:c.hi].where(owned[c.lo:c.hi], 0)
                gz.index_put_((plan.pick_sorted[c.lo:c.hi] - c.a, token_sorted[c.lo:c.hi]),
                              g, accumulate=True)
            if c.temperature is not None:
                gz /= c.temperature
            source.add_grad(buffers, tensors, c, gz, z)
        return source.grads(buffers, tensors)


# ---------------------------------------------------------------------- fused chunks on a GPU

# Where a plain head's chunks run through compiled kernels (Head.fusable). Eager,
# a chunk's float32 logits are written, read and rewritten by one kernel per operation (the
# cast, the log-sum-exp, the softmax and its gradient): ~54 bytes moved per logit, which made
# the lean head 1.7x slower than plain full logits on an H200. Fused, the log-sum-exp and
# the softmax gradient each read the matmul's bfloat16 output once: ~20 bytes.
FUSED_DEVICES = {"cuda"}


def _transformed(z: Tensor, bias: Tensor | None, temperature: Tensor | None) -> Tensor:
    x = z.float()
    if bias is not None:
        x = x + bias.float()
    if temperature is not None:
        x = x / temperature
    return x


def _chunk_lse(z, bias, temperature):
    return torch.logsumexp(_transformed(z, bias, temperature), dim=-1)


def _chunk_grad(z, bias, temperature, lse, g_row):
    # d/dz of sum_rows g_row * (-logsumexp(z / T)): -softmax * g_row / T (the picks added after)
    x = _transformed(z, bias, temperature)
    scaled = g_row[:, None] if temperature is None else g_row[:, None] / temperature
    return torch.exp(x - lse[:, None]) * -scaled


_KERNELS: dict = {}


def _fused(name: str, *args) -> Tensor:
    """Kernel ``name`` ("lse" or "grad") compiled once per process, every chunk's row count
    symbolic (the last chunk of every pack differs). Where compiling fails (no working
    Triton, say) it warns once and runs the same function eagerly from then on."""
    plain = {"lse": _chunk_lse, "grad": _chunk_grad}[name]
    if name not in _KERNELS:
        _KERNELS[name] = torch.compile(plain, dynamic=None)
    try:
        return _KERNELS[name](*args)
    except torch.OutOfMemoryError:
        raise  # the chunk, not the compiler: eager would need more
    except Exception as e:  # noqa: BLE001 - a compiler failure of any kind: run it eagerly
        if _KERNELS[name] is plain:
            raise
        import warnings

        warnings.warn(f"treepack: compiling the lean head's fused {name} kernel failed "
                      f"({type(e).__name__}: {str(e)[:200]}); running it eagerly (slower, "
                      "the same values)", RuntimeWarning, stacklevel=2)
        _KERNELS[name] = plain
        return plain(*args)


def _dynamic_rows(*tensors) -> None:
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _bias(tensors):
    return tensors[2] if len(tensors) > 2 else None


def _fused_forward(plan, source, tensors, c, token_sorted, lse, logp) -> None:
    z = source.matmul(tensors, c.rows)  # [C, V] in the head's dtype
    bias = _bias(tensors)
    _dynamic_rows(z, c.temperature)
    lse[c.a:c.b] = _fused("lse", z, bias, c.temperature)
    if c.hi > c.lo:
        local = plan.pick_sorted[c.lo:c.hi] - c.a
        tok = token_sorted[c.lo:c.hi]
        picked = z[local, tok].float()  # as _transformed, one logit each
        if bias is not None:
            picked = picked + bias[tok].float()
        if c.temperature is not None:
            picked = picked / c.temperature[local, 0]
        logp[plan.order[c.lo:c.hi]] = picked - lse[c.a:c.b][local]


def _fused_backward(plan, source, tensors, c, token_sorted, lse, g_row, g_pick) -> Tensor:
    """The chunk's logit gradient in float32 (the head's matmuls round it once)."""
    z = source.matmul(tensors, c.rows)
    g, lse_c = g_row[c.a:c.b], lse[c.a:c.b]
    _dynamic_rows(z, c.temperature, g, lse_c)
    gz = _fused("grad", z, _bias(tensors), c.temperature, lse_c, g)
    if g_pick is not None and c.hi > c.lo:
        local = plan.pick_sorted[c.lo:c.hi] - c.a
        add = g_pick[c.lo:c.hi]
        if c.temperature is not None:
            add = add / c.temperature[local, 0]
        gz.index_put_((local, token_sorted[c.lo:c.hi]), add, accumulate=True)
    return gz


def to_device(arrays: list[np.ndarray], dtype: torch.dtype, device) -> list[Tensor]:
    """The arrays on ``device`` through one copy (pinned and asynchronous on a GPU).

    Args:
        arrays: host arrays (any lengths).
        dtype: ``torch.int64`` or ``torch.float64``.
        device: where they go.

    Returns:
        One tensor per array, views of one device buffer.
    """
    sizes = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.float64 if dtype == torch.float64
                                                          else np.int64, copy=False))
    device = torch.device(device)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(flat.split(sizes))
