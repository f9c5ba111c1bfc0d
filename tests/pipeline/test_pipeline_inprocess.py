"""Pipeline behaviour on the in-process layer (DESIGN.md habit 9, fake hardware first): the real
Coordinator and real Workers, each worker in its own thread, over the in-process transport
(`runtime.pipeline.inprocess`), driven by the same `train_pipeline` as the command line.

These are the fast twins of the tests over ZeroMQ between worker processes (tests/pipeline/test_pipeline.py,
tests/pipeline/test_replan.py, tests/pipeline/test_replan_bundles.py): flush schedules equal single-device training
bit for bit (and an MNN + PyTorch pipeline closely), 1f1b-stash equals its sequential replay, a
checkpoint resumes identically, a re-plan trains like the new plan from that step (also when it
renumbers the workers, and from plan bundles), and a garbled or unexpected message ends the run
with the coordinator naming the stage. Each test also checks that a plausible wrong answer (a
missed update, no optimizer state carried over, no weight stashing) really differs, so that the
comparison can fail.
"""
from __future__ import annotations

import numpy as np
import pytest

from ir.partition import even_ranges
from jobs.train.pipeline import PlanInMemory, StageChoice, step_feeds, train_pipeline
from planner.onnx_import import load_model
from planner.replan import flops_cluster, partition_of, predicted_compute_s, recalibrate, replan, without_devices
from planner.schedule import make_schedule
from runtime.engines.mnn import MnnStageEngine
from runtime.pipeline.checkpoints import load_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement, WorkerFailed
from runtime.pipeline.inprocess import STOPPED, InProcessWorkers
from runtime.pipeline.local_replay import LocalPipeline
from runtime.transport.local import LocalTransport
from runtime.transport.wire import MessageError, TensorHeader
from tasks.tokenize import split_microbatches
from tasks.trainer import batch_feeds
from support import M, ROWS, S, export_onnx, kill_then_restart, single_device_training, synthetic_batch

STEPS = 2


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    # tiny_onnx's torchscript-17 file, exported alone: run by itself this module then skips the
    # dynamo exports it does not use (in a whole session the file is already there)
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(4)]


def _config(schedule: str = "1f1b-flush") -> PipelineConfig:
    return PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30)


def _train(graph, batches, stages: int, steps: int = STEPS, schedule: str = "1f1b-flush", replans_of=None, **kwargs):
    """`train_pipeline` over `stages` in-process workers: the result and the workers (joined).
    `replans_of(plans)`: the run's on_replan, given its plans in memory (a PlanInMemory)."""
    with InProcessWorkers(stages, timeout_s=30) as workers:
        if replans_of is not None:
            plans = PlanInMemory(graph, _config(schedule), 1, workers.addresses)
            kwargs.update(in_memory=plans, on_replan=replans_of(plans))
        result = train_pipeline(graph, batches, 9, workers.addresses, _config(schedule), steps,
                                transport=workers.coordinator, **kwargs)
    assert workers.codes == [0] * stages, workers.errors
    return result, workers


def _assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _differs(got: dict, want: dict) -> bool:
    return any(not np.array_equal(got[k], want[k]) for k in want)


# --- flush schedules are single-device training --------------------------------------------------

@pytest.fixture(scope="module")
def single(graph, batches):
    """Single-device training for STEPS steps, and for one step less (a wrong reference)."""
    return single_device_training(graph, batches, STEPS), single_device_training(graph, batches, STEPS - 1)


@pytest.mark.parametrize("schedule,stages", [("1f1b-flush", 2), ("1f1b-flush", 3), ("gpipe", 2), ("gpipe", 3)])
def test_flush_schedules_equal_single_device_training(graph, batches, single, schedule, stages):
    """Bit for bit: the same engine on the same micro-batches, gradients summed in the same order,
    whether the stages run in threads, in processes (tests/pipeline/test_pipeline.py) or as one model."""
    result, _ = _train(graph, batches, stages, schedule=schedule)
    (losses, weights), (_, one_step) = single
    assert result.losses == losses
    _assert_same_weights(result.weights, weights)
    assert [tuple(r) for r in result.ranges] == even_ranges(len(graph.blocks), stages)
    assert result.losses[1] != result.losses[0]
    assert _differs(result.weights, one_step)  # a missed update would not pass


# --- weight stashing is its sequential replay ---------------------------------------------------

def _replay(graph, batches, ranges, stash: bool):
    pipe = LocalPipeline(graph, ranges, lambda spec: MnnStageEngine(spec, stash_weights=stash), "adamw", 1e-3)
    schedule = make_schedule("1f1b-stash", len(ranges), STEPS * M)
    feeds = [batch_feeds(mb, 9, b.n_labelled) for b in batches[:STEPS] for mb in split_microbatches(b, M)]
    return pipe.run(schedule, feeds), pipe.parameters()


