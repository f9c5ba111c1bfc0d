"""Measure what a device costs: `confidant profile` runs this on each device and ships the JSON.

`profile_device` times every distinct block kind of a lowered graph (`ir.graph.block_signature`:
MiniLM's six encoder layers are one kind) on every backend that really runs here, through the
same stage engines the pipeline uses, so the numbers include everything a stage pays (host
values, numpy embedding lookups, MNN's per-op caches, gradient reads). Backends are named
`engine:device:tN` (`mnn:cpu:t1`, `torch:cpu:t2`); thread variants count as separate backends.
A backend is profiled only when it is really present: MNN devices that `available_backends()`
finds (the MNN engine itself drives the CPU only, so other MNN devices are reported and skipped),
torch when it is importable, and never more threads than the machine has CPUs.

What is measured, per block kind and backend (one warm-up, then the median of `reps`):

* `forward_s`: one training forward of one micro-batch.
* `backward_s`: one backward as a pipeline stage usually pays it. For MNN that is a backward with
  another micro-batch's forward in between, which forces the engine to re-run the block's forward
  from the stashed input (`runtime.engines.mnn`); `recompute_s` is that time minus the backward
  right after its own forward (which reuses the per-op caches), clamped at 0, so the cost model
  can take `backward_s - recompute_s` where a stage never interleaves (the last stage, a single
  device). Torch keeps autograd's saved tensors, so its `recompute_s` is 0.
* `workspace_bytes`: the growth of the process's resident memory while the freshly built engine
  runs its first forward and backward (session creation, caches, outputs, gradients: the weights
  are already resident). Method: freed memory is handed back first (MNN's executor pool, then
  glibc's `malloc_trim`), the kernel's peak-RSS mark is reset (`/proc/self/clear_refs` = 5,
  Linux >= 4.0), and the peak (VmHWM) minus the RSS at the start is taken. Where the reset is
  refused, a thread samples VmRSS every millisecond instead, which can miss short peaks. Each
  backend first runs its cheapest block once unmeasured, so one-time engine start-up is not
  charged to whichever block comes first. Limits: this is RSS, so memory an allocator recycles
  without the kernel seeing it is missed; torch still measured ~25 MiB more for a shape's first
  run than for a repeat (MiniLM layer: ~105 vs ~82 MiB); MNN repeats agree within ~10%.
* per attention block, an `AttentionCurve`: forward+backward seconds of the block's attention
  for h = 1..H heads. "Fused" runs all h heads batched in one piece (Q/K/V projections of width
  h x head_size, scaled dot-product attention with the model's own additive mask, the output
  projection's h x head_size rows), built as a small IR graph and run by the same engine as the
  blocks, so MNN and torch both get a real curve. "Head by head" is h runs of the one-head piece;
  the heads have identical shapes, so its time is h x the one-head time (the h-1 additions of the
  partial outputs are left out: a few microseconds). Each entry keeps the faster of the two.

`memory_available_bytes` is MemAvailable from /proc/meminfo unless given;
`runtime_overhead_bytes` is the resident memory of a fresh interpreter that imported the worker
runtime and built nothing (measured in a child process, so the caller's model does not count):
the MNN runtime's, ~47 MiB here. Importing torch adds ~240 MiB on top, which this figure does not
include; a plan that puts torch in a device's main process must allow for it.

`split_child_bytes` (engine kind -> bytes) is what each child process of a head split costs
(`runtime.engines.split.attention` runs every backend of a split but one in its own process): for each engine
kind among the profiled backends, a child is started through head_split's own machinery (fork
server, shared memory, serve loop) holding H-1 heads (the most a child of a split holds: an upper
bound) of the model's attention block kind with the most heads, runs one training forward and
backward, and its peak resident memory (VmHWM from /proc/<pid>/status) is taken whole. Measured on
a 2-CPU x86-64 machine: MiniLM's shape (batch 8, seq 128, 11 heads of 32) ~123 MiB for MNN,
~385 MiB for torch; the tiny test BERT (batch 2, seq 16, 3 heads of 16) ~40 / ~340 MiB. It takes
~0.4 s for the MNN child (most of it starting the fork server) and ~2 s for the torch one, which
imports torch. RSS counts the pages a child shares copy-on-write with the fork server, so a second
child of one engine on a device is over-counted by those (the fork server itself, one per device,
is not counted separately).

`split_extra_cost_s` (block signature -> backend -> seconds) is what a real head split costs beyond
the attention curves, the allocator's `extra_cost_s` (`planner.heads`). The curves time each
backend alone; a split also pays the child's command round trips, the copies of x and dy into
shared memory and of the partial output, dx and slice gradients out of it, the sum of the partial
outputs, and, because both engines now compute at once, whatever they slow each other down by
(shared caches and memory bandwidth). So, per attention block kind, the in-process backend of a
split is picked as `runtime.engines.split.attention` picks it (`split_primary`: a torch one if present), and
every other backend with a curve that fits beside it on this machine's CPUs runs real
`SplitAttention`s with it (`split_extra_cost`), the other in a child process as the split engine
runs it, for 1, H/2 and H-1 heads on the child; each takes the median of `reps` forward+backward
after a warm-up, and the backend's figure is the largest excess of a measured time over the
curves' max(curve_primary(h_p), curve_other(h_o)), floored at 0. The in-process backend has no
entry (0 by the allocator's model), nor has a backend that does not fit beside it (its pair would
only measure oversubscription). Measured on a 2-CPU x86-64 machine, mnn:cpu:t1 in a child beside
torch:cpu:t1 (benchmarks/heads.py, two runs, batch 8, seq 128): MiniLM's shape (12 heads of 32)
7-17 ms against ~40 ms splits, in ~1.7 s; BERT-base's (12 heads of 64) 76-111 ms, in ~5.5 s,
where the MNN child computed 27-43% slower than its in-process curve (its busy time, not the
copies). The figures are noisy (the curves themselves drift ±15%) and the worst excess is taken,
so they err high: they say when a split does not pay, not by exactly how much it loses.

Side effects: profiling resets this process's peak-RSS mark (`runtime.procfs.peak_rss_bytes` afterwards
reports peaks since the profile), leaves torch's process-wide thread count at the last setting
an engine made (the split measurement's in-process backend, else the last profiled one; MNN's is
restored), and leaves head_split's fork server running (started to measure the split children
and the split costs; it ends with this process).

`link_probe_server` / `measure_link` measure a link: round trips of tensors through the real
ZeroMQ transport (headers, checksums and all) between this process and a peer.
"""
from __future__ import annotations

