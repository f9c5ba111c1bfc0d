"""Re-planning: the pure decision (planner.replan) on the cost tests' hand-built cluster, and a
re-plan in the middle of real pipeline training (worker processes over ZeroMQ) that moves weights
and optimizer state at a flush boundary and then trains exactly like a run that used the new
block ranges from that step; also when the re-plan renumbers the workers (drops the middle one,
reverses their order), which renames them on the wire."""
from __future__ import annotations

import math

import numpy as np
import pytest

from jobs.train.pipeline import LocalWorkers, PlanInMemory, step_feeds, train_pipeline
from planner.onnx_import import load_model
from planner.partition import (PlanDoesNotFit, check_feasible, make_instance, manual_partition, predicted_step_us,
                               solve_partition)
from planner.replan import (BlockMove, best_cuts, moves_between, partition_of,
                            predicted_compute_s, profile_from_timings, recalibrate, replan, replan_without,
                            scale_profile, with_devices, without_devices)
from ir.partition import even_ranges
from runtime.pipeline.checkpoints import load_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement
from runtime.pipeline.executor import COORDINATOR
from runtime.keys import signer
from runtime.transport.zeromq import ZmqTransport
from support import M, single_device_training, synthetic_batch, tiny_cluster, tiny_graph

SCHEDULE, MB, OPT = "1f1b-flush", 4, "sgd"  # the hand-built cluster is sized for sgd


def _current():
    """The best plan on the unchanged cluster: b runs block 0, a runs blocks 1-3."""
    inst = make_instance(tiny_graph(), tiny_cluster(), SCHEDULE, MB, OPT)
    part = solve_partition(inst, workers=1)
    assert (part.devices, part.ranges) == (["b", "a"], [(0, 0), (1, 3)])
    return part


def _slowed(cluster, device: str, factor: float):
    return with_devices(cluster, {device: {"profile": scale_profile(cluster.device(device).profile, factor)}})


# --- pure: moves, profiles, decisions ---------------------------------------------------------------

def test_moves_are_the_blocks_whose_device_changes():
    g = tiny_graph()
    old = partition_of([(0, 1), (2, 3)], ["a", "b"])
    assert moves_between(old, old, g) == ()
    shifted = partition_of([(0, 0), (1, 3)], ["a", "b"])
    assert moves_between(old, shifted, g) == (BlockMove(1, "a", "b", (), 2000),)
    # with the optimizer, its state travels too (sgd: one momentum buffer per parameter byte)
    assert moves_between(old, shifted, g, "sgd")[0].state_nbytes == 2000
    assert moves_between(old, shifted, g, "adamw")[0].state_nbytes == 4000
    swapped = partition_of([(0, 1), (2, 3)], ["b", "c"])
    assert [(m.block, m.from_device, m.to_device, m.nbytes) for m in moves_between(old, swapped, g)] == [
        (0, "a", "b", 1000), (1, "a", "b", 2000), (2, "b", "c", 2000), (3, "b", "c", 100)]
    with pytest.raises(ValueError, match="new plan covers blocks 0..1, the model has 0..3"):
        moves_between(old, partition_of([(0, 1)], ["a"]), g)


def test_moves_name_the_parameters_of_the_real_model(tiny_onnx):
    g = load_model(tiny_onnx["torchscript-17"], 2, 12)
    moves = moves_between(partition_of([(0, 1), (2, 4)], ["x", "y"]), partition_of([(0, 2), (3, 4)], ["x", "y"]), g)
    assert [(m.block, m.from_device, m.to_device) for m in moves] == [(2, "y", "x")]
    assert moves[0].params == g.blocks[2].params and moves[0].params
    assert moves[0].nbytes == sum(g.constants[p].nbytes for p in g.blocks[2].params)


