"""Time blocks and attention pieces on a backend, through the stage engines the pipeline uses.

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
  backend first runs its cheapest block twice, then its most repeated kind (a decoder layer) twice
  keeping and twice per block (`start_up_bytes`), so the engine's one-time start-up
  is charged with the engine (`BackendProfile.engine_overhead_bytes`), not to the first block (a
  process that trained with the engine before the profile shows none: `confidant profile` starts
  fresh). Limits: this is RSS, so memory an allocator recycles without the kernel seeing it is
  missed; torch still measured ~25 MiB more for a shape's first run than for a repeat (MiniLM
  layer: ~105 vs ~82 MiB); MNN repeats agree within ~10%.
* what a stage holds of it (`peak_workspace`: stages of several blocks, for `stacked_bytes`) and
  what a further micro-batch in flight adds when the engine keeps activations (`kept_workspace`,
  for `kept_bytes`); `runtime.profiling.device.measure_block` takes both.
* per attention block the lowering placed, an `AttentionCurve`: forward+backward seconds of the
  block's attention for h = 1..H heads (key/value groups under grouped-query attention, with their
  query heads; the piece has the block's pre-norm and rotary embeddings too). "Fused" runs all h heads batched in one piece (Q/K/V projections of width
  h x head_size, scaled dot-product attention with the model's own additive mask, the output
  projection's h x head_size rows), built as a small IR graph and run by the same engine as the
  blocks, so MNN and torch both get a real curve. "Head by head" is h runs of the one-head piece;
  the heads have identical shapes, so its time is h x the one-head time (the h-1 additions of the
  partial outputs are left out: a few microseconds). Each entry keeps the faster of the two.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Mapping, Sequence

import numpy as np

from ir.backend import BackendSpec
from ir.graph import Graph
from ir.profile import AttentionCurve, BlockCost
from runtime.engines.factory import make_engine
from runtime.engines.split.piece import AttentionForm, attention_piece
from runtime.engines.stage import StageSpec, stage_spec
from runtime.profiling.inputs import activation, timed
from runtime.procfs import status_bytes
from runtime.profiling.memory import PeakRss


def _stage_inputs(spec: StageSpec, feeds: Mapping[str, np.ndarray], seed: int = 0):
    """Feeds for a one-stage run of `spec` and a gradient of its output (None for the loss)."""
    rng = np.random.default_rng(seed)
    stage_feeds = {k: feeds[k] for k in spec.graph_inputs}
    if spec.activation_input is not None:
        stage_feeds[spec.activation_input] = activation(spec.graph, spec.activation_input, rng)
    grad = None if spec.is_last else (1e-3 * activation(spec.graph, spec.output, rng)).astype(np.float32)
    return stage_feeds, grad


def measure_stage(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray], reps: int = 3,
                  activations: str | None = None) -> BlockCost:
    """Forward, backward (with MNN's forward re-run), recompute and workspace of one stage;
    `activations` as `make_engine` takes it (None: the engine's default)."""
    return _measure_stage(backend, spec, feeds, reps, activations)[0]


def _measure_stage(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray], reps: int,
                   activations: str | None) -> tuple[BlockCost, int]:
    """`measure_stage`, and the file pages (libraries' pages) its workspace's window mapped."""
    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec, activations=activations)
    # as the executor and the trainer run it: an embedding table's gradient as the rows it touches
    # (measured here on MiniLM's embeddings, 2 x 128: backward 19.8 -> 0.4 ms on PyTorch, 6.0 -> 0.5 on MNN)
    engine.row_gradients = True
    try:
        with PeakRss() as peak:
            engine.forward(stage_feeds, 0)   # warm-up: session creation, per-op caches
            engine.backward(0, grad)
        fwd, bwd, forced = [], [], []
        interleave = backend.engine == "mnn"
        for _ in range(max(1, reps)):
            fwd.append(timed(lambda: engine.forward(stage_feeds, 0)))
            bwd.append(timed(lambda: engine.backward(0, grad)))
            if interleave:
                # Another micro-batch's forward between a forward and its backward: each backward
                # now finds the graph holding the other input and re-runs its forward first.
                fwd.append(timed(lambda: engine.forward(stage_feeds, 0)))
                fwd.append(timed(lambda: engine.forward(stage_feeds, 1)))
                forced.append(timed(lambda: engine.backward(0, grad)))
                forced.append(timed(lambda: engine.backward(1, grad)))
    finally:
        engine = None  # let go of it (not `del`: the timed lambdas above name it, which pyflakes reads as unbound)
        gc.collect()
    b_own = statistics.median(bwd)
    if forced:
        b_forced = statistics.median(forced)
        return BlockCost(statistics.median(fwd), b_forced, max(0.0, b_forced - b_own), peak.bytes), peak.file_bytes
    return BlockCost(statistics.median(fwd), b_own, 0.0, peak.bytes), peak.file_bytes


