"""`link_probe_server` / `measure_link` measure a link: round trips of tensors through the real
ZeroMQ transport (headers, checksums and all) between this process and a peer.
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from ir.profile import Link
from runtime.transport.wire import Expected, MessageError, PeerTimeout

# Links ----------------------------------------------------------------------------------------

PROBE_SERVER = "link-probe-server"
PROBE_CLIENT = "link-probe-client"
_PROBE_KIND = "probe"
_MAX_PROBE_COUNT = 10_000
_MAX_PROBE_BYTES = 1 << 30


def link_from_round_trips(round_trips_s: Mapping[int, float]) -> Link:
    """A Link from median round-trip seconds per payload size (bytes): one way takes half a round
    trip; latency is the smallest message's one-way time less its bytes' share, bandwidth the
    slope between the smallest and the largest message, so `Link.transfer_s` reproduces both."""
    sizes = sorted(round_trips_s)
    if len(sizes) < 2 or sizes[0] == sizes[-1]:
        raise ValueError(f"a link needs round trips of at least two sizes, got {sizes}")
    small, large = sizes[0], sizes[-1]
    t_small, t_large = round_trips_s[small] / 2, round_trips_s[large] / 2
    if t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
    else:  # timing noise swamped the payload: the large message's own rate is a lower bound
        bandwidth = large / max(t_large, 1e-9)
    latency = max(0.0, t_small - small / bandwidth)
    return Link(bandwidth, latency)


def _probe_expected(i: int, nbytes: int) -> Expected:
    return Expected(_PROBE_KIND, -1, i, shape=(nbytes,), dtype="uint8")


def link_probe_server(listen: str, *, sessions: int | None = 1, ready: Callable[[str], None] | None = None,
                      timeout_s: float = 60.0) -> None:
    """Echo the tensors of `measure_link` clients, one client at a time, for `sessions` clients
    (None: forever). `ready` receives the bound address (useful with port 0)."""
    from runtime.transport.zeromq import ZmqTransport

    # Plaintext on purpose: a probe carries random bytes only, and it measures the link itself; the
    # transport still drops strangers' messages (never fatal) and refuses ZMTP/1.0 peers.
    with ZmqTransport(PROBE_SERVER, listen, accept=(PROBE_CLIENT,), insecure=True) as t:
        if ready is not None:
            ready(t.address)
        served = 0
        while sessions is None or served < sessions:
            _, hello = t.recv_control(PROBE_CLIENT, timeout=None)
            if hello.get("probe") != "hello" or not isinstance(hello.get("address"), str):
                continue
            t.connect(PROBE_CLIENT, hello["address"])
            t.send_control(PROBE_CLIENT, {"probe": "ready"})
            try:
                _echo_session(t, timeout_s)
            except (PeerTimeout, MessageError):
                pass  # a client that vanished or garbled its messages ends only its own session
            served += 1


def _echo_session(t, timeout_s: float) -> None:
    while True:
        _, msg = t.recv_control(PROBE_CLIENT, timeout=timeout_s)
        if msg.get("probe") != "echo":
            t.send_control(PROBE_CLIENT, {"probe": "bye"})
            return
        count, nbytes = msg.get("count"), msg.get("bytes")
        if (not isinstance(count, int) or not isinstance(nbytes, int) or not 1 <= count <= _MAX_PROBE_COUNT
                or not 1 <= nbytes <= _MAX_PROBE_BYTES):
            t.send_control(PROBE_CLIENT, {"probe": "bye", "error": "bad echo request"})
            return
        for i in range(count):
            _, arr = t.recv_tensor(PROBE_CLIENT, _probe_expected(i, nbytes), timeout=timeout_s)
            t.send_tensor(PROBE_CLIENT, _PROBE_KIND, -1, i, arr)


def _local_listen_towards(address: str) -> str:
    """A listen address on the interface this host uses to reach `address` (tcp only)."""
    if not address.startswith("tcp://"):
        raise ValueError(f"cannot guess a reply address for {address!r}; pass listen=")
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "tcp://127.0.0.1:0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return f"tcp://{s.getsockname()[0]}:0"
    except OSError:
        return f"tcp://{socket.gethostname()}:0"


def measure_link(address: str, sizes: Sequence[int] = (1 << 10, 1 << 20, 8 << 20), reps: int = 5, *,
                 listen: str | None = None, timeout_s: float = 30.0) -> Link:
    """Bandwidth and latency to the `link_probe_server` at `address`, by ping-pong over ZeroMQ.

    Each size makes one warm-up and `reps` timed round trips; `link_from_round_trips` turns the
    medians into a Link. The payload crosses the real transport (header, crc32 on both sides), so
    the figures are what pipeline transfers will see. `listen` is where the server sends replies
    (default: this host's address on the route to the server, on a free port)."""
    from runtime.transport.zeromq import ZmqTransport

    sizes = sorted({int(n) for n in sizes})
    if len(sizes) < 2 or sizes[0] < 1 or sizes[-1] > _MAX_PROBE_BYTES:
        raise ValueError(f"measure_link needs at least two distinct sizes in 1..{_MAX_PROBE_BYTES} bytes, got {sizes}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    listen = listen or _local_listen_towards(address)
    round_trips: dict[int, float] = {}
    with ZmqTransport(PROBE_CLIENT, listen, {PROBE_SERVER: address}, insecure=True) as t:  # see link_probe_server
        t.send_control(PROBE_SERVER, {"probe": "hello", "address": t.address})
        _, reply = t.recv_control(PROBE_SERVER, timeout=timeout_s)
        if reply.get("probe") != "ready":
            raise RuntimeError(f"link probe server at {address} answered {reply!r} instead of ready")
        for nbytes in sizes:
            payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
            t.send_control(PROBE_SERVER, {"probe": "echo", "count": reps + 1, "bytes": nbytes})
            times = []
            for i in range(reps + 1):
                start = time.perf_counter()
                t.send_tensor(PROBE_SERVER, _PROBE_KIND, -1, i, payload)
                t.recv_tensor(PROBE_SERVER, _probe_expected(i, nbytes), timeout=timeout_s)
                times.append(time.perf_counter() - start)
            round_trips[nbytes] = statistics.median(times[1:])
        t.send_control(PROBE_SERVER, {"probe": "stop"})
        t.recv_control(PROBE_SERVER, timeout=timeout_s)
    return link_from_round_trips(round_trips)