def test_scaled_profile_scales_every_time_and_no_memory():
    prof = tiny_cluster().device("a").profile
    double = scale_profile(prof, 2.0)
    for old, new in zip(prof.backends, double.backends):
        for sig, c in old.blocks.items():
            d = new.blocks[sig]
            assert (d.forward_s, d.backward_s, d.recompute_s) == pytest.approx((2 * c.forward_s, 2 * c.backward_s,
                                                                                2 * c.recompute_s))
            assert d.workspace_bytes == c.workspace_bytes
    assert (double.memory_available_bytes, double.runtime_overhead_bytes) == (prof.memory_available_bytes,
                                                                                prof.runtime_overhead_bytes)
    only = scale_profile(prof, 3.0, backend="mnn:cpu:t1")
    assert only.backend("mnn:cpu:t4") == prof.backend("mnn:cpu:t4")
    assert only.backend("mnn:cpu:t1") != prof.backend("mnn:cpu:t1")
    # measured F+B k times the prediction: the block times scale by k
    assert profile_from_timings(prof, 0.3, 0.1) == scale_profile(prof, 0.3 / 0.1)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            scale_profile(prof, bad)
    with pytest.raises(ValueError, match="measured stage seconds must be a finite number > 0"):
        profile_from_timings(prof, 0.0, 0.1)
    with pytest.raises(KeyError, match="no backend 'mnn:gpu'"):
        scale_profile(prof, 2.0, backend="mnn:gpu")


def test_recalibrate_scales_each_device_by_measured_over_predicted():
    g, cl = tiny_graph(), tiny_cluster()
    part = _current()
    predicted = predicted_compute_s(g, cl, part, MB)
    # b: block 0; a (t1): blocks 1-3, the last 1F1B stage, which skips MNN's 2 x 0.005 s forward re-run
    assert predicted == pytest.approx([MB * 0.006, MB * (0.03 + 0.03 + 0.001 - 2 * 0.005)])
    # under GPipe nothing reuses its forward's caches: the head's re-run is priced at least half its 0.5 ms
    # forward (`planner.cost.mnn_rerun_floor`; its profile read none), the encoders' 5 ms as measured
    assert predicted_compute_s(g, cl, part, MB, "gpipe")[1] == pytest.approx(MB * (0.061 + 0.5 * 0.0005))
    new = recalibrate(g, cl, part, [predicted[0] * 3, predicted[1]], MB)
    assert predicted_compute_s(g, new, part, MB) == pytest.approx([3 * predicted[0], predicted[1]])
    assert new.device("c") == cl.device("c")  # not in the plan: unchanged
    with pytest.raises(ValueError, match="1 measured stage times for a plan of 2 stages"):
        recalibrate(g, cl, part, [1.0], MB)


def test_no_replan_when_nothing_changed_or_the_gain_is_below_the_threshold():
    g, cl, current = tiny_graph(), tiny_cluster(), _current()
    same = replan(g, cl, current, SCHEDULE, MB, OPT, workers=1)
    assert same.new_partition is None and same.moves == () and not same.forced
    assert same.predicted_old_s == same.predicted_new_s == pytest.approx(0.2145)
    assert "still the best" in same.reason
    # a slowed by 1.75x: a better plan exists, 21.9% more throughput, which a 30% threshold refuses: a
    # takes blocks 0-1 as the first stage, where keeping its activations (picked again for its new
    # blocks, as plan picks them) skips its encoder's 1.75 x 5 ms forward re-run ...
    slow = _slowed(cl, "a", 1.75)
    kept = replan(g, slow, current, SCHEDULE, MB, OPT, threshold=0.3, workers=1)
    assert kept.new_partition is None and kept.moves == ()
    assert kept.gain == pytest.approx(0.3675 / (0.31025 - 1.75 * 0.005) - 1, rel=1e-3)
    assert "not above the threshold 30.0%" in kept.reason
    # ... and the default 10% takes, moving the blocks that change device
    taken = replan(g, slow, current, SCHEDULE, MB, OPT, workers=1)
    assert taken.new_partition is not None and not taken.forced and taken.gain > 0.1
    assert (taken.new_partition.devices, taken.new_partition.ranges) == (["a", "b"], [(0, 1), (2, 3)])
    assert taken.moves == moves_between(current, taken.new_partition, g, OPT)
    assert [m.block for m in taken.moves] == [0, 2, 3]
    assert dict(taken.engine_moves) == {"a": ("mnn:cpu:t1 (recompute)", "mnn:cpu:t1 (keep)"),
                                        "b": ("mnn:cpu:t2 (recompute)", "mnn:cpu:t2 (keep)")}
    assert taken.new_cluster.device("a").activations == "keep"
    assert taken.predicted_new_s == pytest.approx(predicted_step_us(
        make_instance(g, taken.new_cluster, SCHEDULE, MB, OPT), taken.new_partition) / 1e6)