import ctypes
import gc
import importlib.util
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ir.graph import Block, Graph, Node, Value, block_signature
from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile, Link
from runtime.engines import mnn_kernels as K
from runtime.procfs import meminfo_bytes, status_bytes
from runtime.engines.base import StageEngine
from runtime.engines.base import make_engine as engine_for
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import StageSpec, host_values, stage_spec
from runtime.transport.wire import Expected, MessageError, PeerTimeout

DEFAULT_BACKENDS = ("mnn:cpu:t1", "mnn:cpu:t2", "torch:cpu:t1", "torch:cpu:t2")
ENGINES = ("mnn", "torch")

Progress = Callable[[str], None]


# Backends -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    engine: str   # "mnn" or "torch"
    device: str   # "cpu", "opencl", ...
    threads: int

    @property
    def name(self) -> str:
        return f"{self.engine}:{self.device}:t{self.threads}"


def parse_backend(name: str) -> Backend:
    """`engine:device:tN`, e.g. `mnn:cpu:t2`."""
    parts = name.split(":")
    if (len(parts) != 3 or parts[0] not in ENGINES or not parts[1] or not parts[2].startswith("t")
            or not parts[2][1:].isdigit() or int(parts[2][1:]) < 1):
        raise ValueError(f"backend {name!r} is not engine:device:tN with engine one of {', '.join(ENGINES)} "
                         f"and N >= 1 (e.g. mnn:cpu:t1, torch:cpu:t2)")
    return Backend(parts[0], parts[1], int(parts[2][1:]))


def _torch_importable() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import runtime.engines.pytorch  # noqa: F401  (the only module that imports torch)
    except Exception:  # a broken torch install is as good as none
        return False
    return True


def present_backends(names: Sequence[str], cpus: int | None = None) -> tuple[list[Backend], dict[str, str]]:
    """The requested backends that really run here, and why each other one was skipped."""
    cpus = cpus or os.cpu_count() or 1
    wanted = [parse_backend(n) for n in names]
    present: list[Backend] = []
    skipped: dict[str, str] = {}
    mnn_devices = K.available_backends() if any(b.engine == "mnn" for b in wanted) else {}
    torch_ok = _torch_importable() if any(b.engine == "torch" for b in wanted) else False
    for b in wanted:
        if b in present or b.name in skipped:
            continue
        if b.engine == "mnn" and not mnn_devices.get(b.device, False):
            skipped[b.name] = f"MNN has no working {b.device} backend here"
        elif b.engine == "mnn" and b.device != "cpu":
            skipped[b.name] = "the MNN stage engine drives the CPU backend only"
        elif b.engine == "torch" and not torch_ok:
            skipped[b.name] = "torch cannot be imported"
        elif b.engine == "torch" and b.device != "cpu":
            skipped[b.name] = "the torch stage engine runs on the CPU only"
        elif b.threads > cpus:
            skipped[b.name] = f"{b.threads} threads on a machine with {cpus} CPUs"
        else:
            present.append(b)
    return present, skipped


def make_engine(backend: Backend, spec: StageSpec) -> StageEngine:
    return engine_for(backend.engine, spec, backend.threads)


# Inputs ---------------------------------------------------------------------------------------

