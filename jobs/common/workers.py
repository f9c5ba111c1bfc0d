"""Worker processes on this machine (`--local`): each runs `confidant worker`, prints its bound
address on its first line and waits for a coordinator. They end when the coordinator stops them,
when the process that started them dies (the kernel's parent-death signal, and a watcher, see
runtime.pipeline.worker.watch_parent), or when `stop` terminates them.

Secure by default: each worker gets a fresh key pair of its own and the coordinator's public key,
through a private folder (mode 0700) that is removed as soon as every worker has read its keys;
`keys` is then what the coordinator needs (train_pipeline(..., keys=workers.keys)). With
`insecure=True` the workers run plaintext and `keys` is None.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from runtime.keys import COORDINATOR_KEY, ClusterKeys, KeyPair, write_keypair


@dataclass
class LocalWorkers:
    """Worker processes on this machine, each printing its bound address on its first line."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    keys: ClusterKeys | None = None
    # how each was started, so that `restart` can start it again as it was
    _pairs: list[KeyPair] = field(default_factory=list, repr=False)
    _coordinator: KeyPair | None = field(default=None, repr=False)
    _options: dict = field(default_factory=dict, repr=False)

    @classmethod
    def start(cls, n: int, threads: int, timeout_s: float = 120.0, coordinator: KeyPair | None = None,
              insecure: bool = False, failure_timeout_s: float = 3.0, stderr=None,
              base_files: Sequence[Path] = ()) -> "LocalWorkers":
        """`n` workers; secured with `coordinator`'s key (default: a fresh pair for this run) unless
        `insecure`; each holds the base weights files `base_files` (`confidant worker --base`)."""
        workers = cls()
        if not insecure:
            coordinator = coordinator or KeyPair.generate(COORDINATOR_KEY)
            workers._pairs = [KeyPair.generate(f"local{k}") for k in range(n)]
        workers._coordinator = coordinator
        workers._options = {"threads": threads, "insecure": insecure, "failure_timeout_s": failure_timeout_s,
                            "stderr": stderr, "base": [a for f in base_files for a in ("--base", str(f))]}
        try:
            workers.procs, workers.addresses = workers._launch(list(range(n)), ["tcp://127.0.0.1:0"] * n, timeout_s)
        except BaseException:
            workers.stop()
            raise
        if not insecure:
            workers.keys = ClusterKeys(coordinator, {a: p.public for a, p in zip(workers.addresses, workers._pairs)})
        return workers

    def restart(self, k: int, timeout_s: float = 120.0) -> None:
        """Start worker k again at its address, with its key pair, after it ended (killed): what a
        device does when its worker process comes back."""
        if self.procs[k].poll() is None:
            raise RuntimeError(f"local worker {k} (pid {self.procs[k].pid}) is still running")
        procs, addresses = self._launch([k], [self.addresses[k]], timeout_s)
        if addresses != [self.addresses[k]]:
            procs[0].kill()
            raise RuntimeError(f"local worker {k} came back at {addresses[0]}, not {self.addresses[k]}")
        self.procs[k] = procs[0]

    def _launch(self, which: list[int], listen: list[str], timeout_s: float):
        """Start workers `which` (indices into the key pairs) listening at `listen`; their processes
        and bound addresses once each has printed it."""
        opts = self._options
        env = dict(os.environ)
        # one compute thread per worker unless asked: N workers must not oversubscribe the cores
        threads = str(opts["threads"])
        env.update({"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                    "TOKENIZERS_PARALLELISM": "false"})
        folder = None
        if not opts["insecure"]:
            folder = Path(tempfile.mkdtemp(prefix="confidant-keys-"))  # mkdtemp: mode 0700
            (folder / f"{COORDINATOR_KEY}.pub").write_text(f"{self._coordinator.public.text} {COORDINATOR_KEY}\n")
            for k in which:
                write_keypair(folder, self._pairs[k])
        procs, addresses = [], []
        try:
            for k, address in zip(which, listen):
                security = ["--insecure"] if opts["insecure"] else ["--keys", str(folder), "--name", self._pairs[k].name]
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "confidant", "worker", "--listen", address,
                     "--failure-timeout", str(opts["failure_timeout_s"]), *security, *opts["base"],
                     "--exit-with", str(os.getpid())],
                    stdout=subprocess.PIPE, stderr=opts["stderr"], text=True, env=env))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                line = proc.stdout.readline()
                if not line.startswith("listening "):
                    raise RuntimeError(f"local worker (pid {proc.pid}) did not start: {line.strip() or 'no output'}")
                addresses.append(line.split()[1])
                if time.monotonic() > deadline:
                    raise RuntimeError("local workers took too long to start")
        except BaseException:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            raise
        finally:
            if folder is not None:  # every worker printed its address after reading its keys
                shutil.rmtree(folder, ignore_errors=True)
        return procs, addresses

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


def coordinator_pair(keys_dir: Path, create: bool = True, note=None) -> KeyPair:
    """The coordinator's key pair from `keys_dir`/coordinator.key, made there first (with a note)
    when it is absent and `create`."""
    from runtime.keys import read_keypair

    path = Path(keys_dir) / f"{COORDINATOR_KEY}.key"
    if not path.exists() and create:
        Path(keys_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        pair = KeyPair.generate(COORDINATOR_KEY)
        write_keypair(keys_dir, pair)
        if note is not None:
            note(f"made a coordinator key pair in {keys_dir} ({COORDINATOR_KEY}.pub: give it to the workers)")
        return pair
    return read_keypair(path)


def parse_workers(spec: Sequence[str], keys_dir: Path | None, insecure: bool) -> tuple[list[str], ClusterKeys | None]:
    """`--workers NAME=ADDRESS,...` (NAME.pub in --keys DIR) as addresses and the cluster's keys;
    plain ADDRESS entries only with --insecure."""
    from jobs.common.errors import JobError
    from runtime.keys import KeyDir, KeyFileError

    names, addresses = [], []
    for item in spec:
        name, sep, address = item.partition("=")
        if not sep:
            name, address = "", item
        names.append(name.strip())
        addresses.append(address.strip())
    if insecure:
        return addresses, None
    missing = [a for n, a in zip(names, addresses) if not n]
    if missing or keys_dir is None:
        raise JobError("--workers: give each worker as NAME=ADDRESS, with NAME.pub and coordinator.key in --keys DIR "
                       "(`confidant keys DIR coordinator NAME...`), or run with --insecure"
                       + (f"; no name for {missing}" if missing else ""))
    try:
        keydir = KeyDir.load(keys_dir, COORDINATOR_KEY)
        return addresses, ClusterKeys(keydir.own, {a: keydir.key_of(n) for n, a in zip(names, addresses)})
    except KeyFileError as exc:
        raise JobError(str(exc)) from None
