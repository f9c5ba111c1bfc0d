"""The project's one safetensors codec: weights in bundles and checkpoints, tensors for exports.

safetensors is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw little-endian bytes. This codec is written against that format
with `json` and `numpy.frombuffer` only (no pickle, and `ir` keeps to the standard library and
numpy, as DESIGN.md requires); tests check it against the `safetensors` package in both directions.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
              "BOOL": "bool"}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit


def _checked_arrays(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} cannot be stored in safetensors")
        arr = np.asarray(value)
        if arr.dtype.name not in _ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot hold "
                             f"(supported: {', '.join(sorted(_ST_CODES))})")
        arrays[name] = arr
    return arrays


def _layout(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """(the 8-byte length and padded header of a file of `arrays`, their names in file order)."""
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        arr = arrays[name]
        size = int(arr.size) * arr.dtype.itemsize
        header[name] = {"dtype": _ST_CODES[arr.dtype.name], "shape": [int(d) for d in arr.shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header = {"__metadata__": dict(metadata), **header}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def _raw(arr: np.ndarray) -> np.ndarray:
    # an explicit little-endian dtype, not ascontiguousarray alone, which turns 0-d into 1-d
    return np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of `tensors` (and the header's `__metadata__` strings, e.g.
    {"format": "pt"} as transformers writes); deterministic, so equal weights give equal hashes.

    Tensors are laid out widest dtype first, then by name (as the safetensors package does), so
    every tensor starts aligned to its item size; the header is padded with spaces to 8 bytes."""
    arrays = _checked_arrays(tensors)
    prefix, order = _layout(arrays, metadata)
    # joined from views of the arrays: the file's bytes are the one copy made (tobytes() per tensor
    # and `prefix + ...` held a stage's weights three times over while a bundle was built)
    return b"".join([prefix, *(_raw(arrays[name]).reshape(-1).view(np.uint8) for name in order)])


def assemble_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                         after_each: Callable[[int], None] | None = None) -> bytearray:
    """`encode_safetensors(tensors, metadata)`'s bytes, copied into one buffer a tensor at a time,
    `after_each(bytes copied so far)` called after each tensor: a caller whose tensors are mapped
    from a file gives their pages back as it goes (runtime.pipeline.bundles), so putting a stage's
    weights file together holds the file and a tensor's pages, not the file and every page read."""
    arrays = _checked_arrays(tensors)
    prefix, order = _layout(arrays, metadata)
    sizes = [int(arrays[name].size) * arrays[name].dtype.itemsize for name in order]
    out = bytearray(len(prefix) + sum(sizes))
    view = memoryview(out)
    view[:len(prefix)] = prefix
    at = len(prefix)
    for name, size in zip(order, sizes):
        if size:
            view[at:at + size] = _raw(arrays[name]).reshape(-1).view(np.uint8)
            at += size
        if after_each is not None:
            after_each(at)
    view.release()
    return out


@dataclass(frozen=True, eq=False)
class HashedTensors:
    """The tensors of a safetensors file that was never put together as one buffer, with the
    SHA-256 that file's bytes (`encode_safetensors(tensors)`) have: what a worker checks against a
    manifest when it assembles a stage's weights from pieces (`hash_tensors`)."""

    tensors: Mapping[str, np.ndarray]
    sha256: str
    nbytes: int


# how many bytes of mapped tensors `hash_tensors(give_back=True)` reads before it gives their pages back
_HASH_CHUNK = 8 << 20


