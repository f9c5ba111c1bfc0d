"""A recovery does not re-send what the survivors already hold (issue 32): a survivor keeps its last
setup's weights file, the coordinator offers back the untrained tensors of its new bundle, and ships
only the rest (runtime.pipeline.held_weights). Counted at the coordinator's transport: the weights
bytes shipped to each survivor at the recovery are the moved blocks' share (its new stage's
tensors less the frozen ones it held), and the run still equals single-device training; a kept
file changed on disk is refused by the signed manifest's hash."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from ir.bundle import WEIGHTS
from jobs.common.workers import LocalWorkers
from jobs.train.pipeline import FaultPolicy, train_pipeline
from runtime.engines.stage import stage_spec
from runtime.pipeline.bundles import REST
from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed
from runtime.pipeline.held_weights import HeldWeights
from runtime.pipeline.inprocess import InProcessWorkers
from runtime.transport.local import LocalTransport
from ir.safetensors import encode_safetensors
from support import on_during_recovery, sigkill_on_step, single_device_training, synthetic_batch, tiny_lora_graph

STEPS, LOST_AFTER = 4, 2


@pytest.fixture(scope="module")
def lora_graph(tiny_onnx):
    return tiny_lora_graph(tiny_onnx["torchscript-17"])


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS + 1)]


def _constants_of(graph, first: int, last: int) -> set[str]:
    spec = stage_spec(graph, first, last)
    return {i for node in spec.compute_nodes + spec.host_nodes for i in node.inputs if i in graph.constants}


def _nbytes(graph, names) -> int:
    return sum(int(np.asarray(graph.constants[n]).nbytes) for n in names)


def _count_weights_sent(monkeypatch, transport_class) -> dict:
    """Weights-file bytes the coordinator's `transport_class` sends each stage peer while
    `Session.recover` runs (a bundle's weights.safetensors, or the part of it sent, `REST`)."""
    counting, sent = {"on": False}, {}
    real_send = transport_class.send_tensor

    def send_tensor(self, peer, kind, stage, microbatch, arr, *, name="", **kwargs):
        if counting["on"] and kind == "bundle_chunk" and name in (WEIGHTS, REST):  # its chunks, not its size
            sent[peer] = sent.get(peer, 0) + int(np.asarray(arr).nbytes)
        return real_send(self, peer, kind, stage, microbatch, arr, name=name, **kwargs)

    monkeypatch.setattr(transport_class, "send_tensor", send_tensor)
    on_during_recovery(monkeypatch, counting)
    return sent


def _config() -> PipelineConfig:
    return PipelineConfig(schedule="1f1b-flush", microbatches=2, optimizer="adamw", lr=1e-3, timeout_s=60)


def _params_of(graph, first: int, last: int) -> set[str]:
    return {x for b in graph.blocks[first:last + 1] for x in b.params}


def _check_shipped_only_what_was_lacking(graph, batches, result, sent, peers: bool) -> None:
    """Each survivor was sent its new stage's trainable tensors and the frozen ones of blocks it
    did not hold, and nothing of the frozen ones it held (before this change: its whole new
    bundle again); with the state on the peers, nothing of the trainable ones its own copy of the
    restored snapshot holds either (runtime.pipeline.kept_state); the new_plan event says what was
    kept; losses and weights equal single-device training's."""
    assert [e["event"] for e in result.events] == ["lost", "new_plan", "recovered"], result.events
    (_, change), = result.replans
    old, new = change.old_ranges, change.new_ranges
    assert len(new) == 2 and set(sent) == {"stage0", "stage1"}, (new, sent)
    trainable = set(graph.params)
    header = headers = 0
    own = [_params_of(graph, *old[k]) & _params_of(graph, *new[k]) if peers else set() for k in range(2)]
    for k, (first, last) in enumerate(new):
        held = {n for n in _constants_of(graph, *old[k]) if n not in trainable} | own[k]
        wanted = _constants_of(graph, first, last)
        lacking = _nbytes(graph, wanted - held)
        whole = _nbytes(graph, wanted)
        # the moved blocks' share, and a safetensors header (names, dtypes, offsets) at most
        header = len(encode_safetensors({n: np.zeros(1, np.float32) for n in wanted}))
        headers += header
        assert lacking <= sent[f"stage{k}"] <= lacking + header, (k, sent, lacking, whole)
    kept = sum(_nbytes(graph, (_constants_of(graph, *old[k]) & _constants_of(graph, *new[k]) - trainable) | own[k])
               for k in range(2))
    assert kept > 0  # the plan kept some frozen weights where they were
    new_plan = next(e for e in result.events if e["event"] == "new_plan")
    assert kept <= new_plan["kept_bytes"] == change.kept_bytes <= kept + 2 * headers, (new_plan, kept)
    want_losses, want_weights = single_device_training(graph, batches, STEPS)
    assert result.losses == want_losses
    assert set(result.weights) == set(want_weights)
    for name in want_weights:
        np.testing.assert_array_equal(result.weights[name], want_weights[name], err_msg=name)


@pytest.mark.parametrize("state_on", ["coordinator", "peers"])
def test_a_recovery_ships_a_survivor_only_the_weights_it_lacks(lora_graph, batches, monkeypatch, state_on):
    """LoRA (the frozen base most of the bytes), three in-process workers, the last lost after step
    LOST_AFTER: the survivors are sent only what they lack."""
    sent = _count_weights_sent(monkeypatch, LocalTransport)
    with InProcessWorkers(3, timeout_s=60) as workers:
        def on_step(step, *_):
            if step == LOST_AFTER:
                workers.kill(2)

        result = train_pipeline(lora_graph, batches, 9, workers.addresses, _config(), STEPS,
                                transport=workers.coordinator, on_step=on_step,
                                faults=FaultPolicy(snapshot_every=1, state_on=state_on))
    _check_shipped_only_what_was_lacking(lora_graph, batches, result, sent, state_on == "peers")


@pytest.mark.slow  # twin on threads: test_a_recovery_ships_a_survivor_only_the_weights_it_lacks
def test_sigkill_a_worker_process_and_the_survivors_are_sent_only_what_they_lack(lora_graph, batches, monkeypatch):
    """The same over worker processes and CURVE (the default policy: copies on the peers), the
    last of three killed with SIGKILL after step LOST_AFTER."""
    from runtime.transport.zeromq import ZmqTransport

    sent = _count_weights_sent(monkeypatch, ZmqTransport)
    workers = LocalWorkers.start(3, threads=1)

    on_step = sigkill_on_step(workers, 2, LOST_AFTER)

    try:
        result = train_pipeline(lora_graph, batches, 9, workers.addresses, _config(), STEPS, keys=workers.keys,
                                on_step=on_step, faults=FaultPolicy(snapshot_every=1, state_on="peers"))
    finally:
        codes = workers.wait(30.0)
    assert codes[2] == -signal.SIGKILL and codes[:2] == [0, 0], codes
    _check_shipped_only_what_was_lacking(lora_graph, batches, result, sent, True)


def _flip_first_bytes(file, names) -> None:
    """Flip the first byte of each of the tensors `names` in the open safetensors file `file`."""
    fd = file.fileno()
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, n, 8))
    for name in names:
        if name in header:
            at = 8 + n + header[name]["data_offsets"][0]
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)


