"""Peers that misbehave on purpose or by accident, against real ZeroMQ sockets on 127.0.0.1 and real
processes: a stranger that declares a huge frame before it authenticates, an authenticated peer
that sends a frame no legal message has, and a coordinator frozen long enough for its workers to
drop it that then thaws."""
from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.keys import KeyPair, write_keypair
from runtime.transport.wire import (MAX_CONTROL_BYTES, MAX_FRAME_BYTES, PART_BYTES, Expected, PeerTimeout,
                                    encode_control)
from runtime.transport.zeromq import MAX_WIRE_FRAME_BYTES, ZmqTransport

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# --- frames larger than any legal one ----------------------------------------------------------

ENDPOINT = r"""
import sys
from runtime.keys import KeyPair
from runtime.transport.zeromq import ZmqTransport

secure = sys.argv[1] == "curve"
coordinator = KeyPair.generate("coordinator").public.curve
options = ({"keys": KeyPair.generate("worker").curve_keys(), "accept": {"coordinator": coordinator}}
           if secure else {"insecure": True, "accept": ["coordinator"]})
t = ZmqTransport("worker", "tcp://127.0.0.1:0", **options)
print(t.address, flush=True)
sys.stdin.readline()
t.close()
"""


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (signature, version, mechanism, as-server, filler): 64 bytes."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "insecure"])
def test_a_stranger_declaring_a_4_gib_frame_before_its_handshake_is_dropped_and_costs_no_memory(secure):
    """The probe's attack: a greeting, then one command frame that declares 4 GiB, streamed (where
    a CURVE HELLO should be). libzmq would buffer all of it before any authentication; with frames
    capped at the largest legal one (1 MiB and CURVE's wrapping), the connection is dropped at the
    frame's header and the endpoint's memory stays where it was."""
    child = subprocess.Popen([sys.executable, "-c", ENDPOINT, "curve" if secure else "insecure"], cwd=ROOT,
                             text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address = child.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), child.stderr.read()
        port = int(address.rsplit(":", 1)[1])
        before = _rss(child.pid)
        streamed, dropped = 0, False
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(_greeting(b"CURVE" if secure else b"NULL"))
            assert len(s.recv(64)) > 0  # the endpoint's greeting: a ZMTP peer is listening
            try:
                s.sendall(b"\x06" + struct.pack(">Q", 4 * 2 ** 30))  # a command frame, 8-byte size
                chunk = b"\0" * MIB
                while streamed < 64 * MIB:
                    s.sendall(chunk)
                    streamed += MIB
                s.settimeout(5)
                while s.recv(65536):  # the rest of the greeting, then end of stream once dropped
                    pass
                dropped = True
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
            except socket.timeout:
                pass
        grew = _rss(child.pid) - before
        assert dropped, f"the connection stayed open after {streamed / MIB:.0f} MiB of a 4 GiB frame"
        assert grew < 8 * MIB, f"the endpoint grew {grew / MIB:.1f} MiB for {streamed / MIB:.0f} MiB streamed"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(10) == 0, child.stderr.read()  # and it was never in danger
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()


def test_the_frame_cap_is_the_wire_formats_largest_frame():
    assert MAX_FRAME_BYTES == max(PART_BYTES, MAX_CONTROL_BYTES) == MIB
    # CURVE wraps a frame in a MESSAGE command: name, nonce, flags byte, MAC
    assert MAX_WIRE_FRAME_BYTES == MAX_FRAME_BYTES + 33


def _pair(**options) -> tuple[ZmqTransport, ZmqTransport]:
    a_keys, b_keys = KeyPair.generate("a"), KeyPair.generate("b")
    b = ZmqTransport("b", "tcp://127.0.0.1:0", keys=b_keys.curve_keys(), accept={"a": a_keys.public.curve},
                     linger_s=0.2, **options)
    a = ZmqTransport("a", None, keys=a_keys.curve_keys(), linger_s=0.2, **options)
    a.connect("b", b.address, key=b_keys.public.curve)
    return a, b


