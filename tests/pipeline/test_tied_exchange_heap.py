"""A stage's update with tied weights gives the backwards' freed heap back before the exchange's sum
arrives: the plan charges that update as what the stage holds throughout + the sum received, the
backwards' activations and workspace not held then (`planner.cost.phase_peak_bytes`), but their
small blocks stay resident as free heap below later blocks (glibc trims only the heap's top). The
embeddings' stage of tests/jobs/test_torch_full_finetune_plan.py held 30-41 MiB of it at its update
and read 0.988-0.995 of its plan; given back, 0.967 (benchmarks/MEMORY_NOTES.md, helper h116)."""
from __future__ import annotations

from support import ROWS, S, run_child

# In a fresh process: a real torch stage's executor with one tied weight, its coordinator a local
# transport that has already sent the sum back; 64 blocks of 512 KiB (under the steady heap's 2 MiB
# threshold: heap blocks, as a layer's activations are) each freed below a small block allocated after
# it (as a layer's activations lie below blocks that outlive them), then the UPDATE. Resident before and after it.
_CHILD = r"""
import json, sys
import numpy as np
from planner.onnx_import import load_model
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.pipeline.executor import COORDINATOR, StageExecutor, stage_peer
from runtime.procfs import rss_bytes
from runtime.transport.local import LocalHub, LocalTransport

graph = load_model(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
spec = stage_spec(graph, 0, len(graph.blocks) - 1)
hub = LocalHub()
coordinator = LocalTransport(COORDINATOR, hub)
tied = sorted(spec.params)[0]
executor = StageExecutor(0, 1, TorchStageEngine(spec), LocalTransport(stage_peer(0), hub), make_optimizer("sgd", 0.0),
                         (), timeout=30, tied=(tied,))
coordinator.connect(stage_peer(0), executor.transport.address)
executor.transport.connect(COORDINATOR, coordinator.address)
shape = tuple(np.asarray(graph.constants[tied]).shape)
executor.grad_sum = {k: np.zeros(np.asarray(graph.constants[k]).shape, np.float32) for k in spec.params}
coordinator.send_tensor(stage_peer(0), "tied_sum", -1, 0, np.zeros(shape, np.float32), name=tied)
blocks = [(np.ones(2 ** 16), np.ones(2000)) for _ in range(64)]  # 64 x 512 KiB, each with a 16 KB block above it
pins = [pin for _, pin in blocks]
del blocks
before = rss_bytes()
executor.update()
print("GIVEN " + json.dumps(before - rss_bytes()))
"""


def test_an_update_with_tied_weights_gives_the_backwards_freed_heap_back_before_the_sum_arrives(tiny_checkpoint,
                                                                                              export_dir):
    from support import export_onnx

    model = export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17)
    given = run_child(_CHILD, "GIVEN", model, ROWS, S, timeout=300)
    # 64 x 512 KiB = 32 MiB freed below the pin: all of it back (the sum received is a few KiB);
    # without the release, ~0 (the free heap stays resident under the update)
    assert given >= 0.9 * 32 * 2 ** 20, given / 2 ** 20
