"""runtime.heap on this Linux machine: glibc's mmap threshold held fixed, so a large block freed goes
back to the OS at once instead of raising the threshold and landing the next one in the heap."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process (the test process's heap and settings would blur it): a block three times the
# steady threshold allocated and freed, then again with a small block allocated after it (which pins
# the heap's top, as a stage's next tensor does), and what freeing the second one gave back.
_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from runtime.heap import STEADY_MMAP_THRESHOLD_BYTES, steady_heap
from runtime.procfs import rss_bytes
import numpy as np
{setup}
size = 3 * STEADY_MMAP_THRESHOLD_BYTES
first = np.ones(size // 8)
del first  # glibc's default: this mapped block's size becomes the threshold
second = np.ones(size // 8)
pin = bytearray(4000)
held = rss_bytes()
del second
print(json.dumps([held - rss_bytes(), size, ok]))
"""


def _given_back(setup: str) -> tuple[int, int, bool]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup), str(ROOT)], capture_output=True, text=True,
                         timeout=120, check=True)
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def test_a_freed_large_block_goes_back_to_the_os_under_the_steady_heap():
    """With glibc's defaults the second block comes from the heap (the threshold rose when the first was
    freed) and stays resident once freed; under `steady_heap` both are mapped and unmapped on free."""
    given, size, ok = _given_back("ok = True")
    assert given < size // 2, ("glibc's dynamic threshold did not move: the reference does not hold here", given)
    given, size, ok = _given_back("ok = steady_heap()")
    assert ok
    assert given > 0.9 * size, (given, size)



def test_importing_the_torch_engine_holds_the_heap_steady():
    """A torch worker, the profile's fresh children and the profiling process all run their stage under
    the steady heap because `runtime.engines.pytorch` sets it on import: a plan's figures and a run's
    peak then come from one heap, and the run's peak repeats (the `smollm2-torch` plan's middle stage
    467-495 MiB over five runs under glibc's rising threshold, 448.7-449.7 in four under this one;
    benchmarks/MEMORY_NOTES.md, helper h57). Fails with the module's `steady_heap()` call taken out."""
    given, size, ok = _given_back("import runtime.engines.pytorch\nok = True")
    assert given > 0.9 * size, (given, size)


_SMALL_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import runtime.engines.pytorch
from runtime.procfs import rss_bytes
import numpy as np
size = 512 * 1024
block = np.ones(size // 8)
pin = bytearray(4000)
held = rss_bytes()
del block
print(json.dumps([held - rss_bytes(), size]))
"""


def test_a_threshold_the_environment_sets_is_kept_by_the_torch_engines_import():
    """glibc's MALLOC_MMAP_THRESHOLD_ in the environment fixes the threshold already, at the value its
    setter chose (64 KiB here, as tests/runtime/test_torch_weight_pass.py sets to read a W's rise):
    importing the engine keeps it, so a 512 KiB block is mapped and given back when freed, where the
    steady 2 MiB would have put it in the heap behind the pin (the weight-pass test's rise read 7.27
    MB against a bound of 7.09 in a clean-clone CI run with the import overriding it)."""
    import os

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _SMALL_PROBE, str(ROOT)], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    given, size = json.loads(out.stdout.splitlines()[-1])
    assert given > 0.9 * size, (given, size)
    # the reference: with no threshold in the environment the import's 2 MiB keeps the block in the heap
    env.pop("MALLOC_MMAP_THRESHOLD_")
    out = subprocess.run([sys.executable, "-c", _SMALL_PROBE, str(ROOT)], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    given, size = json.loads(out.stdout.splitlines()[-1])
    assert given < size // 2, ("the steady threshold did not hold the block in the heap: no reference here", given)


# In a fresh process: a row gradient of SmolLM2's tied table (49152 x 576, 108 MiB) with the rows of 4 x 128
# tokens spread over the vocabulary made dense and read whole (the checksum the exchange's send takes), as
# `StageExecutor._sum_tied` sends it, and what that added to the process's resident memory.
_DENSE_PROBE = """
import json, sys, zlib
sys.path.insert(0, sys.argv[1])
import numpy as np
from runtime.engines.base import RowGradient
from runtime.procfs import rss_bytes
ids = np.random.default_rng(0).integers(0, 49152, 512)
g = RowGradient(ids, np.random.default_rng(1).standard_normal((512, 576)).astype(np.float32), (49152, 576))
before = rss_bytes()
dense = g.dense()
zlib.crc32(memoryview(dense.reshape(-1).view(np.uint8)))
added = rss_bytes() - before
want = np.zeros((49152, 576), np.float32)
np.add.at(want, ids, g.rows)
print(json.dumps([added, bool(np.array_equal(dense, want) and dense.flags.writeable)]))
"""


def test_a_row_gradient_made_dense_holds_only_its_rows_pages():
    """The tied exchange sends a lookup stage's row gradient dense (`dense_gradient`): numpy's zeros of a
    table lie on huge pages (numpy advises them for 4 MiB and more), so each row written faulted in the
    2 MiB around it: 512 rows spread over SmolLM2's table held the whole 108 MiB, the small torch full
    fine-tuning plan's embeddings' stage ~56 MiB at its update (benchmarks/MEMORY_NOTES.md, h71). Made in
    `runtime.heap.sparse_zeros`, only the rows' small pages are resident (each row of 2304 bytes on at
    most two 4 KiB pages: 4 MiB at most), the zeros read as they are sent included, and the values are
    numpy's."""
    out = subprocess.run([sys.executable, "-c", _DENSE_PROBE, str(ROOT)], capture_output=True, text=True,
                         timeout=120, check=True)
    added, equal = json.loads(out.stdout.splitlines()[-1])
    assert equal
    assert added <= 512 * 2 * 4096 + 2**20, added / 2**20