def hash_tensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                 give_back: bool = False) -> HashedTensors:
    """`tensors` with the SHA-256 of `encode_safetensors(tensors, metadata)`, hashed one tensor at a
    time in file order: every byte the file would hold is hashed, and no second copy is made. With
    `give_back`, the pages of tensors that lie on a read-only file mapping (`map_safetensors`) are given
    back as the hash reads them (`ir.mapped_pages.PagesGivenBack`), every `_HASH_CHUNK` bytes: a stage's
    mapped base is resident a chunk at a time while it is checked, not whole (nor one whole tensor: SmolLM2's
    stage 0 over its mapped base peaked at 219-247 MiB in its set-up, planned 206, hashing the 108 MiB table)."""
    from ir.mapped_pages import PagesGivenBack

    arrays = _checked_arrays(tensors)
    prefix, order = _layout(arrays, metadata)
    digest = hashlib.sha256(prefix)
    total = len(prefix)
    pages = PagesGivenBack(_HASH_CHUNK) if give_back else None
    for name in order:
        raw = _raw(arrays[name])
        if raw.size:
            flat = raw.reshape(-1).view(np.uint8)
            if pages is None:
                digest.update(flat)
            else:  # a chunk at a time: one tensor read whole held it resident (SmolLM2's 108 MiB table)
                for start in range(0, flat.size, _HASH_CHUNK):
                    digest.update(flat[start:start + _HASH_CHUNK])
                    pages.read(arrays[name], min(_HASH_CHUNK, flat.size - start))
            total += raw.nbytes
    if pages is not None:
        pages.done()
    return HashedTensors(dict(tensors), digest.hexdigest(), total)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _spans(header_bytes: bytes, data_len: int) -> list[tuple[int, int, str, np.dtype, tuple[int, ...]]]:
    """The checked byte ranges (begin, end, name, dtype, shape) of a header over `data_len` data
    bytes, in file order: they must tile the data exactly."""
    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("header __metadata__ is not an object of strings")
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or sorted(entry) != ["data_offsets", "dtype", "shape"]:
            raise ValueError(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(sorted(_ST_DTYPES))}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
        np_dtype = np.dtype(_ST_DTYPES[dtype]).newbyteorder("<")
        if offsets[1] - offsets[0] != math.prod(shape) * np_dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {dtype}{shape} needs {math.prod(shape) * np_dtype.itemsize} bytes, "
                             f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name, np_dtype, tuple(shape)))
    spans.sort()
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != data_len:
        raise ValueError(f"tensors cover {end} data bytes, the file holds {data_len}")
    return spans


