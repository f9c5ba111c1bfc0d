"""Memory figures measured as a fresh worker runs: each one in a child interpreter of its own.

A worker is a fresh process: it imports the runtime, builds its stage's engine and runs its first
steps. The profiling process is not: by the time it measures a decoder layer's per-layer line it has
built and freed every other engine of the profile, and its heap has room that a worker's has not.
glibc's malloc raises its mmap threshold each time a large mapped block is freed (up to 32 MiB), so
a process that has freed big activations serves later ones from its heap, where freed pages stay.
A fresh PyTorch worker recomputing SmolLM2 int4 layers per block grew ~3.5-4 MiB a further layer,
where the warm profile measured 0.5-3.1, and its plans ran 1.06-1.21x their figure; torch's start-up
term measured in the profiling process moved 65-81 MiB between profiles
(benchmarks/MEMORY_NOTES.md, helpers h18 and h22).

So `fresh_measurements` runs each measurement in a child started with `subprocess` (a new
interpreter, not a fork: a fork inherits the parent's heap and its malloc settings), one at a time,
each importing what a worker imports first (the runtime, its transport), then loading the stage's
graph and feeds from a file this process wrote (the stage's constants only) and running the
measurement on a freshly built engine (`peak_workspace`: peak above the built engine, first steps
included; `start_up_bytes`). Engines set their own thread count from the backend name.
Cost: a child per figure (~1 s for MNN, ~3-6 s for PyTorch here, most of it importing torch); one server per
engine a profile (`ForkServers`), and two children where three were asked and the first two agree
(`agreeing_readings`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ir.backend import BackendSpec, engine_of
from ir.graph import Graph
from runtime.engines.stage import stage_spec

_ROOT = Path(__file__).resolve().parents[2]  # the checkout: a child imports the runtime from it

# (what, first block, last block, activations): "peak" is `peak_workspace` (one micro-batch in flight),
# "peak2" the same with two in flight, "summed_peak" / "summed_peak2" those beside a running gradient sum (less
# it), "start_up" `start_up_bytes`, "engine" `engine_setup_bytes` (the
# stage's engine built as a worker builds it, first: nothing run before it), "summed" `summed_workspace` (a
# worker's second step, less its gradient sum and AdamW's moments)
Measurement = tuple[str, int, int, "str | None"]

# The fork server: a fresh interpreter that imports what a worker imports first (the runtime, its
# transport, the backend's engine and so torch), runs nothing, then forks one child per measurement
# (a line on stdin: the backend, a tab, the path of its job file) and reports its exit. Each child starts
# from the heap of imports alone, as a worker does, without paying torch's import again (~3-4 s each here).
# The server only imports and forks, so one serves every backend of its engine (`ForkServers`): a thread
# variant's children start from the same heap as they would from a server of their own.
_SERVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
import runtime.pipeline.worker, runtime.engines.mnn, runtime.transport.zeromq  # a worker's first imports
from runtime.profiling.fresh import _preload, _run_child
_preload(sys.argv[2])
for line in sys.stdin:
    backend, path = line.rstrip("\\n").split("\\t", 1)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _run_child(backend, path)
        except BaseException as exc:
            print('FAILED ' + type(exc).__name__ + ': ' + str(exc)[-800:], flush=True)
            code = 1
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print('DONE ' + str(status), flush=True)
"""


def _preload(backend: str) -> None:
    """In the server, before any fork: the modules a measurement needs, the backend's engine included."""
    import ir.graph  # noqa: F401 (unpickling the stage's graph)
    import runtime.engines.factory  # noqa: F401
    import runtime.profiling.compute  # noqa: F401
    from ir.backend import engine_of

    if engine_of(backend) == "torch":
        import runtime.engines.pytorch  # noqa: F401 (and torch)


