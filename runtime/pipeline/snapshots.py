"""Snapshots held on the workers, each stage's copied to a neighbour: the fault policy's state off
the coordinator and off the step's critical path (issue 32).

At a flush boundary the coordinator orders `snapshot` {sid, holder, keep, spread_s} and does not
wait. Each worker writes its stage's training state (its trainable parameters and its optimizer's
state, `state_tensors`: for LoRA the adapters and theirs, never the frozen base) into a file of its
own (`SpooledCopy`: an unlinked temporary file, a dropped copy's rewritten in place where one is
spare; the tensors packed one after another, written with a `pwritev` per MiB or ~1000 tensors) by a
thread of its own while the next step's first actions run, the step's UPDATE waiting for it (the
state does not change before: `StateCopies.settle`), and, once written, ships the copy to the
stage's holder (`holder_of`: the next stage, the last stage's the one before) while that step
computes: from the stage's own
thread, between the step's actions and while it waits for a neighbour (`StateCopies.pump`; an
engine that holds the interpreter's lock through a whole graph, MNN, left a sender thread waiting
and the step stalled behind it): first its index (`copy_index`: each tensor's name, dtype, shape
and offset, JSON), then the file's bytes read back from it in messages of `MESSAGE_CHUNKS` chunks
of at most `CHUNK_BYTES` (one frame each), whatever tensors each spans (a LoRA stage's ~700 small
tensors go in a few messages, not ~700), at most `PUMP_CHUNKS` chunks at a time, spread over
`spread_s` seconds, at most `CREDIT_BYTES` beyond what the holder said it filed (its word wakes a
sender that waits for it: `wake_on_side`), so the step's own activations and
gradients, which share the connection, wait behind a few chunks at most. Over CURVE the chunks go
without their CRC-32 (the link's MAC authenticates every byte: `Transport.authenticated`). The
holder takes them from a lane of their own (`runtime.transport.wire.SIDE_KIND`: they never meet the
step's tensors), appends each to a file of its own between its actions and while idle, and once
every byte the index declares arrived (a torn copy is never held) holds it and tells the coordinator `replica_held` {sid, of}. So every
stage's state is on two devices and on the coordinator never; in neither device's memory but for
the chunks on their way (the page cache is not the process's: `peer_snapshot_bytes`).

A worker keeps its own copies and the replicas it holds of the snapshots `keep` names (the last
one every stage's holder confirmed) and of the newest; the coordinator orders a new snapshot only
once the previous one is confirmed, and then tells the workers to drop the older one
(`snapshot_keep`), so a worker holds one file of its state and one of its neighbour's between
snapshots, and while one is shipped two of its own, one of its neighbour's and the part received.
After a loss, the coordinator restores from the newest snapshot whose lost stages' replicas were
confirmed (`PeerSnapshots.restorable`), fetching each stage's state from its own worker or, for a
lost one, from its holder (`snapshot_send`: read back from the file a window of 1 MiB chunks at a
time, `send_window`, the optimizer state spooled to the coordinator's disk as it arrives:
runtime.pipeline.restore); the
replay from it is exact as from any copy: the data order is a function of the step.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ir.safetensors import load_safetensors
from runtime.procfs import threads_cpu_s
from runtime.pipeline.checkpoints import (ROW_IDS, TrainingState, dense_from_wire, merge_checkpoint,
                                          read_meta, rows_on_wire)
from runtime.transport.wire import DTYPES, MAX_PAYLOAD_BYTES, PART_BYTES, SIDE_KIND, wire_dtype

# A copy travels in messages of at most this many bytes: a step's tensor on the same connection
# waits behind one of them at most (ZeroMQ interleaves whole messages only), and each arrives as
# one frame, which the holder keeps as it is (a message of several frames is joined into a copy).
CHUNK_BYTES = PART_BYTES
_BEGIN = "#begin"  # a copy's first message: its index (`copy_index`)
_BYTES = "#bytes"  # a chunk of a copy's bytes: "#bytes|OFFSET"
# The holder's word to the sender of a copy: how many of its bytes it has filed so far.
_FILED = "#filed"
# buffers per `pwritev` (the system's limit, 1024 on Linux)
_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
# At most this many bytes per file write. In the workers (MiniLM over 3 MNN workers), a holder's
# 2 MiB `pwritev` of a message's two frames cost 0.6-1.1 ms of CPU a MiB, a 2 MiB `pwrite` of them
# joined as much, two 1 MiB writes 0.24 (as a lone process writes either size): the filing's CPU
# per snapshot 0.17-0.21 CPU-s against 0.07 (runtime/pipeline/FAULTS.md, helper h33).
WRITE_BYTES = 2 ** 20
# A shipment's message carries this many chunks (its payload's frames, `CHUNK_BYTES` each): the
# Python on both ends (a header built and checked, a look at the network, a file write) is paid
# per message, and was ~2/3 of the workers' own CPU for a copy's bytes in 1 MiB messages (the rest:
# reading the chunk from the file, writing it to the holder's). The holder writes a message's frames
# as they are, never joined (a `pwritev` of at most `WRITE_BYTES` each). The step's tensors wait
# behind no more bytes than before: the chunks a pump sends go out back to back either way.
MESSAGE_CHUNKS = 2
# At most this many chunks are sent per `StateCopies.pump` call (between two actions of a step): a
# step's tensor to the same neighbour waits behind at most these (~4 MiB, a few ms of CURVE).
PUMP_CHUNKS = 4
# At most this many bytes of a copy are on their way unfiled (sent, not yet filed by the holder,
# which says so: `_FILED`): nothing else paces the shipping to the link or to the holder, whose
# receive queue took what arrived while it computed (the demo under load: 28-48 MiB over plan).
# In bytes, not chunks: a small tensor is a chunk of its own, and a copy of many small ones (a
# tiny model's, LoRA's) would wait on its holder's actions for nothing.
CREDIT_BYTES = PUMP_CHUNKS * CHUNK_BYTES
# While a stage's own copy is being written (`_Writing`), its shipment waits: a stage that waits
# for a neighbour looks again this often to begin it (the write takes ~20-60 ms on MiniLM; the
# shipment is spread over a step).
WRITE_LOOK_S = 0.02
# Files of dropped copies kept to be written again: the next own copy's and the next replica's.
_SPARE_FILES = 2
# What a worker holds of the copies in memory while training: the chunks it sent that its holder
# has not filed yet and those it received and has not filed yet (filed between the step's actions),
# `CREDIT_BYTES` per copy on its way (its own, and up to two it holds), with room to spare.
SPOOL_WORKING_BYTES = 4 * PUMP_CHUNKS * CHUNK_BYTES
# What a worker sends the coordinator per request when it is asked for its state a window at a time
# (after a loss, `snapshot_send`; a checkpoint or the coordinator's copy, `checkpoint`): chunks of
# at most `CHUNK_BYTES` (one frame each, kept as received), at most this many bytes of them, read
# into buffers of their own (a held copy) or views of the stage's own arrays (`send_window`). A
# window of whole tensors is not bounded: MiniLM's word embeddings and their two AdamW moments are
# 3 x 45 MiB.
FETCH_WINDOW_BYTES = 4 * CHUNK_BYTES


def holder_of(stage: int, stages: int) -> int | None:
    """The stage that holds stage `stage`'s copy: its next neighbour, the last stage's the one
    before (neighbours are connected already); None for a one-stage pipeline."""
    if stages < 2:
        return None
    return stage + 1 if stage + 1 < stages else stage - 1


def peer_snapshot_bytes(state_bytes: Sequence[int]) -> list[int]:
    """What holding the snapshots on the workers adds to each stage's memory at its peak, given each
    stage's training state in bytes (trainable parameters and optimizer state; a lone stage, which
    has no neighbour to hold its copy, is charged nothing). The copies lie in files (`SpooledCopy`),
    so the charge does not grow with the state:
    - while training, a worker holds the chunks on their way (`SPOOL_WORKING_BYTES`): at most
      `CREDIT_BYTES` of its own copy beyond what its holder said it filed, and as many of each
      copy it holds (a holder files between its actions; before that pacing, its receive queue took
      what arrived while it computed: the demo's workers peaked 28-48 MiB over their plan);
    - after a loss it reads its own copy and those it holds back for the coordinator a window at a
      time (`send_window`: at most `FETCH_WINDOW_BYTES` in chunks of `CHUNK_BYTES`, let go by its
      transport (`wait_sent`) before it answers, the next asked for once that answer arrived).
    The two do not overlap: the abort that begins a recovery stops the shipping, and the chunks
    received before the neighbours' fences are filed before a window is read. (Before both, a
    worker was charged its own copy and every copy it holds: the demo's phone 96 MiB, which kept
    its snapshots on the coordinator.)"""
    return [max(SPOOL_WORKING_BYTES, FETCH_WINDOW_BYTES) if len(state_bytes) > 1 else 0 for _ in state_bytes]


@dataclass(frozen=True)
class WindowEntry:
    """One tensor of a state sent a window at a time: `part(a, b)` gives its flat elements [a, b)
    (a view of the stage's own array, or read from a copy's file into a buffer of its own)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    part: Callable[[int, int], np.ndarray]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @classmethod
    def of_array(cls, name: str, arr: np.ndarray) -> "WindowEntry":
        arr = np.asarray(arr)
        # a C-contiguous array (the engines' own) is sent as views of its buffer, no copy
        return cls(name, tuple(int(d) for d in arr.shape), arr.dtype,
                   lambda a, b: np.asarray(arr, order="C").reshape(-1)[a:b])

    @classmethod
    def of_spooled(cls, copy: "SpooledCopy", entry: "SpooledTensor") -> "WindowEntry":
        return cls(entry.name, entry.shape, np.dtype(entry.dtype), lambda a, b: copy.read(entry, a, b))


