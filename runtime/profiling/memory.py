"""Memory figures of a device: peak resident memory around a measurement, what it can give, what an
idle runtime and a head-split child process cost.

`memory_available_bytes` is MemAvailable from /proc/meminfo unless given;
`runtime_overhead_bytes` is the resident memory of a fresh interpreter that imported the worker
runtime, brought a ZeroMQ CURVE link up and passed one 4 MiB tensor over it, and built nothing
(measured in a child process, so the caller's model does not count): the MNN runtime's, ~55 MiB
here (43-45 before the link). Importing torch adds ~240 MiB on top, which this figure does not
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
"""
from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.backend import DEVICES, BackendSpec
from ir.graph import Block, Graph
from runtime.engines import mnn_kernels as K
from runtime.engines.split.piece import AttentionForm, attention_form, bert_form, random_weights
from runtime.engines.split.pieces import PieceShapes
from runtime.engines.split.pool import child_peak_rss
from runtime.procfs import meminfo_bytes, release_free_heap, reset_peak_rss, status_bytes
from runtime.profiling.inputs import Progress, block_mask


def _release_free_heap() -> None:
    """Hand freed memory back to the system, so the next measurement starts from a clean level:
    MNN's executor keeps the buffers of dead graphs pooled (a second MiniLM layer measured 47 MiB
    instead of 138 MiB without this), and glibc keeps freed heap pages."""
    gc.collect()
    K.release_memory()
    release_free_heap()


class PeakRss:
    """`with PeakRss() as p: ...` then `p.bytes`: peak resident memory above the level at entry, or
    above `base` where given (two peaks of one engine measured from the same level); `p.file_bytes`: the
    file pages (RssFile: libraries' pages) mapped inside, which only grow while the block runs, so all of
    them are in the peak (0 where /proc cannot tell)."""

    def __init__(self, base: int | None = None):
        self._given_base = base

    def __enter__(self) -> "PeakRss":
        _release_free_heap()
        self._kernel = reset_peak_rss() and status_bytes("VmHWM") is not None
        self.base = status_bytes("VmRSS") or 0
        if self._given_base is not None:
            self.base = self._given_base
        self.bytes = 0
        self.file_bytes = 0
        self._file_base = status_bytes("RssFile")
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
        file_now = status_bytes("RssFile")
        if self._file_base is not None and file_now is not None:
            self.file_bytes = min(self.bytes, max(0, file_now - self._file_base))


def memory_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else 0."""
    return meminfo_bytes("MemAvailable") or 0


_ROOT = Path(__file__).resolve().parents[2]  # the checkout: a child imports the runtime from it
_RUNTIME_IMPORTS = ("import sys; sys.path.insert(0, sys.argv[1])\n"
                    "import runtime.pipeline.worker, runtime.engines.mnn, runtime.transport.zeromq\n")
# A worker's transport up and one tensor through it: ZeroMQ's context and I/O thread, CURVE's
# buffers (~6 MiB here with both ends of a loopback link in the one process, so a slight over-count
# of one end), which a runtime that only imported the modules does not hold.
_TRANSPORT_UP = ("from runtime.keys import KeyPair\n"
                 "from runtime.transport.zeromq import ZmqTransport\n"
                 "from runtime.transport.wire import Expected\n"
                 "import numpy as np\n"
                 "_a, _b = KeyPair.generate('worker'), KeyPair.generate('peer')\n"
                 "_w = ZmqTransport('worker', 'tcp://127.0.0.1:0', keys=_a.curve_keys(), accept={'peer': _b.public.curve})\n"
                 "_p = ZmqTransport('peer', None, {'worker': _w.address}, keys=_b.curve_keys(),"
                 " peer_keys={'worker': _a.public.curve})\n"
                 "_p.send_tensor('worker', 'act', 0, 0, np.ones(1 << 20, np.float32))\n"
                 "_w.recv_tensor('peer', Expected('act', 0, 0), timeout=30)\n")


def _print_status(label: str, field: str) -> str:
    """A probe statement printing `label` and /proc/self/status's `field` in bytes."""
    return (f"print({label!r}, [int(l.split()[1]) * 1024 for l in open('/proc/self/status')"
            f" if l.startswith({field + ':'!r})][0])\n")


_PRINT_RSS = _print_status("RSS", "VmRSS")
# the peak so far (the import's transient: torch maps its libraries' pages, ~48-54 MiB above where it settles)
_PRINT_HWM = _print_status("HWM", "VmHWM")


def runtime_overhead_bytes(timeout_s: float = 60.0, also: str = "") -> int:
    """Resident memory of a fresh interpreter after importing the worker runtime and passing a tensor
    over a transport link (0 if unknown);
    `also`: a further statement to run first (an engine's import)."""
    return _probe_figures(_RUNTIME_IMPORTS + _TRANSPORT_UP + (also + "\n" if also else "") + _PRINT_RSS,
                          timeout_s).get("RSS", 0)


