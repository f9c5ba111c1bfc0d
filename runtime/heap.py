"""The C library's heap: freed heap given back, one arena for a worker, and a fixed mmap threshold
(measured; no caller yet).

The one module that calls glibc's malloc functions (through ctypes; musl, macOS and Windows have
neither `mallopt` nor `malloc_trim`, and each call is then a no-op that says so).

`steady_heap` (measured, not called yet): a keeping PyTorch stage's peak is the heap's high-water
mark (freed activations stay resident), and with glibc's defaults it moves 11-16% from one fresh
interpreter to the next with nothing but Python's hash seed and the address layout changing (one
SmolLM2 int4 LoRA stage of 12 layers: 340-397 MiB; benchmarks/MEMORY_NOTES.md, helpers h26 and h34).
glibc starts with a 128 KiB mmap threshold and raises it to the size of each mapped block freed (up
to 32 MiB); a threshold set by `mallopt` is fixed (the rise off): every block under it comes from the
heap, every block over it is mapped and unmapped on free. Fixed at 4 MiB (this default) and set
where a torch worker imports its engine, the stage still spread 338-389 MiB and the profile's fresh
keep line still charged 0.93-0.99x a keeping worker's peak, so nothing calls it; 1-2 MiB set at an
interpreter's start measured ~2% at +6-26% CPU (the widened int4 weights mapped and faulted in
afresh each step), not yet tried where a worker would set it.

`one_arena` (a worker calls it before its transport starts threads): glibc gives a thread that
allocates while another holds the main heap an arena of its own (up to 8 per core), and memory freed
in one arena is never reused by an allocation served from another. A worker's transport threads and
its compute thread each had their own: the head stage of a small MNN full fine-tuning plan (the fused
LM head + loss over a 49152 x 256 tied table, tests/jobs/test_full_finetune_plan.py) peaked at
320.0-320.3 MiB against 315.4 planned with glibc's default, 306.0-306.1 with one arena; the stage
before it 387.7-391.7 -> 384.9-385.4 (MALLOC_ARENA_MAX=1 in the workers' environment, two runs each;
benchmarks/MEMORY_NOTES.md, helper h51). The profile measures in one thread's heap, so one arena is
also what its figures describe.
"""
from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# A block of this size or more is mapped on its own and unmapped when freed; smaller ones come from
# the heap: a SmolLM2 layer's activations (0.3-0.8 MiB) and its widened int4 weights (up to 3.4 MiB),
# as under glibc's risen default, so the CPU a step is the default's (MEMORY_NOTES.md, helper h34).
STEADY_MMAP_THRESHOLD_BYTES = 4 * 2 ** 20


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def steady_heap(mmap_threshold: int = STEADY_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `mmap_threshold` bytes (its dynamic rise off; the trim threshold
    stays glibc's 128 KiB), for the rest of this process and the children it forks. Meant to be set
    alike in a torch worker and the profile's fresh children (`runtime.profiling.fresh`) before their
    first tensor, once a threshold is found that makes a keeping stage's peak repeat (the module's
    docstring: 4 MiB does not). False where the C library has no `mallopt`."""
    libc = _libc()
    try:
        return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    except AttributeError:
        return False


def one_arena() -> bool:
    """Serve every thread of this process from one malloc arena (glibc's M_ARENA_MAX = 1, as the
    environment's MALLOC_ARENA_MAX=1 would): memory one thread frees is then reused by the next
    allocation of any thread. Effective for arenas not yet made: called before the process starts
    threads. False where the C library has no `mallopt`."""
    libc = _libc()
    try:
        return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1
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
