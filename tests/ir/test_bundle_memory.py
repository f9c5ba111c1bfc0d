"""A bundle's weights are held once while it loads (issue 31, lever 2): `load_bundle_dir` reads each
tensor of weights.safetensors straight from the file into the array the graph keeps and streams the
file's SHA-256 as it reads, so a device never holds the file's bytes beside their decoded copies
(before, a MiniLM stage peaked at twice its weights while loading)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ir.bundle import WEIGHTS, BundleError, load_bundle_dir, read_bundle_files, verify_bundle_files
from ir.partition import Partition, StageAssignment, StageCost
from ir.safetensors import decode_safetensors, encode_safetensors, read_safetensors_hashed
from planner.emit import emit_plan
from planner.onnx_import import load_model
from planner.schedule import make_schedule

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20

_CHILD = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from ir.bundle import load_bundle_dir
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes

gc.collect()
release_free_heap()
assert reset_peak_rss()
before = rss_bytes()
contents = load_bundle_dir(sys.argv[2])
weights = sum(int(v.nbytes) for v in contents.graph.constants.values())
print("LOAD " + json.dumps({"peak_over": peak_rss_bytes() - before, "held_over": rss_bytes() - before,
                            "weights": weights}))
"""

# A worker's bundle as it arrives from the coordinator (no base file): each file a uint8 array over
# its received buffer; the weights spooled to a file and read back before verification.
_WIRE_CHILD = """
import gc, json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from ir.bundle import read_bundle_files
from runtime.pipeline.bundles import as_uint8, load_bundle, spool_weights
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes

gc.collect()
release_free_heap()
before = rss_bytes()
files = {k: np.frombuffer(bytearray(v), np.uint8) for k, v in read_bundle_files(sys.argv[2]).items()}
gc.collect()
release_free_heap()
assert reset_peak_rss()
received = rss_bytes() - before
if sys.argv[3] == "spool":
    spool_weights(files, "wire")
elif sys.argv[3] == "keep":  # as a worker spools it: into the weights it keeps for its next setup
    from runtime.pipeline.held_weights import HeldWeights
    held = HeldWeights()
    spool_weights(files, "wire", held=held)
contents = load_bundle(files, "wire")
del files
weights = sum(int(v.nbytes) for v in contents.graph.constants.values())
print("LOAD " + json.dumps({"peak_over": peak_rss_bytes() - before, "received": received, "weights": weights}))
"""


@pytest.fixture(scope="module")
def minilm_bundle(tmp_path_factory, minilm_onnx) -> Path:
    graph = load_model(minilm_onnx, 2, 16)
    out = tmp_path_factory.mktemp("plan")
    n = len(graph.blocks)
    partition = Partition((StageAssignment(0, "dev", 0, n - 1, predicted_time_s=0.1, memory_bytes=1,
                                           memory_budget_bytes=10 ** 10),), "manual")
    emit_plan(out, graph, partition, make_schedule("1f1b-flush", 1, 1), {"model": "minilm", "optimizer": "sgd",
              "lr": 1e-3}, [StageCost(0, "dev", 0.01, 0.02, 0.0, 0.0, 0.0)], predicted_step_s=0.1)
    return out / "dev"


def test_a_bundle_loads_with_its_weights_held_once(minilm_bundle):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), str(minilm_bundle)], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    load = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("LOAD "))[5:])
    assert load["weights"] > 80 * MIB  # MiniLM's 86 MiB: a second copy would be far above the noise
    # measured: peak 1.01x the weights (the graph document and imports' lazy parts); 2.0x when the
    # file's bytes were held while they were decoded
    assert load["peak_over"] <= 1.25 * load["weights"], {k: v / MIB for k, v in load.items()}
    assert load["held_over"] <= 1.15 * load["weights"], {k: v / MIB for k, v in load.items()}


def _wire_load(bundle: Path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _WIRE_CHILD, str(ROOT), str(bundle), how], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("LOAD "))[5:])


