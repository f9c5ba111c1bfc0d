"""A run's final state on the coordinator (issue 31, target 5: the coordinator is a process too).

Without a checkpoint to write, the run's result is its weights: the workers send their parameters
only, so the coordinator's peak at the end holds no optimizer state (MiniLM under AdamW: 258 MiB
gathered, 86 of them weights). With a checkpoint, the optimizer state comes too, and the saved
checkpoint resumes as before. Both runs' weights equal single-device training's."""
from __future__ import annotations

import numpy as np
import pytest

from jobs.train.pipeline import FaultPolicy, train_pipeline
from planner.onnx_import import load_model
from runtime.pipeline.checkpoints import load_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from runtime.pipeline.snapshots import PeerSnapshots
from support import M, ROWS, S, export_onnx, single_device_training, synthetic_batch

STEPS = 3


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS)]


def _run(graph, batches, monkeypatch, checkpoint_dir=None):
    """(result, names of every tensor the coordinator received in its last gather)."""
    received: list[list[str]] = []
    real = Coordinator._await_tensor

    def seen(self, peer, expected):
        arr = real(self, peer, expected)
        if expected.kind == "ckpt":
            if expected.microbatch == 0:
                received.append([])
            received[-1].append(expected.name)
        return arr

    monkeypatch.setattr(Coordinator, "_await_tensor", seen)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)
    with InProcessWorkers(2, timeout_s=60) as workers:
        # stop: no snapshot at any boundary, so the last gather is the final state's
        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, transport=workers.coordinator,
                                faults=FaultPolicy(on_failure="stop"), checkpoint_dir=checkpoint_dir)
    return result, received[-2:]


def test_without_a_checkpoint_the_final_state_is_the_weights_alone(graph, batches, monkeypatch):
    result, received = _run(graph, batches, monkeypatch)
    names = [n for stage in received for n in stage]
    assert names and all(n.startswith("param/") for n in names), names
    assert all(k.startswith("param/") for stage in result.checkpoint for k in stage)
    _, want = single_device_training(graph, batches, STEPS)
    assert set(result.weights) == set(want)
    for k in want:
        np.testing.assert_allclose(result.weights[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # what the state is, all of it, is still reported (benchmarks/faults.py: what a copy carries)
    params = sum(int(v.nbytes) for v in result.weights.values())
    assert result.state_bytes > 1.5 * params  # AdamW: two moments beside each weight (a table's touched rows)


def test_with_a_checkpoint_the_optimizer_state_comes_and_is_saved(graph, batches, monkeypatch, tmp_path):
    result, received = _run(graph, batches, monkeypatch, tmp_path / "ckpt")
    names = [n for stage in received for n in stage]
    assert any(n.startswith("opt/") for n in names)
    _, weights, opt_state = load_checkpoint(tmp_path / "ckpt")
    assert opt_state and set(weights) == set(result.weights)
    for k in weights:
        np.testing.assert_array_equal(weights[k], result.weights[k], err_msg=k)
    params = sum(int(v.nbytes) for v in result.weights.values())
    assert result.state_bytes == sum(int(v.nbytes) for stage in result.checkpoint for v in stage.values())
    assert result.state_bytes > 1.5 * params


def test_a_snapshot_on_the_peers_at_the_last_step_is_not_fetched_for_the_weights(graph, batches, monkeypatch):
    """Snapshots on the peers every step: one is ordered at the last boundary too. The final weights
    are collected as they are, not by fetching that snapshot's whole copies (parameters and
    optimizer state, 662 MiB on MiniLM's coordinator against 427)."""
    fetched = []
    real = Coordinator.fetch_held_stages

    def fetch(self, sid, lost=(), *select):
        fetched.append(sid)
        return real(self, sid, lost, *select)

    monkeypatch.setattr(Coordinator, "fetch_held_stages", fetch)
    # every boundary orders one, the last included (not only once the one before is confirmed)
    monkeypatch.setattr(PeerSnapshots, "busy", lambda self: False)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, transport=workers.coordinator,
                                faults=FaultPolicy(snapshot_every=1, state_on="peers"))
    assert fetched == []
    assert all(k.startswith("param/") for stage in result.checkpoint for k in stage)
    _, want = single_device_training(graph, batches, STEPS)
    for k in want:
        np.testing.assert_allclose(result.weights[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
