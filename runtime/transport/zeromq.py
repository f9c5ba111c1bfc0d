"""The ZeroMQ transport between worker and coordinator processes; the only module that imports zmq.

Topology: each endpoint binds one ROUTER socket at its `listen` address and connects one DEALER
socket per peer, with the DEALER's identity set to the endpoint's own name. Every message therefore
reaches the receiver's ROUTER prefixed by the sender's name, which is how the receiver keeps one FIFO
per peer on a single socket. Frames are `[header, payload]` for a tensor and `[control]` for a
control message (the wire format is in `runtime.transport.wire`).

Names move between processes when a re-plan renumbers the pipeline (a worker's name is its stage,
"stage<k>"). Two live sockets under one name at one ROUTER would be ambiguous, so a name changes
hands in order: its holder closes every outgoing socket (`disconnect`, after a last message that
is still delivered) and only then does the next holder connect under it (`rename`, then
`connect`). ROUTER_HANDOVER lets the new connection take the name at once even while the old,
already closed one is still being torn down.

Overlap without a receive thread: ZeroMQ's I/O thread takes messages off the network and queues them
inside the socket while the stage computes, so posting receives early is unnecessary; `recv_tensor`
only drains what already arrived (poller with a timeout) into the per-peer FIFOs. Sends return as
soon as the message is queued; the I/O thread transmits it while the stage computes the next action.

Payloads travel without copies in this process: the array's buffer goes to ZeroMQ with `copy=False`
(pyzmq keeps the array alive until it is sent), and received payload frames are wrapped in place by
`numpy.frombuffer` (see `runtime.transport._array_from_payload` for why the result is read-only).

There is no authentication or encryption: this is for a private network of one's own devices.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

import zmq

from runtime.transport.wire import MAX_PAYLOAD_BYTES, MessageError, PeerTimeout, Transport

# A pipeline keeps at most a few micro-batches in flight per link; the static plan bounds this, so
# the high-water mark is a backstop that must never be what limits a correct plan.
DEFAULT_HWM = 10_000
# Long enough to flush a final stop/stats message on close, short enough that close never hangs on
# a peer that is gone.
DEFAULT_LINGER_S = 2.0
# A send blocks only when a peer's queue is at the high-water mark, i.e. the peer stopped taking
# messages; after this long that is reported instead of hanging the stage.
DEFAULT_SEND_TIMEOUT_S = 300.0


class ZmqTransport(Transport):
    """A `Transport` over ZeroMQ TCP (or ipc/inproc) between named endpoints.

    `listen` is this endpoint's address (`tcp://127.0.0.1:0` or `tcp://host:*` picks a free port;
    the bound address is `.address`); None makes a send-only endpoint. `peers` maps peer names to
    their listen addresses; `connect` adds or moves one later, since the coordinator learns
    addresses at run time, and `disconnect` drops one. `accept` names peers that only send to this
    endpoint. A message from any other identity is a MessageError."""

    def __init__(self, name: str, listen: str | None, peers: dict[str, str] | None = None, *,
                 accept: Iterable[str] = (), hwm: int = DEFAULT_HWM, linger_s: float = DEFAULT_LINGER_S,
                 send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S):
        super().__init__(name)
        self._identity = name.encode("utf-8")
        self._hwm = hwm
        self._linger_ms = int(linger_s * 1000)
        self._send_timeout_s = send_timeout_s
        self._context = zmq.Context(io_threads=1)
        self._peers: dict[str, str] = {}
        self._dealers: dict[str, zmq.Socket] = {}
        self._accepted: set[str] = set(accept)
        self._router: zmq.Socket | None = None
        self.address: str | None = None
        self._closed = False
        try:
            if listen is not None:
                self._router = self._socket(zmq.ROUTER)
                self._router.setsockopt(zmq.RCVHWM, hwm)
                # A worker restarted after a failure reconnects under the same name; let it take over.
                self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
                # No single frame is legally larger than a payload; such a frame is cut off at the wire
                # (the sender is disconnected, and the receiver sees a PeerTimeout) instead of in memory.
                self._router.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
                self._router.bind(re.sub(r"^(tcp://.*):0$", r"\1:*", listen))
                self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            for peer, address in (peers or {}).items():
                self.connect(peer, address)
        except BaseException:
            self.close()
            raise

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        return sock

    def rename(self, name: str) -> None:
        """Take the name peers will know this endpoint by; a worker learns its stage only from the
        coordinator's setup message, so it is named before it opens any outgoing connection.

        Renaming again (a re-plan that moves a worker to another pipeline position) needs every
        outgoing connection closed first (`disconnect`): a receiver tells peers apart only by the
        name their connection carries, so no socket of this endpoint may still speak under the
        old name, which the next holder of that name is about to use."""
        if self._dealers:
            raise RuntimeError(f"transport {self.name!r} still sends to {sorted(self._dealers)} under its old name; "
                               f"disconnect them before renaming it to {name!r}")
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ValueError(f"transport name must be a non-empty printable string, not {name!r}")
        self.name = name
        self._identity = name.encode("utf-8")

    def connect(self, peer: str, address: str) -> None:
        """Send to `peer` at `address` from now on (and accept its messages); moving a peer drops
        whatever was still queued for its old address."""
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        if self._peers.get(peer) == address:
            return
        old = self._dealers.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self._identity)
        dealer.setsockopt(zmq.SNDHWM, self._hwm)
        # Queue for a peer that has not bound yet instead of failing or dropping: processes start in
        # any order.
        dealer.setsockopt(zmq.IMMEDIATE, 0)
        if self._send_timeout_s is not None:
            dealer.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
        dealer.connect(address)
        self._dealers[peer] = dealer
        self._peers[peer] = address

    def disconnect(self, peer: str) -> None:
        """Stop sending to `peer` and forget its address (its messages are refused from now on,
        unless it is an accepted peer). Unlike moving a peer, what is still queued for it is
        delivered (within the linger time): a worker's last word before it gives up its name
        (the coordinator waits for it) goes out this way."""
        dealer = self._dealers.pop(peer, None)
        if dealer is not None:
            dealer.close()
        self._peers.pop(peer, None)

    @property
    def peers(self) -> dict[str, str]:
        return dict(self._peers)

    def address_of(self, peer: str) -> str | None:
        return self._peers.get(peer)

    def _known(self, peer: str) -> bool:
        return peer in self._peers or peer in self._accepted

    def _check_peer(self, peer: str) -> None:
        if self._router is None:
            raise RuntimeError(f"transport {self.name!r} has no listen address and cannot receive")
        if not self._known(peer):
            known = sorted(self._peers.keys() | self._accepted)
            raise ValueError(f"{peer!r} is not a peer of {self.name!r}; known: {known}")

    def _send_frames(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        dealer = self._dealers.get(peer)
        if dealer is None:
            raise ValueError(f"no address for peer {peer!r} of {self.name!r}; call connect() first")
        try:
            dealer.send_multipart(frames, copy=False)
        except zmq.Again:
            raise PeerTimeout(peer, self._peers[peer], "a message", self._send_timeout_s, sending=True) from None

    def _pump(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        if self._router is None:
            raise RuntimeError(f"transport {self.name!r} has no listen address and cannot receive")
        ms = None if timeout is None else math.ceil(timeout * 1000)
        if not self._router.poll(ms, zmq.POLLIN):
            return False
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            self._file(frames)

    def _file(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            peer = identity.decode("utf-8")
        except UnicodeDecodeError:
            peer = None
        if peer is None or not self._known(peer):
            known = ", ".join(repr(p) for p in sorted(self._peers.keys() | self._accepted)) or "none"
            raise MessageError(f"sender is not a known peer; known: {known}",
                               peer=peer if peer is not None else repr(identity),
                               received=f"a message of {len(frames) - 1} frame" + ("s" if len(frames) != 2 else ""))
        # The header is small and parsed at once, so it is copied out; the payload stays in the
        # frame, whose buffer the returned array will reference.
        body = frames[1:]
        if len(body) == 2:
            self._accept(peer, [body[0].bytes, body[1].buffer])
        elif len(body) == 1:
            self._accept(peer, [body[0].bytes])
        else:
            self._accept(peer, body)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in [*self._dealers.values(), self._router]:
            if sock is not None:
                sock.close()
        self._dealers.clear()
        # Every socket has a finite LINGER, so term waits at most that long for unsent messages.
        self._context.term()
