"""The sending side of the snapshots held on the workers (issue 32, runtime.pipeline.snapshots):
what each snapshot costs a worker. A copy is taken into the arrays of a copy every holder confirmed
(fresh arrays cost their pages' first touch), never into those of a copy whose shipping stopped
half-way (the transport may still be sending them); over an authenticated link (CURVE) a copy's
chunks go without their CRC-32, in plaintext they keep it."""
from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from runtime.keys import KeyPair
from runtime.pipeline.snapshots import StateCopies
from runtime.transport.local import LocalHub, LocalTransport
from runtime.transport.wire import SIDE_KIND, Expected, MessageError
from runtime.transport.zeromq import ZmqTransport


def _pair():
    hub = LocalHub()
    a, b = LocalTransport("stage0", hub), LocalTransport("stage1", hub)
    a.connect("stage1", b.address)
    b.connect("stage0", a.address)
    return a, b


def _state(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("param/w", rng.standard_normal((600, 700)).astype(np.float32)),  # > 1 message of 2 MiB, with m
            ("opt/adamw/m/w", rng.standard_normal((600, 700)).astype(np.float32)),
            ("param/b", rng.standard_normal(7).astype(np.float32)),
            ("opt/adamw/t", np.array(seed, np.int64))]  # a 0-d tensor keeps its shape


def _ship(sender: StateCopies, holder: StateCopies, sid: int, state, keep) -> list[tuple[str, np.ndarray]]:
    """Take snapshot `sid` of `state` on the sender, ship it, file it on the holder; the copy taken."""
    sender.take(sid, 0, state, "stage1", keep, 0.0)
    deadline = time.monotonic() + 30
    while (0, sid) not in holder.replicas:
        assert time.monotonic() < deadline, "the copy never reached its holder"
        sender.pump()  # what the executor does between actions
        holder.take_in(["stage0"], 1)
        time.sleep(0.01)
    assert not sender.shipping
    return sender.own[sid]


