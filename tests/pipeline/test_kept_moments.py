"""A recovery leaves the unmoved blocks' optimizer state on the survivors (issue 32: state kept on a
peer instead of the coordinator; runtime.pipeline.kept_state): a survivor's setup reads the moments
of the parameters its new stage shares with its old one from its own copy of the restored snapshot,
checked against the SHA-256 its copy's holder (or, that holder lost, the survivor itself) gave the
coordinator, and only the moved blocks' moments travel through the coordinator. Counted at the
coordinator's transport during `Session.recover`; the runs still equal single-device training (a
1f1b-stash run: the same run switched at its recovery); a kept copy changed on disk is refused."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from ir.bundle import WEIGHTS
from jobs.train.pipeline import FaultPolicy, train_pipeline
from runtime.pipeline.bundles import REST
from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed
from runtime.pipeline.inprocess import InProcessWorkers
from runtime.pipeline.kept_state import (load_moments, moment_param, moments_digest, select_entries,
                                         survivors_moments)
from runtime.pipeline.snapshots import SpooledCopy
from runtime.transport.local import LocalTransport
from support import M, on_during_recovery, sigkill_on_step, single_device_training, synthetic_batch, ts17_graph

STEPS, LOST_AFTER = 5, 3


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return ts17_graph(tiny_checkpoint, export_dir)


@pytest.fixture(scope="module")
def batches():
    """The steps' batches (and one more), one list every test of the module reads."""
    return [synthetic_batch(i) for i in range(STEPS + 1)]


def _config(schedule: str) -> PipelineConfig:
    return PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _count_moments(monkeypatch, coordinator, transport_class=LocalTransport) -> dict:
    """Bytes of optimizer moments (`opt/<kind>/<param>` entries, not the scalars) the coordinator's
    transport (`coordinator`; None: every `transport_class`, the coordinator's being the only one
    in this process) receives from snapshot copies (`held`) and sends to setups (`optstate`) while
    `Session.recover` runs."""
    counting, seen = {"on": False}, {"fetched": 0, "sent": 0, "weights": 0}
    real_send, real_recv = transport_class.send_tensor, transport_class.recv_tensor

    def send_tensor(self, peer, kind, stage, microbatch, arr, *, name="", **kwargs):
        if counting["on"] and coordinator in (None, self) and kind == "optstate" and "/" in name:
            seen["sent"] += int(np.asarray(arr).nbytes)
        if counting["on"] and coordinator in (None, self) and kind == "bundle_chunk" and name in (WEIGHTS, REST):  # its chunks, not its size
            seen["weights"] += int(np.asarray(arr).nbytes)  # a bundle's weights file, or the part of it sent
        return real_send(self, peer, kind, stage, microbatch, arr, name=name, **kwargs)

    def recv_tensor(self, peer, expected, *args, **kwargs):
        got = real_recv(self, peer, expected, *args, **kwargs)
        if counting["on"] and coordinator in (None, self) and expected.kind == "held" and moment_param(expected.name):
            seen["fetched"] += int(got[1].nbytes)
        return got

    monkeypatch.setattr(transport_class, "send_tensor", send_tensor)
    monkeypatch.setattr(transport_class, "recv_tensor", recv_tensor)
    on_during_recovery(monkeypatch, counting)
    return seen


def _params_of(graph, first: int, last: int) -> set[str]:
    return {x for b in graph.blocks[first:last + 1] for x in b.params}


def _wait_for_copies(workers) -> None:
    """Every worker's newest copy shipped whole (the loss then restores from the newest snapshot)."""
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline and any(w.copies.shipping for w in workers.workers):
        time.sleep(0.01)


def _faults(schedule: str) -> FaultPolicy:
    # 1f1b-stash drains every 2 steps (else the run is one segment and a loss restores step 0,
    # before AdamW has any moments); under flush a copy every step, so the restored snapshot is the
    # kill's step's whatever K the machine's load would choose
    if schedule == "1f1b-stash":
        return FaultPolicy(state_on="peers", checkpoint_every=2)
    return FaultPolicy(state_on="peers", snapshot_every=1)


