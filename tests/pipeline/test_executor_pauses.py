"""Where a stage runs its own work between actions (`StageExecutor.between`: a snapshot copy's
chunks shipped or filed, under the command line's default fault policy): never between a forward or
backward and the send of its result, and not before taking a message that has already arrived, so
the neighbour waiting for that result does not wait on it (issue 32: on 2 stages the first stage is
the slowest, and each of its waits for a gradient is on the step's critical path)."""
from __future__ import annotations

import numpy as np
import pytest

from ir.plan import Action, ActionKind
from jobs.train.pipeline import AUTO_SNAPSHOTS, FaultPolicy, train_pipeline
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.optim import make_optimizer
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.executor import StageExecutor, sent_on_without_pause, stage_peer
from runtime.pipeline.inprocess import InProcessWorkers
from runtime.pipeline.worker import Worker
from runtime.transport.local import LocalHub, LocalTransport
from support import M, ROWS, S, export_onnx, single_device_training, synthetic_batch


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


def _text(actions) -> list[str]:
    return [str(a) for a in actions]


def test_the_actions_whose_result_is_sent_next():
    zb = make_schedule("zb-h1", 2, 4)
    assert _text(sent_on_without_pause(zb.actions[0])) == [f"s0.F.m{m}" for m in range(4)]
    assert _text(sent_on_without_pause(zb.actions[1])) == [f"s1.{k}.m{m}" for m in range(4) for k in "FB"]
    gpipe = make_schedule("gpipe", 3, 2)
    # the middle stage sends both; the last stage's forwards end in the loss, its backwards are sent
    assert _text(sent_on_without_pause(gpipe.actions[1])) == ["s1.F.m0", "s1.F.m1", "s1.B.m0", "s1.B.m1"]
    assert _text(sent_on_without_pause(gpipe.actions[2])) == ["s2.B.m0", "s2.B.m1"]
    one = make_schedule("1f1b-flush", 1, 2)
    assert sent_on_without_pause(one.actions[0]) == []  # nothing to send: a stage alone


def test_a_message_already_here_is_taken_before_the_stages_own_work(graph):
    """A RECV whose tensor has arrived runs `between` once, after it (before this change: also once
    before taking it)."""
    from runtime.engines.pytorch import TorchStageEngine
    from runtime.engines.stage import stage_spec

    pytest.importorskip("torch")
    hub = LocalHub()
    before = LocalTransport(stage_peer(0), hub)
    calls = []
    spec = stage_spec(graph, 2, len(graph.blocks) - 1)
    executor = StageExecutor(1, 2, TorchStageEngine(spec), LocalTransport(stage_peer(1), hub),
                             make_optimizer("sgd", 0.1), (), timeout=5, between=lambda: calls.append(1))
    before.connect(stage_peer(1), executor.transport.address)
    executor.transport.connect(stage_peer(0), before.address)
    sent = np.arange(6, dtype=np.float32)
    before.send_tensor(stage_peer(1), "act", 0, 0, sent)
    executor.execute(Action(ActionKind.RECV_ACT, 1, 0, peer=0))
    assert calls == [1]
    np.testing.assert_array_equal(executor._acts[0], sent)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b-flush"])