@pytest.mark.parametrize("how", ["spool", "keep"])
def test_a_received_bundle_is_spooled_so_its_weights_are_held_once(minilm_bundle, how):
    load = _wire_load(minilm_bundle, how)
    assert load["received"] > 80 * MIB
    # measured: 1.0x the weights (the received file, then the arrays read back one by one); 2.0x
    # decoded from the received buffer while it is held (below)
    assert load["peak_over"] <= 1.25 * load["weights"], {k: v / MIB for k, v in load.items()}
    whole = _wire_load(minilm_bundle, "decode")
    assert whole["peak_over"] >= 1.8 * whole["weights"], {k: v / MIB for k, v in whole.items()}


def test_a_spooled_bundle_is_the_bundle_and_an_untrusted_one_is_refused_before_parsing(minilm_bundle, tmp_path):
    from runtime.pipeline.bundles import as_uint8, load_bundle, spool_weights

    wire = {k: as_uint8(v) for k, v in read_bundle_files(minilm_bundle).items()}
    spooled = dict(wire)
    spool_weights(spooled, "wire", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the spool file is gone
    a, b = load_bundle(spooled, "wire"), load_bundle(dict(wire), "wire")
    assert a.manifest == b.manifest
    assert all(np.array_equal(a.graph.constants[k], v) for k, v in b.graph.constants.items())

    def refuse(manifest, signature):
        raise ValueError("not signed by the trusted coordinator")

    untrusted = dict(wire)
    untrusted[WEIGHTS] = as_uint8(b"garbage that is not safetensors")
    with pytest.raises(BundleError, match="refused: not signed"):
        spool_weights(untrusted, "wire", refuse)
    damaged = dict(wire)
    raw = bytearray(read_bundle_files(minilm_bundle)[WEIGHTS])
    raw[-7] ^= 0x10
    damaged[WEIGHTS] = as_uint8(bytes(raw))
    spool_weights(damaged, "wire")
    with pytest.raises(BundleError, match=r"weights.safetensors is corrupted \(sha256 mismatch"):
        load_bundle(damaged, "wire")
    damaged[WEIGHTS] = as_uint8(bytes(raw[:-9]))
    spool_weights(damaged, "wire")
    with pytest.raises(BundleError, match="weights.safetensors is corrupted"):
        load_bundle(damaged, "wire")


def test_a_bundle_read_tensor_by_tensor_is_the_bundle_read_whole(minilm_bundle):
    streamed = load_bundle_dir(minilm_bundle)
    whole = verify_bundle_files(read_bundle_files(minilm_bundle), str(minilm_bundle))
    assert streamed.manifest == whole.manifest
    assert set(streamed.graph.constants) == set(whole.graph.constants)
    for name, value in whole.graph.constants.items():
        got = streamed.graph.constants[name]
        assert np.asarray(got).dtype == np.asarray(value).dtype and np.array_equal(got, value), name
        assert np.asarray(got).flags.writeable


def test_the_streamed_hash_is_the_files_and_every_fault_is_still_named(minilm_bundle, tmp_path):
    data = (minilm_bundle / WEIGHTS).read_bytes()
    hashed = read_safetensors_hashed(minilm_bundle / WEIGHTS)
    assert hashed.sha256 == hashlib.sha256(data).hexdigest() and hashed.nbytes == len(data)
    decoded = decode_safetensors(data)
    assert sorted(hashed.tensors) == sorted(decoded)
    assert all(np.array_equal(hashed.tensors[k], decoded[k]) for k in decoded)
    # a flipped data byte: the stream's hash differs from the manifest's
    copy = tmp_path / "flipped"
    copy.mkdir()
    for f in minilm_bundle.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    (copy / WEIGHTS).write_bytes(bytes(flipped))
    with pytest.raises(BundleError, match=r"weights.safetensors is corrupted \(sha256 mismatch"):
        load_bundle_dir(copy)
    # a truncated file does not parse: read whole, it is named as it always was
    (copy / WEIGHTS).write_bytes(data[:-5])
    with pytest.raises(BundleError, match="weights.safetensors is corrupted"):
        load_bundle_dir(copy)
    bogus = tmp_path / "short.safetensors"
    bogus.write_bytes(encode_safetensors({"a": np.ones(4, np.float32)})[:-2])
    with pytest.raises(ValueError, match="short.safetensors"):
        read_safetensors_hashed(bogus)