def _run(graph, batches, schedule: str, lost: int, monkeypatch, on_kill=None, n: int = 3):
    with InProcessWorkers(n, timeout_s=60) as workers:
        def on_step(step, *_):
            if step == LOST_AFTER and not killed:
                killed.append(step)
                _wait_for_copies(workers)
                if on_kill is not None:
                    on_kill(workers)
                workers.kill(lost)

        killed = []
        seen = _count_moments(monkeypatch, workers.coordinator)
        result = train_pipeline(graph, batches, 9, workers.addresses, _config(schedule), STEPS,
                                transport=workers.coordinator, on_step=on_step, faults=_faults(schedule))
    return result, seen, list(workers.addresses)


def _moved_bytes(graph, result, old_addresses) -> int:
    """Bytes of the parameters whose worker the recovery changed."""
    (_, change), = result.replans
    moved = set()
    for k, r in enumerate(change.new_ranges):
        moved |= _params_of(graph, *r) - _params_of(graph, *change.old_ranges[old_addresses.index(result.addresses[k])])
    return sum(int(np.asarray(graph.constants[x]).nbytes) for x in moved)


@pytest.mark.parametrize("schedule,lost,cuts", [("1f1b-flush", 2, None), ("1f1b-flush", 0, [(0, 2), (3, 4)]),
                                               ("1f1b-stash", 1, None)],
                         ids=["flush-last", "flush-first-renumbered", "stash-middle"])
def test_only_the_moved_blocks_moments_go_through_the_coordinator(graph, batches, monkeypatch, tmp_path,
                                                                  schedule, lost, cuts):
    """Full fine-tuning of the tiny BERT (blocks: embeddings, 2 layers, head, loss) on `n`
    in-process workers, worker `lost` gone after step LOST_AFTER of STEPS (flush-last: the lost
    stage ran only the loss, so no moments move at all; flush-first-renumbered: both survivors
    change stage number, so each gives up its name and its copies were filed under the old one,
    and the first keeps layer.1 (the survivor plan given as `cuts`: the planner's own shifts every
    range, and keeps nothing, when the first stage is lost); stash-middle: both survivors' holder
    was the lost worker, so each vouches for its own copy). The coordinator fetches and sends exactly the
    moments of the parameters that changed worker (AdamW's two per parameter), not the whole
    state's, and the run equals the reference bit for bit."""
    if cuts is not None:
        import planner.replan

        monkeypatch.setattr(planner.replan, "replan_without", lambda *args, **kwargs: list(cuts))
    result, seen, old_addresses = _run(graph, batches, schedule, lost, monkeypatch)
    kinds = [e["event"] for e in result.events]
    assert kinds == ["lost", "new_plan", "recovered"], kinds
    (_, change), = result.replans
    new_addresses = result.addresses
    assert set(new_addresses) == set(old_addresses) - {old_addresses[lost]}
    old_params = [_params_of(graph, *r) for r in change.old_ranges]
    moved = set()
    for k, r in enumerate(change.new_ranges):
        s = old_addresses.index(new_addresses[k])
        moved |= _params_of(graph, *r) - old_params[s]
    moved_bytes = sum(int(np.asarray(graph.constants[x]).nbytes) for x in moved)
    whole = sum(int(np.asarray(graph.constants[x]).nbytes) for x in graph.params)
    kept = [sorted(_params_of(graph, *r) & old_params[old_addresses.index(new_addresses[k])])
            for k, r in enumerate(change.new_ranges)]
    assert moved_bytes < whole and (cuts is None or kept[0]), (moved_bytes, whole, kept, change.new_ranges)
    # the weights files sent: the moved parameters, what the survivors hold of the rest (their own
    # copies' trainable weights, h37's kept frozen ones) left out; headers and untrained constants
    # of moved blocks within 64 KiB
    assert moved_bytes <= seen["weights"] <= moved_bytes + 2 ** 16, (seen, moved_bytes)
    # two moments per moved parameter (dense at the setup; a table's as its rows when fetched)
    assert seen["sent"] == 2 * moved_bytes, (seen, moved_bytes, whole, result.events, old_addresses)
    assert seen["fetched"] <= 2 * moved_bytes + 2 ** 16, (seen, moved_bytes)  # + a table's row ids
    assert (seen["fetched"] > 0) == (moved_bytes > 0), (seen, moved_bytes)
    new_plan = result.events[1]
    assert new_plan["state_fetched_bytes"] < moved_bytes * 2 + whole + 2 ** 16, new_plan
    if schedule == "1f1b-flush":
        want_losses, want_weights = single_device_training(graph, batches, STEPS)
        assert result.losses == want_losses
        _same(result.weights, want_weights)
    else:
        assert result.events[1]["step"] == 2, result.events  # from the drain: moments there
        _equals_a_stash_run_switched_at_its_recovery(graph, batches, result, tmp_path)