def test_a_device_gone_forces_a_replan_whatever_the_threshold():
    g, cl, current = tiny_graph(), tiny_cluster(), _current()
    gone = replan(g, without_devices(cl, "b"), current, SCHEDULE, MB, OPT, threshold=100.0, workers=1)
    assert gone.forced and gone.new_partition is not None and math.isinf(gone.predicted_old_s)
    assert "b" not in gone.new_partition.devices
    assert "device 'b' left the cluster" in gone.reason
    assert [(m.block, m.from_device) for m in gone.moves] == [(0, "b")]  # b's blocks must go somewhere
    with pytest.raises(ValueError, match="no device would be left"):
        without_devices(cl, "a", "b", "c")


def test_less_memory_forces_a_replan_even_to_a_slower_plan():
    g, cl, current = tiny_graph(), tiny_cluster(), _current()
    tight = with_devices(cl, {"a": {"memory_budget_bytes": 16_000}})
    d = replan(g, tight, current, SCHEDULE, MB, OPT, threshold=100.0, workers=1)
    assert d.forced and "the current plan no longer fits: stage 1 on 'a'" in d.reason
    assert all(s.memory_bytes <= s.memory_budget_bytes for s in d.new_partition.stages)
    assert d.predicted_new_s > d.predicted_old_s  # slower, but it runs


def test_keep_order_moves_only_the_cuts_and_is_the_best_such_plan():
    g, cl = tiny_graph(), tiny_cluster()
    current = partition_of([(0, 1), (2, 2), (3, 3)], ["b", "a", "c"])
    # a slowed, and b short of memory for blocks 0-1 (17560 bytes): the cuts must move
    slow = with_devices(_slowed(cl, "a", 4.0), {"b": {"memory_budget_bytes": 17_000}})
    d = replan(g, slow, current, SCHEDULE, MB, OPT, keep_order=True)
    assert d.new_partition.devices == ["b", "a", "c"] and d.new_partition.method == "keep-order"
    inst = make_instance(g, slow, SCHEDULE, MB, OPT)
    brute = min(predicted_step_us(inst, manual_partition(inst, ["b", "a", "c"], [i, j]))
                for i in range(1, 4) for j in range(i + 1, 4)
                if all(s.memory_bytes <= s.memory_budget_bytes
                       for s in manual_partition(inst, ["b", "a", "c"], [i, j]).stages))
    assert predicted_step_us(inst, d.new_partition) == brute
    assert best_cuts(inst, ["b", "a", "c"]).ranges == d.new_partition.ranges
    # a device gone: the rest keep their order
    gone = replan(g, without_devices(cl, "c"), current, SCHEDULE, MB, OPT, keep_order=True)
    assert gone.forced and gone.new_partition.devices == ["b", "a"]
    # without a, b and c in this order (each with 15000 bytes) cannot hold the model; the error says by
    # how much and what to try
    small = with_devices(cl, {"b": {"memory_budget_bytes": 15_000}, "c": {"memory_budget_bytes": 15_000}})
    with pytest.raises(PlanDoesNotFit, match="no placement of the cuts over b, c .* keep_order=False") as err:
        replan(g, without_devices(small, "a"), current, SCHEDULE, MB, OPT, keep_order=True)
    assert err.value.over_bytes > 0 and err.value.device in ("b", "c")