def _start_server(backend: str) -> subprocess.Popen | None:
    """A fork server (`_SERVER`) preloaded for `backend`'s engine; None where fork is missing."""
    if not hasattr(os, "fork"):
        return None
    return subprocess.Popen([sys.executable, "-c", _SERVER, str(_ROOT), backend], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _stop_server(server: subprocess.Popen | None) -> None:
    if server is None:
        return
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class ForkServers:
    """`with ForkServers() as servers: FreshProcesses(backend, servers)`: one fork server (`_SERVER`) per
    engine, started when a backend of it first asks, shared by every FreshProcesses given it (a profile's
    thread variants: `profile_device`), stopped on exit. The server only imports and forks, so a child's
    figures are the same as from a server of its backend's own; a torch server's start (its import of torch,
    ~3-4 s CPU) is paid once a profile instead of once a backend."""

    def __init__(self):
        self._servers: dict[str, subprocess.Popen | None] = {}

    def __enter__(self) -> "ForkServers":
        return self

    def server(self, backend: str) -> subprocess.Popen | None:
        engine = engine_of(backend)
        if engine not in self._servers:
            self._servers[engine] = _start_server(backend)
        return self._servers[engine]

    def __exit__(self, *exc: object) -> None:
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            _stop_server(server)


class FreshProcesses:
    """`with FreshProcesses(backend) as fresh: fresh.run(graph, feeds, measurements)`: measurements,
    each job in a child forked from one server interpreter that has only imported the runtime and
    the backend's engine (`_SERVER`): its own, or with `servers` the engine's of a `ForkServers` (left
    running on exit). Where fork is missing, each job in a new interpreter."""

    def __init__(self, backend: BackendSpec | str, timeout_s: float = 600.0, servers: ForkServers | None = None):
        self.name = backend if isinstance(backend, str) else backend.name
        self.timeout_s = timeout_s
        self._servers = servers
        self._server: subprocess.Popen | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="confidant-fresh-")

    def __enter__(self) -> "FreshProcesses":
        self._server = _start_server(self.name) if self._servers is None else self._servers.server(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._servers is None:
            _stop_server(self._server)
        self._server = None
        self._folder.cleanup()

    def run(self, graph: Graph, feeds: Mapping[str, np.ndarray], measurements: Sequence[Measurement]) -> list[int]:
        """`measurements` in order in one fresh child; their bytes, in order (RuntimeError if it fails)."""
        stage = _stage_graph(graph, [(first, last) for _, first, last, _ in measurements])
        path = os.path.join(self._folder.name, "job.json")
        _write_job(path, stage, feeds, measurements)
        del stage
        if self._server is None:
            return _measure_in_new_interpreter(self.name, path, self.timeout_s)
        self._server.stdin.write(f"{self.name}\t{path}\n")
        self._server.stdin.flush()
        lines = []
        for line in self._server.stdout:
            if line.startswith("DONE "):
                break
            lines.append(line)
        else:
            raise RuntimeError(f"the fresh {self.name} measurement server ended (exit {self._server.poll()})")
        return _result(self.name, lines, 0 if line.strip() == "DONE 0" else 1, "".join(lines))

    def run_new(self, graph: Graph, feeds: Mapping[str, np.ndarray], measurements: Sequence[Measurement]) -> list[int]:
        """`run`, in a new interpreter of its own rather than a child of the fork server: a worker's
        second step's peak ("summed") read in fork-server children moved 85-89 MiB between runs on a
        4-layer full fine-tuning stage where new interpreters, as a worker is, held 89.1-89.6
        (benchmarks/MEMORY_NOTES.md, h69). ~1-2 s more a figure (the runtime's imports)."""
        stage = _stage_graph(graph, [(first, last) for _, first, last, _ in measurements])
        path = os.path.join(self._folder.name, "job.json")
        _write_job(path, stage, feeds, measurements)
        del stage
        return _measure_in_new_interpreter(self.name, path, self.timeout_s)


_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import runtime.pipeline.worker, runtime.engines.mnn, runtime.transport.zeromq  # a worker's first imports
from runtime.profiling.fresh import _run_child
_run_child(sys.argv[2], sys.argv[3])
"""


def _measure_in_new_interpreter(name: str, path: str, timeout_s: float) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(_ROOT), name, path], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return _result(name, proc.stdout.splitlines(), proc.returncode, proc.stderr)


def _result(name: str, lines: Sequence[str], code: int, errors: str) -> list[int]:
    found = [line for line in lines if line.startswith("FRESH ")]
    if code != 0 or not found:
        raise RuntimeError(f"a fresh {name} measurement failed (exit {code}): {errors.strip()[-1500:]}")
    return [int(v) for v in json.loads(found[-1][6:])]


def _stage_graph(graph: Graph, ranges: Sequence[tuple[int, int]]) -> Graph:
    """`graph` with only the constants the blocks of `ranges` read (what a child needs to build them), each
    quantized weight's scales (and offsets) as its storage holds them: an MNN engine built in this process
    leaves the graph views of its float32 copies of them (`runtime.engines.mnn._hold_once`), the same
    values widened exactly, which the job's file format (float16) takes back exactly."""
    from ir.precision import QuantizedTensor

    def stored(value):
        if not isinstance(value, QuantizedTensor) or value.scales.dtype == np.float16:
            return value
        return replace(value, scales=value.scales.astype(np.float16),
                       mins=None if value.mins is None else value.mins.astype(np.float16))

    read: set[str] = set()
    for first, last in ranges:
        spec = stage_spec(graph, first, last)
        read |= {i for node in spec.compute_nodes + spec.host_nodes for i in node.inputs}
    return replace(graph, constants={k: stored(v) for k, v in graph.constants.items() if k in read})


def _write_job(path: str, graph: Graph, feeds: Mapping[str, np.ndarray], measurements: Sequence[Measurement]) -> None:
    """A child's job in the formats bundles use, nothing pickled: `path` (JSON: the graph document as a
    plan bundle writes it, quantized weights as their storage, and the measurements) beside
    PATH.safetensors (the graph's constants under "c/", the feeds under "f/")."""
    from ir.safetensors import save_safetensors
    from ir.serialize import graph_to_json, stored_constants

    tensors = {f"c/{k}": v for k, v in stored_constants(graph.constants).items()}
    tensors.update({f"f/{k}": np.asarray(v) for k, v in feeds.items()})
    save_safetensors(path + ".safetensors", tensors)
    with open(path, "w") as f:
        json.dump({"graph": graph_to_json(graph, stored=True), "measurements": [list(m) for m in measurements]}, f)


def _read_job(path: str) -> tuple[Graph, dict[str, np.ndarray], list[Measurement]]:
    """The graph, feeds and measurements `_write_job` wrote to `path`."""
    from ir.safetensors import load_safetensors
    from ir.serialize import graph_from_json

    with open(path) as f:
        doc = json.load(f)
    tensors = load_safetensors(path + ".safetensors")
    graph = graph_from_json(doc["graph"], {k[2:]: v for k, v in tensors.items() if k.startswith("c/")})
    feeds = {k[2:]: v for k, v in tensors.items() if k.startswith("f/")}
    return graph, feeds, [(what, int(first), int(last), activations)
                          for what, first, last, activations in doc["measurements"]]


def _run_child(backend: str, path: str) -> None:
    """In the child: the measurements listed in `path`, one after another, printed as one JSON line."""
    from ir.backend import parse_backend
    from runtime.profiling.compute import (engine_setup_bytes, file_pages_beyond_probe, peak_workspace,
                                           start_up_bytes, start_up_parts, summed_workspace)

    spec_of_backend = parse_backend(backend)
    graph, feeds, measurements = _read_job(path)
    out = []
    split = []  # the "start_up_parts" stages, for the pages they map beyond the engine's probe
    for what, first, last, activations in measurements:
        spec = stage_spec(graph, first, last)
        measure = peak_workspace if what == "peak" else start_up_bytes
        if what == "start_up_parts":  # the start-up and its file pages, two figures
            out.extend(int(v) for v in start_up_parts(spec_of_backend, spec, feeds, activations))
            split.append((spec, activations))
        elif what in ("peak2", "summed_peak2"):  # two micro-batches in flight
            out.append(int(peak_workspace(spec_of_backend, spec, feeds, activations, in_flight=2,
                                          summed=what == "summed_peak2")))
        elif what == "summed_peak":  # beside a running gradient sum, less the sum
            out.append(int(peak_workspace(spec_of_backend, spec, feeds, activations, summed=True)))
        elif what == "summed":  # a worker's second step, beside its gradient sum and AdamW's moments
            out.append(int(summed_workspace(spec_of_backend, spec, feeds, activations)))
        elif what == "engine":
            out.append(int(engine_setup_bytes(spec_of_backend, spec)))
        else:
            out.append(int(measure(spec_of_backend, spec, feeds, activations)))
    if split:  # last: the figure after every "start_up_parts" one
        out.append(int(file_pages_beyond_probe(spec_of_backend, split, feeds)))
    print("FRESH " + json.dumps(out), flush=True)


# Two fresh readings of one figure this close stand for three (`agreeing_readings`).
AGREE_BYTES = 256 << 10


def agreeing_readings(read: Callable[[], int], repeats: int) -> list[int]:
    """`repeats` readings (`read()`, each a fresh child), or two where `repeats` is 3 and the first two agree
    within AGREE_BYTES: children of one fork server share its hash seed and address layout, so their repeats
    read one allocation order again (identical to ~0.01-0.15 MiB, benchmarks/MEMORY_NOTES.md, h60, h62, h72;
    the figures move between servers, i.e. between profiles, not between repeats). The median of three then
    lies between the two, so their mean is it to within AGREE_BYTES / 2, and a third reading would not move
    the highest by more than the repeats' own spread."""
    out = [read()]
    while len(out) < repeats:
        out.append(read())
        if repeats == 3 and len(out) == 2 and abs(out[1] - out[0]) <= AGREE_BYTES:
            break
    return out


def fresh_peaks(fresh: FreshProcesses, graph: Graph, feeds: Mapping[str, np.ndarray], first: int,
                lengths: Sequence[int], activations: str | None, repeats: int, summed: bool = False) -> list[list[int]]:
    """Per length k of `lengths`, `repeats` peaks (`peak_workspace`) of a stage of blocks first..first+k-1,
    each in a fresh child (`agreeing_readings`: two where they agree): what a worker's first steps peak above
    its built engine (an engine's start-up included); `summed`: beside a running gradient sum, less it."""
    what = "summed_peak" if summed else "peak"
    return [agreeing_readings(lambda k=k: fresh.run(graph, feeds, [(what, first, first + k - 1, activations)])[0],
                              repeats) for k in lengths]


def summed_peaks(fresh: FreshProcesses, graph: Graph, feeds: Mapping[str, np.ndarray], first: int,
                 lengths: Sequence[int], activations: str | None, repeats: int) -> list[list[int]]:
    """Per length k of `lengths`, `repeats` readings of a worker's second step (`summed_workspace`) on a
    stage of blocks first..first+k-1, each in a new interpreter (`FreshProcesses.run_new`)."""
    return [[fresh.run_new(graph, feeds, [("summed", first, first + k - 1, activations)])[0] for _ in range(repeats)]
            for k in lengths]


def fresh_line(peaks: Sequence[Sequence[int]], less: int = 0) -> tuple[int, int]:
    """(what each further block adds, the one-block workspace) of fresh peaks of stages of 1..L blocks
    (`fresh_peaks`), `less` (the start-up charged with the engine) taken off each: a further block
    adds the median step between the lengths' median peaks (three steps: one jump outvoted; two:
    the smaller), and the workspace is the highest peak of any repeat less what stacks under it, so
    every measured stage is covered. Neither below 0; the workspace at least the step."""
    medians = [statistics.median(p) - less for p in peaks]
    steps = sorted(b - a for a, b in zip(medians, medians[1:]))
    step = max(0, int(steps[(len(steps) - 1) // 2])) if steps else 0
    workspace = max(max(p) - less - k * step for k, p in enumerate(peaks))
    return step, max(step, int(workspace))


def summed_line(peaks: Sequence[Sequence[int]], lengths: Sequence[int], lean_run: int, less: int = 0) -> tuple[int, int]:
    """(what each further block adds, the one-block workspace) of a worker's second-step readings
    (`summed_peaks`) at `lengths` (2..lean_run or 1..lean_run, then far points), `less` taken off each. Through 2..lean_run
    blocks the line is robust to one length's readings sitting a layer's gradient high (SmolLM2-shaped
    layers, new interpreters: 61.6 / 89.5 / 103.4 / 89.5 MiB at 1-4 layers, the 3-layer job's every reading,
    where a worker-like run of 3 layers holds what 2 and 4 do, benchmarks/MEMORY_NOTES.md, h80): the step
    is the median of the pairwise steps between the lengths' medians, the level the median of the
    medians less what stacks under them; the 1 -> 2 jump (~28 MiB) is charged once, in the level, not per
    block. With far points the step is the steepest from that level at lean_run blocks to a far point's
    highest reading (the step grows past 12 SmolLM2 layers, h61), and the workspace covers the far
    readings and the one-block readings less what stacks under them. Neither below 0."""
    medians = {k: statistics.median(p) - less for k, p in zip(lengths, peaks)}
    near = [k for k in lengths if 2 <= k <= lean_run]
    pairs = sorted((medians[b] - medians[a]) / (b - a) for a in near for b in near if b > a)
    step = statistics.median(pairs) if pairs else 0.0
    level = statistics.median(medians[k] - (k - 1) * step for k in near) if near else medians[lengths[0]]
    fars = [(k, p) for k, p in zip(lengths, peaks) if k > lean_run]
    if fars:
        at_run = level + (lean_run - 1) * step
        step = max((max(p) - less - at_run) / (k - lean_run) for k, p in fars)
    step = max(0.0, step)
    level = statistics.median(medians[k] - (k - 1) * step for k in near) if near else level
    covered = [max(p) - less - (k - 1) * step for k, p in zip(lengths, peaks) if k == 1 or k > lean_run]
    workspace = max([level] + covered)
    return int(step), max(int(step), int(workspace))


def fresh_in_flight(fresh: FreshProcesses, graph: Graph, feeds: Mapping[str, np.ndarray], first: int,
                    peaks: Sequence[Sequence[int]], activations: str | None, repeats: int,
                    summed: bool = False) -> tuple[int, int]:
    """(what a further micro-batch in flight adds per block, what it adds once) of a stage of blocks
    first.. with `activations`: `repeats` fresh peaks with two micro-batches in flight ("peak2") at
    one block and at len(`peaks`) blocks, each median less the median one-in-flight peak of that
    length (`peaks`, from `fresh_peaks` of lengths 1..L), is a line: its slope per block, its
    intercept once. Neither below 0. `summed`: both peaks beside a running gradient sum, less it."""
    run = len(peaks)
    what = "summed_peak2" if summed else "peak2"
    two = {k: statistics.median(agreeing_readings(
        lambda k=k: fresh.run(graph, feeds, [(what, first, first + k - 1, activations)])[0], repeats))
        for k in (1, run)}
    added = {k: max(0.0, two[k] - statistics.median(peaks[k - 1])) for k in (1, run)}
    per_block = max(0, int((added[run] - added[1]) / (run - 1))) if run > 1 else 0
    return per_block, max(0, int(added[1] - per_block))


def median_start_up(fresh: FreshProcesses, graph: Graph, feeds: Mapping[str, np.ndarray],
                    measurements: Sequence[Measurement], repeats: int) -> int:
    """The median over `repeats` fresh children (`agreeing_readings`) of the sum of `measurements`
    (`start_up_bytes` each, in order in one child, as `profile_device` runs them)."""
    return int(statistics.median(agreeing_readings(lambda: sum(fresh.run(graph, feeds, measurements)), repeats)))


def start_up_and_held(fresh: FreshProcesses, graph: Graph, feeds: Mapping[str, np.ndarray],
                      measurements: Sequence[Measurement], repeats: int) -> tuple[int, int]:
    """(`median_start_up` of `measurements`, the median of what of it a worker holds beyond its engine's term)
    over the same children (`agreeing_readings`; "start_up" read as "start_up_parts", each child's last
    figure `file_pages_beyond_probe`). The first is what a fresh child's first run pays again
    (taken off its peaks); the second is it less the library file pages those runs mapped, plus the pages
    they map beyond the engine's probe: a forked child maps every library page it reads again (a fork
    copies no file page table), and a worker gave torch's back at its import, so those pages are what the
    engine's term charges (its probe's import, product and training step, in a new interpreter as a
    worker is: `runtime.profiling.memory.engine_overhead_bytes`), but for the kernels the probe does not run.
    Charged as the start-up, they were charged twice: ~16 MiB of a hidden-256 per-block plan's ~350 (0.90-0.93
    of it; benchmarks/MEMORY_NOTES.md, helper h120)."""
    parts = [(what if what != "start_up" else "start_up_parts", first, last, a) for what, first, last, a in measurements]
    readings: list[tuple[int, int]] = []

    def read() -> int:
        values = fresh.run(graph, feeds, parts)
        start_up, pages = sum(values[0:-1:2]), sum(values[1:-1:2])
        readings.append((start_up, start_up - pages + values[-1]))
        return start_up

    start_up = int(statistics.median(agreeing_readings(read, repeats)))
    return start_up, max(0, min(start_up, int(statistics.median(held for _, held in readings))))
