"""Peak memory of one call: the CUDA allocator's peak on a GPU, the resident set on a CPU.

On a CPU the kernel keeps a high-water mark of the process's resident set (``VmHWM``) that
``/proc/self/clear_refs`` resets; the peak of a call is how far that mark rises above the
resident set before it. Freed heap pages are handed back to the OS first, or a call that
reuses them would show no rise at all.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import torch


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so the next step's peak shows in RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss(field: str) -> int:
    """``field`` (``"VmRSS:"``, ``"VmHWM:"``) of ``/proc/self/status`` in bytes; 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def peak_memory(device: torch.device, out: list):
    """Append to ``out`` the peak extra bytes the ``with`` body allocated on ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        out.append(torch.cuda.max_memory_allocated(device) - base)
        return
    release_freed_memory()
    base = _rss("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark
    except OSError:
        pass
    yield
    out.append(max(0, _rss("VmHWM:") - base))


@contextlib.contextmanager
def saved_storages(model):
    """``{storage address: bytes}`` of every tensor autograd saves for backward inside the
    ``with``, each storage once, the model's parameters and buffers skipped: what a rank
    holds for its backward at the end of a forward."""
    skip = {t.untyped_storage().data_ptr()
            for t in itertools.chain(model.parameters(), model.buffers())}
    held: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address and address not in skip:
            held.setdefault(address, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield held

