"""The one place stage engines are built: a backend name (`ir.backend.BackendSpec`), a stage and the
plan's head split in, the engine that runs it out. Workers, the single-device trainer, the profiler
and evaluation all come through here; `whole_model_engine` is the one spelling of an engine holding
a whole model on this device's CPU (training on one device, scoring trained weights, predicting).

An unsplit stage runs on one backend (`runtime.engines.single`); a stage whose attention heads the
plan splits across backends runs on `runtime.engines.split.engine.SplitStageEngine`, which builds
each backend's piece through `runtime.engines.single` too.
"""
from __future__ import annotations

from collections import ChainMap
from typing import Mapping

import numpy as np

from ir.backend import BackendSpec, parse_backend
from ir.graph import Graph
from ir.documents import activations_mode
from runtime.engines.base import StageEngine
from runtime.engines.single import single_engine
from runtime.engines.stage import StageSpec, stage_spec


def make_engine(backend: BackendSpec | str, spec: StageSpec, *, head_split: Mapping[str, int] | None = None,
                weights: Mapping[str, np.ndarray] | None = None, stash_weights: bool = True,
                cache_activations: bool = True, activations: str | None = None,
                take_weights: bool = False, cached_blocks: int = 0) -> StageEngine:
    """The stage engine that runs `spec` on `backend` with its thread setting.

    `head_split` ({backend: units}) splits the attention heads of each block the lowering placed
    (`block.attention`: encoders, decoders) across backends
    (the rest of the stage runs on MNN). `weights` overrides the graph's constants;
    `stash_weights` keeps the weight version of every micro-batch in flight (PipeDream stashing);
    `cache_activations` (MNN) trades memory for not re-running the forward in the backward;
    `activations`: "keep" every activation of each micro-batch in flight until its backward
    (PyTorch's autograd does by default; MNN builds a set of block graphs per micro-batch in flight,
    each keeping its per-op caches) or "recompute" them there from the stashed inputs (MNN's default:
    one graph set, whose caches serve only the micro-batch whose backward follows its forward;
    PyTorch runs the forward again), or "per-block" (each block's input held, each block's forward
    re-run inside its own backward: MNN keeps no per-op caches, PyTorch checkpoints each block), or
    "per-block+K" (MNN: the same with `cached_blocks` K); None: the engine's default. `take_weights`: the caller gives up
    the parameters' arrays (the graph's, or `weights`'), and the engine keeps those it can as its
    own weights and updates them in place instead of holding a copy (a worker, whose stage graph is
    its own). `cached_blocks` (with "per-block", MNN): the stage's last that many layers keep their per-op
    caches instead, so their backwards skip the re-run of their forwards (a hybrid: time bought back
    at one block's caches each).
    Raises NotImplementedError for backends the engines cannot drive yet, and ModuleNotFoundError
    naming the fix when torch is asked for and not installed."""
    backend = parse_backend(backend)
    if head_split:
        if backend.engine != "mnn":
            raise ValueError(f"a head split runs its stage on MNN; backend {backend} was asked for")
        # imported here: it imports MNN, which a torch stage never runs (~5 MiB of a torch worker)
        from runtime.engines.split.engine import SplitStageEngine

        return SplitStageEngine(spec, dict(head_split), threads=backend.thread_count, stash_weights=stash_weights)
    activations, hybrid = activations_mode(activations)  # "per-block+K": per block, K blocks cached
    cached_blocks = cached_blocks or hybrid
    return single_engine(backend, spec, weights=weights, stash_weights=stash_weights,
                         cache_activations=cache_activations, activations=activations, take_weights=take_weights,
                         cached_blocks=cached_blocks)


def whole_model_engine(graph: Graph, engine: str = "mnn", threads: int = 1, *,
                       weights: Mapping[str, np.ndarray] | None = None, cache_activations: bool = True,
                       take_weights: bool = False, activations: str | None = None) -> StageEngine:
    """The engine (`engine`: "mnn" or "torch", on the CPU with `threads` threads) that runs every block
    of `graph` as one stage. `weights`: trained parameters by name, over the graph's own constants
    (None: the graph as lowered); `cache_activations` False for an engine that only evaluates, so no
    per-op caches stay resident (MNN); `take_weights` and `activations` as `make_engine`'s.
    ModuleNotFoundError names the fix when torch is asked for and not installed."""
    if weights is not None:
        # over the graph's constants as they are now, not a copy of the dict: an MNN engine replaces each frozen
        # float32 weight in it by a view of the Var it builds (`runtime.engines.mnn._hold_once`), and a copy kept
        # the arrays replaced (after training, views of the training engine's Vars) alive until the build ended
        # (SmolLM2 float32 LoRA: +424 MiB against +47 before training; MEMORY_NOTES, helper h103)
        weights = ChainMap(dict(weights), graph.constants)
    return make_engine(BackendSpec.cpu(engine, threads), stage_spec(graph, 0, len(graph.blocks) - 1),
                       weights=weights, cache_activations=cache_activations, take_weights=take_weights,
                       activations=activations)
