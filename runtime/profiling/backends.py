"""Compute backends: their names, which ones really run here, and the stage engine for each.

A backend is an engine, a device, and the device's setting, named `engine:device[:setting]`:

    mnn:cpu:t1     MNN on the CPU with 1 worker thread (cpu backends always name a thread count)
    mnn:opencl     MNN on a GPU through OpenCL (also vulkan, metal, cuda; no setting)
    torch:cpu:t2   PyTorch on the CPU with 2 threads
    torch:cuda:0   PyTorch on CUDA GPU 0 (the device index is required)

`BackendSpec.parse(name)` and `str(spec)` round-trip. The names are a superset of the
`engine:device:tN` names `runtime.profiling.compute` writes into device profiles, for the CPU; unlike
`runtime.profiling.compute.parse_backend`, a GPU name carries no thread count (`mnn:opencl`, not
`mnn:opencl:t1`), because GPU backends have no thread setting.

`discover()` lists the backends that really run on this machine, probed in child processes so a
broken driver or a torch install that fails on import cannot disturb this process:

* MNN: `runtime.engines.mnn_kernels.available_backends()`, which reports a backend MNN silently replaces
  by the CPU (it only logs `Can't Find type=N backend, use 0 instead`) as absent.
* torch: present when it is installed and imports in a child process (which also asks
  `torch.cuda.is_available()` and the device count). The probe runs once per process. torch is
  never imported here: only `runtime.engines.pytorch` may import it, and importing it costs ~240 MiB.

Thread variants: the CPU backends are listed for 1, 2, 4, ... threads up to the limit (the CPU
count, or `max_threads` if smaller), plus the limit itself, so a 6-CPU machine gets t1, t2, t4,
t6. Every variant is a separate backend for the profiler and the planner.

`make_stage_engine(spec, stage_spec)` builds the stage engine for a backend (through
`runtime.profiling.compute.make_engine`, the one place engines are built with the profiler's settings). The
stage engines drive the CPU only so far: MNN's non-CPU devices and torch CUDA are valid, may be
discovered, and raise `NotImplementedError` here, naming what is missing.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.engines.base import StageEngine
    from runtime.engines.stage import StageSpec

# Devices per engine, in listing order. MNN's are those runtime.engines.mnn_kernels probes (a test keeps the
# two in step); importing that module here would load MNN just to parse a name.
DEVICES: dict[str, tuple[str, ...]] = {
    "mnn": ("cpu", "opencl", "vulkan", "metal", "cuda"),
    "torch": ("cpu", "cuda"),
}
EXAMPLES = "e.g. mnn:cpu:t1, mnn:opencl, torch:cpu:t2, torch:cuda:0"


@dataclass(frozen=True)
class BackendSpec:
    """One backend. `threads`: worker threads, for (and only for) cpu devices; `index`: the GPU
    index, for (and only for) torch's cuda device. Construction validates, as `parse` does."""

    engine: str
    device: str
    threads: int | None = None
    index: int | None = None

    def __post_init__(self) -> None:
        problem = _problem(self.engine, self.device, self.threads, self.index)
        if problem:
            raise ValueError(f"backend {self.engine}:{self.device} (threads={self.threads}, "
                             f"index={self.index}): {problem}")

    @classmethod
    def parse(cls, name: str) -> "BackendSpec":
        """`engine:device[:setting]`; raises ValueError saying what is wrong with `name`."""
        if not isinstance(name, str):
            raise TypeError(f"backend name must be a str, not {type(name).__name__}")
        parts = name.split(":")
        if not 2 <= len(parts) <= 3 or not all(parts):
            raise ValueError(f"backend {name!r} is not engine:device[:setting] ({EXAMPLES})")
        engine, device = parts[0], parts[1]
        setting = parts[2] if len(parts) == 3 else None
        threads = index = None
        if setting is not None:
            if device == "cpu":
                if not re.fullmatch(r"t(0|[1-9][0-9]*)", setting):
                    raise ValueError(f"backend {name!r}: the cpu setting is a thread count tN, "
                                     f"not {setting!r} ({EXAMPLES})")
                threads = int(setting[1:])
            elif engine == "torch" and device == "cuda":
                if not re.fullmatch(r"0|[1-9][0-9]*", setting):
                    raise ValueError(f"backend {name!r}: the cuda setting is a device index N >= 0, "
                                     f"not {setting!r} ({EXAMPLES})")
                index = int(setting)
            else:
                index = -1  # any setting here is refused by _problem below, with its reason
        problem = _problem(engine, device, threads, index)
        if problem:
            raise ValueError(f"backend {name!r}: {problem}")
        return cls(engine, device, threads, index)

    def __str__(self) -> str:
        if self.threads is not None:
            return f"{self.engine}:{self.device}:t{self.threads}"
        if self.index is not None:
            return f"{self.engine}:{self.device}:{self.index}"
        return f"{self.engine}:{self.device}"

    @property
    def name(self) -> str:
        return str(self)