def _header_length(prefix: bytes, total: int) -> int:
    if total < 8:
        raise ValueError(f"{total} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(prefix[:8], "little")
    if n > min(_ST_MAX_HEADER, total - 8):
        raise ValueError(f"header length {n} exceeds the {total - 8} bytes that follow it")
    return n


def _array(raw, name: str, np_dtype: np.dtype, shape: tuple[int, ...], copy: bool = True) -> np.ndarray:
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    if np_dtype == np.bool_ and arr.size and not np.isin(arr.view(np.uint8), (0, 1)).all():
        raise ValueError(f"tensor {name!r}: BOOL bytes other than 0 and 1")
    native = np_dtype.newbyteorder("=")
    if not copy and arr.dtype == native:
        return arr
    return arr.astype(native, copy=True)


def decode_safetensors(data: bytes | memoryview, copy: bool = True) -> dict[str, np.ndarray]:
    """Parse safetensors bytes (or any flat buffer: read, never copied whole, since a stage's
    weights file arrives as one and may be hundreds of MB) strictly (header, dtypes, shapes, byte
    ranges that tile the data exactly); returns writable copies, or with `copy` False arrays that
    are views onto `data` (read-only over bytes; a big-endian host still gets copies): for a reader
    that only checks them while it holds the bytes anyway. ValueError says what is wrong."""
    data = memoryview(data).cast("B")
    n = _header_length(data, len(data))
    buffer = data[8 + n :]
    spans = _spans(bytes(data[8 : 8 + n]), len(buffer))
    return {name: _array(buffer[begin:stop], name, np_dtype, shape, copy)
            for begin, stop, name, np_dtype, shape in spans}


def safetensors_names(path: str | Path) -> list[str]:
    """The tensor names of a safetensors file, from its checked header alone."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        total = Path(path).stat().st_size
        n = _header_length(prefix, total)
        return [name for _, _, name, _, _ in _spans(f.read(n), total - 8 - n)]


def _read_array(f, name: str, np_dtype: np.dtype, shape: tuple[int, ...], digest=None) -> np.ndarray:
    """The tensor at `f`'s position read straight into an array of its own (no bytes object beside
    it: one tensor is never held twice), its bytes fed to `digest` as they are read."""
    arr = np.empty(shape, dtype=np_dtype)
    raw = arr.reshape(-1).view(np.uint8)
    view = memoryview(raw)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"tensor {name!r}: the file ends {len(view) - got} bytes early")
        got += n
    if digest is not None and raw.size:
        digest.update(raw)
    if np_dtype == np.bool_ and arr.size and not np.isin(raw, (0, 1)).all():
        raise ValueError(f"tensor {name!r}: BOOL bytes other than 0 and 1")
    if np_dtype.byteorder not in ("=", "|") and np_dtype != np_dtype.newbyteorder("="):
        arr = arr.astype(np_dtype.newbyteorder("="))  # a big-endian host: one tensor at a time
    return arr


def _source(source) -> tuple[object, str]:
    """A path, or an open binary file (read from its start; left open), and how errors name it."""
    if hasattr(source, "read"):
        return source, str(getattr(source, "name", "<file>"))
    return Path(source), str(Path(source))


@contextlib.contextmanager
def _opened(source):
    if hasattr(source, "read"):
        source.seek(0)
        yield source
    else:
        with open(source, "rb") as f:
            yield f


def read_safetensors_hashed(path: str | Path, mapped=()) -> HashedTensors:
    """Every tensor of a safetensors file, each read straight from the file into its own array,
    with the SHA-256 of the file's bytes streamed as they are read: a stage's weights are held
    once, never as the file's bytes and their decoded copies together (a bundle's weights file can
    be hundreds of MB on a device with little more). ValueError names the file and what is wrong
    (checked as `decode_safetensors` checks).

    Those also in `mapped` (float32 tensors, on a little-endian host) are read-only views onto a
    read-only mapping of the file, as `load_safetensors_subset`'s: their bytes are hashed through
    one `_HASH_CHUNK` buffer read from the file (the page cache's, not this process's resident
    memory), not read into arrays: a pipeline worker without the plan's base file maps the frozen
    weights it received from its spooled copy (runtime.pipeline.held_weights), as one holding the
    base file maps them from that. The file must not change while the views live."""
    path, label = _source(path)
    try:
        with _opened(path) as f:
            total = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = _header_length(prefix, total)
            header = f.read(n)
            spans = _spans(header, total - 8 - n)
            digest = hashlib.sha256(prefix)
            digest.update(header)
            viewed = {name for _, _, name, np_dtype, _ in spans if name in set(mapped)
                      and np_dtype == np.dtype("<f4")} if sys.byteorder == "little" else set()
            mapping = _read_only_mapping(f) if viewed and total else None
            tensors = {}
            for begin, stop, name, np_dtype, shape in spans:
                if mapping is not None and name in viewed:
                    _hash_span(f, stop - begin, name, digest)
                    tensors[name] = np.frombuffer(mapping, np_dtype, (stop - begin) // np_dtype.itemsize,
                                                  8 + n + begin).reshape(shape)
                    continue
                tensors[name] = _read_array(f, name, np_dtype, shape, digest)
            if f.read(1):
                raise ValueError("the file grew while it was read")
            return HashedTensors(tensors, digest.hexdigest(), total)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None


def _hash_span(f, size: int, name: str, digest) -> None:
    """The next `size` bytes of `f` fed to `digest` through one buffer of at most `_HASH_CHUNK` bytes."""
    buf = bytearray(min(size, _HASH_CHUNK))
    view = memoryview(buf)
    left = size
    while left:
        got = f.readinto(view[:min(left, len(buf))])
        if not got:
            raise ValueError(f"tensor {name!r}: the file ends {left} bytes early")
        digest.update(view[:got])
        left -= got


def load_safetensors_subset(path: str | Path, names, mapped=()) -> dict[str, np.ndarray]:
    """The tensors `names` of a safetensors file, reading only their bytes (a base model's file
    can be far larger than what one stage needs). Those also in `mapped` (a path's float32 tensors
    only) are read-only views onto a read-only mapping of the file, not read: their pages are resident
    only while something reads them (`ir.mapped_pages`; a pipeline stage that reads its frozen base a
    block at a time, runtime.pipeline.bundles). ValueError names the file and what is wrong, a name it
    lacks included."""
    path, label = _source(path)
    try:
        with _opened(path) as f:
            total = os.fstat(f.fileno()).st_size
            n = _header_length(f.read(8), total)
            where = {name: (begin, stop, dt, shape) for begin, stop, name, dt, shape in _spans(f.read(n), total - 8 - n)}
            missing = sorted(set(names) - set(where))
            if missing:
                raise ValueError(f"it holds no tensor {missing[0]!r} ({len(missing)} of the {len(set(names))} asked for "
                                 f"are missing)")
            viewed = {name for name in mapped if name in where and where[name][2] == np.dtype("<f4")} \
                if isinstance(path, Path) and sys.byteorder == "little" else set()
            mapping = _read_only_mapping(f) if viewed and total else None
            out = {}
            for name in names:
                begin, stop, np_dtype, shape = where[name]
                if mapping is not None and name in viewed:
                    out[name] = np.frombuffer(mapping, np_dtype, (stop - begin) // np_dtype.itemsize,
                                              8 + n + begin).reshape(shape)
                    continue
                f.seek(8 + n + begin)
                out[name] = _read_array(f, name, np_dtype, shape)
            return out
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None


def _read_only_mapping(f):
    """A read-only mapping of the whole open file `f` (the arrays viewing it keep it alive)."""
    import mmap

    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


_FLOAT_CODES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16: its bit patterns


@dataclass(frozen=True)
class FileTensor:
    """A float tensor of a safetensors file, read (and widened to float32) only when asked: an export
    streams a checkpoint's weights one at a time instead of holding them all widened. `shape`,
    `dtype` (float32: what `read` gives) and `nbytes` answer as the float32 array would."""

    path: Path
    name: str
    stored: str  # the file's dtype code: F32, F16 or BF16
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    dtype = np.dtype(np.float32)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def read(self) -> np.ndarray:
        """The tensor as a float32 array of its own: F16 and BF16 widened exactly (bfloat16 is float32's
        upper half) a chunk at a time, so nothing but the float32 array and a few MiB is held."""
        return self._read_flat(0, self.size).reshape(self.shape)

    def read_rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows `lo:hi` (of the first dimension) as a float32 array of their own, as `read` widens them."""
        row = math.prod(self.shape[1:])
        lo, hi = max(0, lo), min(self.shape[0], hi)
        return self._read_flat(lo * row, max(0, hi - lo) * row).reshape((max(0, hi - lo),) + tuple(self.shape[1:]))

    def row_chunks(self, max_bytes: int = 4 << 20):
        """(lo, hi) row ranges covering the tensor whose float32 is at most `max_bytes` (a row at least):
        a writer widens one at a time instead of the whole tensor."""
        rows = self.shape[0] if self.shape else 1
        step = max(1, max_bytes // max(4 * math.prod(self.shape[1:]), 1))
        return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]

    def _read_flat(self, first: int, count: int) -> np.ndarray:
        """`count` elements from the `first` (in the tensor's row-major order), widened to float32."""
        out = np.empty(count, np.float32)
        flat = out
        stored = np.dtype(_FLOAT_CODES[self.stored]).newbyteorder("<")
        step = _READ_CHUNK // stored.itemsize
        with open(self.path, "rb") as f:
            f.seek(self.offset + first * stored.itemsize)
            for lo in range(0, flat.size, step):
                part = flat[lo:lo + step]
                raw = part.view(np.uint8)[: part.size * stored.itemsize]  # read into the output's own bytes
                view, got = memoryview(raw), 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{self.path}: tensor {self.name!r}: the file ends early")
                    got += n
                if self.stored == "BF16":  # the chunk's first half holds its bit patterns: widen back to front
                    bits = raw.view(stored).copy()
                    np.left_shift(bits, 16, out=part.view(np.uint32), dtype=np.uint32)
                elif self.stored == "F16":
                    part[...] = raw.view(stored).copy()
                elif sys.byteorder == "big":  # the file is little-endian
                    part.byteswap(inplace=True)
        return out


