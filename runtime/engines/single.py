"""A stage engine on one backend (`ir.backend.BackendSpec`): MNN or PyTorch, with the backend's
thread setting. `runtime.engines.factory.make_engine` is what callers use; it comes here for every
unsplit stage, and a head split comes here for each backend's piece, so an engine is configured the
same way wherever it runs.

Engines are imported only when chosen, so a device without torch never loads it (importing torch
costs ~240 MiB). The stage engines drive the CPU only so far: MNN's other devices and torch CUDA
are valid backend names, may be discovered (`runtime.profiling.backends`), and raise
NotImplementedError here, naming what is missing.
"""
from __future__ import annotations

import importlib.util
from typing import Mapping

import numpy as np

from ir.backend import BackendSpec, parse_backend
from runtime.engines.base import StageEngine
from runtime.engines.stage import StageSpec


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def import_engine(engine: str) -> None:
    """Import `engine`'s stage engine module now (a worker, before its stage's weights are read).

    Importing torch and then the torch engine peaks ~48 MiB above where it settles: torch maps its
    libraries' pages (VmHWM 224.7 MiB in a fresh interpreter) and `runtime.engines.pytorch` gives them
    back at its import (`runtime.library_pages`; VmRSS 167.0 after). The profile charges the settled
    figure (`runtime.profiling.memory.engine_overhead_bytes`), so where a worker read its weights
    first the transient stacked on them: a Gemma-3-270M-shaped stage holding only the 170 MiB int8
    table peaked at 396.9 MiB while building its engine, its plan 381.3 (benchmarks/MEMORY_NOTES.md,
    helper h151). MNN is in the runtime already: nothing to do."""
    if engine == "torch" and torch_installed():
        importlib.import_module("runtime.engines.pytorch")


def single_engine(backend: BackendSpec | str, spec: StageSpec, *, weights: Mapping[str, np.ndarray] | None = None,
                  stash_weights: bool = True, cache_activations: bool = True,
                  activations: str | None = None, take_weights: bool = False,
                  cached_blocks: int = 0) -> StageEngine:
    """The engine that runs `spec` on `backend` (options as `runtime.engines.factory.make_engine`)."""
    backend = parse_backend(backend)
    if backend.engine == "mnn":
        if backend.device != "cpu":
            raise NotImplementedError(f"{backend}: the MNN stage engine drives MNN's cpu backend only")
        from runtime.engines.mnn import MnnStageEngine

        return MnnStageEngine(spec, threads=backend.thread_count, weights=weights, stash_weights=stash_weights,
                              cache_activations=cache_activations,
                              cache_slots=None if activations == "keep" else 1, take_weights=take_weights,
                              per_block=activations == "per-block", cached_blocks=cached_blocks)
    if backend.device != "cpu":
        raise NotImplementedError(f"{backend}: the torch stage engine runs on the cpu only "
                                  "(runtime.engines.pytorch has no device setting yet)")
    if not torch_installed():
        raise ModuleNotFoundError(f"{backend} needs PyTorch, which is not installed here (pip install torch==2.13.0)")
    if cached_blocks:
        raise ValueError(f"{backend}: cached_blocks is the MNN engine's hybrid of per-block recompute")
    from runtime.engines.pytorch import TorchStageEngine

    return TorchStageEngine(spec, threads=backend.thread_count, weights=weights,
                            recompute=activations == "recompute", take_weights=take_weights,
                            per_block=activations == "per-block")