def synthetic_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Graph inputs of the lowered shape: valid token ids, an attention mask with a padded row
    (so the additive mask really holds its large negative value), and one-hot float targets."""
    rng = np.random.default_rng(seed)
    rows: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "Gather" and n.tier == "compute" and n.inputs[0] in graph.constants:
            size = int(graph.constants[n.inputs[0]].shape[0])
            rows[n.inputs[1]] = min(rows.get(n.inputs[1], size), size)
    feeds = {}
    for v in graph.inputs:
        shape = tuple(v.shape)
        if v.dtype.startswith("float"):
            labels = rng.integers(0, shape[-1], shape[:-1])
            count = max(1, int(np.prod(shape[:-1], dtype=np.int64)))
            feeds[v.name] = (np.eye(shape[-1])[labels] / count).astype(v.dtype)
        elif "mask" in v.name:
            mask = np.ones(shape, v.dtype)
            if mask.ndim == 2 and shape[0] > 1:
                mask[-1, shape[1] // 2:] = 0
            feeds[v.name] = mask
        else:
            feeds[v.name] = rng.integers(0, rows.get(v.name, 1), shape).astype(v.dtype)
    return feeds


def _activation(graph: Graph, name: str, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(graph.values[name].shape).astype(np.float32)


# Measuring ------------------------------------------------------------------------------------

def _release_free_heap() -> None:
    """Hand freed memory back to the system, so the next measurement starts from a clean level:
    MNN's executor keeps the buffers of dead graphs pooled (a second MiniLM layer measured 47 MiB
    instead of 138 MiB without this), and glibc keeps freed heap pages."""
    gc.collect()
    K.release_memory()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc; elsewhere there is nothing to call
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_bytes("VmHWM") is not None


class PeakRss:
    """`with PeakRss() as p: ...` then `p.bytes`: peak resident memory above the level at entry."""

    def __enter__(self) -> "PeakRss":
        _release_free_heap()
        self._kernel = _reset_peak_rss()
        self.base = status_bytes("VmRSS") or 0
        self.bytes = 0
        self._peak = self.base
        if not self._kernel:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, status_bytes("VmRSS") or 0)

    def __exit__(self, *exc: object) -> None:
        if self._kernel:
            peak = status_bytes("VmHWM") or self.base
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, status_bytes("VmRSS") or 0)
        self.bytes = max(0, peak - self.base)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _stage_inputs(spec: StageSpec, feeds: Mapping[str, np.ndarray], seed: int = 0):
    """Feeds for a one-stage run of `spec` and a gradient of its output (None for the loss)."""
    rng = np.random.default_rng(seed)
    stage_feeds = {k: feeds[k] for k in spec.graph_inputs}
    if spec.activation_input is not None:
        stage_feeds[spec.activation_input] = _activation(spec.graph, spec.activation_input, rng)
    grad = None if spec.is_last else (1e-3 * _activation(spec.graph, spec.output, rng)).astype(np.float32)
    return stage_feeds, grad


def measure_stage(backend: Backend, spec: StageSpec, feeds: Mapping[str, np.ndarray], reps: int = 3) -> BlockCost:
    """Forward, backward (with MNN's forward re-run), recompute and workspace of one stage."""
    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec)
    try:
        with PeakRss() as peak:
            engine.forward(stage_feeds, 0)   # warm-up: session creation, per-op caches
            engine.backward(0, grad)
        fwd, bwd, forced = [], [], []
        interleave = backend.engine == "mnn"
        for _ in range(max(1, reps)):
            fwd.append(_timed(lambda: engine.forward(stage_feeds, 0)))
            bwd.append(_timed(lambda: engine.backward(0, grad)))
            if interleave:
                # Another micro-batch's forward between a forward and its backward: each backward
                # now finds the graph holding the other input and re-runs its forward first.
                fwd.append(_timed(lambda: engine.forward(stage_feeds, 0)))
                fwd.append(_timed(lambda: engine.forward(stage_feeds, 1)))
                forced.append(_timed(lambda: engine.backward(0, grad)))
                forced.append(_timed(lambda: engine.backward(1, grad)))
    finally:
        del engine
        gc.collect()
    b_own = statistics.median(bwd)
    if forced:
        b_forced = statistics.median(forced)
        return BlockCost(statistics.median(fwd), b_forced, max(0.0, b_forced - b_own), peak.bytes)
    return BlockCost(statistics.median(fwd), b_own, 0.0, peak.bytes)


# The attention piece ----------------------------------------------------------------------------

def attention_piece(batch: int, seq: int, hidden: int, heads: int, head_size: int,
                    mask_shape: Sequence[int], seed: int = 0) -> Graph:
    """The attention of `heads` heads as a two-block IR graph whose block 1 is the piece.

    Block 1 reads the hidden state `x` (batch, seq, hidden) and the additive mask `mask`, projects
    to Q, K, V of width heads x head_size (with biases), runs scaled dot-product attention with the
    mask added to the scores, and multiplies the context by the heads x head_size rows of the
    output projection. Block 0 is an empty stand-in so that `x` is a stage's activation input and
    the backward computes its gradient, as a pipeline stage's does. Weights are random (times do
    not depend on their values; denormals are flushed).
    """
    rng = np.random.default_rng(seed)
    B, S, D, h, hs = batch, seq, hidden, heads, head_size
    w = h * hs
    consts: dict[str, np.ndarray] = {}
    values: dict[str, Value] = {}
    nodes: list[Node] = []

    def value(name: str, shape: Sequence[int]) -> str:
        values[name] = Value(name, tuple(int(d) for d in shape), "float32")
        return name

    def const(name: str, arr: np.ndarray) -> str:
        consts[name] = arr.astype(np.float32)
        return value(name, arr.shape)

    def node(op: str, inputs: Sequence[str], out: str, out_shape: Sequence[int], **attrs) -> str:
        nodes.append(Node(f"attn/{out}", op, tuple(inputs), (value(out, out_shape),), attrs))
        return out

    x = value("x", (B, S, D))
    mask = value("mask", mask_shape)
    params = []
    heads_of = {}
    for p, perm in (("q", (0, 2, 1, 3)), ("k", (0, 2, 3, 1)), ("v", (0, 2, 1, 3))):
        wt = const(f"w{p}", rng.normal(0, 0.02, (D, w)))
        bias = const(f"b{p}", rng.normal(0, 0.02, (w,)))
        params += [wt, bias]
        y = node("MatMul", (x, wt), f"{p}_proj", (B, S, w), trans_b=False)
        y = node("Add", (y, bias), f"{p}_bias", (B, S, w))
        y = node("Reshape", (y,), f"{p}_split", (B, S, h, hs), shape=[B, S, h, hs])
        heads_of[p] = node("Transpose", (y,), f"{p}_heads", tuple((B, S, h, hs)[i] for i in perm), perm=list(perm))
    scale = const("scale", np.array(1.0 / math.sqrt(hs)))
    wo = const("wo", rng.normal(0, 0.02, (w, D)))
    params.append(wo)
    s = node("MatMul", (heads_of["q"], heads_of["k"]), "scores", (B, h, S, S), trans_b=False)
    s = node("Mul", (s, scale), "scaled", (B, h, S, S))
    s = node("Add", (s, mask), "masked", (B, h, S, S))
    s = node("Softmax", (s,), "probs", (B, h, S, S), axis=3)
    c = node("MatMul", (s, heads_of["v"]), "context", (B, h, S, hs), trans_b=False)
    c = node("Transpose", (c,), "context_t", (B, S, h, hs), perm=[0, 2, 1, 3])
    c = node("Reshape", (c,), "context_flat", (B, S, w), shape=[B, S, w])
    out = node("MatMul", (c, wo), "out", (B, S, D), trans_b=False)

    params_bytes = sum(int(consts[p].nbytes) for p in params)
    flops = 2 * B * S * D * w * 4 + 2 * 2 * B * h * S * S * hs
    blocks = (
        Block(0, "input", "embeddings", (), (), (), x, (), 0, values[x].nbytes, 0),
        Block(1, f"attention.h{h}", "encoder", tuple(n.name for n in nodes), (), (x, mask), out, tuple(params),
              params_bytes, values[out].nbytes, flops, h, hs),
    )
    return Graph(f"attention-{h}x{hs}", (values[x], values[mask]), (values[out],), tuple(nodes), values,
                 consts, tuple(params), blocks, B, S)


