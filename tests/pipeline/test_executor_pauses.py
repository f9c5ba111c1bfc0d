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
