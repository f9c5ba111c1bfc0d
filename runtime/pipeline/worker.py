"""A device's runtime: bind, wait for a stage from the coordinator, run its action lists, report.

Protocol (JSON control messages; tensors as header + raw bytes, see runtime.transport.wire):
  coordinator -> worker  setup {stage, stages, graph, blocks, engine, threads, optimizer, peers, ...}
                         (optional head_split {backend: heads}: the stage's attention heads split)
                         then one "weights" tensor per constant (and "optstate" tensors on resume)
  worker -> coordinator  ready {stage, pid, rss}
  coordinator -> worker  run {step, actions} ... and "batch" tensors for each micro-batch
  worker -> coordinator  "loss" tensors (last stage), then done {stats, version, rss}
  coordinator -> worker  checkpoint  ->  worker sends "ckpt" tensors, then checkpoint_done {names}
  coordinator -> worker  setup (or setup_bundle) again (re-planning, at a flush boundary): the old
                         stage is dropped and the new one built from what comes with the message;
                         the peers in it replace the old neighbours
  coordinator -> worker  release: drop the stage (engine, weights, optimizer) and give up the name
  worker -> coordinator  released {stage}, the last message under the old name; then the worker
                         closes every outgoing connection and waits, nameless, for a setup under
                         any stage index (a re-plan that renumbers it) or for stop
  coordinator -> worker  reset: drop the stage but keep the name (and the connections)
  coordinator -> worker  stop
Any failure is reported as error {stage, message} before the worker exits non-zero, so the
coordinator can name the device and the cause instead of timing out.

A worker's transport name is its stage ("stage<k>"): neighbours and the coordinator tell its
messages apart by it. A setup under another stage index than the one the worker holds is refused
unless it released its name first, so two processes never speak under one name (see
runtime.transport.zeromq on how a name changes hands).
"""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np

from ir.plan import Action
from ir.serialize import graph_from_json
from ir.backend import BackendSpec
from runtime.engines.factory import make_engine
from runtime.pipeline.executor import COORDINATOR, StageExecutor, stage_peer
from runtime.optim import make_optimizer
from runtime.engines.stage import stage_spec
from runtime.procfs import peak_rss_bytes
from runtime.transport.wire import Expected