def _probe_figures(probe: str, timeout_s: float) -> dict[str, int]:
    """The figures a fresh interpreter running `probe` printed ("NAME bytes" lines; the first of each name)."""
    try:
        proc = subprocess.run([sys.executable, "-c", probe, str(_ROOT)], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("RSS", "HWM", "PAGES") and value.strip().isdigit():
            out.setdefault(name, int(value))
    return out


# What an engine adds to the runtime, as a worker pays it: PyTorch's engine module and one small op
# (the first op maps the kernels and starts the thread pool). MNN is in the runtime already.
_ENGINE_PROBES = {"torch": "import runtime.engines.pytorch, torch; (torch.ones(8, 8) @ torch.ones(8, 8)).sum()"}
# ... and the library pages its training maps again, which its import gave back (`runtime.library_pages`):
# the file pages (RssFile) a small training step adds, after the RSS above is read, so that the step's own
# heap (autograd's engine, its threads: the start-up term, `start_up_bytes`) is not charged here
_FILE_PAGES = "[int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssFile:')][0]"
_TRAINING_PAGES = {"torch": ("from runtime.profiling.training_probe import training_step_probe\n"
                             f"_pages = {_FILE_PAGES}\n"
                             "training_step_probe('torch:cpu:t1', steps=1)\n"
                             f"print('PAGES', max(0, {_FILE_PAGES} - _pages))\n")}


@dataclass(frozen=True)
class EngineFigures:
    """What an engine's probe measured beside a runtime of `runtime_bytes` (0 and 0 for MNN, or if unknown)."""

    overhead_bytes: int      # what it adds once settled (`engine_overhead_bytes`)
    setup_peak_bytes: int    # its import's peak (VmHWM before any training) above the runtime


def engine_figures(engine: str, runtime_bytes: int, timeout_s: float = 120.0) -> EngineFigures:
    """`engine`'s settled figure (its import and first op, and the library file pages a training step
    maps again: `_TRAINING_PAGES`) and its set-up peak (the probe's VmHWM after the import and first op,
    before the training step, less `runtime_bytes`): importing torch peaks ~48-54 MiB above where it
    settles (`runtime.engines.single.import_engine`), which a worker pays before its weights are read."""
    statement = _ENGINE_PROBES.get(engine)
    if statement is None or runtime_bytes <= 0:
        return EngineFigures(0, 0)
    figures = _probe_figures(_RUNTIME_IMPORTS + _TRANSPORT_UP + statement + "\n" + _PRINT_RSS + _PRINT_HWM
                             + _TRAINING_PAGES.get(engine, ""), timeout_s)
    if "RSS" not in figures:
        return EngineFigures(0, 0)
    return EngineFigures(max(0, figures["RSS"] - runtime_bytes) + figures.get("PAGES", 0),
                         max(0, figures.get("HWM", 0) - runtime_bytes))


def engine_overhead_bytes(engine: str, runtime_bytes: int, timeout_s: float = 120.0) -> int:
    """Resident memory `engine` adds to a runtime of `runtime_bytes` (0 for MNN, or if unknown): its
    import and first op, and the library file pages a training step maps again (`_TRAINING_PAGES`)."""
    return engine_figures(engine, runtime_bytes, timeout_s).overhead_bytes


def split_child_bytes(backend: BackendSpec, batch: int, seq: int, hidden: int, heads: int, head_size: int,
                      mask: np.ndarray, start_timeout_s: float = 120.0, seed: int = 0,
                      form: AttentionForm | None = None) -> int | None:
    """Peak resident bytes (VmHWM) of one head-split child process running `backend` on `heads`
    units (heads, or key/value groups) of an attention block of this shape and `form` (BERT's if
    not given), or None where /proc cannot tell.

    The child is started exactly as `runtime.engines.split.attention.SplitAttention` starts one
    (`runtime.engines.split.pool.child_peak_rss`: the fork server, the shared-memory blocks, the child's serve loop), given
    its weight slice, and made to run one training forward and one backward of a micro-batch; its
    VmHWM is then read from /proc before it is closed. Nothing is subtracted: the whole child
    (interpreter, runtime, engine, the shared memory it touches, its slice's workspace) exists
    only because of the split."""
    form = form or bert_form(int(hidden) // int(head_size), int(head_size), int(hidden))
    shapes = PieceShapes(int(batch), int(seq), int(hidden), int(head_size), tuple(int(d) for d in mask.shape), form)
    full = random_weights(form, seed)
    return child_peak_rss(backend.name, heads, shapes, full, mask, start_timeout_s, seed)


def measure_split_children(graph: Graph, kinds: Mapping[str, Block], feeds: Mapping[str, np.ndarray],
                            present: Sequence[BackendSpec], say: Progress, started: float) -> dict[str, int]:
    """`split_child_bytes` per engine kind among `present`: one child each, holding H-1 heads (the
    most a child of a split can hold) of the attention block kind with the most heads. The engine's
    backend with the most threads is used; a child that fails to start is reported and left out
    (unknown), as is everything when no block has two heads or more (nothing can be split)."""
    splittable = [b for b in kinds.values() if b.attention is not None and (b.split_units or 0) >= 2]
    if not splittable:
        return {}
    block = max(splittable, key=lambda b: (b.split_units, b.heads, b.head_size or 0))
    form = attention_form(graph, block)
    batch, seq, hidden = graph.values[block.inputs[0]].shape
    mask = block_mask(graph, block, feeds)
    out: dict[str, int] = {}
    for engine in DEVICES:
        candidates = [b for b in present if b.engine == engine]
        if not candidates:
            continue
        backend = max(candidates, key=lambda b: b.thread_count)
        try:
            nbytes = split_child_bytes(backend, batch, seq, hidden, form.units - 1, block.head_size, mask, form=form)
        except Exception as exc:  # noqa: BLE001 (any failure: the figure stays unknown, and says why)
            say(f"split child {backend.name}: not measured ({type(exc).__name__}: {str(exc).strip()[-300:]})")
            continue
        if nbytes is None:
            say(f"split child {backend.name}: not measured (no /proc/<pid>/status here)")
            continue
        out[engine] = nbytes
        say(f"split child {backend.name} with {form.units - 1} {_unit_word(form)} of {block.name}: peak {nbytes / 2**20:.1f} MiB "
            f"[{time.perf_counter() - started:.1f} s]")
    return out


def _unit_word(form: AttentionForm) -> str:
    return "heads" if form.group == 1 else f"key/value groups ({form.group} query heads each)"
