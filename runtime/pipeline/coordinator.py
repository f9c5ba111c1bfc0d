"""The coordinator: hands each worker its stage, feeds micro-batches, collects losses and figures,
writes checkpoints, re-arranges the stages when the plan changes, and turns any worker's failure
into one clear error.

It talks to workers only through a Transport, so the same code drives real worker processes over
ZeroMQ and in-process workers in tests. Stage k's peer is named "stage<k>".

Re-planning (`reconfigure`) happens at a flush boundary: between two steps of a flush schedule
every stage has applied the same updates and holds no activation, gradient or in-flight message,
so the stage's whole training state is its parameters plus its optimizer state. The coordinator
gathers both from every stage (the checkpoint path, `gather`), then sets the workers up again
with their new stages, each from the new plan's bundle (written from the gathered weights) and
the optimizer entries of its own parameters (optimizer state is keyed by parameter name,
runtime.optim), so no update is lost and training continues exactly as a run that had used the
new plan from that step. `Reconfiguration.moves` says which blocks changed worker and how many
bytes that was.

Every run is a plan: a stage is always set up from its bundle (a plan folder's, or one emitted in
memory by `train-pipeline`), and the workers run the bundle's verified actions; the coordinator
sends data, never actions.

Lost workers (`WorkerLost`): every wait also watches the transport's links (ZeroMQ heartbeats),
so a worker that is killed, frozen or unreachable is reported within the transport's heartbeat
time, naming its stage and address, instead of after `timeout_s` of silence; a busy worker keeps
answering heartbeats and is never taken for lost. `abort` then stops the step on the survivors
(see runtime.pipeline.worker for the fence that keeps the aborted step's messages out of the next),
`forget` drops the lost workers, and `reconfigure(..., state=)` sets the survivors up again from
state held here (jobs.train.pipeline keeps it at every flush boundary), so no update is lost.

Tied weights (`ir.graph.tied_parameters`: a weight read by blocks of several stages) are summed
here: at every UPDATE each holder sends its accumulated gradient ("tied_grad"), the coordinator
adds the parts in stage order (one fixed order, so every holder gets the same bits) and sends the
sum back ("tied_sum"); flush schedules only, since 1f1b-stash has no point at which the copies
could be made equal.

A worker's pipeline position is its transport name ("stage<k>"), so a new plan that renumbers
workers (reorders them, drops one from the middle, or brings in a spare) renames them. Names change
hands in two rounds, never overlapping: first every worker that leaves or moves is released (it
drops its stage, acknowledges under its old name and closes its connections), then the new stages
are set up, each worker taking its new name and connecting to its new neighbours. Workers left out
wait, nameless, until a later re-plan takes them back or the final stop.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.graph import Graph, tied_parameters_of_blocks
from ir.plan import DEFAULT_LR, ActionKind, Schedule
from runtime.pipeline.checkpoints import TrainingState, dense_from_wire, merge_checkpoint
from runtime.pipeline.executor import COORDINATOR, stage_peer
from runtime.engines.stage import stage_spec
from runtime.pipeline import worker as _worker
from runtime.transport.wire import SAME_CONFIDANT, Expected, PeerTimeout, ProtocolMismatch


def _stage_engine(files: Mapping[str, bytes]) -> str | None:
    """The engine a bundle's stage runs on (its stage.json's `engine`), told in the setup order so that
    the worker imports it before the stage's weights are read (`runtime.engines.single.import_engine`)."""
    from ir.bundle import stage_document
    from ir.documents import BundleError

    try:
        return stage_document(files, "to ship").engine
    except (KeyError, BundleError):  # the worker's own check of the bundle names the fault
        return None


class WorkerFailed(RuntimeError):
    """A worker reported an error or went silent; the message names the stage and the cause."""


class CoordinatorStalled(WorkerFailed):
    """This process stood still (stopped, suspended, starved) longer than a worker waits for a silent
    coordinator: every worker has dropped its stage and ignores this coordinator's old connections,
    so the run cannot go on. A WorkerFailed, so that whoever ends a run on a failure ends it here."""


# A worker lost before it answered its first setup: a worker of a tree before protocol 3 (which
# cannot say why) exits at the first frame of another version, so the coordinator sees it lost.
LOST_BEFORE_FIRST_ANSWER = (f"before it answered its first setup; a worker of another Confidant stops at the first "
                            f"message it cannot read, its log naming both protocol versions: {SAME_CONFIDANT}")


class WorkerVersionMismatch(WorkerFailed):
    """A worker answered in another protocol version than this coordinator's (`theirs`, `ours`): it
    runs another Confidant, and cannot take this run's setup (found at the setup's first answer,
    before any bundle is shipped)."""

    def __init__(self, peer: str, address: str | None, theirs, ours: int):
        self.theirs, self.ours = theirs, ours
        super().__init__(f"the worker at {address} ({peer}) speaks protocol version {theirs!r}, this coordinator "
                         f"version {ours}: {SAME_CONFIDANT}")


class WorkerLost(WorkerFailed):
    """Workers whose links went down (killed, frozen, unreachable): `lost` maps each one's stage
    to its LostPeer (address, seconds down, what the transport saw)."""

    def __init__(self, lost: Mapping[int, object], note: str = ""):
        self.lost = dict(sorted(lost.items()))
        parts = [f"stage {k} ({p.address}) lost after {p.down_s:.1f} s: {p.reason}" for k, p in self.lost.items()]
        super().__init__("worker " + "; worker ".join(parts) + (f" ({note})" if note else ""))

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.lost.values()]

    @property
    def stop_reason(self) -> str:
        """Why the run stops, as a stop order tells the survivors: which stage was lost, where, how."""
        return "; ".join(f"stage {k} at {p.address} was lost after {p.down_s:.1f} s: {p.reason}"
                         for k, p in self.lost.items())


class WorkerLostBeforeFirstAnswer(WorkerLost):
    """A worker never set up by this coordinator lost before it answered its first setup: most likely
    a worker of a tree before protocol 3, which exits at the first frame it cannot read with no way
    to say why (LOST_BEFORE_FIRST_ANSWER). A version mismatch as far as the command line goes: a
    setup the user fixes (exit 2), as WorkerVersionMismatch is."""

    def __init__(self, lost: Mapping[int, object]):
        super().__init__(lost, LOST_BEFORE_FIRST_ANSWER)


@dataclass(frozen=True)
class StagePlacement:
    stage: int
    first_block: int
    last_block: int
    address: str


@dataclass(frozen=True)
class PipelineConfig:
    """How a run goes: its schedule and micro-batches per step, and how long to wait for a silent
    worker (`timeout_s`). The rest are the settings a plan made in memory is emitted with, one for
    every stage (jobs.train.pipeline.PlanInMemory): engine, threads, optimizer, learning rate,
    weight decay, and whether the engines "keep" the activations of the micro-batches in flight or
    "recompute" them (None: the engine's default). What differs per device (engines, head splits,
    activation choices) is the plan's, in each device's bundle, never the run's."""

    schedule: str
    microbatches: int
    engine: str = "mnn"
    threads: int = 1
    optimizer: str = "adamw"
    lr: float = DEFAULT_LR
    weight_decay: float | None = None
    timeout_s: float = 600.0
    activations: str | None = None


