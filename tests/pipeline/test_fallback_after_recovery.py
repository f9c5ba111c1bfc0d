"""The coordinator's fallback copy of the new stages right after a recovery (issue 32: state kept on
a peer instead of the coordinator; runtime.pipeline.session `_keep_fallback(new_stages=True)`).

That copy guards against a later loss of a stage together with the neighbour holding its copy. It
used to be collected whole off the new stages (weights and AdamW's moments), though the coordinator
had just set them up from the restored state it holds: only the moments a survivor kept on its own
copy (runtime.pipeline.kept_state) are not there. Now the copy is made of the restored state and
those moments, collected off their worker. Counted at the coordinator's transport (`ckpt` tensors
received during `Session.recover`); the copy equals what the workers hold right after the setup,
tensor for tensor, and the run equals single-device training."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jobs.train.pipeline import FaultPolicy, train_pipeline
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from runtime.pipeline.session import Session
from runtime.transport.local import LocalTransport
from support import M, on_during_recovery, single_device_training, synthetic_batch, ts17_graph

STEPS, LOST_AFTER = 5, 3
BATCHES = [synthetic_batch(i) for i in range(STEPS + 1)]


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return ts17_graph(tiny_checkpoint, export_dir)


def _params_of(graph, first: int, last: int) -> set[str]:
    return {x for b in graph.blocks[first:last + 1] for x in b.params}


def _nbytes(graph, params) -> int:
    return sum(int(np.asarray(graph.constants[x]).nbytes) for x in params)


@pytest.mark.parametrize("lost,cuts,ignored", [(0, [(0, 2), (3, 4)], False), (1, None, False), (1, None, True)],
                         ids=["first-renumbered", "middle", "middle-selection-ignored"])
def test_the_fallback_copy_after_a_recovery_collects_only_the_moments_the_survivors_kept(graph, monkeypatch,
                                                                                        lost, cuts, ignored):
    """Full fine-tuning of the tiny BERT on 3 in-process workers, worker `lost` gone after step
    LOST_AFTER of STEPS (a copy every step). The
    fallback copy taken after the switch brings at most the kept parameters' two moments (and a
    table's row ids) over the wire, not the new stages' whole state, and holds exactly what a
    whole collection right after it reads off the workers. `ignored`: the workers send their whole
    state whatever the selection (a worker that does not know it): the copy is the same."""
    if ignored:
        from runtime.pipeline.worker import Worker

        real_checkpoint = Worker.checkpoint
        monkeypatch.setattr(Worker, "checkpoint", lambda self, optimizer=True, window=None, **_: real_checkpoint(
            self, optimizer, window))
    if cuts is not None:  # the planner's own plan shifts every range when stage 0 is lost: nothing kept
        import planner.replan

        monkeypatch.setattr(planner.replan, "replan_without", lambda *args, **kwargs: list(cuts))
    counting, seen = {"on": False}, {"ckpt": 0}
    real_recv = LocalTransport.recv_tensor
    checked = []

    with InProcessWorkers(3, timeout_s=60) as workers:
        def recv_tensor(self, peer, expected, *args, **kwargs):
            got = real_recv(self, peer, expected, *args, **kwargs)
            if counting["on"] and self is workers.coordinator and expected.kind == "ckpt":
                seen["ckpt"] += int(got[1].nbytes)
            return got

        real_keep = Session._keep_fallback

        def keep_fallback(self, step, new_stages=False, **kwargs):
            real_keep(self, step, new_stages, **kwargs)
            if new_stages and counting["on"]:  # right after the switch: what the copy holds against the workers
                counting["on"] = False
                _, ranges, spooled = self.fallback.spooled()
                assert [tuple(r) for r in ranges] == [tuple(r) for r in self.result.ranges]
                whole = self.coordinator.collect_checkpoint()
                assert len(spooled) == len(whole)
                for k, (got, want) in enumerate(zip(spooled, whole)):
                    assert set(got) == set(want), (k, sorted(set(got) ^ set(want)))
                    for name in want:
                        np.testing.assert_array_equal(got[name], want[name], err_msg=f"stage {k} {name}")
                checked.append(step)
                counting["on"] = True

        def on_step(step, *_):
            if step == LOST_AFTER and not killed:
                killed.append(step)
                deadline = time.monotonic() + 50  # every newest copy shipped whole
                while time.monotonic() < deadline and any(w.copies.shipping for w in workers.workers):
                    time.sleep(0.01)
                workers.kill(lost)

        killed = []
        monkeypatch.setattr(LocalTransport, "recv_tensor", recv_tensor)
        monkeypatch.setattr(Session, "_keep_fallback", keep_fallback)
        on_during_recovery(monkeypatch, counting)
        old_addresses = list(workers.addresses)
        config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)
        result = train_pipeline(graph, BATCHES, 9, workers.addresses, config, STEPS, transport=workers.coordinator,
                                on_step=on_step, faults=FaultPolicy(state_on="peers", snapshot_every=1))

    assert [e["event"] for e in result.events] == ["lost", "new_plan", "recovered"], result.events
    assert checked == [result.events[1]["step"]], (checked, result.events[1])  # the restored snapshot's step
    (_, change), = result.replans
    kept = set()
    for k, r in enumerate(change.new_ranges):
        kept |= _params_of(graph, *r) & _params_of(graph, *change.old_ranges[old_addresses.index(result.addresses[k])])
    whole = _nbytes(graph, graph.params)
    assert kept and _nbytes(graph, kept) < whole, (kept, change)
    # two moments per kept parameter (a table's as its rows, with their ids), nothing of the rest
    if ignored:  # the kept worker's whole state came, and only the kept moments were taken of it
        assert seen["ckpt"] > 2 * _nbytes(graph, kept) + 2 ** 16, seen
    else:
        assert 0 < seen["ckpt"] <= 2 * _nbytes(graph, kept) + 2 ** 16, (seen, _nbytes(graph, kept), whole)
    want_losses, want_weights = single_device_training(graph, BATCHES, STEPS)
    assert result.losses == want_losses
    assert set(result.weights) == set(want_weights)
    for name, arr in want_weights.items():
        np.testing.assert_array_equal(result.weights[name], arr, err_msg=name)
