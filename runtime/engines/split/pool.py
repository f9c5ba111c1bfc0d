"""The child processes of a head split: a backend's piece served in its own process, commands over a
pipe, arrays through shared memory (`runtime.engines.split.shm`), children started by a fork server
that imported this module (and with it MNN) once."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from multiprocessing import shared_memory
from typing import Mapping

import numpy as np

from runtime.engines.split.pieces import HeadRange, Piece, PieceShapes, slice_weights
from runtime.engines.split.shm import inputs_layout, release, worker_layout

def worker_main(conn, backend: str, count: int, shapes: PieceShapes, inputs_name: str, own_name: str,
                 stash_weights: bool) -> None:
    """A child process's loop: build the piece from the weights in shared memory, then serve."""
    inputs_shm = shared_memory.SharedMemory(name=inputs_name)
    own_shm = shared_memory.SharedMemory(name=own_name)
    try:
        serve(conn, backend, count, shapes, inputs_shm, own_shm, stash_weights)
    finally:
        for shm in (inputs_shm, own_shm):
            try:
                shm.close()
            except BufferError:
                pass
        conn.close()


def serve(conn, backend: str, count: int, shapes: PieceShapes, inputs_shm, own_shm, stash_weights: bool) -> None:
    inputs = inputs_layout(shapes).views(inputs_shm.buf)
    own = worker_layout(shapes, count).views(own_shm.buf)
    params = [k[2:] for k in own if k.startswith("w_")]

    def weights() -> dict[str, np.ndarray]:
        return {p: own["w_" + p].copy() for p in params}

    try:
        piece = Piece(backend, count, shapes, weights(), stash_weights)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", 0.0))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:  # the parent is gone
            return
        if cmd[0] == "close":
            conn.send(("ok", 0.0))
            return
        start = time.perf_counter()
        try:
            if cmd[0] == "forward":
                # copies: the engines stash their inputs until the backward, and the parent
                # overwrites the shared buffers with the next micro-batch's
                y = piece.forward(inputs["x"].copy(), inputs["mask"].copy(), cmd[1], cmd[2])
                np.copyto(own["y"], y)
            elif cmd[0] == "backward":
                dx, grads = piece.backward(inputs["dy"].copy(), cmd[1])
                np.copyto(own["dx"], dx)
                for p in params:
                    np.copyto(own["g_" + p], grads[p])
            elif cmd[0] == "set_weights":
                # the engine stashes the old slices for micro-batches in flight (module docstring)
                piece.set_weights(weights())
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", time.perf_counter() - start))


_CONTEXT = None


def context():
    """A fork server that imported this module (MNN, numpy) once: children start in ~0.1 s and
    inherit the denormal flushing, without inheriting any engine threads of this process."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(["runtime.engines.split.attention"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


class ProcessWorker:
    """A backend's piece in a child process; commands go over a pipe, arrays through shared memory."""

    def __init__(self, r: HeadRange, shapes: PieceShapes, inputs_shm: shared_memory.SharedMemory,
                 slices: Mapping[str, np.ndarray], start_timeout_s: float, stash_weights: bool = True):
        self.range = r
        self.layout = worker_layout(shapes, r.count)
        self.shm = shared_memory.SharedMemory(create=True, size=self.layout.nbytes)
        self.views = self.layout.views(self.shm.buf)
        self._write_weights(slices)
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, name=f"head-split {r.backend}", daemon=True,
                                args=(child, r.backend, r.count, shapes, inputs_shm.name, self.shm.name,
                                      stash_weights))
        self.busy_s = 0.0
        self._pending: str | None = "start"
        try:
            self.proc.start()
            child.close()
            self.wait(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _write_weights(self, slices: Mapping[str, np.ndarray]) -> None:
        for p, v in slices.items():
            np.copyto(self.views["w_" + p], v)

    def send(self, *cmd) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{self.range.backend}: command {cmd[0]!r} while {self._pending!r} is unanswered")
        self.conn.send(cmd)
        self._pending = cmd[0]

    def wait(self, timeout_s: float | None = None) -> float:
        """The answer to the last command: the child's compute seconds (raises the child's error)."""
        what, self._pending = self._pending, None
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.range.backend} did not answer {what!r} within {timeout_s} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the process of backend {self.range.backend} died during {what!r} "
                               f"(exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"backend {self.range.backend} failed in {what!r}:\n{payload}")
        self.busy_s = float(payload)
        return self.busy_s

    def set_weights(self, slices: Mapping[str, np.ndarray]) -> None:
        self._write_weights(slices)
        self.send("set_weights")

    def gradients(self) -> dict[str, np.ndarray]:
        return {k[2:]: v for k, v in self.views.items() if k.startswith("g_")}

    def close(self) -> None:
        self.views = {}
        close_worker(self.conn, self.proc, self.shm)


def close_worker(conn, proc, shm) -> None:
    try:
        if proc.is_alive():
            conn.send(("close",))
            if conn.poll(10):
                conn.recv()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    except (OSError, EOFError, BrokenPipeError):
        pass
    finally:
        conn.close()
        release(shm)


def child_peak_rss(backend: str, heads: int, shapes: PieceShapes, weights: Mapping[str, np.ndarray],
                   mask: np.ndarray, start_timeout_s: float = 120.0, seed: int = 0) -> int | None:
    """Peak resident bytes (VmHWM) of one split child holding units 0..`heads`-1 of a block with
    full `weights`, started exactly as `SplitAttention` starts one and made to run one training
    forward and one backward; None where /proc cannot tell. What the profiler charges for every
    child a head split adds to a device."""
    rng = np.random.default_rng(seed)
    r = HeadRange(backend, 0, int(heads))
    layout = inputs_layout(shapes)
    inputs_shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
    try:
        inputs = layout.views(inputs_shm.buf)
        inputs["x"][...] = rng.standard_normal(inputs["x"].shape)
        inputs["mask"][...] = mask
        inputs["dy"][...] = 1e-3 * rng.standard_normal(inputs["dy"].shape)
        del inputs
        worker = ProcessWorker(r, shapes, inputs_shm, slice_weights(weights, r, shapes.head_size, shapes.attention),
                               start_timeout_s)
        try:
            worker.send("forward", 0, True)
            worker.wait(start_timeout_s)
            worker.send("backward", 0)
            worker.wait(start_timeout_s)
            return _process_peak_rss(worker.proc.pid)
        finally:
            worker.close()
    finally:
        release(inputs_shm)


def _process_peak_rss(pid: int) -> int | None:
    """VmHWM of process `pid` (None where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
