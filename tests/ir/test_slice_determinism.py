"""A plan's bytes do not depend on the interpreter's string hashing: the graph slices in its bundles
(ir.serialize.slice_graph) list their values and constants in an order of their own, so two processes
with different PYTHONHASHSEED emit byte-identical bundles of the same model and cut."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# emits a 2-stage plan of the model in memory and prints each bundle's manifest and graph.json digest
SCRIPT = """
import hashlib, sys
from ir.partition import Partition, StageAssignment
from planner.emit import emit_in_memory
from planner.onnx_import import load_model
from planner.schedule import make_schedule
g = load_model(sys.argv[1], 2, 12)
n = len(g.blocks)
emitted = emit_in_memory(g, Partition((StageAssignment(0, "a", 0, 1), StageAssignment(1, "b", 2, n - 1)), "manual"),
                         make_schedule("1f1b-flush", 2, 2), {"model": "tiny"})
for device, files in emitted.bundles.items():
    print(device, files["manifest.json"].hex(), hashlib.sha256(files["graph.json"]).hexdigest())
"""


def _emit(model: Path, seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_bundles_are_the_same_bytes_whatever_the_hash_seed(tiny_onnx):
    model = tiny_onnx["torchscript-17"]
    first = _emit(model, "0")
    assert first.count("\n") == 2
    assert _emit(model, "1") == first
