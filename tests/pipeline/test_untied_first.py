"""A stage with tied weights steps its other weights before the exchange's sum arrives
(`StageExecutor._step_untied_first`): the sum received is a whole table, and the other weights'
gradient sums lay under it at the stage's peak (29.3 MiB on the embeddings' stage of
tests/jobs/test_torch_full_finetune_plan.py, which then read 0.982 of its plan; benchmarks/
MEMORY_NOTES.md, helper h129). The step is one step in two parts: the weights it gives are those of
the engine's own step over everything at once, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from support import ROWS, S


def _stage(model):
    from planner.onnx_import import load_model
    from runtime.engines.pytorch import TorchStageEngine
    from runtime.engines.stage import stage_spec

    graph = load_model(model, ROWS, S)
    return graph, stage_spec(graph, 0, len(graph.blocks) - 1), TorchStageEngine


def _executor(spec, engine_class, optimizer, tied, timeout):
    from runtime.pipeline.executor import COORDINATOR, StageExecutor, stage_peer
    from runtime.transport.local import LocalHub, LocalTransport

    hub = LocalHub()
    coordinator = LocalTransport(COORDINATOR, hub)
    executor = StageExecutor(0, 1, engine_class(spec), LocalTransport(stage_peer(0), hub), optimizer, (),
                             timeout=timeout, tied=(tied,))
    coordinator.connect(stage_peer(0), executor.transport.address)
    executor.transport.connect(COORDINATOR, coordinator.address)
    return executor, coordinator


def test_a_tied_stage_steps_its_other_weights_before_the_sum_arrives_as_one_step_would(tiny_checkpoint, export_dir):
    from runtime.optim import make_optimizer
    from runtime.pipeline.executor import stage_peer
    from runtime.transport.wire import PeerTimeout
    from support import export_onnx

    graph, spec, engine_class = _stage(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17))
    tied = sorted(spec.params)[0]
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal(np.asarray(graph.constants[k]).shape).astype(np.float32) for k in spec.params}
    total = rng.standard_normal(grads[tied].shape).astype(np.float32)  # the holders' sum the coordinator returns

    # the sum never comes: the exchange times out with the other weights stepped and their sums gone
    waiting, _ = _executor(spec, engine_class, make_optimizer("adamw", 1e-2), tied, timeout=0.5)
    before = waiting.engine.parameters()
    waiting.grad_sum = dict(grads)
    with pytest.raises(PeerTimeout):
        waiting.update()
    # main: every weight's sum still held while it waits; h129: the tied part too (sent, and let go since h131)
    assert not waiting.grad_sum
    after = waiting.engine.parameters()
    assert np.array_equal(after[tied], before[tied])
    assert all(not np.array_equal(after[k], before[k]) for k in spec.params if k != tied)

    # the sum comes: the weights are those of the engine's own step over all of them at once
    executor, coordinator = _executor(spec, engine_class, make_optimizer("adamw", 1e-2), tied, timeout=30)
    executor.grad_sum = dict(grads)
    coordinator.send_tensor(stage_peer(0), "tied_sum", -1, 0, total, name=tied)
    executor.update()
    reference = engine_class(spec)
    optimizer = make_optimizer("adamw", 1e-2)
    received = total.copy()
    received.flags.writeable = False  # as the transport gives it (the engine's native step takes writable ones only)
    reference.step(optimizer, {**grads, tied: received})
    got, want = executor.engine.parameters(), reference.parameters()
    assert executor.optimizer.steps == optimizer.steps == 1
    assert all(np.array_equal(got[k], want[k]) for k in spec.params), [k for k in spec.params
                                                                      if not np.array_equal(got[k], want[k])]
