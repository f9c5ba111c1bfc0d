"""One attention block's heads split across compute backends that run at the same time.

Why a split is exact. With x @ W weights, head j of the attention block reads only the columns
j*hs:(j+1)*hs of Wq, Wk, Wv (and of their biases) and feeds only the rows j*hs:(j+1)*hs of Wo. So a
backend given a contiguous range of heads computes, from the full input x, its heads' Q/K/V
projections (column slices), their attention, and its share of the output projection (a row
slice); the block's output is the sum of the backends' partial outputs plus the output bias, which
is added once, here, after the sum (the attention piece of `runtime.engines.split.piece` has no output bias).
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

Each backend runs the attention piece of `runtime.engines.split.piece.attention_piece` (an IR graph) on the
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
`runtime.profiling.memory`'s measurement; torch adds ~240 MiB) besides its engine's own workspace; a start
of ~0.05 s once the fork server runs (the first start, which launches the server, took 0.6 s),
plus ~3 s where the child imports torch; per call a command round trip of ~0.16 ms and the copies
of x (and dy) into shared memory and of the partial results out of it.
As with any multiprocessing program, a script that builds a split with children must guard its
top level with `if __name__ == "__main__":` (the fork server re-imports the main module).
"""
from __future__ import annotations

import time
import weakref
from multiprocessing import shared_memory
from typing import Mapping, Sequence

import numpy as np

from ir.backend import engine_of, parse_backend
from runtime.engines.split.piece import NORM_WEIGHTS, PIECE_PARAM, AttentionForm, bert_form
from runtime.engines.split.pieces import WEIGHT_NAMES, LocalWorker, PieceShapes, head_ranges, slice_weights
from runtime.engines.split.pool import ProcessWorker, close_worker
from runtime.engines.split.shm import inputs_layout, release

__all__ = ["SplitAttention", "WEIGHT_NAMES"]