def _assert_copy(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_a_copy_is_written_into_a_dropped_copys_file_and_stays_exact():
    a, b = _pair()
    reports = []
    sender, holder = StateCopies(a, reports.append), StateCopies(b, reports.append)
    first = _ship(sender, holder, 1, _state(1), keep=[])
    first_file, first_replica = first.file, holder.replicas[(0, 1)].file
    second = _ship(sender, holder, 2, _state(2), keep=[1])  # 1 confirmed: kept while 2 ships
    assert second.file is not first_file
    sender.forget_except([2]), holder.forget_except([2])  # the coordinator's snapshot_keep once 2 is confirmed
    state3 = _state(3)
    third = _ship(sender, holder, 3, state3, keep=[2])
    # snapshot 1's files hold snapshot 3 now (their pages are in the page cache already), exactly,
    # on the sender and its holder
    assert third.file is first_file and holder.replicas[(0, 3)].file is first_replica
    _assert_copy(sender.copy_of(0, 0, 3), state3)
    _assert_copy(holder.copy_of(0, 1, 3), state3)
    _assert_copy(sender.copy_of(0, 0, 2), _state(2))  # the kept copy untouched
    _assert_copy(holder.copy_of(0, 1, 2), _state(2))
    assert {"type": "replica_held", "stage": 1, "of": 0, "sid": 3} in reports
    a.close(), b.close()


def test_a_copy_whose_shipping_stopped_half_way_is_never_held():
    """Snapshot 1's shipping stops half-way (an abort, a new copy): its holder's partial file is
    never taken as a replica, and the next copy, written into the same file, arrives exact."""
    a, b = _pair()
    reports = []
    sender, holder = StateCopies(a, reports.append), StateCopies(b, reports.append)
    sender.take(1, 0, _state(1), "stage1", [], 10.0)  # spread over 10 s: still shipping when stopped
    sender.settle()  # written (on a thread of its own): its index and first chunk go at the next pump
    sender.pump()
    assert sender.shipping
    sender.stop()
    holder.take_in(["stage0"], 1)  # the begin and the first chunk arrived
    assert holder._incoming and not holder.replicas
    first_file = sender.own[1].file
    _ship(sender, holder, 2, _state(2), keep=[])  # nothing kept: 1 was never confirmed
    assert sender.own[2].file is first_file and 1 not in sender.own
    assert list(holder.replicas) == [(0, 2)] and not holder._incoming
    _assert_copy(holder.copy_of(0, 1, 2), _state(2))
    assert [r["sid"] for r in reports] == [2]
    a.close(), b.close()


def test_a_lost_senders_partial_copy_is_dropped():
    a, b = _pair()
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    sender.take(1, 0, _state(1), "stage1", [], 10.0)
    sender.settle()  # written (on a thread of its own): its index and first chunk go at the next pump
    sender.pump()
    holder.take_in(["stage0"], 1)
    holder.forget_from("stage0")  # the worker's abort names the sender lost
    assert not holder._incoming and not holder.replicas and len(holder._spare) == 1
    a.close(), b.close()


_PEAK_SCRIPT = """
import sys, time
import numpy as np
from runtime.pipeline.snapshots import StateCopies
from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from runtime.transport.local import LocalHub, LocalTransport

hub = LocalHub()
a, b = LocalTransport("stage0", hub), LocalTransport("stage1", hub)
a.connect("stage1", b.address)
b.connect("stage0", a.address)
sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
state = [(f"param/w{i}", np.random.default_rng(i).standard_normal(8 * 2**20).astype(np.float32)) for i in range(3)]
state_bytes = sum(arr.nbytes for _, arr in state)
before = rss_bytes()
reset_peak_rss()
keep = []
for sid in range(1, 4):  # the second and third are shipped while the one before is kept
    sender.take(sid, 0, state, "stage1", keep, 0.0)
    while (0, sid) not in holder.replicas:
        sender.pump()  # a few chunks between two actions, as the executor does
        holder.take_in(["stage0"], 1)
    keep = [sid]
    for arr in (state[sid % 3][1],):
        arr += 1  # a step changes the state between snapshots
print(state_bytes, before, peak_rss_bytes())
"""


def test_a_workers_peak_while_its_copy_ships_is_its_own_state_not_copies_of_it():
    """A real process holding a stage's state (96 MiB) takes three snapshots, shipping each to its
    neighbour while the last one is kept, and holds the neighbour's copies (here: its own, as the
    holder): its peak resident memory (VmHWM) grows by a few chunks, not by two to four copies
    (the copies lie in files: the page cache is not the process's memory)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    state_bytes, before, peak = (int(x) for x in out.stdout.split())
    assert peak - before < 0.25 * state_bytes, f"peak {peak - before} bytes above the state's {state_bytes}"


def _endpoints(insecure: bool):
    names = ("stage0", "stage1")
    pairs = {n: KeyPair.generate(n) for n in names}
    if insecure:
        ends = {n: ZmqTransport(n, "tcp://127.0.0.1:0", linger_s=0.2, insecure=True) for n in names}
    else:
        ends = {n: ZmqTransport(n, "tcp://127.0.0.1:0", keys=pairs[n].curve_keys(), linger_s=0.2,
                                accept={o: pairs[o].public.curve for o in names if o != n}) for n in names}
    for n, t in ends.items():
        for o, other in ends.items():
            if o != n:
                t.connect(o, other.address, **({} if insecure else {"key": pairs[o].public.curve}))
    return ends["stage0"], ends["stage1"]


def _side(receiver, peer: str):
    deadline = time.monotonic() + 10
    while (got := receiver.recv_side(peer)) is None:
        assert time.monotonic() < deadline, "nothing arrived in the side lane"
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "plaintext"])
def test_a_copys_chunks_go_without_their_crc_only_over_an_authenticated_link(insecure):
    a, b = _endpoints(insecure)
    try:
        chunk = np.arange(1000, dtype=np.float32)
        sent = a.send_tensor("stage1", SIDE_KIND, 0, 1, chunk, version=4, name="param/w|1000|0")
        step = a.send_tensor("stage1", "act", 0, 0, chunk)
        crc = zlib.crc32(chunk.tobytes())
        assert step.checksum == crc  # a step's own tensors keep theirs either way
        assert sent.checksum == (crc if insecure else 0)
        header, got = _side(b, "stage0")
        assert header.checksum == sent.checksum
        np.testing.assert_array_equal(got, chunk)
        _, act = b.recv_tensor("stage0", Expected(kind="act", stage=0, microbatch=0), timeout=10)
        np.testing.assert_array_equal(act, chunk)
    finally:
        a.close(), b.close()


def test_a_corrupted_chunk_over_an_unauthenticated_link_is_refused():
    """In plaintext (a transport whose links authenticate nothing) the CRC-32 still guards a copy."""
    a, b = _pair()
    assert not a.authenticated and not b.authenticated
    frames = []
    a._send_frames = lambda peer, fr: frames.append([bytes(f) for f in fr])
    a.send_tensor("stage1", SIDE_KIND, 0, 1, np.arange(64, dtype=np.float32), version=4, name="param/w|64|0")
    header, payload = frames[0]
    b._accept("stage0", [header, payload[:-1] + bytes([payload[-1] ^ 1])])
    with pytest.raises(MessageError, match="checksum mismatch"):
        b.recv_side("stage0")
    a.close(), b.close()


def test_a_copy_ships_between_the_steps_actions(tiny_checkpoint, export_dir):
    """The executor ships what is due of a snapshot copy between its actions and while it waits
    (an MNN graph holds the interpreter's lock: a sender thread could not), and the run's losses
    are single-device training's."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.executor import StageExecutor
    from runtime.pipeline.inprocess import InProcessWorkers
    from support import ROWS, S, export_onnx, single_device_training, synthetic_batch

    import runtime.pipeline.snapshots as snapshots

    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)
    batches = [synthetic_batch(i) for i in range(4)]
    in_step = []  # chunks sent inside an action of a step (its end, or a wait for a neighbour)
    real_execute = StageExecutor.execute

    def execute(self, action):
        copies = self.between.__self__.copies
        ship = copies._shipment
        before = ship.sent if ship is not None else None
        real_execute(self, action)
        if ship is not None and ship.sent > before:
            in_step.append(ship.sent - before)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapshots, "CHUNK_BYTES", 4096)  # many chunks for a tiny model's state
        mp.setattr(StageExecutor, "execute", execute)
        config = PipelineConfig(schedule="1f1b-flush", microbatches=4, optimizer="adamw", lr=1e-3, timeout_s=60)
        with InProcessWorkers(2, timeout_s=60) as workers:
            result = train_pipeline(graph, batches, 9, workers.addresses, config, 4, transport=workers.coordinator,
                                    faults=FaultPolicy(state_on="peers"))
    assert in_step, "no chunk of a snapshot copy was sent while a step ran"
    assert result.losses == single_device_training(graph, batches, 4)[0]


