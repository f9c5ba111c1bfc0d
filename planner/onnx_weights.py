"""An ONNX file's weights read straight from disk, apart from its protobuf (issue 31, lever 2).

`onnx.load` holds the file's bytes and the parsed message (which copies every initializer's
`raw_data`) at once, and turning each initializer into an array copies it again: lowering
SmolLM2-135M peaked at 1124 MiB for 513 MiB of weights. Here the file is walked in protobuf's wire
format (ModelProto.graph = field 7, GraphProto.initializer = field 5, TensorProto.raw_data = field
9) without reading the weights: `without_raw_data` returns the message's bytes less every
initializer's `raw_data` (a few MB: nodes, names, shapes) and where each one lies in the file, and
`read_raw` reads one of them into an array of its own. Lowering then holds each weight once, plus
one tensor while it is widened from half precision.

`map_raw` goes one step further for a tensor stored as it is used (not half precision, this
machine's byte order, at least `MAP_MIN_BYTES`): the array is a read-only view onto a read-only
mapping of the file, so the weights are file-backed pages, resident only while something reads
them. `drop_mapped_pages` gives those pages back (madvise DONTNEED: the next read faults them in
again from the page cache, or the disk): a coordinator that emitted a plan from its graph holds
none of the weights it shipped (issue 32), and a re-plan reads the frozen ones from the file again.
The file must not be truncated or rewritten while the graph is in use: a read of a page past a
truncated end is SIGBUS, one of a page rewritten in place reads other weights. So each mapping
remembers the file it maps (`FileIdentity`: device, inode, size, mtime in ns, taken on the mapped
descriptor, and the SHA-256 of its bytes, read once as it is mapped) and keeps a descriptor on it;
`check_mapped_files` compares them with what the file is now, the digest read again, and raises
`ModelFileChanged` (one line naming the file) before a caller touches the pages again: every plan's
emission (a recovery's re-plan among them) and the evaluation after a run, which opens the file by
its path again. The digest catches what size and mtime do not: the file rewritten at its size with
its mtime set back (seen: it passed the identity check). Its cost is one read of the file per check
(with pread, in chunks: never through the mapping, whose pages would count in this process's
memory), and checks happen at a plan's emission, never per step.

Pure wire-format reading (numpy, the standard library, ir's error kind): the caller parses the stripped
bytes with onnx and maps spans to its initializers by position (protobuf keeps a repeated field's
order, also across merged copies of the `graph` field).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ir.errors import InputFileError
from ir.mapped_pages import drop_mapped_pages, mapping_of  # noqa: F401 (drop_mapped_pages: where the planner's callers take it from)

_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5

# ONNX TensorProto.DataType -> the numpy type of its little-endian raw_data (types of a whole number
# of bytes per element; the packed 4-bit and float8 types are left in the message for onnx to read)
RAW_DTYPES = {1: "<f4", 2: "u1", 3: "i1", 4: "<u2", 5: "<i2", 6: "<i4", 7: "<i8", 9: "?", 10: "<f2",
              11: "<f8", 12: "<u4", 13: "<u8", 16: "<u2"}
BFLOAT16 = 16


class WireError(ValueError):
    """The bytes are not the protobuf encoding this reader walks (a damaged file, or not ONNX)."""


@dataclass(frozen=True)
class RawSpan:
    """Where the `raw_data` of the graph's initializer number `index` lies in the file."""

    index: int
    offset: int
    nbytes: int


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError(f"a varint runs past byte {end}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, start of the field's tag, start of its value, end of its value)."""
    pos = start
    while pos < end:
        tag_at = pos
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(f"field number 0 at byte {tag_at}")
        if wire == _VARINT:
            _, value_end = _varint(buf, pos, end)
        elif wire == _FIXED64:
            value_end = pos + 8
        elif wire == _FIXED32:
            value_end = pos + 4
        elif wire == _LENGTH:
            length, pos = _varint(buf, pos, end)
            value_end = pos + length
        else:  # groups (3, 4): deprecated, never written by ONNX
            raise WireError(f"wire type {wire} at byte {tag_at}")
        if value_end > end:
            raise WireError(f"field {number} at byte {tag_at} runs past byte {end}")
        yield number, wire, tag_at, pos, value_end
        pos = value_end


def _message(number: int, body: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH) + _encode_varint(len(body)) + body


def _strip(buf, start: int, end: int, path: tuple[int, ...], found: list[tuple[int, int] | None]) -> bytes:
    """The message buf[start:end] re-encoded without the raw_data at the end of `path` (field
    numbers from this message down); `found` gets each initializer's raw_data span, or None."""
    out = bytearray()
    for number, wire, tag_at, value_at, value_end in _fields(buf, start, end):
        if wire == _LENGTH and path and number == path[0]:
            if len(path) == 1:  # the raw_data itself: left out, remembered (a repeated one: the last wins)
                found[-1] = (value_at, value_end - value_at)
                continue
            if len(path) == 2:  # an initializer: one entry in `found`
                found.append(None)
            out += _message(number, _strip(buf, value_at, value_end, path[1:], found))
        else:
            out += buf[tag_at:value_end]
    return bytes(out)


def without_raw_data(path: str | Path) -> tuple[bytes, list[RawSpan]]:
    """The ModelProto in the file `path` as bytes less its initializers' `raw_data`, and the spans
    those lie at in the file. Raises WireError where the file is not walkable protobuf."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        found: list[tuple[int, int] | None] = []
        stripped = _strip(view, 0, len(view), (_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA), found)
    return stripped, [RawSpan(k, *span) for k, span in enumerate(found) if span is not None]


def read_raw(f, offset: int, nbytes: int, data_type: int, dims: tuple[int, ...], widen: bool = True) -> np.ndarray:
    """The tensor of ONNX type `data_type` and shape `dims` whose little-endian bytes lie at
    `offset` of the open binary file `f`, as a new array (float16 and bfloat16 widened to float32
    where `widen`: one tensor's transient). Raises WireError for a size or type that does not fit."""
    dtype = np.dtype(RAW_DTYPES[data_type])
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if count * dtype.itemsize != nbytes:
        raise WireError(f"{nbytes} bytes of data for {count} elements of {dtype.itemsize} bytes")
    out = np.empty(count, dtype)
    f.seek(offset)
    if f.readinto(memoryview(out).cast("B")) != nbytes:
        raise WireError(f"the file ends inside a tensor's {nbytes} bytes at byte {offset}")
    if not out.dtype.isnative:
        out = out.astype(out.dtype.newbyteorder("="))
    if widen and data_type == BFLOAT16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    elif widen and data_type == 10:
        out = out.astype(np.float32)
    return out.reshape(dims)


# smaller tensors (biases, norms, shape constants) are read as their own arrays: a page of the
# mapping each would save nothing, and lowering may reshape or cast them freely
MAP_MIN_BYTES = 1 << 16


def map_raw(view: mmap.mmap, offset: int, nbytes: int, data_type: int, dims: tuple[int, ...],
            stored_piece: bool = False) -> np.ndarray | None:
    """The tensor of ONNX type `data_type` and shape `dims` at `offset` of the read-only mapping
    `view`, as a read-only array onto the mapping (no copy), or None where it must be read
    (`read_raw`): half precision (widened), another byte order, under MAP_MIN_BYTES. Raises
    WireError for a size or type that does not fit. `stored_piece`: a piece of a weight the file stores
    quantized (`planner.onnx_quantize`: its codes, float16 scales and offsets), mapped whatever its size and
    its float16 kept as it is: such a base is read in place by an engine that gives a block's pages back
    after its use, so every piece of it is file pages, none anonymous memory (SmolLM2 int4: every block
    scale array and its k / v codes lie under 64 KiB, 16 MiB of the 94 MiB base)."""
    dtype = np.dtype(RAW_DTYPES[data_type])
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if count * dtype.itemsize != nbytes:
        raise WireError(f"{nbytes} bytes of data for {count} elements of {dtype.itemsize} bytes")
    if not dtype.isnative or data_type == BFLOAT16 or (not stored_piece and (nbytes < MAP_MIN_BYTES or data_type == 10)):
        return None
    if offset + nbytes > len(view):
        raise WireError(f"the file ends inside a tensor's {nbytes} bytes at byte {offset}")
    return np.frombuffer(view, dtype, count, offset).reshape(dims)


class ModelFileChanged(InputFileError):
    """A file whose weights a run reads through a mapping was rewritten, truncated or replaced
    since it was mapped: its frozen weights are no longer the ones the run planned with."""


DIGEST_CHUNK_BYTES = 4 << 20  # what one pread of a file's digest holds


def file_sha256(fd: int, size: int) -> str:
    """The SHA-256 of the first `size` bytes of the file open as `fd`, read with pread a chunk at a
    time (the descriptor's offset untouched; no page of a mapping faulted into this process)."""
    digest, at = hashlib.sha256(), 0
    while at < size:
        chunk = os.pread(fd, min(DIGEST_CHUNK_BYTES, size - at), at)
        if not chunk:
            break
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileIdentity:
    """What a file was when it was mapped: its path, device and inode, size and modification time,
    and the SHA-256 of its bytes ("" when not taken)."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    sha256: str = ""

    @classmethod
    def of(cls, path: str | Path, st: os.stat_result, sha256: str = "") -> "FileIdentity":
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, sha256)


class FileMapping(mmap.mmap):
    """A read-only mapping of a whole file that remembers the file (`identity`) and holds a
    descriptor on the inode it maps, so a change is seen on that inode even after a rename."""

    identity: FileIdentity
    _fd: int

    def changed(self, reopened: bool = False) -> str | None:
        """What changed in the mapped file since it was mapped (None: nothing); `reopened`: also
        whether its path still names that file (a reader about to open it by its path again)."""
        was = self.identity
        now = os.fstat(self._fd)
        if now.st_size != was.size:
            return f"its size went from {was.size} to {now.st_size} bytes"
        if now.st_mtime_ns != was.mtime_ns:
            return "it was written to"
        if was.sha256 and file_sha256(self._fd, now.st_size) != was.sha256:
            return "its bytes are not the ones mapped: their SHA-256 differs, at the same size and modification time"
        if reopened:
            try:
                there = os.stat(was.path)
            except OSError:
                return "it was removed"
            if (there.st_dev, there.st_ino) != (was.device, was.inode):
                return "another file was put in its place"
        return None


def map_file(path: str | Path) -> FileMapping:
    """A read-only mapping of the whole file (kept open by the arrays `map_raw` makes onto it),
    with the file's identity taken on the same descriptor it maps."""
    with open(path, "rb") as f:
        fd = os.dup(f.fileno())
        try:
            st = os.fstat(fd)
            view = FileMapping(f.fileno(), 0, access=mmap.ACCESS_READ)
            sha256 = file_sha256(fd, st.st_size)  # once here; each check reads it again
        except BaseException:
            os.close(fd)
            raise
    view.identity = FileIdentity.of(path, st, sha256)
    view._fd = fd
    weakref.finalize(view, os.close, fd)
    return view


def check_mapped_files(values, reopened: bool = False) -> int:
    """Raise ModelFileChanged, naming the file, where one of the files that `values` (arrays;
    others skipped) are mapped from changed since it was mapped: before reading those pages again
    (a page past a truncated end would be SIGBUS, a rewritten one other weights). `reopened`: the
    caller opens the file by its path again, so its path must still name the mapped file. Returns
    how many mapped files were checked."""
    mappings = _mappings(values)
    for mapping in mappings:
        if not isinstance(mapping, FileMapping):
            continue
        why = mapping.changed(reopened)
        if why is not None:
            raise ModelFileChanged(
                f"{mapping.identity.path}: the model file changed while this run used it ({why}); its frozen weights "
                "are read from that file again during the run (a re-plan after a lost device, the evaluation): "
                "leave the file unchanged until the run ends (write a new model to another path)")
    return len(mappings)


def _mappings(values) -> list[mmap.mmap]:
    mappings = {}
    for value in values:
        mapping = mapping_of(value)
        if mapping is not None:
            mappings[id(mapping)] = mapping
    return list(mappings.values())
