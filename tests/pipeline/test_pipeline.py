"""Pipeline training over real ZeroMQ sockets between real worker processes, against single-device
training (flush schedules), the in-process sequential replay (weight stashing), and itself across a
checkpoint; plus what a garbled message does."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from jobs.train.pipeline import LocalWorkers, PlanInMemory, StageChoice, train_pipeline
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.pipeline.checkpoints import load_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement, WorkerFailed
from runtime.engines.mnn import MnnStageEngine
from runtime.pipeline.local_replay import LocalPipeline
from tasks.tokenize import Batch, split_microbatches
from tasks.trainer import batch_feeds
from runtime.keys import signer
from runtime.transport.zeromq import ZmqTransport
from support import M, ROWS, S, single_device_training, synthetic_batch

STEPS = 2


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], ROWS, S)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(4)]


def _config(schedule: str) -> PipelineConfig:
    return PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)


def _run(graph, batches, schedule, stages, steps=STEPS, **kwargs):
    workers = LocalWorkers.start(stages, threads=1)
    try:
        return train_pipeline(graph, batches, 9, workers.addresses, _config(schedule), steps, keys=workers.keys,
                              **kwargs)
    finally:
        assert workers.wait(30.0) == [0] * stages


def _assert_rel(a: dict, b: dict, rtol: float) -> None:
    for k in b:
        err = float(np.abs(a[k] - b[k]).max()) / max(float(np.abs(b[k]).max()), 1e-12)
        assert err <= rtol, f"{k}: relative error {err:.3g}"


# Every case has a twin on threads (tests/pipeline/test_pipeline_inprocess.py); one stays in the fast tier as
# the multi-process ZeroMQ check of this family.
@pytest.mark.parametrize("schedule,stages", [
    pytest.param("1f1b-flush", 2, marks=pytest.mark.slow), ("1f1b-flush", 3),
    pytest.param("gpipe", 2, marks=pytest.mark.slow), pytest.param("gpipe", 3, marks=pytest.mark.slow),
])
def test_flush_schedules_equal_single_device_training(graph, batches, schedule, stages):
    result = _run(graph, batches, schedule, stages)
    losses, weights = single_device_training(graph, batches, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_rel(result.weights, weights, 1e-5)
    assert result.losses[1] != result.losses[0]


def _replay(graph, batches, ranges, stash: bool):
    pipe = LocalPipeline(graph, ranges, lambda spec: MnnStageEngine(spec, stash_weights=stash), "adamw", 1e-3)
    schedule = make_schedule("1f1b-stash", len(ranges), STEPS * M)
    feeds = [batch_feeds(mb, 9, b.n_labelled) for b in batches[:STEPS] for mb in split_microbatches(b, M)]
    return pipe.run(schedule, feeds), pipe.parameters()


@pytest.mark.slow  # twin on threads: tests/pipeline/test_pipeline_inprocess.py
def test_weight_stashing_equals_sequential_replay_and_differs_without_it(graph, batches):
    result = _run(graph, batches, "1f1b-stash", 3)
    losses, weights = _replay(graph, batches, result.ranges, stash=True)
    step_losses = [sum(losses[i * M:(i + 1) * M]) for i in range(STEPS)]
    assert result.losses == step_losses  # exactly: same engine, same action order
    for k in weights:
        np.testing.assert_array_equal(result.weights[k], weights[k], err_msg=k)
    unstashed_losses, unstashed = _replay(graph, batches, result.ranges, stash=False)
    assert any(not np.array_equal(unstashed[k], weights[k]) for k in weights)
    # and asynchronous 1F1B is not single-device training: that is what stashing keeps consistent
    single, _ = single_device_training(graph, batches, STEPS)
    assert step_losses[1] != pytest.approx(single[1], rel=1e-6)


@pytest.mark.slow  # twin on threads: tests/pipeline/test_pipeline_inprocess.py
def test_checkpoint_then_resume_continues_identically(graph, batches, tmp_path):
    whole = _run(graph, batches, "1f1b-flush", 2, steps=3)
    first = _run(graph, batches, "1f1b-flush", 2, steps=2, checkpoint_dir=tmp_path / "ckpt", meta={"model": "tiny"})
    meta, weights, opt_state = load_checkpoint(tmp_path / "ckpt")
    assert meta["step"] == 2 and meta["stages"] == 2
    resumed = _run(graph, batches, "1f1b-flush", 2, steps=1, start_step=2, weights=weights, optimizer_state=opt_state,
                   cuts=[r[0] for r in meta["ranges"][1:]])
    assert first.losses == whole.losses[:2]
    assert resumed.losses == whole.losses[2:]
    for k in whole.weights:
        np.testing.assert_array_equal(resumed.weights[k], whole.weights[k], err_msg=k)


# twin on threads: tests/pipeline/test_pipeline_inprocess.py; a worker process's own error report stays in the
# fast tier in tests/jobs/test_plan_train.py (a tampered bundle)
@pytest.mark.slow
def test_garbled_message_stops_the_worker_and_the_coordinator_names_it(graph, batches):
    """A fake stage 0 sends stage 1 (a real worker process) an activation with a corrupted payload."""
    from runtime.keys import KeyPair

    worker = LocalWorkers.start(1, threads=1)
    keys, me = worker.keys, KeyPair.generate("fake")  # the fake stage is a member of the cluster, with its key
    boss, real = keys.coordinator.public.curve, keys.workers[worker.addresses[0]].curve
    coord = ZmqTransport("coordinator", "tcp://127.0.0.1:0", keys=keys.coordinator.curve_keys())
    fake = ZmqTransport("stage0", "tcp://127.0.0.1:0", keys=me.curve_keys(), accept={"coordinator": boss, "stage1": real})
    try:
        placements = [StagePlacement(0, 0, 1, fake.address), StagePlacement(1, 2, 4, worker.addresses[0])]
        coordinator = Coordinator(placements, _config("1f1b-flush"), coord, [graph, graph],
                                  worker_keys={**keys.workers, fake.address: me.public})
        plan = PlanInMemory(graph, _config("1f1b-flush"), 1, [p.address for p in placements],
                            sign=signer(keys.coordinator))([(0, 1), (2, 4)], [p.address for p in placements])

        def answer_setup():
            # as a worker does: 'ready' once the setup came, when the coordinator knows the fake's
            # key (it learns it connecting in setup_bundles(); a connection before that is refused,
            # and on a loaded machine the 'ready' sent over it could be lost with it)
            while fake.recv_control(None, timeout=60.0)[1].get("type") != "setup_bundle":
                pass
            fake.connect("coordinator", coord.address, key=boss)
            fake.send_control("coordinator", {"type": "bundle_wants", "stage": 0})
            fake.send_control("coordinator", {"type": "ready", "stage": 0})

        answering = threading.Thread(target=answer_setup, daemon=True)
        answering.start()
        coordinator.setup_bundles(plan.bundles, plan.devices)
        answering.join(60.0)
        fake.connect("stage1", worker.addresses[0], key=real)
        header = fake.send_tensor  # a real header for micro-batch 0 ...
        act = np.zeros(graph.values[graph.blocks[2].inputs[0]].shape, np.float32)
        from runtime.transport.wire import TensorHeader
        import zlib
        good = TensorHeader("act", 0, 0, -1, "float32", act.shape, act.nbytes, zlib.crc32(act.tobytes()))
        corrupted = act.copy()
        corrupted[0, 0, 0] = 1.0  # ... with other bytes than its checksum covers
        fake._send_frames("stage1", [good.encode(), corrupted.tobytes()])
        schedule = make_schedule("1f1b-flush", 2, M)
        feeds = [batch_feeds(mb, 9, batches[0].n_labelled) for mb in split_microbatches(batches[0], M)]
        with pytest.raises(WorkerFailed) as err:
            coordinator.run(schedule, feeds, 0)
        text = str(err.value)
        assert text.startswith(f"worker stage1 ({worker.addresses[0]}) failed: stage 1 (worker1) in s1.RECV_ACT.m0<s0: "
                               f"MessageError: "
                               f"message from "
                               f"peer 'stage0' ({fake.address}): expected act stage=0 mb=0")
        assert "checksum" in text
        del header
    finally:
        coord.close()
        fake.close()
    assert worker.wait(30.0) == [1]


@pytest.mark.slow  # twin on threads: tests/pipeline/test_pipeline_inprocess.py
def test_cross_framework_pipeline_mnn_then_torch_equals_all_mnn(graph, batches):
    """Stage 0 on MNN, stage 1 on PyTorch: devices with different frameworks train one model."""
    mixed = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    workers = LocalWorkers.start(2, threads=1)
    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, mixed, STEPS, keys=workers.keys,
                                per_stage=(StageChoice(engine="mnn"), StageChoice(engine="torch")))
    finally:
        assert workers.wait(30.0) == [0, 0]
    losses, weights = single_device_training(graph, batches, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    # The key bias's true gradient is exactly zero (softmax ignores a per-row constant), so each
    # framework's float32 rounding noise is all AdamW sees, and AdamW scales noise up to lr-sized
    # steps: those tensors may differ by up to lr x steps; every other tensor must agree closely.
    exact = {k: v for k, v in weights.items() if not k.endswith("attention.self.key.bias")}
    _assert_rel(result.weights, exact, 1e-4)
    for k in set(weights) - set(exact):
        assert float(np.abs(result.weights[k] - weights[k]).max()) <= 2 * 1e-3 * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("schedule,stages", [("1f1b-flush", 3), ("gpipe", 2)])
def test_minilm_pipeline_equalssingle_device_training(minilm_onnx, schedule, stages):
    """The real model: K=2 steps of MiniLM on worker processes give single-device losses and weights."""
    rows, seq = 2, 16
    graph = load_model(minilm_onnx, rows, seq)
    rng = np.random.default_rng(7)

    def batch(seed):
        r = np.random.default_rng(seed)
        mask = np.ones((rows * M, seq), np.int64)
        mask[0, seq // 2:] = 0
        labels = r.integers(0, 9, (rows * M, seq))
        labels[mask == 0] = -100
        return Batch(r.integers(0, 30522, (rows * M, seq)).astype(np.int64), mask, np.zeros_like(mask), labels,
                     n_labelled=int((labels != -100).sum()))

    data = [batch(int(rng.integers(1 << 30))) for _ in range(STEPS)]
    result = _run(graph, data, schedule, stages)
    losses, weights = single_device_training(graph, data, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    exact = {k: v for k, v in weights.items() if not k.endswith("attention.self.key.bias")}
    _assert_rel(result.weights, exact, 1e-5)