def test_weight_stashing_equals_sequential_replay_and_differs_without_it(graph, batches, single):
    result, _ = _train(graph, batches, 3, schedule="1f1b-stash")
    losses, weights = _replay(graph, batches, result.ranges, stash=True)
    step_losses = [sum(losses[i * M:(i + 1) * M]) for i in range(STEPS)]
    assert result.losses == step_losses  # exactly: same engine, same action order
    _assert_same_weights(result.weights, weights)
    _, unstashed = _replay(graph, batches, result.ranges, stash=False)
    assert _differs(unstashed, weights)
    # and asynchronous 1F1B is not single-device training: that is what stashing keeps consistent
    (single_losses, _), _ = single
    assert step_losses[1] != pytest.approx(single_losses[1], rel=1e-6)


def test_torch_stages_stepping_in_their_backwards_equal_the_replay_stepping_after(graph, batches):
    """PyTorch workers under 1f1b-stash step each weight in its backward (the executor fuses each B
    with its UPDATE): the same losses and weights, exactly, as the sequential replay whose engines
    take the whole backward and then the step; the replay without weight stashing (every forward on
    the newest weights: set_parameters after each step) differs."""
    from runtime.engines.pytorch import TorchStageEngine

    config = PipelineConfig(schedule="1f1b-stash", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30,
                            engine="torch")
    with InProcessWorkers(3, timeout_s=30) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, transport=workers.coordinator)
    assert workers.codes == [0] * 3, workers.errors

    def engine(spec, stash: bool = True):
        e = TorchStageEngine(spec, threads=1)  # as the workers run it (a GEMM's sums follow its threads)
        e.steps_in_backward = False  # the reference: backward, then step
        if not stash:
            e.step = lambda optimizer, grads: e.set_parameters(optimizer.step(e.parameters(), grads))
        return e

    feeds = [batch_feeds(mb, 9, b.n_labelled) for b in batches[:STEPS] for mb in split_microbatches(b, M)]
    schedule = make_schedule("1f1b-stash", 3, STEPS * M)
    replayed = {}
    for stash in (True, False):
        pipe = LocalPipeline(graph, result.ranges, lambda spec: engine(spec, stash), "adamw", 1e-3)
        replayed[stash] = pipe.run(schedule, feeds), pipe.parameters()
    losses, weights = replayed[True]
    assert result.losses == [sum(losses[i * M:(i + 1) * M]) for i in range(STEPS)]
    _assert_same_weights(result.weights, weights)
    assert _differs(replayed[False][1], weights)


# --- checkpoints ------------------------------------------------------------------------------------

def test_checkpoint_then_resume_continues_identically(graph, batches, tmp_path):
    whole, _ = _train(graph, batches, 2, steps=3)
    first, _ = _train(graph, batches, 2, steps=2, checkpoint_dir=tmp_path / "ckpt", meta={"model": "tiny"})
    meta, weights, opt_state = load_checkpoint(tmp_path / "ckpt")
    assert meta["step"] == 2 and meta["stages"] == 2 and meta["losses"] == first.losses
    cuts = [r[0] for r in meta["ranges"][1:]]
    resumed, _ = _train(graph, batches, 2, steps=1, start_step=2, weights=weights, optimizer_state=opt_state,
                        cuts=cuts)
    assert first.losses == whole.losses[:2]
    assert resumed.losses == whole.losses[2:]
    _assert_same_weights(resumed.weights, whole.weights)
    # the optimizer state is part of what resumes: the weights alone continue differently
    forgetful, _ = _train(graph, batches, 2, steps=1, start_step=2, weights=weights, cuts=cuts)
    assert _differs(forgetful.weights, whole.weights)


# --- re-planning mid-training ------------------------------------------------------------------