def engine_setup_bytes(backend: BackendSpec, spec: StageSpec) -> int:
    """What building `spec`'s engine holds beyond the weights it takes, built as a worker builds
    it (`take_weights`: the engine keeps the arrays, or lets each go for its own copy): MNN's graphs
    of the blocks and their tensors (SmolLM2 int4: ~1.6 MiB a decoder layer, uncharged before),
    and a frozen weight's storage the engine widens (MNN's float32 block scales; the cost model
    takes off what it charges for those, `planner.cost.engine_bytes`). Measured on copies of the
    stage's constants, so the profiled graph keeps its own: resident memory (freed heap handed
    back) after the engine is built, less before."""
    from dataclasses import replace as _replace

    from ir.precision import QuantizedTensor
    from runtime.procfs import release_free_heap, rss_bytes

    read = {i for node in spec.compute_nodes for i in node.inputs} & set(spec.graph.constants)

    def copied(value):
        if isinstance(value, QuantizedTensor):
            return _replace(value, codes=value.codes.copy(), scales=value.scales.copy(),
                            mins=None if value.mins is None else value.mins.copy())
        return np.array(value, copy=True)

    constants = {k: copied(v) if k in read else v for k, v in spec.graph.constants.items()}
    mine = stage_spec(_replace(spec.graph, constants=constants), spec.first_block, spec.last_block)
    del constants
    gc.collect()
    release_free_heap()
    before = rss_bytes()
    engine = make_engine(backend, mine, take_weights=True)
    gc.collect()
    release_free_heap()
    after = rss_bytes()
    del engine, mine
    gc.collect()
    if before is None or after is None:
        return 0
    return max(0, after - before)


def _run_in_flight(engine, stage_feeds, grad, in_flight: int, summed: bool = False, into: dict | None = None) -> None:
    """Forwards of `in_flight` micro-batches, then their backwards (as 1F1B's warm-up holds them);
    `summed`: as a pipeline stage runs them when their backwards are summed before the update (the
    executor's `forward_into` / `backward_into` into one running sum), `into` where given (a sum kept
    across calls), else a new one."""
    summed = summed or into is not None
    grads: dict = {} if into is None else into
    for mb in range(in_flight):
        if summed:
            engine.forward_into(stage_feeds, mb, grads)
        else:
            engine.forward(stage_feeds, mb)
    for mb in range(in_flight):
        if summed:
            engine.backward_into(mb, grads, grad)
        else:
            engine.backward(mb, grad)


def run_once(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
             activations: str | None = None) -> None:
    """One forward and backward of `spec` on a freshly built engine, let go after: the engine's one-time,
    process-wide start-up (torch: the layer's kernels, autograd's engine and buffers) paid here, so what
    this process holds after it holds that start-up (`jobs.train.causal_lm`: a one-device PyTorch run's
    measured set-up, helper h106). Not `peak_workspace`, which reads its peak by starting VmHWM again: a
    run's whole-life figure reads VmHWM, so nothing here may reset it."""
    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec, activations=activations)
    engine.row_gradients = True
    try:
        engine.forward(stage_feeds, 0)
        engine.backward(0, grad)
    finally:
        del engine
        gc.collect()


def start_up_bytes(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
                   activations: str | None = None) -> int:
    """What the first training run of `backend`'s engine in this process holds beyond a repeat of
    it (`measure_stage`'s workspace twice, on fresh engines): the engine's one-time start-up, which
    every worker pays once beside its import (PyTorch, 2 x 128 MiniLM: ~40 MiB of kernels, autograd's
    engine and threads; MNN: nothing measurable). 0 once the engine has run in this process."""
    return start_up_parts(backend, spec, feeds, activations)[0]


