"""The transport between pipeline stages: the wire format, its checks, and the interface.

Workers exchange activations, gradients, weights and batches as tensors, and the coordinator talks
to workers in small control messages. Both cross a network from devices that may be misconfigured,
out of step, or simply buggy, so nothing received is trusted: a tensor message is a small JSON header
plus the raw little-endian bytes of the array, and a control message is one JSON object. Both are
parsed with `json` and `numpy.frombuffer` only; no received byte is ever turned into code or objects.

Wire format (protocol version 4):

- tensor: a header frame and the payload's frames, `[header, part, ...]`. The header is compact
  ASCII JSON with exactly the keys `v, kind, stage, microbatch, version, dtype, shape, nbytes,
  checksum, name` (see `TensorHeader`); the payload is `nbytes` raw bytes, C order, little-endian,
  in `payload_parts(nbytes)` frames of `PART_BYTES` each but the last (one frame, maybe empty, up
  to `PART_BYTES`), and `checksum` is the zlib.crc32 of all of it (0, and not checked, for a
  snapshot copy's chunk, `SIDE_KIND`, over a link that authenticates every byte: CURVE's MAC).
- control: one frame, `{"v": 2, "control": {...}}` (JSON, at most `MAX_CONTROL_BYTES`).
- so no frame is larger than `MAX_FRAME_BYTES` (1 MiB), however big the tensor.

(Version 1 sent a payload as one frame: ZeroMQ's CURVE encrypts and decrypts a frame through two
fresh buffers of its size, so a 47 MB embedding table cost its sender ~140 MB more memory while it
went out, and its receiver as much; in frames of 1 MiB, a few MiB. Version 3: every setup_bundle is
answered with bundle_wants before a byte of the bundle goes, and may offer a worker its own kept
weights (runtime.pipeline.held_weights); a version-2 worker ignored the offer and its coordinator
waited out its timeout for the answer. Version 4: a bundle file goes as its size and its chunks, answered
every few chunks (runtime.pipeline.bundles), where version 3 sent one message per file.)

Versions: every frame carries the sender's `v`, and a receiver takes only its own. Any change to
what a message means or must be answered with raises PROTOCOL_VERSION, so two trees that disagree
find it at the first frame: `ProtocolMismatch`, naming both versions, never a wait for an answer
the other side cannot give. The envelope itself (`v` and `control`, a header's `v`) never changes.

Ordering: the pipeline plan is static, so each receiver knows exactly which message comes next from
each peer. A transport keeps one FIFO per peer (and per channel: tensors and control messages are
ordered independently), so a message from peer A never satisfies a wait on peer B, and within one
FIFO the next message must match the receiver's `Expected` or it is a `MessageError`; nothing is
reordered, because a mismatch means the two sides disagree about the plan.

This module has no network code; `runtime.transport.zeromq` (ZeroMQ, between processes) and
`runtime.transport.local` (threads in one process, for tests) implement `Transport`.
"""
from __future__ import annotations

import json
import math
import operator
import re
import time
import zlib
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.procfs import release_free_heap

PROTOCOL_VERSION = 4
MAX_HEADER_BYTES = 64 * 1024
MAX_CONTROL_BYTES = 1024 * 1024
# Far above any activation or weight shard of a BERT-class stage; a header claiming more is garbage,
# and refusing it up front keeps a corrupted size from reserving memory.
MAX_PAYLOAD_BYTES = 16 * 1024 ** 3
PART_BYTES = 1 << 20  # a payload's frames (see the module's docstring)
# While a payload of many frames is joined, the freed frames are handed back to the OS every this many
# (`join_payload`; payloads of more frames only): each trim is ~0.1 ms, a frame 1 MiB.
RELEASE_EVERY_PARTS = 4
MAX_FRAMES = 1 + -(-MAX_PAYLOAD_BYTES // PART_BYTES)
# The largest frame this format ever sends (a header, a payload part or a control message), so a
# transport can refuse a bigger one as it arrives, before it has buffered it (a peer that declares
# a 4 GiB frame before it has even authenticated must cost the receiver nothing).
MAX_FRAME_BYTES = max(MAX_HEADER_BYTES, PART_BYTES, MAX_CONTROL_BYTES)
MAX_NDIM = 32
MAX_NAME_CHARS = 256
# Names only, no byte order: the wire is always little-endian (see `wire_dtype`).
DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
})
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_HEADER_KEYS = ("v", "kind", "stage", "microbatch", "version", "dtype", "shape", "nbytes", "checksum", "name")
_CONTROL_KEYS = ("v", "control")
_PREVIEW_BYTES = 80


