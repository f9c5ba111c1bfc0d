"""An in-process transport: a whole multi-stage plan runs in one test process, one thread per stage.

This is the fake hardware of DESIGN.md habit 9. It moves the same frames as the ZeroMQ transport
(encoded header bytes plus payload bytes) and the receiver decodes and checks them through the same
`Transport` code, so garbling, ordering and timeout behaviour tested here is the behaviour on the
network. Payloads are copied into immutable bytes on send, as a network would, so sender and
receiver never share memory.

Topology, as in `runtime.transport.zeromq`: each endpoint has an address (`local://...`) where its
inbox lives (the ROUTER), and `connect(peer, address)` makes sends to `peer` go to that inbox (a
DEALER). Every message is filed at the receiver under the sender's name at the time it was sent
(the DEALER's identity), so the unchanged Worker and Coordinator run over it: a worker starts
nameless ("worker") at its own address, receives whatever the coordinator sends to the peer name it
connected that address under, takes its stage name with `rename` before it opens any connection,
and gives it up by closing every connection (`disconnect`) before the next holder takes it.

An endpoint that never calls `connect` is in a full mesh by name instead: a message to `peer` goes
to the inbox at `local://<peer>`, where a `LocalTransport(peer, hub)` lives by default (the
sequential replay, `runtime.pipeline.local_replay`, and the transport tests use this). Once an
endpoint has connected anything it sends, like a ZeroMQ endpoint, only to the peers it is connected
to, so a message along a link the plan does not have fails at once instead of vanishing.

Receivers take messages from any endpoint of their hub: in one process the hub is the trust
boundary, so there is no equivalent of ZeroMQ refusing an unknown identity, and keys given to
`connect` are ignored.

Liveness, as ZeroMQ's heartbeats report it: a connected peer whose address was bound on the hub
and no longer is (its endpoint closed: the in-process twin of a killed worker process) is reported
by `lost_peers` once it has been gone longer than the grace time.

`close` may be called from another thread than the endpoint's own: it wakes a receive that is
waiting, which then raises, so a harness can end stage threads that wait for a neighbour which will
never send (the in-process twin of terminating a worker process).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

from runtime.transport.wire import LostPeer, Transport

# How long a peer is gone before it is lost. ZeroMQ's grace covers a link that drops and comes back
# at once; an in-process endpoint that closed is gone for good the moment it closes, so a short wait
# only keeps the order of events (what it sent before closing is filed first).
DEFAULT_GRACE_S = 0.05

# What `close` puts into an endpoint's own inbox to wake a receive waiting on it.
_CLOSED = object()


class LocalHub:
    """Inboxes by address, shared by every LocalTransport of one simulated cluster; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.SimpleQueue] = {}
        self._claimed: set[str] = set()
        self._gone: dict[str, float] = {}  # address -> when its endpoint closed

    def _inbox(self, address: str) -> queue.SimpleQueue:
        # Created on first use by either side: stage threads start in any order, and a message to an
        # endpoint that is not bound yet waits for it, as ZeroMQ queues for a peer not yet up.
        with self._lock:
            return self._inboxes.setdefault(address, queue.SimpleQueue())

    def register(self, address: str) -> queue.SimpleQueue:
        """Bind `address`: its inbox, which no other endpoint may hold while this one does."""
        with self._lock:
            if address in self._claimed:
                raise ValueError(f"a local transport is already bound at {address!r} on this hub")
            self._claimed.add(address)
            self._gone.pop(address, None)
        return self._inbox(address)

    def unregister(self, address: str) -> None:
        """Unbind `address`; what was still in its inbox goes with it, as with a closed ROUTER."""
        with self._lock:
            if address in self._claimed:
                self._gone[address] = time.monotonic()
            self._claimed.discard(address)
            self._inboxes.pop(address, None)

    def drop_unclaimed(self, address: str) -> None:
        """Drop what waits at `address` when no endpoint is bound there."""
        with self._lock:
            if address not in self._claimed:
                self._inboxes.pop(address, None)

    def gone_since(self, address: str) -> float | None:
        """When the endpoint bound at `address` closed (time.monotonic()), or None if it is bound
        or never was."""
        with self._lock:
            return self._gone.get(address)

    def is_registered(self, address: str) -> bool:
        with self._lock:
            return address in self._claimed

    def deliver(self, sender: str, address: str, frames: Sequence[bytes]) -> None:
        """File `frames` in the inbox at `address`, from the endpoint now named `sender`."""
        self._inbox(address).put((sender, tuple(frames)))


