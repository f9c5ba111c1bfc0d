"""A process that imports the PyTorch engine gives back the pages of its libraries that only their
loading read (`runtime.library_pages`): ~80 MiB of file pages (libtorch's operator registrations)
resident in every torch worker, and in its VmHWM, though training maps ~35 MiB of them again (issue 31
target 5, benchmarks/MEMORY_NOTES.md, helper h85). Given back, they come again from the page cache
as read: the engine trains in that process as it did."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20

_PROBE = """
import json
import torch
def file_kib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssFile:')).split()[1])
loaded = file_kib()
import runtime.engines.pytorch
after = file_kib()
x = torch.arange(12.0, requires_grad=True)
(g,) = torch.autograd.grad([(x.reshape(3, 4) @ x.reshape(4, 3)).sum()], [x])
print("PROBE " + json.dumps({"loaded": loaded * 1024, "after": after * 1024, "grad": g.tolist()}))
"""


def test_importing_the_torch_engine_gives_back_its_libraries_loading_pages():
    pytest.importorskip("torch")
    if not Path("/proc/self/smaps").exists():
        pytest.skip("Linux only")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])
    # measured here: ~80 MiB of file pages after `import torch`, ~5 once the engine's import gave them back
    assert probe["loaded"] > 40 * MIB, probe
    assert probe["after"] < probe["loaded"] / 4, probe
    # d/dx sum(A @ B) with A, B views of one x: each element's row sum of B plus column sum of A
    import numpy as np

    x = np.arange(12.0)
    a, b = x.reshape(3, 4), x.reshape(4, 3)
    expected = (np.ones((3, 3)) @ b.T).reshape(-1) + (a.T @ np.ones((3, 3))).reshape(-1)
    assert np.allclose(probe["grad"], expected), probe["grad"]