class SplitAttention:
    """An attention block (Q/K/V projections, scaled dot-product attention with an additive mask,
    output projection and its bias) whose heads are split across backends.

    `weights`: Wq, bq, Wk, bk, Wv, bv, Wo, bo (x @ W layout, [hidden, hidden] and [hidden]) for
    BERT's attention; for another `form` (`runtime.engines.split.piece.AttentionForm`: a pre-norm,
    rotary embeddings, grouped-query heads, biases or none) the roles and shapes it names.
    `heads` is the number of units the split deals out: query heads, or key/value heads (each with
    its group of query heads) under grouped-query attention (`form.units`).
    `allocation`: backend name (`mnn:cpu:t1`, `torch:cpu:t2`, ...) -> unit count; the counts sum to
    `heads`, backends with 0 are left out, the others get contiguous ranges in the allocation's
    order. A pre-norm's weights are held by every backend (each normalises x itself) and their
    gradient is the sum of the backends'. `concurrent=False` runs every backend in this process, one after another
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
                 concurrent: bool = True, start_timeout_s: float = 300.0, stash_weights: bool = True,
                 form: AttentionForm | None = None):
        form = form or bert_form(heads, head_size)
        if form.units != heads or form.head_size != head_size:
            raise ValueError(f"a split of {heads} units of head size {head_size} for an attention of {form.units} "
                             f"units of head size {form.head_size}")
        hidden = form.hidden
        self.form = form
        self.heads, self.head_size, self.hidden = heads, head_size, hidden
        self.shapes = PieceShapes(int(batch), int(seq), hidden, int(head_size), tuple(int(d) for d in mask_shape),
                                  form)
        self.ranges = head_ranges(allocation, heads, "heads" if form.group == 1 else
                                  f"key/value groups ({form.group} query heads each)")
        self.weights = self._check_weights(weights)
        self._workers: list[LocalWorker | ProcessWorker] = []
        self._inputs_shm: shared_memory.SharedMemory | None = None
        self._finalizer = None
        self.last_busy_s: dict[str, float] = {}

        if concurrent and len(self.ranges) > 1:
            # the in-process backend: a torch one if any (it computes without the GIL)
            local = next((i for i, r in enumerate(self.ranges) if engine_of(r.backend) == "torch"), 0)
        else:
            local = None
            torch_threads = {parse_backend(r.backend).thread_count for r in self.ranges if engine_of(r.backend) == "torch"}
            if len(torch_threads) > 1:
                raise ValueError(f"torch backends with thread counts {sorted(torch_threads)} in one process: "
                                 "torch's thread count is process-wide; use concurrent=True")
        try:
            remote = [r for i, r in enumerate(self.ranges) if local is not None and i != local]
            if remote:
                self._inputs_shm = shared_memory.SharedMemory(create=True, size=inputs_layout(self.shapes).nbytes)
                self._inputs = inputs_layout(self.shapes).views(self._inputs_shm.buf)
            for i, r in enumerate(self.ranges):
                slices = slice_weights(self.weights, r, head_size, form)
                if local is None or i == local:
                    self._workers.append(LocalWorker(r, self.shapes, slices, stash_weights))
                else:
                    self._workers.append(ProcessWorker(r, self.shapes, self._inputs_shm, slices, start_timeout_s,
                                                        stash_weights))
        except BaseException:
            self.close()
            raise
        procs = [(w.conn, w.proc, w.shm) for w in self._workers if isinstance(w, ProcessWorker)]
        self._finalizer = weakref.finalize(self, _finalize, procs, self._inputs_shm)

    # weights ---------------------------------------------------------------------------------
    def _check_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        roles = [r for r in WEIGHT_NAMES + NORM_WEIGHTS if r in self.form.roles]
        missing = [n for n in roles if n not in weights]
        if missing:
            raise KeyError(f"attention weights {missing} are missing (need {', '.join(roles)})")
        out = {}
        for n in roles:
            w = np.array(weights[n], np.float32)
            want = self.form.weight_shape(n)
            if w.shape != want:
                raise ValueError(f"{n} has shape {w.shape}; heads {self.form.heads} (kv {self.form.kv_heads}) x head "
                                 f"size {self.head_size} over hidden {self.hidden} need {want} (x @ W layout)")
            out[n] = w
        return out

    def set_weights(self, full: Mapping[str, np.ndarray]) -> None:
        """Take new full weights (the one source of truth) and re-slice them into every backend;
        forwards still waiting for their backwards keep the slices they used (weight stashing)."""
        self.weights = self._check_weights(full)
        for w in self._remote():
            w.set_weights(slice_weights(self.weights, w.range, self.head_size, self.form))
        try:
            for w in self._locals():
                w.piece.set_weights(slice_weights(self.weights, w.range, self.head_size, self.form))
        except BaseException:
            _drain(self._remote())
            raise
        _wait_all(self._remote())

    def parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.weights.items()}

    # compute ---------------------------------------------------------------------------------
    def _remote(self) -> list[ProcessWorker]:
        return [w for w in self._workers if isinstance(w, ProcessWorker)]

    def _locals(self) -> list[LocalWorker]:
        return [w for w in self._workers if isinstance(w, LocalWorker)]

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
        if "bo" in self.weights:
            y += self.weights["bo"]
        return y

    def backward(self, dy: np.ndarray, microbatch: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(dx, gradients of every weight role at full size)."""
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
            for name in self.form.piece_roles():
                g, got_part = grads[name], part[PIECE_PARAM[name]]
                cols = self.form.columns(name, w.range.first, w.range.count)
                if name in NORM_WEIGHTS:  # every backend normalised x: the gradient is their sum
                    g += got_part
                elif name == "Wo":
                    g[cols, :] = got_part
                elif g.ndim == 2:
                    g[:, cols] = got_part
                else:
                    g[cols] = got_part
        if "bo" in grads:
            grads["bo"] = dy.sum(axis=(0, 1), dtype=np.float64).astype(np.float32)
        return dx, grads

    # lifetime --------------------------------------------------------------------------------
    @property
    def placement(self) -> dict[str, str]:
        """Backend -> "process" (this one) or "child" (its own process)."""
        return {w.range.backend: "child" if isinstance(w, ProcessWorker) else "process" for w in self._workers}

    def close(self) -> None:
        self._inputs = {}
        for w in self._remote():
            w.views = {}
        if self._finalizer is not None:
            self._finalizer()
        else:  # construction failed half-way
            _finalize([(w.conn, w.proc, w.shm) for w in self._remote()], self._inputs_shm)
        self._workers = [w for w in self._workers if isinstance(w, LocalWorker)]

    def __enter__(self) -> "SplitAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait_all(remote: Sequence[ProcessWorker]) -> None:
    """Every child's answer; the first error is raised after all have answered, so no command is
    left pending and the next call can go ahead."""
    errors = _drain(remote)
    if errors:
        raise errors[0]


def _drain(remote: Sequence[ProcessWorker]) -> list[Exception]:
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
        close_worker(conn, proc, shm)
    if inputs_shm is not None:
        release(inputs_shm)
