"""The coordinator: hands each worker its stage, feeds micro-batches, collects losses and figures,
writes checkpoints, re-arranges the stages when the plan changes, and turns any worker's failure
into one clear error.

It talks to workers only through a Transport, so the same code drives real worker processes over
ZeroMQ and in-process workers in tests. Stage k's peer is named "stage<k>".

Re-planning (`reconfigure`) happens at a flush boundary: between two steps of a flush schedule
every stage has applied the same updates and holds no activation, gradient or in-flight message,
so the stage's whole training state is its parameters plus its optimizer state. The coordinator
gathers both from every stage (the checkpoint path), then sets the same worker processes up again
with their new block ranges, each with the current weights and the optimizer entries of its own
parameters (optimizer state is keyed by parameter name, runtime.optim), so no update is lost and
training continues exactly as a run that had used the new ranges from that step. Weights move
through the coordinator (gather all, send each stage its slice); `Reconfiguration.moves` says which
blocks changed worker and how many bytes that was.

A worker's pipeline position is its transport name ("stage<k>"), fixed by its first setup, so a
worker keeps its stage index across re-setups: a new plan may change every block range, drop
workers from the end of the pipeline (they are reset and wait idle until stopped) and take them
back later, but not renumber a worker.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ir.graph import Graph
from ir.plan import Schedule
from ir.serialize import graph_to_json, slice_graph
from runtime.executor import COORDINATOR, stage_peer
from runtime.stage import stage_spec
from runtime.transport import Expected, PeerTimeout


class WorkerFailed(RuntimeError):
    """A worker reported an error or went silent; the message names the stage and the cause."""


@dataclass(frozen=True)
class StagePlacement:
    stage: int
    first_block: int
    last_block: int
    address: str


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str
    microbatches: int
    engine: str | tuple[str, ...] = "mnn"  # one for all stages, or one per stage (mixed frameworks)
    threads: int = 1
    optimizer: str = "adamw"
    lr: float = 5e-5
    weight_decay: float | None = None
    timeout_s: float = 600.0
    # per stage: None (unsplit) or {backend: heads} splitting the attention heads of every encoder
    # block of that stage across backends (runtime.engine_split; MNN stages, flush schedules only).
    # Indexed by stage; after a re-plan, stages beyond the tuple run unsplit.
    head_split: tuple[Mapping[str, int] | None, ...] | None = None


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

    @property
    def moved_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


@dataclass
class StepFigures:
    step: int
    loss: float
    seconds: float
    stage_busy: list[float]
    stage_seconds: list[dict] = field(default_factory=list)


def split_even(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges of (nearly) equal count: the default when no cuts are given."""
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks into {stages} stages")
    bounds = [round(i * n_blocks / stages) for i in range(stages + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]


def split_at(n_blocks: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """`cuts` are the first block of every stage after the first, e.g. [3] -> [0..2], [3..n-1]."""
    cuts = list(cuts)
    if any(not 0 < c < n_blocks for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"cuts {cuts} must be increasing block indices between 1 and {n_blocks - 1}")
    starts = [0] + cuts
    ends = cuts + [n_blocks]
    return [(a, b - 1) for a, b in zip(starts, ends)]


class Coordinator:
    def __init__(self, graph: Graph | None, placements: Sequence[StagePlacement], config: PipelineConfig, transport,
                 weights: Mapping[str, np.ndarray] | None = None,
                 optimizer_state: Mapping[int, Mapping[str, np.ndarray]] | None = None,
                 stage_graphs: Sequence[Graph] | None = None):
        self.graph = graph
        self.placements = list(placements)
        self.config = config
        self.transport = transport
        self.stages = len(placements)
        self.weights = weights
        self.optimizer_state = optimizer_state or {}
        # with plan bundles each stage's graph slice comes from its bundle; no whole model needed
        graphs = stage_graphs if stage_graphs is not None else [graph] * len(placements)
        self.specs = [stage_spec(g, p.first_block, p.last_block) for g, p in zip(graphs, placements)]
        self.ready: list[dict] = []
        self._pending: list[tuple[str, dict]] = []
        self.bundle_mode = False
        self.setup_bytes = 0
        self.idle: list[StagePlacement] = []   # workers a reconfiguration left out; stopped with the rest
        self._stage_of: dict[str, int] = {}    # worker address -> its stage index, fixed at first setup
        self._engine_of: dict[str, str] = {}   # worker address -> the engine it was first given
        if config.head_split is not None and len(config.head_split) != self.stages:
            raise ValueError(f"{len(config.head_split)} head splits given for {self.stages} stages")

    def engine_of(self, stage: int) -> str:
        engine = self.config.engine
        if isinstance(engine, str):
            return engine
        if len(engine) != self.stages:
            raise ValueError(f"{len(engine)} engines given for {self.stages} stages")
        return engine[stage]

    def head_split_of(self, stage: int) -> dict[str, int] | None:
        splits = self.config.head_split
        if splits is None or stage >= len(splits) or splits[stage] is None:
            return None
        return {str(k): int(v) for k, v in splits[stage].items()}

    # --- failures ------------------------------------------------------------------------
    def _check_errors(self) -> None:
        try:
            sender, msg = self.transport.recv_control(None, timeout=0)
        except PeerTimeout:
            return
        if msg.get("type") in ("ready", "done", "checkpoint_done"):
            self._pending.append((sender, msg))
            return
        if msg.get("type") == "error":
            raise WorkerFailed(f"worker {sender} ({self.transport.address_of(sender)}) failed: {msg.get('message')}")
        raise WorkerFailed(f"unexpected control message from {sender}: {msg}")

    def _await_control(self, peer: str, kind: str) -> dict:
        """The next `kind` message from `peer`; other workers' messages that arrive first wait their turn."""
        for i, (sender, msg) in enumerate(self._pending):
            if sender == peer and msg.get("type") == kind:
                return self._pending.pop(i)[1]
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                sender, msg = self.transport.recv_control(None, timeout=0.5)
            except PeerTimeout:
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"worker {peer} ({self.transport.address_of(peer)}) sent no '{kind}' within "
                                       f"{self.config.timeout_s:.0f} s") from None
                continue
            if msg.get("type") == "error":
                raise WorkerFailed(f"worker {sender} ({self.transport.address_of(sender)}) failed: {msg.get('message')}")
            if sender == peer and msg.get("type") == kind:
                return msg
            if sender != peer and msg.get("type") in ("ready", "done", "checkpoint_done"):
                self._pending.append((sender, msg))
                continue
            raise WorkerFailed(f"expected '{kind}' from {peer}, got {msg.get('type')!r} from {sender}")

    def _await_tensor(self, peer: str, expected: Expected) -> np.ndarray:
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                return self.transport.recv_tensor(peer, expected, timeout=0.5)[1]
            except PeerTimeout:
                self._check_errors()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"worker {peer} ({self.transport.address_of(peer)}) sent no "
                                       f"{expected.describe()} within {self.config.timeout_s:.0f} s") from None

    # --- setup ---------------------------------------------------------------------------
    def setup(self) -> list[dict]:
        self._remember_workers()
        self.setup_bytes = 0  # weights and optimizer state sent by this setup
        peers = {stage_peer(p.stage): p.address for p in self.placements}
        for p in self.placements:
            self.transport.connect(stage_peer(p.stage), p.address)
        for p, spec in zip(self.placements, self.specs):
            part = slice_graph(self.graph, p.first_block, p.last_block)
            neighbours = {COORDINATOR: self.transport.address}
            for k in (p.stage - 1, p.stage + 1):
                if 0 <= k < self.stages:
                    neighbours[stage_peer(k)] = peers[stage_peer(k)]
            opt_state = self.optimizer_state.get(p.stage, {})
            self.transport.send_control(stage_peer(p.stage), {
                "type": "setup", "stage": p.stage, "stages": self.stages, "blocks": [p.first_block, p.last_block],
                "graph": graph_to_json(part), "engine": self.engine_of(p.stage), "threads": self.config.threads,
                "optimizer": {"name": self.config.optimizer, "lr": self.config.lr,
                              "weight_decay": self.config.weight_decay},
                "peers": neighbours, "optimizer_state": list(opt_state),
                **({"head_split": self.head_split_of(p.stage)} if self.head_split_of(p.stage) else {}),
            })
            for i, (name, arr) in enumerate(part.constants.items()):
                value = self.weights[name] if self.weights is not None and name in self.weights else arr
                self.transport.send_tensor(stage_peer(p.stage), "weights", -1, i, np.asarray(value, order="C"), name=name)
                self.setup_bytes += int(np.asarray(value).nbytes)
            for i, (name, arr) in enumerate(opt_state.items()):
                self.transport.send_tensor(stage_peer(p.stage), "optstate", -1, i, np.asarray(arr, order="C"), name=name)
                self.setup_bytes += int(np.asarray(arr).nbytes)
        self.ready = [self._await_control(stage_peer(p.stage), "ready") for p in self.placements]
        return self.ready

    def setup_bundles(self, bundle_dirs: Sequence[Path], devices: Sequence[str]) -> list[dict]:
        """Ship each stage its plan bundle (workers verify it before use) instead of a graph slice."""
        from runtime.bundle_load import send_bundle

        self.bundle_mode = True
        self._remember_workers()
        peers = {stage_peer(p.stage): p.address for p in self.placements}
        for p in self.placements:
            self.transport.connect(stage_peer(p.stage), p.address)
        for p, directory, device in zip(self.placements, bundle_dirs, devices):
            neighbours = {COORDINATOR: self.transport.address}
            for k in (p.stage - 1, p.stage + 1):
                if 0 <= k < self.stages:
                    neighbours[stage_peer(k)] = peers[stage_peer(k)]
            from runtime.bundle_load import bundle_to_wire

            names = list(bundle_to_wire(directory))
            opt_state = self.optimizer_state.get(p.stage, {})
            self.transport.send_control(stage_peer(p.stage), {
                "type": "setup_bundle", "stage": p.stage, "device": device, "peers": neighbours,
                "bundle_files": names, "optimizer_state": list(opt_state)})
            sent = send_bundle(self.transport, stage_peer(p.stage), directory)
            if sent != names:
                raise RuntimeError(f"bundle {directory} changed while being sent")
            for i, (name, arr) in enumerate(opt_state.items()):
                self.transport.send_tensor(stage_peer(p.stage), "optstate", -1, i, np.asarray(arr, order="C"), name=name)
        self.ready = [self._await_control(stage_peer(p.stage), "ready") for p in self.placements]
        return self.ready

    # --- training ------------------------------------------------------------------------
    def run(self, schedule: Schedule, microbatch_feeds: Sequence[Mapping[str, np.ndarray]], step: int) -> tuple[list[float], list[dict]]:
        """Run one schedule (a batch for flush schedules, the whole run for 1f1b-stash); returns the
        per-micro-batch losses in order and each stage's 'done' report."""
        if len(microbatch_feeds) != schedule.microbatches:
            raise ValueError(f"{len(microbatch_feeds)} micro-batches of data for a schedule of {schedule.microbatches}")
        for p in self.placements:
            # with bundles the workers run the action lists they verified; nothing else is sent
            actions = None if self.bundle_mode else [str(a) for a in schedule.actions[p.stage]]
            self.transport.send_control(stage_peer(p.stage), {"type": "run", "step": step, "actions": actions})
        for m, feeds in enumerate(microbatch_feeds):
            for p, spec in zip(self.placements, self.specs):
                for name in spec.graph_inputs:
                    self.transport.send_tensor(stage_peer(p.stage), "batch", -1, m,
                                               np.asarray(feeds[name], order="C"), name=name)
        last = stage_peer(self.stages - 1)
        losses = [float(self._await_tensor(last, Expected(kind="loss", stage=self.stages - 1, microbatch=m))[0])
                  for m in range(schedule.microbatches)]
        done = [self._await_control(stage_peer(p.stage), "done") for p in self.placements]
        return losses, done

    def collect_checkpoint(self) -> list[dict[str, np.ndarray]]:
        """Every stage's parameters and optimizer state (call at a flush boundary)."""
        for p in self.placements:
            self.transport.send_control(stage_peer(p.stage), {"type": "checkpoint"})
        out = []
        for p in self.placements:
            peer = stage_peer(p.stage)
            names = self._await_control(peer, "checkpoint_done")["names"]
            tensors = {}
            for i, name in enumerate(names):
                arr = self._await_tensor(peer, Expected(kind="ckpt", stage=p.stage, microbatch=i, name=name))
                tensors[name] = np.array(arr)
            out.append(tensors)
        return out

    # --- re-planning ---------------------------------------------------------------------
    def _remember_workers(self) -> None:
        for p in self.placements:
            self._stage_of.setdefault(p.address, p.stage)
            self._engine_of.setdefault(p.address, self.engine_of(p.stage))

    def _check_new_placements(self, placements: Sequence[StagePlacement]) -> None:
        n = len(self.graph.blocks)
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
        holders = {stage: address for address, stage in self._stage_of.items()}
        for p in placements:
            was = self._stage_of.get(p.address)
            if was is not None and was != p.stage:
                raise ValueError(f"the worker at {p.address} is stage {was} and cannot become stage {p.stage}: a "
                                 f"worker's stage index is its name on the wire, fixed at its first setup. Keep the "
                                 f"devices in their pipeline order (drop only workers at the end), or restart the "
                                 f"workers and resume from a checkpoint")
            if was is None and holders.get(p.stage, p.address) != p.address:
                raise ValueError(f"stage {p.stage} belongs to the worker at {holders[p.stage]}; a new worker at "
                                 f"{p.address} cannot take its name")

    def reconfigure(self, placements: Sequence[StagePlacement]) -> Reconfiguration:
        """Switch to new block ranges at a flush boundary (call between steps of a flush schedule):
        gather every stage's weights and optimizer state, reset the workers left out, and set up
        each stage of `placements` again with its slice, the current weights and the optimizer
        state of its parameters. See the module docstring for what may change."""
        if self.bundle_mode or self.graph is None:
            raise ValueError("re-planning needs the whole model graph: stages set up from plan bundles (or from "
                             "graph slices) cannot be re-cut at run time; write a new plan and resume from a checkpoint")
        start = time.perf_counter()
        placements = list(placements)
        self._check_new_placements(placements)
        engines = self.config.engine
        if not isinstance(engines, str):  # per-stage engines stay with their workers
            missing = [p.address for p in placements if p.address not in self._engine_of]
            if missing:
                raise ValueError(f"per-stage engines were given, but none for the new worker(s) {missing}")
            engines = tuple(self._engine_of[p.address] for p in placements)
        old = self.placements
        per_stage = self.collect_checkpoint()
        weights, states, scalars = _merge_checkpoint(per_stage)
        nbytes = {name: int(arr.nbytes) + sum(int(s[name].nbytes) for s in states.values() if name in s)
                  for name, arr in weights.items()}

        def owner(ps: Sequence[StagePlacement], k: int) -> str:
            return next(p.address for p in ps if p.first_block <= k <= p.last_block)

        moves = []
        for b in self.graph.blocks:
            before, after = owner(old, b.index), owner(placements, b.index)
            if before != after:
                moves.append(WeightMove(b.index, before, after, tuple(b.params), sum(nbytes[x] for x in b.params)))
        kept = {p.address for p in placements}
        for p in old:
            if p.address not in kept:
                # its engine and weights go; the process waits for a later setup or the final stop
                self.transport.send_control(stage_peer(p.stage), {"type": "reset"})
                self.idle.append(p)
        self.idle = [p for p in self.idle if p.address not in kept]
        self.weights = {**(self.weights or {}), **weights}
        self.optimizer_state = {}
        for p in placements:
            names = [x for b in self.graph.blocks[p.first_block:p.last_block + 1] for x in b.params]
            state = {f"{kind}/{x}": per_name[x] for kind, per_name in states.items() for x in names if x in per_name}
            self.optimizer_state[p.stage] = {**state, **scalars}
        self.config = replace(self.config, engine=engines)
        self.placements = placements
        self.stages = len(placements)
        self.specs = [stage_spec(self.graph, p.first_block, p.last_block) for p in placements]
        self.setup()
        return Reconfiguration([(p.first_block, p.last_block) for p in old],
                               [(p.first_block, p.last_block) for p in placements], moves, self.setup_bytes,
                               [p.address for p in self.idle], time.perf_counter() - start)

    def stop(self) -> None:
        for p in self.idle:
            try:
                self.transport.send_control(stage_peer(p.stage), {"type": "stop"})
            except Exception:
                pass
        for p in self.placements:
            try:
                self.transport.send_control(stage_peer(p.stage), {"type": "stop"})
            except Exception:
                pass


