"""An MNN stage's weight gradients charged once under full fine-tuning, and what its worker holds
beside the sum instead (issue 31 target 3, helper h56).

The profile measures a stage's workspace with a backward that returns the stage's whole set of
dense gradients at once (`runtime.profiling.compute.peak_workspace`), so the per-block lines hold
each block's gradients. A run on MNN sums each block's into the running sum as its gradient program
gives them (`MnnStageEngine.backward_into`, in place): the sum the gradient term charges is the only
set. What the run holds that the profile's fresh engine does not is the backward's buffers landing
beside AdamW's moments from the second step on: `SUMMED_BACKWARD_EXTRA_SHARE` of the set
(benchmarks/MEMORY_NOTES.md, h56). Not the fused LM head's block (its forward makes the tied table's
dense gradient beside the sum: held twice for real, h43), not a table's rows. PyTorch's
`backward_into` is the whole backward, then the sum: both live, both charged, nothing taken off.

By hand on the tiny Llama (embeddings, 4 layers, the fused LM head, its loss), full fine-tuning,
two stages cut after the second layer."""
from __future__ import annotations

import math

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import (SUMMED_BACKWARD_EXTRA_SHARE, row_gradient_delta_bytes, stage_memory_bytes, stage_memory_terms,
                          stage_params_bytes, tied_sum_bytes)
from planner.partition import make_instance

MIB = 2 ** 20
M = 4
RANGES = ((0, 2), (3, 6))


def _device(graph, name: str, backend: str) -> DeviceSpec:
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=1 * MIB) for b in graph.blocks}
    profile = DeviceProfile(name, graph.name, graph.batch, graph.seq, (BackendProfile(backend, costs),),
                            memory_available_bytes=8 << 30, runtime_overhead_bytes=40 * MIB)
    return DeviceSpec(name, f"tcp://{name}:1", profile, 2 << 30, backend)


def _layer_weights_bytes(graph, first: int, last: int) -> int:
    """The dense weights of the decoder layers among blocks first..last, from the graph's constants
    (no table, no head: blocks 1..n-3 of the tiny Llama)."""
    n = len(graph.blocks)
    return sum(int(graph.constants[p].nbytes) for k in range(max(first, 1), min(last, n - 3) + 1)
               for p in graph.blocks[k].params)


@pytest.mark.parametrize("schedule,every", [("1f1b-flush", 1), ("2bw", 2)])
def test_an_mnn_stage_is_charged_its_layers_gradients_once_and_a_share_beside_by_hand(tiny_llama, schedule, every):
    graph = tiny_llama
    n = len(graph.blocks)
    assert n == 7 and _layer_weights_bytes(graph, 0, n - 1) > 0
    for s, (first, last) in enumerate(RANGES):
        layers = _layer_weights_bytes(graph, first, last)
        per_layer = [_layer_weights_bytes(graph, k, k) for k in range(first, last + 1)]
        off = sum(w - math.ceil(SUMMED_BACKWARD_EXTRA_SHARE * w) for w in per_layer)
        assert layers > 0 and 0 < off < layers
        for backend, taken in (("mnn:cpu:t1", off), ("torch:cpu:t1", 0)):
            device = _device(graph, "d", backend)
            terms = stage_memory_terms(graph, device, first, last, s, 2, schedule, M, "adamw", every)
            expected = (stage_params_bytes(graph, first, last)
                        + row_gradient_delta_bytes(graph, first, last, device, M, schedule, every)
                        + tied_sum_bytes(graph, first, last) - taken)
            assert terms.gradient_bytes == expected, (backend, first, last)


@pytest.mark.parametrize("schedule,every", [("1f1b-flush", 1), ("2bw", 2)])
def test_the_partition_instance_charges_what_the_cost_model_does(tiny_llama, schedule, every):
    """Every cut of the tiny Llama over an MNN and a PyTorch device: the instance's stage bytes equal
    planner.cost's, the summed gradients taken off per block."""
    graph = tiny_llama
    n = len(graph.blocks)
    devices = (_device(graph, "a", "mnn:cpu:t1"), _device(graph, "b", "torch:cpu:t1"))
    inst = make_instance(graph, Cluster(devices, Link(1e9, 1e-4)), schedule, M, "adamw", every)
    for d, device in enumerate(devices):
        for cut in range(1, n - 1):
            if cut - 1 in inst.joined:
                continue
            for s, (first, last) in enumerate(((0, cut - 1), (cut, n - 1))):
                assert inst.stage_bytes(d, first, last, 2, s) == stage_memory_bytes(
                    graph, device, first, last, s, 2, schedule, M, "adamw", every), (device.name, first, last)


def test_an_mnn_stage_updating_after_every_backward_is_charged_as_before(tiny_llama):
    """1f1b-stash updating after every backward holds no gradient sum: the workspace's set is the
    one set, on MNN as on any engine (nothing taken off)."""
    graph = tiny_llama
    n = len(graph.blocks)
    device = _device(graph, "d", "mnn:cpu:t1")
    terms = stage_memory_terms(graph, device, 0, n - 1, 0, 1, "1f1b-stash", M, "adamw", 1)
    assert terms.gradient_bytes == (row_gradient_delta_bytes(graph, 0, n - 1, device, M, "1f1b-stash", 1)
                                    + tied_sum_bytes(graph, 0, n - 1))