def _attention_fwd_bwd(backend: Backend, graph: Graph, mask: np.ndarray, reps: int) -> float:
    spec = stage_spec(graph, 1, 1)
    rng = np.random.default_rng(0)
    feeds = {"x": _activation(graph, "x", rng), "mask": mask}
    grad = (1e-3 * _activation(graph, spec.output, rng)).astype(np.float32)
    engine = make_engine(backend, spec)
    try:
        engine.forward(feeds, 0)
        engine.backward(0, grad)
        times = []
        for _ in range(max(1, reps)):
            start = time.perf_counter()
            engine.forward(feeds, 0)
            engine.backward(0, grad)
            times.append(time.perf_counter() - start)
    finally:
        del engine
    return statistics.median(times)


def attention_curve(backend: Backend, batch: int, seq: int, hidden: int, heads: int, head_size: int,
                    mask: np.ndarray, reps: int = 3) -> AttentionCurve:
    """Forward+backward seconds for h = 1..heads, the faster of fused and head-by-head per h.

    A backward right after its own forward (MNN reuses its caches), like the block's pair. The
    one-head piece runs once unmeasured first: its time scales the whole head-by-head line, so
    first-use costs (torch's lazy kernel set-up) must not land in it."""
    _attention_fwd_bwd(backend, attention_piece(batch, seq, hidden, 1, head_size, mask.shape), mask, 1)
    fused = [_attention_fwd_bwd(backend, attention_piece(batch, seq, hidden, h, head_size, mask.shape), mask, reps)
             for h in range(1, heads + 1)]
    one = fused[0]
    seconds = tuple(min(f, h * one) for h, f in enumerate(fused, start=1))
    return AttentionCurve(seconds, tuple(f <= h * one for h, f in enumerate(fused, start=1)))


def _block_mask(graph: Graph, block: Block, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """The additive attention mask the block really adds to its scores, from the synthetic feeds."""
    spec = stage_spec(graph, block.index, block.index)
    env = host_values(spec, feeds)
    for name in block.inputs[1:]:
        v = graph.values.get(name)
        if v is not None and v.dtype == "float32" and len(v.shape) == 4 and name in env:
            return np.asarray(env[name], np.float32)
    batch, seq = graph.values[block.inputs[0]].shape[:2]
    return np.zeros((batch, 1, 1, seq), np.float32)


# The device -----------------------------------------------------------------------------------

def memory_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else 0."""
    return meminfo_bytes("MemAvailable") or 0


_ROOT = Path(__file__).resolve().parents[1]
_OVERHEAD_PROBE = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "import runtime.pipeline.worker, runtime.engines.mnn, runtime.transport.zeromq\n"
    "print('RSS', [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])\n"
)


def runtime_overhead_bytes(timeout_s: float = 60.0) -> int:
    """Resident memory of a fresh interpreter after importing the worker runtime (0 if unknown)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _OVERHEAD_PROBE, str(_ROOT)], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    for line in proc.stdout.splitlines():
        if line.startswith("RSS "):
            return int(line.split()[1])
    return 0


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