def test_a_slowed_worker_triggers_a_replan_that_trains_like_the_new_plan_from_that_step(graph, batches, tmp_path):
    """Twin of tests/pipeline/test_replan.py's: steps 0-1 on ranges A; after step 2 worker 1 is reported 6x
    slower than predicted, the plan moves blocks off it (B), and steps 2-3 run on B. That equals,
    exactly, A for two steps, checkpointed, then B from step 2 on fresh workers; and single-device
    training."""
    names = ["worker0", "worker1", "worker2"]  # the devices of a plan made in memory are its workers
    a_ranges = even_ranges(len(graph.blocks), 3)
    calls = []

    def replans_of(plans):
        def on_replan(step, measured, weights):
            assert len(measured) == 3 and all(x > 0 for x in measured)  # the real F+B seconds per step
            replanner = plans.replanner()  # the one re-planner, over the plan in use
            predicted = predicted_compute_s(graph, replanner.cluster, replanner.partition, M)
            new = replanner(step, [predicted[0], 6 * predicted[1], predicted[2]], weights)  # worker 1: 6x slower
            calls.append((step, replanner.decisions[-1][1], new))
            return new
        return on_replan

    result, workers = _train(graph, batches, 3, 4, replan_every=2, replans_of=replans_of)
    assert [step for step, _, _ in calls] == [2]  # not after the last step
    decision, new = calls[0][1:]
    b_ranges = decision.new_partition.ranges
    # what the workers got is a verified plan of the re-planner's decision, made in memory
    assert new.directory is None and new.ranges == b_ranges and new.loaded.plan.device_names == names
    assert [list(d.blocks) for d in new.loaded.plan.devices] == [list(r) for r in b_ranges]
    assert new.loaded.released  # shipped, then let go
    assert b_ranges != a_ranges and result.ranges == b_ranges
    flops = lambda r: sum(b.flops for b in graph.blocks[r[0]:r[1] + 1])  # noqa: E731
    assert flops(b_ranges[1]) < flops(a_ranges[1])  # the slowed worker does less

    (step, reconf), = result.replans
    assert step == 2 and reconf.old_ranges == a_ranges and reconf.new_ranges == b_ranges and reconf.idle == []
    address = dict(zip(names, workers.addresses))
    assert [(m.block, m.from_address, m.to_address, m.params) for m in reconf.moves] == [
        (m.block, address[m.from_device], address[m.to_device], m.params) for m in decision.moves]
    assert reconf.moved_bytes == 3 * sum(m.nbytes for m in decision.moves)  # adamw: weights and two moments

    # oracle 1: A for steps 0-1, a checkpoint, then B from step 2 on fresh workers
    first, _ = _train(graph, batches, 3, 2, checkpoint_dir=tmp_path / "ckpt")
    _, weights, per_stage = load_checkpoint(tmp_path / "ckpt")
    union = {k: v for state in per_stage.values() for k, v in state.items()}  # each stage takes what it owns
    cuts = [r[0] for r in b_ranges[1:]]
    second, _ = _train(graph, batches, 3, 2, start_step=2, weights=weights,
                       optimizer_state={k: union for k in range(3)}, cuts=cuts)
    assert result.losses == first.losses + second.losses
    _assert_same_weights(result.weights, second.weights)
    # a re-plan that moved the weights but lost the optimizer state would not pass
    forgetful, _ = _train(graph, batches, 3, 2, start_step=2, weights=weights, cuts=cuts)
    assert _differs(forgetful.weights, second.weights)
    # oracle 2: a flush schedule is single-device training, whatever the cuts
    losses, single = single_device_training(graph, batches, 4)
    assert result.losses == losses
    _assert_same_weights(result.weights, single)


def test_a_worker_leaving_at_the_end_of_the_pipeline(graph, batches):
    """Worker 2 leaves after step 1: the forced re-plan gives its blocks to the others; it is
    released, waits nameless and stops cleanly at the end; training equals single-device training."""
    a_ranges = even_ranges(len(graph.blocks), 3)
    forced = []

    def replans_of(plans):
        def on_replan(step, measured, weights):
            replanner = plans.replanner()
            new = replanner.without(step, ["worker2"], weights())
            forced.append(replanner.decisions[-1][1].forced)
            return new
        return on_replan

    result, workers = _train(graph, batches, 3, 3, replan_every=1, replans_of=replans_of)
    assert forced == [True, False]
    (step, reconf), = result.replans  # the second call returns the same ranges: nothing to do
    assert step == 1 and len(reconf.new_ranges) == 2 and reconf.new_ranges[-1][1] == len(graph.blocks) - 1
    assert reconf.idle == [workers.addresses[2]]
    held = set(range(a_ranges[2][0], a_ranges[2][1] + 1))
    assert held and {m.block for m in reconf.moves if m.from_address == workers.addresses[2]} == held
    assert [len(done) for done in result.stage_reports] == [3, 2, 2]
    assert workers.workers[2].stage is None  # it gave up its name
    losses, single = single_device_training(graph, batches, 3)
    assert result.losses == losses
    _assert_same_weights(result.weights, single)


# --- a re-plan that renumbers the workers (renames them on the wire) --------------------------------

ALL, AT = 4, 2  # re-plan after step AT of ALL
_EVEN3 = [((0, 1), 0), ((2, 2), 1), ((3, 4), 2)]


def _drive(graph, batches, workers: InProcessWorkers, first, steps, start_step=0, then=None, state=None,
           keep_optimizer=True):
    """Drive a Coordinator over `workers` directly: placements `first` (stage k: (range, worker
    index)) from `start_step`, switching to `then` after step AT; the step losses, the training
    state at the end, and the Reconfiguration. Workers in neither placement are spares."""
    def placements(spec):
        return [StagePlacement(k, a, b, workers.addresses[w]) for k, ((a, b), w) in enumerate(spec)]

    initial = placements(first)
    used = {w for _, w in first}
    spares = [a for w, a in enumerate(workers.addresses) if w not in used]
    opt = None if state is None or not keep_optimizer else {
        p.stage: state.stage_optimizer_state([x for b in graph.blocks[p.first_block:p.last_block + 1]
                                              for x in b.params]) for p in initial}
    # every run is a plan: each placement emitted in memory from the weights of its step, as train_pipeline does
    plans = PlanInMemory(graph, _config(), 1, workers.addresses)
    plan = plans([(p.first_block, p.last_block) for p in initial], [p.address for p in initial],
                 None if state is None else state.weights)
    coord = Coordinator(initial, _config(), workers.coordinator, [graph] * len(initial), optimizer_state=opt,
                        spares=spares)
    losses, reconf = [], None
    try:
        coord.setup_bundles(plan.bundles, plan.devices)
        for s in range(start_step, start_step + steps):
            if then is not None and s == AT:
                now = coord.gather()
                plan = plans([r for r, _ in then], [workers.addresses[w] for _, w in then], now.weights)
                reconf = coord.reconfigure(placements(then), bundles=plan.bundles, devices=plan.devices, state=now)
            step_losses, _ = coord.run(plan.schedule, step_feeds(batches, s, graph.batch, M, 9), s)
            losses.append(float(sum(step_losses)))
        return losses, coord.gather(), reconf
    finally:
        coord.stop()


