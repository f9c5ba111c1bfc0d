"""What the memory model's `async_extra_copies` says of 1f1b-stash and 2bw, held to the engines: a
stage that updates with a forward in flight holds its current weights apart from the ones that
forward ran with (one more copy), and one that updates with nothing in flight (the last stage,
F B F B) steps its weights where they are (no copy)."""
from __future__ import annotations

import numpy as np
import pytest

from planner.cost import async_extra_copies, weight_copies
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from support import S, token_feeds

B = 2


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


def _run(engine, spec, graph, in_flight: int) -> None:
    """`in_flight` forwards, the first one's backward, then an update (what stage p-1-w runs with
    w forwards ahead of its backward)."""
    rng = np.random.default_rng(0)
    feeds = token_feeds(B, S, vocab=500)
    outs = []
    for m in range(in_flight):
        fed = dict(feeds)
        if spec.activation_input is not None:
            fed[spec.activation_input] = rng.standard_normal(graph.values[spec.activation_input].shape
                                                             ).astype(np.float32)
        outs.append(engine.forward(fed, m))
    grad = None if spec.is_last else np.full_like(outs[0], 1e-3)
    engine.step(make_optimizer("adamw", 1e-3), engine.backward(0, grad).params)


def test_the_model_charges_the_extra_copy_on_every_stage_but_the_last():
    for schedule in ("1f1b-stash", "2bw"):
        assert [async_extra_copies(schedule, 3, s) for s in range(3)] == [1, 1, 0]
    assert [async_extra_copies("1f1b-flush", 3, s) for s in range(3)] == [0, 0, 0]
    # the last stage under stash: weights and AdamW's two moments (a flush holds its gradient sum too)
    assert weight_copies("1f1b-stash", "adamw", 3, 2, 4) == weight_copies("1f1b-flush", "adamw", 3, 2, 4) - 1 == 3


@pytest.mark.parametrize("in_flight", [1, 2])
def test_pytorch_steps_in_place_unless_a_forward_is_in_flight(graph, in_flight):
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 1, len(graph.blocks) - 1)
    engine = TorchStageEngine(spec)
    before = dict(engine._params)
    _run(engine, spec, graph, in_flight)
    same = [engine._params[k] is t for k, t in before.items()]
    assert all(same) if in_flight == 1 else not any(same)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_mnn_keeps_its_weights_in_its_vars_unless_a_forward_is_in_flight(graph, in_flight):
    spec = stage_spec(graph, 1, len(graph.blocks) - 1)
    engine = MnnStageEngine(spec, stash_weights=True)
    _run(engine, spec, graph, in_flight)
    assert engine._current_in_vars is (in_flight == 1)
    assert engine.stashed_versions() == in_flight - 1


def test_pytorch_holds_no_second_current_copy_besides_the_version_in_flight(graph):
    """Stage 0 of 2 under 1f1b-stash (F F B UPDATE): PyTorch holds each versioned weight twice, the
    tensors the forward in flight ran with and the new current ones (WEIGHT_COPIES plus one old
    version), and its tables once; the model charges it that (`shared_current_bytes` takes the
    second current copy MNN holds off every weight but the tables)."""
    from dataclasses import replace

    from ir.profile import BackendProfile, DeviceProfile
    from planner.cluster import DeviceSpec
    from planner.cost import (WEIGHT_COPIES, shared_current_bytes, stage_params_bytes, stashed_weight_versions,
                              unversioned_bytes)
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 0, 2)
    engine = TorchStageEngine(spec)
    engine.row_gradients = True
    _run(engine, spec, graph, 2)
    held = {k: {id(engine._params[k])} | {id(entry[2][k]) for entry in engine._saved.values()}
            for k in spec.params}
    tables = engine._stepped_in_place
    assert tables and all(len(held[k]) == 1 for k in tables)
    old = stashed_weight_versions("1f1b-stash", 2, 0, 4)
    assert old == 1 and all(len(held[k]) == WEIGHT_COPIES + old for k in spec.params if k not in tables)

    profile = DeviceProfile("d", graph.name, graph.batch, graph.seq,
                            (BackendProfile("torch:cpu:t1", {}), BackendProfile("mnn:cpu:t1", {})), 10**12)
    torch_device = DeviceSpec("d", "tcp://d:1", profile, 10**12, "torch:cpu:t1")
    assert shared_current_bytes(graph, 0, 2, torch_device) == (stage_params_bytes(graph, 0, 2)
                                                               - unversioned_bytes(graph, 0, 2, torch_device)) > 0
    assert async_extra_copies("1f1b-stash", 2, 0) == 1
    assert shared_current_bytes(graph, 0, 2, replace(torch_device, backend="mnn:cpu:t1")) == 0
