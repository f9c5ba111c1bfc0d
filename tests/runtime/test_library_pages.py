"""A process that imports the PyTorch engine gives back the pages of its libraries that only their
loading read (`runtime.library_pages`): ~80 MiB of file pages (libtorch's operator registrations)
resident in every torch worker, and in its VmHWM, though training maps ~35-40 MiB of them again (issue
31 target 5, benchmarks/MEMORY_NOTES.md, helpers h85 and h99). Given back, they come again from the page
cache as read: the engine trains in that process as it did.

In this process (h85's check ran a fresh interpreter: one `import torch` more of the fast tier's CPU):
the libraries' read-only pages are read back in first, as `import torch` leaves them, then given back."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

MIB = 2 ** 20


def _file_bytes() -> int:
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith("RssFile:")).split()[1])


def test_the_torch_engine_gives_back_its_libraries_loading_pages():
    torch = pytest.importorskip("torch")
    if not Path("/proc/self/smaps").exists():
        pytest.skip("Linux only")
    import runtime.engines.pytorch as engine
    from runtime.library_pages import _library_mappings, drop_library_pages

    # the engine's import gave back what torch's import had left resident (~80 MiB measured here)
    assert engine.LIBRARY_PAGES_GIVEN_BACK > 0
    # every read-only, never-written library mapping read through, as a library's loading reads it
    for lo, hi, _ in _library_mappings(resident_only=False):
        ctypes.string_at(lo, hi - lo)
    loaded = _file_bytes()
    given = drop_library_pages()
    after = _file_bytes()
    assert loaded > 40 * MIB, loaded
    assert after < loaded / 4, (loaded / MIB, after / MIB)
    assert given >= (loaded - after) / 2, (given / MIB, loaded / MIB, after / MIB)
    # d/dx sum(A @ B) with A, B views of one x: each element's row sum of B plus column sum of A
    x = torch.arange(12.0, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad([(x.reshape(3, 4) @ x.reshape(4, 3)).sum()], [x])
    a, b = np.arange(12.0).reshape(3, 4), np.arange(12.0).reshape(4, 3)
    expected = (np.ones((3, 3)) @ b.T).reshape(-1) + (a.T @ np.ones((3, 3))).reshape(-1)
    assert np.array_equal(g.numpy(), expected), g
