"""Workers in threads of this process: the whole multi-device plan on the in-process transport.

DESIGN.md habit 9, "fake hardware first": `InProcessWorkers(n)` starts `n` real
`runtime.pipeline.worker.Worker` objects, each in its own daemon thread at its own address on one
`LocalHub`, nameless until the coordinator's setup names it, exactly as `confidant worker` processes
wait on their sockets. The coordinator (the real `runtime.pipeline.coordinator.Coordinator`, or
`jobs.train.pipeline.train_pipeline` with `transport=workers.coordinator`) drives them through
the same protocol as over ZeroMQ; only the frames' way between endpoints differs.

Failures: a worker thread that raises reports it to the coordinator as `worker.serve` does for a
process (an `error` control message naming the stage), so the run ends with the coordinator's
WorkerFailed instead of a hang; the exception itself stays in `errors` for the test to look at.
When the run ends early, `stop` closes every worker's transport, which wakes a stage waiting for a
neighbour that will never send (the twin of terminating a worker process).

Threads and MNN: MNN's Python binding holds the GIL for a whole graph evaluation (it releases it
only around `Interpreter.runSession`, which stages do not use; a thread spinning beside a 1 s
`read` barely runs), so stage threads never run MNN concurrently and nothing in MNN needs a lock
here: they interleave between calls, each stage on its own graphs and Vars, and the losses and
weights are bit for bit those of worker processes (flush, stash, mixed MNN + PyTorch and head-split
stages compared, also with the interpreter's switch interval at 1 us; the tests compare with
single-device training, which processes equal too). PyTorch stages do compute at the same time.
Process-wide, not per stage: MNN's thread count (`runtime.engines.mnn_kernels.set_threads`, which
every MNN engine calls when built; a graph keeps the count in force when it first ran), so every
stage here must use the same count, normally 1, and torch's (`torch.set_num_threads`). Per
thread, not per process: the x86 floating-point mode. A worker process flushes denormals in its
main thread when it imports MNN; a thread only inherits its creator's mode, which need not have
been set yet, so each stage thread sets it for itself and computes as a process would.
"""
from __future__ import annotations

import threading
from typing import Callable, Mapping

from runtime.engines import fpmode
from runtime.pipeline.executor import COORDINATOR
from runtime.pipeline.worker import Worker
from runtime.transport.local import LocalHub, LocalTransport

# What `join` reports for a worker thread that did not end by itself and had to be stopped.
STOPPED = -1


