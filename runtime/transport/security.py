"""What a secure link needs to know, as plain data: this endpoint's CURVE key pair, and a record of
every stranger that was turned away.

No cryptography happens here (libzmq does CURVE inside `runtime.transport.zeromq`; signing and key
files are `runtime.keys`): these are the values that cross between them.

Trust is by key, never by name. A receiver binds each peer name it knows to the key that peer must
authenticate with; a connection whose key is not one of those is refused during the handshake
(libzmq's ZAP handler in the ZeroMQ transport), and a message that arrives under a known name over a
connection authenticated with another peer's key is dropped. Both are logged and recorded in
`Transport.refused`, never raised: a stranger must not be able to stop a run by talking to it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("confidant.transport")

CURVE_KEY_BYTES = 32
# Refusals kept for inspection; older ones are only in the log. Bounded so a flood costs no memory.
MAX_REFUSALS_KEPT = 256


@dataclass(frozen=True)
class CurveKeys:
    """This endpoint's CURVE key pair (raw 32-byte Curve25519 keys; `runtime.keys` derives them
    from the endpoint's Ed25519 identity). `repr` never shows the secret."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for what, key in (("public", self.public), ("secret", self.secret)):
            if not isinstance(key, bytes) or len(key) != CURVE_KEY_BYTES:
                raise ValueError(f"CURVE {what} key must be {CURVE_KEY_BYTES} raw bytes")

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public.hex()[:16]}..., secret=<hidden>)"


def check_curve_key(key: object, whose: str) -> bytes:
    if not isinstance(key, bytes) or len(key) != CURVE_KEY_BYTES:
        raise ValueError(f"the CURVE key of {whose} must be {CURVE_KEY_BYTES} raw bytes, not {key!r:.60}")
    return key


@dataclass(frozen=True)
class Refusal:
    """One attempt that was turned away: when (time.time()), from where (a remote address when the
    transport knows it), what it claimed to be, and why."""

    at: float
    source: str
    claimed: str
    reason: str

    def describe(self) -> str:
        return f"refused {self.claimed} from {self.source}: {self.reason}"


class RefusalLog:
    """Thread-safe record of refusals (the ZAP handler runs in its own thread), logged as they
    happen: the first few of each source in full, then one line per `quiet_s` with a count."""

    def __init__(self, owner: str, quiet_s: float = 5.0):
        self.owner = owner
        self.quiet_s = quiet_s
        self._lock = threading.Lock()
        self._kept: deque[Refusal] = deque(maxlen=MAX_REFUSALS_KEPT)
        self._last_logged: dict[str, tuple[float, int]] = {}
        self.count = 0

    def add(self, source: str, claimed: str, reason: str) -> Refusal:
        refusal = Refusal(time.time(), source, claimed, reason)
        with self._lock:
            self._kept.append(refusal)
            self.count += 1
            now = time.monotonic()
            last, silenced = self._last_logged.get(source, (-1e9, 0))
            loud = now - last >= self.quiet_s
            self._last_logged[source] = (now, 0) if loud else (last, silenced + 1)
            if len(self._last_logged) > MAX_REFUSALS_KEPT:  # forget the oldest sources
                self._last_logged.pop(next(iter(self._last_logged)))
        if loud:
            more = f" ({silenced} more from there not shown)" if silenced else ""
            log.warning("%s: %s%s", self.owner, refusal.describe(), more)
        return refusal

    def snapshot(self) -> list[Refusal]:
        with self._lock:
            return list(self._kept)
