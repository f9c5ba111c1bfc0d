"""Transport: round trips, every way a message can be wrong, timeouts, per-peer ordering.

The same checks run over the in-process transport and over ZeroMQ (in one process, and between two
real processes for the round trip), since both share the decoding and checking code and must fail
with the same messages."""
from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.transport.wire import (DTYPES, MAX_FRAMES, MAX_HEADER_BYTES, PART_BYTES, PROTOCOL_VERSION, Expected,
                                    MessageError, PeerTimeout, TensorHeader, check_payload, decode_control, encode_control)
from runtime.transport.local import LocalHub, LocalTransport
from runtime.keys import KeyPair, PublicKey
from runtime.transport.zeromq import ZmqTransport

ROOT = Path(__file__).resolve().parents[2]

# Every ZeroMQ endpoint here is CURVE-secured, as in a real run: each gets its name's key pair (made
# on first use), and a peer's key is the key of the endpoint bound at its address (renames keep
# an endpoint's key), else that of its name (an endpoint not bound yet).
_PAIRS: dict[str, KeyPair] = {}
_AT: dict[str, KeyPair] = {}


def pair_of(name: str) -> KeyPair:
    return _PAIRS.setdefault(name, KeyPair.generate(name))


def key_at(address: str, name: str) -> bytes:
    return (_AT.get(address) or pair_of(name)).public.curve


def zmq_endpoint(name: str, listen: str | None, peers: dict | None = None, *, accept=(), **options) -> ZmqTransport:
    pair = pair_of(name)
    t = ZmqTransport(name, listen, keys=pair.curve_keys(), accept={a: pair_of(a).public.curve for a in accept},
                     **options)
    if t.address:
        _AT[t.address] = pair
    for peer, address in (peers or {}).items():
        t.connect(peer, address, key=key_at(address, peer))
    return t


MODULES = [ROOT / "runtime" / "transport" / f for f in ("wire.py", "zeromq.py", "local.py")]
KINDS = ["local", "zmq"]


def make_mesh(kind: str, names: list[str]) -> dict:
    """Fully connected endpoints; ZeroMQ ones bind free loopback ports and learn each other's address."""
    if kind == "local":
        hub = LocalHub()
        return {n: LocalTransport(n, hub) for n in names}
    mesh = {n: zmq_endpoint(n, "tcp://127.0.0.1:0", linger_s=0.2) for n in names}
    for n, t in mesh.items():
        for other, peer in mesh.items():
            if other != n:
                t.connect(other, peer.address, key=key_at(peer.address, other))
    return mesh


@pytest.fixture(params=KINDS)
def mesh(request):
    made: dict = {}

    def build(*names):
        made.update(make_mesh(request.param, list(names)))
        return [made[n] for n in names]

    yield build
    for t in made.values():
        t.close()


def sample_arrays():
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 4)).astype(np.float32),
        rng.standard_normal((2, 3, 5)).astype(np.float32),
        np.float32(2.5) * np.ones((), np.float32),
        np.zeros((0, 7), np.float32),
        rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB: the zero-copy path
        rng.integers(-2**40, 2**40, (8,), dtype=np.int64),
        rng.integers(0, 30000, (4, 16), dtype=np.int64),
        rng.standard_normal((5, 6)).astype(np.float16),
        rng.random((3, 3)) > 0.5,
    ]


def good_message(array: np.ndarray, kind="act", stage=0, mb=3, **fields) -> tuple[TensorHeader, bytes]:
    payload = np.ascontiguousarray(array).tobytes()
    header = TensorHeader(kind=kind, stage=stage, microbatch=mb, version=-1, dtype=array.dtype.name,
                          shape=array.shape, nbytes=len(payload), checksum=zlib.crc32(payload), **fields)
    return header, payload


def preview(raw: bytes) -> str:
    return repr(raw[:80]) + (f"... ({len(raw)} bytes)" if len(raw) > 80 else "")


# --- round trips ------------------------------------------------------------------------------

def test_round_trip_in_process(mesh):
    a, b = mesh("a", "b")
    arrays = sample_arrays()
    for mb, x in enumerate(arrays):
        a.send_tensor("b", "act", 0, mb, x, version=7, name=f"t{mb}")
    for mb, x in enumerate(arrays):
        header, y = b.recv_tensor("a", Expected("act", 0, mb, version=7, shape=x.shape, dtype=x.dtype.name),
                                  timeout=5)
        assert header == TensorHeader("act", 0, mb, 7, x.dtype.name, x.shape, x.nbytes,
                                      zlib.crc32(x.tobytes()), f"t{mb}")
        assert y.dtype == x.dtype and y.shape == x.shape and np.array_equal(y, x)
        assert not y.flags.writeable and y.flags.aligned


