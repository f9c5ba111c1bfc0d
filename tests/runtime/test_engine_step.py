"""The optimizer step inside the engine (`StageEngine.step`): the stage's weights are held once.

A pipeline stage used to keep three copies of its weights (the graph's, the engine's, and the
executor's for the optimizer); now the engine's are stepped in place and a worker's engine takes
the graph's arrays (`take_weights`). These tests hold the new path to independent references: the
old copy-step-write path on a second engine (bit for bit), PyTorch float64 gradients at the old
weights for a backward whose forward ran before an update (weight stashing), and a dense running
sum for embedding gradients summed as rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from planner.onnx_import import load_model
from runtime.engines.base import RowGradient, accumulate, dense_gradient
from runtime.engines.factory import make_engine
from runtime.engines.pytorch import TorchStageEngine, fused_adamw
from runtime.engines.stage import stage_spec
from runtime.optim import SGD, AdamW
from support import M, ROWS, S as SEQ, assert_grads_close, export_onnx, single_device_training, synthetic_batch, token_feeds

B, S = 2, 12
ENGINES = ["mnn", "torch"]


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), B, S)


def _feeds(spec, graph, seed: int) -> dict[str, np.ndarray]:
    feeds = token_feeds(B, S, vocab=500, seed=seed)
    if spec.activation_input is not None:
        shape = graph.values[spec.activation_input].shape
        feeds[spec.activation_input] = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return feeds


def _grad_out(spec, graph):
    if spec.is_last:
        return None
    return np.random.default_rng(99).standard_normal(graph.values[spec.output].shape).astype(np.float32)


def _private_copy(graph):
    """The graph with its own copies of every constant (what a worker builds from the wire)."""
    from dataclasses import replace

    return replace(graph, constants={k: np.array(v) for k, v in graph.constants.items()})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
                                       lambda: AdamW(lr=0.01, weight_decay=0.01)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("blocks", [(0, 1), (2, 4)], ids=["embeddings-first", "head-and-loss"])
def test_step_equals_copy_step_write_bit_for_bit(graph, engine, optimizer, blocks):
    """Three steps of `engine.step` give the weights the copy path gives (parameters, optimizer on
    the copies, set_parameters) on a second engine, bit for bit; the graph's constants stay as they
    were unless the engine was given them."""
    spec = stage_spec(graph, *blocks)
    before = {p: graph.constants[p].copy() for p in spec.params}
    stepped, copied = make_engine(f"{engine}:cpu:t1", spec), make_engine(f"{engine}:cpu:t1", spec)
    for e in (stepped, copied):
        e.row_gradients = True
    opt_stepped, opt_copied = optimizer(), optimizer()
    params = copied.parameters()
    for step in range(3):
        sums = []
        for e in (stepped, copied):
            total: dict = {}
            for m in range(2):
                e.forward(_feeds(spec, graph, 10 * step + m), m)
                accumulate(total, e.backward(m, _grad_out(spec, graph)).params)
            sums.append(total)
        stepped.step(opt_stepped, sums[0])
        if engine == "torch" and isinstance(opt_copied, AdamW):
            # PyTorch's engine steps AdamW's dense weights with its fused kernel (tables by rows,
            # in numpy): the copy path with the same kernel on the same gradients
            opt_copied.step(params, sums[1], dense_kernel=fused_adamw)
        else:
            opt_copied.step(params, {k: dense_gradient(g) for k, g in sums[1].items()})
        copied.set_parameters(params)
    got, want = stepped.parameters(), copied.parameters()
    assert set(got) == set(spec.params)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(not np.array_equal(got[k], before[k]) for k in before)  # the steps changed something
    for k in before:
        np.testing.assert_array_equal(graph.constants[k], before[k], err_msg=f"{k}: the graph's copy was changed")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("take", [False, True], ids=["copied", "taken"])
@pytest.mark.parametrize("blocks", [(1, 2), (0, 1)], ids=["layers", "embeddings"])
def test_a_backward_after_a_step_uses_its_forwards_weights(graph, engine, take, blocks):
    """forward m0, step, forward m1, backward m0, backward m1: m0's gradients are PyTorch float64's at
    the weights before the step, m1's at the weights after it (PipeDream stashing), with the
    engine's weights copied or taken from the graph. With the embeddings, m0's backward re-runs its
    forward (m1's ran on the same graphs since), from the rows m0's lookups read: MNN keeps no old
    version of a table it only looks up."""
    g = _private_copy(graph) if take else graph
    spec = stage_spec(g, *blocks)
    e = make_engine(f"{engine}:cpu:t1", spec, take_weights=take)
    w0 = e.parameters()
    feeds = [_feeds(spec, g, 20 + m) for m in range(2)]
    grad_out = _grad_out(spec, g)
    e.forward(feeds[0], 0)
    # a random step: a uniform one would vanish in the embeddings' LayerNorm
    rng = np.random.default_rng(5)
    step = {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in w0.items()}
    e.step(SGD(lr=0.5, momentum=0.0), step)
    tables = {n.inputs[0] for n in spec.compute_nodes if n.op == "Gather"} & set(spec.params)
    assert bool(tables) == (blocks[0] == 0)
    if engine == "mnn":
        (old,) = e._old_versions.values()
        assert set(old) == set(spec.params) - tables
    w1 = e.parameters()
    assert all(np.allclose(w1[k], w0[k] - 0.5 * step[k]) for k in w0)
    e.forward(feeds[1], 1)
    got = [e.backward(m, grad_out).params for m in range(2)]
    for m, weights in enumerate((w0, w1)):
        ref = TorchStageEngine(spec, dtype=torch.float64, weights={**g.constants, **weights})
        ref.forward(feeds[m], m)
        assert_grads_close(got[m], ref.backward(m, grad_out).params)
    np.testing.assert_array_equal(e.parameters()[spec.params[0]], w1[spec.params[0]])  # the backward put nothing back
    if take:
        # MNN copies the old version for the forward in flight and steps the graph's arrays; PyTorch's
        # autograd holds the very tensors its forward ran with, so the step writes new ones and the
        # taken arrays keep the old weights: never stepped under a forward that still reads them. A
        # table only looked up is stepped in place by both (a lookup's backward never reads it).
        for k in w1:
            stepped = engine == "mnn" or k in tables
            np.testing.assert_array_equal(g.constants[k], (w1 if stepped else w0)[k], err_msg=k)


def test_a_worker_steps_the_weights_of_its_own_graph(tiny_checkpoint, export_dir):
    """Workers (the real Coordinator and Workers over the in-process transport) train as one device
    does, and each stage's graph holds the trained weights: the engine took the arrays the worker
    received instead of copying them, and stepped them in place."""
    from jobs.train.pipeline import train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    pipe_graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, SEQ)
    batches = [synthetic_batch(i) for i in range(2)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30)
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = train_pipeline(pipe_graph, batches, 9, workers.addresses, config, 2, transport=workers.coordinator)
        stage_graphs = [w.executor.engine.spec.graph for w in workers.workers]
    assert workers.codes == [0, 0], workers.errors
    losses, weights = single_device_training(pipe_graph, batches, 2)
    assert result.losses == losses
    for k, v in weights.items():
        np.testing.assert_array_equal(result.weights[k], v, err_msg=k)
    held = {k: v for sg in stage_graphs for k, v in sg.constants.items() if k in weights}
    assert set(held) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(held[k], v, err_msg=f"{k}: the stage's graph does not hold the trained weight")
        assert not np.array_equal(pipe_graph.constants[k], v), f"{k}: not trained"


def _rows(seed: int, n: int = 9, shape=(6, 4)) -> RowGradient:
    r = np.random.default_rng(seed)
    return RowGradient(r.integers(0, shape[0], n), r.normal(size=(n, shape[1])).astype(np.float32), shape)


def test_rows_summed_as_rows_equal_a_dense_running_sum_bit_for_bit():
    """Embedding gradients stay rows through the micro-batches of a step (no dense table held from
    the first backward on) and come out as the dense running sum would, bit for bit: each element
    gets its additions in the same order, from zero. A dense gradient joining makes the sum dense."""
    parts = [_rows(s) for s in range(4)]
    total: dict = {}
    for part in parts:
        accumulate(total, {"t": part})
    assert isinstance(total["t"], RowGradient) and len(total["t"].ids) == sum(len(p.ids) for p in parts)
    running = np.zeros((6, 4), np.float32)
    for part in parts:
        for i, row in zip(part.ids, part.rows):
            running[i] += row
    np.testing.assert_array_equal(dense_gradient(total["t"]), running)
    dense = np.random.default_rng(7).normal(size=(6, 4)).astype(np.float32)
    accumulate(total, {"t": dense.copy()})
    assert isinstance(total["t"], np.ndarray)
    np.testing.assert_array_equal(total["t"], running + dense)


@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
                                       lambda: AdamW(lr=0.01, weight_decay=0.01)], ids=["sgd", "adamw"])
def test_the_optimizer_takes_a_row_sum_as_its_dense_gradient(optimizer):
    parts = [_rows(s) for s in range(3)]
    rows: dict = {}
    for part in parts:
        accumulate(rows, {"t": part})
    dense = {"t": dense_gradient(rows["t"]).copy()}
    w = {"t": np.random.default_rng(3).normal(size=(6, 4)).astype(np.float32)}
    a, b = optimizer(), optimizer()
    got, want = {"t": w["t"].copy()}, {"t": w["t"].copy()}
    for _ in range(2):
        a.step(got, rows)
        b.step(want, dense)
    np.testing.assert_array_equal(got["t"], want["t"])
    assert not np.array_equal(got["t"], w["t"])


@pytest.mark.parametrize("blocks", [(1, 2), (0, 1)], ids=["layers", "embeddings"])
@pytest.mark.parametrize("slots", [None, 1], ids=["a-slot-each", "one-slot"])
def test_mnn_updating_with_micro_batches_in_flight_keeps_each_forwards_weights(graph, blocks, slots):
    """PipeDream's order on one stage (F0 F1, step, F2 B0, step, B1 B2) with the executor's
    `updates_in_flight`: each backward gets PyTorch float64's gradients at its own forward's
    weights. With a slot per micro-batch in flight each slot's Var set keeps its forward's version,
    so no old copy of a Var-held weight is made; with one slot the old versions are copied."""
    spec = stage_spec(graph, *blocks)
    e = make_engine("mnn:cpu:t1", spec)
    e._max_slots = slots  # what cache_slots=None (the planner's "keep") or 1 sets
    e.updates_in_flight = True
    feeds = [_feeds(spec, graph, 40 + m) for m in range(3)]
    grad_out = _grad_out(spec, graph)
    rng = np.random.default_rng(6)
    weights = [e.parameters()]

    def step():
        e.step(SGD(lr=0.5, momentum=0.0),
               {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in weights[0].items()})
        weights.append(e.parameters())

    e.forward(feeds[0], 0)
    e.forward(feeds[1], 1)
    step()
    copied = {k for old in e._old_versions.values() for k in old}
    e.forward(feeds[2], 99, train=False)  # an evaluation in between takes no micro-batch's weights
    e.forward(feeds[2], 2)
    got = {0: e.backward(0, grad_out).params}
    step()
    got[1] = e.backward(1, grad_out).params
    got[2] = e.backward(2, grad_out).params
    var_held = set(e._params)
    assert (copied & var_held == set()) == (slots is None)
    assert e.cache_slots == (3 if slots is None else 1)
    for m, version in ((0, 0), (1, 0), (2, 1)):
        ref = TorchStageEngine(spec, dtype=torch.float64, weights={**graph.constants, **weights[version]})
        ref.forward(feeds[m], m)
        assert_grads_close(got[m], ref.backward(m, grad_out).params)
    assert e.stashed_versions() == 0
    # a forward after all that runs on the newest weights
    ref = TorchStageEngine(spec, dtype=torch.float64, weights={**graph.constants, **weights[2]})
    np.testing.assert_allclose(e.forward(feeds[0], 3, train=False), ref.forward(feeds[0], 3, train=False),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blocks", [(1, 2), (0, 1)], ids=["layers", "embeddings"])
def test_torch_steps_with_forwards_in_flight_reuse_retired_tensors(graph, blocks):
    """PyTorch under weight stashing: F0 F1, step, F2 B0, step, B1 B2 F3, step, B3: each backward gets
    float64's gradients at its own forward's weights; the third step's new tensors are those of a
    retired version (no forward in flight holds them any more), and a table only looked up keeps its
    one tensor, stepped in place."""
    spec = stage_spec(graph, *blocks)
    e = make_engine("torch:cpu:t1", spec)
    feeds = [_feeds(spec, graph, 60 + m) for m in range(4)]
    grad_out = _grad_out(spec, graph)
    rng = np.random.default_rng(8)
    weights, tensors = [e.parameters()], [dict(e._params)]

    def step():
        e.step(SGD(lr=0.5, momentum=0.0),
               {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in weights[0].items()})
        weights.append(e.parameters())
        tensors.append(dict(e._params))

    got = {}
    e.forward(feeds[0], 0)
    e.forward(feeds[1], 1)
    step()
    e.forward(feeds[2], 2)
    got[0] = e.backward(0, grad_out).params
    step()
    got[1] = e.backward(1, grad_out).params
    got[2] = e.backward(2, grad_out).params
    e.forward(feeds[3], 3)
    step()
    got[3] = e.backward(3, grad_out).params
    for m, version in ((0, 0), (1, 0), (2, 1), (3, 2)):
        ref = TorchStageEngine(spec, dtype=torch.float64, weights={**graph.constants, **weights[version]})
        ref.forward(feeds[m], m)
        assert_grads_close(got[m], ref.backward(m, grad_out).params)
    tables = {n.inputs[0] for n in spec.compute_nodes if n.op == "Gather"} & set(spec.params)
    for k in spec.params:
        if k in tables:
            assert all(t[k] is tensors[0][k] for t in tensors)
        else:
            assert tensors[1][k] is not tensors[0][k] and tensors[2][k] is not tensors[1][k]
            # versions 0 and 1 retired, and free by the third step: one of them reused
            assert any(tensors[3][k] is tensors[v][k] for v in (0, 1))


def test_mnn_holds_its_weights_once_until_it_updates_with_forwards_in_flight(graph):
    """An MNN stage's current weights are its Vars' own memory (taken weights: the caller's mapping
    gets that memory, its arrays are let go), stepped in place, and outlive the engine safely; once
    the stage updates with forwards in flight they become arrays of their own."""
    import gc

    from runtime.engines import mnn_kernels as K

    g = _private_copy(graph)
    spec = stage_spec(g, 0, 2)
    received = {p: g.constants[p] for p in spec.params}
    e = make_engine("mnn:cpu:t1", spec, take_weights=True)
    e.row_gradients = True
    in_vars = [p for p in spec.params if p in e._current]
    assert in_vars and all(K.shares_memory(e._params[p], e._current[p]) for p in in_vars)
    assert all(g.constants[p] is e._current[p] and g.constants[p] is not received[p] for p in in_vars)
    opt = AdamW(lr=0.01)
    for step in range(2):
        e.forward(_feeds(spec, g, step), 0)
        e.step(opt, e.backward(0, _grad_out(spec, g)).params)
    assert all(K.shares_memory(e._params[p], e._current[p]) for p in in_vars)
    trained = e.parameters()
    assert any(not np.array_equal(trained[p], received[p]) for p in in_vars)
    e.updates_in_flight = True
    assert not any(K.shares_memory(e._params[p], e._current[p]) for p in in_vars)
    assert all(g.constants[p] is e._current[p] for p in in_vars)
    views = {p: K.memory_of(e._params[p]) for p in in_vars}
    del e
    gc.collect()
    for p in in_vars:  # the Vars live as long as an array over their memory does
        np.testing.assert_array_equal(views[p], trained[p], err_msg=p)


def test_pytorchs_adamw_kernel_is_torch_fused_adamw_with_runtime_optims_state():
    """The PyTorch engine's native AdamW step (`fused_adamw`, through runtime.optim's `dense_kernel`)
    is torch.optim.AdamW(fused=True) bit for bit, weights and moments, over steps with bias
    correction; within float32 rounding of float64 AdamW; and an array the kernel cannot take as it
    is (not C-contiguous) goes numpy's way in the same step, to the same float64 reference."""
    rng = np.random.default_rng(5)
    shapes = [(48, 32), (32,), (5, 3, 2)]
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    ours = {str(i): w.copy() for i, w in enumerate(start)}
    opt = AdamW(lr=0.01, weight_decay=0.1)
    fused = [torch.tensor(w, requires_grad=True) for w in start]
    ref = torch.optim.AdamW(fused, lr=0.01, weight_decay=0.1, fused=True)
    exact = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in start]
    ref64 = torch.optim.AdamW(exact, lr=0.01, weight_decay=0.1)
    for step in grads:
        # the last weight's gradient as a transposed view: not C-contiguous, so numpy steps it
        given = {str(i): g for i, g in enumerate(step[:2])} | {"2": np.asfortranarray(step[2])}
        opt.step(ours, given, dense_kernel=fused_adamw)
        for t, t64, g in zip(fused, exact, step):
            t.grad, t64.grad = torch.tensor(g), torch.tensor(g, dtype=torch.float64)
        ref.step()
        ref64.step()
    for i in range(2):
        np.testing.assert_array_equal(ours[str(i)], fused[i].detach().numpy())
        np.testing.assert_array_equal(opt.m[str(i)], ref.state[fused[i]]["exp_avg"].numpy())
        np.testing.assert_array_equal(opt.v[str(i)], ref.state[fused[i]]["exp_avg_sq"].numpy())
    for i in range(3):
        np.testing.assert_allclose(ours[str(i)], exact[i].detach().numpy(), rtol=0, atol=2e-6)
    assert not np.array_equal(ours["0"], start[0])