def test_a_copy_of_many_small_tensors_goes_in_a_few_messages_and_file_writes(monkeypatch):
    """A LoRA stage's state is ~700 small tensors: its copy is packed (one file of the tensors one
    after another, an index beside it), so taking, shipping and filing it costs a few system calls
    and messages, not one or more per tensor, and the holder's copy is exact."""
    import os

    import runtime.pipeline.snapshots as snapshots

    rng = np.random.default_rng(5)
    state = [(f"param/l{i}.lora_{ab}", rng.standard_normal((8, 16)).astype(np.float32))
             for i in range(300) for ab in "AB"]
    state += [(f"opt/adamw/{m}/{name}", rng.standard_normal(arr.shape).astype(np.float32))
              for m in ("m", "v") for name, arr in list(state)]
    state += [("opt/adamw/t", np.array(7, np.int64)), ("param/empty", np.zeros((0, 3), np.float32))]
    assert len(state) == 1802 and sum(a.nbytes for _, a in state) < snapshots.CHUNK_BYTES
    a, b = _pair()
    sent = []
    real_send = a._send_frames
    a._send_frames = lambda peer, frames: (sent.append(len(frames)), real_send(peer, frames))
    writes = []
    for call in ("pwrite", "pwritev"):
        real = getattr(os, call)
        monkeypatch.setattr(os, call, lambda *args, real=real, call=call: (writes.append(call), real(*args))[1])
    reports = []
    sender, holder = StateCopies(a, reports.append), StateCopies(b, reports.append)
    _ship(sender, holder, 1, state, keep=[])
    assert len(sent) <= 3, f"{len(sent)} messages for a copy of {len(state)} tensors"
    assert len(writes) <= 4, f"{len(writes)} file writes for a copy of {len(state)} tensors (sender and holder)"
    _assert_copy(holder.copy_of(0, 1, 1), state)
    _assert_copy(sender.copy_of(0, 0, 1), state)
    assert reports == [{"type": "replica_held", "stage": 1, "of": 0, "sid": 1}]
    a.close(), b.close()