def test_the_replanner_of_a_plan_in_memory_moves_blocks_off_a_stage_measured_slow(graph):
    """train-pipeline's re-plans are the one re-planner's (planner.replan.PlanReplanner, the workers
    in their order, FLOPs-priced profiles recalibrated from what each stage measured), and what it
    returns is a verified plan emitted in memory from the weights given."""
    plans = PlanInMemory(graph, _config(), 1, ["tcp://w0:1", "tcp://w1:1"])
    plans([(0, 1), (2, 4)], ["tcp://w0:1", "tcp://w1:1"])
    replanner = plans.replanner(0.1)
    predicted = predicted_compute_s(graph, replanner.cluster, replanner.partition, M)
    trained = {name: graph.constants[name] + 1.0 for name in graph.params}  # the weights training has reached
    gathered = []

    def weights():
        gathered.append(1)
        return trained
    assert replanner(1, predicted, weights) is None  # as predicted: nothing to gain
    assert replanner(2, [x * 1.03 for x in predicted], weights) is None  # uniformly slower: still the best
    assert gathered == []  # no weights are gathered for a plan that stays
    new = replanner(3, [predicted[0], 5 * predicted[1]], weights)  # stage 1 five times slower than predicted
    assert new is not None and new.ranges[1][0] > 2  # it gives blocks to stage 0
    assert replanner.partition.ranges == new.ranges and replanner.decisions[-1][0] == 3
    assert new.directory is None and new.devices == ["worker0", "worker1"] and gathered == [1]
    # the plan: verified once, its bundles the new stages with the weights given, its schedule the run's
    assert [(c.first_block, c.last_block) for c in new.loaded.contents] == new.ranges
    for c in new.loaded.contents:
        for name in c.graph.params:
            np.testing.assert_array_equal(c.graph.constants[name], trained[name])
    assert new.schedule.name == "1f1b-flush" and new.schedule.stages == 2
    assert replanner(4, [0.0, 1.0], weights) is None  # nothing measured on a stage: no decision


# --- the coordinator refuses what the workers cannot do --------------------------------------------

def test_the_coordinator_checks_new_placements_before_touching_a_worker(tiny_onnx):
    g = load_model(tiny_onnx["torchscript-17"], 2, 12)
    placements = [StagePlacement(0, 0, 1, "tcp://w0:1"), StagePlacement(1, 2, 4, "tcp://w1:1")]
    coord = Coordinator(placements, PipelineConfig("1f1b-flush", 2), None, [g, g])  # no worker is reached
    with pytest.raises(ValueError, match="the new stages cover blocks 0..3, the model has 0..4"):
        coord.reconfigure([StagePlacement(0, 0, 3, "tcp://w0:1")])
    with pytest.raises(ValueError, match="placement 0 is numbered stage 1; number the stages 0..1"):
        coord.reconfigure([StagePlacement(1, 0, 1, "tcp://w1:1"), StagePlacement(0, 2, 4, "tcp://w0:1")])
    with pytest.raises(ValueError, match="a worker may run one stage only; addresses repeat"):
        coord.reconfigure([StagePlacement(0, 0, 1, "tcp://w0:1"), StagePlacement(1, 2, 4, "tcp://w0:1")])
    # every run is a plan: the new stages come as the new plan's bundles, never as graph slices
    with pytest.raises(ValueError, match="a re-plan must bring the new plan's bundle and device name for each of its 2"):
        coord.reconfigure(placements)
    with pytest.raises(ValueError, match="a worker may appear once among the stages and spares"):
        Coordinator(placements, PipelineConfig("1f1b-flush", 2), None, [g, g], spares=["tcp://w1:1"])


def test_replanning_needs_a_flush_schedule():
    config = PipelineConfig("1f1b-stash", 2)
    with pytest.raises(ValueError, match="re-planning needs a flush schedule"):
        train_pipeline(None, [], 9, ["tcp://127.0.0.1:1"], config, 2, replan_every=1, on_replan=lambda s, t: None)
    with pytest.raises(ValueError, match="replan_every needs on_replan"):
        train_pipeline(None, [], 9, ["tcp://127.0.0.1:1"], PipelineConfig("gpipe", 2), 2, replan_every=1)


# --- real workers: re-plan mid-training ------------------------------------------------------------

@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], 2, 12)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(4)]


def _config() -> PipelineConfig:
    return PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)


