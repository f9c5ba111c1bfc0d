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


def test_the_engine_term_charges_the_library_pages_a_training_step_maps_again():
    """The torch engine's plan term (`runtime.profiling.memory.engine_overhead_bytes`) adds what a small
    training step maps again of the pages given back (`runtime.profiling.training_probe`): measured after the
    import alone, the term fell ~60 MiB with the drop where a training worker fell ~35, and a worker ran over
    its plan (tests/jobs/test_torch_per_block_plan.py: 411.7 MiB against 406.0; benchmarks/MEMORY_NOTES.md,
    helper h104). Here, in this process: the pages given back, the probe's steps map some of them again (the
    kernels, autograd's, the update's: ~15 MiB measured), which is what the probe's PAGES figure reads."""
    pytest.importorskip("torch")
    if not Path("/proc/self/smaps").exists():
        pytest.skip("Linux only")
    import runtime.engines.pytorch as engine
    from runtime.library_pages import _library_mappings, drop_library_pages
    from runtime.profiling.training_probe import training_step_probe

    drop_library_pages()
    before = sum(rss for _, _, rss in _library_mappings()) * 1024
    training_step_probe("torch:cpu:t1")
    mapped_again = sum(rss for _, _, rss in _library_mappings()) * 1024 - before
    # some of the pages, not all: the import's loading read ~60 MiB, a step's kernels a part of it
    print(f"mapped again {mapped_again / MIB:.1f} MiB of {engine.LIBRARY_PAGES_GIVEN_BACK / MIB:.1f} given back")
    assert 4 * MIB < mapped_again < engine.LIBRARY_PAGES_GIVEN_BACK, (mapped_again / MIB, engine.LIBRARY_PAGES_GIVEN_BACK / MIB)
