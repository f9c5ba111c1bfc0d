"""One plan object (issue 34): a plan is read and verified once (`ir.bundle.LoadedPlan`), re-plans
included, shipped as it is, and let go once shipped, so the coordinator does not hold a model's worth
of bundle bytes for the run. On in-process workers over real plan folders and real MNN training."""
from __future__ import annotations

import gc
import shutil
import weakref

import numpy as np
import pytest

from ir.bundle import WEIGHTS, load_plan_folder
from ir.partition import Partition, StageAssignment
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from jobs.train.pipeline import train_pipeline
from planner.cluster import Cluster, DeviceSpec
from planner.emit import emit_plan
from planner.onnx_import import load_model
from planner.replan import PlanReplanner, predicted_compute_s
from planner.schedule import make_schedule
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import M, ROWS, S, export_onnx, single_device_training, synthetic_batch, bundle_weights_alive

STEPS = 4


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS)]


def _flops_cluster(graph, names) -> Cluster:
    from ir.graph import block_signature

    costs = {block_signature(b): BlockCost(max(b.flops * 1e-9, 1e-6), 2 * max(b.flops * 1e-9, 1e-6))
             for b in graph.blocks}
    return Cluster(tuple(DeviceSpec(n, f"tcp://127.0.0.1:{1 + i}",
                                    DeviceProfile(n, graph.name, graph.batch, graph.seq,
                                                  (BackendProfile("mnn:cpu:t1", costs),), 2**33), 2**30, "mnn:cpu:t1")
                         for i, n in enumerate(names)), Link(1e9, 1e-4), {})


def _plan(graph, plan_dir):
    """Device a: the embeddings and both encoder layers; b: the rest. Its cluster priced by FLOPs."""
    cluster = _flops_cluster(graph, "ab")
    emit_plan(plan_dir, graph, Partition((StageAssignment(0, "a", 0, 2), StageAssignment(1, "b", 3, 4)), "manual"),
              make_schedule("1f1b-flush", 2, M), {"model": "tiny", "lr": 1e-3}, cluster=cluster)
    return cluster


def _run(workers, loaded, steps, batches, **kwargs):
    config = PipelineConfig(schedule=loaded.plan.schedule, microbatches=loaded.plan.microbatches, timeout_s=30)
    return train_pipeline(None, batches, 9, workers.addresses[:len(loaded.files)], config, steps, bundles=loaded.files,
                          devices=loaded.devices, stage_graphs=list(loaded.contents), schedule=loaded.schedule,
                          transport=workers.coordinator, **kwargs)


def test_after_setup_the_coordinator_holds_no_bundle_bytes(graph, batches, tmp_path):
    """The plan folder's bundles, read once, are shipped and let go: from the first step on no
    mapping of bundle files in this process holds a weights file (before: the plan's whole bytes,
    about a model's worth, for the whole run)."""
    _plan(graph, tmp_path / "plan")
    loaded = load_plan_folder(tmp_path / "plan")
    held = bundle_weights_alive()
    assert held >= sum(len(f[WEIGHTS]) for f in loaded.files) > 0  # the check sees them while they are held
    seen = []
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = _run(workers, loaded, 2, batches, on_step=lambda *_: seen.append(bundle_weights_alive()))
    assert workers.codes == [0, 0], workers.errors
    assert seen == [0, 0]
    assert loaded.plan.device_names == ["a", "b"] and loaded.schedule.name == "1f1b-flush"  # what stays
    losses, _ = single_device_training(graph, batches, 2)
    assert result.losses == losses


def test_a_replanned_folder_is_read_once_and_shipped_as_read(graph, batches, tmp_path):
    """A measured re-plan writes its folder and reads it once (PlanReplanner -> LoadedPlan); the run
    ships those bytes: with the folder gone from disk before the switch the run goes on (before, the
    coordinator read it twice more, to check it and to ship it). Training equals one device's."""
    cluster = _plan(graph, tmp_path / "plan")
    loaded = load_plan_folder(tmp_path / "plan")
    whole = graph
    replanner = PlanReplanner(tmp_path / "plan", loaded.plan, whole, cluster, workers=1)
    moved, slices = [], []

    def on_replan(step, measured, weights):
        predicted = predicted_compute_s(whole, replanner.cluster, replanner.partition, M)
        new = replanner(step, [x * (8.0 if d == "a" else 1.0) for x, d in zip(predicted, replanner.partition.devices)],
                        weights)
        if new is not None:
            assert new.loaded.directory == new.directory and len(new.loaded.contents) == len(new.devices)
            shutil.move(str(new.directory), str(tmp_path / "away"))  # nothing may read it again
            slices.extend(weakref.ref(c.graph) for c in new.loaded.contents)
            moved.append(new)
        return new

    parsed_after = []

    def on_step(step, *_):
        if step > 2:  # after the switch: no parsed bundle of the new plan (its slices' weights) is held here
            gc.collect()
            parsed_after.append(sum(ref() is not None for ref in slices))

    with InProcessWorkers(2, timeout_s=30) as workers:
        result = _run(workers, loaded, STEPS, batches, replan_every=2, on_replan=on_replan, on_step=on_step)
    assert workers.codes == [0, 0], workers.errors
    (new,) = moved
    assert parsed_after == [0, 0]
    assert result.replans[0][0] == 2 and result.ranges == new.ranges and new.ranges != [(0, 2), (3, 4)]
    assert new.loaded.released  # shipped, then let go
    losses, weights = single_device_training(graph, batches, STEPS)
    assert result.losses == losses
    for k in weights:
        np.testing.assert_array_equal(result.weights[k], weights[k], err_msg=k)