def _train(graph, batches, workers: int, steps: int, replans_of=None, **kwargs):
    """The result, and the workers' addresses (stage k on the k-th). `replans_of(plans)`: the run's
    on_replan, given its plans in memory (a PlanInMemory)."""
    local = LocalWorkers.start(workers, threads=1)
    try:
        if replans_of is not None:
            plans = PlanInMemory(graph, _config(), 1, local.addresses, sign=signer(local.keys.coordinator))
            kwargs.update(in_memory=plans, on_replan=replans_of(plans))
        return train_pipeline(graph, batches, 9, local.addresses, _config(), steps, keys=local.keys, **kwargs), local.addresses
    finally:
        assert local.wait(30.0) == [0] * workers


def _assert_rel(a: dict, b: dict, rtol: float) -> None:
    for k in b:
        err = float(np.abs(a[k] - b[k]).max()) / max(float(np.abs(b[k]).max()), 1e-12)
        assert err <= rtol, f"{k}: relative error {err:.3g}"


@pytest.mark.slow  # twin on threads: tests/pipeline/test_pipeline_inprocess.py
def test_a_slowed_worker_triggers_a_replan_that_trains_like_the_new_plan_from_that_step(graph, batches, tmp_path):
    """Steps 0-1 on ranges A; after step 2 worker 1 is measured 6x slower than predicted, the plan
    moves blocks off it (B), and steps 2-3 run on B. That must equal, exactly, a run on A for two
    steps, checkpointed, then resumed on B; and (flush schedule) single-device training."""
    names = ["worker0", "worker1", "worker2"]  # the devices of a plan made in memory are its workers
    a_ranges = even_ranges(len(graph.blocks), 3)
    calls = []

    def replans_of(plans):
        def on_replan(step, measured, weights):
            assert len(measured) == 3 and all(x > 0 for x in measured)  # the real F+B seconds per step
            replanner = plans.replanner()  # the one re-planner, over the plan in use
            predicted = predicted_compute_s(graph, replanner.cluster, replanner.partition, M)
            # what a worker with its threads cut reports
            new = replanner(step, [predicted[0], 6 * predicted[1], predicted[2]], weights)
            calls.append((step, replanner.decisions[-1][1]))
            return new
        return on_replan

    result, addresses = _train(graph, batches, 3, 4, replan_every=2, replans_of=replans_of)
    assert [step for step, _ in calls] == [2]  # not after the last step
    decision = calls[0][1]
    b_ranges = decision.new_partition.ranges
    assert b_ranges != a_ranges and result.ranges == b_ranges
    flops = lambda r: sum(b.flops for b in graph.blocks[r[0]:r[1] + 1])  # noqa: E731
    assert flops(b_ranges[1]) < flops(a_ranges[1])  # the slowed worker does less

    # the coordinator moved what the planner said would move
    (step, reconf), = result.replans
    assert step == 2 and reconf.old_ranges == a_ranges and reconf.new_ranges == b_ranges and reconf.idle == []
    address = dict(zip(names, addresses))
    assert [(m.block, m.from_address, m.to_address, m.params) for m in reconf.moves] == [
        (m.block, address[m.from_device], address[m.to_device], m.params) for m in decision.moves]
    # adamw: weights plus two moments per parameter
    assert reconf.moved_bytes == 3 * sum(m.nbytes for m in decision.moves)

    # oracle 1: A for steps 0-1, a checkpoint, then B from step 2 in fresh processes
    first, _ = _train(graph, batches, 3, 2, checkpoint_dir=tmp_path / "ckpt")
    _, weights, per_stage = load_checkpoint(tmp_path / "ckpt")
    union = {k: v for state in per_stage.values() for k, v in state.items()}  # each stage takes what it owns
    second, _ = _train(graph, batches, 3, 2, start_step=2, weights=weights, optimizer_state={k: union for k in range(3)},
                    cuts=[r[0] for r in b_ranges[1:]])
    assert result.losses == first.losses + second.losses
    for k in second.weights:
        np.testing.assert_array_equal(result.weights[k], second.weights[k], err_msg=k)
    # oracle 2: a flush schedule is single-device training, whatever the cuts
    losses, single = single_device_training(graph, batches, 4)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_rel(result.weights, single, 1e-5)


