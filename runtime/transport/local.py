"""An in-process transport: a whole multi-stage plan runs in one test process, one thread per stage.

This is the fake hardware of DESIGN.md habit 9. It moves the same frames as the ZeroMQ transport
(encoded header bytes plus payload bytes) and the receiver decodes and checks them through the same
`Transport` code, so garbling, ordering and timeout behaviour tested here is the behaviour on the
network. Payloads are copied into immutable bytes on send, as a network would, so sender and
receiver never share memory.
"""
from __future__ import annotations

import queue
import threading
from typing import Sequence

from runtime.transport.wire import Transport


class LocalHub:
    """Mailboxes by name, shared by every LocalTransport of one simulated cluster; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.SimpleQueue] = {}
        self._claimed: set[str] = set()

    def _inbox(self, name: str) -> queue.SimpleQueue:
        # Created on first use by either side: stage threads start in any order, and a message to a
        # stage that has not registered yet waits for it, as ZeroMQ queues for a peer not yet up.
        with self._lock:
            return self._inboxes.setdefault(name, queue.SimpleQueue())

    def register(self, name: str) -> queue.SimpleQueue:
        with self._lock:
            if name in self._claimed:
                raise ValueError(f"a local transport named {name!r} is already registered on this hub")
            self._claimed.add(name)
        return self._inbox(name)

    def is_registered(self, name: str) -> bool:
        with self._lock:
            return name in self._claimed

    def deliver(self, sender: str, receiver: str, frames: Sequence[bytes]) -> None:
        self._inbox(receiver).put((sender, tuple(frames)))


class LocalTransport(Transport):
    """A `Transport` whose peers are other LocalTransports on the same hub, found by name."""

    def __init__(self, name: str, hub: LocalHub):
        super().__init__(name)
        self.hub = hub
        self.address = f"local://{name}"
        self._inbox = hub.register(name)
        self._closed = False

    def address_of(self, peer: str) -> str | None:
        return f"local://{peer}"

    def _send_frames(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        self.hub.deliver(self.name, peer, [bytes(f) for f in frames])

    def _pump(self, timeout: float | None) -> bool:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        try:
            sender, frames = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        self._accept(sender, frames)
        while True:
            try:
                sender, frames = self._inbox.get_nowait()
            except queue.Empty:
                return True
            self._accept(sender, frames)

    def close(self) -> None:
        self._closed = True

    def connect(self, peer: str, address: str) -> None:
        """Nothing to connect in-process: the hub delivers by name (kept for interface parity)."""

    def disconnect(self, peer: str) -> None:
        """Nothing to close in-process (kept for interface parity with `connect`)."""