def split_child_bytes(backend: Backend, batch: int, seq: int, hidden: int, heads: int, head_size: int,
                      mask: np.ndarray, start_timeout_s: float = 120.0, seed: int = 0) -> int | None:
    """Peak resident bytes (VmHWM) of one head-split child process running `backend` on `heads`
    heads of an attention block of this shape, or None where /proc cannot tell.

    The child is started exactly as `runtime.engines.split.attention.SplitAttention` starts one (its
    `_ProcessWorker`: the fork server, the shared-memory blocks, the child's serve loop), given
    its weight slice, and made to run one training forward and one backward of a micro-batch; its
    VmHWM is then read from /proc before it is closed. Nothing is subtracted: the whole child
    (interpreter, runtime, engine, the shared memory it touches, its slice's workspace) exists
    only because of the split."""
    from multiprocessing import shared_memory

    from runtime.engines.split import attention as hs  # here, not at the top: head_split imports this module

    rng = np.random.default_rng(seed)
    shapes = hs._Shapes(int(batch), int(seq), int(hidden), int(head_size), tuple(int(d) for d in mask.shape))
    full = {n: rng.normal(0, 0.02, (hidden, hidden) if n.startswith("W") else (hidden,)).astype(np.float32)
            for n in hs.WEIGHT_NAMES}
    r = hs.HeadRange(backend.name, 0, int(heads))
    layout = hs._inputs_layout(shapes)
    inputs_shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
    try:
        inputs = layout.views(inputs_shm.buf)
        inputs["x"][...] = rng.standard_normal(inputs["x"].shape)
        inputs["mask"][...] = mask
        inputs["dy"][...] = 1e-3 * rng.standard_normal(inputs["dy"].shape)
        del inputs
        worker = hs._ProcessWorker(r, shapes, inputs_shm, hs.slice_weights(full, r, head_size), start_timeout_s)
        try:
            worker.send("forward", 0, True)
            worker.wait(start_timeout_s)
            worker.send("backward", 0)
            worker.wait(start_timeout_s)
            return _process_peak_rss(worker.proc.pid)
        finally:
            worker.close()
    finally:
        hs._release(inputs_shm)


@dataclass(frozen=True)
class SplitRun:
    """One measured allocation of a real split: `heads` on the measured backend, `primary_heads`
    on the in-process one, the median measured forward+backward seconds and the curves' prediction
    max(curve_primary(primary_heads), curve_backend(heads))."""

    heads: int
    primary_heads: int
    measured_s: float
    predicted_s: float
    # median compute seconds (forward + backward) per backend inside the split, as
    # `SplitAttention.last_busy_s` reports them: tells copies and round trips (measured above busy)
    # from the engines slowing each other (busy above their curves)
    busy_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitExtraCost:
    """What running `backend` in a child process next to `primary` costs beyond the curves."""

    backend: str
    primary: str
    runs: tuple[SplitRun, ...]

    @property
    def extra_s(self) -> float:
        """The fixed cost the allocator adds for `backend`: the worst excess over the runs, >= 0.
        The worst, not the mean: the copies are the same whatever the allocation, and what else
        the excess holds (the two engines slowing each other on shared caches and memory
        bandwidth) is a cost the planner must not be surprised by."""
        return max(0.0, max(r.measured_s - r.predicted_s for r in self.runs))


def split_primary(backends: Sequence[Backend]) -> Backend:
    """The backend a head split keeps in the calling process, as `runtime.engines.split.attention` does: a
    torch one if there is any (torch computes without holding the GIL), else the first; among
    several torch ones the one with the fewest threads, which leaves the most cores to the others.
    Its extra cost is 0 by definition (it holds the activations; `planner.heads`)."""
    if not backends:
        raise ValueError("no backends to pick a head split's in-process backend from")
    torch = [b for b in backends if b.engine == "torch"]
    return min(torch, key=lambda b: b.threads) if torch else backends[0]


