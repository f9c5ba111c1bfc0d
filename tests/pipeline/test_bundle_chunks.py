"""A bundle file crosses the wire as its size and its chunks (runtime.pipeline.bundles, protocol 4), so that a worker
writes a weights file to its spool file as it arrives and never holds it whole: h168's one-stage SmolLM2 worker
without the plan's base file peaked at 692 MiB setting up (its plan 423), 515 of them the weights file received as
one message. A peer that sends chunks out of order, of another size, or more or fewer than the size it announced is
refused with one line naming what was expected and what came; a file whose bytes are not the signed manifest's is
refused by the bundle's verification, as before.

The fast tests here run on the in-process transport (the sender in a thread: it waits for the receiver's answers
every few chunks); the slow one sets up a real worker process and reads its peak (VmHWM) at ready."""
from __future__ import annotations

import os
import tempfile
import threading

import numpy as np
import pytest

from ir.bundle import WEIGHTS, BundleError
from runtime.pipeline.bundles import (BUNDLE_CHUNK_BYTES, BUNDLE_CHUNK_KIND, BUNDLE_KIND, BUNDLE_WINDOW_CHUNKS,
                                      SpooledFile, recv_bundle_files, send_bundle_file)
from runtime.keys import COORDINATOR_KEY, KeyPair
from runtime.transport.local import LocalHub, LocalTransport
from runtime.transport.wire import MessageError

MIB = 2 ** 20
BOSS = KeyPair.generate(COORDINATOR_KEY)


def _pair():
    hub = LocalHub()
    return LocalTransport("coordinator", hub), LocalTransport("stage0", hub)


def _in_thread(target):
    """Run the sender beside the receiver; its exception, if any, kept for the test."""
    failed = []

    def run():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failed


