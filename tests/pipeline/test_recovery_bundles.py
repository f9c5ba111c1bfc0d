"""A recovery's new plan on the coordinator (issue 32: SmolLM2 LoRA recovered in 10.5-11.5 s, most of
it re-emitting the bundles): each bundle's bytes are hashed once on the coordinator (the digest
carried with them: the plan's identity, the manifest, the checks before shipping all use it), and
the bundles are put together one stage at a time as they are shipped, never all at once. The
recovery still equals single-device training, and each worker still checks what it loads."""
from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

import runtime.pipeline.bundles as bundles_module
from jobs.train.pipeline import FaultPolicy, train_pipeline
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import M, bundle_weights_alive, on_during_recovery, single_device_training, synthetic_batch, ts17_graph

STEPS, LOST_AFTER = 4, 2


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return ts17_graph(tiny_checkpoint, export_dir)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS + 1)]


class _Hashed:
    """hashlib.sha256 counting the bytes it hashes on the coordinator's thread (the test's own:
    the in-process workers hash what they receive in theirs, and must)."""

    def __init__(self, real, counts: dict):
        self.real, self.counts = real, counts

    def __call__(self, data=b"", **kwargs):
        outer = self

        class Counting:
            def __init__(self):
                self.h = outer.real(**kwargs)
                self.update(data)

            def update(self, chunk):
                if threading.current_thread() is threading.main_thread() and outer.counts["on"]:
                    outer.counts["bytes"] += memoryview(chunk).nbytes
                self.h.update(chunk)

            def hexdigest(self):
                return self.h.hexdigest()

            def digest(self):
                return self.h.digest()

        return Counting()


def test_a_recovery_hashes_each_bundle_once_and_builds_them_one_stage_at_a_time(graph, batches, monkeypatch):
    """Three workers, the last lost after step 2 of 4 (the state on the coordinator): while the
    coordinator recovers, the bytes it hashes are the new plan's bundles' bytes once (before: four
    times, the bundle built, verified, checked before shipping, and the whole model again for the
    plan's identity), and when it ships a stage's bundle no other stage's weights file is held put
    together (before: every stage's, emitted at once). Losses and weights are single-device
    training's."""
    counts = {"on": False, "bytes": 0}
    monkeypatch.setattr(hashlib, "sha256", _Hashed(hashlib.sha256, counts))
    shipped, held_at_send = [], []
    real_send = bundles_module.send_bundle

    def send(transport, peer, files, await_took=None):
        if counts["on"]:
            held_at_send.append(bundle_weights_alive())
            shipped.append(sum(bundles_module.file_size(data) for data in files.values()))
        return real_send(transport, peer, files, await_took)

    monkeypatch.setattr(bundles_module, "send_bundle", send)
    on_during_recovery(monkeypatch, counts)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)
    with InProcessWorkers(3, timeout_s=60) as workers:
        def on_step(step, *_):
            if step == LOST_AFTER:
                workers.kill(2)

        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, transport=workers.coordinator,
                                on_step=on_step, faults=FaultPolicy(snapshot_every=1))
    assert [e["event"] for e in result.events] == ["lost", "new_plan", "recovered"], result.events
    assert len(shipped) == 2  # the survivors' two new stages
    weights_bytes = sum(int(np.asarray(v).nbytes) for v in graph.constants.values())
    assert sum(shipped) >= weights_bytes  # what was shipped: the whole model's bundles
    # once: every byte shipped hashed once (the manifest's digests and the signature's few bytes aside)
    assert sum(shipped) <= counts["bytes"] <= 1.1 * sum(shipped), (counts["bytes"], sum(shipped))
    assert held_at_send == [0, 0]  # each stage's weights file put together as it is sent, not before
    want_losses, want_weights = single_device_training(graph, batches, STEPS)
    assert result.losses == want_losses
    assert set(result.weights) == set(want_weights)
    for k in want_weights:
        np.testing.assert_array_equal(result.weights[k], want_weights[k], err_msg=k)
