"""One attention block's heads split across compute backends that run at the same time.

Why a split is exact. With x @ W weights, head j of the attention block reads only the columns
j*hs:(j+1)*hs of Wq, Wk, Wv (and of their biases) and feeds only the rows j*hs:(j+1)*hs of Wo. So a
backend given a contiguous range of heads computes, from the full input x, its heads' Q/K/V
projections (column slices), their attention, and its share of the output projection (a row
slice); the block's output is the sum of the backends' partial outputs plus the output bias, which
is added once, here, after the sum (the attention piece of `runtime.profiling.compute` has no output bias).
Backward is the reverse: every backend receives the whole dy, returns the gradients of its slices,
which are scattered back into full-size arrays, and its partial dx; dx is the sum of the partials,
because x feeds every backend. The output bias's gradient is dy summed over batch and sequence.
Only the order of the float32 sums differs from the unsplit block.

One place of truth. `SplitAttention` keeps the full weights (float32 numpy); the backends hold
copies of their slices. `set_weights(full)` (after an optimizer step on the full arrays) re-slices
and pushes every slice, so the backends never drift apart.

Weight stashing (PipeDream). `set_weights` may come while forwards wait for their backwards (the
asynchronous 1f1b-stash schedule); each such backward must use the slices its forward used. Every
backend's engine already keeps them, in whichever process it runs: `MnnStageEngine` with
`stash_weights` saves the version a micro-batch in flight used and swaps it in for that backward,
and `TorchStageEngine` replaces its tensors on an update, so a pending forward keeps the ones it
ran with. The output bias needs no old version: its gradient, dy summed, does not read a weight.
So this class keeps only the current full weights; an old version lives, sliced, in the backends.
`stash_weights=False` turns the MNN backends' stashing off (a reference that shows it matters;
torch backends cannot turn theirs off).

Each backend runs the attention piece of `runtime.profiling.compute.attention_piece` (an IR graph) on the
stage engine of its kind: `MnnStageEngine` for `mnn:cpu:tN`, `TorchStageEngine` for `torch:cpu:tN`.

Concurrency, measured (2-vCPU x86-64 VM, MiniLM attention piece, 12 heads, batch 8, seq 128, one
engine thread): a Python "heartbeat" thread that wakes every 0.5 ms while an engine computes
three forward+backward passes in the main thread got
  * MNN:   7 heartbeats in 0.510 s, longest gap 109 ms (a whole backward): MNN keeps the GIL for
           the whole of a graph evaluation (`Var.read`), so no other Python thread runs meanwhile;
  * torch: 253 heartbeats in 0.203 s, longest gap 5.6 ms (the interpreter's switch interval):
           torch releases the GIL inside its ops.
Consequently two backends in two threads of one process do not overlap when one of them is MNN
(MNN t1 + torch t1 in two threads: 0.518 s against 0.459 s one after the other); the torch
thread stalls whenever it needs the GIL between its ops. And MNN's thread count is process-wide
(`K.set_threads` sets the global executor's), as is torch's, so two backends of one engine with
different thread counts cannot share a process either. Hence: one backend runs in this process
(a torch one if the split has any, since its engine's thread count is set when it is built and
torch needs no GIL to compute), every other backend runs in its own child process, each with its
own engine settings. Inputs (x, mask, dy) go to the children through one shared-memory block
written once per call; each child writes its partial output, partial dx and slice gradients into
its own shared-memory block, and only small command tuples cross the pipes. The children are
started by a fork server that has imported this module (and with it MNN, before any MNN thread
exists) once; a child that needs torch imports it itself (~3 s).

Costs of a child (measured as above): an interpreter with the runtime imported (~47 MiB by
`runtime.profiling.compute`'s measurement; torch adds ~240 MiB) besides its engine's own workspace; a start
of ~0.05 s once the fork server runs (the first start, which launches the server, took 0.6 s),
plus ~3 s where the child imports torch; per call a command round trip of ~0.16 ms and the copies
of x (and dy) into shared memory and of the partial results out of it.
As with any multiprocessing program, a script that builds a split with children must guard its
top level with `if __name__ == "__main__":` (the fork server re-imports the main module).
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Mapping, Sequence

import numpy as np

from runtime.engines import mnn_kernels as K
from runtime.engines.base import StageEngine
from runtime.profiling.compute import Backend, attention_piece, parse_backend
from runtime.engines.stage import stage_spec

# Full weights, x @ W layout: W* are [hidden, hidden], b* are [hidden].
WEIGHT_NAMES = ("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo")
# The attention piece's parameter for each full weight (bo is added outside the pieces).
_PIECE_PARAM = {"Wq": "wq", "bq": "bq", "Wk": "wk", "bk": "bk", "Wv": "wv", "bv": "bv", "Wo": "wo"}


@dataclass(frozen=True)
class HeadRange:
    """Heads [first, first + count) of the block, run by `backend`."""

    backend: str
    first: int
    count: int

    def columns(self, head_size: int) -> slice:
        """The columns of Wq/Wk/Wv (entries of their biases, rows of Wo) these heads own."""
        return slice(self.first * head_size, (self.first + self.count) * head_size)


def head_ranges(allocation: Mapping[str, int], heads: int) -> list[HeadRange]:
    """Contiguous head ranges in the allocation's order; backends given 0 heads get none."""
    if not allocation:
        raise ValueError("an allocation needs at least one backend")
    counts = dict(allocation)
    for name, count in counts.items():
        parse_backend(name)  # a readable error for a malformed name
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"backend {name!r} is given {count!r} heads; a head count is an int >= 0")
    if sum(counts.values()) != heads:
        raise ValueError(f"allocation {counts} covers {sum(counts.values())} heads, the block has {heads}")
    ranges, first = [], 0
    for name, count in counts.items():
        if count:
            ranges.append(HeadRange(name, first, int(count)))
            first += int(count)
    return ranges