def _problem(engine: str, device: str, threads: int | None, index: int | None) -> str | None:
    """Why these fields name no backend (None when they do). Messages are relative to the name."""
    if engine not in DEVICES:
        return f"unknown engine {engine!r} (engines: {', '.join(DEVICES)})"
    if device not in DEVICES[engine]:
        return f"engine {engine} has no device {device!r} (devices: {', '.join(DEVICES[engine])})"
    if device == "cpu":
        if index is not None:
            return "a cpu backend has no device index"
        if threads is None:
            return f"a cpu backend needs a thread count, e.g. {engine}:cpu:t1"
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            return f"thread count must be an integer >= 1, not {threads!r}"
        return None
    if threads is not None:
        return f"{engine}:{device} has no thread setting (threads are for cpu backends)"
    if engine == "torch" and device == "cuda":
        if index is None:
            return "torch:cuda needs a device index, e.g. torch:cuda:0"
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            return f"device index must be an integer >= 0, not {index!r}"
        return None
    if index is not None:
        return f"{engine}:{device} takes no setting"
    return None


def parse_backend(name: str | BackendSpec) -> BackendSpec:
    """`BackendSpec.parse`, passing a BackendSpec through."""
    return name if isinstance(name, BackendSpec) else BackendSpec.parse(name)


# Discovery -------------------------------------------------------------------------------------

_TORCH_PROBE = ("import torch\n"
                "ok = torch.cuda.is_available()\n"
                "print('CONFIDANT_TORCH', int(ok), torch.cuda.device_count() if ok else 0, flush=True)\n")


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


@functools.lru_cache(maxsize=1)
def torch_devices(timeout_s: float = 120.0) -> tuple[bool, int]:
    """(torch imports here, number of usable CUDA devices), probed once in a child process.

    A child, so that this process neither pays torch's import (~240 MiB, seconds) nor inherits a
    CUDA context, and a broken install (or a driver that hangs) cannot take it down."""
    if not _torch_installed():
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
    from runtime.engines import mnn_kernels as K  # loads MNN; a device without it is not a Confidant device

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


# Engines ---------------------------------------------------------------------------------------

def make_stage_engine(spec: BackendSpec | str, stage_spec: "StageSpec") -> "StageEngine":
    """The stage engine that runs `stage_spec` on backend `spec`, with its thread setting.

    Raises NotImplementedError for backends the stage engines cannot drive yet (MNN off the CPU,
    torch on CUDA), and ModuleNotFoundError with a clear message when torch is not installed."""
    spec = parse_backend(spec)
    if spec.engine == "mnn" and spec.device != "cpu":
        raise NotImplementedError(f"{spec}: the MNN stage engine drives MNN's cpu backend only")
    if spec.engine == "torch" and spec.device != "cpu":
        raise NotImplementedError(f"{spec}: the torch stage engine runs on the cpu only "
                                  "(runtime.engines.pytorch has no device setting yet)")
    if spec.engine == "torch" and not _torch_installed():
        raise ModuleNotFoundError(f"{spec} needs PyTorch, which is not installed here "
                                  "(pip install torch==2.13.0)")
    from runtime.profiling import compute as profile

    return profile.make_engine(profile.parse_backend(str(spec)), stage_spec)