_READ_CHUNK = 4 << 20  # bytes of the file read at a time


def safetensors_float_tensors(path: str | Path) -> dict[str, FileTensor]:
    """The float tensors (F32, F16, BF16) of a safetensors file, from its checked header alone (the
    bytes are read by `FileTensor.read`); the file's other tensors are left out."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            total = path.stat().st_size
            n = _header_length(f.read(8), total)
            header_bytes = f.read(n)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:  # BF16 is read here (as its bit patterns) though the codec does not write it
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
        codes = {k: v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
        as_u16 = {k: ({**v, "dtype": "U16"} if isinstance(v, dict) and v.get("dtype") == "BF16" else v)
                  for k, v in header.items()}
        checked = json.dumps(as_u16).encode()
        spans = _spans(checked, total - 8 - n)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid safetensors file: {exc}") from None
    return {name: FileTensor(path, name, codes[name], shape, 8 + n + begin)
            for begin, _, name, _, shape in spans if codes[name] in _FLOAT_CODES}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path` atomically (a partial file never takes the name)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(encode_safetensors(tensors, metadata))
    tmp.replace(path)


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file; ValueError names the file and what is wrong with it."""
    path = Path(path)
    try:
        return decode_safetensors(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"{path}: not a valid safetensors file: {exc}") from None