def test_no_work_of_the_stages_own_between_a_result_and_its_send(graph, monkeypatch, schedule):
    """Two stages under the command line's default policy (copies shipped to the neighbour while the
    steps run): `between` runs, but never right after an action whose result is sent next; the
    losses are single-device training's, bit for bit."""
    # per executor: each action as it starts, and each `between` with the action in flight then
    # (None: run after an action, not inside one of its waits)
    log: list[tuple[int, object]] = []
    real_execute, real_between = StageExecutor.execute, Worker._between

    def execute(self, action):
        log.append((id(self), action))
        real_execute(self, action)

    def between(self):
        log.append((id(self.executor), ("between", self.executor.in_flight)))
        return real_between(self)

    monkeypatch.setattr(StageExecutor, "execute", execute)
    monkeypatch.setattr(Worker, "_between", between)
    batches = [synthetic_batch(i) for i in range(3)]
    config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            engine="torch" if schedule == "zb-h1" else "mnn")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, 3, transport=workers.coordinator,
                                faults=FaultPolicy(snapshot_every=AUTO_SNAPSHOTS, state_on="peers"))
    assert workers.codes == [0, 0], workers.errors
    if schedule == "1f1b-flush":  # the same engine alone
        assert result.losses == single_device_training(graph, batches, 3)[0]
    held = {a for stage in make_schedule(schedule, 2, M).actions for a in sent_on_without_pause(stage)}
    per_stage: dict[int, list] = {}
    for who, what in log:
        per_stage.setdefault(who, []).append(what)
    assert len(per_stage) == 2
    for events in per_stage.values():
        after, last = [], None  # the action each `between` outside a wait followed
        for e in events:
            if isinstance(e, tuple) and e[0] == "between":
                if e[1] is None:
                    after.append(last)
            else:
                last = e
        assert after and any(e in held for e in events)
        assert not [a for a in after if a in held], [str(a) for a in after if a in held]


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b-flush"])
def test_a_stages_own_snapshot_copy_is_written_off_its_thread_and_before_its_state_changes(graph, monkeypatch,
                                                                                          schedule):
    """Under the default policy a stage's own snapshot copy (taken when the order arrives, before the
    next step's first forward) is written into its file by another thread while the step's first
    actions run, not by the stage's own (which, on the busiest stage, is the step's critical path);
    the engine steps the state only once it is written (here each copy's first write is made 0.3 s
    slow), so the copy is the state at the boundary: the losses are single-device training's bit for
    bit, and every copy, the stage's own and the one its holder filed, holds the state the stage had
    when the snapshot was ordered, byte for byte."""
    import threading
    import time

    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.pytorch import TorchStageEngine
    from runtime.pipeline.snapshots import SpooledCopy, StateCopies

    events: list[tuple] = []  # (what, thread, id, monotonic time[, end])
    real_take, real_writev, real_complete = StateCopies.take, SpooledCopy._writev, StateCopies._complete
    own_copies: dict[int, StateCopies] = {}  # id(SpooledCopy) -> the StateCopies whose own copy it is
    stage_of: dict[int, tuple[StateCopies, int]] = {}  # a worker's thread -> its copies and stage
    states: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (stage, sid) -> the state at the order
    compared: list[tuple[str, int, int]] = []  # (own or held, stage, sid) of each copy compared
    stepped_unwritten: list[int] = []  # stages whose engine stepped before their copy was written
    slowed: set[int] = set()  # the copies whose first write was made slow
    alive: list[SpooledCopy] = []  # every copy written, kept so that no id above is reused

    def same(copy: SpooledCopy, stage: int, sid: int, what: str) -> None:
        want = states[(stage, sid)]
        got = dict(copy.items())
        assert got.keys() == want.keys()
        for name, arr in got.items():
            np.testing.assert_array_equal(arr, want[name], err_msg=f"{what} copy of stage {stage}, snapshot {sid}")
        compared.append((what, stage, sid))

    def take(self, sid, stage, tensors, *args, **kwargs):
        gathered = list(tensors() if callable(tensors) else tensors)
        states[(stage, sid)] = {name: np.array(arr) for name, arr in gathered}
        events.append(("take", threading.get_ident(), id(self), time.monotonic()))
        stage_of[threading.get_ident()] = (self, stage)
        real_take(self, sid, stage, gathered, *args, **kwargs)
        own_copies[id(self.own[sid])] = self

    def writev(self, views):
        start = time.monotonic()
        if id(self) not in slowed:
            slowed.add(id(self))
            alive.append(self)
            time.sleep(0.3)  # a slow disk: each copy's first write
        real_writev(self, views)
        events.append(("write", threading.get_ident(), id(self), start, time.monotonic()))

    def stepping(real):
        def step(self, *args, **kwargs):
            copies, stage = stage_of.get(threading.get_ident(), (None, None))
            if copies is not None and copies.own:
                sid = max(copies.own)
                if getattr(copies, "_writing", None) is not None or not [
                        e for e in events if e[0] == "write" and e[2] == id(copies.own[sid])]:
                    stepped_unwritten.append(stage)
                elif ("own", stage, sid) not in compared:
                    same(copies.own[sid], stage, sid, "own")
            return real(self, *args, **kwargs)
        return step

    def complete(self, peer, this_stage):
        got = self._incoming[peer]
        real_complete(self, peer, this_stage)
        if (got.stage, got.sid) in self.replicas:
            same(self.replicas[(got.stage, got.sid)], got.stage, got.sid, "held")

    monkeypatch.setattr(StateCopies, "take", take)
    monkeypatch.setattr(StateCopies, "_complete", complete)
    monkeypatch.setattr(SpooledCopy, "_writev", writev)
    for engine in (TorchStageEngine, MnnStageEngine):
        for name in ("step", "backward_and_step"):
            if name in vars(engine):
                monkeypatch.setattr(engine, name, stepping(vars(engine)[name]))
    batches = [synthetic_batch(i) for i in range(4)]
    config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            engine="torch" if schedule == "zb-h1" else "mnn")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, 4, transport=workers.coordinator,
                                faults=FaultPolicy(snapshot_every=1, state_on="peers"))
    assert workers.codes == [0, 0], workers.errors
    if schedule == "1f1b-flush":  # the same engine alone
        assert result.losses == single_device_training(graph, batches, 4)[0]
    assert not stepped_unwritten, f"stages {stepped_unwritten} stepped their state before its copy was written"
    stage_thread = {c: t for what, t, c, *_ in events if what == "take"}  # a worker's thread
    assert len(stage_thread) == 2
    own_writes = [e for e in events if e[0] == "write" and e[2] in own_copies]
    assert own_writes, "no own copy was written"
    on_stage = [e for e in own_writes if e[1] == stage_thread[id(own_copies[e[2]])]]
    assert not on_stage, f"{len(on_stage)} of {len(own_writes)} writes of a stage's own copy on its own thread"
    # copies compared: each stage's own at its next step, and the ones its holder filed
    assert {w for w, _, _ in compared} == {"own", "held"} and len(compared) >= 6, compared
