"""The free heap a PyTorch layer run node by node leaves of the values it lets go (`planner.memory_defaults.
torch_kept_bytes`, charged by `train-local`'s step on PyTorch keeping), by each value's size against the mmap
threshold the torch engine fixes (2 MiB, `runtime.heap.steady_heap`): a sixth of a value at or over it (mapped on
its own where no free chunk holds it), none of one at twice it or more, three quarters of one over half of it, half
of the rest. Every value let go charged half, MiniLM NER LoRA int4 keep read 0.83-0.87 of its plan at 4 x 128 and
2 x 256 (their 3 and 6 MiB scores and FFN values), and 8 x 64 (its 1.5 MiB scores in the heap) moved 480-519 MiB
against 523 planned with those at none and these at a half (helpers h146, h157). By hand on the tiny BERT with LoRA
(hidden 64, 4 heads, FFN 128): a layer lets go 29 values of its hidden size (b x s x 64 floats), 2 of its FFN size
(twice that) and 3 of its scores' size (b x 4 x s x s floats: the product, its scaling, its mask added); its two
LayerNorms' statistics (a float pair a row) are saved under keys of their own, taken off the values they come from,
as before."""
from __future__ import annotations

import pytest

MIB = 2 ** 20


def _layer(tiny_onnx, batch: int, seq: int):
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings
    from planner.onnx_import import load_model

    graph = adapted(load_model(tiny_onnx["torchscript-17"], batch, seq), LoraSettings(8))
    return graph, graph.blocks[1]


@pytest.mark.parametrize("batch, seq, heap_bytes", [
    # hidden 0.375 MiB, FFN 0.75, scores 1.5 (over half the threshold: three quarters of each)
    (24, 64, int(0.5 * (29 * 0.375 * MIB + 2 * 0.75 * MIB - 2 * 8 * 24 * 64)) + int(0.75 * 3 * 1.5 * MIB)),
    # hidden 0.5 MiB, FFN 1 (half the threshold: half), scores 2 (at the threshold: a sixth)
    (32, 64, int(0.5 * (29 * 0.5 * MIB + 2 * 1 * MIB - 2 * 8 * 32 * 64)) + int(3 * 2 * MIB / 6)),
    # hidden 1 MiB (half), FFN 2 (a sixth), scores 4 (twice the threshold: nothing)
    (64, 64, int(0.5 * (29 * 1 * MIB - 2 * 8 * 64 * 64)) + int(2 * 2 * MIB / 6)),
])
def test_a_layer_run_node_by_node_is_charged_the_free_heap_of_what_it_lets_go_by_size_by_hand(tiny_onnx, batch, seq,
                                                                                              heap_bytes):
    """What autograd saves (`backward_read_bytes`, its own tests) and the free heap counted by hand. On main's
    charge (half of every value let go) both fail: 24 x 64 1.125 MiB under (13774848 == 14954496 false), 32 x 64
    2 MiB over (its 2 MiB scores at a half, not a sixth: 18366464 == 16269312 false), 64 x 64 over too."""
    from planner.memory_defaults import backward_read_bytes, torch_kept_bytes

    graph, block = _layer(tiny_onnx, batch, seq)
    assert torch_kept_bytes(graph, block) == backward_read_bytes(graph, block, frozenset()) + heap_bytes


def test_the_charge_reads_the_mmap_threshold_the_torch_engine_fixes():
    """The planner may not import the runtime: its copy of the threshold is held equal here."""
    from planner.memory_defaults import TORCH_MMAP_THRESHOLD_BYTES
    from runtime.heap import STEADY_MMAP_THRESHOLD_BYTES

    assert TORCH_MMAP_THRESHOLD_BYTES == STEADY_MMAP_THRESHOLD_BYTES
