"""What a worker holds while it sends the coordinator the snapshot copies it keeps after a loss
(issue 32; runtime.pipeline.snapshots `send_window`): one window of chunks, never a whole copy nor
a whole large tensor of one; and the coordinator puts a tensor cut across chunks and windows
together exactly, or refuses a window whose chunks do not follow on."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.keys import KeyPair
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement, WorkerFailed
from runtime.pipeline.snapshots import FETCH_WINDOW_BYTES, peer_snapshot_bytes
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
def test_a_worker_sending_a_large_held_copy_after_a_loss_holds_one_window(tiny_checkpoint, export_dir):
    """Over CURVE, a real worker process holding its neighbour's copy (a 64 MiB tensor and its two
    AdamW moments) is asked for it after that neighbour's loss, as a recovery asks
    (`Coordinator.fetch_held_stages`): its peak resident memory rises by one window of chunks
    (`FETCH_WINDOW_BYTES`) and what the interpreter and ZeroMQ keep of it, within what the plan
    charges it for the copies (`peer_snapshot_bytes`), not by the copy's tensors; and every tensor
    arrives exact. Before, it read a window of 4 whole tensors into memory (+194.5 MiB), and was
    charged every copy it holds."""
    from planner.onnx_import import load_model
    from support import ROWS, S, export_onnx

    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)
    n = len(graph.blocks)
    big_bytes = sum(4 * e for _, e, _ in _big_state())
    small_bytes = sum(4 * e for _, e, _ in _small_state())
    # what the plan charges a worker for the copies (the larger of the shipping's working set and
    # a window): not the copies themselves
    charge = peer_snapshot_bytes([big_bytes, small_bytes])[1]
    assert FETCH_WINDOW_BYTES <= charge < BIG * 4

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


def _local_pair(graph):
    from runtime.transport.local import LocalHub, LocalTransport

    hub = LocalHub()
    worker, coord = LocalTransport("stage1", hub), LocalTransport("coordinator", hub)
    worker.connect("coordinator", coord.address)
    coord.connect("stage1", worker.address)
    n = len(graph.blocks)
    coordinator = Coordinator([StagePlacement(0, 0, 0, "local-0"), StagePlacement(1, 1, n - 1, worker.address)],
                              PipelineConfig(schedule="1f1b-flush", microbatches=2, timeout_s=10), coord, [graph, graph])
    return worker, coord, coordinator


def _tiny_graph(tiny_checkpoint, export_dir):
    from planner.onnx_import import load_model
    from support import ROWS, S, export_onnx

    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


def test_windows_that_end_inside_a_tensor_put_it_together_exactly(tiny_checkpoint, export_dir, monkeypatch):
    """Chunks of 40 bytes, windows of 100: tensors cut across chunks and windows (a 0-d one, an empty
    one, int64 among float32) arrive whole and exact, each window asked for once the last was in."""
    import runtime.pipeline.snapshots as snapshots
    from runtime.pipeline.snapshots import WindowEntry, send_window

    monkeypatch.setattr(snapshots, "CHUNK_BYTES", 40)
    worker, coord, coordinator = _local_pair(_tiny_graph(tiny_checkpoint, export_dir))
    rng = np.random.default_rng(0)
    state = [("param/a", rng.standard_normal((7, 9)).astype(np.float32)), ("opt/steps", np.array(3, np.int64)),
             ("param/e", np.zeros((0, 4), np.float32)), ("opt/m/a", rng.standard_normal(33).astype(np.float32))]
    entries = [WindowEntry.of_array(n, a) for n, a in state]
    asked = []

    def ask(first, start):
        asked.append((first, start))
        done = send_window(worker, "coordinator", "held", 0, entries, first, start, 100)
        return done

    got = list(coordinator._windowed("stage1", "held", 0, ask(0, 0), ask))
    assert [n for n, _ in got] == [n for n, _ in state]
    for (name, g), (_, w) in zip(got, state):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w)
    assert len(asked) > 4 and any(start > 0 for _, start in asked)  # windows began inside a tensor


def test_a_window_whose_chunks_do_not_follow_on_is_refused(tiny_checkpoint, export_dir, monkeypatch):
    """A worker that skips part of a tensor (or repeats one) is a failed worker: no torn tensor is
    taken into the restored state."""
    import runtime.pipeline.snapshots as snapshots
    from runtime.pipeline.snapshots import WindowEntry, send_window

    monkeypatch.setattr(snapshots, "CHUNK_BYTES", 40)
    worker, coord, coordinator = _local_pair(_tiny_graph(tiny_checkpoint, export_dir))
    entries = [WindowEntry.of_array("param/a", np.arange(30, dtype=np.float32))]
    done = send_window(worker, "coordinator", "held", 0, entries, 0, 0, 40)  # elements 0..9
    skipping = lambda first, start: send_window(worker, "coordinator", "held", 0, entries, first, start + 10, 40)
    with pytest.raises(WorkerFailed, match="not the next"):
        list(coordinator._windowed("stage1", "held", 0, done, skipping))
