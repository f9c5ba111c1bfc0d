"""Worker processes on this machine (`--local`): each runs `confidant worker`, prints its bound
address on its first line and waits for a coordinator. They end when the coordinator stops them,
when it dies (their connection to it breaks), or when `stop` terminates them."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class LocalWorkers:
    """Worker processes on this machine, each printing its bound address on its first line."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, n: int, threads: int, timeout_s: float = 120.0) -> "LocalWorkers":
        env = dict(os.environ)
        # one compute thread per worker unless asked: N workers must not oversubscribe the cores
        env.update({"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
                    "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
        workers = cls()
        for _ in range(n):
            proc = subprocess.Popen([sys.executable, "-m", "confidant", "worker", "--listen", "tcp://127.0.0.1:0"],
                                    stdout=subprocess.PIPE, text=True, env=env)
            workers.procs.append(proc)
        deadline = time.monotonic() + timeout_s
        for proc in workers.procs:
            line = proc.stdout.readline()
            if not line.startswith("listening "):
                workers.stop()
                raise RuntimeError(f"local worker (pid {proc.pid}) did not start: {line.strip() or 'no output'}")
            workers.addresses.append(line.split()[1])
            if time.monotonic() > deadline:
                workers.stop()
                raise RuntimeError("local workers took too long to start")
        return workers

    def wait(self, timeout_s: float = 30.0) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes

    def stop(self) -> None:
        """Terminate every worker still running (after a failure: they may wait for a coordinator
        that will never come) and collect them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        self.wait(10.0)

    def finish(self, failed: bool, timeout_s: float = 30.0) -> list[int]:
        """After training: wait for workers the coordinator stopped, or stop them when the run failed."""
        if failed:
            self.stop()
            return [p.returncode for p in self.procs]
        return self.wait(timeout_s)