def test_a_payload_over_several_frames_round_trips_and_goes_in_frames_of_a_mebibyte(mesh, monkeypatch):
    """A payload bigger than PART_BYTES crosses in frames of PART_BYTES (the last shorter): ZeroMQ's
    CURVE encrypts each frame through buffers of its size, so no frame is a whole table. The
    receiver gets the same array, writable by no one, whatever the split."""
    a, b = mesh("a", "b")
    sizes = []
    send = a._send_frames
    monkeypatch.setattr(a, "_send_frames", lambda peer, frames: (sizes.append([memoryview(f).nbytes for f in frames]),
                                                                 send(peer, frames)))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3 * PART_BYTES // 4 + 5,)).astype(np.float32)  # 3 MiB + 20 bytes
    exact = rng.standard_normal((PART_BYTES // 2, 2)).astype(np.float32)  # 4 MiB: 4 full frames
    for mb, arr in enumerate((x, exact, np.zeros(0, np.float32))):
        a.send_tensor("b", "act", 0, mb, arr)
    assert [s[1:] for s in sizes] == [[PART_BYTES] * 3 + [20], [PART_BYTES] * 4, [0]]
    for mb, arr in enumerate((x, exact, np.zeros(0, np.float32))):
        _, y = b.recv_tensor("a", Expected("act", 0, mb), timeout=10)
        assert np.array_equal(y, arr) and y.shape == arr.shape and not y.flags.writeable


def test_a_payload_split_otherwise_is_refused(mesh):
    """The split is the format's: frames that sum to the header's size and checksum but are cut
    elsewhere, or a payload in more frames than any tensor needs, are garbage."""
    a, b = mesh("a", "b")
    x = np.arange(PART_BYTES // 2 + 3, dtype=np.float32)  # 2 MiB + 12 bytes: 3 frames
    header, payload = good_message(x)
    # (no frame over PART_BYTES: ZeroMQ cuts a frame larger than any legal one at the wire)
    uneven = [payload[:PART_BYTES - 4], payload[PART_BYTES - 4:2 * PART_BYTES - 4], payload[2 * PART_BYTES - 4:]]
    a._send_frames("b", [header.encode(), *uneven])
    rule = f"a payload of {len(payload)} bytes comes in 3 frames of {PART_BYTES} bytes but the last"
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received act stage=0 mb=3 (payload in 3 frames of "
                                       f"{PART_BYTES - 4}, {PART_BYTES}, 16 bytes, {rule})")
    cut = [payload[:PART_BYTES], payload[PART_BYTES:2 * PART_BYTES], payload[2 * PART_BYTES:]]
    a._send_frames("b", [header.encode(), cut[0], cut[1][:-1], cut[1][-1:] + cut[2]])
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received act stage=0 mb=3 (payload in 3 frames of "
                                       f"{PART_BYTES}, {PART_BYTES - 1}, 13 bytes, {rule})")
    a._send_frames("b", [header.encode(), cut[0], cut[1][:-1]])
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received act stage=0 mb=3 (truncated payload: "
                                       f"{len(payload) - 13} bytes, header says {len(payload)})")
    bad = bytearray(cut[2])
    bad[0] ^= 1
    a._send_frames("b", [header.encode(), cut[0], cut[1], bytes(bad)])
    with pytest.raises(MessageError, match="checksum mismatch"):
        b.recv_tensor("a", WANT, timeout=5)
    a._send_frames("b", [header.encode(), payload])  # version 1's one frame
    if isinstance(b, ZmqTransport):  # over the largest legal frame: ZeroMQ cuts it at the wire, nothing arrives
        with pytest.raises(PeerTimeout):
            b.recv_tensor("a", WANT, timeout=1)
    else:
        expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received act stage=0 mb=3 (payload in 1 frame "
                                           f"of {len(payload)} bytes, {rule})")
    a.send_tensor("b", "act", 0, 3, x)  # and the link still works
    assert np.array_equal(b.recv_tensor("a", WANT, timeout=5)[1], x)


def test_send_accepts_strided_and_big_endian_arrays(mesh):
    a, b = mesh("a", "b")
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    a.send_tensor("b", "act", 0, 0, x.T)
    a.send_tensor("b", "act", 0, 1, x.astype(">f4"))
    assert np.array_equal(b.recv_tensor("a", Expected("act", 0, 0), timeout=5)[1], x.T)
    _, y = b.recv_tensor("a", Expected("act", 0, 1), timeout=5)
    assert y.dtype == np.dtype("<f4") and np.array_equal(y, x)


def test_sender_refuses_what_it_cannot_describe(mesh):
    a, _ = mesh("a", "b")
    with pytest.raises(ValueError, match="cannot send dtype complex64"):
        a.send_tensor("b", "act", 0, 0, np.zeros(3, np.complex64))
    with pytest.raises(ValueError, match="kind 'Act!'"):
        a.send_tensor("b", "Act!", 0, 0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="control message is not plain JSON"):
        a.send_control("b", {"loss": float("nan")})


CHILD = r"""
import sys
from runtime.keys import KeyPair, PublicKey
from runtime.transport.wire import Expected
from runtime.transport.zeromq import ZmqTransport

main_key = PublicKey.parse(sys.argv[2]).curve
me = KeyPair.generate("echo")
t = ZmqTransport("echo", "tcp://127.0.0.1:0", {"main": sys.argv[1]}, keys=me.curve_keys(), peer_keys={"main": main_key})
print(t.address, me.public.text, flush=True)
print(t.address, flush=True)
echoed = 0
while True:
    _, msg = t.recv_control("main", timeout=20)
    if msg["op"] == "stop":
        t.send_control("main", {"op": "stats", "echoed": echoed, "names": msg["names"]})
        break
    for mb in range(msg["count"]):
        header, x = t.recv_tensor("main", Expected("act", 0, mb), timeout=20)
        t.send_tensor("main", "grad", 1, mb, ~x if x.dtype == bool else x * 2, version=header.version,
                      name=header.name)
        echoed += 1
t.close()
"""


def test_round_trip_between_two_processes():
    main = zmq_endpoint("main", "tcp://127.0.0.1:0", linger_s=1.0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, main.address, pair_of("main").public.text], cwd=ROOT,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address, key = (child.stdout.readline().split() + ["", ""])[:2]
        assert address.startswith("tcp://127.0.0.1:"), child.stderr.read()
        main.connect("echo", address, key=PublicKey.parse(key).curve)
        arrays = sample_arrays()
        main.send_control("echo", {"op": "echo", "count": len(arrays)})
        for mb, x in enumerate(arrays):
            main.send_tensor("echo", "act", 0, mb, x, version=mb, name=f"x{mb}")
        for mb, x in enumerate(arrays):
            header, y = main.recv_tensor("echo", Expected("grad", 1, mb, version=mb,
                                                          shape=x.shape, dtype=x.dtype.name, name=f"x{mb}"),
                                         timeout=20)
            assert np.array_equal(y, ~x if x.dtype == bool else x * 2), mb
        main.send_control("echo", {"op": "stop", "names": ["α", {"nested": [1, 2.5, None, True]}]})
        assert main.recv_control("echo", timeout=20) == (
            "echo", {"op": "stats", "echoed": len(arrays), "names": ["α", {"nested": [1, 2.5, None, True]}]})
        assert child.wait(timeout=20) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
        main.close()


def test_zmq_queues_sends_to_a_peer_that_has_not_bound_yet():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    early = zmq_endpoint("early", None, {"late": address}, linger_s=0.2)
    try:
        early.send_tensor("late", "act", 0, 0, np.arange(5, dtype=np.int64))
        early.send_control("late", {"op": "start"})
        late = zmq_endpoint("late", address, accept=["early"], linger_s=0.2)
        try:
            assert late.address == address
            assert late.recv_control("early", timeout=5) == ("early", {"op": "start"})
            assert np.array_equal(late.recv_tensor("early", Expected("act", 0, 0), timeout=5)[1], np.arange(5))
        finally:
            late.close()
    finally:
        early.close()


def test_zmq_wait_sent_waits_for_a_large_message_to_leave_and_reports_one_that_cannot():
    """`wait_sent` (what bounds a recovery's optimizer state in ZeroMQ's queue): a large tensor
    queued for a peer that has not bound yet is still held when the send timeout runs out
    (PeerTimeout, sending); once the peer is there, a wait after the next one returns and the peer
    gets both, intact."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: tracked, in frames of a mebibyte
    early = zmq_endpoint("early", None, {"late": address}, linger_s=0.2, send_timeout_s=2.0)
    try:
        early.wait_sent("late")  # nothing sent yet: nothing to wait for
        early.send_tensor("late", "optstate", -1, 0, big)
        with pytest.raises(PeerTimeout):
            early.wait_sent("late")
        late = zmq_endpoint("late", address, accept=["early"], linger_s=0.2)
        try:
            early.send_tensor("late", "optstate", -1, 1, 2 * big)
            early.wait_sent("late")
            for i, want in ((0, big), (1, 2 * big)):
                np.testing.assert_array_equal(late.recv_tensor("early", Expected("optstate", -1, i), timeout=10)[1], want)
        finally:
            late.close()
    finally:
        early.close()


# --- connections: addresses, names, renaming (the same rules over both transports) -------------

def make_endpoint(kind: str, name: str, hub: LocalHub, address: str, **zmq_options):
    """An endpoint that receives at its own address: a local one at `address` on `hub`, or a
    ZeroMQ one on a free loopback port."""
    if kind == "local":
        return LocalTransport(name, hub, address)
    return zmq_endpoint(name, "tcp://127.0.0.1:0", linger_s=0.2, **zmq_options)


@pytest.fixture(params=KINDS)
def endpoints(request):
    hub, made = LocalHub(), []

    def build(name, address, **zmq_options):
        made.append(make_endpoint(request.param, name, hub, address, **zmq_options))
        return made[-1]

    yield build
    for t in made:
        t.close()


def test_messages_go_to_an_address_and_are_filed_under_the_senders_name(endpoints):
    """As a worker and its coordinator: the worker starts nameless ("worker") and still receives
    what the coordinator sends to the peer name it connected the worker's address under; once
    renamed and connected back, its messages are filed under its new name."""
    coord = endpoints("coordinator", "local://coordinator")
    worker = endpoints("worker", "local://w0", accept=("coordinator",))
    coord.connect("stage0", worker.address, key=key_at(worker.address, "stage0"))
    assert coord.peers == {"stage0": worker.address} and coord.address_of("stage0") == worker.address
    coord.send_control("stage0", {"type": "setup", "stage": 0})
    coord.send_tensor("stage0", "weights", -1, 0, X, name="w")
    assert worker.recv_control("coordinator", timeout=5) == ("coordinator", {"type": "setup", "stage": 0})
    assert np.array_equal(worker.recv_tensor("coordinator", Expected("weights", -1, 0, name="w"), timeout=5)[1], X)
    worker.rename("stage0")
    worker.connect("coordinator", coord.address, key=key_at(coord.address, "coordinator"))
    assert worker.name == "stage0" and worker.peers == {"coordinator": coord.address}
    worker.send_control("coordinator", {"type": "ready", "stage": 0})
    assert coord.recv_control(None, timeout=5) == ("stage0", {"type": "ready", "stage": 0})


def test_a_name_changes_hands_only_after_every_connection_is_closed(endpoints):
    """A re-plan that renumbers a worker: it may not rename while it still sends under the old
    name; after `disconnect` it takes the new one, and the coordinator files it under that."""
    coord = endpoints("coordinator", "local://coordinator")
    worker = endpoints("worker", "local://w0", accept=("coordinator",))
    coord.connect("stage1", worker.address, key=key_at(worker.address, "stage1"))
    worker.rename("stage1")
    worker.connect("coordinator", coord.address, key=key_at(coord.address, "coordinator"))
    worker.send_control("coordinator", {"type": "released", "stage": 1})
    with pytest.raises(RuntimeError, match=r"still sends to \['coordinator'\] under its old name; disconnect them "
                                           r"before renaming it to 'stage0'"):
        worker.rename("stage0")
    assert coord.recv_control("stage1", timeout=5) == ("stage1", {"type": "released", "stage": 1})
    worker.disconnect("coordinator")
    assert worker.peers == {}
    with pytest.raises(ValueError, match=r"no address for peer 'coordinator' of 'stage1'; call connect\(\) first"):
        worker.send_control("coordinator", {"type": "late"})
    with pytest.raises(ValueError, match="transport name must be a non-empty printable string"):
        worker.rename("")
    worker.rename("stage0")
    coord.disconnect("stage1")
    coord.connect("stage0", worker.address, key=key_at(worker.address, "stage0"))
    coord.send_control("stage0", {"type": "setup", "stage": 0})
    assert worker.recv_control("coordinator", timeout=5) == ("coordinator", {"type": "setup", "stage": 0})
    worker.connect("coordinator", coord.address, key=key_at(coord.address, "coordinator"))
    worker.send_control("coordinator", {"type": "ready", "stage": 0})
    assert coord.recv_control(None, timeout=5) == ("stage0", {"type": "ready", "stage": 0})
    assert coord.peers == {"stage0": worker.address}


def test_a_peer_moved_to_another_address_gets_what_is_sent_from_then_on(endpoints):
    coord = endpoints("coordinator", "local://coordinator")
    old = endpoints("old", "local://old", accept=("coordinator",))
    new = endpoints("new", "local://new", accept=("coordinator",))
    coord.connect("stage0", old.address, key=key_at(old.address, "stage0"))
    coord.send_control("stage0", {"n": 1})
    assert old.recv_control("coordinator", timeout=5) == ("coordinator", {"n": 1})
    coord.connect("stage0", new.address, key=key_at(new.address, "stage0"))
    coord.send_control("stage0", {"n": 2})
    assert new.recv_control("coordinator", timeout=5) == ("coordinator", {"n": 2})
    with pytest.raises(PeerTimeout):
        old.recv_control("coordinator", timeout=0.1)


def test_a_local_endpoint_that_never_connects_finds_peers_by_name():
    """The full mesh of the sequential replay: `local://<name>` is where `LocalTransport(name)`
    lives, until the endpoint connects anything; then it sends only where it connected."""
    hub = LocalHub()
    a, b = LocalTransport("a", hub), LocalTransport("b", hub)
    assert (a.address, a.peers, a.address_of("b")) == ("local://a", {}, "local://b")
    a.send_control("b", {"n": 1})
    assert b.recv_control("a", timeout=5) == ("a", {"n": 1})
    a.connect("c", "local://somewhere")
    assert a.address_of("b") is None
    with pytest.raises(ValueError, match=r"no address for peer 'b' of 'a'; call connect\(\) first"):
        a.send_control("b", {"n": 2})
    with pytest.raises(ValueError, match="is not a local:// address"):
        a.connect("d", "tcp://127.0.0.1:1")


def test_local_addresses_are_bound_once_and_freed_by_close():
    hub = LocalHub()
    first = LocalTransport("worker", hub, "local://w0")
    with pytest.raises(ValueError, match="already bound at 'local://w0'"):
        LocalTransport("worker", hub, "local://w0")
    second = LocalTransport("worker", hub, "local://w1")  # one name, two addresses: two nameless workers
    first.close()
    again = LocalTransport("worker", hub, "local://w0")
    assert hub.is_registered("local://w0") and hub.is_registered("local://w1")
    for t in (second, again):
        t.close()
    with pytest.raises(RuntimeError, match="is closed"):
        again.send_control("x", {})


def test_closing_a_local_endpoint_wakes_a_receive_waiting_in_another_thread():
    """How the in-process harness stops a stage that waits for a neighbour that will never send."""
    hub = LocalHub()
    waiting = LocalTransport("stage1", hub)
    outcome = []

    def wait():
        try:
            waiting.recv_tensor("stage0", Expected("act", 0, 0), timeout=30)
        except RuntimeError as err:
            outcome.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    waiting.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(outcome) == 1 and "closed" in str(outcome[0])


def test_pipeline_of_threads_over_the_local_transport():
    """A 3-stage, 4-micro-batch GPipe step (y = x * w per stage) run on threads matches one process."""
    stages, micro = 3, 4
    weights = [np.float32(s + 2) for s in range(stages)]
    batches = [np.full((2, 3), mb + 1, np.float32) for mb in range(micro)]
    hub = LocalHub()
    coord = LocalTransport("coord", hub)
    ts = [LocalTransport(f"s{s}", hub) for s in range(stages)]
    grads_w = [[] for _ in range(stages)]
    failures = []

    def run(s: int) -> None:
        t, prev, nxt = ts[s], f"s{s - 1}" if s else "coord", f"s{s + 1}" if s < stages - 1 else None
        try:
            inputs = []
            for mb in range(micro):
                x = t.recv_tensor(prev, Expected("batch" if s == 0 else "act", s - 1, mb), timeout=5)[1]
                inputs.append(x)
                if nxt:
                    t.send_tensor(nxt, "act", s, mb, x * weights[s])
            for mb in reversed(range(micro)):
                g = np.ones((2, 3), np.float32) if nxt is None else \
                    t.recv_tensor(nxt, Expected("grad", s + 1, mb), timeout=5)[1]
                grads_w[s].append(float((g * inputs[mb]).sum()))
                if s:
                    t.send_tensor(prev, "grad", s, mb, g * weights[s])
            t.send_control("coord", {"stage": s, "done": True})
        except Exception as err:  # surfaced by the main thread's assertion
            failures.append(err)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for th in threads:
        th.start()
    for mb, x in enumerate(batches):
        coord.send_tensor("s0", "batch", -1, mb, x)
    done = sorted(coord.recv_control(None, timeout=10)[1]["stage"] for _ in range(stages))
    for th in threads:
        th.join(timeout=10)
    assert not failures, failures
    assert done == [0, 1, 2]
    for s in range(stages):
        downstream = np.prod(weights[s + 1:]) if s < stages - 1 else 1.0
        upstream = np.prod(weights[:s]) if s else 1.0
        expect = [float((x * upstream * downstream).sum()) for x in reversed(batches)]
        assert grads_w[s] == pytest.approx(expect)


# --- every way a message can be wrong ---------------------------------------------------------

X = np.arange(12, dtype=np.float32).reshape(3, 4)
WANT = Expected("act", 0, 3)


def expect_error(b, address: str, text: str, want: Expected = WANT) -> None:
    with pytest.raises(MessageError) as info:
        b.recv_tensor("a", want, timeout=5)
    assert str(info.value) == f"message from peer 'a' ({address}): {text}"


def test_corrupted_checksum(mesh):
    a, b = mesh("a", "b")
    header, payload = good_message(X)
    bad = TensorHeader(**{**header.__dict__, "checksum": header.checksum ^ 1})
    a._send_frames("b", [bad.encode(), payload])
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received act stage=0 mb=3 (checksum "
                                       f"mismatch: payload crc32 0x{header.checksum:08x}, header says "
                                       f"0x{header.checksum ^ 1:08x})")


def test_truncated_and_oversized_payloads(mesh):
    a, b = mesh("a", "b")
    header, payload = good_message(X)
    a._send_frames("b", [header.encode(), payload[:-4]])
    a._send_frames("b", [header.encode(), payload + b"\0"])
    expect_error(b, b.address_of("a"), "expected act stage=0 mb=3, received act stage=0 mb=3 "
                                       "(truncated payload: 44 bytes, header says 48)")
    expect_error(b, b.address_of("a"), "expected act stage=0 mb=3, received act stage=0 mb=3 "
                                       "(oversized payload: 49 bytes, header says 48)")


def test_garbled_headers(mesh):
    a, b = mesh("a", "b")
    addr = b.address_of("a")
    junk = b"\x00\xff" + b"z" * 100
    a._send_frames("b", [b"not json{", b""])
    a._send_frames("b", [junk, b""])
    a._send_frames("b", [b"[1, 2]", b""])
    a._send_frames("b", [b"[" * (MAX_HEADER_BYTES // 2), b""])
    expect_error(b, addr, "expected act stage=0 mb=3, received header b'not json{' "
                          "(header is not valid JSON at char 0)")
    expect_error(b, addr, f"expected act stage=0 mb=3, received header {junk[:80]!r}... (102 bytes) "
                          f"(header is not UTF-8 (byte 1))")
    expect_error(b, addr, "expected act stage=0 mb=3, received header b'[1, 2]' "
                          "(header is a JSON list, not an object)")
    with pytest.raises(MessageError, match="header nests too deeply"):
        b.recv_tensor("a", WANT, timeout=5)


def test_headers_with_an_extra_or_missing_field(mesh):
    a, b = mesh("a", "b")
    header, payload = good_message(X)
    extra = json.dumps({**json.loads(header.encode()), "extra": 1}).encode()
    fields = json.loads(header.encode())
    del fields["name"], fields["checksum"]
    missing = json.dumps(fields).encode()
    a._send_frames("b", [extra, payload])
    a._send_frames("b", [missing, payload])
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received header {preview(extra)} "
                                       f"(unknown field 'extra')")
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received header {preview(missing)} "
                                       f"(missing fields 'checksum', 'name')")


def test_out_of_order_messages(mesh):
    a, b = mesh("a", "b")
    a.send_tensor("b", "act", 0, 2, X)
    a.send_tensor("b", "grad", 0, 3, X)
    a.send_tensor("b", "act", 1, 3, X)
    a.send_tensor("b", "act", 0, 3, X, version=4)
    a.send_tensor("b", "act", 0, 3, X)
    addr = b.address_of("a")
    expect_error(b, addr, "expected act stage=0 mb=3, received act stage=0 mb=2 (out of order)")
    expect_error(b, addr, "expected act stage=0 mb=3, received grad stage=0 mb=3 (out of order)")
    expect_error(b, addr, "expected act stage=0 mb=3, received act stage=1 mb=3 (out of order)")
    expect_error(b, addr, "expected act stage=0 mb=3 v=5 dtype=int64 shape=(4, 3), received act stage=0 "
                          "mb=3 v=4 dtype=float32 shape=(3, 4) (version, dtype, shape differ)",
                 Expected("act", 0, 3, version=5, shape=(4, 3), dtype="int64"))
    # A rejected message is consumed, so the stream carries on with the next one.
    header, y = b.recv_tensor("a", Expected("act", 0, 3, version=-1), timeout=5)
    assert np.array_equal(y, X)


def test_a_tensor_under_another_name_is_refused(mesh):
    """input_ids, attention_mask and token_type_ids are all int64 [B, S]: only the name tells them
    apart, so a name other than the awaited one is a MessageError naming both."""
    a, b = mesh("a", "b")
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    a.send_tensor("b", "batch", -1, 0, np.ones_like(ids), name="attention_mask")
    a.send_tensor("b", "batch", -1, 0, ids, name="input_ids")
    want = Expected("batch", -1, 0, shape=ids.shape, dtype="int64", name="input_ids")
    expect_error(b, b.address_of("a"), "expected batch stage=-1 mb=0 dtype=int64 shape=(2, 6) name='input_ids', "
                                       "received batch stage=-1 mb=0 dtype=int64 shape=(2, 6) "
                                       "name='attention_mask' (name differs)", want)
    header, y = b.recv_tensor("a", want, timeout=5)
    assert header.name == "input_ids" and np.array_equal(y, ids)


class _RecordingEngine:
    """Just enough of a StageEngine for a one-stage executor: records the feeds of each forward."""

    spec = SimpleNamespace(params=(), activation_input=None)  # a stage without weights

    def __init__(self):
        self.feeds: list[dict[str, np.ndarray]] = []

    def parameters(self) -> dict[str, np.ndarray]:
        return {}

    def forward(self, feeds, microbatch=0, train=True):
        self.feeds.append({k: np.array(v) for k, v in feeds.items()})
        return np.asarray([0.5], np.float32)


TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _token_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"input_ids": rng.integers(5, 500, (2, 6)), "attention_mask": np.ones((2, 6), np.int64),
            "token_type_ids": np.zeros((2, 6), np.int64)}


@pytest.mark.parametrize("order", [TOKEN_INPUTS, ("attention_mask", "input_ids", "token_type_ids")])
def test_the_executor_takes_graph_inputs_by_name_never_by_position(order):
    """The coordinator sends a stage's graph inputs over the local transport, as the local replay
    does; sent in the plan's order each reaches the engine under its own name, while in another
    order (every one the same int64 [2, 6]) the executor refuses them instead of feeding the mask
    as the token ids."""
    from ir.plan import Action, ActionKind
    from runtime.optim import make_optimizer
    from runtime.pipeline.executor import COORDINATOR, StageExecutor, stage_peer

    hub = LocalHub()
    coordinator = LocalTransport(COORDINATOR, hub)
    engine = _RecordingEngine()
    executor = StageExecutor(0, 1, engine, LocalTransport(stage_peer(0), hub), make_optimizer("sgd", 0.1),
                             TOKEN_INPUTS, timeout=0)
    batch = _token_batch()
    for name in order:
        coordinator.send_tensor(stage_peer(0), "batch", -1, 0, batch[name], name=name)
    if order == TOKEN_INPUTS:
        executor.execute(Action(ActionKind.F, 0, 0))
        assert set(engine.feeds[0]) == set(TOKEN_INPUTS)
        for name in TOKEN_INPUTS:
            assert np.array_equal(engine.feeds[0][name], batch[name]), name
        return
    with pytest.raises(MessageError) as info:
        executor.execute(Action(ActionKind.F, 0, 0))
    assert "name='input_ids'" in str(info.value) and "name='attention_mask'" in str(info.value)
    assert info.value.problem == "name differs"
    assert engine.feeds == []


def test_wrong_frame_count(mesh):
    a, b = mesh("a", "b")
    a._send_frames("b", [b"{}"] + [b""] * MAX_FRAMES)
    expect_error(b, b.address_of("a"), f"expected act stage=0 mb=3, received {MAX_FRAMES + 1} frames "
                                       f"(a message is 1 control frame, or a tensor's header and its payload in 1 to "
                                       f"{MAX_FRAMES - 1} frames)")


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "insecure"])
def test_zmq_drops_an_unknown_sender_and_records_it(secure):
    """A stranger is noise, never an error (issue 13): its message does not reach the receiver,
    nothing is raised, and the refusal is recorded. Secure, a stranger's key is refused in the
    handshake; insecure, its unknown name is."""
    if secure:
        b = zmq_endpoint("b", "tcp://127.0.0.1:0", accept=["a", "c"], linger_s=0.2)
        mallory = zmq_endpoint("mallory", None, {"b": b.address}, linger_s=0.2)
    else:
        b = ZmqTransport("b", "tcp://127.0.0.1:0", accept=["a", "c"], linger_s=0.2, insecure=True)
        mallory = ZmqTransport("mallory", None, {"b": b.address}, linger_s=0.2, insecure=True)
    try:
        mallory.send_tensor("b", "act", 0, 3, X)
        with pytest.raises(PeerTimeout):
            b.recv_tensor("a", WANT, timeout=1)
        assert b.refused, "the stranger was not recorded"
        reason = b.refused[0].describe()
        assert ("not the key of any peer" in reason) if secure else ("'mallory'" in reason and "no such peer" in reason)
        with pytest.raises(ValueError, match="'mallory' is not a peer of 'b'"):
            b.recv_tensor("mallory", WANT, timeout=0)
    finally:
        mallory.close()
        b.close()


def test_garbled_control_frame(mesh):
    a, b = mesh("a", "b")
    a._send_frames("b", [b'{"v":%d}' % PROTOCOL_VERSION])
    a._send_frames("b", [b'{"v":%d,"control":[1]}' % PROTOCOL_VERSION])
    with pytest.raises(MessageError) as info:
        b.recv_control("a", timeout=5)
    assert str(info.value) == (f"message from peer 'a' ({b.address_of('a')}): expected a control message, "
                               f"received control frame b'{{\"v\":{PROTOCOL_VERSION}}}' (missing field 'control')")
    with pytest.raises(MessageError, match="control is not a JSON object"):
        b.recv_control(None, timeout=5)


GOOD = json.loads(good_message(X)[0].encode())


@pytest.mark.parametrize("change, problem", [
    ({"v": 1}, f"protocol version 1, this side speaks {PROTOCOL_VERSION}: run the same Confidant version on every "
               f"device (the coordinator's and every worker's)"),
    ({"v": True}, "protocol version True is not a whole number"),
    ({"stage": True}, "stage True is not an integer >= -1"),
    ({"stage": -2}, "stage -2 is not an integer >= -1"),
    ({"microbatch": 1.0}, "microbatch 1.0 is not an integer >= -1"),
    ({"kind": ""}, "kind '' is not a lowercase identifier of at most 32 characters"),
    ({"dtype": "object"}, f"dtype 'object' is not one of {', '.join(sorted(DTYPES))}"),
    ({"shape": [3, -4]}, "shape [3, -4] has a dimension that is not a non-negative integer"),
    ({"shape": "3,4"}, "shape is str, not a list"),
    ({"nbytes": 47}, "nbytes 47 does not match float32(3, 4) (48 bytes)"),
    ({"shape": [2**40, 2**40], "nbytes": 2**82}, "nbytes 4835703278458516698824704 exceeds the limit of 17179869184"),
    ({"checksum": 2**32}, "checksum 4294967296 is not a 32-bit unsigned integer"),
    ({"name": "a\nb"}, "name 'a\\nb' is not a printable string of at most 256 characters"),
])
def test_header_decode_is_strict(change, problem):
    with pytest.raises(MessageError) as info:
        TensorHeader.decode(json.dumps({**GOOD, **change}).encode())
    assert info.value.problem == problem


@pytest.mark.parametrize("raw, problem", [
    (b'{"v":3,"v":3}', "header is not valid: duplicate key 'v'"),
    (json.dumps({**GOOD, "checksum": float("nan")}).encode(), "header is not valid: non-finite number NaN"),
    (b" " * (MAX_HEADER_BYTES + 1), f"header of {MAX_HEADER_BYTES + 1} bytes exceeds the limit of {MAX_HEADER_BYTES}"),
])
def test_header_decode_rejects_malformed_json(raw, problem):
    with pytest.raises(MessageError) as info:
        TensorHeader.decode(raw)
    assert info.value.problem == problem


def test_header_and_control_encodings_round_trip():
    header, payload = good_message(X, name="layer.0.weight")
    assert header.encode().startswith(b'{"v":%d,"kind":"act",' % PROTOCOL_VERSION)
    assert TensorHeader.decode(header.encode()) == header
    check_payload(header, payload)
    obj = {"op": "stats", "loss": 0.25, "per_stage": [1, 2], "note": "ok"}
    assert decode_control(encode_control(obj)) == obj


# --- timeouts, demultiplexing, control --------------------------------------------------------

def test_timeout_names_the_peer_and_what_was_awaited(mesh):
    a, b = mesh("a", "b")
    with pytest.raises(PeerTimeout) as info:
        b.recv_tensor("a", Expected("grad", 1, 0), timeout=0.2)
    assert str(info.value) == (f"nothing arrived from peer 'a' ({b.address_of('a')}) within 0.2 s "
                               "while waiting for grad stage=1 mb=0")
    with pytest.raises(PeerTimeout) as info:
        b.recv_control(None, timeout=0.1)
    assert str(info.value) == "nothing arrived from any peer within 0.1 s while waiting for a control message"


def test_messages_from_two_peers_are_demultiplexed(mesh):
    a, b, c = mesh("a", "b", "c")
    for mb in range(3):
        a.send_tensor("b", "act", 0, mb, np.full(2, mb, np.float32))
        c.send_tensor("b", "grad", 2, mb, np.full(2, 10 + mb, np.float32))
    # a's messages are queued, yet none of them may satisfy a wait on c, nor be lost by it.
    for mb in range(3):
        assert b.recv_tensor("c", Expected("grad", 2, mb), timeout=5)[1][0] == 10 + mb
    with pytest.raises(PeerTimeout):
        b.recv_tensor("c", Expected("grad", 2, 3), timeout=0.1)
    for mb in range(3):
        assert b.recv_tensor("a", Expected("act", 0, mb), timeout=5)[1][0] == mb


def test_control_messages_keep_their_own_order(mesh):
    a, b, c = mesh("a", "b", "c")
    a.send_control("b", {"op": "start", "n": 1})
    a.send_tensor("b", "act", 0, 0, X)
    c.send_control("b", {"op": "stats", "loss": 0.5})
    a.send_control("b", {"op": "stop"})
    assert b.recv_control("c", timeout=5) == ("c", {"op": "stats", "loss": 0.5})
    assert b.recv_control(None, timeout=5) == ("a", {"op": "start", "n": 1})
    assert np.array_equal(b.recv_tensor("a", Expected("act", 0, 0), timeout=5)[1], X)
    assert b.recv_control(None, timeout=5) == ("a", {"op": "stop"})


# --- hygiene ----------------------------------------------------------------------------------

def test_no_pickle_or_eval_in_the_transport():
    for path in MODULES:
        text = path.read_text().lower()
        for word in ("pickle", "marshal", "shelve", "pyobj", "eval(", "exec("):
            assert word not in text, f"{path.name} mentions {word}"


def test_only_the_zmq_transport_imports_zmq():
    for path in MODULES:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        assert ("zmq" in names) == (path.name == "zeromq.py"), path.name
    code = "import sys, runtime.transport.local; print(sorted(m for m in sys.modules if m.startswith('zmq')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "insecure"])
def test_zmq_drops_what_a_names_old_holder_sent_once_the_name_changes_hands(secure):
    """A re-plan gives a lost worker's position, so its name, to another worker (issue 13: a frozen
    worker thaws and flushes what it had queued). A gradient the old holder sent and nobody took,
    with the very stage and micro-batch the new holder's will carry, must not pass for the new
    holder's; what the old holder sends later is refused; the new holder's is taken."""
    def endpoint(name: str, pair: KeyPair) -> ZmqTransport:
        if not secure:
            return ZmqTransport(name, "tcp://127.0.0.1:0", linger_s=0.2, insecure=True)
        return ZmqTransport(name, "tcp://127.0.0.1:0", keys=pair.curve_keys(), linger_s=0.2)

    pairs = {k: KeyPair.generate(k) for k in ("survivor", "old", "new")}
    survivor, old, new = (endpoint(n, pairs[k]) for n, k in (("stage0", "survivor"), ("stage1", "old"),
                                                              ("stage1", "new")))
    key = {k: pairs[k].public.curve if secure else None for k in pairs}
    try:
        survivor.connect("stage1", old.address, key=key["old"])
        old.connect("stage0", survivor.address, key=key["survivor"])
        old.send_tensor("stage0", "grad", 1, 0, X)
        old.send_control("stage0", {"type": "marker"})  # after the gradient on one connection: it is filed
        assert survivor.recv_control("stage1", timeout=5) == ("stage1", {"type": "marker"})
        survivor.connect("stage1", new.address, key=key["new"])  # the name changes hands
        old.send_tensor("stage0", "grad", 1, 1, 2 * X)
        new.connect("stage0", survivor.address, key=key["survivor"])
        new.send_tensor("stage0", "grad", 1, 0, 3 * X)
        _, got = survivor.recv_tensor("stage1", Expected("grad", 1, 0), timeout=5)
        np.testing.assert_array_equal(got, 3 * X)
        with pytest.raises(PeerTimeout):
            survivor.recv_tensor("stage1", Expected("grad", 1, 1), timeout=0.5)
        assert survivor.refused, "the old holder's late message was not recorded as refused"
    finally:
        for t in (survivor, old, new):
            t.close()


# A big tensor (a stage's weights file: MiniLM's embeddings stage, 45 MiB) arrives in frames of
# PART_BYTES; joined into one buffer, each frame must be let go as it is copied, or the receiver holds
# the tensor twice for a moment (that stage peaked at 1.21x its plan; issue 31 target 3).
_JOIN_CHILD = r"""
import gc, json, sys
import numpy as np
from runtime.keys import KeyPair
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes
from runtime.transport.wire import Expected
from runtime.transport.zeromq import ZmqTransport

pa, pb = KeyPair.generate("a"), KeyPair.generate("b")
a = ZmqTransport("a", "tcp://127.0.0.1:0", keys=pa.curve_keys(), accept={"b": pb.public.curve}, linger_s=5.0)
b = ZmqTransport("b", "tcp://127.0.0.1:0", keys=pb.curve_keys(), accept={"a": pa.public.curve})
a.connect("b", b.address, key=pb.public.curve)
b.connect("a", a.address, key=pa.public.curve)
x = np.arange(int(sys.argv[1]) // 4, dtype=np.float32)
a.send_tensor("b", "act", 0, 0, x)
a.send_control("b", {"sent": 1})
assert b.recv_control("a", timeout=30)[1] == {"sent": 1}  # the tensor, sent before it, is filed by now
a.close()
del x
gc.collect()
release_free_heap()
assert reset_peak_rss()
before = rss_bytes()
_, y = b.recv_tensor("a", Expected("act", 0, 0), timeout=30)
over = peak_rss_bytes() - before
assert np.array_equal(y, np.arange(y.size, dtype=np.float32))
print("JOIN " + json.dumps({"peak_over": over}), flush=True)
b.close()
"""


def test_a_tensor_over_many_frames_is_never_held_twice_while_it_is_joined():
    """Its frames are let go one by one as they are copied into the joined buffer: receiving 48 MiB
    peaks a few MiB above what the frames held (before: the whole tensor more)."""
    size = 48 * PART_BYTES
    proc = subprocess.run([sys.executable, "-c", _JOIN_CHILD, str(size)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    over = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("JOIN "))[5:])["peak_over"]
    assert over < size / 4, f"receiving {size >> 20} MiB peaked {over / 2**20:.1f} MiB above its frames"


def test_a_wait_with_wake_on_side_ends_when_a_side_lane_message_arrives_first(mesh):
    """A worker waiting for a tensor or an order while its snapshot copy ships is woken by a
    side-lane message (a neighbour's chunk to file, its holder's word for more), so neither end looks
    every few ms; without `wake_on_side` the same wait goes on until what it waits for arrives. The
    side message stays in its lane for `take_side`, its frames unjoined."""
    import time

    from runtime.transport.wire import SIDE_KIND

    a, b = mesh("a", "b")
    chunk = np.arange(PART_BYTES // 2, dtype=np.float32).view(np.uint8)  # 2 MiB: 2 frames
    later = threading.Timer(0.3, a.send_tensor, ("b", SIDE_KIND, 0, 1, chunk), {"name": "#bytes|0"})
    later.start()
    start = time.monotonic()
    with pytest.raises(PeerTimeout):
        b.recv_tensor("a", Expected("act", 0, 0), timeout=20, wake_on_side=True)
    assert time.monotonic() - start < 10  # woken by the side message, not at the timeout
    [(header, views)] = b.take_side("a")
    assert header.name == "#bytes|0" and [v.nbytes for v in views] == [PART_BYTES, PART_BYTES]
    assert bytes(views[0]) + bytes(views[1]) == chunk.tobytes()
    # a control wait is woken the same way; a wait without it is not
    later = threading.Timer(0.3, a.send_tensor, ("b", SIDE_KIND, 0, 2, chunk[:10]), {"name": "#bytes|0"})
    later.start()
    with pytest.raises(PeerTimeout):
        b.recv_control("a", timeout=20, wake_on_side=True)
    assert len(b.take_side("a")) == 1
    threading.Timer(0.3, a.send_tensor, ("b", SIDE_KIND, 0, 3, chunk[:10]), {"name": "#bytes|0"}).start()
    threading.Timer(1.0, a.send_tensor, ("b", "act", 0, 0, np.ones(2, np.float32))).start()
    _, got = b.recv_tensor("a", Expected("act", 0, 0), timeout=20)
    assert np.array_equal(got, np.ones(2, np.float32)) and len(b.take_side("a")) == 1
