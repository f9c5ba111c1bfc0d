"""The ZeroMQ transport between worker and coordinator processes; the only module that imports zmq.

Topology: each endpoint binds one ROUTER socket at its `listen` address and connects one DEALER
socket per peer, with the DEALER's routing id set to the endpoint's own name (plus a random tag,
see below). Every message therefore reaches the receiver's ROUTER prefixed by the sender's name,
which is how the receiver keeps one FIFO per peer on a single socket. Frames are `[header, payload]`
for a tensor and `[control]` for a control message (the wire format is in `runtime.transport.wire`).

Security (DESIGN.md, "Contracts added for LLMs, LoRA and faults"). With `keys` every socket speaks
CURVE (libzmq's elliptic-curve handshake, then every frame encrypted and authenticated): the ROUTER
is a CURVE server, each DEALER a CURVE client that must know its peer's public key. A ZAP handler
(a thread answering libzmq's authentication requests for this endpoint's context) admits a
connection only when its client key is the key of a peer this endpoint knows (`connect`ed, or
`accept`ed with its key), and tags it with that key; a message is then filed under its sender's
name only if the name is bound to exactly that key. Everything else (no key, a wrong key, a known
name over another peer's key, ZMTP/1.0 or HTTP bytes, which libzmq refuses outright once ZAP is on)
is dropped and recorded in `refused` and the log, never raised: a stranger cannot stop a run.
A message from an authenticated peer that does not parse is still a MessageError, as before.
`insecure=True` runs the same sockets in plaintext (the NULL mechanism, ZAP still on so ZMTP/1.0
peers are refused and unknown names are dropped), for a network of one's own where nobody else
can connect; the command line prints a warning when it is chosen.

Names move between processes when a re-plan renumbers the pipeline (a worker's name is its stage,
"stage<k>"). Two live connections under one name at one ROUTER would be ambiguous, so a name
changes hands in order: its holder closes every outgoing socket (`disconnect`, after a last
message that is still delivered) and only then does the next holder connect under it (`rename`,
then `connect`). Each DEALER's routing id is the name, a NUL and a random tag, so the new holder's
connection never collides with the old one still being torn down (the receiver files by the name
alone), and no connection can take over another's routing id.

Failure detection: every socket sends ZMTP heartbeats (PING/PONG, answered by libzmq's I/O thread,
so a stage busy computing, even holding the GIL, still answers); a peer that answers nothing for
0.8 x `heartbeat_s` is disconnected by libzmq. A monitor on each DEALER reports connects and
disconnects; `lost_peers` names every peer whose link has been down longer than `heartbeat_s / 10`
(a killed process: its socket closes at once; a stopped one: its heartbeats stop), so a dead or
frozen peer is found within about `heartbeat_s` of going silent. A PING shares its connection with
the data, so it waits behind the message being written (one tensor); on a link too slow to carry
the largest tensor within 0.8 x `heartbeat_s`, raise it (`--failure-timeout`).

Reconnects: libzmq reconnects a dropped link every 100 ms, and gives up a TCP connect not answered
within `connect_timeout_s` (1 s, or a third of `heartbeat_s` if more) to start another, so a peer
whose network heals is reached within about that long, even where the outage lost the SYNs
silently (the kernel alone would back off for minutes).

Overlap without a receive thread: ZeroMQ's I/O thread takes messages off the network and queues them
inside the socket while the stage computes, so posting receives early is unnecessary; `recv_tensor`
only drains what already arrived (poller with a timeout) into the per-peer FIFOs. Sends return as
soon as the message is queued; the I/O thread transmits it while the stage computes the next action.

Frame size: no legal frame is larger than `wire.MAX_FRAME_BYTES` (1 MiB: payloads go in parts), so
every socket refuses bigger ones at the wire (`MAX_WIRE_FRAME_BYTES`): a peer that sends one, or
only declares one (a stranger before its CURVE HELLO), is disconnected, at a cost of at most one
frame's memory per connection; a receiver sees nothing of it (a PeerTimeout if it waits).

Addresses are `tcp://HOST:PORT` (`ir.address`), checked before any socket uses them: a bad one is
a ValueError that names it, and a connect that fails anyway closes its socket, so `close` never
waits on a socket left open.

Payloads travel without copies in this process: the array's buffer goes to ZeroMQ with `copy=False`
(pyzmq keeps the array alive until it is sent), and received payload frames are wrapped in place by
`numpy.frombuffer` (see `runtime.transport._array_from_payload` for why the result is read-only).
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from ir.address import AddressError, parse_address
from runtime.transport.security import CurveKeys, RefusalLog, check_curve_key
from runtime.transport.wire import MAX_FRAME_BYTES, LostPeer, PeerTimeout, Transport

# A pipeline keeps at most a few micro-batches in flight per link; the static plan bounds this, so
# the high-water mark is a backstop that must never be what limits a correct plan.
DEFAULT_HWM = 10_000
# Long enough to flush a final stop/stats message on close, short enough that close never hangs on
# a peer that is gone.
DEFAULT_LINGER_S = 2.0
# messages at least this large are sent tracked (`wait_sent`); smaller ones are copied by ZeroMQ anyway
_TRACKED_BYTES = 1 << 20
# A send blocks only when a peer's queue is at the high-water mark, i.e. the peer stopped taking
# messages; after this long that is reported instead of hanging the stage.
DEFAULT_SEND_TIMEOUT_S = 300.0
# A silent peer is reported lost within this many seconds (ZMTP heartbeats; see the docstring).
DEFAULT_HEARTBEAT_S = 3.0
# A connect not answered within this long (at least) is made again (see `_link`).
MIN_CONNECT_TIMEOUT_S = 1.0
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"confidant"
_TAG_BYTES = 6
# Under CURVE a frame crosses as a MESSAGE command (RFC 26): the command's name with its length byte
# (8 bytes), an 8-byte nonce, then the frame behind its flags byte, boxed with a 16-byte MAC.
_CURVE_FRAME_OVERHEAD = len(b"\x07MESSAGE") + 8 + 1 + 16
# libzmq checks every frame's declared size against ZMQ_MAXMSGSIZE as the frame starts to arrive,
# before it reserves memory for it and before the handshake is done; a bigger one drops the
# connection. So no peer, authenticated or not, makes an endpoint buffer more than this per connection.
MAX_WIRE_FRAME_BYTES = MAX_FRAME_BYTES + _CURVE_FRAME_OVERHEAD
_DEALER_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_CLOSED)
_ROUTER_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


NOT_CONNECTED_YET = "no connection yet"  # a link's problem before its first handshake


def _send_tracked(dealer, frames) -> object | None:
    """Send one multipart message without copies; the tracker of its last frame that ZeroMQ holds
    (a frame under pyzmq's copy threshold is copied, its tracker done at once), or None."""
    last = None
    for i, frame in enumerate(frames):
        tracker = dealer.send(frame, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False, track=True)
        if tracker is not None and not tracker.done:
            last = tracker
    return last


@dataclass
class _Link:
    """One outgoing connection: its socket, its monitor, and whether the peer is reachable."""

    dealer: zmq.Socket
    monitor: zmq.Socket
    up: bool = False
    down_since: float = 0.0
    ever_up: bool = False
    problem: str = NOT_CONNECTED_YET


class _ZapHandler(threading.Thread):
    """Answers libzmq's ZAP requests for one context: a CURVE client is admitted only with a key in
    `allowed()`, and tagged with it (its User-Id is the key's hex); NULL is admitted only when the
    transport is insecure. Refusals go to the transport's RefusalLog."""

    def __init__(self, context: zmq.Context, owner: str, allowed, insecure: bool, refusals: RefusalLog):
        super().__init__(name=f"confidant-zap-{owner}", daemon=True)
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(_ZAP_ENDPOINT)
        self._allowed, self._insecure, self._refusals = allowed, insecure, refusals
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._socket.poll(100):
                    continue
                request = self._socket.recv_multipart()
                self._socket.send_multipart(self._answer(request))
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        source = address.decode("ascii", "replace") or "an unknown address"
        if mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
            key = credentials[0]
            if key in self._allowed():
                return [version, request_id, b"200", b"OK", key.hex().encode("ascii"), b""]
            self._refusals.add(source, f"CURVE key {key.hex()[:12]}...", "not the key of any peer of this endpoint")
            return [version, request_id, b"400", b"unknown key", b"", b""]
        if mechanism == b"NULL" and self._insecure:
            return [version, request_id, b"200", b"OK", b"", b""]
        self._refusals.add(source, f"a {mechanism.decode('ascii', 'replace')} connection",
                           "this endpoint speaks CURVE only" if not self._insecure else "unsupported mechanism")
        return [version, request_id, b"400", b"refused", b"", b""]

    def stop(self) -> None:
        self._stopping.set()
        self.join(5.0)


class ZmqTransport(Transport):
    """A `Transport` over ZeroMQ TCP (or ipc/inproc) between named endpoints.

    `listen` is this endpoint's address (`tcp://127.0.0.1:0` or `tcp://host:*` picks a free port;
    the bound address is `.address`); None makes a send-only endpoint. `peers` maps peer names to
    their listen addresses; `connect` adds or moves one later, since the coordinator learns
    addresses at run time, and `disconnect` drops one. `accept` names peers that only send to this
    endpoint (a mapping name -> CURVE public key when secure). A message from any other name, or
    over a connection authenticated with another key, is dropped and recorded in `refused`.

    Exactly one of `keys` (this endpoint's CURVE key pair; every peer then needs its key,
    `peer_keys` or `connect(..., key=)`) and `insecure=True` must be given."""

    def __init__(self, name: str, listen: str | None, peers: dict[str, str] | None = None, *,
                 keys: CurveKeys | None = None, insecure: bool = False,
                 peer_keys: Mapping[str, bytes] | None = None,
                 accept: Iterable[str] | Mapping[str, bytes | None] = (), hwm: int = DEFAULT_HWM,
                 linger_s: float = DEFAULT_LINGER_S, send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S,
                 heartbeat_s: float | None = DEFAULT_HEARTBEAT_S):
        super().__init__(name)
        if listen is not None:
            try:
                parse_address(listen, listen=True)
            except AddressError as exc:
                raise ValueError(f"transport {name!r}: listen address {exc}") from None
        if (keys is None) == (not insecure):
            raise ValueError(f"transport {name!r}: give CURVE keys (keys=CurveKeys, see runtime.keys) or, on a "
                             f"network nobody else can reach, insecure=True; not {'both' if keys else 'neither'}")
        self.secure = keys is not None
        self.authenticated = self.secure  # CURVE: every message's bytes authenticated by its MAC
        self._keys = keys
        self._hwm = hwm
        self._linger_ms = int(linger_s * 1000)
        self._send_timeout_s = send_timeout_s
        self._last_tracker: dict[str, object] = {}  # peer -> the last large message's (`wait_sent`)
        self.heartbeat_s = heartbeat_s
        # a TCP handshake is one round trip; a third of the heartbeat time leaves slow links (raised
        # --failure-timeout) their margin, and 1 s (the kernel's first SYN retry) is the floor
        self.connect_timeout_s = max(MIN_CONNECT_TIMEOUT_S, (heartbeat_s or DEFAULT_HEARTBEAT_S) / 3)
        self._context = zmq.Context(io_threads=1)
        self._send_lock = threading.Lock()
        self._peers: dict[str, str] = {}
        self._links: dict[str, _Link] = {}
        self._bound: dict[str, bytes | None] = {}   # peer name -> the key its messages must carry
        self._accepted: set[str] = set()
        self._allowed_keys: frozenset[bytes] = frozenset()
        self.refusals = RefusalLog(f"transport {name!r}")
        self._router: zmq.Socket | None = None
        self._router_monitor: zmq.Socket | None = None
        self._zap: _ZapHandler | None = None
        self._poll: zmq.Poller | None = None  # rebuilt when links change
        self._routing_ids: dict[str, set[bytes]] = {}  # peer name -> the connections it has sent over
        self._retired: set[bytes] = set()  # connections never to be heard again (`retire`)
        self.address: str | None = None
        self._closed = False
        try:
            if isinstance(accept, Mapping):
                items = list(accept.items())
            else:
                items = [(p, None) for p in accept]
            for peer, key in items:
                self._bind_name(peer, key)
                self._accepted.add(peer)
            if listen is not None:
                self._zap = _ZapHandler(self._context, name, lambda: self._allowed_keys, insecure, self.refusals)
                self._zap.start()
                self._router = self._socket(zmq.ROUTER)
                self._router.setsockopt(zmq.RCVHWM, hwm)
                self._router.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
                if self.secure:
                    self._router.setsockopt(zmq.CURVE_SERVER, 1)
                    self._router.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
                    self._router.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                self._router_monitor = self._router.get_monitor_socket(_ROUTER_EVENTS)
                try:
                    self._router.bind(re.sub(r"^(tcp://.*):0$", r"\1:*", listen))
                except zmq.ZMQError as exc:
                    raise ValueError(f"transport {name!r} cannot listen at {listen!r}: "
                                     f"{zmq.strerror(exc.errno)}") from None
                self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            for peer, address in (peers or {}).items():
                self.connect(peer, address, key=(peer_keys or {}).get(peer))
        except BaseException:
            self.close()
            raise

    # --- sockets ---------------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        # every socket, DEALERs too: a "peer" this endpoint connects to may be anyone at that address
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME_BYTES)
        if self.heartbeat_s is not None:
            # A PING waits behind the message being written on its connection (one tensor: a weight
            # shard at most), so the timeout is most of heartbeat_s, not a small part of it.
            ms = int(self.heartbeat_s * 1000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, ms // 10))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms * 8 // 10)
            sock.setsockopt(zmq.HEARTBEAT_TTL, ms * 8 // 10)
        return sock

    def _bind_name(self, peer: str, key: bytes | None) -> None:
        if self.secure:
            self._bound[peer] = check_curve_key(key, f"peer {peer!r} of {self.name!r} (a secure transport needs "
                                                     f"every peer's public key)")
        else:
            self._bound[peer] = None
        self._allowed_keys = frozenset(k for k in self._bound.values() if k is not None)

    def _unbind_name(self, peer: str) -> None:
        if peer not in self._accepted:
            self._bound.pop(peer, None)
        self._allowed_keys = frozenset(k for k in self._bound.values() if k is not None)

    def rename(self, name: str) -> None:
        """Take the name peers will know this endpoint by; a worker learns its stage only from the
        coordinator's setup message, so it is named before it opens any outgoing connection.

        Renaming again (a re-plan that moves a worker to another pipeline position) needs every
        outgoing connection closed first (`disconnect`): a receiver tells peers apart only by the
        name their connection carries, so no socket of this endpoint may still speak under the
        old name, which the next holder of that name is about to use."""
        if self._peers:
            raise RuntimeError(f"transport {self.name!r} still sends to {sorted(self._peers)} under its old name; "
                               f"disconnect them before renaming it to {name!r}")
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ValueError(f"transport name must be a non-empty printable string, not {name!r}")
        self.name = name

    def connect(self, peer: str, address: str, key: bytes | None = None) -> None:
        """Send to `peer` at `address` from now on, and accept its messages (over a connection
        authenticated with `key`, its CURVE public key, when secure); moving a peer drops whatever
        was still queued for its old address."""
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        try:
            parse_address(address)
        except AddressError as exc:
            raise ValueError(f"transport {self.name!r}: peer {peer!r}: address {exc}") from None
        if self._peers.get(peer) == address and self._bound.get(peer) == (key if self.secure else None):
            return
        old_address, old_key = self._peers.get(peer), self._bound.get(peer)
        if (old_address is not None and old_address != address) or (
                self.secure and old_key is not None and old_key != key):
            # The name changes hands (a re-plan gives a lost or released worker's position to
            # another): whatever its old holder sent that was not taken, or is still on its way (a
            # frozen process that thaws flushes its queue), is of a pipeline that went on without
            # it and would pass for the new holder's (same name, stage and micro-batch)
            self.retire(peer)
            self.discard(peer)
        self._bind_name(peer, key)
        old = self._links.pop(peer, None)
        if old is not None:
            self._close_link(old, linger=0)
        self._peers[peer] = address

    def _link(self, peer: str) -> _Link:
        """The connection to `peer`, opened on first use: a worker connects to a neighbour only when
        it first sends to it, which the plan puts after every stage's setup, so the neighbour
        already admits this endpoint's key (connecting earlier would be refused as a stranger)."""
        link = self._links.get(peer)
        if link is not None:
            return link
        if peer not in self._peers:
            raise ValueError(f"no address for peer {peer!r} of {self.name!r}; call connect() first")
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.name.encode("utf-8") + b"\0" + os.urandom(_TAG_BYTES).hex().encode())
        dealer.setsockopt(zmq.SNDHWM, self._hwm)
        # Queue for a peer that has not bound yet instead of failing or dropping: processes start in
        # any order.
        dealer.setsockopt(zmq.IMMEDIATE, 0)
        # A connect whose SYNs are lost on the way (an outage past a switch or router: nothing tells
        # the sender) waits on the kernel's SYN back-off, 1 s apart five times, then 2, 4, 8, 16, 32 s
        # (older kernels back off from the first), for up to ~2 min before libzmq tries again: a lost
        # device's call back could reach it only seconds or minutes after its network healed (issue
        # 32). Given up after a moment instead, a connect is made afresh every connect_timeout_s.
        dealer.setsockopt(zmq.CONNECT_TIMEOUT, int(self.connect_timeout_s * 1000))
        if self.secure:
            dealer.setsockopt(zmq.CURVE_SERVERKEY, self._bound[peer])
            dealer.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.public)
            dealer.setsockopt(zmq.CURVE_SECRETKEY, self._keys.secret)
        if self._send_timeout_s is not None:
            dealer.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
        monitor = dealer.get_monitor_socket(_DEALER_EVENTS)
        link = _Link(dealer, monitor, down_since=time.monotonic())
        try:
            dealer.connect(self._peers[peer])
        except zmq.ZMQError as exc:
            # closed at once: an open socket would keep `close` (the context's term) waiting forever
            self._close_link(link, linger=0)
            raise ValueError(f"transport {self.name!r} cannot connect to peer {peer!r} at "
                             f"{self._peers[peer]!r}: {zmq.strerror(exc.errno)}") from None
        self._links[peer] = link
        self._poll = None
        return link

    def _close_link(self, link: _Link, linger: int | None = None) -> None:
        self._poll = None
        try:
            link.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        link.monitor.close(linger=0)
        link.dealer.close(linger=linger)

    def disconnect(self, peer: str, deliver_queued: bool = True) -> None:
        """Stop sending to `peer` and forget its address (its messages are refused from now on,
        unless it is an accepted peer). Unlike moving a peer, what is still queued for it is
        delivered (within the linger time): a worker's last word before it gives up its name
        (the coordinator waits for it) goes out this way. With `deliver_queued` False (a lost
        peer) the queue is dropped, so a process that comes back at that address within the
        linger time is not handed orders of the pipeline that lost it."""
        link = self._links.pop(peer, None)
        if link is not None:
            self._close_link(link, linger=None if deliver_queued else 0)
        self._peers.pop(peer, None)
        self._unbind_name(peer)

    def retire(self, peer: str) -> None:
        """See Transport.retire: every routing id `peer` has sent under (a name, a NUL and the random
        tag of one DEALER) is refused from now on; a new connection has a new tag."""
        self._pump(0)  # what already arrived is filed first, so its connection is known
        self._retired |= self._routing_ids.pop(peer, set())

    @property
    def peers(self) -> dict[str, str]:
        return dict(self._peers)

    @property
    def refused(self) -> list:
        return self.refusals.snapshot()

    def address_of(self, peer: str) -> str | None:
        return self._peers.get(peer)

    def _check_peer(self, peer: str) -> None:
        if self._router is None:
            raise RuntimeError(f"transport {self.name!r} has no listen address and cannot receive")
        if peer not in self._bound:
            raise ValueError(f"{peer!r} is not a peer of {self.name!r}; known: {sorted(self._bound)}")

    # --- liveness --------------------------------------------------------------------------------

    def _drain_monitors(self) -> None:
        now = time.monotonic()
        for link in self._links.values():
            while link.monitor.poll(0):
                event = recv_monitor_message(link.monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up, link.ever_up, link.problem = True, True, ""
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    if link.up:
                        link.up, link.down_since = False, now
                    link.problem = "its connection closed" if link.ever_up else link.problem
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    link.problem = "it refused this endpoint's key (is it another cluster's, or has the key changed?)"
                elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                    link.problem = ("the CURVE handshake failed (is this the peer's public key, and does it speak "
                                    "CURVE?)" if self.secure else "the handshake failed (does it run --insecure too?)")
        self._drain_router_monitor()

    def _drain_router_monitor(self) -> None:
        """Log handshakes refused by libzmq itself (ZMTP/1.0 or HTTP bytes, a broken CURVE hello)."""
        if self._router_monitor is not None:
            while self._router_monitor.poll(0):
                recv_monitor_message(self._router_monitor)
                self.refusals.add("a peer", "a connection", "its handshake failed (not ZMTP 3"
                                  + (" with CURVE)" if self.secure else ")"))

    def lost_peers(self, grace_s: float | None = None) -> dict[str, LostPeer]:
        """Connected peers whose link has been down for more than `grace_s` (default
        `heartbeat_s / 10`): killed, frozen, unreachable, or refusing this endpoint's key. A link
        that has not come up yet, with nothing refused, gets `heartbeat_s` at least: a peer on a
        busy machine may take more than a tenth of it to answer its first handshake."""
        if self._closed or self.heartbeat_s is None:
            return {}
        self._drain_monitors()
        grace = self.heartbeat_s / 10 if grace_s is None else grace_s
        now = time.monotonic()
        lost = {}
        for peer, link in self._links.items():
            pending = not link.ever_up and link.problem == NOT_CONNECTED_YET  # nothing refused, just not up yet
            if not link.up and now - link.down_since > (max(grace, self.heartbeat_s) if pending else grace):
                reason = link.problem if link.problem else "its connection closed"
                if link.ever_up and link.problem == "its connection closed":
                    reason = "its connection closed or its heartbeats stopped (killed, frozen or unreachable)"
                lost[peer] = LostPeer(peer, self._peers[peer], now - link.down_since, reason, link.ever_up)
        return lost

    # --- frames ----------------------------------------------------------------------------------

    def open(self, peer: str) -> None:
        self._link(peer)

    def _send_frames(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        link = self._link(peer)
        try:
            # a second thread may send to a peer whose connection exists (`Transport.open`): a
            # ZeroMQ socket is not safe to use from two threads at once, so sends take turns
            with self._send_lock:
                if sum(memoryview(f).nbytes for f in frames) < _TRACKED_BYTES:
                    link.dealer.send_multipart(frames, copy=False)
                else:  # a large message: `wait_sent` can wait for ZeroMQ to let go of its buffers
                    self._last_tracker[peer] = _send_tracked(link.dealer, frames)
        except zmq.Again:
            raise PeerTimeout(peer, self._peers[peer], "a message", self._send_timeout_s, sending=True) from None

    def wait_sent(self, peer: str) -> None:
        # the last large message's frames released by ZeroMQ (encrypted and handed to the socket's
        # encoder): every earlier message to `peer` went through the same pipe before it
        tracker = self._last_tracker.pop(peer, None)
        if tracker is None:
            return
        try:
            tracker.wait(-1 if self._send_timeout_s is None else self._send_timeout_s)
        except zmq.NotDone:
            raise PeerTimeout(peer, self._peers.get(peer), "a message", self._send_timeout_s, sending=True) from None

    def _pump(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        if self._router is None:
            raise RuntimeError(f"transport {self.name!r} has no listen address and cannot receive")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Monitors wake the wait too, so a link's state changes are timestamped as they happen.
            self._drain_monitors()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ms = None if remaining is None else math.ceil(remaining * 1000)
            ready = dict(self._poller().poll(ms))
            if self._router not in ready:
                if deadline is not None and time.monotonic() >= deadline:
                    self._drain_monitors()
                    return False
                continue
            filed = False
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                filed = self._file(frames) or filed
            # only strangers' messages arrived: keep waiting, as if nothing had
            if filed or (deadline is not None and time.monotonic() >= deadline):
                return filed

    def _poller(self) -> zmq.Poller:
        if self._poll is None:
            self._poll = zmq.Poller()
            for sock in [self._router, self._router_monitor, *(link.monitor for link in self._links.values())]:
                if sock is not None:
                    self._poll.register(sock, zmq.POLLIN)
        return self._poll

    def _file(self, frames: list[zmq.Frame]) -> bool:
        """File one message under its sender, or drop it (False) when the sender is a stranger."""
        routing = frames[0].bytes
        name, _, _tag = routing.partition(b"\0")
        try:
            peer = name.decode("utf-8")
        except UnicodeDecodeError:
            peer = None
        if peer is None or peer not in self._bound:
            self.refusals.add(self._source(frames), f"a message from {name[:40]!r}", "no such peer")
            return False
        if routing in self._retired:
            self.refusals.add(self._source(frames), f"a message from {peer!r}",
                              "it came over a connection of a lost peer, retired")
            return False
        if self.secure:
            key = self._bound[peer]
            user = frames[-1].get("User-Id") if len(frames) > 1 else ""
            if key is None or user != key.hex():
                self.refusals.add(self._source(frames), f"a message under the name {peer!r}",
                                  "its connection is not authenticated with that peer's key")
                return False
        self._routing_ids.setdefault(peer, set()).add(routing)
        # The header is small and parsed at once, so it is copied out; the payload stays in the
        # frame, whose buffer the returned array will reference.
        body = frames[1:]
        if len(body) == 1:
            self._accept(peer, [body[0].bytes])
        elif body:
            self._accept(peer, [body[0].bytes, *(f.buffer for f in body[1:])])
        else:
            self._accept(peer, body)
        return True

    @staticmethod
    def _source(frames: list[zmq.Frame]) -> str:
        try:
            return frames[-1].get("Peer-Address") or "an unknown address"
        except (zmq.ZMQError, AttributeError):
            return "an unknown address"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            self._close_link(link)
        self._links.clear()
        if self._router_monitor is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
            self._router_monitor.close(linger=0)
        if self._router is not None:
            self._router.close()
        if self._zap is not None:
            self._zap.stop()
        # Every socket has a finite LINGER, so term waits at most that long for unsent messages.
        self._context.term()
