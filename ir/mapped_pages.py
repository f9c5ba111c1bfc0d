"""Weights mapped from a file (`planner.onnx_weights.map_raw`: read-only arrays onto a read-only
mapping of the model file) are file-backed pages, resident only while something reads them:
`drop_mapped_pages` gives them back once they are read. Here, in `ir`, because both the planner
(which emits bundles from them) and the runtime's coordinator (which puts each bundle's weights file
together as it ships it, runtime.pipeline.bundles) read them, and give them back after.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np
from numpy.lib.array_utils import byte_bounds

__all__ = ["FAULT_SPAN_BYTES", "GIVE_BACK_EVERY_S", "RELEASE_EVERY", "PagesGivenBack", "PagesGivenBackWhile",
           "drop_mapped_pages", "drop_pages_under", "gather_rows", "give_back_pages", "mapping_of",
           "read_only_mappings"]

# how many bytes read from mapped arrays before their pages are given back, by a reader that walks
# a whole model (quantizing its base, comparing its weights, copying a stage's weights file out of
# it: runtime.pipeline.bundles): its resident pages stay under this plus one chunk, not the file's size
RELEASE_EVERY = 32 << 20


def mapping_of(value) -> mmap.mmap | None:
    """The file mapping `value`'s memory lies in (a `map_raw` array or a view of one), or None."""
    while isinstance(value, np.ndarray):
        value = value.base
    if isinstance(value, memoryview):
        value = value.obj
    return value if isinstance(value, mmap.mmap) else None


def drop_mapped_pages(values) -> int:
    """Give back the resident pages of every file mapping that one of `values` (arrays; others are
    skipped) lies in: madvise DONTNEED, after which the process's resident memory no longer counts
    them and a later read faults them in again from the file. Returns how many mappings."""
    mappings = {}
    for value in values:
        mapping = mapping_of(value)
        if mapping is not None:
            mappings[id(mapping)] = mapping
    for mapping in mappings.values():
        _advise_dontneed(mapping)
    return len(mappings)


def read_only_mappings(values) -> tuple[mmap.mmap, ...]:
    """The read-only file mappings that `values` (arrays; others are skipped) lie in, each once: what
    a reader that holds them gives back with `give_back_pages` (a writable mapping's pages may hold
    what was written, anonymous memory, and are left alone)."""
    found: dict[int, mmap.mmap] = {}
    for value in values:
        mapping = mapping_of(value)
        if mapping is not None and not mapping.closed and _read_only(mapping):
            found[id(mapping)] = mapping
    return tuple(found.values())


def give_back_pages(mappings) -> None:
    """Give back the resident pages of `mappings` (`read_only_mappings`): madvise DONTNEED over each
    whole mapping, whose cost is a walk of its page table, not of its bytes."""
    for mapping in mappings:
        _advise_dontneed(mapping)