def test_a_survivor_whose_kept_weights_changed_on_disk_refuses_its_new_bundle(lora_graph, batches):
    """What a survivor reuses is checked against the signed manifest, not trusted: its kept file
    changed on disk before the recovery (every frozen tensor's first byte flipped), the worker
    refuses the new bundle (its weights' SHA-256 is not the manifest's), saying its own weights
    were reused, and the run fails rather than training on them."""
    with InProcessWorkers(3, timeout_s=60) as workers:
        def on_step(step, *_):
            if step == LOST_AFTER:
                held = workers.workers[0].held
                for file in {id(t.file): t.file for t in held._held.values()}.values():
                    _flip_first_bytes(file, [n for n, t in held._held.items()
                                             if n not in lora_graph.params and t.dtype.startswith("float")])
                workers.kill(2)

        with pytest.raises(WorkerFailed, match="kept from its last setup"):
            train_pipeline(lora_graph, batches, 9, workers.addresses, _config(), STEPS,
                           transport=workers.coordinator, on_step=on_step, faults=FaultPolicy(snapshot_every=1))


def _written(held: HeldWeights, tensors):
    file = held.new_file()
    held.write(file, encode_safetensors(tensors))
    return file


def test_a_kept_file_changed_on_disk_fails_the_manifests_hash(tmp_path):
    """What a worker reuses is checked, never trusted: tensors read back from a kept file that was
    changed make weights whose SHA-256 differs from the untouched ones' (what the signed manifest
    names), and a kept file that cannot be read is an error. The kept files are unlinked (nothing
    left by name on the disk, so a killed worker leaves nothing behind)."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones(5, np.float32)
    held = HeldWeights(tmp_path)
    first = held.take(_written(held, {"a": a, "b": b}))
    held.commit()
    assert not list(tmp_path.iterdir())
    assert held.matching({"a": ("float32", (3, 4)), "b": ("float32", (4,))}) == ["a"]  # form checked too
    good = held.take(_written(held, {"b": b}), ["a"])
    assert good.sha256 == first.sha256  # the same file's hash, made from a kept part and a received one
    held.discard()
    (kept,) = {id(t.file): t.file for t in held._held.values()}.values()
    _flip_first_bytes(kept, ["a"])
    changed = held.take(_written(held, {"b": b}), ["a"])
    assert changed.sha256 != first.sha256
    held.discard()
    kept.close()
    with pytest.raises((OSError, ValueError)):
        held.take(_written(held, {"b": b}), ["a"])
    held.close()
    assert not list(tmp_path.iterdir())