@pytest.mark.slow  # worker processes over CURVE; twin on threads: test_only_the_moved_blocks_moments_go_...
def test_sigkill_a_worker_process_and_only_the_moved_moments_pass_the_coordinator(graph, batches, monkeypatch):
    """The same over worker processes and CURVE (the default policy: copies on the peers): the
    middle one of three SIGKILLed after step LOST_AFTER (both survivors' holder: each vouches for
    its own copy); counted at the coordinator's ZeroMQ transport, and the run equals single-device
    training's."""
    import signal

    from jobs.common.workers import LocalWorkers
    from runtime.transport.zeromq import ZmqTransport

    seen = _count_moments(monkeypatch, None, ZmqTransport)
    workers = LocalWorkers.start(3, threads=1)

    on_step = sigkill_on_step(workers, 1, LOST_AFTER)

    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, _config("1f1b-flush"), STEPS, keys=workers.keys,
                                on_step=on_step, faults=FaultPolicy(state_on="peers"))
    finally:
        codes = workers.wait(30.0)
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 0, codes
    assert [e["event"] for e in result.events] == ["lost", "new_plan", "recovered"], result.events
    moved = _moved_bytes(graph, result, list(workers.addresses))
    assert 0 < moved and seen["sent"] == 2 * moved and 0 < seen["fetched"] <= 2 * moved + 2 ** 16, (seen, moved)
    want_losses, want_weights = single_device_training(graph, batches, STEPS)
    np.testing.assert_allclose(result.losses, want_losses, rtol=1e-5)
    _same(result.weights, want_weights)


def _equals_a_stash_run_switched_at_its_recovery(graph, batches, result, tmp_path: Path) -> None:
    """A recovered 1f1b-stash run's losses and weights equal (as tests/pipeline/test_faults.py
    checks them) 3 threads' run up to the step its new plan started from, checkpointed, then the
    survivors' 2 from that checkpoint."""
    from runtime.pipeline.checkpoints import load_checkpoint

    switch = next(e for e in result.events if e["event"] == "new_plan")["step"]
    faults = _faults("1f1b-stash")
    with InProcessWorkers(3, timeout_s=60) as threads:
        train_pipeline(graph, batches, 9, threads.addresses, _config("1f1b-stash"), switch,
                       transport=threads.coordinator, faults=faults, checkpoint_dir=tmp_path / "ref")
    _, weights, by_stage = load_checkpoint(tmp_path / "ref")
    union = {k: v for state in by_stage.values() for k, v in state.items()}  # each stage takes its own
    with InProcessWorkers(2, timeout_s=60) as threads:
        rest = train_pipeline(graph, batches, 9, threads.addresses, _config("1f1b-stash"), STEPS - switch,
                              start_step=switch, weights=weights, optimizer_state={0: union, 1: union},
                              cuts=[result.ranges[1][0]], transport=threads.coordinator, faults=faults)
    assert result.losses[switch:] == rest.losses
    _same(result.weights, rest.weights)


def _flip_moments(copy: SpooledCopy) -> None:
    """Flip the first byte of every optimizer moment's values in `copy`'s file (not a table's row
    ids: changed values are what a worker would train on unnoticed)."""
    for e in select_entries(copy.tensors, weights=False):
        if e.nbytes and not e.name.endswith("#ids"):
            fd = copy.file.fileno()
            os.pwrite(fd, bytes([os.pread(fd, 1, e.offset)[0] ^ 0xFF]), e.offset)