def mesh_address(name: str) -> str:
    """Where a mesh endpoint finds `name`: the default address of `LocalTransport(name, hub)`."""
    return f"local://{name}"


class LocalTransport(Transport):
    """A `Transport` to other LocalTransports on the same hub.

    `address` is where this endpoint receives (default `local://<name>`); it stays when the endpoint
    is renamed, as a ZeroMQ endpoint's bound address does."""

    def __init__(self, name: str, hub: LocalHub, address: str | None = None):
        super().__init__(name)
        self.hub = hub
        self.address = address if address is not None else mesh_address(name)
        if not isinstance(self.address, str) or not self.address.startswith("local://"):
            raise ValueError(f"a local transport's address starts with 'local://', not {self.address!r}")
        self._inbox = hub.register(self.address)
        self._peers: dict[str, str] = {}
        self._connected_once = False
        self._closed = False

    # --- connections, as runtime.transport.zeromq ------------------------------------------------

    def rename(self, name: str) -> None:
        """Take the name peers will know this endpoint by (see `ZmqTransport.rename`): refused while
        any connection is open, since a receiver tells peers apart only by the sender's name and the
        next holder of the old name is about to use it."""
        if self._peers:
            raise RuntimeError(f"transport {self.name!r} still sends to {sorted(self._peers)} under its old name; "
                               f"disconnect them before renaming it to {name!r}")
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ValueError(f"transport name must be a non-empty printable string, not {name!r}")
        self.name = name

    def connect(self, peer: str, address: str, key: bytes | None = None) -> None:
        """Send to `peer` at `address` from now on (moving a peer just points it elsewhere: messages
        are in the receiver's inbox as soon as they are sent, so nothing is queued to drop)."""
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        if not isinstance(address, str) or not address.startswith("local://"):
            raise ValueError(f"peer {peer!r} of local transport {self.name!r} is at {address!r}, which is not a "
                             f"local:// address")
        self._peers[peer] = address
        self._connected_once = True

    def disconnect(self, peer: str, deliver_queued: bool = True) -> None:
        """Stop sending to `peer` and forget its address; what was sent before is already delivered,
        unless `deliver_queued` is False and nobody is bound there (a lost peer): what waits for
        the address is dropped, as ZeroMQ drops a closed connection's queue, so a process that
        binds it later never takes it for its own."""
        address = self._peers.pop(peer, None)
        if not deliver_queued and address is not None:
            self.hub.drop_unclaimed(address)

    def lost_peers(self, grace_s: float | None = None) -> dict[str, LostPeer]:
        grace = DEFAULT_GRACE_S if grace_s is None else grace_s
        now, lost = time.monotonic(), {}
        for peer, address in self._peers.items():
            since = self.hub.gone_since(address)
            if since is not None and now - since > grace:
                lost[peer] = LostPeer(peer, address, now - since, "its endpoint closed")
        return lost

    @property
    def peers(self) -> dict[str, str]:
        """The connected peers and their addresses (a mesh endpoint has none)."""
        return dict(self._peers)

    def address_of(self, peer: str) -> str | None:
        if peer in self._peers:
            return self._peers[peer]
        return None if self._connected_once else mesh_address(peer)

    # --- frames --------------------------------------------------------------------------------

    def _send_frames(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        address = self.address_of(peer)
        if address is None:
            raise ValueError(f"no address for peer {peer!r} of {self.name!r}; call connect() first")
        self.hub.deliver(self.name, address, [bytes(f) for f in frames])

    def _pump(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:
            if item is _CLOSED:
                raise RuntimeError(f"transport {self.name!r} was closed while waiting for a message")
            self._accept(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def close(self) -> None:
        """Unbind; a receive waiting in another thread wakes and raises."""
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        self.hub.unregister(self.address)
        self._inbox.put(_CLOSED)
