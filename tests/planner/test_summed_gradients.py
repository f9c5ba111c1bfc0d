"""An MNN stage's weight gradients charged once under full fine-tuning (issue 31 target 3).

The profile measures a stage's workspace with a backward that returns the stage's whole set of
gradients at once (`runtime.profiling.compute.peak_workspace`), so that set is in the workspace
its lines charge. A run on MNN sums each block's gradients into the running sum as they come
(`MnnStageEngine.backward_into`, `tests/runtime/test_engine_step.py::
test_mnn_backward_into_holds_no_second_set_of_gradients`): the sum the gradient term charges is the
only set. SmolLM2 full fine-tuning over 3 MNN devices ran 0.80-0.82x its plan with both charged
(benchmarks/MEMORY_NOTES.md, helper h36). PyTorch's `backward_into` is the whole backward, then the
sum: both live, both charged."""
from __future__ import annotations

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import (row_gradient_delta_bytes, stage_memory_bytes, stage_memory_terms, stage_params_bytes,
                          tied_sum_bytes, unversioned_bytes)
from planner.onnx_import import load_model
from planner.partition import make_instance

MIB = 2 ** 20
M = 4


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], 4, 16)


def _device(graph, backend: str) -> DeviceSpec:
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=1 * MIB) for b in graph.blocks}
    profile = DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile(backend, costs),),
                            memory_available_bytes=8 << 30, runtime_overhead_bytes=40 * MIB)
    return DeviceSpec("box", "tcp://127.0.0.1:5901", profile, 2 << 30, backend)


@pytest.mark.parametrize("schedule,every", [("1f1b-flush", 1), ("2bw", 2)])
def test_an_mnn_stage_is_charged_its_dense_weight_gradients_once_by_hand(graph, schedule, every):
    """Full fine-tuning of the whole tiny BERT on one device, by hand: MNN's gradient term is the
    looked-up table's rows and nothing dense (the profiled workspace holds the dense set); PyTorch's
    is the dense sum besides (its backward's own set lives beside it, in the workspace). The
    partition instance charges what the cost model does."""
    n = len(graph.blocks)
    params = stage_params_bytes(graph, 0, n - 1)
    dense = params - unversioned_bytes(graph, 0, n - 1, _device(graph, "mnn:cpu:t1"))
    assert dense > 0 and params > dense  # the word table is looked up only: its gradient is rows
    for backend, held in (("mnn:cpu:t1", params - dense), ("torch:cpu:t1", params)):
        device = _device(graph, backend)
        rows = row_gradient_delta_bytes(graph, 0, n - 1, device, M, schedule, every)
        terms = stage_memory_terms(graph, device, 0, n - 1, 0, 1, schedule, M, "adamw", every)
        assert terms.gradient_bytes == held + rows + tied_sum_bytes(graph, 0, n - 1), backend
        cluster = Cluster((device,), Link(1e9, 1e-4))
        inst = make_instance(graph, cluster, schedule, M, "adamw", every)
        assert inst.stage_bytes(0, 0, n - 1, 1, 0) == stage_memory_bytes(graph, device, 0, n - 1, 0, 1, schedule, M,
                                                                         "adamw", every), backend


def test_an_mnn_stage_updating_after_every_backward_is_charged_as_before(graph):
    """1f1b-stash updating after every backward holds no gradient sum: the workspace's set is the
    one set, on MNN as on any engine (nothing taken off)."""
    n = len(graph.blocks)
    device = _device(graph, "mnn:cpu:t1")
    terms = stage_memory_terms(graph, device, 0, n - 1, 0, 1, "1f1b-stash", M, "adamw", 1)
    assert terms.gradient_bytes == (row_gradient_delta_bytes(graph, 0, n - 1, device, M, "1f1b-stash", 1)
                                    + tied_sum_bytes(graph, 0, n - 1))
