"""What a worker holds while it sends the coordinator the snapshot copies it keeps after a loss
(issue 32; runtime.pipeline.snapshots `send_window`, `peer_snapshot_bytes`): one window of chunks,
never a whole copy nor a whole large tensor of one, so the plan's charge for the copies does not
grow with the state and a plan with a few MiB to spare keeps its copies on the workers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.keys import KeyPair
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement, WorkerFailed
from runtime.pipeline.snapshots import peer_snapshot_bytes
from runtime.transport.zeromq import ZmqTransport

MiB = 2 ** 20
BIG = 16 * MiB  # float32 elements: a 64 MiB tensor, and AdamW's two moments of it


def _big_state() -> list[tuple[str, int, int]]:
    """Stage 0's copy: (name, elements, seed) of each tensor, generated the same on both sides."""
    return [("param/emb", BIG, 1), ("opt/adamw/m/emb", BIG, 2), ("opt/adamw/v/emb", BIG, 3),
            ("param/b", 7, 4), ("opt/adamw/m/b", 0, 5)]  # a tensor of no elements travels too


def _small_state() -> list[tuple[str, int, int]]:
    """Stage 1's own copy (its holder is stage 0, which is lost)."""
    return [("param/w", 300_001, 6), ("opt/adamw/m/w", 300_001, 7)]


def _tensor(elements: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


# The worker, in a fresh process (what earlier tests left in pytest's heap would move its peak):
# stage 1, holding stage 0's copy of snapshot 1 (192 MiB) and its own, both in files as a worker
# keeps them, answers the coordinator's orders as a worker does after a loss and prints how far its
# peak (VmHWM) rose over its resident memory before the first order.
_WORKER = r"""
import ctypes, gc, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/pipeline"]
import test_held_copy_window as t
from runtime.keys import KeyPair, PublicKey
from runtime.pipeline.executor import COORDINATOR
from runtime.pipeline.snapshots import SpooledCopy, _spool_file
from runtime.pipeline.worker import Worker
from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from runtime.transport.zeromq import ZmqTransport

pair = KeyPair.from_seed("stage1", bytes.fromhex(sys.argv[4]))
transport = ZmqTransport("stage1", "tcp://127.0.0.1:0", keys=pair.curve_keys(), linger_s=0.5,
                         accept={COORDINATOR: bytes.fromhex(sys.argv[3])})
transport.connect(COORDINATOR, sys.argv[2], key=bytes.fromhex(sys.argv[3]))
worker = Worker(transport, timeout=120)
worker.stage = 1
for key, state in (((0, 1), t._big_state()), (None, t._small_state())):
    copy = SpooledCopy(_spool_file([]))
    for name, elements, seed in state:
        copy.append(name, t._tensor(elements, seed))
        gc.collect()
    copy.finish()
    if key is None:
        worker.copies.own[1] = copy
    else:
        worker.copies.replicas[key] = copy
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("READY", transport.address, flush=True)
before = rss_bytes()
reset_peak_rss()
while True:
    _, msg = transport.recv_control(COORDINATOR, timeout=120)
    if msg.get("type") == "stop":
        break
    worker._obey(msg)
print("PEAK", peak_rss_bytes() - before, flush=True)
transport.close()
"""


@pytest.mark.slow  # a worker process writes and sends 192 MiB
def test_a_worker_sending_a_large_held_copy_after_a_loss_stays_within_its_charge(tiny_checkpoint, export_dir):
    """Over CURVE, a real worker process holding its neighbour's copy (a 64 MiB tensor and its two
    AdamW moments) is asked for it after that neighbour's loss, as a recovery asks
    (`Coordinator.fetch_held_stages`): its peak resident memory rises by no more than the plan
    charges it for the copies (`peer_snapshot_bytes`), which is well under one of the copy's
    tensors; and every tensor arrives exact. Before, it read a window of 4 whole tensors into
    memory (+192 MiB), and was charged every copy it holds instead."""
    from planner.onnx_import import load_model
    from support import ROWS, S, export_onnx

    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)
    n = len(graph.blocks)
    big_bytes = sum(4 * e for _, e, _ in _big_state())
    small_bytes = sum(4 * e for _, e, _ in _small_state())
    charge = peer_snapshot_bytes([big_bytes, small_bytes])[1]
    assert charge < 4 * BIG  # the point: a worker is not charged the copies it holds

    root = Path(__file__).resolve().parents[2]
    pair, worker_pair = KeyPair.generate("coordinator"), KeyPair.generate("stage1")
    transport = ZmqTransport("coordinator", "tcp://127.0.0.1:0", keys=pair.curve_keys(), linger_s=0.5)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root), transport.address, pair.public.curve.hex(),
                             worker_pair.seed.hex()],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "READY", proc.stderr.read()[-3000:]
        address = line[1]
        transport.connect("stage1", address, key=worker_pair.public.curve)
        placements = [StagePlacement(0, 0, 0, "tcp://127.0.0.1:9"), StagePlacement(1, 1, n - 1, address)]
        coordinator = Coordinator(placements, PipelineConfig(schedule="1f1b-flush", microbatches=2, timeout_s=120),
                                  transport, [graph, graph])
        got = {}
        for stage, rows, tensors in coordinator.fetch_held_stages(1, lost=[0]):
            for name, arr in tensors:
                got[(stage, name)] = (arr.dtype, arr.shape, np.array_equal(arr, _tensor(*_elements(stage, name))))
                del arr
        transport.send_control("stage1", {"type": "stop"})
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        transport.close()
    assert proc.returncode == 0, err[-3000:]
    want = {(0, name): (np.dtype(np.float32), (e,), True) for name, e, _ in _big_state()}
    want.update({(1, name): (np.dtype(np.float32), (e,), True) for name, e, _ in _small_state()})
    assert got == want
    peak = int(next(line for line in out.splitlines() if line.startswith("PEAK ")).split()[1])
    print(f"the worker's peak rose {peak / MiB:.1f} MiB sending {(big_bytes + small_bytes) / MiB:.0f} MiB; "
          f"charged {charge / MiB:.0f} MiB")
    assert peak <= charge, (peak / MiB, charge / MiB)


def _elements(stage: int, name: str) -> tuple[int, int]:
    for n, e, seed in (_big_state() if stage == 0 else _small_state()):
        if n == name:
            return e, seed
    raise KeyError(name)