@dataclass(frozen=True)
class WeightMove:
    """Block `block`'s parameters (and their optimizer state: `nbytes` counts both) moved from the
    worker at `from_address` to the one at `to_address` in a reconfiguration."""

    block: int
    from_address: str
    to_address: str
    params: tuple[str, ...]
    nbytes: int


@dataclass
class Reconfiguration:
    """What `Coordinator.reconfigure` did: old and new block ranges, the blocks that changed worker,
    every byte sent to set the stages up again, workers left idle, and how long it all took."""

    old_ranges: list[tuple[int, int]]
    new_ranges: list[tuple[int, int]]
    moves: list[WeightMove]
    sent_bytes: int
    idle: list[str]
    seconds: float
    # weights the workers took from their own kept files instead of receiving them again
    # (runtime.pipeline.held_weights): what the setup did not send
    kept_bytes: int = 0

    @property
    def moved_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


class Coordinator:
    """Drives the workers at `placements` (stage k on placements[k].address) through a Transport,
    each stage from its plan bundle (`setup_bundles`: every run is a plan).

    `stage_graphs`: each stage's graph slice (its bundle's; the whole model's graph serves every
    stage too), for the stages' graph inputs and every block's metadata.
    `spares` are addresses of further workers that run no stage yet: they wait, nameless, until
    a re-plan gives them one, and are stopped with the rest."""

    def __init__(self, placements: Sequence[StagePlacement], config: PipelineConfig, transport,
                 stage_graphs: Sequence[Graph],
                 optimizer_state: Mapping[int, Mapping[str, np.ndarray]] | None = None, spares: Sequence[str] = (),
                 worker_keys: Mapping[str, object] | None = None, base=None):
        # the plan's base weights file (runtime.pipeline.bundles.BaseWeights) a worker may hold, so
        # that its stage's frozen weights need not be sent; None: every bundle goes whole
        self.base = base
        # worker address -> its public key (runtime.keys.PublicKey): the key each worker's link must
        # be authenticated with, and what its neighbours are told to expect; None: insecure
        self.worker_keys = dict(worker_keys) if worker_keys is not None else None
        self.placements = list(placements)
        self.config = config
        self.transport = transport
        self.stages = len(placements)
        self.optimizer_state = optimizer_state or {}
        if len(stage_graphs) != len(placements):
            raise ValueError(f"{len(stage_graphs)} stage graphs for {len(placements)} stages")
        # what each stage is fed (its graph inputs): only the names are kept, not the slices, whose
        # weights would be a model's worth held here for the run
        self.inputs_of = [stage_spec(g, p.first_block, p.last_block).graph_inputs
                          for g, p in zip(stage_graphs, placements)]
        # every slice keeps every block's metadata (names, parameters): enough to re-cut the model
        self._blocks = stage_graphs[0].blocks
        self._tied_updates = 0  # tied-gradient sums done since the stages were last set up
        self.ready: list[dict] = []
        self._pending: list[tuple[str, dict]] = []
        self._known_lost: set[str] = set()  # stage peers already being recovered from (during `abort`)
        self._since = _StallWatch.start()  # stalls of this process from now on end the run (`_check_stalled`)
        self.setup_bytes = 0
        self.base_bytes_held = 0
        # new stage -> the `own_state` its next setup carries (set by `reconfigure` after a loss)
        self._own_states: dict[int, dict] = {}
        self.eval_done: list[dict] = []  # each stage's answer to the last evaluation pass (`forward_only`)
        # bytes of weights files the workers took from their own kept weights at the last setup
        # (runtime.pipeline.held_weights) instead of receiving them, and the workers that may hold
        # some: those this coordinator set up before
        self.held_bytes_reused = 0
        self._set_up: set[str] = set()
        # workers that hold no stage (left out by a re-plan, or spares): nameless, stopped with the rest
        self.idle: list[str] = list(spares)
        self._connected: dict[str, str] = {}   # this side's peer name -> worker address, one per worker
        self._probes: dict[str, str] = {}  # lost worker's address -> the name it answers a hello under
        # snapshots held on the workers (runtime.pipeline.snapshots): the last one ordered, and per
        # snapshot the stages whose holder has confirmed the whole copy
        self._sid = 0
        self.replicas_held: dict[int, set[int]] = {}
        taken = [p.address for p in self.placements]
        if len(set(taken + self.idle)) != len(taken) + len(self.idle):
            raise ValueError(f"a worker may appear once among the stages and spares; addresses: {taken + self.idle}")

    # --- failures ------------------------------------------------------------------------
    _ANSWERS = ("ready", "done", "checkpoint_done", "released", "aborted", "here", "bundle_wants", "held_done",
                "eval_done", "copy_digest")
    _POLL_S = 0.1  # how often a wait looks for lost workers (a message that arrives wakes it at once)

    def _check_lost(self) -> None:
        """Raise WorkerLost when the link to any stage's worker is down (other than those already
        known lost, while an abort is under way); first, CoordinatorStalled when this process stood
        still too long (a thawed coordinator must not take its workers' dropped links for losses
        of theirs, nor wait for answers that never come)."""
        self._check_stalled()
        lost = self.transport.lost_peers()
        if not lost:
            return
        by_stage = {p.stage: lost[stage_peer(p.stage)] for p in self.placements
                    if stage_peer(p.stage) in lost and stage_peer(p.stage) not in self._known_lost}
        if by_stage:
            raise WorkerLost(by_stage)

    def _check_stalled(self) -> None:
        stalled = _StallWatch.longest_since(self._since)
        if stalled >= _worker.COORDINATOR_GRACE_S:
            raise CoordinatorStalled(
                f"this coordinator stood still for {stalled:.0f} s (stopped, suspended or starved of CPU), longer "
                f"than a worker waits for a silent coordinator ({_worker.COORDINATOR_GRACE_S:g} s): every worker has "
                f"dropped its stage and ignores this run; start it again (from its last checkpoint, if it wrote one)")

    def _recv_control(self, timeout: float) -> tuple[str, dict]:
        """The next control message from any worker; a worker of another protocol version is
        WorkerVersionMismatch, naming it and both versions."""
        try:
            return self.transport.recv_control(None, timeout=timeout)
        except ProtocolMismatch as exc:
            raise WorkerVersionMismatch(exc.peer, exc.address, exc.theirs, exc.ours) from None

    def _check_errors(self) -> bool:
        """Take one control message that has arrived, without waiting: an answer waits its turn, an
        error report is raised. False when none had arrived."""
        try:
            sender, msg = self._recv_control(0)
        except PeerTimeout:
            return False
        if self._noted(msg):
            return True
        if msg.get("type") in self._ANSWERS:
            self._pending.append((sender, msg))
            return True
        if msg.get("type") == "error":
            raise WorkerFailed(f"worker {sender} ({self.transport.address_of(sender)}) failed: {msg.get('message')}")
        raise WorkerFailed(f"unexpected control message from {sender}: {msg}")

    def _await_control(self, peer: str, kind: str, stale: bool = False) -> dict:
        """The next `kind` message from `peer`; other workers' messages that arrive first wait their
        turn. With `stale`, other answers from `peer` (of an aborted step or checkpoint) are dropped."""
        for i, (sender, msg) in enumerate(self._pending):
            if sender == peer and msg.get("type") == kind:
                return self._pending.pop(i)[1]
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                sender, msg = self._recv_control(self._POLL_S)
            except PeerTimeout:
                self._check_lost()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"worker {peer} ({self.transport.address_of(peer)}) sent no '{kind}' within "
                                       f"{self.config.timeout_s:.0f} s") from None
                continue
            if msg.get("type") == "error":
                raise WorkerFailed(f"worker {sender} ({self.transport.address_of(sender)}) failed: {msg.get('message')}")
            if self._noted(msg):
                continue
            if sender == peer and msg.get("type") == kind:
                return msg
            if sender != peer and msg.get("type") in self._ANSWERS:
                self._pending.append((sender, msg))
                continue
            if (stale and msg.get("type") in self._ANSWERS) or (msg.get("type") == "aborted" and kind != "aborted"):
                continue  # answers to an aborted step, or a repeated abort's second answer
            raise WorkerFailed(f"expected '{kind}' from {peer}, got {msg.get('type')!r} from {sender}")

    def _noted(self, msg: dict) -> bool:
        """A notice that needs no answer, filed: a holder has a stage's whole snapshot copy."""
        if msg.get("type") != "replica_held":
            return False
        sid, of = msg.get("sid"), msg.get("of")
        if isinstance(sid, int) and isinstance(of, int) and sid in self.replicas_held:
            self.replicas_held[sid].add(of)
        return True

    def take_notices(self) -> None:
        """File every control message that has arrived, without waiting."""
        while self._check_errors():
            pass

    def await_replicas(self, sid: int) -> None:
        """Wait until every stage's holder has confirmed its copy of snapshot `sid` (`replica_held`),
        filing other messages as `take_notices` does; WorkerLost when a worker is lost meanwhile,
        WorkerFailed past the run's timeout."""
        deadline = time.monotonic() + self.config.timeout_s
        while not self.replicas_held.get(sid, set()) >= set(range(self.stages)):
            try:
                sender, msg = self._recv_control(self._POLL_S)
            except PeerTimeout:
                self._check_lost()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"snapshot {sid} was not held whole by every stage's neighbour within "
                                       f"{self.config.timeout_s:.0f} s") from None
                continue
            if self._noted(msg):
                continue
            if msg.get("type") in self._ANSWERS:
                self._pending.append((sender, msg))
            elif msg.get("type") == "error":
                raise WorkerFailed(f"worker {sender} ({self.transport.address_of(sender)}) failed: {msg.get('message')}")
            else:
                raise WorkerFailed(f"unexpected control message from {sender}: {msg}")

    def _await_tensor(self, peer: str, expected: Expected) -> np.ndarray:
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                return self.transport.recv_tensor(peer, expected, timeout=self._POLL_S)[1]
            except PeerTimeout:
                self._check_errors()
                self._check_lost()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"worker {peer} ({self.transport.address_of(peer)}) sent no "
                                       f"{expected.describe()} within {self.config.timeout_s:.0f} s") from None

    # --- setup ---------------------------------------------------------------------------
    def _connect_workers(self) -> None:
        """One connection per worker: stage k's under "stage<k>", an idle one's under its address.
        Names that now point elsewhere are closed first, so a worker never receives from this
        side over two connections."""
        wanted = {stage_peer(p.stage): p.address for p in self.placements}
        wanted.update({_idle_peer(address): address for address in self.idle})
        for peer, address in list(self._connected.items()):
            if wanted.get(peer) != address:
                self.transport.disconnect(peer)
                del self._connected[peer]
        for peer, address in wanted.items():
            self._connect(peer, address)
            self._connected[peer] = address

    def _connect(self, peer: str, address: str) -> None:
        if self.worker_keys is None:
            self.transport.connect(peer, address)
        else:
            self.transport.connect(peer, address, key=self._key_of(address).curve)

    def _key_of(self, address: str):
        if address not in self.worker_keys:
            raise ValueError(f"no public key for the worker at {address}; every worker of a secure pipeline needs "
                             f"one (the cluster file's `key:`, or NAME.pub in --keys DIR)")
        return self.worker_keys[address]

    def _neighbours(self, p: StagePlacement) -> dict[str, str]:
        """Who stage `p` talks to: the coordinator and the stages next to it."""
        neighbours = {COORDINATOR: self.transport.address}
        for q in self.placements:
            if abs(q.stage - p.stage) == 1:
                neighbours[stage_peer(q.stage)] = q.address
        return neighbours

    def _peer_keys(self, p: StagePlacement) -> dict:
        """The neighbours' public keys for stage `p`'s setup (the worker trusts its coordinator's
        key already and takes no other key for it), or nothing when insecure."""
        if self.worker_keys is None:
            return {}
        return {"peer_keys": {stage_peer(q.stage): self._key_of(q.address).text
                              for q in self.placements if abs(q.stage - p.stage) == 1}}

    @property
    def tied(self) -> dict[str, tuple[int, ...]]:
        """The weights several stages hold -> those stages (empty when no cut goes through one)."""
        return tied_parameters_of_blocks(self._blocks, [(p.first_block, p.last_block) for p in self.placements])

    def _tied_of(self, stage: int) -> dict:
        names = sorted(name for name, stages in self.tied.items() if stage in stages)
        return {"tied": names} if names else {}

    def _sum_tied(self, schedule: Schedule) -> None:
        """Every UPDATE of the schedule: take each holder's gradient part of each tied weight, add
        the parts in stage order, send the sum to every holder (see the module docstring)."""
        tied = self.tied
        if not tied:
            return
        holders = sorted({s for stages in tied.values() for s in stages})
        counts = {s: sum(1 for a in schedule.actions[s] if a.kind is ActionKind.UPDATE) for s in holders}
        if len(set(counts.values())) != 1:
            raise ValueError(f"the holders of tied weights update a different number of times per run ({counts}): "
                             f"their copies would drift apart")
        for _ in range(counts[holders[0]]):
            u = self._tied_updates
            for name in sorted(tied):
                total = None
                for s in tied[name]:
                    part = self._await_tensor(stage_peer(s), Expected(kind="tied_grad", stage=s, microbatch=u,
                                                                      name=name))
                    if total is None:
                        total = np.array(part, dtype=part.dtype, copy=True)
                    elif part.shape != total.shape or part.dtype != total.dtype:
                        raise WorkerFailed(f"stage {s} sent a gradient of {part.dtype}{part.shape} for tied weight "
                                           f"{name!r}, stage {tied[name][0]} one of {total.dtype}{total.shape}")
                    else:
                        total += part
                for s in tied[name]:
                    self.transport.send_tensor(stage_peer(s), "tied_sum", -1, u, total, name=name)
            self._tied_updates += 1

    def _send_optimizer_state(self, stage: int, opt_state: Mapping[str, np.ndarray]) -> None:
        # one tensor at a time: a recovery's state is read back from the coordinator's disk here
        # (runtime.pipeline.restore.SpooledTensor), each let go once ZeroMQ has sent it; at most
        # SEND_WINDOW bytes in ZeroMQ's queue at once (the disk is read faster than CURVE encrypts:
        # unbounded, a stage's optimizer state waited in the queue, +23 MiB of a 6.6 M-parameter run)
        queued = 0
        for i, (name, arr) in enumerate(opt_state.items()):
            arr = np.asarray(arr, order="C")
            self.transport.send_tensor(stage_peer(stage), "optstate", -1, i, arr, name=name)
            self.setup_bytes += int(arr.nbytes)
            queued += int(arr.nbytes)
            del arr
            if queued >= self.SEND_WINDOW:
                self.transport.wait_sent(stage_peer(stage))
                queued = 0

    def setup_bundles(self, bundle_dirs: Sequence[Path | Mapping[str, bytes]], devices: Sequence[str]) -> list[dict]:
        """Ship each stage its plan bundle, a directory or the files in memory (workers verify it
        before use): its graph slice, weights, engine, optimizer and actions all come from it.
        Files given in memory are let go once sent (each mapping emptied): the coordinator does not
        hold a model's worth of bundle bytes for the run (a recovery reads a plan folder again)."""
        from ir.bundle import WEIGHTS
        from runtime.pipeline.bundles import (REST, bundle_to_wire, file_size, held_offer, send_bundle, split_weights,
                                              without_tensors)

        self._connect_workers()
        self.setup_bytes = 0  # bundle files and optimizer state sent by this setup
        self.base_bytes_held = 0  # frozen weights the workers took from their own base files instead
        self.held_bytes_reused = 0  # weights the workers took from their own kept files instead
        trainable = {name for b in self._blocks for name in b.params}
        for p, directory, device in zip(self.placements, bundle_dirs, devices):
            peer = stage_peer(p.stage)
            files = bundle_to_wire(directory)
            local, rest = split_weights(files, self.base) if self.base is not None else ([], b"")
            # a worker set up before may hold the untrained tensors of its new bundle: offered, not sent
            offer = held_offer(files[WEIGHTS], trainable) if not local and p.address in self._set_up else {}
            own = self._own_states.get(p.stage)
            if own and not local:  # and the trainable weights its own snapshot copy holds (runtime.pipeline.kept_state)
                offer.update((n, form) for n, form in held_offer(files[WEIGHTS], ()).items() if n in set(own["params"]))
            opt_state = self.optimizer_state.get(p.stage, {})
            self.transport.send_control(peer, {
                "type": "setup_bundle", "stage": p.stage, "device": device, "engine": _stage_engine(files),
                "peers": self._neighbours(p),
                **self._peer_keys(p), "bundle_files": list(files), "optimizer_state": list(opt_state),
                **self._tied_of(p.stage), **({"base": {"sha256": self.base.sha256, "names": local}} if local else {}),
                **({"held": offer} if offer else {}),
                **({"own_state": self._own_states[p.stage]} if p.stage in self._own_states else {})})
            # every setup is answered before a byte of its bundle goes (protocol 3): a worker that
            # cannot take it (another version, a setup it refuses) says so now, not after the bundle
            try:
                wants = self._await_control(peer, "bundle_wants")
            except WorkerLost as lost:
                if p.address in self._set_up or set(lost.lost) != {p.stage}:
                    raise
                raise WorkerLostBeforeFirstAnswer(lost.lost) from None
            if local and wants.get("base") is True:
                self.base_bytes_held += file_size(files[WEIGHTS]) - len(rest)
                files = {(REST if name == WEIGHTS else name): (rest if name == WEIGHTS else data)
                         for name, data in files.items()}
            elif offer:
                taken = wants.get("held")
                if not (isinstance(taken, list) and all(isinstance(n, str) and n in offer for n in taken)):
                    raise ValueError(f"stage {p.stage}'s worker answered the offer of its own weights with {taken!r:.80}, "
                                     f"not a list of the names offered")
                if taken:
                    rest = without_tensors(files[WEIGHTS], taken)
                    self.held_bytes_reused += file_size(files[WEIGHTS]) - len(rest)
                    files = {(REST if name == WEIGHTS else name): (rest if name == WEIGHTS else data)
                             for name, data in files.items()}
            send_bundle(self.transport, peer, files, lambda: self._await_control(peer, "bundle_took"))
            if REST in files:  # bytes put together here: let go before the next stage's are
                self.transport.wait_sent(peer)
            self.setup_bytes += sum(file_size(data) for data in files.values())
            self._set_up.add(p.address)
            del files, rest
            if isinstance(directory, dict):  # shipped: every holder of these bytes lets them go
                directory.clear()
            self._send_optimizer_state(p.stage, opt_state)
        self.ready = [self._await_control(stage_peer(p.stage), "ready") for p in self.placements]
        self._own_states = {}  # of this setup only
        self._tied_updates = 0
        return self.ready

    # --- training ------------------------------------------------------------------------
    def run(self, schedule: Schedule, microbatch_feeds: Sequence[Mapping[str, np.ndarray]], step: int,
            steps: int = 1, on_loss=None) -> tuple[list[float], list[dict]]:
        """Run one schedule (a batch for flush schedules; for 1f1b-stash `steps` steps without a flush,
        `schedule` being the plan's `for_steps(steps)`); returns the per-micro-batch losses in order and
        each stage's 'done' report. `on_loss(m, loss)` hears each micro-batch's loss as it arrives
        (1f1b-stash reports its steps as they finish).

        With bundles the workers run the action lists they verified (for `steps` steps, their steady
        state unrolled) and no action is sent."""
        if len(microbatch_feeds) != schedule.microbatches:
            raise ValueError(f"{len(microbatch_feeds)} micro-batches of data for a schedule of {schedule.microbatches}")
        if self.tied and not schedule.flushes:
            name, stages = next(iter(self.tied.items()))
            raise ValueError(f"{schedule.name} cannot train weights tied across stages ({name!r} is on stages "
                             f"{list(stages)}): use 1f1b-flush or gpipe, or keep the tied blocks on one stage")
        for p in self.placements:
            self.transport.send_control(stage_peer(p.stage), {"type": "run", "step": step, "steps": steps})
        for m, feeds in enumerate(microbatch_feeds):
            for p, inputs in zip(self.placements, self.inputs_of):
                for name in inputs:
                    self.transport.send_tensor(stage_peer(p.stage), "batch", -1, m,
                                               np.asarray(feeds[name], order="C"), name=name)
        last = stage_peer(self.stages - 1)
        losses = []
        for m in range(schedule.microbatches):
            losses.append(float(self._await_tensor(last, Expected(kind="loss", stage=self.stages - 1, microbatch=m))[0]))
            if on_loss is not None:
                on_loss(m, losses[-1])
        self._sum_tied(schedule)
        done = [self._await_control(stage_peer(p.stage), "done") for p in self.placements]
        return losses, done

    # --- evaluation on the workers -------------------------------------------------------
    def forward_only(self, microbatch_feeds: Sequence[Mapping[str, np.ndarray]],
                     positions: Sequence[np.ndarray] | None = None, until_block: int | None = None) -> list:
        """An evaluation pass on the stages' trained weights, after training (the workers hold them;
        this process holds none): every micro-batch of `microbatch_feeds` forward only through the
        stages (worker `eval_forward`, `StageExecutor.forward_only`). Without `until_block`: each
        micro-batch's loss (float), from the last stage. With `until_block` (the LM head's block)
        and `positions` (per micro-batch, int64 [rows]: the position of each row whose next token
        is wanted, or [rows, k]: k positions a row): each micro-batch's greedy next tokens (int64
        [rows], or [rows, k]) from the stage holding
        that block; the stages after it take no part. Call between steps (no step in flight)."""
        n = len(microbatch_feeds)
        if n == 0:
            return []
        if until_block is None:
            end = self.stages - 1
        else:
            end = next((p.stage for p in self.placements if p.first_block <= until_block <= p.last_block), None)
            if end is None or positions is None or len(positions) != n:
                raise ValueError(f"an evaluation pass to block {until_block} needs a stage holding it and one "
                                 f"positions array per micro-batch")
        taking = [(p, inputs) for p, inputs in zip(self.placements, self.inputs_of) if p.stage <= end]
        for p, _ in taking:
            self.transport.send_control(stage_peer(p.stage), {"type": "eval_forward", "microbatches": n, "end": end,
                                                              "until_block": until_block})
        for m, feeds in enumerate(microbatch_feeds):
            for p, inputs in taking:
                for name in inputs:
                    self.transport.send_tensor(stage_peer(p.stage), "eval_batch", -1, m,
                                               np.asarray(feeds[name], order="C"), name=name)
            if until_block is not None:
                self.transport.send_tensor(stage_peer(end), "eval_at", -1, m, np.asarray(positions[m], np.int64))
        kind = "eval_loss" if until_block is None else "eval_next"
        out = []
        for m in range(n):
            got = self._await_tensor(stage_peer(end), Expected(kind=kind, stage=end, microbatch=m))
            out.append(float(got.reshape(-1)[0]) if until_block is None else np.array(got, np.int64))
        self.eval_done = [self._await_control(stage_peer(p.stage), "eval_done") for p, _ in taking]
        return out

    def collect_checkpoint(self) -> list[dict[str, np.ndarray]]:
        """Every stage's parameters and optimizer state (call at a flush boundary)."""
        return self._collect(optimizer=True)

    def collect_weights(self) -> list[dict[str, np.ndarray]]:
        """Every stage's parameters only (call at a flush boundary): each optimizer tensor is dropped
        as it arrives, never made dense. A run's final state when no checkpoint is written: MiniLM's
        AdamW moments, twice its weights, set the coordinator's peak (issue 31)."""
        return self._collect(optimizer=False)

    def _collect(self, optimizer: bool) -> list[dict[str, np.ndarray]]:
        """Without `optimizer` the workers send their parameters only (one that sends more has the
        rest dropped as it arrives). `self.state_bytes`: every stage's whole state (parameters and
        optimizer state), as the workers report it."""
        order = {"type": "checkpoint"} if optimizer else {"type": "checkpoint", "optimizer": False}
        for p in self.placements:
            self.transport.send_control(stage_peer(p.stage), order)
        out = []
        self.state_bytes = 0
        for p in self.placements:
            peer = stage_peer(p.stage)
            done = self._await_control(peer, "checkpoint_done")
            tensors = {}
            received = 0
            for i, name in enumerate(done["names"]):
                # kept as received (read-only, on the receive buffer, which is this process's own):
                # a copy would cost a pass over the whole state at every snapshot (issue 32)
                arr = self._await_tensor(peer, Expected(kind="ckpt", stage=p.stage, microbatch=i, name=name))
                received += int(arr.nbytes)
                if optimizer or not name.startswith("opt/"):
                    tensors[name] = arr
                del arr
            reported = done.get("state_bytes")
            self.state_bytes += reported if isinstance(reported, int) and reported >= received else received
            rows = done.get("rows")
            if not optimizer and isinstance(rows, dict):  # row-wise entries are optimizer state only
                rows = {k: v for k, v in rows.items() if not (isinstance(k, str) and k.startswith("opt/"))}
            out.append(dense_from_wire(tensors, rows, f"stage {p.stage}'s checkpoint"))
        return out

    # at most about this many bytes of optimizer state wait in the transport's queue while a setup
    # sends them (`_send_optimizer_state`: the sender waits for them to leave before reading more)
    SEND_WINDOW = 4 << 20

    def collect_stages(self, select: Mapping[int, dict] | None = None):
        """Every stage's parameters and optimizer state as they come off the wire, one stage after
        the other, one tensor at a time: yields (stage, its `rows` declaration for
        `dense_from_wire`, an iterator of (name, tensor) to use up before the next stage). Each
        stage is asked for one window of its state at a time (`checkpoint` {first, start, bytes}:
        chunks of at most 1 MiB, `FETCH_WINDOW_BYTES` of them), the next once the last was taken
        (`_windowed`), so whoever writes each tensor away before taking the next holds one tensor
        and a window, not the whole model's state nor a stage's in the receive queue (call at a
        flush boundary). `select`: stage -> what of its state (`checkpoint`'s `weights` and
        `moments_of`, as `fetch_held_stages` takes them), only those stages; None: every stage's
        whole state."""
        for p in self.placements:
            if select is not None and p.stage not in select:
                continue
            what = dict(select[p.stage]) if select is not None else {}
            ask = lambda first, start, stage=p.stage, what=what: self._ask_checkpoint(stage, first, start, what)
            done = ask(0, 0)
            yield p.stage, done.get("rows"), self._windowed(stage_peer(p.stage), "ckpt", p.stage, done, ask)

    def _ask_checkpoint(self, stage: int, first: int, start: int, what: Mapping | None = None) -> dict:
        from runtime.pipeline.snapshots import FETCH_WINDOW_BYTES

        peer = stage_peer(stage)
        self.transport.send_control(peer, {"type": "checkpoint", "first": first, "start": start,
                                           "bytes": FETCH_WINDOW_BYTES, **(what or {})})
        return self._await_control(peer, "checkpoint_done")

    def _windowed(self, peer: str, kind: str, stage: int, done: dict, ask):
        """(name, tensor) of a stage's state as its windows come (`runtime.pipeline.snapshots.send_window`):
        `done` the answer to the first, `ask(first, start)` the next's. A tensor in one chunk is kept
        as received (read-only, on the receive buffer); a larger one is put together in one array
        of its own as its chunks come. The answers of `collect_stages` and `fetch_held_stages` are
        the same."""
        building = None  # [name, shape, flat array, elements filled] of a tensor that comes in several chunks
        while True:
            parts, shapes, names = done.get("parts"), done.get("shapes"), done.get("names")
            if not (isinstance(parts, list) and isinstance(shapes, dict) and isinstance(names, list)
                    and len(names) == len(parts)):
                raise WorkerFailed(f"{peer} sent no window of its state: {done!r:.120}")
            for part, name in zip(parts, names):
                try:
                    index, start, count = (int(x) for x in part)
                    shape = tuple(int(d) for d in shapes[name])
                except (TypeError, ValueError, KeyError):
                    raise WorkerFailed(f"{peer} declared a chunk {part!r:.60} of {name!r:.60} without its place or "
                                       f"shape") from None
                arr = self._await_tensor(peer, Expected(kind=kind, stage=stage, microbatch=index, name=name))
                size = int(np.prod(shape, dtype=np.int64))
                if building is None and start == 0 and arr.size == count == size:
                    yield name, arr.reshape(shape)
                    continue
                if building is None and start == 0:
                    building = [name, shape, np.empty(size, arr.dtype), 0]
                if (building is None or building[0] != name or building[1] != shape or start != building[3]
                        or arr.size != count or arr.dtype != building[2].dtype or start + count > size):
                    raise WorkerFailed(f"{peer} sent a chunk of {name!r:.60} at element {start} of {size}, not the "
                                       f"next of the tensor it was sending")
                building[2][start:start + count] = arr.reshape(-1)
                building[3] += count
                del arr
                if building[3] == size:
                    whole, building = building[2].reshape(shape), None
                    yield name, whole
                    del whole
            nxt = done.get("next")
            if nxt is None:
                if building is not None:
                    raise WorkerFailed(f"{peer} stopped sending {building[0]!r:.60} after {building[3]} elements")
                return
            try:
                first, start = (int(x) for x in nxt)
            except (TypeError, ValueError):
                raise WorkerFailed(f"{peer} named no next window of its state: {nxt!r:.60}") from None
            done = ask(first, start)

    def snapshot_to_peers(self, keep: Sequence[int], spread_s: float) -> int:
        """Order snapshot `sid` (returned) at this flush boundary: each stage copies its state and
        ships it to its holder while the next step runs (runtime.pipeline.snapshots); nothing is
        waited for. The workers keep the copies of `keep` and of this one, no others."""
        from runtime.pipeline.snapshots import holder_of

        self._sid += 1
        self.replicas_held = {k: v for k, v in self.replicas_held.items() if k in set(keep)}
        self.replicas_held[self._sid] = set()
        for p in self.placements:
            holder = holder_of(p.stage, self.stages)
            self.transport.send_control(stage_peer(p.stage), {
                "type": "snapshot", "sid": self._sid, "holder": None if holder is None else stage_peer(holder),
                "keep": list(keep), "spread_s": float(spread_s)})
        return self._sid

    def keep_snapshots(self, keep: Sequence[int]) -> None:
        """Have the workers drop every snapshot copy but those of `keep` (a newer one is confirmed)."""
        self.replicas_held = {k: v for k, v in self.replicas_held.items() if k in set(keep)}
        for p in self.placements:
            self.transport.send_control(stage_peer(p.stage), {"type": "snapshot_keep", "keep": list(keep)})

    def fetch_held(self, sid: int, lost: Sequence[int] = ()) -> list[dict[str, np.ndarray]]:
        """Every stage's state of snapshot `sid` as the workers hold it, whole in memory: each stage's
        from its own worker, a lost stage's (`lost`, already `forget`-ten) from its holder. Call
        between steps. (A recovery streams it instead: `fetch_held_stages`.)"""
        out = []
        for stage, rows, tensors in self.fetch_held_stages(sid, lost):
            out.append(dense_from_wire(dict(tensors), rows, f"stage {stage}'s snapshot"))
        return out

    def fetch_held_stages(self, sid: int, lost: Sequence[int] = (), select: Mapping[int, dict] | None = None):
        """Snapshot `sid` as the workers hold it, one stage after the other, a tensor at a time:
        yields (stage, its `rows` declaration for `dense_from_wire`, an iterator of (name, tensor)
        to use up before the next stage), as `collect_stages` does. Each stage's copy comes from its
        own worker, a lost stage's (`lost`, already `forget`-ten) from its holder, one window at a
        time (`snapshot_send` {sid, of, first, start, bytes}: chunks read back from the copy's file,
        `FETCH_WINDOW_BYTES` of them), each asked for once the last was taken (`_windowed`): the
        worker holds one window, never a whole copy or a whole large tensor of it, and whoever writes
        each tensor away before taking the next holds one tensor and a window here. Call between
        steps. `select`: stage -> what of its copy (`snapshot_send`'s `weights` and `moments_of`,
        runtime.pipeline.kept_state), only those stages; None: every stage's whole copy."""
        from runtime.pipeline.snapshots import holder_of

        lost = set(lost)
        for p in self.placements:
            if select is not None and p.stage not in select:
                continue
            what = dict(select[p.stage]) if select is not None else {}
            source = p.stage
            if source in lost:
                source = holder_of(p.stage, self.stages)
                if source is None or source in lost:
                    raise WorkerFailed(f"stage {p.stage}'s snapshot copy was on stage {source}, lost too")
            ask = lambda first, start, source=source, stage=p.stage, what=what: self._ask_held(
                source, sid, stage, first, start, what)
            done = ask(0, 0)
            yield p.stage, done.get("rows"), self._windowed(stage_peer(source), "held", p.stage, done, ask)

    def _ask_held(self, source: int, sid: int, stage: int, first: int, start: int, what: Mapping | None = None) -> dict:
        from runtime.pipeline.snapshots import FETCH_WINDOW_BYTES

        peer = stage_peer(source)
        self.transport.send_control(peer, {"type": "snapshot_send", "sid": sid, "of": [stage], "first": first,
                                           "start": start, "bytes": FETCH_WINDOW_BYTES, **(what or {})})
        # its chunks come before it on the same connection: all are here once it is
        done = self._await_control(peer, "held_done")
        if done.get("of") != stage or done.get("sid") != sid:
            raise WorkerFailed(f"expected snapshot {sid} of stage {stage} from {peer}, got {done!r:.120}")
        if done.get("missing"):
            raise WorkerFailed(f"stage {source} does not hold snapshot {sid} of stage {stage}")
        return done

    def stage_params(self, first: int, last: int) -> list[str]:
        """The trainable parameters of blocks first..last."""
        return [x for b in self._blocks[first:last + 1] for x in b.params]

    def own_states(self, sid: int, kept: Mapping[int, tuple[int, Sequence[str]]], lost: Sequence[int] = ()
                   ) -> dict[int, dict]:
        """The `own_state` of each new stage in `kept` (new stage -> (the old stage its worker ran,
        the parameters whose optimizer state it reads from its own copy of snapshot `sid`): {sid,
        params, sha256}, the SHA-256 of those entries as the old stage's holder made it from its
        replica, or, where that holder was lost or holds no whole replica of it, as the survivor said
        (runtime.pipeline.kept_state).
        Every holder is asked first, so they hash at once. Call between steps, before the new setup."""
        from runtime.pipeline.snapshots import holder_of

        lost = set(lost)
        asks = []
        for k, (old, params) in sorted(kept.items()):
            holder = holder_of(old, self.stages)
            source = holder if holder is not None and holder not in lost else old
            self.transport.send_control(stage_peer(source), {"type": "copy_digest", "sid": sid, "of": old,
                                                             "params": list(params)})
            asks.append((k, old, source, list(params)))
        out = {}
        for k, old, source, params in asks:
            answer = self._await_control(stage_peer(source), "copy_digest")
            if answer.get("missing") and answer.get("of") == old and source != old:
                # its replica of that snapshot never came whole (only the lost stages' are sure to
                # have been confirmed): the survivor vouches for its own copy
                source = old
                self.transport.send_control(stage_peer(old), {"type": "copy_digest", "sid": sid, "of": old,
                                                              "params": params})
                answer = self._await_control(stage_peer(old), "copy_digest")
            if answer.get("of") != old or answer.get("sid") != sid or answer.get("missing") \
                    or not isinstance(answer.get("sha256"), str):
                raise WorkerFailed(f"stage {source} holds no copy of snapshot {sid} of stage {old} to vouch for: "
                                   f"{answer!r:.120}")
            out[k] = {"sid": sid, "params": params, "sha256": answer["sha256"]}
        return out

    def gather(self) -> TrainingState:
        """The whole training state, merged from every stage (call at a flush boundary): what a
        re-plan hands on, and the weights to write a new plan's bundles with."""
        return TrainingState(*merge_checkpoint(self.collect_checkpoint()))

    # --- re-planning ---------------------------------------------------------------------
    def _check_new_placements(self, placements: Sequence[StagePlacement]) -> None:
        n = len(self._blocks)
        expected = 0
        for i, p in enumerate(placements):
            if p.stage != i:
                raise ValueError(f"placement {i} is numbered stage {p.stage}; number the stages 0..{len(placements) - 1}")
            if p.first_block != expected or not p.first_block <= p.last_block < n:
                raise ValueError(f"stage {i} runs blocks {p.first_block}..{p.last_block}; expected a range starting "
                                 f"at block {expected} within 0..{n - 1}")
            expected = p.last_block + 1
        if expected != n:
            raise ValueError(f"the new stages cover blocks 0..{expected - 1}, the model has 0..{n - 1}")
        addresses = [p.address for p in placements]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"a worker may run one stage only; addresses repeat: {addresses}")

    def _check_new_bundles(self, placements: Sequence[StagePlacement], bundles: Sequence[Path | Mapping[str, bytes]] | None,
                           devices: Sequence[str] | None, weights: Mapping[str, np.ndarray],
                           contents: Sequence | None = None) -> list:
        """The new plan's bundles, verified and parsed (`contents`: as the plan was loaded, verified
        once, `ir.bundle.LoadedPlan`; else parsed here), after checking that they are the new stages,
        one each, in order, and hold the weights training has reached (a bundle written from older
        weights would silently undo the steps since)."""
        from runtime.pipeline.bundles import load_bundle

        parsed = []
        for k, (p, directory, device) in enumerate(zip(placements, bundles, devices)):
            if contents:
                c = contents[k]
            else:
                c = load_bundle(directory, None if isinstance(directory, (str, Path)) else f"the new plan's {device}")
            if (c.stage, c.stages, c.device, c.first_block, c.last_block) != (
                    p.stage, len(placements), device, p.first_block, p.last_block):
                raise ValueError(f"bundle {directory} is stage {c.stage} of {c.stages} on {c.device!r}, blocks "
                                 f"{c.first_block}..{c.last_block}; the new placement wants stage {p.stage} of "
                                 f"{len(placements)} on {device!r}, blocks {p.first_block}..{p.last_block}")
            for name in c.graph.params:
                if name in weights and not np.array_equal(c.graph.constants[name], weights[name]):
                    raise ValueError(f"bundle {c.source} holds weights for {name!r} that differ from the ones "
                                     f"training has reached; write the new plan from Coordinator.gather()'s weights")
            parsed.append(c)
        plans = {c.plan_id for c in parsed}
        if len(plans) > 1:  # each bundle's signed manifest names its plan: these are of several
            raise ValueError(f"the new plan's bundles belong to {len(plans)} different plans (their signed manifests "
                             f"name {sorted(str(p)[:12] for p in plans)}): a plan's bundles are used only together")
        return parsed

    def reconfigure(self, placements: Sequence[StagePlacement], *,
                    bundles: Sequence[Path | Mapping[str, bytes]] | None = None,
                    devices: Sequence[str] | None = None, state: TrainingState | None = None,
                    lost: Sequence[str] = (), contents: Sequence | None = None,
                    own_states: Mapping[int, dict] | None = None) -> Reconfiguration:
        """Switch to new stages at a flush boundary (call between steps of a flush schedule):
        gather every stage's weights and optimizer state (or take `state`, gathered at this same
        boundary), release the name of every worker that leaves or changes position, and set up
        each stage of `placements` again with the current weights and the optimizer state of its
        parameters. Any block ranges, any order of any of the workers (including spares and
        workers left out before); workers not in `placements` wait idle until stopped.

        The new stages come as the new plan's `bundles` and `devices` (one per placement, holding
        the current weights); workers verify them as on first setup. `contents`: those bundles as
        verified and parsed when the plan was loaded (`ir.bundle.LoadedPlan`), not parsed again here.

        After a loss (`lost`: the lost workers' addresses, already `forget`-ten), `state` must be
        the state held off the devices; lost workers are not asked to release anything.
        `own_states`: new stage -> {sid, params, sha256} (`own_states()`): the optimizer state of
        those parameters its worker reads from its own snapshot copy; it is neither in `state` nor sent."""
        start = time.perf_counter()
        lost = set(lost)
        if lost & {p.address for p in placements}:
            raise ValueError(f"the new placements use lost workers {sorted(lost & {p.address for p in placements})}")
        if lost and state is None:
            raise ValueError("after a loss the state must come from elsewhere (state=): lost workers cannot be gathered")
        placements = list(placements)
        self._check_new_placements(placements)
        if bundles is None or devices is None or not len(bundles) == len(devices) == len(placements):
            raise ValueError(f"every run is a plan: a re-plan must bring the new plan's bundle and device name for "
                             f"each of its {len(placements)} stages (bundles=, devices=)")
        state = state if state is not None else self.gather()
        contents = self._check_new_bundles(placements, bundles, devices, state.weights, contents)
        old = self.placements
        moves = _moves(self._blocks, old, placements, state)
        self._release([p for p in old if _stage_at(placements, p.address) != p.stage and p.address not in lost])
        kept = {p.address for p in placements}
        self.idle = [a for a in [*self.idle, *(p.address for p in old)] if a not in kept and a not in lost]
        own_states = dict(own_states or {})
        self._own_states = own_states
        self.optimizer_state = {p.stage: state.stage_optimizer_state(
            [x for b in self._blocks[p.first_block:p.last_block + 1] for x in b.params
             if x not in set(own_states.get(p.stage, {}).get("params", ()))]) for p in placements}
        self.placements = placements
        self.stages = len(placements)
        self.inputs_of = [stage_spec(c.graph, p.first_block, p.last_block).graph_inputs
                          for c, p in zip(contents, placements)]
        self.setup_bundles(bundles, devices)
        return Reconfiguration([(p.first_block, p.last_block) for p in old],
                               [(p.first_block, p.last_block) for p in placements], moves, self.setup_bytes,
                               list(self.idle), time.perf_counter() - start, self.held_bytes_reused)

    def abort(self, step: int, lost: WorkerLost) -> list[str]:
        """Stop step `step` on every surviving stage after `lost`: each drops what the step had in
        flight, fences its neighbours and answers; what the survivors sent here for that step is
        dropped. Returns the survivors' addresses. A further loss meanwhile raises WorkerLost
        with every lost stage."""
        gone = {stage_peer(k) for k in lost.lost}
        survivors = [p for p in self.placements if stage_peer(p.stage) not in gone]
        for p in survivors:
            self.transport.send_control(stage_peer(p.stage), {"type": "abort", "step": step, "lost": sorted(gone)})
        self._known_lost = gone
        try:
            for p in survivors:
                peer = stage_peer(p.stage)
                self._pending = [(s, m) for s, m in self._pending if s != peer or m.get("type") == "aborted"]
                self._await_control(peer, "aborted", stale=True)
        except WorkerLost as more:
            raise WorkerLost({**lost.lost, **more.lost}) from None
        finally:
            self._known_lost = set()
        for p in survivors:
            peer = stage_peer(p.stage)
            self.transport.discard(peer)
            self._pending = [(s, m) for s, m in self._pending if s != peer]
        return [p.address for p in survivors]

    def forget(self, addresses: Sequence[str]) -> None:
        """Drop lost workers: no connection, no stage, not idle; they are never waited for again."""
        addresses = set(addresses)
        for peer, address in list(self._connected.items()):
            if address in addresses:
                self.transport.disconnect(peer, deliver_queued=False)
                self.transport.retire(peer)  # it may thaw and finish what it was sending
                # what it sent before it died stays filed under its name, which a survivor may take next
                self.transport.discard(peer)
                del self._connected[peer]
                self._pending = [(s, m) for s, m in self._pending if s != peer]
        self.idle = [a for a in self.idle if a not in addresses]

    # --- devices that come back ---------------------------------------------------------------
    def call_back(self, addresses: Sequence[str]) -> None:
        """Ask the lost workers at `addresses` to say when they are back: a hello waits in the queue
        of a new connection to each (ZeroMQ retries the connection for as long as it stays open),
        and `returned` finds the answers. A worker answers under the name `_probe_peer(address)`,
        which only its key may use."""
        for address in addresses:
            if address in self._probes:
                continue
            peer = _probe_peer(address)
            self._connect(peer, address)
            self.transport.send_control(peer, {"type": "hello", "reply_to": self.transport.address, "name": peer})
            self._probes[address] = peer

    def calling_back(self) -> bool:
        """Some lost worker called back has not answered yet."""
        return bool(self._probes)

    def returned(self) -> list[dict]:
        """The workers called back that have answered since the last call (their `here` reports, with
        `address`), without waiting: each is idle from now on, a worker a re-plan may use."""
        if not self._probes:
            return []
        while self._check_errors():  # file whatever arrived, without waiting
            pass
        back = []
        for address, peer in list(self._probes.items()):
            answer = next((i for i, (s, m) in enumerate(self._pending) if s == peer and m.get("type") == "here"), None)
            if answer is None:
                continue
            back.append({**self._pending.pop(answer)[1], "address": address})
            self._pending = [(s, m) for s, m in self._pending if s != peer]
            self.transport.disconnect(peer)
            del self._probes[address]
            self.idle.append(address)
            self._connect(_idle_peer(address), address)  # so that it is stopped with the rest
            self._connected[_idle_peer(address)] = address
        return back

    def lost_spares(self) -> list[str]:
        """Idle workers whose links are down (gone while waiting): a re-plan must not use them."""
        lost = self.transport.lost_peers()
        return [a for a in self.idle if _idle_peer(a) in lost]

    def _release(self, workers: Sequence[StagePlacement]) -> None:
        """Have each of `workers` drop its stage and give up its name, and wait until all have:
        only then may another process take one of those names (see runtime.pipeline.worker)."""
        for p in workers:
            self.transport.send_control(stage_peer(p.stage), {"type": "release"})
        for p in workers:
            self._await_control(stage_peer(p.stage), "released")

    def stop(self, reason: str = "the run ended") -> None:
        """Tell every worker of the run to stop, and why (`runtime.pipeline.worker.stop_order`)."""
        try:
            self.returned()  # a worker that is back by now is stopped with the rest
        except Exception:
            pass
        for peer in list(self._probes.values()):  # a hello nobody answered: not a worker of this run now
            self.transport.disconnect(peer)
        self._probes.clear()
        for peer in list(self._connected):
            try:
                self.transport.send_control(peer, _worker.stop_order(reason))
            except Exception:
                pass