def send_window(transport, peer: str, kind: str, stage: int, entries: Sequence[WindowEntry], first: int, start: int,
                budget: int) -> dict:
    """Send `peer` the part of `entries` from element `start` of tensor `first` on: chunks of at most
    `CHUNK_BYTES`, as many as fit in `budget` bytes (one at least), each a flat `kind` tensor named
    as its tensor, with the tensor's index as its micro-batch. Returns what the answer that follows
    them says of them (`Coordinator._windowed` reads it): `parts` ([index, start, count] each, in
    the order sent), the `shapes` of their tensors, `names`, `total` and `next` ([index, start] of
    the next window; None: the last was sent). The chunks are let go by the transport
    (`wait_sent`) before this returns: a worker holds one window of its state at most."""
    if not (0 <= first <= len(entries) and (first == len(entries) or 0 <= start <= max(entries[first].size - 1, 0))):
        raise ValueError(f"a window of {len(entries)} tensors cannot start at tensor {first}, element {start}")
    parts, shapes, sent = [], {}, 0
    i, a = first, start
    while i < len(entries):
        e = entries[i]
        b = min(e.size, a + max(1, CHUNK_BYTES // e.dtype.itemsize))
        nbytes = (b - a) * e.dtype.itemsize
        if parts and sent + nbytes > budget:
            break
        transport.send_tensor(peer, kind, stage, i, e.part(a, b), name=e.name)
        parts.append([i, a, b - a])
        shapes[e.name] = list(e.shape)
        sent += nbytes
        i, a = (i + 1, 0) if b >= e.size else (i, b)
    transport.wait_sent(peer)
    return {"first": first, "start": start, "parts": parts, "shapes": shapes,
            "names": [entries[k].name for k, _, _ in parts], "total": len(entries),
            "next": [i, a] if i < len(entries) else None}


def state_tensors(executor) -> list[tuple[str, np.ndarray]]:
    """A stage's training state as checkpoint tensors (`param/<name>`, `opt/<kind>/<name>`, a
    table's row state as `rows_on_wire` pairs): the engine's and optimizer's own arrays, no copies."""
    tensors = [(f"param/{k}", v) for k, v in executor.engine.parameter_arrays().items()]
    dense, rows = executor.optimizer_state_parts()
    tensors += [(f"opt/{k}", np.asarray(v)) for k, v in dense.items()]
    for k, sparse in rows.items():
        tensors += rows_on_wire(f"opt/{k}", sparse)
    return tensors


def row_shapes(tensors: Sequence[tuple[str, np.ndarray]]) -> dict[str, list[int]]:
    """The dense shape of each row-kept entry among `tensors` (its parameter's), as a checkpoint's
    `rows` declares them."""
    shapes = {name: list(arr.shape) for name, arr in tensors if name.startswith("param/")}
    out = {}
    for name, _ in tensors:
        if name.endswith(ROW_IDS):
            key = name[:-len(ROW_IDS)]
            out[key] = shapes.get(f"param/{key.split('/', 2)[-1]}", [])
    return out


@dataclass(frozen=True)
class SpooledTensor:
    """Where one tensor of a spooled copy lies in its file: `nbytes` bytes at `offset`, C order."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


class SpooledCopy:
    """One snapshot copy in a file of its own (an unlinked temporary file: the kernel frees it with
    the process, a worker killed included), its tensors one after another. Written through the page
    cache and read back with `pread` into fresh buffers, never mapped, so none of it is the process's
    resident memory but the one tensor or chunk being read."""

    def __init__(self, file):
        self.file = file  # a binary file object, open for reading and writing
        self.tensors: list[SpooledTensor] = []
        self.end = 0  # bytes written

    def append(self, name: str, arr: np.ndarray) -> SpooledTensor:
        """Write `arr` after what is written (no copy of it in memory: its buffer goes to the file)."""
        return self.extend([(name, arr)])[0]

    def extend(self, tensors: Sequence[tuple[str, np.ndarray]]) -> list[SpooledTensor]:
        """Write `tensors` one after another after what is written, in as few system calls as
        `pwritev` allows (`_IOV_MAX` buffers each: a LoRA stage's ~700 small tensors in one), never
        joined in memory; each in the wire's byte order (little-endian: no copy on x86 and ARM)."""
        entries, views = self.lay_out(tensors)
        self._writev(views)
        return entries

    def lay_out(self, tensors: Sequence[tuple[str, np.ndarray]]) -> tuple[list[SpooledTensor], list[memoryview]]:
        """Place `tensors` after what is written (their entries added to `tensors`) and return them
        with the views of their bytes, to be written in order (`write_laid_out`) before anything
        else is: a stage's own copy is laid out on its thread, its bytes written on another
        (`StateCopies.take`). Each view is of the tensor's own buffer (no copy) in the wire's byte
        order (little-endian: no copy on x86 and ARM)."""
        entries, views, at = [], [], self.end
        for name, arr in tensors:
            arr = np.asarray(arr)
            # (np.ascontiguousarray would make a 0-d array of shape (1,))
            arr = np.asarray(arr, dtype=wire_dtype(arr.dtype.name), order="C")
            entry = SpooledTensor(name, tuple(int(d) for d in arr.shape), arr.dtype.str, at)
            if arr.nbytes:
                views.append(memoryview(arr.reshape(-1)).cast("B"))
                at += arr.nbytes
            entries.append(entry)
        self.tensors += entries
        return entries, views

    def write_laid_out(self, views: list) -> None:
        """Write what `lay_out` returned, then cut what a longer copy left in a reused file."""
        self._writev(views)
        self.finish()

    def _writev(self, views: list) -> None:
        """Write `views` at the end, in `pwritev` calls of at most `WRITE_BYTES` each (many small
        buffers in one call; a large one in several), again from where a short write stopped."""
        pending = deque(v[i:i + WRITE_BYTES] for v in views for i in range(0, v.nbytes, WRITE_BYTES))
        while pending:
            batch, size = [], 0
            while pending and len(batch) < _IOV_MAX and size + pending[0].nbytes <= WRITE_BYTES:
                size += pending[0].nbytes
                batch.append(pending.popleft())
            done = os.pwritev(self.file.fileno(), batch, self.end)
            self.end += done
            while batch and done >= batch[0].nbytes:
                done -= batch.pop(0).nbytes
            if batch and done:  # a short write that stopped inside a buffer
                batch[0] = batch[0][done:]
            pending.extendleft(reversed(batch))  # what a short write left, first

    def write(self, arr: np.ndarray) -> None:
        """Write `arr`'s bytes (C order) at the end."""
        data = memoryview(np.asarray(arr, order="C").reshape(-1)).cast("B")
        done = 0
        while done < len(data):
            done += os.pwrite(self.file.fileno(), data[done:], self.end + done)
        self.end += len(data)

    def write_views(self, views: Sequence[memoryview]) -> None:
        """Write `views` (bytes) one after another at the end, never joined (`_writev`)."""
        self._writev([v for v in views if v.nbytes])

    def read_bytes(self, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) of the file, into a buffer of their own."""
        data = os.pread(self.file.fileno(), stop - start, start) if stop > start else b""
        if len(data) != stop - start:
            raise OSError(f"a spooled snapshot copy is short: {len(data)} of {stop - start} bytes at {start}")
        return np.frombuffer(data, np.uint8)

    def finish(self) -> None:
        """Every tensor is written: cut what a longer copy left in a reused file."""
        self.file.truncate(self.end)

    def read(self, entry: SpooledTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements [start, stop) of `entry` (flat; the whole tensor, shaped, by default), read into a
        buffer of its own."""
        item = np.dtype(entry.dtype).itemsize
        stop = entry.size if stop is None else stop
        count = (stop - start) * item
        data = os.pread(self.file.fileno(), count, entry.offset + start * item) if count else b""
        if len(data) != count:
            raise OSError(f"a spooled snapshot copy is short: {len(data)} of {count} bytes of {entry.name!r}")
        flat = np.frombuffer(data, np.dtype(entry.dtype)) if count else np.zeros(0, np.dtype(entry.dtype))
        return flat if (start, stop) != (0, entry.size) else flat.reshape(entry.shape)

    def items(self):
        """(name, tensor) one at a time, each read when asked for."""
        for entry in self.tensors:
            yield entry.name, self.read(entry)

    def close(self) -> None:
        self.file.close()


def copy_index(copy: SpooledCopy) -> np.ndarray:
    """A copy's index as its holder takes it (`parse_copy_index`): JSON, {"bytes": the file's size,
    "tensors": [[name, dtype, shape, offset], ...]} in file order, as uint8."""
    doc = {"bytes": copy.end,
           "tensors": [[e.name, np.dtype(e.dtype).name, list(e.shape), e.offset] for e in copy.tensors]}
    return np.frombuffer(json.dumps(doc, separators=(",", ":")).encode("ascii"), np.uint8)


def parse_copy_index(arr: np.ndarray, where: str) -> tuple[list[SpooledTensor], int]:
    """(tensors, total bytes) of a copy's index as `copy_index` writes it: parsed as JSON only; each
    tensor a known dtype, a shape of non-negative sizes, each named once, laid one after another from
    0 to the total (so a copy whose bytes are all in is whole, and no tensor reads past its end)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: its index {why}")

    try:
        doc = json.loads(bytes(np.asarray(arr, np.uint8)).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise bad("is not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"bytes", "tensors"} or not isinstance(doc["tensors"], list) \
            or not isinstance(doc["bytes"], int) or isinstance(doc["bytes"], bool):
        raise bad('is not {"bytes": N, "tensors": [...]}')
    tensors, names, at = [], set(), 0
    for item in doc["tensors"]:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and item[1] in DTYPES
                and isinstance(item[2], list) and all(type(d) is int and d >= 0 for d in item[2])
                and type(item[3]) is int):
            raise bad(f"has an entry {item!r:.80} that is not [name, dtype, shape, offset]")
        name, dtype, shape, offset = item
        if name in names or offset != at:
            raise bad(f"names {name!r:.80} twice, or at {offset} where the one before ends at {at}")
        dt = wire_dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize  # Python's integers: a huge shape does not wrap around
        if nbytes > MAX_PAYLOAD_BYTES:
            raise bad(f"declares {name!r:.80} of {nbytes} bytes")
        names.add(name)
        tensors.append(SpooledTensor(name, tuple(shape), dt.str, offset))
        at += nbytes
    if doc["bytes"] != at:
        raise bad(f"declares {doc['bytes']} bytes, its tensors take {at}")
    return tensors, at


def _spool_file(spare: list):
    """A file for a new copy: a dropped copy's where one is spare (overwriting pages already in the
    page cache costs a copy; a new file's pages cost their allocation, several times more), else a
    new unlinked temporary file."""
    return spare.pop() if spare else tempfile.TemporaryFile(prefix="confidant-copy-")


@dataclass
class _Incoming:
    """A neighbour's copy as its bytes arrive: its index (from its "#begin"), appended to a file of
    this worker's as they come, in order; held only once all `total` bytes are in."""

    sid: int
    stage: int
    tensors: list[SpooledTensor]
    total: int
    spool: SpooledCopy
    filed: int = 0  # bytes filed


def _io_cpu_s() -> float:
    return threads_cpu_s("ZMQbg/IO") or 0.0


class _Shipment:
    """A copy on its way to its holder: the bytes of its file, read back and sent in order in
    messages of `MESSAGE_CHUNKS` chunks of `CHUNK_BYTES` (however many tensors each spans: a LoRA stage's ~700 small tensors go in a few
    messages, not one or more each), evenly over `spread_s` from its start. The "#begin" message,
    the copy's index (each tensor's name, dtype, shape and offset, as JSON), goes at once."""

    def __init__(self, holder: str, sid: int, stage: int, copy: SpooledCopy, spread_s: float):
        self.holder, self.sid, self.stage, self.copy = holder, sid, stage, copy
        step = MESSAGE_CHUNKS * CHUNK_BYTES  # a message's bytes (`MESSAGE_CHUNKS`)
        self.chunks = [(a, min(a + step, copy.end)) for a in range(0, copy.end, step)]
        self.index = copy_index(copy)
        self.spread_s = spread_s
        self.start = time.monotonic()
        self.sent = 0
        self.sent_bytes = 0
        self.filed = 0  # bytes the holder said it filed (`_FILED`)
        self.begun = False

    def due(self, now: float) -> int:
        """How many chunks should have gone by `now`."""
        if self.spread_s <= 0:
            return len(self.chunks)
        return min(len(self.chunks), int(len(self.chunks) * (now - self.start) / self.spread_s) + 1)

    def credit(self) -> bool:
        """The next message may go: with it, at most `CREDIT_BYTES` of the copy are on their way
        beyond what the holder said it filed (or nothing is on its way: a message over the credit)."""
        if self.sent >= len(self.chunks):
            return False
        a, b = self.chunks[self.sent]
        return self.sent_bytes == self.filed or self.sent_bytes + (b - a) - self.filed <= CREDIT_BYTES

    def next_at(self) -> float:
        """When the next chunk is due (monotonic seconds)."""
        if self.spread_s <= 0:
            return self.start
        return self.start + self.spread_s * self.sent / len(self.chunks)


class _Writing:
    """A stage's own copy whose bytes a thread of its own writes (`StateCopies.take`), and where it
    goes once written: its shipment to its holder begins only then."""

    def __init__(self, copy: SpooledCopy, views: list, ship: tuple | None):
        self.copy, self.ship = copy, ship  # ship: (holder, sid, stage, spread_s) or None
        self.error: BaseException | None = None
        self.cpu_s = 0.0
        self.thread = threading.Thread(target=self._write, args=(views,), name="confidant-copy", daemon=True)
        self.thread.start()

    def _write(self, views: list) -> None:
        cpu = time.thread_time()
        try:
            self.copy.write_laid_out(views)
        except BaseException as exc:  # raised on the stage's thread by `StateCopies.settle`
            self.error = exc
        finally:
            self.cpu_s = time.thread_time() - cpu


class StateCopies:
    """A worker's own snapshot copies, the replicas it holds for a neighbour, and the shipping of
    its newest copy to its holder (`pump`, called from the stage's own thread). Every copy lies in a
    file of its own (`SpooledCopy`), not in the worker's memory: while one ships, the worker's peak
    is its stage's own state and a few chunks, not two to four copies of it.

    A copy's bytes are written by a thread of its own (`_Writing`) while the next step's first
    actions run: the state does not change until the step's UPDATE (or a backward that steps), and
    the stage's executor waits for the write before it (`settle`, its `before_state_change`), so the
    copy is the state at the boundary exactly. A file write releases the interpreter's lock, so the
    copy no longer delays the step's first forward on the busiest stage (stage 0 of two: ~40 ms a
    snapshot, benchmarks/PIPELINE_NOTES.md, helper h50); its shipment begins once it is written."""

    def __init__(self, transport, report: Callable[[dict], None]):
        self.transport = transport
        self.report = report  # sends the coordinator a control message
        self.own: dict[int, SpooledCopy] = {}  # sid -> this stage's copy
        self.replicas: dict[tuple[int, int], SpooledCopy] = {}  # (stage, sid) -> its copy
        self._incoming: dict[str, _Incoming] = {}  # sender peer -> the copy it is sending
        self._shipment: _Shipment | None = None  # the copy being shipped to its holder (`pump`)
        # the files of dropped copies, which the next copies are written into (`_spool_file`): a
        # chunk is read into a buffer of its own before it is sent, so no chunk in ZeroMQ's queue
        # is in a file that is written again
        self._spare: list = []
        self.copy_s = 0.0  # the last copy's seconds, on the step's path (reported with the next done)
        # what the snapshots have cost this worker's CPUs since its setup (the copies, shipping,
        # filing a neighbour's copy), and how many it took: the coordinator
        # chooses how often to snapshot from it
        self.cpu_s = 0.0
        self.taken = 0
        # the same CPU by part: the copy at the boundary, shipping it, filing a neighbour's
        self.cpu_parts = {"copy": 0.0, "send": 0.0, "file": 0.0}
        # the transport's I/O threads' CPU at this worker's setup: their CPU since is charged to the
        # snapshots (CURVE encrypts and decrypts the copies there: ~0.1 CPU-s per 100 MiB each way,
        # the largest part of a snapshot's cost; the step's own tensors, a few ms a step on
        # MiniLM, are counted too: K errs long)
        self._io_start = _io_cpu_s()
        self._lock = threading.Lock()
        self._writing: _Writing | None = None  # the own copy whose bytes are being written

    # --- taking and shipping -------------------------------------------------------------------
    def take(self, sid: int, stage: int,
             tensors: Sequence[tuple[str, np.ndarray]] | Callable[[], Sequence[tuple[str, np.ndarray]]],
             holder: str | None, keep: Sequence[int], spread_s: float) -> None:
        """Copy `tensors` (or what calling it returns: gathering them is charged to the copy too) as
        snapshot `sid` and ship it to `holder` once written. The bytes are written by a thread of
        their own (`_Writing`): the arrays must not change until `settle` returns (the executor
        calls it before it steps the state)."""
        self.stop()
        self.settle()
        if not self.taken:  # counted from the first snapshot: a setup's weights went through them too
            self._io_start = _io_cpu_s()
        start, cpu = time.perf_counter(), time.thread_time()
        self.forget_except(keep)  # the copies dropped now lend their files to this one
        if callable(tensors):
            tensors = tensors()
        copy = SpooledCopy(_spool_file(self._spare))
        _, views = copy.lay_out(tensors)
        if holder is not None:
            self.transport.open(holder)
        self.own[sid] = copy
        self._writing = _Writing(copy, views, None if holder is None else (holder, sid, stage, spread_s))
        self.copy_s = time.perf_counter() - start
        with self._lock:
            self.cpu_s += self.copy_s
            self.cpu_parts["copy"] += time.thread_time() - cpu
            self.taken += 1

    def settle(self) -> None:
        """Wait until the own copy being written is written (its error raised here), and begin its
        shipment. The time waited is on the step's path (`copy_s`)."""
        writing = self._writing
        if writing is None:
            return
        start = time.perf_counter()
        writing.thread.join()
        self._writing = None
        self.copy_s += time.perf_counter() - start
        with self._lock:
            self.cpu_s += writing.cpu_s
            self.cpu_parts["copy"] += writing.cpu_s
        if writing.error is not None:
            raise writing.error
        if writing.ship is not None:
            holder, sid, stage, spread_s = writing.ship
            self._shipment = _Shipment(holder, sid, stage, writing.copy, spread_s)

    @property
    def writing(self) -> bool:
        """The own copy's bytes are still being written (its shipment waits for them)."""
        return self._writing is not None and self._writing.thread.is_alive()

    def forget_except(self, sids) -> None:
        self.settle()  # a copy being written keeps its file until it is written
        sids = set(sids)
        ship = self._shipment
        for held in (self.own, self.replicas):
            for key in [k for k in held if (k if held is self.own else k[1]) not in sids]:
                copy = held.pop(key)
                if ship is not None and ship.copy is copy:
                    self.stop()
                self._spare.append(copy.file)
        for f in self._spare[_SPARE_FILES:]:  # the next copy and the next replica take at most two
            f.close()
        del self._spare[_SPARE_FILES:]

    @property
    def awaiting_word(self) -> bool:
        """The copy being shipped is out of credit: what it waits for is its holder's word."""
        ship = self._shipment
        return ship is not None and ship.begun and not ship.credit() and ship.sent < len(ship.chunks)

    @property
    def shipping(self) -> bool:
        """A copy is still being shipped to its holder (or written, to be shipped)."""
        return self._shipment is not None or (self._writing is not None and self._writing.ship is not None)

    def pump(self) -> float | None:
        """Send the chunks of the copy being shipped that are due (spread evenly over its
        `spread_s`, at most `PUMP_CHUNKS` a call), from the stage's own thread: its executor calls
        this between actions and while it waits for a neighbour, the worker while it waits for an
        order. Each chunk is read from the copy's file into a buffer of its own. Returns the seconds
        until the next chunk is due (0: behind), None when none is left or the holder's word on
        what it filed is awaited (its arrival wakes a wait with `wake_on_side`)."""
        if self._writing is not None:
            if self._writing.thread.is_alive():
                return WRITE_LOOK_S  # its shipment begins once it is written
            self.settle()
        ship = self._shipment
        if ship is None:
            return None
        cpu = time.thread_time()
        try:
            if not ship.begun:
                self.transport.send_tensor(ship.holder, SIDE_KIND, ship.stage, 0, ship.index, version=ship.sid,
                                           name=_BEGIN)
                ship.begun = True
            due = ship.due(time.monotonic())
            if ship.sent < due and not ship.credit():
                # its word on what it filed, and its own copy's chunks: what filing them cost is
                # charged by take_in (`file`), not a second time here as sending
                cpu += self.take_in([ship.holder], ship.stage)
            sent = 0
            while ship.sent < due and sent < PUMP_CHUNKS * CHUNK_BYTES and ship.credit():
                a, b = ship.chunks[ship.sent]
                self.transport.send_tensor(ship.holder, SIDE_KIND, ship.stage, ship.sent + 1,
                                           ship.copy.read_bytes(a, b), version=ship.sid, name=f"{_BYTES}|{a}")
                ship.sent += 1
                ship.sent_bytes += b - a
                sent += b - a
        except Exception:  # the holder or this transport went away: the coordinator's acks tell
            self._shipment = None
            return None
        finally:
            with self._lock:
                spent = time.thread_time() - cpu
                self.cpu_s += spent
                self.cpu_parts["send"] += spent
        if ship.sent >= len(ship.chunks):
            self._shipment = None
            return None
        if not ship.credit():
            # the holder has not filed what is on its way: its word wakes a stage that waits
            # (`wake_on_side`), and one that computes looks after its action. (Looking every 5 ms,
            # then 25, woke waiting stages ~10-40 times an action for nothing: +4-5%, then +3.6%
            # on MiniLM's wall-clock step over 3 MNN workers on 2 cores.)
            return None
        return max(0.0, ship.next_at() - time.monotonic())

    def stop(self) -> None:
        """Stop shipping (a new copy, an abort, a new stage): the holder drops the partial copy. A
        copy still being written is written, never shipped."""
        self._shipment = None
        if self._writing is not None:
            self._writing.ship = None

    def detach_own(self) -> dict[int, SpooledCopy]:
        """This stage's own copies, taken out (sid -> copy): `drop` leaves them open for whoever
        took them (a survivor's setup after a loss reads its unmoved blocks' optimizer state from
        them: runtime.pipeline.kept_state), who closes them."""
        self.stop()
        self.settle()
        own, self.own = dict(self.own), {}
        return own

    def drop(self) -> None:
        self.stop()
        if self._writing is not None:  # its file is closed below: written first, whatever became of it
            self._writing.thread.join()
            self._writing = None
        for copy in [*self.own.values(), *self.replicas.values(), *(g.spool for g in self._incoming.values())]:
            copy.close()
        for f in self._spare:
            f.close()
        self.own.clear()
        self.replicas.clear()
        self._incoming.clear()
        self._spare.clear()
        self.cpu_s, self.taken = 0.0, 0
        self.cpu_parts = dict.fromkeys(self.cpu_parts, 0.0)
        self._io_start = _io_cpu_s()

    # --- holding a neighbour's copy ------------------------------------------------------------
    def take_in(self, peers: Sequence[str], this_stage: int | None) -> float:
        """File what neighbours' senders delivered so far (no waiting); a copy completed is a
        replica held, and the coordinator hears so. Returns the CPU seconds it charged to the
        snapshots (`file`; 0.0 for a look that found nothing)."""
        start, looked = time.thread_time(), False
        for peer in peers:
            filed = None
            for header, views in self.transport.take_side(peer):  # one look at the network for all
                filed = self._file(peer, header, views, this_stage) or filed
                looked = True
            if filed is not None:  # the sender may send as many more bytes (`CREDIT_BYTES`)
                try:
                    self.transport.send_tensor(peer, SIDE_KIND, filed[1], 0, np.array([filed[2]], np.int64),
                                               version=filed[0], name=_FILED)
                except Exception:  # the sender went away: the coordinator hears of it
                    pass
        if not looked:  # a look that found nothing: the worker looks as often with no snapshots at all
            return 0.0
        spent = time.thread_time() - start
        with self._lock:
            self.cpu_s += spent
            self.cpu_parts["file"] += spent
        return spent

    def _file(self, peer: str, header, views: Sequence[memoryview], this_stage: int | None
              ) -> tuple[int, int, int] | None:
        """File one side-lane message from `peer` (its header and its payload's frames); (sid,
        stage, bytes filed) of its copy when it was a chunk of one, for the word back to the sender."""
        if header.name not in (_FILED, _BEGIN):
            return self._file_bytes(peer, header, views, this_stage)
        arr = np.frombuffer(b"".join(views), wire_dtype(header.dtype)).reshape(header.shape)  # small: a word, an index
        if header.name == _FILED:
            ship = self._shipment
            if ship is not None and ship.holder == peer and ship.sid == header.version and arr.size == 1:
                ship.filed = max(ship.filed, int(arr.reshape(-1)[0]))
            return None
        if header.name == _BEGIN:
            tensors, total = parse_copy_index(arr, f"a snapshot copy from {peer}")
            self.forget_from(peer)  # a copy it stopped sending half-way: its file is written again
            self._incoming[peer] = _Incoming(header.version, header.stage, tensors, total,
                                             SpooledCopy(_spool_file(self._spare)))
            self._complete(peer, this_stage)
            return None

    def _file_bytes(self, peer: str, header, views: Sequence[memoryview], this_stage: int | None
                    ) -> tuple[int, int, int] | None:
        got = self._incoming.get(peer)
        if got is None or got.sid != header.version or got.stage != header.stage:
            return None  # the rest of a copy its sender stopped shipping, or began before this stage's setup
        tag, _, offset = header.name.partition("|")
        size = sum(v.nbytes for v in views)
        if tag != _BYTES or not offset.isdigit() or int(offset) != got.spool.end or header.dtype != "uint8" \
                or got.spool.end + size > got.total:
            raise ValueError(f"a snapshot copy from {peer}: part {header.name!r:.80} of {size} bytes ({header.dtype}) "
                             f"does not follow its {got.spool.end} bytes of {got.total}")
        got.spool.write_views(views)
        got.filed += size
        self._complete(peer, this_stage)
        return got.sid, got.stage, got.filed

    def _complete(self, peer: str, this_stage: int | None) -> None:
        got = self._incoming[peer]
        if got.spool.end < got.total:
            return
        del self._incoming[peer]
        got.spool.tensors = got.tensors
        got.spool.finish()
        # only a copy every chunk of which arrived is held: a sender lost half-way leaves a partial
        # file that is never taken (`forget_from`)
        self.replicas[(got.stage, got.sid)] = got.spool
        self.report({"type": "replica_held", "stage": this_stage, "of": got.stage, "sid": got.sid})

    def forget_from(self, peer: str) -> None:
        """A lost neighbour's partial copy is of no use: its file is written again."""
        got = self._incoming.pop(peer, None)
        if got is not None:
            self._spare.append(got.spool.file)

    def spooled(self, stage: int, own_stage: int | None, sid: int) -> SpooledCopy | None:
        """The copy of `stage` for snapshot `sid`: this stage's own or a replica held."""
        if stage == own_stage:
            self.settle()
        return self.own.get(sid) if stage == own_stage else self.replicas.get((stage, sid))

    def copy_of(self, stage: int, own_stage: int | None, sid: int) -> list[tuple[str, np.ndarray]] | None:
        """The same, read whole into memory (tests; the worker sends a copy tensor by tensor)."""
        copy = self.spooled(stage, own_stage, sid)
        return None if copy is None else list(copy.items())

    def figures(self) -> dict:
        """What a step's done reports: the copy on its path, and the snapshots' CPU so far."""
        with self._lock:
            io = 0.0
            if self.taken:
                cpu = time.thread_time()
                now = _io_cpu_s()
                # reading the I/O threads' CPU (/proc, each of the process's threads) is the snapshots' too
                self._io_start -= time.thread_time() - cpu
                io = now - self._io_start
            out = {"snapshot_copy_s": self.copy_s, "snapshot_cpu_s": self.cpu_s + io, "snapshots_taken": self.taken,
                   "snapshot_cpu_parts_s": {**self.cpu_parts, "io": io},
                   # the whole process's CPU so far (every thread): less the snapshots', a step's own
                   # work between two reports, which K weighs all the workers' copies against
                   "process_cpu_s": time.process_time()}
        self.copy_s = 0.0
        return out


# --- the coordinator's side ------------------------------------------------------------------------

@dataclass
class HeldSnapshot:
    """A snapshot the workers hold (what `jobs.train.pipeline.Snapshot` is for state held on
    the coordinator): `per_stage` and `state` are fetched from the workers when first asked for."""

    step: int
    sid: int
    ranges: list[tuple[int, int]]
    fetch: Callable[[int], list[dict[str, np.ndarray]]]
    _per_stage: list | None = None
    _state: TrainingState | None = None

    @property
    def per_stage(self) -> list[dict[str, np.ndarray]]:
        if self._per_stage is None:
            self._per_stage = self.fetch(self.sid)
        return self._per_stage

    @property
    def state(self) -> TrainingState:
        if self._state is None:
            self._state = TrainingState(*merge_checkpoint(self.per_stage))
        return self._state

    def spooled(self, spool, stages) -> "HeldSnapshot":
        """This snapshot with its state streamed from `stages` (`Coordinator.fetch_held_stages`)
        into `spool` (runtime.pipeline.restore.RestoreSpool): the weights in memory, the optimizer
        state on the coordinator's disk, never the whole state in memory."""
        self._state = spool.state_of(stages, f"snapshot {self.sid}")
        return self


# Steps whose own work (all the workers' CPU) K's choice takes the median of.
WORK_STEPS = 8


class PeerSnapshots:
    """The coordinator's record of the snapshots held on the workers: which were ordered (by
    `sid`), which every holder has confirmed, and from which a loss of given stages restores."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.ordered: list[HeldSnapshot] = []  # newest last; at most the confirmed one and a newer
        self.cost_s: float | None = None  # one snapshot's CPU on the busiest worker
        self.total_cost_s: float | None = None  # one snapshot's CPU summed over the workers
        # per stage: (process CPU, snapshots' CPU, updates) at its last report, and each step's own
        # work summed over the stages (CPU seconds less the snapshots'), the last WORK_STEPS steps
        self._last: dict[int, tuple[float, float, int]] = {}
        self._work_cpu: deque[float] = deque(maxlen=WORK_STEPS)

    @classmethod
    def for_run(cls, coordinator, faults, plan_over) -> "PeerSnapshots | None":
        """The run's keeper when its policy holds the state on the workers: `state_on` "peers",
        recovering by a re-plan (a stop writes the coordinator's copy to disk), more than one stage
        (a lone stage has no neighbour to hold its copy)."""
        if (faults.state_on != "peers" or faults.on_failure != "replan" or plan_over is None
                or coordinator.stages < 2):
            return None
        return cls(coordinator)

    def confirmed(self) -> HeldSnapshot | None:
        held = self.coordinator.replicas_held
        for snap in reversed(self.ordered):
            if held.get(snap.sid, set()) >= set(range(len(snap.ranges))) or len(snap.ranges) < 2:
                return snap
        return None

    def note(self, done: Sequence[dict]) -> None:
        """The stages' reports of a step: what the snapshots have cost each worker's CPUs so far."""
        costs = [d["snapshot_cpu_s"] / d["snapshots_taken"] for d in done
                 if isinstance(d.get("snapshot_cpu_s"), (int, float)) and isinstance(d.get("snapshots_taken"), int)
                 and d["snapshots_taken"] > 0]
        if costs:
            self.cost_s = max(costs)
            self.total_cost_s = sum(costs)
        self._note_work(done)

    def _note_work(self, done: Sequence[dict]) -> None:
        """Each stage's CPU since its last report less what its snapshots took, per update, summed
        over the stages: what a step's own work costs all the workers (None until every stage has
        reported twice since its setup; a report whose counters went back, a new setup, starts over)."""
        total, whole = 0.0, True
        for k, d in enumerate(done):
            now = (d.get("process_cpu_s"), d.get("snapshot_cpu_s", 0.0), d.get("updates"))
            if not (isinstance(now[0], (int, float)) and isinstance(now[1], (int, float)) and isinstance(now[2], int)):
                whole = False
                continue
            before, self._last[k] = self._last.get(k), now
            if before is None or now[2] <= before[2] or now[0] < before[0] or now[1] < before[1]:
                whole = False
                continue
            total += max(0.0, (now[0] - before[0]) - (now[1] - before[1])) / (now[2] - before[2])
        if whole and done and total > 0:
            self._work_cpu.append(total)

    def together(self) -> tuple[float, float]:
        """(one snapshot's CPU summed over the workers, a step's own work's CPU summed over them,
        the median of the last WORK_STEPS): K weighs the first against the second (0.0, 0.0 until
        both are known)."""
        if self.total_cost_s is None or not self._work_cpu:
            return 0.0, 0.0
        work = sorted(self._work_cpu)
        return self.total_cost_s, work[len(work) // 2]

    def costs(self) -> list[float]:
        """What one snapshot costs the busiest worker, in CPU seconds (its copy, the shipping
        thread, filing its neighbour's copy): on a device with no CPU to spare, what it adds to the
        steps; the policy's K is chosen from it (jobs.train.pipeline.snapshot_interval)."""
        return [self.cost_s] if self.cost_s is not None else []

    def busy(self) -> bool:
        """A snapshot is still being copied to its holders: a new one would make the workers hold
        a third copy, so none is ordered until it is confirmed."""
        self.coordinator.take_notices()
        newest = self.ordered[-1] if self.ordered else None
        if newest is None:
            return False
        if newest is not self.confirmed():
            return True
        if len(self.ordered) > 1:  # the older copies are of no use now: the workers drop them
            self.ordered = [newest]
            self.coordinator.keep_snapshots([newest.sid])
        return False

    def take(self, step: int, ranges, step_seconds: Sequence[float]) -> HeldSnapshot:
        """Order a snapshot after `step` steps; its copies are shipped over half a step (the
        shortest of the last `step_seconds`: the first after a setup builds the engines, and a
        copy shipped slower than the steps run would be confirmed only steps later), so that the
        step's own tensors pass between its chunks."""
        spread_s = 0.5 * min(step_seconds[-8:]) if step_seconds else 0.0
        base = self.confirmed()
        keep = [base.sid] if base is not None else []
        sid = self.coordinator.snapshot_to_peers(keep, spread_s)
        snap = HeldSnapshot(step, sid, [tuple(r) for r in ranges], self.coordinator.fetch_held)
        self.ordered = [s for s in self.ordered if s is base] + [snap]
        return snap

    def wait_confirmed(self, snap: HeldSnapshot) -> None:
        """Return once every holder has confirmed `snap` (the workers ship while idle, all at once
        when ordered with no spread), the older copies dropped: what 1f1b-stash does at a drain, so
        that a loss in the segment after it replays that segment at most (with the copy still on its
        way, a loss right after the drain restored the drain before: two segments)."""
        if len(snap.ranges) > 1:
            self.coordinator.await_replicas(snap.sid)
        self.busy()  # confirmed: the workers drop the older copies now

    def restorable(self, lost_stages: Sequence[int], notices: bool = True) -> HeldSnapshot | None:
        """The newest snapshot every lost stage's holder confirmed, the holder not lost too (None:
        none can be restored); its fetch is bound to the lost stages now. With `notices`, the
        confirmations that arrived are filed first (call between steps, or after an abort)."""
        if notices:
            self.coordinator.take_notices()
        held = self.coordinator.replicas_held
        lost = tuple(sorted(lost_stages))
        for snap in reversed(self.ordered):
            stages = len(snap.ranges)
            holders = {holder_of(k, stages) for k in lost}
            if set(lost) <= held.get(snap.sid, set()) and not holders & set(lost) and None not in holders:
                snap.fetch = lambda sid, lost=lost: self.coordinator.fetch_held(sid, lost)
                snap._per_stage = snap._state = None
                return snap
        return None

    def reset(self) -> None:
        """The stages were set up again: their copies are gone (and their counters start over)."""
        self.ordered = []
        self._last.clear()
        self._work_cpu.clear()


# --- the coordinator's fallback: when a stage and the neighbour holding its copy are lost together --

class FallbackCopies:
    """What the coordinator keeps for a loss its peers cannot recover from (a stage lost together
    with the neighbour that holds its copy): every stage's state at a boundary, written to a spool
    folder of its own tensor by tensor as it comes off the wire (`Coordinator.collect_stages`; .npy
    files, read back without pickle; not fsynced, since it serves this run only), so the coordinator
    holds one tensor at a time, and none between recoveries. Its state is read back only for such a
    loss. (A run writing checkpoints has those too: `checkpointed`.)"""

    def __init__(self):
        self.folder: Path | None = None
        self.step: int | None = None  # the boundary the spooled copy is of
        self.ranges: list[tuple[int, int]] = []
        self.seconds: list[float] = []  # what each spooled copy cost (collecting and writing it)

    def spool(self, step: int, ranges, stages) -> None:
        """Write `stages` ((stage, rows declaration, iterator of (name, tensor)) each, as
        `Coordinator.collect_stages` yields them: every stage's state after `step` steps),
        replacing the last copy once all are written."""
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="confidant-fallback-"))
        new = self.folder / "new"
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir()
        for k, rows, tensors in stages:
            part = new / f"stage{k}"
            part.mkdir()
            names = []
            for i, (name, arr) in enumerate(tensors):
                np.save(part / f"{i}.npy", np.asarray(arr), allow_pickle=False)
                names.append(name)
            (part / "index.json").write_text(json.dumps({"names": names, "rows": rows}))
        shutil.rmtree(self.folder / "copy", ignore_errors=True)
        os.rename(new, self.folder / "copy")
        self.step, self.ranges = step, [tuple(r) for r in ranges]

    def spooled(self) -> tuple[int, list[tuple[int, int]], list[dict[str, np.ndarray]]] | None:
        """(step, ranges, every stage's state) of the spooled copy; None when there is none."""
        if self.step is None:
            return None
        per_stage = []
        for k in range(len(self.ranges)):
            part = self.folder / "copy" / f"stage{k}"
            index = json.loads((part / "index.json").read_text())
            tensors = {name: np.load(part / f"{i}.npy", allow_pickle=False) for i, name in enumerate(index["names"])}
            per_stage.append(dense_from_wire(tensors, index["rows"], f"the coordinator's copy of stage {k}"))
        return self.step, self.ranges, per_stage

    def spooled_stages(self):
        """The spooled copy as `RestoreSpool.state_of` takes it: (stage, rows declaration, (name,
        tensor) pairs), each tensor a file read back only when used (runtime.pipeline.restore)."""
        from runtime.pipeline.restore import SpooledTensor

        for k in range(len(self.ranges)):
            part = self.folder / "copy" / f"stage{k}"
            index = json.loads((part / "index.json").read_text())
            yield k, index["rows"], [(name, SpooledTensor.npy(part / f"{i}.npy")) for i, name in enumerate(index["names"])]

    @staticmethod
    def checkpointed(directory: Path) -> tuple[int, list[tuple[int, int]], list[dict[str, np.ndarray]]]:
        """(step, ranges, every stage's state) of the checkpoint the run wrote last to `directory`."""
        meta = read_meta(directory)
        per_stage = [load_safetensors(Path(directory) / f"stage{k}.safetensors") for k in range(meta["stages"])]
        return int(meta["step"]), [tuple(r) for r in meta["ranges"]], per_stage

    @staticmethod
    def checkpointed_stages(directory: Path):
        """(step, ranges, the stages as `RestoreSpool.state_of` takes them) of the checkpoint the run
        wrote last to `directory`: each stage's file read when its turn comes."""
        meta = read_meta(directory)
        stages = ((k, None, load_safetensors(Path(directory) / f"stage{k}.safetensors").items())
                  for k in range(meta["stages"]))
        return int(meta["step"]), [tuple(r) for r in meta["ranges"]], stages

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder, self.step = None, None