def wire_dtype(name: str) -> np.dtype:
    """The numpy dtype of `name` as it travels: little-endian, whatever the host's byte order."""
    return np.dtype(name).newbyteorder("<")


def _is_int(x: Any) -> bool:
    # bool is an int subclass; JSON `true` must not pass as stage 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _preview(raw: bytes | memoryview, limit: int = _PREVIEW_BYTES) -> str:
    """The first bytes of an unparseable frame, escaped so any garbage prints as one safe line."""
    head = bytes(raw[:limit])
    text = repr(head)
    return f"{text}... ({len(raw)} bytes)" if len(raw) > limit else text


def _fmt_shape(shape: Sequence[int]) -> str:
    return str(tuple(int(d) for d in shape))


@dataclass(frozen=True)
class TensorHeader:
    """What travels in front of a tensor's bytes.

    `stage` is the sender's pipeline stage, -1 for the coordinator (which is not a stage);
    `microbatch` is -1 for tensors not tied to one (weights);
    `version` is the weight version the tensor was computed with, -1 when not applicable; `nbytes`
    and `checksum` (zlib.crc32 of the payload) let the receiver reject truncated or corrupted bytes;
    `name` tells tensors apart when several travel together (e.g. a weight shard per parameter)."""

    kind: str
    stage: int
    microbatch: int
    version: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    name: str = ""

    def __post_init__(self) -> None:
        problem = _header_problem(self)
        if problem is not None:
            raise ValueError(f"invalid tensor header: {problem}")

    def describe(self, like: Expected | None = None) -> str:
        """`kind stage=S mb=M`, plus the fields `like` checks, so it reads against an expectation."""
        text = f"{self.kind} stage={self.stage} mb={self.microbatch}"
        if like is None:
            return f"{text} v={self.version} {self.dtype}{_fmt_shape(self.shape)}" + (
                f" name={self.name!r}" if self.name else "")
        if like.version is not None:
            text += f" v={self.version}"
        if like.dtype is not None:
            text += f" dtype={self.dtype}"
        if like.shape is not None:
            text += f" shape={_fmt_shape(self.shape)}"
        if like.name is not None:
            text += f" name={self.name!r}"
        return text

    def __str__(self) -> str:
        return self.describe()

    def encode(self) -> bytes:
        fields = {"v": PROTOCOL_VERSION, "kind": self.kind, "stage": self.stage, "microbatch": self.microbatch,
                  "version": self.version, "dtype": self.dtype, "shape": list(self.shape),
                  "nbytes": self.nbytes, "checksum": self.checksum, "name": self.name}
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def decode(cls, data: bytes | memoryview) -> TensorHeader:
        """Parse and validate a received header; anything but a well-formed v1 header is a MessageError."""
        fields = _parse_json_object(data, MAX_HEADER_BYTES, "header")
        received = f"header {_preview(data)}"
        problem = _key_problem(fields, _HEADER_KEYS)
        if problem is not None:
            raise MessageError(problem, received=received)
        _check_version(fields["v"], received)
        shape = fields["shape"]
        if not isinstance(shape, list):
            raise MessageError(f"shape is {type(shape).__name__}, not a list", received=received)
        fields = {k: fields[k] for k in _HEADER_KEYS if k != "v"} | {"shape": tuple(shape)}
        try:
            return cls(**fields)
        except ValueError as err:
            raise MessageError(str(err).removeprefix("invalid tensor header: "), received=received) from None