def _probe_peer(address: str) -> str:
    """The name a lost worker answers a hello under (runtime.pipeline.worker.Worker.hello)."""
    return f"probe {address}"


def _idle_peer(address: str) -> str:
    """The coordinator's name for its connection to a worker that holds no stage."""
    return f"idle {address}"


def _stage_at(placements: Sequence[StagePlacement], address: str) -> int | None:
    return next((p.stage for p in placements if p.address == address), None)


def _moves(blocks, old: Sequence[StagePlacement], new: Sequence[StagePlacement],
           state: TrainingState) -> list[WeightMove]:
    """The blocks whose worker changes between `old` and `new`, with their bytes (weights and
    optimizer state)."""
    def owner(ps: Sequence[StagePlacement], k: int) -> str:
        return next(p.address for p in ps if p.first_block <= k <= p.last_block)

    moves = []
    for b in blocks:
        before, after = owner(old, b.index), owner(new, b.index)
        if before != after:
            moves.append(WeightMove(b.index, before, after, tuple(b.params), sum(state.nbytes(x) for x in b.params)))
    return moves


class _StallWatch:
    """Notices when this whole process stood still: a SIGSTOP, a paused VM or a suspended laptop stop
    every thread, the ZeroMQ I/O thread that answers heartbeats included, so the workers take the
    coordinator for lost (`runtime.pipeline.worker.COORDINATOR_GRACE_S`); a busy main thread does not
    (the I/O thread keeps answering). One daemon thread per process ticks every `TICK_S` and keeps the
    gaps between its ticks much longer than that; the clock counts suspended time where the platform
    has one that does (CLOCK_BOOTTIME), since the workers' clocks ran on meanwhile."""

    TICK_S = 0.25
    _KEPT = 64
    _lock = threading.Lock()
    _thread: threading.Thread | None = None
    _last_tick = 0.0
    _stalls: deque = deque(maxlen=_KEPT)  # (ended at, seconds), oldest first

    @staticmethod
    def clock() -> float:
        boottime = getattr(time, "CLOCK_BOOTTIME", None)
        return time.clock_gettime(boottime) if boottime is not None else time.monotonic()

    @classmethod
    def start(cls) -> float:
        """Start the watch if it is not running; returns now, on its clock."""
        with cls._lock:
            if cls._thread is None:
                cls._last_tick = cls.clock()
                cls._thread = threading.Thread(target=cls._run, name="confidant-stall-watch", daemon=True)
                cls._thread.start()
        return cls.clock()

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(cls.TICK_S)
            now = cls.clock()
            with cls._lock:
                gap = now - cls._last_tick - cls.TICK_S
                if gap > 1.0:
                    cls._stalls.append((now, gap))
                cls._last_tick = now

    @classmethod
    def longest_since(cls, since: float) -> float:
        """The longest stall (seconds) that ended after `since`, the one this thread may be the first to
        see counted too (after a thaw, the caller can run before the watch's own thread)."""
        now = cls.clock()
        with cls._lock:
            open_gap = now - cls._last_tick - cls.TICK_S
            ended = [gap for at, gap in cls._stalls if at > since]
        return max([open_gap, *ended])