def start_up_parts(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
                   activations: str | None = None) -> tuple[int, int]:
    """(`start_up_bytes`, the part of it that is libraries' file pages the first run mapped): a child forked
    from a server holds none of its libraries' read-only pages (a fork copies no page table of a file
    mapping), and a worker gave torch's back at its import (`runtime.library_pages`), so the first run maps
    the kernels' pages it reads (torch, 2 x 128 hidden-256 layers: ~18 of a ~20 MiB start-up), which the
    engine's term charges already where its probe trains (`runtime.profiling.memory.engine_overhead_bytes`)."""
    first, pages = _measure_stage(backend, spec, feeds, 1, activations)
    again = measure_stage(backend, spec, feeds, reps=1, activations=activations).workspace_bytes
    start_up = max(0, first.workspace_bytes - again)
    return start_up, min(start_up, pages)


def file_pages_beyond_probe(backend: BackendSpec, stages: Sequence[tuple[StageSpec, str | None]],
                            feeds: Mapping[str, np.ndarray]) -> int:
    """The libraries' file pages that a first run of each of `stages` ((spec, activations)) maps beyond what
    the engine's probe maps (`runtime.profiling.memory.engine_overhead_bytes`: its import, a product and a
    small training step, `training_step_probe`), in this process after its start-up runs: torch's library
    pages given back first (as its import gives them back), the probe's step run, then each stage once; the
    RssFile growth over the stages (SmolLM2-shaped layers, hidden 256: ~3 MiB, their MLP's kernels)."""
    from runtime.library_pages import drop_library_pages
    from runtime.profiling.training_probe import training_step_probe

    drop_library_pages()
    training_step_probe(backend.name, steps=1)
    before = status_bytes("RssFile")
    for spec, activations in stages:
        stage_feeds, grad = _stage_inputs(spec, feeds)
        engine = make_engine(backend, spec, activations=activations)
        engine.row_gradients = True
        engine.forward(stage_feeds, 0)
        engine.backward(0, grad)
        del engine
    after = status_bytes("RssFile")
    return 0 if before is None or after is None else max(0, after - before)


def peak_workspace(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
                   activations: str | None = None, in_flight: int = 1, summed: bool = False) -> int:
    """Peak bytes above the weights of a freshly built engine running two forwards and backwards
    of `spec`, one after the other (MNN's second peaks ~5 MiB higher on three MiniLM layers, with
    the first one's buffers kept while the second's temporaries come); `activations` as
    `make_engine` takes it (None: the engine's default); `in_flight`: micro-batches forwarded
    before their backwards in each of the two rounds. `summed`: every backward added into one running
    sum kept over both rounds (`backward_into`, as a worker sums a step's micro-batches), less the sum
    (the gradient term charges it): what a stage holds beside its sum. PyTorch's whole backward adds each
    weight's gradient as autograd completes it (`TorchStageEngine._backward_summed`), never the stage's
    whole set beside the sum, which a fresh `backward` returns: SmolLM2's full fine-tuning stages held
    117-194 MiB less than lines measured that way (benchmarks/MEMORY_NOTES.md, helper h150)."""
    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec, activations=activations)
    engine.row_gradients = True
    into: dict | None = {} if summed else None
    try:
        with PeakRss() as peak:
            _run_in_flight(engine, stage_feeds, grad, in_flight, into=into)
            _run_in_flight(engine, stage_feeds, grad, in_flight, into=into)
    finally:
        del engine
        gc.collect()
    return max(0, peak.bytes - gradient_bytes(into or {}))


def gradient_bytes(grads: Mapping[str, object]) -> int:
    """Bytes of a gradient sum's arrays (a row gradient's ids and rows)."""
    return sum(g.nbytes if isinstance(g, np.ndarray) else g.ids.nbytes + g.rows.nbytes for g in grads.values())