class InProcessWorkers:
    """`n` workers in threads on one hub, and the coordinator's transport on it.

    `addresses[k]` is worker k's address (give them to the coordinator as stage addresses or
    spares); `coordinator` is the transport the coordinator runs on. `make_transport(k, hub,
    address)` builds worker k's transport (default: a nameless `LocalTransport` at `address`);
    tests pass one that misbehaves. `timeout_s` is each worker's receive timeout.

    Use as a context manager: on leaving, the workers the coordinator stopped are joined, and any
    still running (after an error) are stopped; `codes` then holds 0 for a worker that was told to
    stop, 1 for one that failed, and `STOPPED` for one that had to be stopped."""

    def __init__(self, n: int, *, timeout_s: float = 120.0,
                 make_transport: Callable[[int, LocalHub, str], LocalTransport] | None = None,
                 hub: LocalHub | None = None, base_files: Mapping[str, object] | None = None):
        if n < 1:
            raise ValueError(f"need at least one worker, not {n}")
        self.hub = hub if hub is not None else LocalHub()
        self.coordinator = LocalTransport(COORDINATOR, self.hub)
        self.addresses = [f"local://worker{k}" for k in range(n)]
        make_transport = make_transport or (lambda k, hub, address: LocalTransport("worker", hub, address))
        self.base_files = base_files  # every worker holds these base weights files (SHA-256 -> path)
        self.workers = [Worker(make_transport(k, self.hub, address), timeout=timeout_s, base_files=base_files)
                        for k, address in enumerate(self.addresses)]
        self.codes: list[int | None] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self._stopping: set[int] = set()
        self._threads = [threading.Thread(target=self._serve, args=(k,), name=f"confidant-worker{k}", daemon=True)
                         for k in range(n)]
        for thread in self._threads:
            thread.start()

    def _serve(self, k: int) -> None:
        worker = self.workers[k]
        fpmode.enable_flush_denormals()  # per thread: see the module docstring
        try:
            self.codes[k] = worker.serve()
        except Exception as exc:  # as runtime.pipeline.worker.serve: report, then fail
            if k in self._stopping:  # woken by `stop`: nothing went wrong here
                self.codes[k] = STOPPED
                return
            self.errors[k] = exc
            transport = worker.transport
            if COORDINATOR not in transport.peers:  # never set up, or released: no connection to it yet
                try:
                    transport.connect(COORDINATOR, self.coordinator.address)
                except Exception:
                    pass
            worker.report_failure(worker.failure(exc))
            self.codes[k] = 1
        finally:
            try:
                worker.reset()  # a head-split engine's backend processes
            finally:
                worker.held.close()
                worker.transport.close()

    def join(self, timeout_s: float = 30.0) -> list[int]:
        """Wait up to `timeout_s` for every worker thread to end; stop the ones still running."""
        for thread in self._threads:
            thread.join(timeout_s)
        if any(t.is_alive() for t in self._threads):
            self.stop()
        return list(self.codes)

    def kill(self, k: int) -> None:
        """Worker k vanishes as a killed process does: its endpoint closes and it says nothing more
        (no error report); the coordinator finds it lost through its transport (`lost_peers`)."""
        self._stopping.add(k)
        self.workers[k].transport.close()

    def restart(self, k: int, timeout_s: float = 120.0) -> None:
        """Worker k, killed, comes back at its address: a fresh worker that never had a stage, as
        a device restarting its worker process does (what the coordinator queued for the address
        meanwhile is waiting for it)."""
        self._threads[k].join(30.0)
        if self._threads[k].is_alive():
            raise RuntimeError(f"worker {k} is still running; kill it before restarting it")
        self._stopping.discard(k)
        self.codes[k], self.errors[k] = None, None
        self.workers[k] = Worker(_RestartedTransport("worker", self.hub, self.addresses[k]), timeout=timeout_s,
                                 base_files=self.base_files)
        self._threads[k] = threading.Thread(target=self._serve, args=(k,), name=f"confidant-worker{k}", daemon=True)
        self._threads[k].start()

    def wait_answered(self, k: int, timeout_s: float = 30.0) -> None:
        """Wait until worker k, restarted, has sent its first message (its answer to the
        coordinator's call back). Stage threads share the GIL with MNN evaluations that hold it,
        so on a loaded machine a fresh thread can take longer to answer than the run takes to
        finish; a test that means the device to be back by a boundary waits here."""
        transport = self.workers[k].transport
        if not isinstance(transport, _RestartedTransport):
            raise RuntimeError(f"worker {k} was not restarted; only a restarted worker answers a call back")
        if not transport.sent.wait(timeout_s):
            raise TimeoutError(f"restarted worker {k} sent nothing within {timeout_s:g} s: the coordinator "
                               f"never called it back, or its thread is stuck ({self.errors[k]!r})")

    def stop(self) -> None:
        """End every worker still running: close its transport, which wakes a receive waiting on it."""
        running = [k for k, t in enumerate(self._threads) if t.is_alive()]
        for k in running:
            self._stopping.add(k)
            self.workers[k].transport.close()
        for k in running:
            self._threads[k].join(30.0)

    def __enter__(self) -> InProcessWorkers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.stop()
        self.join()
        self.coordinator.close()


class _RestartedTransport(LocalTransport):
    """A restarted worker's transport: `sent` is set once it has sent anything."""

    def __init__(self, name: str, hub: LocalHub, address: str):
        super().__init__(name, hub, address)
        self.sent = threading.Event()

    def _send_frames(self, peer, frames) -> None:
        super()._send_frames(peer, frames)
        self.sent.set()