@pytest.mark.slow  # twin on threads: tests/pipeline/test_pipeline_inprocess.py
def test_a_worker_leaving_at_the_end_of_the_pipeline(graph, batches):
    """Worker 2 leaves after step 1: the forced re-plan gives its blocks to the others; it is reset,
    waits idle and exits cleanly at the end; training continues like single-device training."""
    a_ranges = even_ranges(len(graph.blocks), 3)
    forced = []

    def replans_of(plans):
        def on_replan(step, measured, weights):
            replanner = plans.replanner()
            new = replanner.without(step, ["worker2"], weights())
            forced.append(replanner.decisions[-1][1].forced)
            return new
        return on_replan

    result, addresses = _train(graph, batches, 3, 3, replan_every=1, replans_of=replans_of)
    assert forced == [True, False]
    (step, reconf), = result.replans  # the second call returns the same ranges: nothing to do
    assert step == 1 and len(reconf.new_ranges) == 2 and reconf.new_ranges[-1][1] == len(graph.blocks) - 1
    assert reconf.idle == [addresses[2]]
    held = set(range(a_ranges[2][0], a_ranges[2][1] + 1))
    assert held and {m.block for m in reconf.moves if m.from_address == addresses[2]} == held  # all it held
    assert [len(done) for done in result.stage_reports] == [3, 2, 2]
    losses, single = single_device_training(graph, batches, 3)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_rel(result.weights, single, 1e-5)