def _header_problem(h: TensorHeader) -> str | None:
    """The first thing wrong with a header's fields, or None; one rule set for senders and receivers."""
    if not isinstance(h.kind, str) or not _KIND.fullmatch(h.kind):
        return f"kind {h.kind!r} is not a lowercase identifier of at most 32 characters"
    for field, lowest in (("stage", -1), ("microbatch", -1), ("version", -1)):
        value = getattr(h, field)
        if not _is_int(value) or not lowest <= value < 2 ** 63:
            return f"{field} {value!r} is not an integer >= {lowest}"
    if not isinstance(h.dtype, str) or h.dtype not in DTYPES:
        return f"dtype {h.dtype!r} is not one of {', '.join(sorted(DTYPES))}"
    if not isinstance(h.shape, tuple) or len(h.shape) > MAX_NDIM:
        return f"shape {h.shape!r} is not a tuple of at most {MAX_NDIM} dimensions"
    if not all(_is_int(d) and d >= 0 for d in h.shape):
        return f"shape {list(h.shape)!r} has a dimension that is not a non-negative integer"
    if not _is_int(h.nbytes):
        return f"nbytes {h.nbytes!r} is not an integer"
    size = math.prod(h.shape) * np.dtype(h.dtype).itemsize
    if h.nbytes != size:
        return f"nbytes {h.nbytes} does not match {h.dtype}{_fmt_shape(h.shape)} ({size} bytes)"
    if h.nbytes > MAX_PAYLOAD_BYTES:
        return f"nbytes {h.nbytes} exceeds the limit of {MAX_PAYLOAD_BYTES}"
    if not _is_int(h.checksum) or not 0 <= h.checksum < 2 ** 32:
        return f"checksum {h.checksum!r} is not a 32-bit unsigned integer"
    if not isinstance(h.name, str) or len(h.name) > MAX_NAME_CHARS or not h.name.isprintable():
        return f"name {h.name!r} is not a printable string of at most {MAX_NAME_CHARS} characters"
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _parse_json_object(data: bytes | memoryview, limit: int, what: str) -> dict[str, Any]:
    """Strict JSON: size-limited, UTF-8, no duplicate keys, no NaN/Infinity, an object at the top."""
    received = f"{what} {_preview(data)}"
    if len(data) > limit:
        raise MessageError(f"{what} of {len(data)} bytes exceeds the limit of {limit}", received=received)
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise MessageError(f"{what} is not UTF-8 (byte {err.start})", received=received) from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise MessageError(f"{what} is not valid JSON at char {err.pos}", received=received) from None
    except ValueError as err:
        raise MessageError(f"{what} is not valid: {err}", received=received) from None
    except RecursionError:
        # A 64 KiB frame of '[' nests deep enough to exhaust the parser's recursion limit.
        raise MessageError(f"{what} nests too deeply", received=received) from None
    if not isinstance(obj, dict):
        raise MessageError(f"{what} is a JSON {type(obj).__name__}, not an object", received=received)
    return obj


def _key_problem(fields: dict[str, Any], known: Sequence[str]) -> str | None:
    extra = [k for k in fields if k not in known]
    missing = [k for k in known if k not in fields]
    if extra:
        return "unknown field" + ("s " if len(extra) > 1 else " ") + ", ".join(repr(k) for k in extra)
    if missing:
        return "missing field" + ("s " if len(missing) > 1 else " ") + ", ".join(repr(k) for k in missing)
    return None


@dataclass(frozen=True)
class Expected:
    """What the receiver's plan says arrives next from a peer; None fields are not checked."""

    kind: str
    stage: int
    microbatch: int
    version: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    def describe(self) -> str:
        text = f"{self.kind} stage={self.stage} mb={self.microbatch}"
        if self.version is not None:
            text += f" v={self.version}"
        if self.dtype is not None:
            text += f" dtype={self.dtype}"
        if self.shape is not None:
            text += f" shape={_fmt_shape(self.shape)}"
        if self.name is not None:
            text += f" name={self.name!r}"
        return text

    def __str__(self) -> str:
        return self.describe()

    def mismatch(self, header: TensorHeader) -> str | None:
        """Why `header` is not the awaited message, or None when it is."""
        order = [f for f in ("kind", "stage", "microbatch") if getattr(header, f) != getattr(self, f)]
        other = [f for f in ("version", "dtype", "shape", "name")
                 if getattr(self, f) is not None and getattr(header, f) != getattr(self, f)]
        parts = ["out of order"] if order else []
        if other:
            parts.append(", ".join(other) + (" differ" if len(other) > 1 else " differs"))
        return "; ".join(parts) or None