class Worker:
    def __init__(self, transport, timeout: float = 600.0):
        self.transport = transport
        self.timeout = timeout
        self.stage: int | None = None
        self.executor: StageExecutor | None = None
        self.bundle_actions: list[Action] | None = None

    def _recv_tensors(self, kind: str, names: list[str]) -> dict[str, np.ndarray]:
        out = {}
        for i, name in enumerate(names):
            _, arr = self.transport.recv_tensor(COORDINATOR, Expected(kind=kind, stage=-1, microbatch=i, name=name),
                                                timeout=self.timeout)
            out[name] = arr
        return out

    def reset(self) -> None:
        """Drop the stage this worker ran (engine, weights, optimizer state, buffers) before a new
        setup; only the name stays (`release` gives that up too)."""
        close = getattr(self.executor.engine, "close", None) if self.executor is not None else None
        if close is not None:  # a head-split engine's backend processes
            close()
        self.executor = None
        self.bundle_actions = None

    def release(self) -> None:
        """Drop the stage and give up the name: acknowledge under the old name (the coordinator
        waits for this before anyone else takes it), then close every outgoing connection."""
        if self.stage is None:
            raise RuntimeError("release, but this worker holds no stage name (never set up, or already released)")
        self.reset()
        self.transport.send_control(COORDINATOR, {"type": "released", "stage": self.stage})
        for peer in list(getattr(self.transport, "peers", {})):
            self.transport.disconnect(peer)
        self.stage = None

    def _take_stage(self, stage: int) -> None:
        """Become stage `stage`: a nameless worker (new, or released by a re-plan) takes the name
        now; one that holds a name keeps it, since peers know it by it."""
        if self.stage is None:
            if hasattr(self.transport, "rename"):
                self.transport.rename(stage_peer(stage))
            self.stage = stage
        elif stage != self.stage:
            raise ValueError(f"this worker is stage {self.stage} (its name on the wire) and cannot be set up as stage "
                             f"{stage} without a release first: the coordinator must release a worker's name before "
                             f"giving it another")
        self.reset()

    def _meet_peers(self, peers: dict[str, str]) -> None:
        """Connect to this setup's peers (coordinator and neighbours) and drop any old neighbour
        that is not one of them, so nothing is sent along a link the new plan does not have."""
        for peer in list(getattr(self.transport, "peers", {})):
            if peer not in peers:
                self.transport.disconnect(peer)
        for peer, address in peers.items():
            self.transport.connect(peer, address)

    def setup(self, msg: dict) -> None:
        self._take_stage(int(msg["stage"]))
        stages = int(msg["stages"])
        self._meet_peers(msg["peers"])
        constants = self._recv_tensors("weights", list(msg["graph"]["constants"]))
        graph = graph_from_json(msg["graph"], {k: np.array(v) for k, v in constants.items()})
        first, last = msg["blocks"]
        spec = stage_spec(graph, first, last)
        engine = make_engine(BackendSpec.cpu(msg.get("engine", "mnn"), int(msg.get("threads", 1))), spec,
                             head_split=msg.get("head_split"))
        opt = msg["optimizer"]
        optimizer = make_optimizer(opt["name"], float(opt["lr"]), opt.get("weight_decay"))
        if msg.get("optimizer_state"):
            optimizer.load_state(self._recv_tensors("optstate", list(msg["optimizer_state"])))
        self.executor = StageExecutor(self.stage, stages, engine, self.transport, optimizer,
                                      spec.graph_inputs, timeout=self.timeout)
        self.transport.send_control(COORDINATOR, {"type": "ready", "stage": self.stage, "pid": os.getpid(),
                                                  "rss_bytes": peak_rss_bytes()})

    def setup_bundle(self, msg: dict) -> None:
        """Set up from a plan bundle: verify every file against its manifest before using any of it;
        the stage, graph slice, weights, actions and optimizer all come from the bundle."""
        from runtime.pipeline.bundles import recv_bundle

        self._take_stage(int(msg["stage"]))
        self._meet_peers(msg["peers"])
        contents = recv_bundle(self.transport, COORDINATOR, msg["bundle_files"],
                               source=f"{msg.get('device', 'bundle')} (from the coordinator)", timeout=self.timeout)
        if contents.stage != self.stage:
            raise ValueError(f"bundle is for stage {contents.stage}, the coordinator assigned stage {self.stage}")
        doc = contents.stage_doc
        spec = stage_spec(contents.graph, contents.first_block, contents.last_block)
        engine = make_engine(doc.backend_spec, spec, head_split=doc.head_split)
        optimizer = make_optimizer(doc.optimizer.name, doc.optimizer.lr, doc.optimizer.weight_decay)
        if msg.get("optimizer_state"):
            optimizer.load_state(self._recv_tensors("optstate", list(msg["optimizer_state"])))
        self.bundle_actions = list(contents.actions)
        self.executor = StageExecutor(self.stage, doc.stages, engine, self.transport, optimizer,
                                      spec.graph_inputs, timeout=self.timeout)
        self.transport.send_control(COORDINATOR, {"type": "ready", "stage": self.stage, "pid": os.getpid(),
                                                  "rss_bytes": peak_rss_bytes(), "device": contents.device})

    def _need_stage(self, what: str) -> None:
        if self.executor is None:
            raise RuntimeError(f"{what} but this worker has no stage (not set up, or reset by a re-plan)")

    def run(self, msg: dict) -> None:
        self._need_stage(f"run of step {msg.get('step')}")
        if msg.get("actions") is not None:
            actions = [Action.parse(t) for t in msg["actions"]]
        elif self.bundle_actions is not None:
            actions = self.bundle_actions
        else:
            raise ValueError("run without actions: no bundle was loaded and the coordinator sent none")
        before = dict(self.executor.stats.seconds), self.executor.stats.wall_s
        self.executor.run(actions)
        stats = self.executor.stats
        self.transport.send_control(COORDINATOR, {
            "type": "done", "stage": self.stage, "step": msg.get("step"),
            "seconds": {k: v - before[0].get(k, 0.0) for k, v in stats.seconds.items()},
            "wall_s": stats.wall_s - before[1], "version": getattr(self.executor.engine, "version", None),
            "updates": self.executor.updates, "peak_rss_bytes": peak_rss_bytes(),
        })

    def checkpoint(self) -> None:
        self._need_stage("checkpoint")
        tensors = {f"param/{k}": v for k, v in self.executor.params.items()}
        tensors.update({f"opt/{k}": np.asarray(v) for k, v in self.executor.optimizer_state().items()})
        for i, (name, arr) in enumerate(tensors.items()):
            self.transport.send_tensor(COORDINATOR, "ckpt", self.stage, i, np.asarray(arr, order="C"), name=name)
        self.transport.send_control(COORDINATOR, {"type": "checkpoint_done", "stage": self.stage,
                                                  "names": list(tensors)})

    def failure(self, exc: BaseException) -> str:
        """`exc` as the coordinator's WorkerFailed quotes it: which stage (or, with none, which
        worker) broke, and how."""
        where = f"stage {self.stage}" if self.stage is not None else f"worker at {self.transport.address}"
        return f"{where}: {type(exc).__name__}: {exc}"

    def report_failure(self, message: str) -> None:
        """Send the coordinator an error report, as far as the transport still can (a worker that
        was never set up, or was released, has no connection to it)."""
        try:
            self.transport.send_control(COORDINATOR, {"type": "error", "stage": self.stage, "message": message})
        except Exception:
            pass

    def serve(self) -> int:
        while True:
            _, msg = self.transport.recv_control(COORDINATOR, timeout=self.timeout)
            kind = msg.get("type")
            if kind == "setup":
                self.setup(msg)
            elif kind == "setup_bundle":
                self.setup_bundle(msg)
            elif kind == "run":
                self.run(msg)
            elif kind == "checkpoint":
                self.checkpoint()
            elif kind == "reset":
                self.reset()
            elif kind == "release":
                self.release()
            elif kind == "stop":
                return 0
            else:
                raise ValueError(f"unknown control message type {kind!r} from the coordinator")


def serve(listen: str, threads_hint: int | None = None, timeout: float = 600.0) -> int:
    """`confidant worker --listen ADDR`: print the bound address, then serve until told to stop."""
    from runtime.transport.zeromq import ZmqTransport

    transport = ZmqTransport("worker", listen, accept=(COORDINATOR,))
    print(f"listening {transport.address}", flush=True)
    worker = Worker(transport, timeout=timeout)
    try:
        return worker.serve()
    except Exception as exc:  # report, then fail: the coordinator must learn which device broke and why
        message = worker.failure(exc)
        print(message, file=sys.stderr)
        if os.environ.get("CONFIDANT_DEBUG"):
            traceback.print_exc()
        worker.report_failure(message)
        return 1
    finally:
        transport.close()