# The steps `summed_workspace` runs, shorter than a worker's (h88): the first makes what a worker's second step
# runs beside, the running gradient sum and AdamW's two moments, with one micro-batch (F0 B0, then the update);
# the second runs as many micro-batches in flight as a middle stage under 1f1b-flush does (2: its
# F0 F1 B0 F2 B1 F3 B2 B3 with 4), each backward summed into the sum, then the update. SmolLM2's layers (new
# interpreters, load ~9): 4 layers 89.56 MiB in 3.9 s, 12 layers 92.19 in 8.3 s, 30 layers 104.23 in 12.3 s, where a
# worker's whole order in both steps read 89.69 in 8.7 s, 91.84 in 20.8 s, 103.92 in 25.1 s; 4 hidden-256 layers
# 21.88 against 21.94 (benchmarks/MEMORY_NOTES.md, h88).
SUMMED_FIRST = (("F", 0), ("B", 0))
SUMMED_ORDER = (("F", 0), ("F", 1), ("B", 0), ("B", 1))


def _summed_step(engine, optimizer, stage_feeds: Mapping[str, np.ndarray], grad: np.ndarray | None,
                 order: tuple[tuple[str, int], ...]) -> None:
    """One training step of `engine` in `order` (each input and gradient a new array, as from a link,
    every backward summed in place into the running sum), then its update."""
    summed: dict = {}
    for kind, mb in order:
        if kind == "F":
            engine.forward({k: np.array(v, copy=True) for k, v in stage_feeds.items()}, mb)
        else:
            engine.backward_into(mb, summed, None if grad is None else np.array(grad, copy=True))
    engine.step(optimizer, summed)


def summed_workspace(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
                     activations: str | None = None) -> int:
    """Peak bytes of a worker's second training step of `spec`, above its built engine, less what the
    gradient and optimizer terms charge (the running gradient sum, AdamW's two moments: 3 x the stage's
    trainable weights): the workspace a stage with trainable weights holds beside them from its second
    step on. Run as a worker runs it: the engine built taking the weights; a first step of one
    micro-batch (`SUMMED_FIRST`: the sum and the moments made), a second of `SUMMED_ORDER` (as many in
    flight as a 1f1b-flush middle stage), every backward summed in place into the running sum
    (`backward_into`), each input and gradient a new array; each step then an AdamW update
    (`engine.step`); the heap not trimmed before the second step, whose peak (VmHWM, reset as it
    starts) is taken. A fresh engine's `backward`
    (`peak_workspace`) returns a stage's whole gradient set, which a worker holds once, as its sum, and
    it never has the moments beside it: a backward that runs once they sit in the heap holds ~20-40
    MiB more than a fresh engine's (SmolLM2 full fine-tuning, benchmarks/MEMORY_NOTES.md, h43, h56,
    h61, h69). Linux only (the peak is VmHWM after `/proc/self/clear_refs`); else 0."""
    from runtime.optim import make_optimizer
    from runtime.procfs import release_free_heap, reset_peak_rss, status_bytes

    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec, activations=activations, take_weights=True)
    engine.row_gradients = True
    optimizer = make_optimizer("adamw", 1e-4)
    trainable = sum(np.asarray(v).nbytes for v in engine.parameter_arrays().values())
    gc.collect()
    release_free_heap()
    base = status_bytes("VmRSS") or 0

    try:
        _summed_step(engine, optimizer, stage_feeds, grad, SUMMED_FIRST)
        if not reset_peak_rss():
            return 0
        _summed_step(engine, optimizer, stage_feeds, grad, SUMMED_ORDER)
        peak = status_bytes("VmHWM") or base
    finally:
        del engine
        gc.collect()
    return max(0, peak - base - 3 * trainable)