def _with_workers(n, fn):
    with InProcessWorkers(n, timeout_s=30) as workers:
        out = fn(workers)
    assert workers.codes == [0] * n, workers.errors  # idle ones too: released, then stopped cleanly
    return out, workers


@pytest.fixture(scope="module")
def before_replan(graph, batches):
    """Steps 0..AT-1 on three workers, even ranges: the common start of the runs below."""
    (losses, state, _), _ = _with_workers(3, lambda w: _drive(graph, batches, w, _EVEN3, AT))
    return losses, state


@pytest.mark.parametrize("then", [
    pytest.param([((0, 2), 0), ((3, 4), 2)], id="middle-worker-leaves"),
    pytest.param([((0, 0), 2), ((1, 2), 1), ((3, 4), 0)], id="first-and-last-swap"),
    pytest.param([((0, 1), 0), ((2, 2), 3), ((3, 4), 1)], id="a-spare-joins-and-the-last-leaves"),
])
def test_a_replan_that_renumbers_workers_trains_like_the_new_plan_from_that_step(graph, batches, before_replan, then):
    """Workers change position after step AT (and with it their name on the wire). Losses and
    weights equal, bit for bit, the first AT steps followed by fresh workers that used the new
    placement from step AT; without the optimizer state carried over they would not."""
    n = 1 + max(w for _, w in _EVEN3 + then)
    (losses, state, reconf), workers = _with_workers(n, lambda w: _drive(graph, batches, w, _EVEN3, ALL, then=then))
    assert reconf.new_ranges == [r for r, _ in then] and reconf.old_ranges == [r for r, _ in _EVEN3]
    left = sorted(set(range(n)) - {w for _, w in then})
    assert reconf.idle == [workers.addresses[w] for w in left]
    owner = {k: workers.addresses[w] for (a, b), w in then for k in range(a, b + 1)}
    before = {k: workers.addresses[w] for (a, b), w in _EVEN3 for k in range(a, b + 1)}
    assert [(m.block, m.from_address, m.to_address) for m in reconf.moves] == [
        (k, before[k], owner[k]) for k in range(len(graph.blocks)) if before[k] != owner[k]]
    # each worker answers to its new stage's name, and the ones left out hold none
    assert [workers.workers[w].stage for _, w in then] == list(range(len(then)))
    assert [workers.workers[w].transport.name for _, w in then] == [f"stage{k}" for k in range(len(then))]
    assert [workers.workers[w].stage for w in left] == [None] * len(left)

    first_losses, at_replan = before_replan
    fresh = [(r, k) for k, (r, _) in enumerate(then)]  # the new ranges, stage k on fresh worker k
    (rest, reference, _), _ = _with_workers(
        len(then), lambda w: _drive(graph, batches, w, fresh, ALL - AT, start_step=AT, state=at_replan))
    assert losses == first_losses + rest
    _assert_same_weights(state.weights, reference.weights)
    assert set(state.optimizer) == set(reference.optimizer)
    for kind in reference.optimizer:
        _assert_same_weights(state.optimizer[kind], reference.optimizer[kind])
    (_, forgetful, _), _ = _with_workers(
        len(then), lambda w: _drive(graph, batches, w, fresh, ALL - AT, start_step=AT, state=at_replan,
                                    keep_optimizer=False))
    assert _differs(forgetful.weights, reference.weights)


# --- failures: the coordinator names the stage ---------------------------------------------------

class _CorruptsActivations(LocalTransport):
    """A stage's transport that flips one payload byte of every activation it sends, after the
    checksum was taken (as a bad link or bad memory would)."""

    def _send_frames(self, peer, frames):
        if len(frames) == 2 and TensorHeader.decode(frames[0]).kind == "act":
            payload = bytearray(frames[1])
            payload[0] ^= 0x01
            frames = [frames[0], bytes(payload)]
        super()._send_frames(peer, frames)