def split_allocations(heads: int) -> list[int]:
    """Head counts for the measured (child) backend of a two-backend split of `heads` heads:
    1, H/2 and H-1 (distinct, each leaving the in-process backend at least one head)."""
    return sorted({h for h in (1, heads // 2, heads - 1) if 1 <= h <= heads - 1})


def time_split_attention(sa, x: np.ndarray, mask: np.ndarray, dy: np.ndarray, reps: int
                         ) -> tuple[list[float], list[dict[str, float]]]:
    """Wall seconds of `reps` forward+backward passes of a `runtime.engines.split.attention.SplitAttention`,
    and per pass each backend's busy seconds (its compute, without waiting for the others)."""
    times, busy = [], []
    for _ in range(reps):
        start = time.perf_counter()
        sa.forward(x, mask)
        fwd_busy = dict(sa.last_busy_s)
        sa.backward(dy)
        times.append(time.perf_counter() - start)
        busy.append({b: fwd_busy[b] + sa.last_busy_s[b] for b in fwd_busy})
    return times, busy


def split_extra_cost(primary: Backend, other: Backend, curves: Mapping[str, AttentionCurve],
                     batch: int, seq: int, hidden: int, heads: int, head_size: int, mask: np.ndarray,
                     reps: int = 3, start_timeout_s: float = 300.0, seed: int = 0) -> SplitExtraCost:
    """Run real splits of one attention block between `primary` (in this process) and `other` (in a
    child process) and compare them with what the curves predict.

    For each allocation of `split_allocations(heads)`, a `runtime.engines.split.attention.SplitAttention` is
    built as the split engine builds one (concurrent: fork server, shared memory, the child's serve
    loop; the primary listed first, so that it is the in-process backend even when neither is
    torch), runs one training forward and backward unmeasured, then `reps` timed ones; the median
    is compared with max(curve_primary(h_p), curve_other(h_o)), the allocator's model without
    extra costs. `curves` maps both backends' names to their curves of this block shape."""
    from runtime.engines.split import attention as hs  # here, not at the top: head_split imports this module

    if primary.name == other.name:
        raise ValueError(f"a split needs two different backends, got {primary.name} twice")
    if heads < 2:
        raise ValueError(f"a block of {heads} head(s) cannot be split")
    seconds = {b.name: tuple(curves[b.name].seconds) for b in (primary, other)}
    for name, s in seconds.items():
        if len(s) != heads:
            raise ValueError(f"the curve of {name} covers {len(s)} heads, the block has {heads}")
    rng = np.random.default_rng(seed)
    full = {n: rng.normal(0, 0.02, (hidden, hidden) if n.startswith("W") else (hidden,)).astype(np.float32)
            for n in hs.WEIGHT_NAMES}
    x = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    dy = (1e-3 * rng.standard_normal((batch, seq, hidden))).astype(np.float32)
    mask = np.asarray(mask, np.float32)
    runs = []
    for h_other in split_allocations(heads):
        h_primary = heads - h_other
        allocation = {primary.name: h_primary, other.name: h_other}
        with hs.SplitAttention(full, heads, head_size, allocation, batch, seq, mask.shape,
                               start_timeout_s=start_timeout_s) as sa:
            if sa.placement != {primary.name: "process", other.name: "child"}:  # pragma: no cover - a rule changed
                raise AssertionError(f"split {allocation} placed its backends {sa.placement}; expected "
                                     f"{primary.name} in this process")
            sa.forward(x, mask)
            sa.backward(dy)
            times, busy = time_split_attention(sa, x, mask, dy, max(1, reps))
        predicted = max(seconds[primary.name][h_primary - 1], seconds[other.name][h_other - 1])
        runs.append(SplitRun(h_other, h_primary, statistics.median(times), predicted,
                             {b: statistics.median(r[b] for r in busy) for b in busy[0]}))
    return SplitExtraCost(other.name, primary.name, tuple(runs))


def _measure_split_extra_costs(graph: Graph, kinds: Mapping[str, Block], feeds: Mapping[str, np.ndarray],
                               present: Sequence[Backend], profiles: Sequence[BackendProfile], reps: int,
                               say: Progress, started: float) -> dict[str, dict[str, float]]:
    """`split_extra_cost_s`: per attention block kind of >= 2 heads, `split_extra_cost` of every
    backend with a curve besides the in-process one (`split_primary`) that fits next to it on this
    machine's CPUs (threads summed; an oversubscribed pair would measure the contention, not the
    split). A backend that fails is reported and left out (unknown), like one that does not fit."""
    cpus = os.cpu_count() or 1
    by_name = {b.name: b for b in present}
    out: dict[str, dict[str, float]] = {}
    for sig, block in kinds.items():
        if not block.heads or block.heads < 2:
            continue
        curves = {p.backend: p.attention[sig] for p in profiles if sig in p.attention and p.backend in by_name}
        if len(curves) < 2:
            continue
        primary = split_primary([by_name[n] for n in curves])
        batch, seq, hidden = graph.values[block.inputs[0]].shape
        mask = _block_mask(graph, block, feeds)
        costs: dict[str, float] = {}
        for name in curves:
            other = by_name[name]
            if other == primary:
                continue
            if other.threads + primary.threads > cpus:
                say(f"split extra cost {other.name}: not measured ({other.threads} + {primary.threads} threads "
                    f"beside {primary.name} on {cpus} CPUs)")
                continue
            try:
                got = split_extra_cost(primary, other, curves, batch, seq, hidden, block.heads, block.head_size, mask,
                                       reps)
            except Exception as exc:  # noqa: BLE001 (any failure: the figure stays unknown, and says why)
                say(f"split extra cost {other.name}: not measured ({type(exc).__name__}: {str(exc).strip()[-300:]})")
                continue
            costs[other.name] = got.extra_s
            runs = ", ".join(f"{r.heads}+{r.primary_heads} {r.measured_s * 1e3:.1f} (curves {r.predicted_s * 1e3:.1f})"
                             for r in got.runs)
            say(f"split extra cost {other.name} beside {primary.name}, {block.name}: {got.extra_s * 1e3:.1f} ms "
                f"(heads {other.name}+{primary.name}: {runs} ms) [{time.perf_counter() - started:.1f} s]")
        if costs:
            out[sig] = costs
    return out


def distinct_blocks(graph: Graph) -> dict[str, Block]:
    """The first block of each signature, in graph order."""
    out: dict[str, Block] = {}
    for b in graph.blocks:
        out.setdefault(block_signature(b), b)
    return out


def profile_device(graph: Graph, name: str, backends: Sequence[str] = DEFAULT_BACKENDS, reps: int = 3,
                   progress: Progress | None = None, memory_bytes: int | None = None,
                   attention: bool = True, seed: int = 0) -> DeviceProfile:
    """Profile every distinct block kind of `graph` on each requested backend that runs here.

    `memory_bytes` overrides the measured MemAvailable (a `--memory` flag); `attention=False`
    skips the per-head curves. `progress` receives one line per measured item."""
    if not graph.blocks:
        raise ValueError(f"graph {graph.name!r} has no blocks; run the block-finding pass first")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    overhead = runtime_overhead_bytes()
    present, skipped = present_backends(backends)
    for b, why in skipped.items():
        say(f"skip {b}: {why}")
    feeds = synthetic_feeds(graph, seed)
    kinds = distinct_blocks(graph)
    threads_before = K.get_threads()
    profiles = []
    try:
        for backend in present:
            costs: dict[str, BlockCost] = {}
            curves: dict[str, AttentionCurve] = {}
            # One unmeasured run of the cheapest block takes the engine's one-time, process-wide
            # start-up (torch: ~50 MiB of lazily built kernels and threads) out of the first
            # block's workspace; that is runtime overhead, not the block's.
            cheapest = min(kinds.values(), key=lambda b: (b.flops, b.params_bytes))
            measure_stage(backend, stage_spec(graph, cheapest.index, cheapest.index), feeds, reps=1)
            for sig, block in kinds.items():
                cost = measure_stage(backend, stage_spec(graph, block.index, block.index), feeds, reps)
                costs[sig] = cost
                say(f"{backend.name} {block.name}: forward {cost.forward_s * 1e3:.1f} ms, backward "
                    f"{cost.backward_s * 1e3:.1f} ms (recompute {cost.recompute_s * 1e3:.1f}), workspace "
                    f"{cost.workspace_bytes / 2**20:.1f} MiB [{time.perf_counter() - started:.1f} s]")
            if attention:
                for sig, block in kinds.items():
                    if not block.heads:
                        continue
                    batch, seq, hidden = graph.values[block.inputs[0]].shape
                    curve = attention_curve(backend, batch, seq, hidden, block.heads, block.head_size,
                                            _block_mask(graph, block, feeds), reps)
                    curves[sig] = curve
                    say(f"{backend.name} {block.name} attention 1..{block.heads} heads: "
                        f"{curve.seconds[0] * 1e3:.1f} .. {curve.seconds[-1] * 1e3:.1f} ms "
                        f"[{time.perf_counter() - started:.1f} s]")
            profiles.append(BackendProfile(backend.name, costs, curves))
        children = _measure_split_children(graph, kinds, feeds, present, say, started) if attention else {}
        extra = (_measure_split_extra_costs(graph, kinds, feeds, present, profiles, reps, say, started)
                 if attention else {})
    finally:
        K.set_threads(threads_before)
    available = memory_bytes if memory_bytes is not None else memory_available_bytes()
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, tuple(profiles), int(available), overhead,
                         update_rates(), children, extra, accumulate_rate())


def _measure_split_children(graph: Graph, kinds: Mapping[str, Block], feeds: Mapping[str, np.ndarray],
                            present: Sequence[Backend], say: Progress, started: float) -> dict[str, int]:
    """`split_child_bytes` per engine kind among `present`: one child each, holding H-1 heads (the
    most a child of a split can hold) of the attention block kind with the most heads. The engine's
    backend with the most threads is used; a child that fails to start is reported and left out
    (unknown), as is everything when no block has two heads or more (nothing can be split)."""
    splittable = [b for b in kinds.values() if b.heads and b.heads >= 2]
    if not splittable:
        return {}
    block = max(splittable, key=lambda b: (b.heads, b.head_size or 0))
    batch, seq, hidden = graph.values[block.inputs[0]].shape
    mask = _block_mask(graph, block, feeds)
    out: dict[str, int] = {}
    for engine in ENGINES:
        candidates = [b for b in present if b.engine == engine]
        if not candidates:
            continue
        backend = max(candidates, key=lambda b: b.threads)
        try:
            nbytes = split_child_bytes(backend, batch, seq, hidden, block.heads - 1, block.head_size, mask)
        except Exception as exc:  # noqa: BLE001 (any failure: the figure stays unknown, and says why)
            say(f"split child {backend.name}: not measured ({type(exc).__name__}: {str(exc).strip()[-300:]})")
            continue
        if nbytes is None:
            say(f"split child {backend.name}: not measured (no /proc/<pid>/status here)")
            continue
        out[engine] = nbytes
        say(f"split child {backend.name} with {block.heads - 1} heads of {block.name}: peak {nbytes / 2**20:.1f} MiB "
            f"[{time.perf_counter() - started:.1f} s]")
    return out


def update_rates(nbytes: int = 32 << 20, reps: int = 3) -> dict[str, float]:
    """Seconds per parameter byte of one optimizer step (runtime.optim, in place, state allocated)."""
    from runtime.optim import make_optimizer

    params = {"w": np.zeros(nbytes // 4, np.float32)}
    grads = {"w": np.full(nbytes // 4, 1e-3, np.float32)}
    rates = {}
    for name in ("sgd", "adamw"):
        optimizer = make_optimizer(name, 1e-4)
        optimizer.step(params, grads)  # allocates the optimizer state, which later steps reuse
        rates[name] = statistics.median(_timed(lambda: optimizer.step(params, grads)) for _ in range(reps)) / nbytes
    return rates


def accumulate_rate(nbytes: int = 32 << 20, reps: int = 3) -> float:
    """Seconds per parameter byte of adding one micro-batch's gradient into the running sum, as
    runtime.pipeline.executor does (`acc += g`, in place)."""
    acc = np.zeros(nbytes // 4, np.float32)
    grad = np.full(nbytes // 4, 1e-3, np.float32)

    def add():
        nonlocal acc
        acc += grad

    add()
    return statistics.median(_timed(add) for _ in range(reps)) / nbytes


# Links ----------------------------------------------------------------------------------------

PROBE_SERVER = "link-probe-server"
PROBE_CLIENT = "link-probe-client"
_PROBE_KIND = "probe"
_MAX_PROBE_COUNT = 10_000
_MAX_PROBE_BYTES = 1 << 30


def link_from_round_trips(round_trips_s: Mapping[int, float]) -> Link:
    """A Link from median round-trip seconds per payload size (bytes): one way takes half a round
    trip; latency is the smallest message's one-way time less its bytes' share, bandwidth the
    slope between the smallest and the largest message, so `Link.transfer_s` reproduces both."""
    sizes = sorted(round_trips_s)
    if len(sizes) < 2 or sizes[0] == sizes[-1]:
        raise ValueError(f"a link needs round trips of at least two sizes, got {sizes}")
    small, large = sizes[0], sizes[-1]
    t_small, t_large = round_trips_s[small] / 2, round_trips_s[large] / 2
    if t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
    else:  # timing noise swamped the payload: the large message's own rate is a lower bound
        bandwidth = large / max(t_large, 1e-9)
    latency = max(0.0, t_small - small / bandwidth)
    return Link(bandwidth, latency)


def _probe_expected(i: int, nbytes: int) -> Expected:
    return Expected(_PROBE_KIND, -1, i, shape=(nbytes,), dtype="uint8")


def link_probe_server(listen: str, *, sessions: int | None = 1, ready: Callable[[str], None] | None = None,
                      timeout_s: float = 60.0) -> None:
    """Echo the tensors of `measure_link` clients, one client at a time, for `sessions` clients
    (None: forever). `ready` receives the bound address (useful with port 0)."""
    from runtime.transport.zeromq import ZmqTransport

    with ZmqTransport(PROBE_SERVER, listen, accept=(PROBE_CLIENT,)) as t:
        if ready is not None:
            ready(t.address)
        served = 0
        while sessions is None or served < sessions:
            _, hello = t.recv_control(PROBE_CLIENT, timeout=None)
            if hello.get("probe") != "hello" or not isinstance(hello.get("address"), str):
                continue
            t.connect(PROBE_CLIENT, hello["address"])
            t.send_control(PROBE_CLIENT, {"probe": "ready"})
            try:
                _echo_session(t, timeout_s)
            except (PeerTimeout, MessageError):
                pass  # a client that vanished or garbled its messages ends only its own session
            served += 1


def _echo_session(t, timeout_s: float) -> None:
    while True:
        _, msg = t.recv_control(PROBE_CLIENT, timeout=timeout_s)
        if msg.get("probe") != "echo":
            t.send_control(PROBE_CLIENT, {"probe": "bye"})
            return
        count, nbytes = msg.get("count"), msg.get("bytes")
        if (not isinstance(count, int) or not isinstance(nbytes, int) or not 1 <= count <= _MAX_PROBE_COUNT
                or not 1 <= nbytes <= _MAX_PROBE_BYTES):
            t.send_control(PROBE_CLIENT, {"probe": "bye", "error": "bad echo request"})
            return
        for i in range(count):
            _, arr = t.recv_tensor(PROBE_CLIENT, _probe_expected(i, nbytes), timeout=timeout_s)
            t.send_tensor(PROBE_CLIENT, _PROBE_KIND, -1, i, arr)


def _local_listen_towards(address: str) -> str:
    """A listen address on the interface this host uses to reach `address` (tcp only)."""
    if not address.startswith("tcp://"):
        raise ValueError(f"cannot guess a reply address for {address!r}; pass listen=")
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "tcp://127.0.0.1:0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return f"tcp://{s.getsockname()[0]}:0"
    except OSError:
        return f"tcp://{socket.gethostname()}:0"


def measure_link(address: str, sizes: Sequence[int] = (1 << 10, 1 << 20, 8 << 20), reps: int = 5, *,
                 listen: str | None = None, timeout_s: float = 30.0) -> Link:
    """Bandwidth and latency to the `link_probe_server` at `address`, by ping-pong over ZeroMQ.

    Each size makes one warm-up and `reps` timed round trips; `link_from_round_trips` turns the
    medians into a Link. The payload crosses the real transport (header, crc32 on both sides), so
    the figures are what pipeline transfers will see. `listen` is where the server sends replies
    (default: this host's address on the route to the server, on a free port)."""
    from runtime.transport.zeromq import ZmqTransport

    sizes = sorted({int(n) for n in sizes})
    if len(sizes) < 2 or sizes[0] < 1 or sizes[-1] > _MAX_PROBE_BYTES:
        raise ValueError(f"measure_link needs at least two distinct sizes in 1..{_MAX_PROBE_BYTES} bytes, got {sizes}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    listen = listen or _local_listen_towards(address)
    round_trips: dict[int, float] = {}
    with ZmqTransport(PROBE_CLIENT, listen, {PROBE_SERVER: address}) as t:
        t.send_control(PROBE_SERVER, {"probe": "hello", "address": t.address})
        _, reply = t.recv_control(PROBE_SERVER, timeout=timeout_s)
        if reply.get("probe") != "ready":
            raise RuntimeError(f"link probe server at {address} answered {reply!r} instead of ready")
        for nbytes in sizes:
            payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
            t.send_control(PROBE_SERVER, {"probe": "echo", "count": reps + 1, "bytes": nbytes})
            times = []
            for i in range(reps + 1):
                start = time.perf_counter()
                t.send_tensor(PROBE_SERVER, _PROBE_KIND, -1, i, payload)
                t.recv_tensor(PROBE_SERVER, _probe_expected(i, nbytes), timeout=timeout_s)
                times.append(time.perf_counter() - start)
            round_trips[nbytes] = statistics.median(times[1:])
        t.send_control(PROBE_SERVER, {"probe": "stop"})
        t.recv_control(PROBE_SERVER, timeout=timeout_s)
    return link_from_round_trips(round_trips)