def kept_workspace(backend: BackendSpec, spec: StageSpec, feeds: Mapping[str, np.ndarray],
                   summed: bool = False) -> int:
    """Bytes a second micro-batch in flight adds to the peak of `spec`'s engine when it keeps
    activations: the peak of two forwards then two backwards minus that of one of each, both
    above the same level (PyTorch: the second micro-batch's saved tensors; MNN: a second set of
    block graphs, with the per-op caches and backward buffers it keeps). `summed`: the backwards
    summed into one running sum as a pipeline stage sums them (`_run_in_flight`)."""
    stage_feeds, grad = _stage_inputs(spec, feeds)
    engine = make_engine(backend, spec, activations="keep")
    engine.row_gradients = True
    try:
        # each peak over two rounds: the first of each builds what later ones reuse (the engine's
        # buffers, MNN's second set of graphs), the second can peak higher beside them
        with PeakRss() as one:
            _run_in_flight(engine, stage_feeds, grad, 1, summed)
            _run_in_flight(engine, stage_feeds, grad, 1, summed)
        with PeakRss(base=one.base) as two:
            _run_in_flight(engine, stage_feeds, grad, 2, summed)
            _run_in_flight(engine, stage_feeds, grad, 2, summed)
    finally:
        del engine
        gc.collect()
    return max(0, two.bytes - one.bytes)


# The attention piece ----------------------------------------------------------------------------

def _attention_fwd_bwd(backend: BackendSpec, graph: Graph, mask: np.ndarray, reps: int) -> float:
    spec = stage_spec(graph, 1, 1)
    rng = np.random.default_rng(0)
    feeds = {"x": activation(graph, "x", rng), "mask": mask}
    grad = (1e-3 * activation(graph, spec.output, rng)).astype(np.float32)
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


def attention_curve(backend: BackendSpec, batch: int, seq: int, hidden: int, heads: int, head_size: int,
                    mask: np.ndarray, reps: int = 3, form: AttentionForm | None = None) -> AttentionCurve:
    """Forward+backward seconds for h = 1..heads units, the faster of fused and head-by-head per h.
    A unit is a head, or under grouped-query attention a key/value head with its query heads
    (`form`: the block's `runtime.engines.split.piece.AttentionForm`; BERT's if not given).

    A backward right after its own forward (MNN reuses its caches), like the block's pair. The
    one-head piece runs once unmeasured first: its time scales the whole head-by-head line, so
    first-use costs (torch's lazy kernel set-up) must not land in it."""
    def piece(h: int) -> Graph:
        return attention_piece(batch, seq, hidden, h, head_size, mask.shape, form=form)

    _attention_fwd_bwd(backend, piece(1), mask, 1)
    fused = [_attention_fwd_bwd(backend, piece(h), mask, reps) for h in range(1, heads + 1)]
    one = fused[0]
    seconds = tuple(min(f, h * one) for h, f in enumerate(fused, start=1))
    return AttentionCurve(seconds, tuple(f <= h * one for h, f in enumerate(fused, start=1)))


def _step_rate(optimizer, nbytes: int, reps: int, **step_options) -> float:
    """Seconds per parameter byte of one `optimizer.step` over `nbytes` of weights, its state
    allocated by a first step as later steps find it."""
    params = {"w": np.zeros(nbytes // 4, np.float32)}
    grads = {"w": np.full(nbytes // 4, 1e-3, np.float32)}
    optimizer.step(params, grads, **step_options)
    return statistics.median(timed(lambda: optimizer.step(params, grads, **step_options))
                             for _ in range(reps)) / nbytes


def update_rates(nbytes: int = 32 << 20, reps: int = 3) -> dict[str, float]:
    """Seconds per parameter byte of one optimizer step (runtime.optim, in place, state allocated)."""
    from runtime.optim import make_optimizer

    return {name: _step_rate(make_optimizer(name, 1e-4), nbytes, reps) for name in ("sgd", "adamw")}


def engine_update_rates(backend: BackendSpec, spec: StageSpec, nbytes: int = 32 << 20,
                        reps: int = 3) -> dict[str, float]:
    """Seconds per parameter byte of one step of each optimizer `backend`'s engine steps with a
    native kernel of its own (`StageEngine.optimizer_kernel`: PyTorch's fused AdamW), measured as
    `update_rates` is, at the engine's thread setting; {} for an engine that has none (MNN)."""
    from runtime.optim import make_optimizer

    engine = make_engine(backend, spec)
    rates = {}
    for name in ("sgd", "adamw"):
        optimizer = make_optimizer(name, 1e-4)
        kernel = engine.optimizer_kernel(optimizer)
        if kernel is not None:
            rates[name] = _step_rate(optimizer, nbytes, reps, dense_kernel=kernel)
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
    return statistics.median(timed(add) for _ in range(reps)) / nbytes
