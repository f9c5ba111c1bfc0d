"""Issue 31 target 4: the memory model's charge for a stage whose float32 frozen weights are read mapped from the
model file by PyTorch recomputing per block (`planner.cost.maps_frozen`): its largest block's frozen bytes
("frozen weights mapped, one block resident"), not the stage's, and only where the run maps (`DeviceSpec.
frozen_mapped`), the engine is PyTorch and it recomputes per block; checked against the graph's own arrays.
The engine's side: tests/runtime/test_torch_mapped_base.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from jobs.common.lora import adapted
from jobs.common.memory_check import step_bytes
from planner.cluster import DeviceSpec
from planner.cost import MAPPED_FROZEN, stage_memory_terms
from planner.lora import LoraSettings
from planner.memory_defaults import default_profile, memory_parts
from planner.onnx_import import load_model


@pytest.fixture(scope="module")
def graph(chat_llama):
    """The tiny chat Llama under LoRA on q, k, v, o over its float32 base: a 12 MiB tied table (the embeddings'
    block and the head's each read it) and two small layers."""
    return adapted(load_model(chat_llama[0], 1, 16),
                   LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32"))


def _device(graph, backend: str, activations: str | None, mapped: bool) -> DeviceSpec:
    profile = default_profile(graph, backend=backend, per_block=True)
    return DeviceSpec("d0", "tcp://127.0.0.1:1", profile, 2 ** 40, backend, activations=activations,
                      frozen_mapped=mapped)


def _terms(graph, device):
    return stage_memory_terms(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")


def test_a_mapped_torch_per_block_stage_is_charged_its_largest_blocks_frozen_bytes(graph):
    table = next(v for k, v in graph.constants.items() if "embed" in k and v.ndim == 2)
    layer_weights = sum(int(v.nbytes) for k, v in graph.constants.items()
                        if ".layers." in k and k not in graph.params and v.ndim == 2)
    assert table.nbytes > 2 * layer_weights
    head = table.nbytes + graph.constants["model.norm.weight"].nbytes  # the largest block: the final norm and the head
    held = _terms(graph, _device(graph, "torch:cpu:t1", "per-block", False))
    mapped = _terms(graph, _device(graph, "torch:cpu:t1", "per-block", True))
    assert mapped.frozen_bytes == {MAPPED_FROZEN: head}
    assert "frozen " + MAPPED_FROZEN in mapped.by_name()  # what `show` prints
    # the stage held the table once and every layer's weights (and the norms' scales)
    spared = sum(held.frozen_bytes.values()) - head
    assert spared >= layer_weights
    assert held.total - mapped.total == spared
    device = _device(graph, "torch:cpu:t1", "per-block", True)
    assert memory_parts(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == head
    # a one-device run's step charges the resident block its set-up (read with the base given back) does not hold
    assert (step_bytes(graph, "adamw", "torch", "per-block", "float32", 1, True)
            - step_bytes(graph, "adamw", "torch", "per-block", "float32", 1, False)) == head


@pytest.mark.parametrize("backend,activations,mapped", [("torch:cpu:t1", "per-block", False),
                                                       ("torch:cpu:t1", "keep", True),
                                                       ("torch:cpu:t1", "recompute", True),
                                                       ("mnn:cpu:t1", "per-block+1", True)])
def test_only_a_mapped_torch_per_block_stage_is_charged_so(graph, backend, activations, mapped):
    """The base held in memory, a graph kept for the whole backward, an MNN hybrid's copies of its constants: all
    of it. (MNN per block streams a mapped base: tests/planner/test_streamed_frozen.py.)"""
    device = _device(graph, backend, activations, mapped)
    assert _terms(graph, device) == _terms(graph, replace(device, frozen_mapped=False))
    assert MAPPED_FROZEN not in _terms(graph, device).frozen_bytes