def test_the_cli_refuses_replanning_without_a_flush_schedule(tiny_onnx, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "confidant", "train-pipeline", str(tiny_onnx["torchscript-17"]),
                           "--data", str(tmp_path / "unused.txt"), "--local", "2", "--schedule", "1f1b-stash",
                           "--replan-every", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # a usage error (issue 32: flags that cannot go together exit 2)
    assert "--replan-every needs a whole number of steps >= 1 and a flush schedule" in proc.stderr


# --- real workers: a re-plan that renumbers them ------------------------------------------------------

STEPS, AT = 4, 2  # re-plan after step AT of STEPS


def _drive(graph, batches, addresses, first, steps, start_step=0, then=None, state=None, keys=None):
    """Drive a Coordinator over the workers at `addresses` directly: placements `first` (stage k:
    (range, worker index)) from `start_step`, switching to `then` after step AT; returns the step
    losses, the training state at the end, and the Reconfiguration."""
    def placements(spec):
        return [StagePlacement(k, a, b, addresses[w]) for k, ((a, b), w) in enumerate(spec)]

    transport = ZmqTransport(COORDINATOR, "tcp://127.0.0.1:0", keys=keys.coordinator.curve_keys())
    initial = placements(first)
    opt = None if state is None else {
        p.stage: state.stage_optimizer_state([x for b in graph.blocks[p.first_block:p.last_block + 1]
                                              for x in b.params]) for p in initial}
    # every run is a plan: each placement emitted in memory, signed, from the weights of its step
    plans = PlanInMemory(graph, _config(), 1, addresses, sign=signer(keys.coordinator))
    plan = plans([(p.first_block, p.last_block) for p in initial], [p.address for p in initial],
                 None if state is None else state.weights)
    coord = Coordinator(initial, _config(), transport, [graph] * len(initial), optimizer_state=opt,
                        worker_keys=keys.workers)
    losses, reconf = [], None
    try:
        coord.setup_bundles(plan.bundles, plan.devices)
        for s in range(start_step, start_step + steps):
            if then is not None and s == AT:
                now = coord.gather()
                plan = plans([r for r, _ in then], [addresses[w] for _, w in then], now.weights)
                reconf = coord.reconfigure(placements(then), bundles=plan.bundles, devices=plan.devices, state=now)
            step_losses, _ = coord.run(plan.schedule, step_feeds(batches, s, graph.batch, M, 9), s)
            losses.append(float(sum(step_losses)))
        return losses, coord.gather(), reconf
    finally:
        coord.stop()
        transport.close()


def _with_workers(n, fn):
    local = LocalWorkers.start(n, threads=1)
    try:
        return fn(local.addresses, local.keys), local.addresses
    finally:
        assert local.wait(30.0) == [0] * n  # idle ones too: released, then stopped cleanly


@pytest.fixture(scope="module")
def before_replan(graph, batches):
    """Steps 0..AT-1 on three workers, even ranges: the common start of both runs below."""
    (losses, state, _), _ = _with_workers(3, lambda a, k: _drive(graph, batches, a, _EVEN3, AT, keys=k))
    return losses, state


_EVEN3 = [((0, 1), 0), ((2, 2), 1), ((3, 4), 2)]


@pytest.mark.parametrize("then", [
    # both have twins on threads (tests/pipeline/test_pipeline_inprocess.py); the swap stays in the fast tier as
    # the check that names change hands between real processes over ZeroMQ
    pytest.param([((0, 2), 0), ((3, 4), 2)], id="middle-worker-leaves", marks=pytest.mark.slow),
    pytest.param([((0, 0), 2), ((1, 2), 1), ((3, 4), 0)], id="first-and-last-swap"),
])
def test_a_replan_that_renumbers_workers_trains_like_the_new_plan_from_that_step(graph, batches, before_replan, then):
    """Three real workers; after step AT the plan changes so that workers change position (and
    with it their name on the wire). Losses and weights equal, bit for bit, the first AT steps
    followed by a run of fresh workers that used the new placement from step AT."""
    (losses, state, reconf), addresses = _with_workers(
        3, lambda a, k: _drive(graph, batches, a, _EVEN3, STEPS, then=then, keys=k))
    assert reconf.new_ranges == [r for r, _ in then] and reconf.old_ranges == [r for r, _ in _EVEN3]
    left = sorted(set(range(3)) - {w for _, w in then})
    assert reconf.idle == [addresses[w] for w in left]
    owner = {k: addresses[w] for (a, b), w in then for k in range(a, b + 1)}
    before = {k: addresses[w] for (a, b), w in _EVEN3 for k in range(a, b + 1)}
    assert [(m.block, m.from_address, m.to_address) for m in reconf.moves] == [
        (k, before[k], owner[k]) for k in range(len(graph.blocks)) if before[k] != owner[k]]

    first_losses, at_replan = before_replan
    fresh = [(r, k) for k, (r, _) in enumerate(then)]  # the new ranges, stage k on fresh worker k
    (rest, reference, _), _ = _with_workers(
        len(then), lambda a, k: _drive(graph, batches, a, fresh, STEPS - AT, start_step=AT, state=at_replan,
                                       keys=k))
    assert losses == first_losses + rest
    assert set(state.weights) == set(reference.weights)
    for k in reference.weights:
        np.testing.assert_array_equal(state.weights[k], reference.weights[k], err_msg=k)
    for kind in reference.optimizer:
        for k in reference.optimizer[kind]:
            np.testing.assert_array_equal(state.optimizer[kind][k], reference.optimizer[kind][k], err_msg=k)


def test_a_failure_replan_prices_the_gradient_sum_of_update_every():
    """1f1b-stash with an update per 4 backwards holds a gradient sum on every stage: where a's
    budget holds blocks 1-3 only without it, the re-plan after c leaves must cut elsewhere, as the
    planner would (`best_cuts` of the instance priced with update_every=4)."""
    g, cl = tiny_graph(), tiny_cluster()
    tight = with_devices(cl, {"a": {"memory_budget_bytes": 17_000}, "b": {"memory_budget_bytes": 21_000}})
    current, devices = [(0, 0), (1, 2), (3, 3)], ["b", "a", "c"]
    k1 = replan_without(g, current, devices, ["c"], "1f1b-stash", MB, OPT, cluster=tight)
    k4 = replan_without(g, current, devices, ["c"], "1f1b-stash", MB, OPT, cluster=tight, update_every=4)
    assert k1 == [(0, 0), (1, 3)]  # blocks 1-3 fit a with no gradient sum
    inst = make_instance(g, without_devices(tight, "c"), "1f1b-stash", MB, OPT, 4)
    assert check_feasible(manual_partition(inst, ["b", "a"], [1]), inst)  # ... but not with one
    assert k4 == best_cuts(inst, ["b", "a"]).ranges == [(0, 1), (2, 3)]