@pytest.mark.parametrize("index, problem", [
    (b"\x80\x04K\x01.", "is not JSON"),  # a pickle is never unpickled
    (b'{"bytes": 8, "tensors": [["param/w", "float32", [2], 0], ["param/w", "float32", [0], 8]]}', "twice"),
    (b'{"bytes": 8, "tensors": [["param/w", "object", [2], 0]]}', "that is not \\[name, dtype, shape, offset\\]"),
    (b'{"bytes": 8, "tensors": [["param/w", "float32", [2], 4]]}', "where the one before ends at 0"),
    (b'{"bytes": 12, "tensors": [["param/w", "float32", [2], 0]]}', "declares 12 bytes, its tensors take 8"),
    (b'{"bytes": 0, "tensors": [["param/w", "float32", [4294967296, 4294967296], 0]]}', "of 73786976294838206464 bytes"),
])
def test_a_copys_index_that_is_not_a_packed_layout_is_refused(index, problem):
    a, b = _pair()
    holder = StateCopies(b, lambda msg: None)
    a.send_tensor("stage1", SIDE_KIND, 0, 0, np.frombuffer(index, np.uint8), version=1, name="#begin")
    with pytest.raises(ValueError, match=problem):
        holder.take_in(["stage0"], 1)
    assert not holder.replicas
    a.close(), b.close()


def test_a_copy_whose_bytes_are_not_all_in_is_never_held():
    """A torn copy (its sender stopped after some chunks) is never taken; a chunk out of order is refused."""
    import runtime.pipeline.snapshots as snapshots

    a, b = _pair()
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    sender.take(1, 0, _state(1), "stage1", [], 100.0)  # spread over 100 s: the first chunk only
    sender.settle()  # written (on a thread of its own): its index and first chunk go at the next pump
    sender.pump()
    holder.take_in(["stage0"], 1)
    got = holder._incoming["stage0"]
    assert 0 < got.spool.end < got.total and not holder.replicas
    a.send_tensor("stage1", SIDE_KIND, 0, 9, np.zeros(16, np.uint8), version=1,
                  name=f"{snapshots._BYTES}|{got.spool.end + 16}")
    with pytest.raises(ValueError, match="does not follow"):
        holder.take_in(["stage0"], 1)
    assert not holder.replicas
    a.close(), b.close()


def test_what_a_snapshot_costs_counts_gathering_the_state_and_reading_the_io_threads():
    """K (`runtime.pipeline.session.snapshot_interval`) is chosen from what a worker reports a
    snapshot cost its CPUs: gathering the stage's state (the engine's and optimizer's arrays: per
    tensor, ~700 for a LoRA stage) is in it, not left out before the copy's clock starts."""
    a, b = _pair()
    sender = StateCopies(a, lambda msg: None)

    def gather():  # what state_tensors does, made dear: 0.1 CPU-s
        start = time.thread_time()
        while time.thread_time() - start < 0.1:
            pass
        return _state(1)

    sender.take(1, 0, gather, None, [], 0.0)
    figures = sender.figures()
    assert figures["snapshot_cpu_parts_s"]["copy"] >= 0.1 and figures["snapshot_cpu_s"] >= 0.1, figures
    _assert_copy(sender.copy_of(0, 0, 1), _state(1))
    a.close(), b.close()


_HOLDER_SCRIPT = """
import ctypes, gc, sys, time
from runtime.pipeline.snapshots import StateCopies
from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from runtime.transport.zeromq import ZmqTransport

t = ZmqTransport("stage1", "tcp://127.0.0.1:0", linger_s=0.2, insecure=True)
t.connect("stage0", sys.argv[1])
holder = StateCopies(t, lambda msg: None)
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("READY", t.address, flush=True)
before = rss_bytes()
reset_peak_rss()
deadline = time.monotonic() + 120
while (0, 1) not in holder.replicas and time.monotonic() < deadline:
    time.sleep(0.25)  # an action of its step: nothing is filed meanwhile
    holder.take_in(["stage0"], 1)
print("PEAK", peak_rss_bytes() - before, int((0, 1) in holder.replicas), flush=True)
time.sleep(0.5)
t.close()
"""