def test_a_weights_file_of_many_windows_is_written_to_its_spool_file_as_its_chunks_arrive(tmp_path):
    sender, receiver = _pair()
    data = np.random.default_rng(0).integers(0, 256, 11 * BUNDLE_WINDOW_CHUNKS * BUNDLE_CHUNK_BYTES // 4 + 123,
                                             dtype=np.uint8).tobytes()
    thread, failed = _in_thread(lambda: (send_bundle_file(sender, "stage0", 0, WEIGHTS, data),
                                         send_bundle_file(sender, "stage0", 1, "stage.json", b"{}")))
    sizes = []
    receive = receiver.recv_tensor

    def watched(expected):  # every chunk the receiver takes is at most one chunk
        arr = receive("coordinator", expected, timeout=10)[1]
        sizes.append(arr.nbytes)
        return arr

    spool = tmp_path / "spool"
    files = recv_bundle_files(receiver, "coordinator", [WEIGHTS, "stage.json"], receive=watched,
                              spool=lambda name: open(spool, "wb", buffering=0) if name == WEIGHTS else None)
    thread.join(10)
    assert not failed, failed
    assert isinstance(files[WEIGHTS], SpooledFile) and files[WEIGHTS].nbytes == len(data)
    files[WEIGHTS].file.close()
    assert spool.read_bytes() == data
    assert bytes(files["stage.json"]) == b"{}"
    assert max(sizes) == BUNDLE_CHUNK_BYTES and len(sizes) == 2 + 1 + -(-len(data) // BUNDLE_CHUNK_BYTES)


def _hostile(sender, messages):
    """Send `messages` ((kind, microbatch, array, name), ...) as a peer that keeps no protocol would."""
    for kind, mb, arr, name in messages:
        sender.send_tensor("stage0", kind, -1, mb, arr, name=name)


CHUNK = np.zeros(BUNDLE_CHUNK_BYTES, np.uint8)
SIZE = np.array([BUNDLE_CHUNK_BYTES + 10], np.int64)  # two chunks: one whole, one of 10 bytes


@pytest.mark.parametrize("messages, problem", [
    ([(BUNDLE_KIND, 0, SIZE, WEIGHTS), (BUNDLE_CHUNK_KIND, 1, CHUNK, WEIGHTS)],
     "expected bundle_chunk stage=-1 mb=0 dtype=uint8 shape=(4194304,) name='weights.safetensors', received "
     "bundle_chunk stage=-1 mb=1 dtype=uint8 shape=(4194304,) name='weights.safetensors' (out of order)"),
    ([(BUNDLE_KIND, 0, SIZE, WEIGHTS), (BUNDLE_CHUNK_KIND, 0, np.zeros(BUNDLE_CHUNK_BYTES + 1, np.uint8), WEIGHTS)],
     "received bundle_chunk stage=-1 mb=0 dtype=uint8 shape=(4194305,) name='weights.safetensors' (shape differs)"),
    ([(BUNDLE_KIND, 0, SIZE, WEIGHTS), (BUNDLE_CHUNK_KIND, 0, CHUNK, WEIGHTS),
      (BUNDLE_CHUNK_KIND, 1, np.zeros(11, np.uint8), WEIGHTS)],
     "expected bundle_chunk stage=-1 mb=1 dtype=uint8 shape=(10,) name='weights.safetensors', received bundle_chunk "
     "stage=-1 mb=1 dtype=uint8 shape=(11,) name='weights.safetensors' (shape differs)"),
    ([(BUNDLE_KIND, 0, SIZE, WEIGHTS), (BUNDLE_CHUNK_KIND, 0, CHUNK, WEIGHTS),
      (BUNDLE_CHUNK_KIND, 1, np.zeros(10, np.uint8), WEIGHTS), (BUNDLE_CHUNK_KIND, 2, np.zeros(10, np.uint8), WEIGHTS)],
     "expected bundle stage=-1 mb=1 dtype=int64 shape=(1,) name='stage.json', received bundle_chunk stage=-1 mb=2 "
     "dtype=uint8 shape=(10,) name='weights.safetensors' (out of order; dtype, shape, name differ)"),
    ([(BUNDLE_KIND, 0, SIZE, WEIGHTS), (BUNDLE_CHUNK_KIND, 0, CHUNK, "stage.json")],
     "received bundle_chunk stage=-1 mb=0 dtype=uint8 shape=(4194304,) name='stage.json' (name differs)"),
    ([(BUNDLE_KIND, 0, np.zeros(BUNDLE_CHUNK_BYTES + 10, np.uint8), WEIGHTS)],
     "expected bundle stage=-1 mb=0 dtype=int64 shape=(1,) name='weights.safetensors', received bundle stage=-1 mb=0 "
     "dtype=uint8 shape=(4194314,) name='weights.safetensors' (dtype, shape differ)"),
], ids=["out-of-order", "oversized", "longer-than-announced", "more-than-announced", "another-file", "old-protocol"])
def test_a_peer_sending_a_bad_chunk_sequence_gets_one_line_naming_what_was_expected(messages, problem, tmp_path):
    sender, receiver = _pair()
    _hostile(sender, messages)
    written = []

    def spool(name):
        f = tempfile.TemporaryFile(dir=tmp_path, buffering=0)
        written.append(f)
        return f

    with pytest.raises(MessageError) as caught:
        recv_bundle_files(receiver, "coordinator", [WEIGHTS, "stage.json"], timeout=5, spool=spool)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("message from peer 'coordinator' (local://coordinator): ")
    assert problem in line, line
    assert all(f.closed for f in written)  # the spool file is let go with the refused setup


def test_a_size_beyond_the_wire_limit_is_refused_before_anything_is_reserved():
    sender, receiver = _pair()
    _hostile(sender, [(BUNDLE_KIND, 0, np.array([1 << 40], np.int64), WEIGHTS)])
    with pytest.raises(BundleError, match=r"^bundle from coordinator: weights.safetensors announced as 1099511627776 "
                                          r"bytes, not 0 to 17179869184$"):
        recv_bundle_files(receiver, "coordinator", [WEIGHTS], timeout=5)


def test_a_receiver_that_answers_for_other_bytes_stops_the_sender_with_one_line():
    sender, receiver = _pair()
    data = bytes(3 * BUNDLE_WINDOW_CHUNKS * BUNDLE_CHUNK_BYTES)
    thread, failed = _in_thread(lambda: send_bundle_file(sender, "stage0", 0, WEIGHTS, data))
    with pytest.raises(Exception):
        recv_bundle_files(receiver, "coordinator", [WEIGHTS], timeout=0.5,
                          took=lambda answer: receiver.send_control("coordinator", {**answer, "bytes": 1}))
    thread.join(10)
    assert len(failed) == 1 and isinstance(failed[0], BundleError), failed
    assert str(failed[0]) == ("stage0 answered weights.safetensors's chunks with {'type': 'bundle_took', 'file': "
                              "'weights.safetensors', 'bytes': 1}, not {'type': 'bundle_took', 'file': "
                              "'weights.safetensors', 'bytes': 16777216}")


# a 128 MiB float32 table, frozen under LoRA (the weights file is mostly it): well above torch's import transient
# (~48 MiB above where it settles, tests/jobs/test_torch_worker_setup_peak.py), which a 64 MiB one received whole
# stood only 9 MiB above (main: 235.8 against 226.8 MiB)
VOCAB, HIDDEN = 262144, 128


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
                if k in ("VmRSS", "VmHWM")}


