"""Which compute backends really run on this device (names: `ir.backend.BackendSpec`).

`discover()` lists the backends that run here, probed in child processes so a broken driver or a
torch install that fails on import cannot disturb this process:

* MNN: `runtime.engines.mnn_kernels.available_backends()`, which reports a backend MNN silently
  replaces by the CPU (it only logs `Can't Find type=N backend, use 0 instead`) as absent.
* torch: present when it is installed and imports in a child process (which also asks
  `torch.cuda.is_available()` and the device count). The probe runs once per process. torch is
  never imported here: only `runtime.engines.pytorch` may import it, and importing it costs ~240 MiB.

Thread variants: the CPU backends are listed for 1, 2, 4, ... threads up to the limit (the CPU
count, or `max_threads` if smaller), plus the limit itself, so a 6-CPU machine gets t1, t2, t4,
t6. Every variant is a separate backend for the profiler and the planner.

`present_backends(names)` is the profiler's filter: of the backends asked for, those the stage
engines can really drive here, and why each other one was skipped.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Sequence

from ir.backend import DEVICES, BackendSpec, parse_backend
from runtime.engines import (
    mnn_kernels as K,  # loads MNN; a device without it is not a Confidant device
)
from runtime.engines.single import torch_installed

# Discovery -------------------------------------------------------------------------------------

_TORCH_PROBE = ("import torch\n"
                "ok = torch.cuda.is_available()\n"
                "print('CONFIDANT_TORCH', int(ok), torch.cuda.device_count() if ok else 0, flush=True)\n")


@functools.lru_cache(maxsize=1)
def torch_devices(timeout_s: float = 120.0) -> tuple[bool, int]:
    """(torch imports here, number of usable CUDA devices), probed once in a child process.

    A child, so that this process neither pays torch's import (~240 MiB, seconds) nor inherits a
    CUDA context, and a broken install (or a driver that hangs) cannot take it down."""
    if not torch_installed():
        return False, 0
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False, 0
    for line in proc.stdout.splitlines():
        if line.startswith("CONFIDANT_TORCH "):
            _, ok, count = line.split()
            return True, int(count) if ok == "1" else 0
    return False, 0


def thread_variants(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `limit`, and `limit` itself."""
    if limit < 1:
        raise ValueError(f"thread limit must be >= 1, got {limit}")
    counts, t = [], 1
    while t < limit:
        counts.append(t)
        t *= 2
    return tuple(counts + [limit])


def discover(max_threads: int | None = None) -> list[BackendSpec]:
    """The backends that really run on this machine, MNN's first, cpu thread variants ascending.

    `max_threads` caps the thread variants (default and upper bound: the CPU count)."""
    if max_threads is not None and (isinstance(max_threads, bool) or not isinstance(max_threads, int)
                                    or max_threads < 1):
        raise ValueError(f"max_threads must be an integer >= 1, got {max_threads!r}")
    cpus = os.cpu_count() or 1
    threads = thread_variants(min(cpus, max_threads) if max_threads else cpus)

    found: list[BackendSpec] = []
    mnn = K.available_backends()
    for device in DEVICES["mnn"]:
        if not mnn.get(device, False):
            continue
        if device == "cpu":
            found += [BackendSpec("mnn", "cpu", threads=t) for t in threads]
        else:
            found.append(BackendSpec("mnn", device))
    torch_ok, gpus = torch_devices()
    if torch_ok:
        found += [BackendSpec("torch", "cpu", threads=t) for t in threads]
        found += [BackendSpec("torch", "cuda", index=i) for i in range(gpus)]
    return found


def _torch_importable() -> bool:
    if not torch_installed():
        return False
    try:
        import runtime.engines.pytorch  # noqa: F401  (the only module that imports torch)
    except Exception:  # a broken torch install is as good as none
        return False
    return True


def present_backends(names: Sequence[str], cpus: int | None = None) -> tuple[list[BackendSpec], dict[str, str]]:
    """The requested backends that really run here, and why each other one was skipped."""
    cpus = cpus or os.cpu_count() or 1
    wanted = [parse_backend(n) for n in names]
    present: list[BackendSpec] = []
    skipped: dict[str, str] = {}
    mnn_devices = K.available_backends() if any(b.engine == "mnn" for b in wanted) else {}
    torch_ok = _torch_importable() if any(b.engine == "torch" for b in wanted) else False
    for b in wanted:
        if b in present or b.name in skipped:
            continue
        if b.engine == "mnn" and not mnn_devices.get(b.device, False):
            skipped[b.name] = f"MNN has no working {b.device} backend here"
        elif b.engine == "mnn" and b.device != "cpu":
            skipped[b.name] = "the MNN stage engine drives the CPU backend only"
        elif b.engine == "torch" and not torch_ok:
            skipped[b.name] = "torch cannot be imported"
        elif b.engine == "torch" and b.device != "cpu":
            skipped[b.name] = "the torch stage engine runs on the CPU only"
        elif b.thread_count > cpus:
            skipped[b.name] = f"{b.threads} threads on a machine with {cpus} CPUs"
        else:
            present.append(b)
    return present, skipped