def test_a_garbled_activation_fails_the_receiving_stage_and_the_coordinator_names_it(graph, batches):
    """Stage 1's link corrupts what it sends stage 2: stage 2 refuses the activation, reports, and
    the run ends with WorkerFailed naming stage 2, its sender and the checksum; the stages left
    waiting for gradients are stopped instead of hanging."""
    def make_transport(k, hub, address):
        return (_CorruptsActivations if k == 1 else LocalTransport)("worker", hub, address)

    with pytest.raises(WorkerFailed) as err:
        with InProcessWorkers(3, timeout_s=30, make_transport=make_transport) as workers:
            train_pipeline(graph, batches, 9, workers.addresses, _config(), STEPS, transport=workers.coordinator)
    text = str(err.value)
    assert text.startswith(f"worker stage2 ({workers.addresses[2]}) failed: stage 2 (worker2) in s2.RECV_ACT.m0<s1: "
                           f"MessageError: "
                           f"message from "
                           f"peer 'stage1' ({workers.addresses[1]}): expected act stage=1 mb=0, received act stage=1 "
                           f"mb=0 (checksum mismatch")
    assert isinstance(workers.errors[2], MessageError) and workers.errors[2].problem.startswith("checksum mismatch")
    assert workers.codes[2] == 1 and workers.errors[:2] == [None, None]
    assert set(workers.codes[:2]) <= {0, STOPPED}


def test_the_same_activation_uncorrupted_passes(graph, batches):
    """The corrupting transport above is the only difference: the same transport class without
    the flip trains normally (so the failure is the garbling's, not the harness's)."""
    class _Passes(_CorruptsActivations):
        def _send_frames(self, peer, frames):
            LocalTransport._send_frames(self, peer, frames)

    def make_transport(k, hub, address):
        return (_Passes if k == 1 else LocalTransport)("worker", hub, address)

    with InProcessWorkers(3, timeout_s=30, make_transport=make_transport) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, _config(), STEPS, transport=workers.coordinator)
    assert workers.codes == [0, 0, 0] and len(result.losses) == STEPS


def test_an_engine_failing_in_a_backward_is_named_by_its_action(graph, batches, monkeypatch):
    """Stage 1's engine raises in its backward of micro-batch 1: the coordinator's error names the
    stage and the action it was running in the plan's one-token text form (`s1.B.m1`), as
    torch's pipelining names the failing cell of its grid, and the exception the engine raised."""
    import runtime.pipeline.worker as worker_module

    middle = even_ranges(len(graph.blocks), 3)[1][0]
    made = worker_module.make_engine

    def make_engine(backend, spec, **kwargs):
        engine = made(backend, spec, **kwargs)
        if spec.first_block == middle:
            backward = engine.backward_into  # what the executor calls: gradients summed as they come

            def failing(microbatch, into, upstream):
                if microbatch == 1:
                    raise FloatingPointError("the engine's backward overflowed")
                return backward(microbatch, into, upstream)
            engine.backward_into = failing
        return engine

    monkeypatch.setattr(worker_module, "make_engine", make_engine)
    with pytest.raises(WorkerFailed) as err:
        with InProcessWorkers(3, timeout_s=30) as workers:
            train_pipeline(graph, batches, 9, workers.addresses, _config(), STEPS, transport=workers.coordinator)
    assert str(err.value) == (f"worker stage1 ({workers.addresses[1]}) failed: stage 1 (worker1) in s1.B.m1: "
                              f"FloatingPointError: the engine's backward overflowed")
    assert isinstance(workers.errors[1], FloatingPointError) and workers.codes[1] == 1


class _AnswersOutOfTurn(LocalTransport):
    """A stage's transport that replaces its second 'done' report with a message of a type the
    protocol does not have."""

    dones = 0

    def send_control(self, peer, obj):
        if obj.get("type") == "done":
            self.dones += 1
            if self.dones == 2:
                obj = {"type": "hello", "stage": obj["stage"]}
        super().send_control(peer, obj)


def test_an_unexpected_message_makes_the_coordinator_name_the_stage(graph, batches):
    def make_transport(k, hub, address):
        return (_AnswersOutOfTurn if k == 0 else LocalTransport)("worker", hub, address)

    with pytest.raises(WorkerFailed, match=r"^expected 'done' from stage0, got 'hello' from stage0$"):
        with InProcessWorkers(2, timeout_s=30, make_transport=make_transport) as workers:
            train_pipeline(graph, batches, 9, workers.addresses, _config(), STEPS, transport=workers.coordinator)
    assert workers.errors == [None, None]  # no worker failed: the coordinator refused what one sent


def test_a_worker_failing_before_it_has_a_stage_still_ends_the_run(graph, batches):
    """A worker that breaks before any setup named it has no connection to the coordinator yet:
    the harness connects it to report, so the coordinator fails naming the worker's address
    instead of waiting out its timeout."""
    with pytest.raises(WorkerFailed) as err:
        with InProcessWorkers(2, timeout_s=30) as workers:
            garbage = LocalTransport("coordinator", workers.hub, "local://impostor")
            garbage.connect("w1", workers.addresses[1])
            garbage._send_frames("w1", [b"not json"])
            garbage.close()
            train_pipeline(graph, batches, 9, workers.addresses, _config(), STEPS, transport=workers.coordinator)
    assert f"failed: worker at {workers.addresses[1]}: MessageError: message from peer 'coordinator'" in str(err.value)
    assert "control frame is not valid JSON" in str(err.value)
    assert workers.codes[1] == 1 and workers.codes[0] in (0, STOPPED)



# --- mixed frameworks ------------------------------------------------------------------------------