def _set_up_peak(plan_dir, graph, base, base_files) -> dict[str, int]:
    """A fresh worker process (`confidant worker`, with `--base` for each of `base_files`) set up by a real
    coordinator that offers the plan's base: its VmHWM and VmRSS at ready."""
    from jobs.common.workers import LocalWorkers
    from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement
    from runtime.pipeline.executor import COORDINATOR
    from runtime.transport.zeromq import ZmqTransport

    boss = BOSS  # the key the plan was signed with
    workers = LocalWorkers.start(1, threads=1, coordinator=boss, base_files=base_files)
    transport = ZmqTransport(COORDINATOR, "tcp://127.0.0.1:0", keys=boss.curve_keys())
    try:
        address = workers.addresses[0]
        coordinator = Coordinator([StagePlacement(0, 0, len(graph.blocks) - 1, address)],
                                  PipelineConfig(schedule="1f1b-flush", microbatches=1, engine="torch", timeout_s=120),
                                  transport, [graph], worker_keys=workers.keys.workers, base=base)
        ready = coordinator.setup_bundles([plan_dir / "a"], ["a"])
        held = _status(int(ready[0]["pid"]))
        held["from_base"] = coordinator.base_bytes_held
        coordinator.stop()
    finally:
        transport.close()
    workers.wait(30.0)
    return held


@pytest.mark.slow  # two fresh torch workers and a 128 MiB export: ~25 CPU s (50-60 s wall at load 9)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_worker_without_the_base_file_sets_up_within_the_peak_of_one_holding_it(tmp_path):
    """Real worker processes set up by a real coordinator that offers the plan's base, with a one-stage PyTorch
    per-block LoRA bundle (its plan charges the frozen base mapped, as a worker holding the base file reads it):
    one started without the base file receives every frozen weight, spools the weights file as it arrives and maps
    them; its set-up's peak (VmHWM at ready) stands within a few MiB of the peak of one started with the base file
    (`--base`), whose set-up receives only the adapters. Main's one message per file held the 128 MiB file whole
    first."""
    from ir.bundle import PLAN_BASE, load_plan
    from ir.partition import Partition, StageAssignment
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from planner.emit import emit_plan
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from planner.schedule import make_schedule
    from runtime.keys import signer
    from runtime.pipeline.bundles import plan_base

    model = random_causal_lm("gpt2", 0, vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2, n_positions=16)
    path = export_causal_lm(model, tmp_path / "m" / "m.onnx", LlmExportOptions(example_seq=8), kv_cache=False)
    del model
    graph, _ = add_lora(load_model(path, 1, 8), LoraSettings(4, 8.0, targets=("q", "v"), seed=0, base_dtype="float32"))
    stage = Partition((StageAssignment(0, "a", 0, len(graph.blocks) - 1),), "manual")
    plan_dir = tmp_path / "plan"
    emit_plan(plan_dir, graph, stage, make_schedule("1f1b-flush", 1, 1),
              {"model": "m", "engine": "torch", "activations": {"a": "per-block"}}, sign=signer(BOSS))
    base = plan_base(plan_dir, load_plan(plan_dir))
    assert base is not None and base.names
    holding = _set_up_peak(plan_dir, graph, base, [plan_dir / PLAN_BASE])
    without = _set_up_peak(plan_dir, graph, base, [])
    print(f"ready, with --base: VmHWM {holding['VmHWM'] / MIB:.1f} MiB (VmRSS {holding['VmRSS'] / MIB:.1f}); "
          f"without: {without['VmHWM'] / MIB:.1f} ({without['VmRSS'] / MIB:.1f})")
    assert holding["from_base"] > VOCAB * HIDDEN * 4 and without["from_base"] == 0  # the table: taken / sent
    assert without["VmHWM"] - holding["VmHWM"] < 12 * MIB, (without["VmHWM"] - holding["VmHWM"]) / MIB
