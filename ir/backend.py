"""Compute backends by name: one `BackendSpec`, parsed here and nowhere else.

A backend is an engine, a device, and the device's setting, named `engine:device[:setting]`:

    mnn:cpu:t1     MNN on the CPU with 1 worker thread (cpu backends always name a thread count)
    mnn:opencl     MNN on a GPU through OpenCL (also vulkan, metal, cuda; no setting)
    torch:cpu:t2   PyTorch on the CPU with 2 threads
    torch:cuda:0   PyTorch on CUDA GPU 0 (the device index is required)

`BackendSpec.parse(name)` and `str(spec)` round-trip. Profiles, cluster files, plans and bundles
all name backends this way; which of them really run on a device is `runtime.profiling.backends`'
business, and which engine runs a backend is `runtime.engines.factory`'s.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

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

    @property
    def thread_count(self) -> int:
        """The worker threads this backend runs: its tN on a cpu device, 1 on a GPU (whose host
        side runs one thread)."""
        return self.threads if self.threads is not None else 1

    @classmethod
    def cpu(cls, engine: str, threads: int = 1) -> "BackendSpec":
        """`engine` on the CPU with `threads` threads, e.g. BackendSpec.cpu("mnn", 2) = mnn:cpu:t2."""
        return cls(engine, "cpu", threads=threads)


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
    return name if isinstance(name, BackendSpec) else _parsed(name)


@lru_cache(maxsize=256)
def _parsed(name: str) -> BackendSpec:
    # the planner asks for a device's engine per block range (150 k times planning 64 devices x 193
    # blocks: 3 s of parsing); a spec is frozen, so one per name serves every caller
    return BackendSpec.parse(name)


def engine_of(name: str | BackendSpec) -> str:
    """The engine kind of a backend name: 'mnn:cpu:t2' -> 'mnn'."""
    return parse_backend(name).engine


def threads_of(name: str | BackendSpec) -> int:
    """The threads a backend runs: 'mnn:cpu:t2' -> 2, 'torch:cuda:0' -> 1."""
    return parse_backend(name).thread_count


def runs_as(name: str | BackendSpec, engine: str, threads: int) -> bool:
    """Whether backend `name` is `engine` at `threads` threads (False for a name that is not a
    backend, as a nominal profile's are)."""
    try:
        return engine_of(name) == engine and threads_of(name) == threads
    except ValueError:
        return False