class MessageError(RuntimeError):
    """A received message that cannot be used: garbled, truncated, corrupted, or not the one expected.

    The text names the peer and its address, what the plan expected and what arrived (the parsed
    header, or the first bytes escaped when it does not parse), so a log line alone locates the fault."""

    def __init__(self, problem: str, *, peer: str | None = None, address: str | None = None,
                 expected: Expected | str | None = None, received: TensorHeader | str | None = None):
        self.problem = problem
        self.peer = peer
        self.address = address
        self.expected = expected
        self.received = received
        super().__init__(self._render())

    def _render(self) -> str:
        head = "message"
        if self.peer is not None:
            head += f" from peer {self.peer!r}" + (f" ({self.address})" if self.address else "")
        parts = []
        if self.expected is not None:
            parts.append(f"expected {self.expected}")
        if isinstance(self.received, TensorHeader):
            like = self.expected if isinstance(self.expected, Expected) else None
            parts.append(f"received {self.received.describe(like)}")
        elif self.received is not None:
            parts.append(f"received {self.received}")
        return f"{head}: {', '.join(parts)} ({self.problem})" if parts else f"{head}: {self.problem}"

    def at(self, peer: str | None, address: str | None, expected: Expected | str | None) -> MessageError:
        """This error with the receiver's context filled in where the parser could not know it."""
        return MessageError(self.problem, peer=self.peer if self.peer is not None else peer,
                            address=self.address if self.address is not None else address,
                            expected=self.expected if self.expected is not None else expected,
                            received=self.received)


class ProtocolMismatch(MessageError):
    """A frame of another protocol version (`theirs`; this side speaks `ours`): the peer runs another
    Confidant. `control`: the control message it carried, parsed as JSON and not trusted beyond
    that (a worker takes its coordinator's address from it, to say why it cannot go on)."""

    def __init__(self, theirs, ours: int, control: Any = None, **context):
        self.theirs, self.ours, self.control = theirs, ours, control
        super().__init__(f"protocol version {theirs!r}, this side speaks {ours}: {SAME_CONFIDANT}", **context)

    def at(self, peer: str | None, address: str | None, expected: Expected | str | None) -> ProtocolMismatch:
        return ProtocolMismatch(self.theirs, self.ours, self.control,
                                peer=self.peer if self.peer is not None else peer,
                                address=self.address if self.address is not None else address,
                                expected=self.expected if self.expected is not None else expected,
                                received=self.received)


SAME_CONFIDANT = "run the same Confidant version on every device (the coordinator's and every worker's)"


def _check_version(v: Any, received: str, control: Any = None) -> None:
    """A frame's `v`: this side's version, else ProtocolMismatch (a whole number) or MessageError."""
    if not _is_int(v):
        raise MessageError(f"protocol version {v!r} is not a whole number", received=received)
    if v != PROTOCOL_VERSION:
        raise ProtocolMismatch(v, PROTOCOL_VERSION, control if isinstance(control, dict) else None, received=received)


@dataclass(frozen=True)
class LostPeer:
    """A peer whose link has been down for `down_s` seconds: `reason` says what the transport saw;
    `was_up` is False for a peer never reached at all (wrong address or key, not started)."""

    peer: str
    address: str | None
    down_s: float
    reason: str
    was_up: bool = True


class PeerTimeout(RuntimeError):
    """Nothing arrived from a peer in time (or, when sending, the peer took nothing in time)."""

    def __init__(self, peer: str | None, address: str | None, waiting_for: str, timeout_s: float,
                 sending: bool = False):
        self.peer = peer
        self.address = address
        self.waiting_for = waiting_for
        self.timeout_s = timeout_s
        who = "any peer" if peer is None else f"peer {peer!r}" + (f" ({address})" if address else "")
        if sending:
            text = f"{who} took nothing within {timeout_s:g} s while sending {waiting_for} (its queue is full)"
        else:
            text = f"nothing arrived from {who} within {timeout_s:g} s while waiting for {waiting_for}"
        super().__init__(text)


def check_payload(header: TensorHeader, payload: bytes | memoryview) -> None:
    """Raise MessageError unless `payload` has exactly the header's size and checksum."""
    _check_size(header, len(payload) if isinstance(payload, bytes) else memoryview(payload).nbytes)
    crc = zlib.crc32(payload)
    if crc != header.checksum:
        raise MessageError(f"checksum mismatch: payload crc32 0x{crc:08x}, header says 0x{header.checksum:08x}",
                           received=header)


def _check_size(header: TensorHeader, size: int) -> None:
    if size != header.nbytes:
        what = "truncated" if size < header.nbytes else "oversized"
        raise MessageError(f"{what} payload: {size} bytes, header says {header.nbytes}", received=header)