def _merge_checkpoint(per_stage: Sequence[Mapping[str, np.ndarray]]
                      ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """All stages' checkpoint tensors (`collect_checkpoint`) merged: parameters by name, optimizer
    state per kind and parameter ({"m": {name: array}, ...} from "opt/m/<name>"), and the
    optimizer's scalars ("opt/steps"), which every stage of a flush schedule must agree on."""
    weights: dict[str, np.ndarray] = {}
    states: dict[str, dict[str, np.ndarray]] = {}
    scalars: dict[str, np.ndarray] = {}
    for k, tensors in enumerate(per_stage):
        for key, arr in tensors.items():
            if key.startswith("param/"):
                weights[key[len("param/"):]] = arr
            elif key.startswith("opt/"):
                entry = key[len("opt/"):]
                if "/" in entry:
                    kind, name = entry.split("/", 1)
                    states.setdefault(kind, {})[name] = arr
                elif entry in scalars and not np.array_equal(scalars[entry], arr):
                    raise RuntimeError(f"stages disagree on optimizer {entry!r} ({scalars[entry]} before stage {k}, "
                                       f"{arr} on stage {k}): not at a flush boundary")
                else:
                    scalars[entry] = arr
            else:
                raise RuntimeError(f"stage {k} sent checkpoint entry {key!r}, neither param/ nor opt/")
    return weights, states, scalars


def save_checkpoint(directory: Path, per_stage: Sequence[Mapping[str, np.ndarray]], meta: dict) -> None:
    """Weights and optimizer state per stage in safetensors (no pickle), plus meta.json."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for k, tensors in enumerate(per_stage):
        save_file({name: np.asarray(v, order="C") for name, v in tensors.items()}, str(directory / f"stage{k}.safetensors"))
    (directory / "meta.json").write_text(json.dumps(meta, indent=1))


def load_checkpoint(directory: Path) -> tuple[dict, dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """meta, all parameters by name, and optimizer state per stage."""
    from safetensors.numpy import load_file

    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no meta.json")
    meta = json.loads(meta_path.read_text())
    weights: dict[str, np.ndarray] = {}
    opt: dict[int, dict[str, np.ndarray]] = {}
    for k in range(int(meta["stages"])):
        path = directory / f"stage{k}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} lacks {path.name}")
        tensors = load_file(str(path))
        weights.update({n[len("param/"):]: v for n, v in tensors.items() if n.startswith("param/")})
        opt[k] = {n[len("opt/"):]: v for n, v in tensors.items() if n.startswith("opt/")}
    return meta, weights, opt