def test_a_survivor_whose_own_copy_changed_on_disk_refuses_to_train_on_it(graph, batches, monkeypatch):
    """What a survivor takes from its own copy is checked against the digest its holder gave: the
    copies of worker 0 changed on disk before the loss of worker 2 (its holder, worker 1,
    survives), its setup refuses them and the run stops (before this change the coordinator
    fetched those moments from the changed copy and trained on them)."""
    from runtime.pipeline.worker import Worker

    # changed where the setup will read them: the own copies worker 0's reset keeps (changing its
    # copies at the kill raced the next step's copy, which the recovery then restored from)
    survivor, reset = [], Worker.reset

    def reset_then_change(self):
        reset(self)
        if survivor and self is survivor[0]:
            for copy in list(self.kept_own.values()):
                _flip_moments(copy)

    monkeypatch.setattr(Worker, "reset", reset_then_change)
    with pytest.raises(WorkerFailed, match="optimizer state this worker kept"):
        _run(graph, batches, "1f1b-flush", 2, monkeypatch, on_kill=lambda workers: survivor.append(workers.workers[0]))


def test_a_holder_without_the_replica_leaves_the_survivor_to_vouch_for_its_copy(graph, batches, monkeypatch):
    """Only the lost stages' replicas are sure to be whole at the restored snapshot: worker 1 has
    let its replica of stage 0 go before worker 2 is lost, so the coordinator asks worker 0 itself
    for its copy's digest, and the recovery goes on, equal to single-device training (before, the
    holder's "missing" ended the run)."""
    def drop_replica(workers):
        replicas = workers.workers[1].copies.replicas
        for key in [k for k in list(replicas) if k[0] == 0]:
            replicas.pop(key).close()

    result, seen, _ = _run(graph, batches, "1f1b-flush", 2, monkeypatch, on_kill=drop_replica)
    assert [e["event"] for e in result.events] == ["lost", "new_plan", "recovered"], result.events
    want_losses, want_weights = single_device_training(graph, batches, STEPS)
    assert result.losses == want_losses
    _same(result.weights, want_weights)


def test_the_kept_moments_are_chosen_by_parameter_and_hashed_whole(tmp_path):
    """`survivors_moments` keeps on each survivor what its new stage shares with its old one and
    fetches each other needed parameter once (a lost stage's come whole); `load_moments` reads a
    table's rows dense and refuses a copy whose bytes are not those hashed."""
    kept, fetch = survivors_moments([{"a", "b"}, {"c", "d"}, {"e"}], ["w0", "w1", "w2"],
                                    [{"a", "b", "c"}, {"d", "e"}], ["w0", "w1"], [2])
    assert kept == {0: (0, ["a", "b"]), 1: (1, ["d"])} and fetch == {1: ["c"]}
    kept, fetch = survivors_moments([{"a", "b"}, {"c", "d"}, {"e"}], ["w0", "w1", "w2"],
                                    [{"a", "b", "c"}, {"d", "e"}], ["w1", "w2"], [0])
    assert kept == {0: (1, ["c"]), 1: (2, ["e"])} and fetch == {1: ["d"]}
    with open(tmp_path / "copy", "w+b") as f:
        copy = SpooledCopy(f)
        table = np.arange(12, dtype=np.float32).reshape(4, 3)
        copy.extend([("param/t", table), ("param/w", np.ones(2, np.float32)), ("opt/steps", np.array(3.0)),
                     ("opt/m/w", np.full(2, 0.5, np.float32)), ("opt/m/t#ids", np.array([2], np.int64)),
                     ("opt/m/t#rows", np.full((1, 3), 7, np.float32)), ("opt/v/w", np.full(2, 0.25, np.float32))])
        copy.finish()
        digest = moments_digest(copy, ["t", "w"])
        got = load_moments(copy, ["t", "w"], digest, "a test copy")
        assert set(got) == {"m/w", "v/w", "m/t"}
        np.testing.assert_array_equal(got["m/t"], [[0, 0, 0], [0, 0, 0], [7, 7, 7], [0, 0, 0]])
        assert set(load_moments(copy, ["w"], moments_digest(copy, ["w"]), "a test copy")) == {"m/w", "v/w"}
        with pytest.raises(ValueError, match="hashes to"):
            load_moments(copy, ["w"], digest, "a test copy")  # the digest of another selection
        _flip_moments(copy)
        with pytest.raises(ValueError, match="refused"):
            load_moments(copy, ["t", "w"], digest, "a test copy")