def test_a_holder_busy_computing_receives_a_few_chunks_not_the_copy():
    """A holder (a real process, ZeroMQ) files a neighbour's copy only between its actions; here it
    "computes" 0.25 s between filings while a 48 MiB copy ships at once. The sender sends at most
    `CREDIT_BYTES` beyond what the holder said it filed, so the holder's peak resident
    memory (VmHWM) rises by a few chunks, not by the copy its receive queue took while it computed
    (before: nothing paced the shipping; the demo's workers peaked 28-48 MiB over their plan)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from runtime.pipeline.snapshots import CHUNK_BYTES, PUMP_CHUNKS

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sender_end = ZmqTransport("stage0", "tcp://127.0.0.1:0", linger_s=0.2, insecure=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER_SCRIPT, sender_end.address], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "READY", proc.stderr.read()[-3000:]
        sender_end.connect("stage1", line[1])
        sender = StateCopies(sender_end, lambda msg: None)
        state = [(f"param/w{i}", np.random.default_rng(i).standard_normal(4 * 2**20).astype(np.float32))
                 for i in range(3)]  # 3 x 16 MiB
        sender.take(1, 0, state, "stage1", [], 0.0)
        deadline = time.monotonic() + 120
        while sender.shipping and time.monotonic() < deadline:
            time.sleep(sender.pump() or 0.005)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        sender_end.close()
    assert proc.returncode == 0, err[-3000:]
    peak, held = (int(x) for x in next(l for l in out.splitlines() if l.startswith("PEAK ")).split()[1:])
    assert held, "the copy never became a replica"
    print(f"the holder's peak rose {peak / 2**20:.1f} MiB taking a 48 MiB copy")
    # the chunks on their way, and what the interpreter and ZeroMQ keep: not the copy (48 MiB)
    assert peak <= PUMP_CHUNKS * CHUNK_BYTES + 8 * 2**20, peak / 2**20


def test_a_copy_goes_in_messages_of_several_chunks_filed_a_chunk_a_write(monkeypatch):
    """A copy's bytes go in messages of `MESSAGE_CHUNKS` chunks (the Python of a message, on both
    ends, is paid per message: ~2/3 of a worker's own CPU for a copy in 1 MiB messages), and the
    holder writes each message's frames as they are, not joined first, at most `WRITE_BYTES` a
    write (2 MiB writes cost the workers 3-4x the CPU a MiB of 1 MiB ones); the copy is exact."""
    import os

    import runtime.pipeline.snapshots as snapshots

    rng = np.random.default_rng(9)
    state = [(f"param/w{i}", rng.standard_normal(2**20 // 4 * 3 // 2).astype(np.float32)) for i in range(8)]
    total = sum(a.nbytes for _, a in state)  # 12 MiB: 12 chunks, 6 messages
    a, b = _pair()
    chunks_sent = []
    real_send = a._send_frames
    a._send_frames = lambda peer, frames: (chunks_sent.append(len(frames) - 1) if b"#bytes" in bytes(frames[0]) else None,
                                           real_send(peer, frames))[1]
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    sender.take(1, 0, state, "stage1", [], 0.0)
    sender.settle()  # the sender's own copy written (on a thread of its own)
    writes = []
    for call in ("pwrite", "pwritev"):
        real = getattr(os, call)
        monkeypatch.setattr(os, call, lambda fd, data, at, real=real: (
            writes.append(sum(memoryview(d).nbytes for d in data) if isinstance(data, list) else memoryview(data).nbytes),
            real(fd, data, at))[1])
    deadline = time.monotonic() + 30
    while (0, 1) not in holder.replicas:  # from here on only the holder writes
        assert time.monotonic() < deadline, "the copy never reached its holder"
        sender.pump()
        holder.take_in(["stage0"], 1)
    messages = -(-total // (snapshots.MESSAGE_CHUNKS * snapshots.CHUNK_BYTES))
    assert snapshots.MESSAGE_CHUNKS >= 2 and len(chunks_sent) == messages == 6, chunks_sent
    assert chunks_sent == [snapshots.MESSAGE_CHUNKS] * messages  # frames of 1 MiB, as the wire has them
    assert writes == [snapshots.CHUNK_BYTES] * (messages * snapshots.MESSAGE_CHUNKS), \
        f"file writes of {writes} bytes for {messages} messages of {snapshots.MESSAGE_CHUNKS} chunks"
    _assert_copy(holder.copy_of(0, 1, 1), state)
    a.close(), b.close()


def test_a_sender_out_of_credit_waits_for_its_holders_word_without_looking_every_few_ms(monkeypatch):
    """A stage waiting for a neighbour's tensor (the executor's own wait, `StageExecutor._recv`)
    while its copy's shipping is out of credit (`CREDIT_BYTES` on its way, unfiled) is woken by its
    holder's word on what it filed (`wake_on_side`), not by looks every 25 ms that find nothing: its
    wake-ups (`between` calls) are a few per filing. Here the holder files every 0.25 s (it
    "computes" between) a 16 MiB copy, 4 filings or more; with looks every 25 ms, ~10 a filing. (The
    executor's look for an abort, every `POLL_S`, is set far apart here: those wake-ups are not the
    copy's.)"""
    import threading
    from types import SimpleNamespace

    import runtime.pipeline.executor as executor
    from runtime.pipeline.executor import StageExecutor

    monkeypatch.setattr(executor, "POLL_S", 30.0)

    a, b = _pair()
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    state = [(f"param/w{i}", np.random.default_rng(i).standard_normal(2**20).astype(np.float32)) for i in range(4)]
    filings = []

    def holder_side():
        while (0, 1) not in holder.replicas:
            time.sleep(0.25)  # computing
            holder.take_in(["stage0"], 1)
            filings.append(time.monotonic())
        b.send_tensor("stage0", "act", 1, 0, np.ones(3, np.float32))  # what the waiting stage waits for

    wakes = []

    def between():
        wakes.append(time.monotonic())
        return sender.pump()

    sender.take(1, 0, state, "stage1", [], 0.0)
    sender.settle()  # written (on a thread of its own): the wake-ups counted are the shipping's
    thread = threading.Thread(target=holder_side, daemon=True)
    thread.start()
    # as the worker sets it up: woken by a side message while its copy waits for the holder's word
    stage = SimpleNamespace(transport=a, interrupt=None, between=between, timeout=60.0,
                            wake_on_side=lambda: sender.awaiting_word)
    got = StageExecutor._recv(stage, "stage1", "act", 1, 0)
    thread.join(10)
    np.testing.assert_array_equal(got, np.ones(3, np.float32))
    _assert_copy(holder.copy_of(0, 1, 1), state)
    assert not sender.shipping and len(filings) >= 4
    # each filing's word wakes the wait once (and the tensor waited for, at the end)
    print(f"{len(wakes)} wake-ups for {len(filings)} filings")
    assert len(wakes) <= 2 * len(filings) + 2, (len(wakes), len(filings))
    a.close(), b.close()


def test_a_copys_file_is_written_a_mib_a_write_and_resumed_exactly_after_short_writes(monkeypatch):
    """A stage's own copy (large tensors and many small ones) is written at most `WRITE_BYTES` a
    system call (larger writes cost the workers 3-4x the CPU a MiB), and a write the system cut
    short is resumed where it stopped, inside a buffer too: the file is the tensors' bytes exactly."""
    import os

    import runtime.pipeline.snapshots as snapshots

    rng = np.random.default_rng(11)
    state = [("param/big", rng.standard_normal(3 * 2**20 // 4 + 5).astype(np.float32))]
    state += [(f"param/small{i}", rng.standard_normal(1000 + i).astype(np.float32)) for i in range(300)]
    state += [("opt/adamw/t", np.array(7, np.int64)), ("param/other", rng.standard_normal(2**18).astype(np.float32))]
    total = sum(a.nbytes for _, a in state)
    real = os.pwritev
    for short in (None, 300_001):  # as the system writes, then every write cut to its first 300001 bytes
        sizes = []

        def pwritev(fd, buffers, at, short=short):
            sizes.append(sum(memoryview(b).nbytes for b in buffers))
            if short is None or sizes[-1] <= short:
                return real(fd, buffers, at)
            data = b"".join(bytes(b) for b in buffers)[:short]  # what a short write wrote
            return real(fd, [data], at)

        monkeypatch.setattr(os, "pwritev", pwritev)
        with snapshots.tempfile.TemporaryFile() as f:
            copy = snapshots.SpooledCopy(f)
            copy.extend(state)
            copy.write_views([memoryview(a.reshape(-1)).cast("B") for _, a in state[:2]])
            assert copy.end == total + state[0][1].nbytes + state[1][1].nbytes
            assert max(sizes) <= snapshots.WRITE_BYTES, sizes
            if short is None:  # many small tensors still go several to a write
                assert len(sizes) <= (2 * total) // snapshots.WRITE_BYTES + 8, f"{len(sizes)} writes"
            _assert_copy(list(copy.items()), state)
            f.seek(total)
            tail = f.read()
            assert tail == state[0][1].tobytes() + state[1][1].tobytes()


def test_the_snapshot_interval_is_chosen_from_a_cost_that_counts_the_holders_filing_and_io():
    """K (`runtime.pipeline.session.snapshot_interval`, from `PeerSnapshots.costs`) is chosen from
    what each worker reports one snapshot cost its CPUs, and a holder's report counts what the
    neighbour's copy cost it: filing the chunks (`take_in`: the side lane's look, the file writes,
    its word back) and its ZeroMQ I/O threads (CURVE's decryption). Here the holder's own copy is
    tiny and it files a 24 MiB copy over CURVE: its report is far above its own copy's cost, and
    the keeper's cost is at least it."""
    from runtime.pipeline.session import snapshot_interval
    from runtime.pipeline.snapshots import PeerSnapshots

    a, b = _endpoints(insecure=False)
    try:
        sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
        holder.take(1, 1, [("param/b", np.ones(4, np.float32))], None, [], 0.0)  # its own stage's copy
        rng = np.random.default_rng(13)
        state = [(f"param/w{i}", rng.standard_normal(2**20).astype(np.float32)) for i in range(6)]
        _ship(sender, holder, 1, state, keep=[])
        reports = [sender.figures(), holder.figures()]
        parts = reports[1]["snapshot_cpu_parts_s"]
        assert parts["file"] > 2 * parts["copy"] and parts["io"] > 0, parts  # (io: this process's, both ends')
        assert reports[1]["snapshot_cpu_s"] >= 0.99 * sum(parts.values()), reports[1]  # (each part its own clock read)
        keeper = PeerSnapshots(None)
        keeper.note(reports)
        assert keeper.costs() == [max(r["snapshot_cpu_s"] for r in reports)]
        assert keeper.costs()[0] >= reports[1]["snapshot_cpu_s"]
        # what K does with it: a snapshot costing c CPU-s against steps of s is taken every
        # ceil(c / (share * s)) steps, within the replay budget
        cost = keeper.costs()[0]
        # (a replay budget that does not bind: under load a copy here costs over 0.125 CPU-s, and
        # 5 s of such 10x steps are 3)
        assert snapshot_interval(cost, 10 * cost, replay_budget_s=60) == 4  # 2.5% of the step: every 4 steps
        _assert_copy(holder.copy_of(0, 1, 1), state)
    finally:
        a.close(), b.close()


def _report(process_cpu_s: float, snapshot_cpu_s: float, snapshots: int, updates: int) -> dict:
    """What a worker's done says of its CPU (`StateCopies.figures` and the executor's updates)."""
    return {"process_cpu_s": process_cpu_s, "snapshot_cpu_s": snapshot_cpu_s, "snapshots_taken": snapshots,
            "updates": updates}


def test_the_snapshot_interval_weighs_all_the_workers_copies_against_all_their_work():
    """Issue 32: K was chosen from the busiest worker's snapshot against the wall-clock step, as if
    each worker had a core of its own and computed the whole step. Two workers that each spend
    0.0305 CPU-s on a snapshot, with 0.1 s steps in which each computes 0.04 CPU-s (idle in the
    bubbles): the busiest against the step asks for every ceil(0.0305 / (2.5% of 0.1)) = 13 steps;
    all the copies (0.061 CPU-s) against all the work (0.08 CPU-s a step) for every
    ceil(0.061 / (2.5% of 0.08)) = 31 steps, and that is K (the 5 s replay bound allows 49)."""
    from runtime.pipeline.session import FaultPolicy, Session, snapshot_interval
    from runtime.pipeline.snapshots import PeerSnapshots

    keeper = PeerSnapshots(None)
    # each step 0.04 CPU-s of work on each worker; worker 0 also pays for snapshot 1 during step 2
    # (its copy and shipping), worker 1 during step 3 (filing it): a step's work is the process's
    # CPU since the last report less the snapshots'
    keeper.note([_report(5.0, 0.0, 0, 1), _report(3.0, 0.0, 0, 1)])  # the first report: a baseline
    keeper.note([_report(5.0705, 0.0305, 1, 2), _report(3.04, 0.0, 1, 2)])
    keeper.note([_report(5.1105, 0.0305, 1, 3), _report(3.1105, 0.0305, 1, 3)])
    keeper.note([_report(5.1505, 0.0305, 1, 4), _report(3.1505, 0.0305, 1, 4)])
    copies, work = keeper.together()
    assert keeper.costs() == [pytest.approx(0.0305)] and copies == pytest.approx(0.061)
    assert work == pytest.approx(0.08)
    assert snapshot_interval(0.0305, 0.1) == 13  # the busiest alone, as before
    assert snapshot_interval(0.0305, 0.1, copies_cpu_s=copies, work_cpu_s=work) == 31
    assert snapshot_interval(0.0305, 0.1, replay_budget_s=1.0, copies_cpu_s=copies, work_cpu_s=work) == 9
    # workers busier than the wall clock (cores shared with others' work): never below the busiest's K
    assert snapshot_interval(0.0305, 0.1, copies_cpu_s=0.061, work_cpu_s=0.3) == 13

    # what the run asks: Session.snapshot_every under AUTO_SNAPSHOTS (its first step after the
    # setup, which builds the engines, left out)
    run = Session.__new__(Session)
    run.faults, run.held, run._work_s = FaultPolicy(snapshot_every=None, state_on="peers"), keeper, [0.3, 0.1, 0.1]
    assert run.snapshot_every() == 31

    # a new setup starts the counters over: no work known, K from the busiest alone
    keeper.reset()
    keeper.note([_report(9.0, 0.0, 0, 1), _report(7.0, 0.0, 0, 1)])
    assert keeper.together() == (0.0, 0.0) and run.snapshot_every() == 13
    # counters that went back (a worker set up again) are a new baseline, not a negative step
    keeper.note([_report(9.04, 0.0, 0, 2), _report(7.04, 0.0, 0, 2)])
    keeper.note([_report(1.0, 0.0, 0, 1), _report(7.08, 0.0, 0, 3)])
    assert keeper.together()[1] == pytest.approx(0.08)


def test_filing_done_while_shipping_is_charged_once(monkeypatch):
    """A sender out of credit files what its holder sent (the holder's word, its own copy's chunks)
    from inside `pump`; `take_in` charges that to the snapshots as filing, and `pump` charged it
    again as sending: K was chosen from a cost counted twice, and the parts misread. The sender's
    filing made dear (0.05 CPU-s a message it files): every such CPU-second is in `file` once,
    not in `send`."""
    a, b = _pair()
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    real_file, burnt = StateCopies._file, []

    def dear_file(self, *args):
        if self is sender:
            start = time.thread_time()
            while time.thread_time() - start < 0.05:
                pass
            burnt.append(time.thread_time() - start)
        return real_file(self, *args)

    monkeypatch.setattr(StateCopies, "_file", dear_file)
    rng = np.random.default_rng(5)
    state = [(f"param/w{i}", rng.standard_normal(2**20).astype(np.float32)) for i in range(4)]  # 16 MiB
    _ship(sender, holder, 1, state, keep=[])
    parts = sender.figures()["snapshot_cpu_parts_s"]
    assert len(burnt) >= 3, burnt  # the holder's words, filed from inside pump (the test never calls it)
    assert parts["file"] >= 0.99 * sum(burnt), (parts, sum(burnt))
    assert parts["send"] < 0.5 * sum(burnt), (parts, sum(burnt))
    _assert_copy(holder.copy_of(0, 1, 1), state)
    a.close(), b.close()