def test_cross_framework_pipeline_mnn_then_torch_equals_all_mnn(graph, batches, single):
    """Twin of tests/pipeline/test_pipeline.py's: stage 0 on MNN, stage 1 on PyTorch, in two threads (torch
    releases the GIL in its kernels, so here the two stages really compute at once)."""
    pytest.importorskip("torch")
    mixed = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30)
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, mixed, STEPS, transport=workers.coordinator,
                                per_stage=(StageChoice(engine="mnn"), StageChoice(engine="torch")))
    assert workers.codes == [0, 0], workers.errors
    (losses, weights), _ = single
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    # The key bias's true gradient is exactly zero, so each framework's float32 rounding noise is all
    # AdamW sees, and AdamW scales noise up to lr-sized steps: those tensors may differ by up to
    # lr x steps; every other tensor must agree closely.
    for k, want in weights.items():
        err = float(np.abs(result.weights[k] - want).max())
        bound = 2 * 1e-3 * STEPS if k.endswith("attention.self.key.bias") else 1e-4 * float(np.abs(want).max())
        assert err <= bound, f"{k}: {err:.3g} > {bound:.3g}"
    assert _differs(result.weights, weights)  # another framework's rounding: close, not equal (torch ran)


# --- training from plan bundles, and re-planning into new ones ----------------------------------

SLOWER = 8.0  # device "a" is reported this many times slower than its profile predicts


def _flops_profile(graph, name: str, seconds_per_flop: float = 1e-9):
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile

    forward = {block_signature(b): max(b.flops * seconds_per_flop, 1e-6) for b in graph.blocks}
    costs = {sig: BlockCost(f, 2 * f) for sig, f in forward.items()}
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),), 2**33)


def _bundle_run(workers: InProcessWorkers, plan_dir, steps: int, batches, **kwargs):
    """`train_pipeline` from the plan at `plan_dir` on the first of `workers`, as `confidant train
    PLAN` drives it (the other workers are there for `spare_devices`)."""
    from ir.bundle import load_bundle_dir, load_plan

    plan = load_plan(plan_dir, verify_bundles=True)
    bundles = [plan_dir / d.bundle for d in plan.devices]
    config = PipelineConfig(schedule=plan.schedule, microbatches=plan.microbatches, timeout_s=30)
    return train_pipeline(None, batches, 9, workers.addresses[:len(bundles)], config, steps, bundles=bundles,
                          devices=plan.device_names, stage_graphs=[load_bundle_dir(b) for b in bundles],
                          schedule=plan.to_schedule(), transport=workers.coordinator, **kwargs)


def _plan_on_a_and_b(graph, plan_dir, devices: str):
    """A plan giving device a the embeddings and both encoder layers and b the rest, over a cluster of
    `devices` (FLOPs-priced profiles), and its PlanReplanner: (plan, whole graph, replanner)."""
    from ir.bundle import load_bundle_dir, load_plan
    from ir.partition import Partition, StageAssignment
    from ir.profile import Link
    from ir.serialize import merge_slices
    from planner.cluster import Cluster, DeviceSpec
    from planner.emit import emit_plan
    from planner.replan import PlanReplanner

    cluster = Cluster(tuple(DeviceSpec(n, f"tcp://127.0.0.1:{1 + i}", _flops_profile(graph, n), 2**30, "mnn:cpu:t1")
                            for i, n in enumerate(devices)), Link(1e9, 1e-4), {})
    emit_plan(plan_dir, graph, Partition((StageAssignment(0, "a", 0, 2), StageAssignment(1, "b", 3, 4)), "manual"),
              make_schedule("1f1b-flush", 2, M), {"model": "tiny", "lr": 1e-3}, cluster=cluster)
    plan = load_plan(plan_dir)
    whole = merge_slices([load_bundle_dir(plan_dir / d.bundle).graph for d in plan.devices])
    return plan, whole, PlanReplanner(plan_dir, plan, whole, cluster, workers=1)


