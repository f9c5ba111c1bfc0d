"""The C library's heap: the malloc settings a PyTorch process runs under, and freed heap given back.

The one module that calls glibc's malloc functions (through ctypes; musl, macOS and Windows have
neither `mallopt` nor `malloc_trim`, and each call is then a no-op that says so).

Why the settings (`steady_heap`): a keeping PyTorch stage's peak is the heap's high-water mark (freed
activations stay resident), and with glibc's defaults it moved ~20% from one fresh interpreter to
the next with nothing but Python's hash seed and the address layout changing: one SmolLM2 int4 LoRA
stage of 12 layers, 319-392 MiB over ten runs (benchmarks/MEMORY_NOTES.md, helpers h26 and h34).
glibc starts with a 128 KiB mmap threshold and raises it to the size of each mapped block that is
freed (up to 32 MiB), so where in a run it rises, and so which later tensors land in the heap,
depends on the order of allocations. A fixed threshold turns the rise off (glibc: any of the
thresholds set by `mallopt` does): every block under it comes from the heap, every block over it is
mapped and unmapped on free. Which threshold, and what it costs, is measured in MEMORY_NOTES.md.
"""
from __future__ import annotations

import ctypes

# glibc's mallopt parameter (malloc.h)
_M_MMAP_THRESHOLD = -3

# A block of this size or more is mapped on its own and unmapped when freed; smaller ones come from
# the heap. Measured on one keeping SmolLM2 int4 LoRA stage (12 layers, 2 in flight) in fresh
# interpreters with random hash seeds (MEMORY_NOTES.md, helper h34): glibc's default spread its peak
# ~11%; fixed at 4 MiB (a layer's activations, 0.3-0.8 MiB, and its widened int4 weights, up to
# 3.4 MiB, from the heap as with the risen default) ~3% at the default's CPU; at 1 MiB ~2% but
# ~1.2x the CPU (the widened weights mapped and faulted in afresh every step); 8 MiB 6%, 32 MiB 15%.
STEADY_MMAP_THRESHOLD_BYTES = 4 * 2 ** 20


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def steady_heap(mmap_threshold: int = STEADY_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `mmap_threshold` bytes (its dynamic rise off; the trim threshold
    stays glibc's 128 KiB), for the rest of this process and the children it forks. Call it before a
    PyTorch stage allocates its first activation: a worker and the profile's fresh children
    (`runtime.profiling.fresh`) run under it alike, so a profile's keep line is measured as a worker
    then runs. False where the C library has no `mallopt`."""
    libc = _libc()
    try:
        return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    except AttributeError:
        return False


def release_free_heap() -> bool:
    """Give the heap memory this process has freed back to the OS (glibc's `malloc_trim`): glibc
    keeps freed memory mapped for reuse, so what an earlier phase freed (an evaluation's ONNX Runtime
    sessions: 1.1 GB under SmolLM2's LoRA training) would still be resident under the next one's
    peak. False where the C library has no `malloc_trim` (musl, macOS, Windows): nothing to do there."""
    libc = _libc()
    try:
        if libc is None:
            return False
        libc.malloc_trim(0)
    except AttributeError:
        return False
    return True