def test_pytorchs_engine_steps_adamw_with_its_kernel_and_sgd_with_numpy(graph):
    """`TorchStageEngine.step` hands AdamW its fused kernel (its profile rate is that kernel's) and
    SGD none; MNN's engine has no kernel of its own."""
    spec = stage_spec(graph, 2, 4)
    torch_engine, mnn_engine = make_engine("torch:cpu:t1", spec), make_engine("mnn:cpu:t1", spec)
    assert torch_engine.optimizer_kernel(AdamW(lr=0.1)) is fused_adamw
    assert torch_engine.optimizer_kernel(SGD(lr=0.1)) is None
    assert mnn_engine.optimizer_kernel(AdamW(lr=0.1)) is None
    assert TorchStageEngine(spec, dtype=torch.float64).optimizer_kernel(AdamW(lr=0.1)) is None


@pytest.mark.parametrize("engine", ENGINES)
def test_backward_into_sums_the_gradients_backward_gives(graph, engine):
    """`backward_into` (what the single-device trainer and a pipeline stage sum with) adds each
    micro-batch's gradients into the running sum: the same sums `accumulate` of `backward`'s
    whole dicts gives, on a second engine, and the same input gradient."""
    spec = stage_spec(graph, 1, 4)  # an activation input, so the input gradient is checked too
    engines = [make_engine(f"{engine}:cpu:t1", spec, weights=_private_copy(graph).constants) for _ in range(2)]
    into, ref = {}, {}
    for e in engines:
        e.row_gradients = True
    for m in range(3):
        feeds = _feeds(spec, graph, seed=m)
        for e in engines:
            e.forward(feeds, m)
        dx = engines[0].backward_into(m, into, _grad_out(spec, graph))
        result = engines[1].backward(m, _grad_out(spec, graph))
        accumulate(ref, result.params)
        np.testing.assert_allclose(dx, result.activation_input, rtol=1e-6, atol=1e-7)
    assert into.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(dense_gradient(into[k]), dense_gradient(ref[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_mnn_backward_into_holds_no_second_set_of_gradients(tmp_path):
    """MNN's `backward_into` adds each block's gradients as the block's backward gives them, so a
    backward with a running sum already held allocates about one block's gradients more (numpy's
    allocations, as tracemalloc counts them), where `backward` then `accumulate` allocates the
    micro-batch's whole set first (SmolLM2 full fine-tuning: 513 MiB more at every backward)."""
    import tracemalloc

    from jobs.export.encoder import ExportOptions, export_model
    from support import tiny_model

    path = export_model(tiny_model("bert", layers=8, num_labels=9), tmp_path / "bert8.onnx",
                        ExportOptions(num_labels=9, sidecar=False))
    graph = load_model(path, B, S)
    spec = stage_spec(graph, 1, len(graph.blocks) - 1)  # the layers, head and loss: a table's rows aside
    engine = make_engine("mnn:cpu:t1", spec, take_weights=True)
    engine.row_gradients = True
    whole = sum(int(np.asarray(graph.constants[p]).nbytes) for p in spec.params)

    def extra_bytes(run) -> int:
        total: dict = {}
        engine.forward(_feeds(spec, graph, 0), 0)
        engine.backward_into(0, total, _grad_out(spec, graph))
        engine.forward(_feeds(spec, graph, 1), 1)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            run(total)
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    summed_as_they_come = extra_bytes(lambda total: engine.backward_into(1, total, _grad_out(spec, graph)))
    whole_then_summed = extra_bytes(lambda total: accumulate(total, engine.backward(1, _grad_out(spec, graph)).params))
    assert whole_then_summed >= 0.9 * whole, (whole_then_summed, whole)
    assert summed_as_they_come < 0.4 * whole, (summed_as_they_come, whole)
