"""Shared libraries' pages that only their loading read, given back (`drop_library_pages`).

A process that imports torch maps ~80 MiB of its libraries' files (libtorch_cpu 48, libtorch_python
12, libpython, numpy's...), nearly all of it read once: libtorch's static initialisers, which register
every operator it holds, and the import's module set-up. Those pages stay resident (RssFile, counted in
the process's VmRSS and VmHWM) though a stage's training touches ~35 MiB of them (MiniLM's stage 0 under
zb-h1: RssFile 99 MiB at its peak, 38 with them given back; benchmarks/MEMORY_NOTES.md, helper h85).

`MADV_DONTNEED` over a private file mapping that no write ever touched (no `w` in its permissions,
no anonymous page in it: nothing copied on write) only unmaps its pages: the next read maps them again
from the page cache, the same bytes, a minor fault. A mapping with anonymous pages (relocated data,
`.data.rel.ro`) is left alone: its pages hold what the loader wrote, which the file does not.

Linux only (/proc/self/smaps, glibc's `madvise`); elsewhere nothing is done.
"""
from __future__ import annotations

import ctypes
import re

_MADV_DONTNEED = 4
_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
_LIBRARY = re.compile(r"\.so(\.|$)")


# torch's own libraries (libtorch_cpu ~52 MiB resident after the import, libtorch_python ~11, libc10):
# ~65 of the ~86 MiB of library pages a torch worker holds. The others (libpython, MNN's, numpy's, libc,
# libstdc++: ~3 MiB each at most) are left: every step reads most of them, and in the profiling process,
# which imports this engine before it measures MNN, MNN's first run mapped its own pages again (1.5 MiB, read
# as an MNN start-up: tests/planner/test_engine_choice.py, helper h99).
TORCH_LIBRARIES = "/torch/"


def _library_mappings(resident_only: bool = True, under: str = TORCH_LIBRARIES) -> list[tuple[int, int, int]]:
    """(start, end, resident KiB) of each read-only, never-written mapping of a shared library whose path
    holds `under` (with a page resident, unless `resident_only` is False)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _VMA.match(line)
            if m:
                cur = None
                if m.group(3)[:2] == "r-" and _LIBRARY.search(m.group(4)) and under in m.group(4):
                    cur = [int(m.group(1), 16), int(m.group(2), 16), 0, None]
                    out.append(cur)
            elif cur is not None and line.startswith("Rss:"):
                cur[2] = int(line.split()[1])
            elif cur is not None and line.startswith("Anonymous:"):
                cur[3] = int(line.split()[1])
    return [(lo, hi, rss) for lo, hi, rss, anon in out if anon == 0 and (rss or not resident_only)]


def drop_library_pages(under: str = TORCH_LIBRARIES) -> int:
    """Unmap the resident pages of the read-only, never-written mappings of every shared library whose
    path holds `under` (torch's); the bytes given back (0 where the system has no /proc/self/smaps or no
    `madvise`)."""
    try:
        mappings = _library_mappings(under=under)
        libc = ctypes.CDLL(None)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for lo, hi, rss in mappings:
        if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            dropped += rss * 1024
    return dropped