def test_a_replan_from_bundles_writes_a_new_plan_and_trains_like_it_from_that_step(graph, batches, tmp_path):
    """Twin of tests/pipeline/test_replan_bundles.py's command-line run, on PlanReplanner (what `confidant
    train PLAN --replan-every` uses): a plan gives device a the embeddings and both encoder layers
    and b the rest, c waits as a spare; after step 2, a is reported SLOWER times slower than its
    profile predicts (as tests/pipeline/test_replan.py reports a slowed worker: deterministic, whatever the
    machine's load), so PlanReplanner writes a new plan from the gathered weights and the workers
    switch to its bundles. The run equals the old plan for 2 steps followed by the new plan's
    bundles from step 2 (with the optimizer state saved then), and single-device training."""
    from ir.bundle import load_bundle_dir, load_plan

    old_dir = tmp_path / "plan"
    old, whole, replanner = _plan_on_a_and_b(graph, old_dir, "abc")

    def on_replan(step, measured, weights):
        assert len(measured) == 2 and all(x > 0 for x in measured)  # the real F+B seconds per step
        predicted = predicted_compute_s(whole, replanner.cluster, replanner.partition, M)
        slowed = [x * (SLOWER if d == "a" else 1.0) for x, d in zip(predicted, replanner.partition.devices)]
        return replanner(step, slowed, weights)

    with InProcessWorkers(3, timeout_s=30) as workers:
        live = _bundle_run(workers, old_dir, 4, batches, replan_every=2, on_replan=on_replan,
                           spare_devices={"c": workers.addresses[2]})
    assert workers.codes == [0, 0, 0], workers.errors
    (step, reconf), = live.replans
    (applied,) = replanner.applied
    assert step == 2 and applied.step == 2 and [s for s, _ in replanner.decisions] == [2]
    new_dir = applied.directory
    new = load_plan(new_dir, verify_bundles=True)
    assert live.devices == new.device_names == applied.devices and live.ranges == applied.ranges
    flops = {d.name: sum(b.flops for b in graph.blocks[d.blocks[0]:d.blocks[1] + 1]) for d in new.devices}
    assert flops.get("a", 0) < sum(b.flops for b in graph.blocks[0:3])  # the slowed device does less
    assert reconf.moved_bytes > 0

    # the reference: the old plan for 2 steps, then the new plan's bundles from step 2
    with InProcessWorkers(2, timeout_s=30) as workers:
        first = _bundle_run(workers, old_dir, 2, batches, checkpoint_dir=tmp_path / "before")
    _, weights, per_stage = load_checkpoint(tmp_path / "before")
    assert first.losses == live.losses[:2]
    for d in new.devices:  # the new bundles hold the weights training had reached
        c = load_bundle_dir(new_dir / d.bundle)
        for name in c.graph.params:
            np.testing.assert_array_equal(c.graph.constants[name], weights[name], err_msg=name)
    union = {k: v for state in per_stage.values() for k, v in state.items()}  # each stage takes its own
    stages = len(new.devices)
    with InProcessWorkers(stages, timeout_s=30) as workers:
        rest = _bundle_run(workers, new_dir, 2, batches, start_step=2,
                           optimizer_state={k: union for k in range(stages)})
    assert live.losses[2:] == rest.losses
    _assert_same_weights(live.weights, rest.weights)
    with InProcessWorkers(stages, timeout_s=30) as workers:  # without the optimizer state: not the same
        forgetful = _bundle_run(workers, new_dir, 2, batches, start_step=2)
    assert _differs(forgetful.weights, rest.weights)
    losses, single = single_device_training(graph, batches, 4)
    assert live.losses == losses
    _assert_same_weights(live.weights, single)