def drop_pages_under(values) -> int:
    """Give back the resident pages under each of `values` only (arrays on a read-only file mapping;
    others are skipped), not the whole mapping's: what a reader that uses a model's weights a block at
    a time gives back after each block, the rest of the file's pages left as they are. The range is
    rounded out to whole pages (a neighbour's page given back too is read again from the file when
    next used). Returns how many arrays."""
    done = 0
    for value in values:
        mapping = mapping_of(value)
        if mapping is None or mapping.closed or not isinstance(value, np.ndarray) or not _read_only(mapping):
            continue
        low, high = byte_bounds(value)
        base = np.frombuffer(mapping, np.uint8, count=1).__array_interface__["data"][0]
        start = (low - base) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(mapping), -(-(high - base) // mmap.PAGESIZE) * mmap.PAGESIZE)
        done += _advise_dontneed(mapping, start, end - start)
    return done


# The most bytes of a file mapping one read fault makes resident: Linux maps a page-cache folio whole where it
# lies in the mapping, and a file written since boot (a plan's base.safetensors) holds folios of up to a PMD,
# 2 MiB with 4 KiB pages. Measured (kernel 6.18, ext4, helper h172): one lookup of 93-102 SmolLM2 token ids
# (66-72 distinct rows of 2304 bytes) in a freshly written 108 MiB table mapped 46-50 MiB of it, 23-25 such
# spans; the same lookup in a file read in long ago by readahead mapped 3.2-3.6 MiB (64 KiB fault-around).
FAULT_SPAN_BYTES = 2 << 20


def gather_rows(table: np.ndarray, ids) -> np.ndarray:
    """`table[ids]` (rows of a C-contiguous table) where the table lies on a read-only file mapping: the rows are
    read in the order of the `FAULT_SPAN_BYTES` spans of the file they lie in, and the table's pages given back
    after each span's rows, so at most two spans of it are resident at once (a row may straddle two), not every
    span a row lies in (`FAULT_SPAN_BYTES`: 46-50 MiB of SmolLM2's table for one lookup of 128 ids). Another
    table is indexed as it is."""
    mapping = mapping_of(table)
    flat = np.asarray(ids).reshape(-1)
    if (mapping is None or mapping.closed or not _read_only(mapping) or not table.flags.c_contiguous
            or table.ndim < 1 or flat.size == 0):
        return table[ids]
    base = np.frombuffer(mapping, np.uint8, count=1).__array_interface__["data"][0]
    start = byte_bounds(table)[0] - base  # the table's offset in the file
    spans = (start + flat.astype(np.int64) * table.strides[0]) // FAULT_SPAN_BYTES
    order = np.argsort(spans, kind="stable")
    out = np.empty((flat.size,) + table.shape[1:], table.dtype)
    for group in np.split(order, np.flatnonzero(np.diff(spans[order])) + 1):
        out[group] = table[flat[group]]
        drop_pages_under([table])
    return out.reshape(np.shape(ids) + table.shape[1:])


# how often `PagesGivenBackWhile` gives a reader's pages back: a reader that streams a mapped model
# (ONNX Runtime generating over SmolLM2's mapped float32 base) faults in what it reads in between
GIVE_BACK_EVERY_S = 0.005


class PagesGivenBackWhile:
    """A context in which a thread gives back the resident pages of `mappings`
    (`read_only_mappings`) every `every` seconds, for a reader we cannot interrupt (ONNX Runtime
    reads the whole base in one run of its session): the pages are those of a read-only file
    mapping, so a page given back while it is read is faulted in again from the file, the same
    bytes. The thread holds the GIL only to call madvise (a session's run releases it)."""

    def __init__(self, mappings, every: float | None = None):
        self.mappings = tuple(mappings)
        self.every = GIVE_BACK_EVERY_S if every is None else every
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "PagesGivenBackWhile":
        if self.mappings:
            self._thread = threading.Thread(target=self._run, name="pages-given-back", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            give_back_pages(self.mappings)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        give_back_pages(self.mappings)


class PagesGivenBack:
    """Gives back the pages of the read-only file mappings a reader has read from, every `every`
    bytes it says it read (`read`), and once more when it is done (`done`): a walk over a whole
    mapped model holds `every` bytes of its pages, not the file. Arrays in memory of their own, and
    writable mappings (whose pages may hold what was written, anonymous memory), are left alone."""

    def __init__(self, every: int | None = None):
        self.every = RELEASE_EVERY if every is None else every
        self._pending = 0
        self._mappings: dict[int, mmap.mmap] = {}

    def read(self, value, nbytes: int) -> None:
        """`nbytes` of `value` (an array) were just read."""
        mapping = mapping_of(value)
        if mapping is None or mapping.closed or not _read_only(mapping):
            return
        self._mappings[id(mapping)] = mapping
        self._pending += int(nbytes)
        if self._pending >= self.every:
            self.done()

    def done(self) -> None:
        """Give back what was read so far."""
        give_back_pages(self._mappings.values())
        self._pending = 0  # the mappings are kept: pages read since without a word are given back too


def _advise_dontneed(mapping: mmap.mmap, start: int = 0, length: int | None = None) -> bool:
    """madvise DONTNEED over `mapping` (or `length` bytes of it from `start`, page-aligned): its pages no
    longer resident, a later read faulting them in again from the file. False where it could not (a closed
    mapping, a platform without the advice: the pages stay until the kernel reclaims them)."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or mapping.closed:
        return False
    try:
        if length is None:
            mapping.madvise(advice)
        else:
            mapping.madvise(advice, start, length)
    except (OSError, ValueError):
        return False
    return True


def _read_only(mapping: mmap.mmap) -> bool:
    try:
        with memoryview(mapping) as view:
            return view.readonly
    except (TypeError, ValueError):
        return False