def slice_weights(full: Mapping[str, np.ndarray], r: HeadRange, head_size: int) -> dict[str, np.ndarray]:
    """The piece parameters (wq, bq, ..., wo) of head range `r`, as contiguous float32 copies."""
    cols = r.columns(head_size)
    out = {}
    for name, param in _PIECE_PARAM.items():
        w = np.asarray(full[name], np.float32)
        if name == "Wo":
            part = w[cols, :]
        elif w.ndim == 2:
            part = w[:, cols]
        else:
            part = w[cols]
        out[param] = np.ascontiguousarray(part)
    return out


# One backend's piece ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Shapes:
    batch: int
    seq: int
    hidden: int
    head_size: int
    mask_shape: tuple[int, ...]


class _Piece:
    """One backend's heads: the attention piece graph on that backend's stage engine."""

    def __init__(self, backend: str, count: int, shapes: _Shapes, slices: Mapping[str, np.ndarray],
                 stash_weights: bool = True):
        self.backend: Backend = parse_backend(backend)
        if self.backend.device != "cpu":
            raise ValueError(f"backend {backend!r}: the stage engines run on the CPU only")
        graph = attention_piece(shapes.batch, shapes.seq, shapes.hidden, count, shapes.head_size,
                                shapes.mask_shape)
        spec = stage_spec(graph, 1, 1)
        self.output = spec.output
        self.engine: StageEngine
        if self.backend.engine == "mnn":
            from runtime.engines.mnn import MnnStageEngine

            self.engine = MnnStageEngine(spec, threads=self.backend.threads, weights=slices,
                                         stash_weights=stash_weights)
        else:
            from runtime.engines.pytorch import TorchStageEngine  # torch only when asked for

            self.engine = TorchStageEngine(spec, threads=self.backend.threads, weights=slices)

    def _threads(self) -> None:
        # MNN's thread count is process-wide and a graph keeps the count of its first evaluation:
        # set ours before every call in case another engine in this process changed it.
        if self.backend.engine == "mnn" and K.get_threads() != self.backend.threads:
            K.set_threads(self.backend.threads)

    def forward(self, x: np.ndarray, mask: np.ndarray, microbatch: int, train: bool) -> np.ndarray:
        self._threads()
        return self.engine.forward({"x": x, "mask": mask}, microbatch, train=train)

    def backward(self, dy: np.ndarray, microbatch: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self._threads()
        g = self.engine.backward(microbatch, dy)
        return g.activation_input, g.params

    def set_weights(self, slices: Mapping[str, np.ndarray]) -> None:
        self.engine.set_parameters(slices)


# Shared memory --------------------------------------------------------------------------------

class _Layout:
    """Named float32 arrays packed into one buffer."""

    def __init__(self, fields: Sequence[tuple[str, tuple[int, ...]]]):
        self.fields = [(name, tuple(int(d) for d in shape)) for name, shape in fields]
        self.offsets, off = {}, 0
        for name, shape in self.fields:
            self.offsets[name] = off
            off += 4 * int(np.prod(shape, dtype=np.int64))
        self.nbytes = max(off, 4)

    def views(self, buf) -> dict[str, np.ndarray]:
        return {name: np.ndarray(shape, np.float32, buf, self.offsets[name]) for name, shape in self.fields}


def _inputs_layout(s: _Shapes) -> _Layout:
    act = (s.batch, s.seq, s.hidden)
    return _Layout([("x", act), ("mask", s.mask_shape), ("dy", act)])


def _worker_layout(s: _Shapes, count: int) -> _Layout:
    act = (s.batch, s.seq, s.hidden)
    w = count * s.head_size
    params = [("wq", (s.hidden, w)), ("bq", (w,)), ("wk", (s.hidden, w)), ("bk", (w,)),
              ("wv", (s.hidden, w)), ("bv", (w,)), ("wo", (w, s.hidden))]
    return _Layout([("y", act), ("dx", act)] + [("g_" + n, sh) for n, sh in params]
                   + [("w_" + n, sh) for n, sh in params])


def _worker_main(conn, backend: str, count: int, shapes: _Shapes, inputs_name: str, own_name: str,
                 stash_weights: bool) -> None:
    """A child process's loop: build the piece from the weights in shared memory, then serve."""
    inputs_shm = shared_memory.SharedMemory(name=inputs_name)
    own_shm = shared_memory.SharedMemory(name=own_name)
    try:
        _serve(conn, backend, count, shapes, inputs_shm, own_shm, stash_weights)
    finally:
        for shm in (inputs_shm, own_shm):
            try:
                shm.close()
            except BufferError:
                pass
        conn.close()


def _serve(conn, backend: str, count: int, shapes: _Shapes, inputs_shm, own_shm, stash_weights: bool) -> None:
    inputs = _inputs_layout(shapes).views(inputs_shm.buf)
    own = _worker_layout(shapes, count).views(own_shm.buf)
    params = [k[2:] for k in own if k.startswith("w_")]

    def weights() -> dict[str, np.ndarray]:
        return {p: own["w_" + p].copy() for p in params}

    try:
        piece = _Piece(backend, count, shapes, weights(), stash_weights)
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


def _context():
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


class _ProcessWorker:
    """A backend's piece in a child process; commands go over a pipe, arrays through shared memory."""

    def __init__(self, r: HeadRange, shapes: _Shapes, inputs_shm: shared_memory.SharedMemory,
                 slices: Mapping[str, np.ndarray], start_timeout_s: float, stash_weights: bool = True):
        self.range = r
        self.layout = _worker_layout(shapes, r.count)
        self.shm = shared_memory.SharedMemory(create=True, size=self.layout.nbytes)
        self.views = self.layout.views(self.shm.buf)
        self._write_weights(slices)
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, name=f"head-split {r.backend}", daemon=True,
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
        _close_worker(self.conn, self.proc, self.shm)


def _close_worker(conn, proc, shm) -> None:
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
        _release(shm)


def _release(shm: shared_memory.SharedMemory) -> None:
    """Unlink a block this process created. If numpy views of it are still alive (an object being
    collected), the mapping stays until they die; the name is gone either way."""
    try:
        shm.close()
    except BufferError:
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class _LocalWorker:
    """A backend's piece in this process, computed in the calling thread."""

    def __init__(self, r: HeadRange, shapes: _Shapes, slices: Mapping[str, np.ndarray], stash_weights: bool = True):
        self.range = r
        self.piece = _Piece(r.backend, r.count, shapes, slices, stash_weights)
        self.busy_s = 0.0


# The split block ------------------------------------------------------------------------------

class SplitAttention:
    """An attention block (Q/K/V projections, scaled dot-product attention with an additive mask,
    output projection and its bias) whose heads are split across backends.

    `weights`: Wq, bq, Wk, bk, Wv, bv, Wo, bo (x @ W layout, [hidden, hidden] and [hidden]).
    `allocation`: backend name (`mnn:cpu:t1`, `torch:cpu:t2`, ...) -> head count; the counts sum to
    `heads`, backends with 0 heads are left out, the others get contiguous head ranges in the
    allocation's order. `concurrent=False` runs every backend in this process, one after another
    (a reference; two torch backends must then agree on their thread count, torch's is process-wide).

    `forward(x, mask_bias)` -> y; `backward(dy)` -> (dx, full-size gradients of all eight weights);
    `set_weights(full)` after an update. Micro-batches are independent, as in a stage engine: each
    forward(..., microbatch=m) waits for its backward(dy, microbatch=m), which uses the weights that
    forward used even if `set_weights` came in between (weight stashing, module docstring; off for
    MNN backends with `stash_weights=False`). Close the object (or use it
    as a context manager) to stop its child processes; garbage collection also does.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], heads: int, head_size: int,
                 allocation: Mapping[str, int], batch: int, seq: int, mask_shape: Sequence[int],
                 concurrent: bool = True, start_timeout_s: float = 300.0, stash_weights: bool = True):
        hidden = heads * head_size
        self.heads, self.head_size, self.hidden = heads, head_size, hidden
        self.shapes = _Shapes(int(batch), int(seq), hidden, int(head_size), tuple(int(d) for d in mask_shape))
        self.ranges = head_ranges(allocation, heads)
        self.weights = self._check_weights(weights)
        self._workers: list[_LocalWorker | _ProcessWorker] = []
        self._inputs_shm: shared_memory.SharedMemory | None = None
        self._finalizer = None
        self.last_busy_s: dict[str, float] = {}

        if concurrent and len(self.ranges) > 1:
            # the in-process backend: a torch one if any (it computes without the GIL)
            local = next((i for i, r in enumerate(self.ranges) if r.backend.startswith("torch:")), 0)
        else:
            local = None
            torch_threads = {parse_backend(r.backend).threads for r in self.ranges if r.backend.startswith("torch:")}
            if len(torch_threads) > 1:
                raise ValueError(f"torch backends with thread counts {sorted(torch_threads)} in one process: "
                                 "torch's thread count is process-wide; use concurrent=True")
        try:
            remote = [r for i, r in enumerate(self.ranges) if local is not None and i != local]
            if remote:
                self._inputs_shm = shared_memory.SharedMemory(create=True, size=_inputs_layout(self.shapes).nbytes)
                self._inputs = _inputs_layout(self.shapes).views(self._inputs_shm.buf)
            for i, r in enumerate(self.ranges):
                slices = slice_weights(self.weights, r, head_size)
                if local is None or i == local:
                    self._workers.append(_LocalWorker(r, self.shapes, slices, stash_weights))
                else:
                    self._workers.append(_ProcessWorker(r, self.shapes, self._inputs_shm, slices, start_timeout_s,
                                                        stash_weights))
        except BaseException:
            self.close()
            raise
        procs = [(w.conn, w.proc, w.shm) for w in self._workers if isinstance(w, _ProcessWorker)]
        self._finalizer = weakref.finalize(self, _finalize, procs, self._inputs_shm)

    # weights ---------------------------------------------------------------------------------
    def _check_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in WEIGHT_NAMES if n not in weights]
        if missing:
            raise KeyError(f"attention weights {missing} are missing (need {', '.join(WEIGHT_NAMES)})")
        D = self.hidden
        out = {}
        for n in WEIGHT_NAMES:
            w = np.array(weights[n], np.float32)
            want = (D, D) if n.startswith("W") else (D,)
            if w.shape != want:
                raise ValueError(f"{n} has shape {w.shape}; heads {self.heads} x head size {self.head_size} "
                                 f"need {want} (x @ W layout)")
            out[n] = w
        return out

    def set_weights(self, full: Mapping[str, np.ndarray]) -> None:
        """Take new full weights (the one source of truth) and re-slice them into every backend;
        forwards still waiting for their backwards keep the slices they used (weight stashing)."""
        self.weights = self._check_weights(full)
        for w in self._remote():
            w.set_weights(slice_weights(self.weights, w.range, self.head_size))
        try:
            for w in self._locals():
                w.piece.set_weights(slice_weights(self.weights, w.range, self.head_size))
        except BaseException:
            _drain(self._remote())
            raise
        _wait_all(self._remote())

    def parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.weights.items()}

    # compute ---------------------------------------------------------------------------------
    def _remote(self) -> list[_ProcessWorker]:
        return [w for w in self._workers if isinstance(w, _ProcessWorker)]

    def _locals(self) -> list[_LocalWorker]:
        return [w for w in self._workers if isinstance(w, _LocalWorker)]

    def forward(self, x: np.ndarray, mask_bias: np.ndarray, microbatch: int = 0, train: bool = True) -> np.ndarray:
        """The block's output: the sum of the backends' partial outputs, plus the output bias."""
        s = self.shapes
        x = np.asarray(x, np.float32)
        mask_bias = np.asarray(mask_bias, np.float32)
        if x.shape != (s.batch, s.seq, s.hidden) or mask_bias.shape != s.mask_shape:
            raise ValueError(f"x {x.shape} / mask {mask_bias.shape}: this split was built for x "
                             f"{(s.batch, s.seq, s.hidden)} and mask {s.mask_shape}")
        remote = self._remote()
        if remote:
            np.copyto(self._inputs["x"], x)
            np.copyto(self._inputs["mask"], mask_bias)
            for w in remote:
                w.send("forward", microbatch, train)
        partial: dict[int, np.ndarray] = {}
        try:
            for w in self._locals():
                start = time.perf_counter()
                partial[id(w)] = w.piece.forward(x, mask_bias, microbatch, train)
                w.busy_s = time.perf_counter() - start
        except BaseException:
            _drain(remote)
            raise
        _wait_all(remote)
        for w in remote:
            partial[id(w)] = w.views["y"]
        self.last_busy_s = {w.range.backend: w.busy_s for w in self._workers}
        y = np.zeros((s.batch, s.seq, s.hidden), np.float32)
        for w in self._workers:  # a fixed order, so results do not depend on who finished first
            y += partial[id(w)]
        y += self.weights["bo"]
        return y

    def backward(self, dy: np.ndarray, microbatch: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(dx, gradients of Wq, bq, Wk, bk, Wv, bv, Wo, bo at full size)."""
        s = self.shapes
        dy = np.asarray(dy, np.float32)
        if dy.shape != (s.batch, s.seq, s.hidden):
            raise ValueError(f"dy has shape {dy.shape}, the block's output is {(s.batch, s.seq, s.hidden)}")
        remote = self._remote()
        if remote:
            np.copyto(self._inputs["dy"], dy)
            for w in remote:
                w.send("backward", microbatch)
        got: dict[int, tuple[np.ndarray, Mapping[str, np.ndarray]]] = {}
        try:
            for w in self._locals():
                start = time.perf_counter()
                got[id(w)] = w.piece.backward(dy, microbatch)
                w.busy_s = time.perf_counter() - start
        except BaseException:
            _drain(remote)
            raise
        _wait_all(remote)
        for w in remote:
            got[id(w)] = (w.views["dx"], w.gradients())
        self.last_busy_s = {w.range.backend: w.busy_s for w in self._workers}
        dx = np.zeros((s.batch, s.seq, s.hidden), np.float32)
        grads = {n: np.zeros_like(v) for n, v in self.weights.items()}
        for w in self._workers:
            part_dx, part = got[id(w)]
            dx += part_dx
            cols = w.range.columns(self.head_size)
            for name, param in _PIECE_PARAM.items():
                g = grads[name]
                if name == "Wo":
                    g[cols, :] = part[param]
                elif g.ndim == 2:
                    g[:, cols] = part[param]
                else:
                    g[cols] = part[param]
        grads["bo"] = dy.sum(axis=(0, 1), dtype=np.float64).astype(np.float32)
        return dx, grads

    # lifetime --------------------------------------------------------------------------------
    @property
    def placement(self) -> dict[str, str]:
        """Backend -> "process" (this one) or "child" (its own process)."""
        return {w.range.backend: "child" if isinstance(w, _ProcessWorker) else "process" for w in self._workers}

    def close(self) -> None:
        self._inputs = {}
        for w in self._remote():
            w.views = {}
        if self._finalizer is not None:
            self._finalizer()
        else:  # construction failed half-way
            _finalize([(w.conn, w.proc, w.shm) for w in self._remote()], self._inputs_shm)
        self._workers = [w for w in self._workers if isinstance(w, _LocalWorker)]

    def __enter__(self) -> "SplitAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait_all(remote: Sequence[_ProcessWorker]) -> None:
    """Every child's answer; the first error is raised after all have answered, so no command is
    left pending and the next call can go ahead."""
    errors = _drain(remote)
    if errors:
        raise errors[0]


def _drain(remote: Sequence[_ProcessWorker]) -> list[Exception]:
    errors = []
    for w in remote:
        if w._pending is not None:
            try:
                w.wait()
            except Exception as e:  # noqa: PERF203 (one per child)
                errors.append(e)
    return errors


def _finalize(procs, inputs_shm) -> None:
    for conn, proc, shm in procs:
        _close_worker(conn, proc, shm)
    if inputs_shm is not None:
        _release(inputs_shm)