@pytest.mark.parametrize("state_on", ["coordinator", "peers"])
def test_a_plan_run_takes_back_a_device_that_returns_with_a_plan_written_for_it(graph, batches, tmp_path, state_on):
    """From bundles, as `confidant train PLAN` runs: a plan over devices a and b; b vanishes after
    step 1 and PlanReplanner.without writes the recovery plan (a alone); b's worker starts again
    after step 2, answers the call back, and PlanReplanner.with_devices writes a plan over both
    (`replan-step000N-joined`) that the run switches to. Flush: the losses and weights stay
    single-device training's through both switches. The state held on the coordinator, or on
    the workers as `confidant train PLAN` keeps it (b's copy on a: the recovery plan is written
    from the weights fetched from it)."""
    from ir.bundle import load_plan
    from jobs.train.pipeline import FaultPolicy
    from jobs.train.from_plan import _plan_over

    plan_dir = tmp_path / "plan"
    _, _, replanner = _plan_on_a_and_b(graph, plan_dir, "ab")
    steps = 4
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = _bundle_run(workers, plan_dir, steps, batches, on_step=kill_then_restart(workers, 1),
                             plan_over=_plan_over(replanner, dict(zip("ab", workers.addresses))),
                             faults=FaultPolicy(state_on=state_on))
    assert workers.codes == [0, 0], workers.errors
    kinds = [e["event"] for e in result.events]
    assert kinds == ["lost", "new_plan", "recovered", "joined", "new_plan"], kinds
    recovery, joined = result.events[1], result.events[4]
    assert recovery["devices"] == ["a"] and recovery["plan"].endswith("-recovery")
    assert joined["cause"] == "joined" and joined["joined"] == ["b"] and joined["plan"].endswith("-joined")
    assert sorted(result.devices) == ["a", "b"] and len(result.ranges) == 2
    load_plan(joined["plan"], verify_bundles=True)
    want_losses, want_weights = single_device_training(graph, batches, steps)
    np.testing.assert_allclose(result.losses, want_losses, rtol=1e-5)
    for name, value in want_weights.items():
        np.testing.assert_allclose(result.weights[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_waiting_for_a_restarted_worker_names_what_it_waited_for():
    """InProcessWorkers.wait_answered: only a restarted worker can be waited for, and one that nobody
    called back times out with that said (instead of the test hanging or passing by luck)."""
    with InProcessWorkers(1, timeout_s=5) as workers:
        with pytest.raises(RuntimeError, match="worker 0 was not restarted"):
            workers.wait_answered(0)
        workers.kill(0)
        workers.restart(0)
        with pytest.raises(TimeoutError, match="restarted worker 0 sent nothing within 0.2 s"):
            workers.wait_answered(0, timeout_s=0.2)
        workers.stop()
    assert workers.codes == [STOPPED]


def test_a_snapshot_sends_a_tables_optimizer_state_as_rows_and_gathers_it_dense(graph, batches):
    """A snapshot (every step under the default fault policy) sends the optimizer's own arrays, the
    embedding tables' state as the rows that have any, and the coordinator gathers exactly the
    dense state each stage's optimizer holds: no dense copy is built on a device to be sent."""
    received = []

    def drive(workers):
        recv = workers.coordinator.recv_tensor

        def recording(peer, expected, timeout=None):
            header, arr = recv(peer, expected, timeout)
            received.append((header.name, arr.nbytes))
            return header, arr

        workers.coordinator.recv_tensor = recording
        placements = [StagePlacement(k, a, b, workers.addresses[k]) for k, (a, b) in enumerate(even_ranges(5, 2))]
        plan = PlanInMemory(graph, _config(), 1, workers.addresses)(even_ranges(5, 2), workers.addresses[:2])
        coord = Coordinator(placements, _config(), workers.coordinator, [graph, graph])
        try:
            coord.setup_bundles(plan.bundles, plan.devices)
            coord.run(plan.schedule, step_feeds(batches, 0, graph.batch, M, 9), 0)
            per_stage = coord.collect_checkpoint()
            held = [w.executor.optimizer.state() for w in workers.workers]
            return per_stage, held, set(workers.workers[0].executor.optimizer.rows)
        finally:
            coord.stop()

    (per_stage, held, by_rows), _ = _with_workers(2, drive)
    # the word and position tables; the token type table (1 of 2 rows used) went dense at once
    tables = sorted(by_rows)
    assert len(tables) == 2 and all("embeddings" in n for n in tables)
    for k in range(2):
        got = {key[len("opt/"):]: arr for key, arr in per_stage[k].items() if key.startswith("opt/")}
        assert got.keys() == held[k].keys()
        assert all(np.array_equal(got[key], held[k][key]) for key in got)
    names = dict(received)
    for table in tables:
        vocab = graph.constants[table].shape[0]
        for kind in ("m", "v"):
            assert f"opt/{kind}/{table}" not in names  # never sent dense
            n = names[f"opt/{kind}/{table}#ids"] // 8
            assert 0 < n < vocab and names[f"opt/{kind}/{table}#rows"] == n * graph.constants[table][0].nbytes


def test_a_bundle_stage_failing_in_a_backward_is_named_by_device_and_action(graph, batches, tmp_path, monkeypatch):
    """From plan bundles the worker's error also names the plan's device: `stage 1 (b) in s1.B.m1`."""
    import runtime.pipeline.worker as worker_module

    _plan_on_a_and_b(graph, tmp_path / "plan", "ab")
    made = worker_module.make_engine

    def make_engine(backend, spec, **kwargs):
        engine = made(backend, spec, **kwargs)
        if spec.first_block == 3:  # device b's stage
            def failing(microbatch, into, upstream):
                raise FloatingPointError("the engine's backward overflowed")
            engine.backward_into = failing  # what the executor calls
        return engine

    monkeypatch.setattr(worker_module, "make_engine", make_engine)
    with pytest.raises(WorkerFailed) as err:
        with InProcessWorkers(2, timeout_s=30) as workers:
            _bundle_run(workers, tmp_path / "plan", 1, batches)
    assert str(err.value) == (f"worker stage1 ({workers.addresses[1]}) failed: stage 1 (b) in s1.B.m0: "
                              f"FloatingPointError: the engine's backward overflowed")


# --- every run is a plan (issue 34) ------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b-flush", "1f1b-stash"])
def test_the_coordinator_ships_bundles_and_sends_no_action_at_run_time(graph, batches, tmp_path, schedule):
    """train_pipeline from a whole graph runs a plan made in memory: every stage is set up from a
    bundle (no graph-slice setup), no run message carries actions (1f1b-stash's segments of 2 steps
    are the bundle's steady state unrolled: the run says how many steps), and the losses are those of
    the plan's schedule run as before (its sequential replay for 1f1b-stash, single-device for flush)."""
    from runtime.pipeline.session import FaultPolicy

    sent = []
    with InProcessWorkers(2, timeout_s=30) as workers:
        send = workers.coordinator.send_control

        def recording(peer, msg):
            sent.append(dict(msg))
            return send(peer, msg)

        workers.coordinator.send_control = recording
        result = train_pipeline(graph, batches, 9, workers.addresses, _config(schedule), 4,
                                transport=workers.coordinator, faults=FaultPolicy(checkpoint_every=2),
                                checkpoint_dir=tmp_path / "ck")
    assert workers.codes == [0, 0], workers.errors
    kinds = {m["type"] for m in sent}
    assert "setup_bundle" in kinds and "setup" not in kinds, kinds
    runs = [m for m in sent if m["type"] == "run"]
    assert runs and not any("actions" in m for m in runs)
    assert {m["steps"] for m in runs} == ({2} if schedule == "1f1b-stash" else {1})
    assert len(result.losses) == 4
