"""The fused LM head's weight gradient, which the profile's fresh forward and backward make a new array
(in the head's measured workspace), is not charged where a gradient sum is kept: both engines add it
into the sum in place (`TorchStageEngine.backward_into`, `MnnStageEngine.forward_into`;
tests/runtime/test_head_sum.py and test_mnn_head_sum.py measure it), so a stage's peak lost it (the
full fine-tuning tests' head stages: PyTorch 746.8 -> 642.0 MiB, h131; MNN 309.2 -> 262.2, h135,
benchmarks/MEMORY_NOTES.md). Where no sum is kept (1f1b-stash updating after every backward, a flush
schedule of one micro-batch: the backward's own gradient is the one set) it is charged as before."""
from __future__ import annotations

import dataclasses

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile

MIB = 2 ** 20


def test_the_head_s_gradient_comes_off_its_charge_on_pytorch_where_a_sum_is_kept(chat_llama):
    from planner.cluster import DeviceSpec
    from planner.cost import stage_memory_bytes, stage_memory_terms
    from planner.memory_defaults import default_profile
    from planner.onnx_import import load_model

    model, _, _ = chat_llama
    graph = load_model(model, 1, 64)
    n = len(graph.blocks)
    weight = graph.node(graph.blocks[-2].nodes[-1]).inputs[1]
    assert weight in graph.params
    head_bytes = int(graph.constants[weight].nbytes)  # 49152 x 64 float32: 12 MiB
    costs = dict(default_profile(graph, "p").backends[0].blocks)
    costs[block_signature(graph.blocks[-2])] = BlockCost(0.01, 0.02, 0.0, 40 * MIB)
    backends = tuple(BackendProfile(b, costs) for b in ("torch:cpu:t1", "mnn:cpu:t1"))
    profile = DeviceProfile("p", graph.name, graph.batch, graph.seq, backends, 1 << 40)
    torch_device = DeviceSpec("d", "tcp://d:1", profile, 1 << 40, "torch:cpu:t1")
    mnn_device = dataclasses.replace(torch_device, backend="mnn:cpu:t1")

    def terms(device, first, schedule="1f1b-flush", update_every=1, microbatches=4):
        return stage_memory_terms(graph, device, first, n - 1, 1, 2, schedule, microbatches, "adamw", update_every)

    for device in (torch_device, mnn_device):
        for first in (n - 2, n - 3):
            summed = terms(device, first)
            assert summed.head_loss_bytes == 40 * MIB - head_bytes, device.backend
            stepped = terms(device, first, "1f1b-stash")  # no sum: the gradient made, stepped, let go
            assert stepped.head_loss_bytes == 40 * MIB
            assert terms(device, first, "1f1b-flush", microbatches=1).head_loss_bytes == 40 * MIB  # its own set
            assert terms(device, first, "1f1b-stash", 2).head_loss_bytes == 40 * MIB - head_bytes
            assert terms(device, first, "zb-h1").head_loss_bytes == 40 * MIB - head_bytes
            assert terms(device, first, "gpipe").head_loss_bytes == 40 * MIB - head_bytes
            assert summed.total == stage_memory_bytes(graph, device, first, n - 1, 1, 2, "1f1b-flush", 4, "adamw")