def payload_parts(nbytes: int) -> int:
    """How many frames a payload of `nbytes` crosses the wire in."""
    return max(1, -(-nbytes // PART_BYTES))


def split_payload(payload: memoryview) -> list[memoryview]:
    """`payload` (bytes, flat) as its frames: views, no copies."""
    n = payload.nbytes
    return [payload[i:i + PART_BYTES] for i in range(0, n, PART_BYTES)] if n else [payload]


def payload_views(header: TensorHeader, parts: Sequence[bytes | memoryview], checksum: bool = True
                  ) -> list[memoryview]:
    """A tensor's payload as its frames' bytes, checked as `join_payload` checks them, not joined:
    for a reader that writes them on as they are (a snapshot copy's chunk, filed with one
    `pwritev`: runtime.pipeline.snapshots)."""
    views = [memoryview(p).cast("B") for p in parts]
    _check_views(header, views)
    if checksum:
        _check_crc(header, views)
    return views


def _check_crc(header: TensorHeader, views: Sequence[memoryview]) -> None:
    """The CRC-32 of a payload's frames, in order, against its header's."""
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    if crc != header.checksum:
        raise MessageError(f"checksum mismatch: payload crc32 0x{crc:08x}, header says 0x{header.checksum:08x}",
                           received=header)


def _check_views(header: TensorHeader, views: Sequence[memoryview]) -> None:
    _check_size(header, sum(v.nbytes for v in views))
    want = payload_parts(header.nbytes)
    if len(views) != want or any(v.nbytes != PART_BYTES for v in views[:-1]):
        sizes = ", ".join(str(v.nbytes) for v in views[:4]) + (", ..." if len(views) > 4 else "")
        raise MessageError(f"payload in {len(views)} frame{'s' if len(views) != 1 else ''} of {sizes} bytes, a "
                           f"payload of {header.nbytes} bytes comes in {want} frame{'s' if want != 1 else ''} of "
                           f"{PART_BYTES} bytes but the last", received=header)


def join_payload(header: TensorHeader, parts: Sequence[bytes | memoryview],
                 checksum: bool = True, consume: bool = False) -> bytes | memoryview:
    """A tensor's payload from its frames, checked (`check_payload`, and as many frames as its size
    needs, each `PART_BYTES` but the last); one frame is returned as it is, several are copied into
    one buffer. Without `checksum` the CRC-32 is not verified (a link whose every byte its cipher's
    MAC authenticated: `Transport.authenticated`)."""
    views = [memoryview(p).cast("B") for p in parts]
    _check_views(header, views)
    want = len(views)
    if len(parts) == 1:
        if checksum:
            check_payload(header, parts[0])
        return parts[0]
    if checksum:
        _check_crc(header, views)
    joined = np.empty(header.nbytes, np.uint8)
    # Each frame is let go as soon as it is copied (when the caller gave its list away: `consume`),
    # so the frames and the joined buffer are not both held whole (a stage's weights file twice).
    # Last frame first: frames received one after another lie one above another in the allocator's
    # heap, and only memory freed at its top goes back to the OS.
    if consume:
        parts.clear()
    at = header.nbytes
    while views:
        v = views.pop()
        joined[at - v.nbytes:at] = np.frombuffer(v, np.uint8)
        at -= v.nbytes
        v.release()
        del v
        if consume and want > RELEASE_EVERY_PARTS and len(views) % RELEASE_EVERY_PARTS == 0:
            # Freed frames go back to the OS only where they top the allocator's heap; where they lie
            # below live memory (which depends on what else the process allocated as they arrived),
            # only an explicit trim returns their pages.
            release_free_heap()
    return memoryview(joined)


def encode_control(obj: dict[str, Any]) -> bytes:
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise TypeError(f"a control message is a dict with string keys, not {type(obj).__name__}")
    try:
        data = json.dumps({"v": PROTOCOL_VERSION, "control": obj}, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False).encode("ascii")
    except ValueError as err:
        raise ValueError(f"control message is not plain JSON: {err}") from None
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(data)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    return data


def decode_control(data: bytes | memoryview) -> dict[str, Any]:
    envelope = _parse_json_object(data, MAX_CONTROL_BYTES, "control frame")
    received = f"control frame {_preview(data)}"
    problem = _key_problem(envelope, _CONTROL_KEYS)
    if problem is not None:
        raise MessageError(problem, received=received)
    _check_version(envelope["v"], received, envelope["control"])
    if not isinstance(envelope["control"], dict):
        raise MessageError("control is not a JSON object", received=received)
    return envelope["control"]


def _array_from_payload(header: TensorHeader, payload: bytes | memoryview) -> np.ndarray:
    # Zero-copy and read-only: the array keeps the frame's buffer alive through numpy's base
    # reference, and stages only read what they receive (activations are stashed for backward, so
    # an in-place write would corrupt it; read-only makes that fail loudly). A caller that must
    # write copies. Payloads that land unaligned inside a receive buffer are copied once, since
    # compute engines may require aligned input.
    arr = np.frombuffer(payload, dtype=wire_dtype(header.dtype), count=math.prod(header.shape))
    arr = arr.reshape(header.shape)
    if not arr.flags.aligned:
        arr = arr.copy()
    arr.flags.writeable = False
    return arr


TENSOR, CONTROL, SIDE = "tensor", "control", "side"
# Tensors of this kind travel in a lane of their own (`recv_side`): a stage's snapshot copy sent to
# its neighbour while a step runs (runtime.pipeline.snapshots) must not meet the step's tensors,
# whose FIFO order is the plan's.
SIDE_KIND = "replica"
_SIDE_PREFIX = b'{"v":%d,"kind":"%s"' % (PROTOCOL_VERSION, SIDE_KIND.encode())
_CONTROL_WAIT = "a control message"


class Transport(ABC):
    """Send and receive checked tensors and control messages between named peers.

    A transport is used from one thread (its stage's executor); `LocalHub` and ZeroMQ handle the
    cross-thread and cross-process parts. Subclasses move opaque frames (`_send_frames`, `_pump`);
    everything that gives those frames meaning, and all checking, lives here, so every transport
    rejects the same garbage with the same message."""

    name: str
    address: str | None
    # every byte received was authenticated by the link (CURVE's MAC: altered bytes never arrive),
    # so a side-lane copy (`SIDE_KIND`, many MiB a snapshot) goes without its CRC-32, computed by
    # neither end (the step's tensors keep theirs)
    authenticated: bool = False

    def __init__(self, name: str):
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ValueError(f"transport name must be a non-empty printable string, not {name!r}")
        self.name = name
        self._fifos: dict[tuple[str, str], deque] = {}
        # Arrival order of pending control messages across peers, for recv_control(None).
        self._control_order: deque[str] = deque()
        # side-lane messages taken in so far: a wait with `wake_on_side` ends when this moves
        self._side_arrivals = 0

    def wait_sent(self, peer: str) -> None:
        """Return once the messages sent to `peer` so far have left this process's queues (their
        buffers let go), so that a sender of many large tensors in a row (a recovery's optimizer
        state) holds a bounded part of them; PeerTimeout when that takes longer than the transport's
        send timeout. Here nothing is queued: a transport that queues says otherwise."""

    # --- what subclasses provide -------------------------------------------------------------

    @abstractmethod
    def _send_frames(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one message of raw frames for `peer` and return without waiting for delivery."""

    @abstractmethod
    def _pump(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: forever) for incoming messages and hand every one
        available to `_accept`; True when at least one arrived."""

    @abstractmethod
    def address_of(self, peer: str) -> str | None:
        """Where `peer` lives, for error messages."""

    @abstractmethod
    def close(self) -> None:
        ...

    def _check_peer(self, peer: str) -> None:
        """Raise ValueError when waiting on `peer` could never succeed."""

    def lost_peers(self, grace_s: float | None = None) -> dict[str, LostPeer]:
        """Peers this endpoint sends to whose link is down (dead, frozen or unreachable); a
        transport that cannot tell reports none."""
        return {}

    @property
    def refused(self) -> list:
        """Strangers turned away (`runtime.transport.security.Refusal`), most recent last."""
        return []

    # --- shared machinery --------------------------------------------------------------------

    def _accept(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        """File one raw incoming message under its sender; frame count decides its channel."""
        if 2 <= len(frames) <= MAX_FRAMES:
            # a header that claims the side lane and lies is refused where it is taken (`recv_side`
            # checks it whole, as `recv_tensor` does)
            side = bytes(frames[0][:len(_SIDE_PREFIX)]) == _SIDE_PREFIX
            self._fifos.setdefault((peer, SIDE if side else TENSOR), deque()).append(frames)
            self._side_arrivals += side
        elif len(frames) == 1:
            self._fifos.setdefault((peer, CONTROL), deque()).append(frames[0])
            self._control_order.append(peer)
        else:
            raise MessageError(f"a message is 1 control frame, or a tensor's header and its payload in 1 to "
                               f"{MAX_FRAMES - 1} frames", peer=peer, address=self.address_of(peer),
                               received=f"{len(frames)} frames")

    def _wait(self, peer: str | None, channel: str, timeout: float | None, what: Expected | str,
              wake_on_side: bool = False) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        side = self._side_arrivals
        while True:
            found = self._take(peer, channel)
            if found is not None:
                return found
            if wake_on_side and self._side_arrivals != side:
                # a side-lane message came first: the caller takes it in and waits again
                raise PeerTimeout(peer, None if peer is None else self.address_of(peer), str(what), timeout)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                arrived = self._pump(remaining)
            except MessageError as err:
                same = err.peer == peer and channel == TENSOR
                raise err.at(None, None, what if same else None) from None
            # Past the deadline, one last non-blocking pump has run; only then give up.
            if not arrived and deadline is not None and time.monotonic() >= deadline:
                raise PeerTimeout(peer, None if peer is None else self.address_of(peer), str(what), timeout)

    def _take(self, peer: str | None, channel: str) -> tuple[str, Any] | None:
        if peer is None:
            if not self._control_order:
                return None
            peer = self._control_order[0]
        fifo = self._fifos.get((peer, channel))
        if not fifo:
            return None
        if channel == CONTROL:
            self._control_order.remove(peer)
        return peer, fifo.popleft()

    def discard(self, peer: str, controls: bool = True) -> int:
        """Drop every tensor (and, with `controls`, control message) from `peer` that arrived and
        was not taken yet (what was in flight when a step was aborted); returns how many."""
        dropped = 0
        for channel in (TENSOR, CONTROL) if controls else (TENSOR,):
            fifo = self._fifos.pop((peer, channel), None)
            dropped += len(fifo) if fifo else 0
        if controls:
            self._control_order = deque(p for p in self._control_order if p != peer)
        return dropped

    def retire(self, peer: str) -> None:
        """Never take a message again over any connection `peer` has used so far (a lost peer's, or
        a coordinator's before it called this worker back): what is still in flight on them is of a
        pipeline that went on without it. A later connection under the same name (a new process,
        or a re-plan's next holder of the name) is taken. Transports without connections that
        outlive their endpoints have nothing to do."""

    def peek_control(self, peer: str) -> dict[str, Any] | None:
        """The next control message from `peer` if one has arrived, left in place; None otherwise.
        Takes in whatever arrived without waiting."""
        self._pump(0)
        fifo = self._fifos.get((peer, CONTROL))
        if not fifo:
            return None
        try:
            return decode_control(fifo[0])
        except MessageError as err:
            raise err.at(peer, self.address_of(peer), _CONTROL_WAIT) from None

    def send_tensor(self, peer: str, kind: str, stage: int, microbatch: int, array: np.ndarray, *,
                    version: int = -1, name: str = "") -> TensorHeader:
        """Send `array` to `peer` behind a header computed from it; returns that header.

        The bytes go out without a copy where the transport can manage it, so the caller must not
        write to `array` afterwards; if it does anyway, the checksum taken here makes the receiver
        reject the message instead of training on torn data."""
        arr = np.asarray(array)
        if arr.dtype.name not in DTYPES:
            raise ValueError(f"cannot send dtype {arr.dtype} (allowed: {', '.join(sorted(DTYPES))})")
        # No copy when already C-contiguous little-endian, the normal case on ARM and x86.
        # (np.ascontiguousarray would turn a 0-d array into shape (1,).)
        arr = np.asarray(arr, dtype=wire_dtype(arr.dtype.name), order="C")
        payload = memoryview(arr.reshape(-1).view(np.uint8))
        header = TensorHeader(kind=kind, stage=operator.index(stage), microbatch=operator.index(microbatch),
                              version=operator.index(version),
                              dtype=arr.dtype.name, shape=tuple(int(d) for d in arr.shape),
                              nbytes=arr.nbytes, checksum=0 if self._unchecked(kind) else zlib.crc32(payload),
                              name=name)
        self._send_frames(peer, [header.encode(), *split_payload(payload)])
        return header

    def recv_tensor(self, peer: str, expected: Expected, timeout: float | None = None, wake_on_side: bool = False
                    ) -> tuple[TensorHeader, np.ndarray]:
        """The next tensor from `peer`, which must match `expected`; the array is read-only.

        Raises PeerTimeout when nothing arrives within `timeout` seconds (None waits forever), and
        with `wake_on_side` also as soon as a side-lane message (`SIDE_KIND`, from any peer)
        arrives first: a worker then files a neighbour's snapshot chunk, or sends more of its own
        copy on its holder's word, at once rather than looking every few ms (runtime.pipeline.snapshots).
        MessageError when what arrives is garbled, corrupted, or not the expected message."""
        self._check_peer(peer)
        _, (raw_header, *parts) = self._wait(peer, TENSOR, timeout, expected, wake_on_side)
        try:
            header = TensorHeader.decode(raw_header)
            problem = expected.mismatch(header)
            if problem is not None:
                raise MessageError(problem, received=header)
            payload = join_payload(header, parts, consume=True)
            del parts  # the frames, once joined: not held while the array lives
        except MessageError as err:
            raise err.at(peer, self.address_of(peer), expected) from None
        return header, _array_from_payload(header, payload)

    def recv_side(self, peer: str) -> tuple[TensorHeader, np.ndarray] | None:
        """The next side-lane tensor (`SIDE_KIND`) from `peer` that has arrived, without waiting;
        None when none has."""
        self._pump(0)
        fifo = self._fifos.get((peer, SIDE))
        if not fifo:
            return None
        raw_header, *parts = fifo.popleft()
        try:
            header = TensorHeader.decode(raw_header)
            if header.kind != SIDE_KIND:
                raise MessageError(f"kind {header.kind!r} in the {SIDE_KIND} lane", received=header)
            payload = join_payload(header, parts, checksum=not self._unchecked(SIDE_KIND), consume=True)
            del parts
        except MessageError as err:
            raise err.at(peer, self.address_of(peer), f"a {SIDE_KIND} tensor") from None
        return header, _array_from_payload(header, payload)

    def take_side(self, peer: str) -> list[tuple[TensorHeader, list[memoryview]]]:
        """Every side-lane message from `peer` that has arrived (one look at the network, no
        waiting), each its header and its payload's frames, checked as `recv_side` checks them but
        not joined: a chunk of several frames is written on with one `pwritev`, never copied into
        one buffer first."""
        self._pump(0)
        fifo = self._fifos.get((peer, SIDE))
        out = []
        while fifo:
            raw_header, *parts = fifo.popleft()
            try:
                header = TensorHeader.decode(raw_header)
                if header.kind != SIDE_KIND:
                    raise MessageError(f"kind {header.kind!r} in the {SIDE_KIND} lane", received=header)
                out.append((header, payload_views(header, parts, checksum=not self._unchecked(SIDE_KIND))))
            except MessageError as err:
                raise err.at(peer, self.address_of(peer), f"a {SIDE_KIND} tensor") from None
        return out

    def _unchecked(self, kind: str) -> bool:
        """A tensor of `kind` goes without its CRC-32: a side-lane copy over an authenticated link."""
        return kind == SIDE_KIND and self.authenticated

    def discard_side(self, peer: str) -> None:
        self._fifos.pop((peer, SIDE), None)

    def open(self, peer: str) -> None:
        """Make the connection to `peer` now (a transport that connects lazily does it on first
        send), so that another thread may send to it (`send_tensor` is safe from a second thread
        to a peer whose connection exists: runtime.pipeline.snapshots' sender)."""

    def send_control(self, peer: str, obj: dict[str, Any]) -> None:
        """Send a JSON object (start, stop, stats, error reports) to `peer`."""
        self._send_frames(peer, [encode_control(obj)])

    def recv_control(self, peer: str | None = None, timeout: float | None = None, wake_on_side: bool = False
                     ) -> tuple[str, dict[str, Any]]:
        """The next control message from `peer`, or from whichever peer sent first when None
        (`wake_on_side` as for `recv_tensor`)."""
        if peer is not None:
            self._check_peer(peer)
        sender, raw = self._wait(peer, CONTROL, timeout, _CONTROL_WAIT, wake_on_side)
        try:
            return sender, decode_control(raw)
        except MessageError as err:
            raise err.at(sender, self.address_of(sender), _CONTROL_WAIT) from None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
