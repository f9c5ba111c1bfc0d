"""Weights mapped from a file (`planner.onnx_weights.map_raw`: read-only arrays onto a read-only
mapping of the model file) are file-backed pages, resident only while something reads them:
`drop_mapped_pages` gives them back once they are read. Here, in `ir`, because both the planner
(which emits bundles from them) and the runtime's coordinator (which puts each bundle's weights file
together as it ships it, runtime.pipeline.bundles) read them, and give them back after.
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["drop_mapped_pages", "mapping_of"]


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
    advice = getattr(mmap, "MADV_DONTNEED", None)
    for mapping in mappings.values():
        if advice is not None and not mapping.closed:
            try:
                mapping.madvise(advice)
            except (OSError, ValueError):  # a platform without it: the pages stay until reclaimed
                pass
    return len(mappings)
