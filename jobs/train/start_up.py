"""A one-device run's engine start-up paid before its set-up is read, and what an engine let go of handed
back between phases: shared by `jobs.train.local` (token and sequence classification) and
`jobs.train.causal_lm`, whose planned figure is the set-up as measured + a step (`local_check`)."""
from __future__ import annotations

import gc
from typing import Mapping

import numpy as np

from ir.backend import BackendSpec
from ir.graph import Graph, block_signature
from runtime.engines.stage import stage_spec
from runtime.procfs import release_free_heap


def hand_back(engine: str) -> None:
    """What an engine let go of given back before the next phase: Python's garbage, the buffers MNN cached for
    its programs (SmolLM2 int4 LoRA after training: ~41 MiB, which stood under the evaluation's generation:
    benchmarks/MEMORY_NOTES.md, helper h89) and glibc's free heap."""
    gc.collect()
    if engine == "mnn":
        from runtime.engines.mnn_kernels import release_memory

        release_memory()
    release_free_heap()


def torch_start_up(graph: Graph, threads: int, activations: str | None, feeds: Mapping[str, np.ndarray]) -> None:
    """PyTorch's one-time start-up (the layer's kernels, autograd's engine and buffers, held for the process's
    life; a profile charges it with the engine, `runtime.profiling.device`), which a step does not charge:
    one forward and backward of the graph's most repeated block (a decoder or encoder layer) on an engine of
    its own, with the run's activations (`runtime.profiling.compute.run_once`), let go after, so that a set-up
    read after it holds it (the tiny chat Llama's first step rose 113 MiB above its set-up where the step
    charges 48, helpers h97, h102, h106; MiniLM NER LoRA int4 per block ~97 above what the evaluation left,
    1.013 over its figure, helper h117)."""
    from runtime.profiling.compute import run_once

    count: dict[str, int] = {}
    for b in graph.blocks:
        count[block_signature(b)] = count.get(block_signature(b), 0) + 1
    layer = max(graph.blocks, key=lambda b: (count[block_signature(b)], -b.index))
    run_once(BackendSpec.cpu("torch", threads), stage_spec(graph, layer.index, layer.index), feeds, activations)
    hand_back("torch")


def update_start_up(optimizer: str) -> None:
    """numpy's kernels an update runs (AdamW's or SGD's element-wise steps, a looked-up table's by its rows), mapped
    by one update of a few numbers at learning rate 0, so that a set-up read after it holds their pages: the first
    update of a one-device MNN run mapped 0.56-0.7 MiB of numpy's library pages (`_multiarray_umath`) above its
    set-up, which no term charges (the tiny BERT: helper h128; helper h137)."""
    from runtime.engines.base import RowGradient
    from runtime.optim import make_optimizer

    params = {"weight": np.zeros((4, 8), np.float32), "table": np.zeros((16, 8), np.float32)}
    grads = {"weight": np.ones((4, 8), np.float32),
             "table": RowGradient(np.array([1, 3, 1]), np.ones((3, 8), np.float32), (16, 8))}
    make_optimizer(optimizer, lr=0.0).step(params, grads)
