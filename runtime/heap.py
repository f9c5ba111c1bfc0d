"""The C library's heap: freed heap given back, one arena for a worker, a fixed mmap threshold
for every process that runs a torch stage, and zeros of which only the pages written are resident
(`sparse_zeros`).

The one module that calls glibc's malloc functions (through ctypes; musl, macOS and Windows have
neither `mallopt` nor `malloc_trim`, and each call is then a no-op that says so).

`steady_heap` (called where `runtime.engines.pytorch` is imported: a torch worker, the profile's
fresh children, the profiling process): a torch stage's peak is the heap's high-water mark (freed
activations stay resident as free heap: SmolLM2's middle stage held ~150 MiB live and ~130 MiB
free inside a 285 MiB heap at its peak), and with glibc's defaults it moved from one run to the
next with nothing but the order of allocations changing (Python's hash seed, the address layout,
and when the transport's thread allocates: one SmolLM2 int4 LoRA keeping stage 340-397 MiB, h26 /
h34; the `smollm2-torch` plan's per-block middle stage 467-495 MiB in five runs of one plan, and
1.05 / 1.09 of its plan in h44's runs under load). glibc starts with a 128 KiB mmap threshold and
raises it to the size of each mapped block freed (up to 32 MiB); a threshold set by `mallopt` is
fixed (the rise off): every block under it comes from the heap, every block over it is mapped and
unmapped on free. At 2 MiB (this default: every widened int4 MLP weight, 3.4 MiB on SmolLM2, is
mapped on its own) the same middle stage peaked 448.7-449.7 MiB in four runs, set at this engine's
import as at the interpreter's start; at 4 MiB it still spread 338-389 MiB (h34). Its cost: the
widened weights faulted in afresh each forward and backward, ~8% more CPU a worker (h57).

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
import mmap
import os

import numpy as np

# glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_M_TRIM_THRESHOLD = -1

# A block of this size or more is mapped on its own and unmapped when freed; smaller ones come from
# the heap: a SmolLM2 layer's activations (0.3-0.8 MiB) stay there, its widened int4 MLP weights
# (3.4 MiB) are mapped (MEMORY_NOTES.md, helpers h34 and h57).
STEADY_MMAP_THRESHOLD_BYTES = 2 * 2 ** 20

# glibc's own starting mmap and trim thresholds (malloc.h's DEFAULT_MMAP_THRESHOLD_MIN and
# DEFAULT_TRIM_THRESHOLD): `start_heap`.
START_MMAP_THRESHOLD_BYTES = 128 * 2 ** 10
START_TRIM_THRESHOLD_BYTES = 128 * 2 ** 10


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def steady_heap(mmap_threshold: int = STEADY_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `mmap_threshold` bytes (its dynamic rise off; the trim threshold
    stays glibc's 128 KiB), for the rest of this process and the children it forks: set alike in a
    torch worker and the profile's fresh children (`runtime.profiling.fresh`), before their stage's
    first tensor, so a plan's figures and a run are measured under one heap. False where the C
    library has no `mallopt`. A threshold the environment sets (glibc's MALLOC_MMAP_THRESHOLD_, read
    at the process's start, which fixes it too) is left as it is: whoever set it asked for that heap
    (tests/runtime/test_torch_weight_pass.py measures a W's rise under 64 KiB)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return True
    libc = _libc()
    try:
        return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    except AttributeError:
        return False


def start_heap() -> bool:
    """Fix glibc's mmap and trim thresholds at their starting values (128 KiB each), as a process that
    never freed a mapped block has them: every block of 128 KiB or more mapped and unmapped on free,
    free heap over 128 KiB at the top given back. `train-local` calls it before its steps
    (`jobs.train.causal_lm`): the evaluation before them freed ONNX Runtime's large blocks, which
    raised the mmap threshold to 32 MiB and the trim threshold to twice that, and the steps' large
    blocks (widened int4 weights, the loss's chunks of logits) then came from the heap and stayed
    resident as free heap under their peak: SmolLM2 int4 per-block 556 MiB after an evaluation
    against its planned 536 (the mmap threshold alone fixed back: 564, the trim threshold still
    64 MiB). False where the C library has no `mallopt`; thresholds the environment sets are left."""
    libc = _libc()
    try:
        if libc is None:
            return False
        ok = True
        for name, param, value in (("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, START_MMAP_THRESHOLD_BYTES),
                                   ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, START_TRIM_THRESHOLD_BYTES)):
            if not os.environ.get(name):
                ok = libc.mallopt(param, int(value)) == 1 and ok
        return ok
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


def sparse_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A writable array of zeros of which only the pages written become resident, each a small page:
    a row gradient made dense (`RowGradient.dense`: the tied table's copy the exchange sends). numpy
    advises huge pages for an array of 4 MiB or more (`madvise(MADV_HUGEPAGE)`), so each row written
    into its zeros faults in the whole 2 MiB page around it: the 49152 x 576 tied table's copy with
    the rows of 4 x 128 tokens held ~14 MiB where its rows' own pages are ~1 MiB, and up to the whole
    table (108 MiB) where the tokens spread over the vocabulary (benchmarks/MEMORY_NOTES.md, helper
    h71). Anonymous memory of its own, advised against huge pages where the system offers that
    (Linux; elsewhere a plain mapping, whose pages come as the system gives them); unmapped when the
    array goes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: a page only read stays the zero page
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        buffer.madvise(advice)
    return np.frombuffer(buffer, dtype).reshape(shape)
