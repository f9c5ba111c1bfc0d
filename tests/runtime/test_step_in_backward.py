"""1f1b-stash with an update after every backward on PyTorch: the executor runs each B with the
UPDATE after it as the engine's `backward_and_step`, which steps every weight as soon as its
gradient is complete and lets the gradient go (the stage never holds all its weight gradients at
once). It must leave exactly what `backward` then `step` leave: the same weights, optimizer state
and input gradients bit for bit, with forwards in flight (weight stashing) or not, keeping or
recomputing activations, dense weights and embedding tables stepped by rows, AdamW and SGD."""
from __future__ import annotations

import numpy as np
import pytest

from ir.plan import ActionKind
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.pipeline.executor import fused_backwards
from support import S, token_feeds

B = 2


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


def _run(graph, first: int, last: int, in_flight: int, fused: bool, recompute: bool, optimizer: str):
    """1F1B on one stage with `in_flight` forwards ahead of each backward: F x in_flight, then
    (B, UPDATE, F) until 6 micro-batches are through. Each backward's upstream gradient is fixed
    by its micro-batch. Returns the input gradients, the weights after every update and the state."""
    spec = stage_spec(graph, first, last)
    engine = TorchStageEngine(spec, recompute=recompute)
    engine.row_gradients = True
    engine.updates_in_flight = in_flight > 1
    opt = make_optimizer(optimizer, 0.05)
    rng = np.random.default_rng(1)
    xs = []
    for m in range(6):
        feeds = token_feeds(B, S, vocab=500, seed=m)
        if spec.activation_input is not None:
            feeds[spec.activation_input] = rng.standard_normal(graph.values[spec.activation_input].shape
                                                               ).astype(np.float32)
        xs.append(feeds)
    outs, dxs, weights = {}, [], []
    started = 0
    for m in range(6):
        while started < min(6, m + in_flight):
            outs[started] = engine.forward(xs[started], started)
            started += 1
        upstream = None if spec.is_last else np.full_like(outs[m], 1e-2 * (m + 1))
        if fused:
            dx = engine.backward_and_step(m, opt, upstream)
        else:
            result = engine.backward(m, upstream)
            engine.step(opt, result.params)
            dx = result.activation_input
        dxs.append(dx)
        weights.append(engine.parameters())
    return dxs, weights, opt.state(), engine


@pytest.mark.parametrize("where, in_flight, recompute, optimizer", [
    ("last", 1, False, "adamw"),
    ("first", 2, False, "adamw"),
    ("first", 3, True, "adamw"),
    ("middle", 2, False, "sgd"),
    ("first", 2, False, "sgd"),
])
def test_stepping_in_the_backward_equals_backward_then_step(graph, where, in_flight, recompute, optimizer):
    n = len(graph.blocks)
    first, last = {"last": (2, n - 1), "first": (0, 1), "middle": (1, 2)}[where]
    ref_dx, ref_w, ref_state, ref = _run(graph, first, last, in_flight, False, recompute, optimizer)
    dx, w, state, fused = _run(graph, first, last, in_flight, True, recompute, optimizer)
    for a, b in zip(ref_dx, dx):
        assert (a is None and b is None) or np.array_equal(a, b)
    for a, b in zip(ref_w, w):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert ref_state.keys() == state.keys() and all(np.array_equal(ref_state[k], state[k]) for k in state)
    # the weights moved (a test that cannot fail would not), and as many versions are held
    assert any(not np.array_equal(ref_w[0][k], ref_w[-1][k]) for k in ref_w[0])
    assert len(fused._retired) == len(ref._retired)


def test_the_executor_fuses_each_backward_its_update_sums_alone():
    every = make_schedule("1f1b-stash", 3, 6)
    for s in range(3):
        bs = [a for a in every.actions[s] if a.kind is ActionKind.B]
        assert fused_backwards(every.actions[s]) == bs
    pairs = make_schedule("1f1b-stash", 3, 6, update_every=2)
    assert all(fused_backwards(row) == [] for row in pairs.actions)
    odd = make_schedule("1f1b-stash", 2, 5, update_every=2)  # the fifth backward is updated alone
    assert [a.microbatch for a in fused_backwards(odd.actions[0])] == [4]
    flush = make_schedule("1f1b-flush", 2, 4)
    assert all(fused_backwards(row) == [] for row in flush.actions)