def test_big_tensors_and_the_largest_frames_cross_and_an_oversized_frame_only_drops_its_connection():
    """Over CURVE: a 9 MiB tensor crosses (in parts), so does a control message of exactly the
    largest size (a frame of MAX_FRAME_BYTES, plus CURVE's wrapping); one frame a byte over it is
    cut at the wire: the receiver sees nothing and raises nothing, and the sender's next message,
    over the connection ZeroMQ makes again, arrives."""
    a, b = _pair()
    try:
        big = np.arange(9 * MIB // 4 + 3, dtype=np.float32)
        a.send_tensor("b", "act", 0, 0, big)
        assert np.array_equal(b.recv_tensor("a", Expected("act", 0, 0), timeout=20)[1], big)
        pad = MAX_CONTROL_BYTES - len(encode_control({"pad": ""}))
        largest = {"pad": "x" * pad}
        assert len(encode_control(largest)) == MAX_FRAME_BYTES
        a.send_control("b", largest)
        assert b.recv_control("a", timeout=20) == ("a", largest)
        a._send_frames("b", [b"{" + b" " * MAX_FRAME_BYTES])  # one byte over
        with pytest.raises(PeerTimeout):
            b.recv_control("a", timeout=1.5)
        a.send_control("b", {"type": "after"})
        assert b.recv_control("a", timeout=20) == ("a", {"type": "after"})
    finally:
        a.close()
        b.close()


# --- a coordinator frozen past its workers' patience -----------------------------------------------

# The workers' patience with a silent coordinator (COORDINATOR_GRACE_S, 30 s) is cut to 1 s in both
# kinds of process, so that the freeze takes seconds, not a minute.
GRACE_S = 1.0
WORKER = r"""
import sys
import runtime.pipeline.worker as worker
worker.COORDINATOR_GRACE_S = float(sys.argv[1])
from confidant.cli import main
sys.exit(main(sys.argv[2:]))
"""
COORDINATOR = r"""
import sys
import runtime.pipeline.worker as worker
worker.COORDINATOR_GRACE_S = float(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from jobs.train.pipeline import FaultPolicy, train_pipeline
from jobs.common.workers import parse_workers
from planner.onnx_import import load_model
from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed
from support import M, ROWS, S, synthetic_batch

addresses, keys = parse_workers(sys.argv[5].split(","), sys.argv[4], False)
graph = load_model(sys.argv[3], ROWS, S)
try:
    train_pipeline(graph, [synthetic_batch(0)], 9, addresses, PipelineConfig("1f1b-flush", M), 100000, keys=keys,
                   faults=FaultPolicy(detect_s=1.0), on_step=lambda step, *rest: print(f"step {step}", flush=True))
except WorkerFailed as exc:
    print(f"failed: {exc}", flush=True)
    sys.exit(3)
"""


def _wait_for(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def test_a_frozen_coordinator_that_thaws_is_ignored_by_its_workers_and_ends_with_a_clear_error(tiny_onnx, tmp_path):
    """The probe's case (SIGSTOP of the coordinator past its workers' patience, then SIGCONT): each
    worker drops its stage and waits for a coordinator; the thawed one's orders (the step it had
    queued, its stop) come over its old connections and are refused and logged, not obeyed (they
    made a worker exit: "run of step N but this worker has no stage"); the thawed coordinator sees
    it stood still too long and ends with that error instead of waiting for answers; and a new
    coordinator is obeyed."""
    keys = tmp_path / "keys"
    pairs = {name: KeyPair.generate(name) for name in ("coordinator", "w1", "w2")}
    for pair in pairs.values():
        write_keypair(keys, pair)
    logs = [tmp_path / f"{name}.log" for name in ("w1", "w2", "coordinator")]
    procs = []

    def start(args: list, log: Path) -> subprocess.Popen:
        with log.open("w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", *map(str, args)], cwd=ROOT, text=True,
                                          stdout=subprocess.PIPE, stderr=err))
        return procs[-1]

    try:
        workers = [start([WORKER, GRACE_S, "worker", "--listen", "tcp://127.0.0.1:0", "--keys", keys, "--name", name,
                          "--failure-timeout", 1], log) for name, log in zip(("w1", "w2"), logs)]
        addresses = [w.stdout.readline().split()[-1] for w in workers]
        coordinator = start([COORDINATOR, GRACE_S, ROOT / "tests", tiny_onnx["torchscript-17"], keys,
                             f"w1={addresses[0]},w2={addresses[1]}"], logs[2])
        while (line := coordinator.stdout.readline()) and line.strip() != "step 3":
            pass
        assert line, logs[2].read_text()
        os.kill(coordinator.pid, signal.SIGSTOP)
        for log in logs[:2]:
            assert _wait_for(log, "dropping the stage and waiting for a coordinator", 15.0), log.read_text()
        os.kill(coordinator.pid, signal.SIGCONT)
        assert coordinator.wait(30) == 3, logs[2].read_text()
        last = coordinator.stdout.read().strip().splitlines()[-1]
        assert re.fullmatch(
            r"failed: this coordinator stood still for \d+ s \(stopped, suspended or starved of CPU\), longer than a "
            r"worker waits for a silent coordinator \(1 s\): every worker has dropped its stage and ignores this run; "
            r"start it again \(from its last checkpoint, if it wrote one\)", last), last
        for log, worker in zip(logs, workers):
            assert _wait_for(log, "it came over a connection of a lost peer, retired", 5.0), log.read_text()
            assert worker.poll() is None, f"the worker obeyed its old coordinator: {log.read_text()}"
            assert "has no stage" not in log.read_text()
        # a new coordinator (a new process's connections, the same key) is obeyed
        new = ZmqTransport("coordinator", None, keys=pairs["coordinator"].curve_keys(), linger_s=2.0)
        try:
            for name, address in zip(("w1", "w2"), addresses):
                new.connect(name, address, key=pairs[name].public.curve)
                new.send_control(name, {"type": "stop"})
        finally:
            new.close()
        assert [w.wait(10) for w in workers] == [0, 0], [log.read_text() for log in logs[:2]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()


def test_a_worker_without_a_stage_waits_for_a_coordinator_past_its_timeout(tmp_path):
    """`--timeout` bounds the wait on a silent peer of a stage; a worker that holds none (started by
    hand, a spare, one whose coordinator was lost) is a server and waits as long as it takes (it
    exited with status 1 after 600 s, or after --timeout)."""
    keys = tmp_path / "keys"
    pairs = {name: KeyPair.generate(name) for name in ("coordinator", "w1")}
    for pair in pairs.values():
        write_keypair(keys, pair)
    worker = subprocess.Popen([sys.executable, "-m", "confidant", "worker", "--listen", "tcp://127.0.0.1:0",
                               "--keys", str(keys), "--name", "w1", "--timeout", "0.5"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address = worker.stdout.readline().split()[-1]
        time.sleep(3.0)
        assert worker.poll() is None, worker.stderr.read()
        coordinator = ZmqTransport("coordinator", None, keys=pairs["coordinator"].curve_keys(), linger_s=2.0)
        try:
            coordinator.connect("w1", address, key=pairs["w1"].public.curve)
            coordinator.send_control("w1", {"type": "stop"})
        finally:
            coordinator.close()
        assert worker.wait(10) == 0, worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        worker.stdout.close()
        worker.stderr.close()
