"""Pipeline training: drive a coordinator over workers for a number of steps (`train_pipeline`, which
training from a plan uses too), and the `confidant train-pipeline` job around it.

Side effects live here (processes, sockets, files); the protocol is in runtime.pipeline.coordinator and
runtime.pipeline.worker, the schedules in planner.schedule.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.graph import tied_parameters
from ir.partition import even_ranges, ranges_at_cuts
from ir.plan import ASYNC_SCHEDULES, Schedule
from jobs.errors import JobError, RunFailed, failure_text
from jobs.memory_check import check_memory, default_planned_bytes
from jobs.pipeline_tasks import pipeline_task, step_feeds
from jobs.metrics import DeviceFigures, TrainingMetrics, steps_from
from jobs.report import Reporter, Silent
from jobs.settings import PipelineSettings, TrainingSettings
from jobs.workers import LocalWorkers, coordinator_pair, parse_workers
from planner.cost import check_tied_schedule
from planner.partition import PlanDoesNotFit
from planner.replan import TimingReplanner
from planner.schedule import make_schedule
from runtime.keys import ClusterKeys
from runtime.pipeline.checkpoints import (TrainingState, check_checkpoint_target, check_tensors_fit, load_checkpoint,
                                          merge_checkpoint, save_checkpoint)
from runtime.pipeline.coordinator import (Coordinator, PipelineConfig, Reconfiguration, StagePlacement, WorkerFailed,
                                          WorkerLost)
from runtime.pipeline.executor import busy_fraction
from runtime.pipeline.snapshots import PeerSnapshots
from runtime.procfs import peak_rss_bytes
from runtime.transport.wire import Transport


@dataclass
class PipelineResult:
    losses: list[float]
    step_seconds: list[float]  # wall clock from each step's start to the next's (state copies included)
    stage_busy: list[list[float]]
    stage_reports: list[list[dict]]
    weights: dict[str, np.ndarray]
    checkpoint: list[dict[str, np.ndarray]]
    ranges: list[tuple[int, int]]  # at the end (after any re-plan)
    replans: list[tuple[int, Reconfiguration]] = field(default_factory=list)  # (steps done before it, what moved)
    devices: list[str] | None = None  # with bundles: the device of each stage at the end
    events: list[dict] = field(default_factory=list)  # failures and recoveries, as they happened (jobs.metrics)
    addresses: list[str] = field(default_factory=list)  # the worker of each stage at the end
    snapshot_seconds: list[float] = field(default_factory=list)  # each copy of the state to the coordinator
    state_seconds: list[float] = field(default_factory=list)  # per step: the part of step_seconds spent copying
    # the state to the coordinator and writing checkpoints (what the fault policy costs)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # worker address -> its peak over the run
    setup_bytes: int = 0  # what the first setup sent the workers (bundles or weights, optimizer state)
    base_bytes_held: int = 0  # frozen weights the first setup left to the workers' own base files


FAILURE_POLICIES = ("replan", "stop")
STATE_PLACES = ("coordinator", "peers")

# The command line's snapshot policy (FaultPolicy.snapshot_every): chosen from measured costs.
AUTO_SNAPSHOTS = None
# What the state copies may cost of the wall-clock step under AUTO_SNAPSHOTS (issue 32's target).
SNAPSHOT_SHARE = 0.05
# At most this many seconds of steps replayed after a loss under AUTO_SNAPSHOTS: with a re-setup of
# a few seconds, a recovery stays within 10 s (issue 13's target).
REPLAY_BUDGET_S = 5.0
# 1f1b-stash without --checkpoint-every under AUTO_SNAPSHOTS: the run drains (and copies its state)
# every this many steps, so a loss replays at most these (issue 32: it replayed the run from step 0).
STASH_SEGMENT_STEPS = 8


def snapshot_interval(copy_s: float, step_s: float, share: float = SNAPSHOT_SHARE,
                      replay_budget_s: float = REPLAY_BUDGET_S) -> int:
    """Steps between state copies so that a copy of `copy_s` seconds costs at most `share` of
    steps of `step_s` seconds (wall clock, copies left out), but no more steps than replay in
    `replay_budget_s` (a recovery's bound wins: the copies then cost more than `share`)."""
    if not step_s > 0:
        return 1
    wanted = math.ceil(copy_s / (share * step_s)) if copy_s > 0 else 1
    return max(1, min(wanted, int(replay_budget_s // step_s)))


@dataclass(frozen=True)
class FaultPolicy:
    """What a run does about lost devices.

    `on_failure`: "replan" (re-plan over the survivors and continue from the state held off the
    devices) or "stop" (end with a resumable checkpoint). `detect_s`: a worker silent this long is
    lost (ZeroMQ heartbeats, so a busy one is never taken for lost). `snapshot_every`: steps
    between copies of every stage's state to the coordinator (flush boundaries; with 1 a recovery
    replays at most the interrupted step). `snapshot_every` None (`AUTO_SNAPSHOTS`, the command
    line's default): flush schedules copy the state every K steps, K chosen from the measured
    copy and step times so that the copies cost at most `SNAPSHOT_SHARE` of the wall-clock step,
    and at most `REPLAY_BUDGET_S` of steps are replayed after a loss (the data order is
    deterministic, so a replay retrains the same batches to the same bits); 1f1b-stash drains
    and copies every `STASH_SEGMENT_STEPS` steps (a fixed count: where stash drains changes its
    updates, so it must not depend on timing). `checkpoint_every`: steps between checkpoints on disk
    (needs a checkpoint folder); for 1f1b-stash also the length of the segments the run drains
    at, so a run resumed from such a checkpoint continues exactly as one that never stopped.
    `low_memory_bytes` / `low_battery_percent`: a device reporting less free memory (MemAvailable)
    or battery after a step is a `memory_low` / `battery_low` event, and under "replan" (flush
    schedules) the run moves off it at that boundary, before it runs out: the planner's cuts over
    the others, the state gathered from every stage, no step replayed; the device waits idle.
    `take_back`: a lost device is called back (runtime.pipeline.coordinator.Coordinator.call_back);
    when it answers (restarted, thawed, reachable again) it is a `joined` event and, under "replan"
    (flush schedules), taken in at that boundary if the plan with it is predicted faster (it waits
    as a spare otherwise)."""

    on_failure: str = "replan"
    detect_s: float = 3.0
    snapshot_every: int | None = 1
    checkpoint_every: int | None = None
    low_memory_bytes: int = 256 * 2 ** 20
    low_battery_percent: float = 15.0
    take_back: bool = True
    # where the snapshots live: "coordinator" (every stage's state copied to it) or "peers" (each
    # worker keeps its own copy and ships one to a neighbour while the next step runs; the
    # coordinator holds none: runtime.pipeline.snapshots), the command line's default
    state_on: str = "coordinator"

    def check(self) -> "FaultPolicy":
        if self.on_failure not in FAILURE_POLICIES:
            raise ValueError(f"--on-failure must be one of {', '.join(FAILURE_POLICIES)}, not {self.on_failure!r}")
        if not self.detect_s > 0:
            raise ValueError(f"--failure-timeout must be a positive number of seconds, got {self.detect_s}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be at least 1 step (or None: chosen from measured costs), got "
                             f"{self.snapshot_every}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1 step, got {self.checkpoint_every}")
        if self.state_on not in STATE_PLACES:
            raise ValueError(f"state_on must be one of {', '.join(STATE_PLACES)}, not {self.state_on!r}")
        return self


@dataclass(frozen=True)
class Snapshot:
    """Every stage's state at the flush boundary after `step` steps, held by the coordinator."""

    step: int
    per_stage: list[dict[str, np.ndarray]]
    state: TrainingState
    ranges: list[tuple[int, int]]


@dataclass(frozen=True)
class SurvivorPlan:
    """Where training goes on after a loss: stage k runs ranges[k] on addresses[k]; with bundles,
    the new plan's bundles, devices and schedule too (planner.replan.ReplannedPlan's fields)."""

    ranges: list[tuple[int, int]]
    addresses: list[str]
    bundles: list[Path] | None = None
    devices: list[str] | None = None
    schedule: Schedule | None = None
    directory: Path | None = None


class RecoveryImpossible(RuntimeError):
    """The survivors cannot go on (no plan fits them, or the policy says stop); `checkpoint` is
    where the resumable state was written, if anywhere. `train_pipeline` gives it (and a
    WorkerFailed) the run's `result` so far, as `result`: the steps done and the events."""

    def __init__(self, message: str, checkpoint: Path | None = None):
        self.checkpoint = checkpoint
        self.result: PipelineResult | None = None
        super().__init__(message + (f"; the state before the failed step is in {checkpoint} (resume with "
                                    f"--resume {checkpoint})" if checkpoint is not None else ""))


def stage_ranges(n_blocks: int, stages: int, cuts: Sequence[int] | None) -> list[tuple[int, int]]:
    if cuts:
        ranges = ranges_at_cuts(n_blocks, cuts)
        if len(ranges) != stages:
            raise ValueError(f"--cuts {','.join(map(str, cuts))} makes {len(ranges)} stages but there are {stages} workers")
        return ranges
    return even_ranges(n_blocks, stages)


def _check_replanning(config: PipelineConfig, replan_every, on_replan, bundles, stage_graphs) -> None:
    if replan_every is None:
        return
    if not isinstance(replan_every, int) or replan_every < 1:
        raise ValueError(f"replan_every must be a whole number of steps >= 1, got {replan_every!r}")
    if on_replan is None:
        raise ValueError("replan_every needs on_replan, the function that chooses the new plan")
    if config.schedule in ASYNC_SCHEDULES:
        raise ValueError(f"re-planning needs a flush schedule (1f1b-flush, gpipe or zb-h1): {config.schedule} runs "
                         "the whole training as one schedule with weight versions in flight, so there is no step boundary "
                         "at which every stage holds the same weights")
    if bundles is None and stage_graphs is not None:
        raise ValueError("re-planning from graph slices without their bundles is not possible: give the bundles "
                         "(the new plan comes as bundles) or the whole model graph")


def coordinator_transport(listen: str, keys: ClusterKeys | None, insecure: bool, detect_s: float) -> Transport:
    """The coordinator's ZeroMQ endpoint: CURVE with the coordinator's key, admitting the workers'
    keys, or plaintext when `insecure`."""
    from runtime.transport.zeromq import ZmqTransport

    if keys is None and not insecure:
        raise ValueError("a pipeline over ZeroMQ needs the cluster's keys (keys=ClusterKeys: the coordinator's pair "
                         "and each worker's public key; LocalWorkers.keys for local workers) or insecure=True")
    if keys is not None:
        return ZmqTransport("coordinator", listen, keys=keys.coordinator.curve_keys(), heartbeat_s=detect_s)
    return ZmqTransport("coordinator", listen, insecure=True, heartbeat_s=detect_s)


def train_pipeline(graph, batches, num_labels: int, addresses: Sequence[str], config: PipelineConfig, steps: int,
                   cuts: Sequence[int] | None = None, update_every: int = 1, start_step: int = 0,
                   weights=None, optimizer_state=None, listen: str = "tcp://127.0.0.1:0", on_step=None,
                   checkpoint_dir: Path | None = None, meta: dict | None = None,
                   bundles: Sequence[Path] | None = None, devices: Sequence[str] | None = None,
                   stage_graphs=None, replan_every: int | None = None, on_replan=None,
                   spare_devices: Mapping[str, str] | None = None, on_replanned=None,
                   schedule: Schedule | None = None, transport: Transport | None = None,
                   keys: ClusterKeys | None = None, insecure: bool = False, faults: FaultPolicy = FaultPolicy(),
                   plan_over=None, on_event=None, feeds_of_step=None, base=None) -> PipelineResult:
    """Train `steps` batches across the workers at `addresses`; stage k runs on addresses[k].
    With `bundles` (one plan bundle per stage, of `devices`) the workers get verified bundles
    instead of graph slices, and the block ranges are the bundles'; `schedule` is then the plan's
    (flush schedules run it every step; without it the schedule is built from `config`).
    `transport` is the coordinator's (default: ZeroMQ at `listen`, secured with `keys`, or
    plaintext with `insecure`; tests pass an in-process one).

    Re-planning (flush schedules): every `replan_every` steps, between two steps, `on_replan` is
    called with the number of steps done so far and, per stage, its measured forward+backward
    seconds per step averaged since the last call; the coordinator then moves weights and
    optimizer state at this flush boundary, so training continues as if the new plan had been used
    from that step, and `on_replanned(step, Reconfiguration)` hears what moved.
    The first step after a setup (engines build their graphs and caches) is left out of the
    measured average whenever later steps were measured.
    - From graph slices, `on_replan(step, measured)` returns new block ranges (stage k on
      addresses[k]; fewer ranges than workers leaves the last workers idle) or None to carry on.
    - From bundles, `on_replan(step, measured, weights)` gets a third argument, a function that
      gathers the current parameters by name from the workers (once, at this boundary), and
      returns None or the new plan (planner.replan.ReplannedPlan: `devices`, `ranges`, `bundles`,
      `schedule`, written with those weights). Its devices may be any of `devices` and
      `spare_devices` (device name -> address of a worker that waits without a stage), in any order.

    Lost devices (`faults`): the coordinator holds every stage's state from the last snapshot
    (every `faults.snapshot_every` steps); when a worker is lost mid-run the step is aborted on
    the survivors, `plan_over(step, snapshot, stages, candidates)` returns a SurvivorPlan over
    `candidates` (the live workers, in the run's first order) for the pipeline whose stages run
    on `stages` (default for graph slices: the planner's best cuts, in that order; with bundles
    the caller must give one, e.g. planner.replan.PlanReplanner.without), the survivors are set
    up with the held state, and training goes on from the snapshot's step: no update is lost or
    applied twice. The same function moves off devices running low (candidates without them) and
    takes back devices that return (candidates with them; it may return None: no better plan).
    Every event (lost, recovered, steps replayed, new plan, joined, memory or battery low) goes
    to `on_event(dict)` and `result.events`.

    `base` (runtime.pipeline.bundles.BaseWeights, from bundles): the plan's base weights file; a
    worker holding it builds its stage's frozen weights from it instead of receiving them.

    The graph inputs of step k are NER `batches` (`step_feeds`, with `num_labels`), or
    `feeds_of_step(k)` (a list of one feed dict per micro-batch: a causal LM's, tasks.lm_data)."""
    _check_replanning(config, replan_every, on_replan, bundles, stage_graphs)
    faults.check()
    if checkpoint_dir is not None:  # before any step: a path no checkpoint can be written to loses the run
        check_checkpoint_target(checkpoint_dir)
    if stage_graphs is not None:
        ranges = [(b.first_block, b.last_block) for b in stage_graphs]
        stage_graphs = [b.graph for b in stage_graphs]
        graph = stage_graphs[0]
    else:
        ranges = stage_ranges(len(graph.blocks), len(addresses), cuts)
    placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(ranges, addresses))]
    spare_devices = dict(spare_devices or {})
    if transport is None:
        transport = coordinator_transport(listen, keys, insecure, faults.detect_s)
    try:
        coordinator = Coordinator(graph, placements, config, transport, weights=weights,
                                  optimizer_state=optimizer_state, stage_graphs=stage_graphs,
                                  spares=list(spare_devices.values()),
                                  worker_keys=None if keys is None else keys.workers, base=base)
    except BaseException:
        transport.close()
        raise
    if plan_over is None and bundles is None and graph is not None and stage_graphs is None:
        plan_over = _flops_plan_over(graph, config, update_every)
    run = _Run(coordinator, batches, num_labels, graph.batch, config, on_step,
               PipelineResult([], [], [], [], {}, [], ranges, devices=list(devices) if devices is not None else None,
                              addresses=list(addresses)),
               faults, plan_over, on_event, checkpoint_dir, meta, devices, spare_devices, feeds_of_step)
    try:
        if bundles is not None:
            coordinator.setup_bundles(bundles, devices)
        else:
            coordinator.setup()
        run.result.setup_bytes, run.result.base_bytes_held = coordinator.setup_bytes, coordinator.base_bytes_held
        if config.schedule in ASYNC_SCHEDULES:
            run.stash(start_step, steps, update_every)
        else:
            address_of = {**dict(zip(devices or (), addresses)), **spare_devices}
            if schedule is None:
                schedule = make_schedule(config.schedule, len(placements), config.microbatches)
            run.flush(start_step, steps, schedule, replan_every, bundles is not None, address_of,
                      on_replan, on_replanned)
        if run.final is None:  # no step to run
            run.collect_final(start_step)
        result = run.result
        result.checkpoint = run.final
        for tensors in result.checkpoint:
            result.weights.update({k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")})
        if checkpoint_dir is not None:
            run.save(checkpoint_dir, start_step + steps, result.checkpoint)
    except BaseException as exc:  # a lost run, Ctrl-C, any fault: what it did reaches the metrics document
        run._close_step()
        exc.result = run.result  # its steps and events
        raise
    finally:
        coordinator.stop()
        transport.close()
    return result


def _flops_plan_over(graph, config: PipelineConfig, update_every: int = 1):
    """plan_over for graph slices: the planner's best cuts over the candidates, in their order
    (FLOPs-priced, as TimingReplanner starts out, with the run's update after every `update_every`
    backwards): planner.replan.replan_without when stages left, replan_with when workers came back
    (None unless that is predicted faster)."""
    from planner.replan import replan_with, replan_without

    def plan_over(step: int, snapshot: Snapshot, stages: Sequence[str], candidates: Sequence[str]) -> SurvivorPlan | None:
        gone = [a for a in stages if a not in set(candidates)]
        if gone:
            ranges = replan_without(graph, snapshot.ranges, list(stages), gone, config.schedule, config.microbatches,
                                    config.optimizer, update_every=update_every)
            return SurvivorPlan(ranges, [a for a in stages if a not in set(gone)])
        ranges = replan_with(graph, snapshot.ranges, list(stages), list(candidates), config.schedule,
                             config.microbatches, config.optimizer, update_every=update_every)
        return None if ranges is None else SurvivorPlan(ranges, list(candidates))

    return plan_over


class _Run:
    """One training run's steps on a set-up coordinator, recorded into `result`, with the state
    snapshots a recovery restores from."""

    def __init__(self, coordinator: Coordinator, batches, num_labels: int, micro_rows: int, config: PipelineConfig,
                 on_step, result: PipelineResult, faults: FaultPolicy = FaultPolicy(), plan_over=None, on_event=None,
                 checkpoint_dir: Path | None = None, meta: dict | None = None, devices=None, spare_devices=None,
                 feeds_of_step=None):
        self.coordinator, self.batches, self.num_labels = coordinator, batches, num_labels
        self.feeds_of_step = feeds_of_step
        self.micro_rows, self.M, self.config, self.on_step, self.result = (micro_rows, config.microbatches, config,
                                                                           on_step, result)
        self.faults, self.plan_over, self.on_event = faults, plan_over, on_event
        self.checkpoint_dir, self.meta = checkpoint_dir, meta
        self.start_step = 0  # the step this run started at (a resume's), set by `stash` / `flush`
        self.snapshot: Snapshot | None = None
        self.running_low: dict[str, str] = {}  # address -> "memory_low" | "battery_low", after the last step
        # state is held off the devices when a loss can be recovered from, or a stop must leave a checkpoint
        self.keep_state = (faults.on_failure == "replan" and plan_over is not None) or checkpoint_dir is not None
        self.held = PeerSnapshots.for_run(coordinator, faults, plan_over)  # None: snapshots on the coordinator
        self._recovering: dict | None = None  # the recovery whose first completed step is still to come
        # the last step done, whose wall clock runs on (state copies, checkpoints, re-plan checks)
        # until the next step starts or the run ends: its seconds and progress report come then
        self._open: dict | None = None
        self._work_s: list[float] = []  # the coordinator's run of each step since the last setup (AUTO_SNAPSHOTS)
        self.final: list | None = None  # every stage's state after the last step, once the run is done
        # every worker of the run (stages, then spares) in its first order, less the lost and moved off
        self.workers = list(dict.fromkeys([*result.addresses, *(spare_devices or {}).values()]))
        self.first_order = list(self.workers)
        self.address_of_device = {**dict(zip(devices or (), result.addresses)), **dict(spare_devices or {})}
        self.device_of = {a: d for d, a in self.address_of_device.items()}

    def feeds(self, step: int):
        if self.feeds_of_step is not None:
            return list(self.feeds_of_step(step))
        return step_feeds(self.batches, step, self.micro_rows, self.M, self.num_labels)

    # --- events, snapshots, checkpoints ----------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        entry = {"event": kind, "at": time.time(), **fields}
        self.result.events.append(entry)
        if self.on_event:
            self.on_event(entry)
        return entry

    def take_snapshot(self, step: int) -> Snapshot:
        start = time.perf_counter()
        if self.held is not None:  # copied on the workers, shipped to neighbours while the next step runs
            self.snapshot = self.held.take(step, self.result.ranges, self._work_s)
            self._charge(time.perf_counter() - start)
            return self.snapshot
        per_stage = self.coordinator.collect_checkpoint()
        seconds = time.perf_counter() - start
        self.result.snapshot_seconds.append(seconds)
        self._charge(seconds)
        self.snapshot = Snapshot(step, per_stage, TrainingState(*merge_checkpoint(per_stage)), list(self.result.ranges))
        return self.snapshot

    def _charge(self, seconds: float) -> None:
        """Seconds of the step still open spent on the fault policy (state copies, checkpoints)."""
        if self._open is not None:
            self.result.state_seconds[self._open["index"]] += seconds

    def save(self, directory: Path, step: int, per_stage, ranges=None) -> None:
        # the loss of every step up to `step`: a resumed run's earlier ones (meta's "losses"), then this
        # run's, not those of steps past `step` (a stop after a loss saves the snapshot before them)
        earlier = list((self.meta or {}).get("losses") or [])
        losses = earlier + self.result.losses[:max(0, step - self.start_step)]
        start = time.perf_counter()
        save_checkpoint(directory, per_stage,
                        {**(self.meta or {}), "stages": len(per_stage), "ranges": ranges or self.result.ranges,
                         "step": step, "schedule": self.config.schedule, "microbatches": self.M,
                         "losses": losses, "checkpoint_every": self.faults.checkpoint_every,
                         "devices": self.result.devices})
        self._charge(time.perf_counter() - start)

    def snapshot_every(self) -> int:
        """Steps between state copies now: the policy's, or under AUTO_SNAPSHOTS the interval that
        keeps the copies within SNAPSHOT_SHARE of the step, from the last copies and the steps run
        since the last setup (its first step, which builds the engines, left out once others ran)."""
        if self.faults.snapshot_every is not None:
            return self.faults.snapshot_every
        copies = self.result.snapshot_seconds[-3:] if self.held is None else self.held.costs()
        work = self._work_s[1:] or self._work_s
        if not copies or not work:
            return 1
        return snapshot_interval(statistics.median(copies), statistics.median(work[-8:]))

    def _boundary(self, step: int, start_step: int) -> bool:
        """After `step` steps: is a snapshot due (and a checkpoint), so the next failure replays from here?"""
        ckpt = self.faults.checkpoint_every if self.checkpoint_dir is not None else None
        if ckpt and (step - start_step) % ckpt == 0:
            return True
        if not self.keep_state or (self.held is not None and self.held.busy()):
            return False
        if self.faults.snapshot_every is None:  # counted from the last copy (a recovery restarts the count)
            last = self.snapshot.step if self.snapshot is not None else start_step
            return step - last >= self.snapshot_every()
        return (step - start_step) % self.faults.snapshot_every == 0

    def at_boundary(self, step: int, start_step: int) -> None:
        if not self._boundary(step, start_step):
            return
        snap = self.take_snapshot(step)
        ckpt = self.faults.checkpoint_every
        if self.checkpoint_dir is not None and ckpt and step % ckpt == 0:
            self.save(self.checkpoint_dir, step, snap.per_stage, snap.ranges)
            self.event("checkpoint", step=step, directory=str(self.checkpoint_dir))

    def _record(self, step: int, loss: float, started: float, done: list[dict]) -> None:
        """Step `step` is done (it started at `started`, perf_counter): its loss now; its seconds
        and progress report once the next step starts or the run ends (`_close_step`)."""
        self._close_step(started)
        self.result.losses.append(loss)
        self.result.step_seconds.append(time.perf_counter() - started)
        self.result.state_seconds.append(0.0)
        self._open = {"step": step, "loss": loss, "started": started, "done": done,
                      "index": len(self.result.losses) - 1}
        if self._recovering is not None:
            r, self._recovering = self._recovering, None
            self.event("recovered", step=step, seconds=time.monotonic() - r["t0"], steps_replayed=r["replayed"],
                       ranges=[list(x) for x in self.result.ranges], devices=self._devices())
        self._watch_devices(step, done)

    def _close_step(self, now: float | None = None) -> None:
        """The step still open ends `now` (the next one starts, or the run ends): its wall-clock
        seconds, from its start, with whatever the fault policy did after it, and its progress report."""
        step, self._open = self._open, None
        if step is None:
            return
        seconds = (time.perf_counter() if now is None else now) - step["started"]
        self.result.step_seconds[step["index"]] = seconds
        if self.on_step:
            done = step["done"]
            self.on_step(step["step"], step["loss"], seconds, [d["seconds"] for d in done], done)

    def _devices(self) -> list[str]:
        return [self.device_of.get(a, a) for a in self.result.addresses]

    def _watch_devices(self, step: int, done: list[dict]) -> None:
        """A device about to run out of memory or battery is an event, and a device to move off
        (`self.running_low`, taken by `flush` at this boundary)."""
        self.running_low = {}
        for name, address, d in zip(self._devices(), self.result.addresses, done):
            mem, battery = d.get("mem_available_bytes"), d.get("battery_percent")
            if mem is not None and mem < self.faults.low_memory_bytes:
                self.event("memory_low", step=step, device=name, mem_available_bytes=mem)
                self.running_low.setdefault(address, "memory_low")
            if battery is not None and battery < self.faults.low_battery_percent:
                self.event("battery_low", step=step, device=name, battery_percent=battery)
                self.running_low.setdefault(address, "battery_low")

    def move_off(self, step: int) -> tuple[bool, Schedule | None]:
        """At the flush boundary after `step` steps, re-plan without the devices running low (all
        of them alive: the state comes from them, nothing is replayed). (moved, the new schedule or
        None for the config's). Nothing moves when the policy is "stop", there is no re-planner,
        every device is low, or no plan fits the others (an event says which)."""
        low, self.running_low = dict(self.running_low), {}
        if not low or self.faults.on_failure != "replan" or self.plan_over is None:
            return False, None
        names = [self.device_of.get(a, a) for a in low]
        if len(low) >= len(self.result.addresses):
            self.event("stayed", step=step, devices=names, cause=sorted(set(low.values())),
                       reason="every device of the pipeline is running low")
            return False, None
        snap = self.snapshot if self.snapshot is not None and self.snapshot.step == step else self.take_snapshot(step)
        try:
            plan = self.plan_over(step, snap, list(self.result.addresses), [a for a in self.workers if a not in low])
        except (PlanDoesNotFit, ValueError) as exc:
            self.event("stayed", step=step, devices=names, cause=sorted(set(low.values())),
                       reason=f"the others cannot hold the model: {exc}")
            return False, None
        self.workers = [a for a in self.workers if a not in low]
        self._switch(step, plan, snap, sorted(set(low.values()))[0], left=names)
        return True, plan.schedule

    def take_in(self, step: int) -> tuple[bool, Schedule | None]:
        """At the flush boundary (or 1f1b-stash drain) after `step` steps: the lost workers that
        answered the call back are `joined` events and candidates again, and the run re-plans over
        them when that is predicted faster (moved, the new schedule or None for the config's)."""
        back = self.coordinator.returned()
        if not back:
            return False, None
        joined = [b["address"] for b in back]
        self.workers = [a for a in self.first_order if a in set(self.workers) | set(joined)]
        plan, reason = None, "the policy is --on-failure stop" if self.faults.on_failure != "replan" else ""
        if not reason and self.plan_over is None:
            reason = "no way to re-plan this pipeline"
        if not reason:
            snap = self.snapshot if self.snapshot is not None and self.snapshot.step == step else self.take_snapshot(step)
            try:
                plan = self.plan_over(step, snap, list(self.result.addresses), list(self.workers))
            except (PlanDoesNotFit, ValueError) as exc:
                reason = f"no plan with it fits: {exc}"
            if plan is None and not reason:
                reason = "the plan with it is predicted no faster"
        for b in back:
            self.event("joined", step=step, device=self.device_of.get(b["address"], b["address"]),
                       address=b["address"], taken_in=plan is not None, reason=reason or "re-planned with it",
                       **{k: b[k] for k in ("mem_available_bytes", "battery_percent") if b.get(k) is not None})
        if plan is None:
            return False, None
        self._switch(step, plan, snap, "joined", joined=[self.device_of.get(a, a) for a in joined])
        return True, plan.schedule

    def _switch(self, step: int, plan: SurvivorPlan, snap: Snapshot, cause: str, lost: Sequence[str] = (),
                **fields) -> None:
        """Set the pipeline up as `plan` with the state of `snap` (held off the devices, or gathered at
        this boundary) and record the new plan (an event, result.ranges/addresses/devices/replans)."""
        placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(plan.ranges, plan.addresses))]
        if plan.devices is not None:
            self.device_of.update(dict(zip(plan.addresses, plan.devices)))
        reconf = self.coordinator.reconfigure(placements, bundles=plan.bundles, devices=plan.devices,
                                              state=snap.state, lost=lost)
        self._work_s = []  # a new setup: its first step builds the engines again
        old_ranges = list(self.result.ranges)
        self.result.ranges = [tuple(r) for r in plan.ranges]
        self.result.addresses = list(plan.addresses)
        if plan.devices is not None:
            self.result.devices = list(plan.devices)
        self.result.replans.append((snap.step, reconf))
        self.event("new_plan", step=snap.step, cause=cause, **fields, old_ranges=[list(r) for r in old_ranges],
                   ranges=[list(r) for r in self.result.ranges], devices=self._devices(),
                   plan=None if plan.directory is None else str(plan.directory), seconds=reconf.seconds)
        # the held state is the same, the stages are new: a checkpoint or a later recovery needs theirs
        if self.held is not None:
            self.held.reset()
            self.snapshot = self.held.take(snap.step, self.result.ranges, []) if self.keep_state else None
            return
        self.snapshot = Snapshot(snap.step, self.coordinator.collect_checkpoint(), snap.state,
                                 list(self.result.ranges)) if self.keep_state else None

    def collect_final(self, step: int) -> None:
        """Every stage's state after the last step (`self.final`): the snapshot's when one was just
        taken, else collected now. A device lost here is a loss like any other (WorkerLost): the
        caller recovers and replays, because the last steps' updates live only on the devices."""
        if self.snapshot is not None and self.snapshot.step == step:
            self.final = self.snapshot.per_stage
        else:
            self.final = self.coordinator.collect_checkpoint()

    def _reports(self, done: list[dict]) -> None:
        """Keep the stages' reports of the last REPORTS_KEPT steps (a long run's coordinator must not
        grow with every step: issue 13 measured 4 KB a step) and each worker's peak memory."""
        self.result.stage_reports.append(done)
        self.result.stage_busy.append([busy_fraction(d["seconds"], d.get("wall_s", 0.0)) for d in done])
        if len(self.result.stage_reports) > REPORTS_KEPT:
            del self.result.stage_reports[0], self.result.stage_busy[0]
        copied = max((d.get("snapshot_copy_s") or 0.0 for d in done), default=0.0)
        if copied > 0:  # the workers' copies before this step (state on "peers"): on its path
            self.result.snapshot_seconds.append(copied)
            self._charge(copied)
        if self.held is not None:
            self.held.note(done)
        for address, d in zip(self.result.addresses, done):
            peak = d.get("peak_rss_bytes")
            if peak is not None:
                self.result.peak_rss_bytes[address] = max(peak, self.result.peak_rss_bytes.get(address, 0))

    def _truncate(self, step: int, start_step: int) -> None:
        keep = step - start_step
        drop = len(self.result.losses) - keep  # the steps to run again
        del self.result.losses[keep:], self.result.step_seconds[keep:], self.result.state_seconds[keep:]
        if drop > 0 and self.config.schedule not in ASYNC_SCHEDULES:  # flush: one report per step
            del self.result.stage_reports[-drop:], self.result.stage_busy[-drop:]

    # --- recovery --------------------------------------------------------------------------------
    def recover(self, lost: WorkerLost, step: int, mid_step: bool, start_step: int) -> Schedule | None:
        """After `lost` during (or right after) step `step`: abort it on the survivors, re-plan over
        them, restore the snapshot and return the new plan's schedule (None: build one from the
        config); the caller then continues from `self.snapshot.step`."""
        t0 = time.monotonic()
        if self._open is not None and self._open["step"] > (self.snapshot.step if self.snapshot else -1):
            self._open = None  # replayed: it is reported when it is done again
        self._close_step()
        self._work_s = []  # a new setup: its first step builds the engines again
        for k, p in lost.lost.items():
            self.event("lost", step=step, stage=k, device=self.device_of.get(p.address, p.address),
                       address=p.address, detected_after_s=p.down_s, reason=p.reason)
        snap = self.snapshot  # on peers: which one restores is known after the abort (holders file what came)
        if self.faults.on_failure == "stop" or snap is None or self.plan_over is None:
            why = ("--on-failure stop" if self.faults.on_failure == "stop" else
                   "no state was held off the devices" if snap is None else "no way to re-plan this pipeline")
            raise RecoveryImpossible(f"{lost} ({why})", self._rescue(snap))
        while True:
            try:
                self.coordinator.abort(step, lost)
                break
            except WorkerLost as more:
                for k, p in more.lost.items():
                    if k not in lost.lost:
                        self.event("lost", step=step, stage=k, device=self.device_of.get(p.address, p.address),
                                   address=p.address, detected_after_s=p.down_s, reason=p.reason)
                lost = more
        if self.held is not None:
            snap = self.held.restorable(list(lost.lost))
            if snap is None:
                raise RecoveryImpossible(f"{lost} (no snapshot of the lost stages was held by a survivor)")
        self.coordinator.forget(lost.addresses)
        gone = lost.addresses + self.coordinator.lost_spares()
        self.coordinator.forget(gone)
        if self.faults.take_back:
            self.coordinator.call_back(gone)
        self.workers = [a for a in self.workers if a not in gone]
        try:
            plan = self.plan_over(snap.step, snap, list(self.result.addresses), list(self.workers))
        except (PlanDoesNotFit, ValueError) as exc:
            raise RecoveryImpossible(f"{lost}; the survivors cannot hold the model: {exc}", self._rescue(snap)) from None
        if plan is None:
            raise RuntimeError("plan_over returned no plan after a loss")
        self._switch(snap.step, plan, snap, "lost", lost=gone)
        replayed = step - snap.step + (1 if mid_step else 0)
        self._truncate(snap.step, start_step)
        self._recovering = {"t0": t0, "replayed": replayed}
        return plan.schedule

    def _rescue(self, snap: Snapshot | None) -> Path | None:
        """Write the held state where a resume finds it (the checkpoint folder)."""
        if snap is None or self.checkpoint_dir is None:
            return None
        self.save(self.checkpoint_dir, snap.step, snap.per_stage, snap.ranges)
        return self.checkpoint_dir

    # --- schedules -------------------------------------------------------------------------------
    def stash(self, start_step: int, steps: int, update_every: int) -> None:
        """1f1b-stash: PipeDream never flushes, so a segment of steps is one schedule over steps x M
        micro-batches, whose actions go to the workers with the run, bundles or not. Segments end
        at multiples of `faults.checkpoint_every` (absolute steps; without it the whole run is one
        segment), where the pipeline drains: a checkpoint there continues exactly, and a lost
        device replays at most the segment it interrupted."""
        self.start_step = start_step
        M, end = self.M, start_step + steps
        every = self.faults.checkpoint_every or (STASH_SEGMENT_STEPS if self.keep_state else None)
        if self.keep_state:
            self.take_snapshot(start_step)
        s = start_step
        while s < end:
            stop = min(end, (s // every + 1) * every) if every else end
            schedule = make_schedule(self.config.schedule, self.coordinator.stages, (stop - s) * M,
                                     update_every=update_every)
            feeds = [f for k in range(s, stop) for f in self.feeds(k)]
            start = time.perf_counter()
            self._close_step(start)
            arrived: list[float] = []
            marks = [start]  # when each step of the segment was done: its last micro-batch's loss came

            def on_loss(m: int, loss: float, s=s, stop=stop, arrived=arrived, marks=marks) -> None:
                """Every step but the segment's last is reported as its last loss comes (the last one
                once the stages' reports are in); its seconds run from the step before it."""
                arrived.append(loss)
                if len(arrived) % M == 0:
                    k = len(arrived) // M
                    marks.append(time.perf_counter())
                    if s + k < stop:
                        self._record(s + k, float(sum(arrived[-M:])), marks[-2], [])
                        self._close_step(marks[-1])

            try:
                losses, done = self.coordinator.run(schedule, feeds, s, send_actions=True, on_loss=on_loss)
            except WorkerLost as lost:
                finished = len(arrived) // M  # the steps whose losses all came before the loss was found
                self.recover(lost, s + finished, s + finished < stop, start_step)
                s = self.snapshot.step
                continue
            self._record(stop, float(sum(losses[-M:])), marks[-2], done)
            self._reports(done)
            s = stop
            try:
                if s == end:
                    self._close_step()
                    self.collect_final(s)
                    continue
                snap = self.take_snapshot(s) if self.keep_state else None
                ckpt = self.faults.checkpoint_every
                if self.checkpoint_dir is not None and ckpt and s % ckpt == 0:
                    snap = snap or self.take_snapshot(s)
                    self.save(self.checkpoint_dir, s, snap.per_stage, snap.ranges)
                    self.event("checkpoint", step=s, directory=str(self.checkpoint_dir))
                # a drain is a boundary like a flush schedule's: a lost device that answered the
                # call back joins here (the next segment's schedule is made for the stages then)
                self.take_in(s)
            except WorkerLost as lost:
                self.recover(lost, s, False, start_step)
                s = self.snapshot.step
        self._close_step()

    def flush(self, start_step: int, steps: int, schedule: Schedule, replan_every: int | None, from_bundles: bool,
              address_of: Mapping[str, str], on_replan, on_replanned) -> None:
        """Flush schedules: one schedule per step, a snapshot at each boundary the fault policy asks
        for, and a re-plan check every `replan_every` steps."""
        self.start_step = start_step
        # per step since the last re-plan check: F+B seconds per stage, and whether that step was
        # the first after a setup, which builds the engines' graphs and caches: not steady state,
        # so it is left out whenever later steps were measured
        window: list[list[float]] = []
        warm_up = True
        end = start_step + steps
        if self.keep_state:
            self.take_snapshot(start_step)
        s = start_step
        while s < end:
            start = time.perf_counter()
            self._close_step(start)
            try:
                losses, done = self.coordinator.run(schedule, self.feeds(s), s)
            except WorkerLost as lost:
                schedule = self.recover(lost, s, True, start_step) or make_schedule(
                    self.config.schedule, self.coordinator.stages, self.M)
                s, window, warm_up = self.snapshot.step, [], True
                continue
            self._work_s.append(time.perf_counter() - start)
            self._record(s + 1, float(sum(losses)), start, done)
            self._reports(done)
            s += 1
            try:
                self.at_boundary(s, start_step)
                if s == end:
                    self._close_step()  # the last step ends here; collecting the final state is the run's
                    self.collect_final(s)
            except WorkerLost as lost:
                schedule = self.recover(lost, s, False, start_step) or make_schedule(
                    self.config.schedule, self.coordinator.stages, self.M)
                s, window, warm_up = self.snapshot.step, [], True
                continue
            if s < end:
                moved, new_schedule = self.take_in(s)
                if not moved and self.running_low:
                    moved, new_schedule = self.move_off(s)
                if moved:
                    schedule = new_schedule or make_schedule(self.config.schedule, self.coordinator.stages, self.M)
                    window, warm_up = [], True
                    continue
            window.append([d["seconds"].get("F", 0.0) + d["seconds"].get("B", 0.0) for d in done])
            if warm_up and len(window) > 1:
                window.pop(0)
                warm_up = False
            if not (replan_every and (s - start_step) % replan_every == 0 and s < end):
                continue
            measured = [sum(col) / len(window) for col in zip(*window)]
            window, warm_up = [], False
            fresh = self.snapshot if self.snapshot is not None and self.snapshot.step == s else None
            if from_bundles:
                replanned = _replan_bundles(self.coordinator, on_replan, s, measured, address_of, self.result, fresh)
                reconf, new_schedule = replanned if replanned is not None else (None, None)
            else:
                reconf = _replan_ranges(self.coordinator, on_replan, s, measured, self.workers, self.result, fresh)
                new_schedule = None if reconf is None else make_schedule(self.config.schedule,
                                                                         self.coordinator.stages, self.M)
            if reconf is not None:
                window, warm_up = [], True
                self.result.replans.append((s, reconf))
                self.event("new_plan", step=s, cause="measured", old_ranges=[list(r) for r in reconf.old_ranges],
                           ranges=[list(r) for r in reconf.new_ranges], devices=self._devices(),
                           seconds=reconf.seconds)
                schedule = new_schedule
                if self.held is not None:  # the new stages hold no copy yet: one of the state they start from
                    self.held.reset()
                    self.take_snapshot(s)
                elif self.snapshot is not None and self.snapshot.step == s:  # the state is the same, the stages not
                    self.snapshot = Snapshot(s, self.coordinator.collect_checkpoint(), self.snapshot.state,
                                             list(self.result.ranges))
                if on_replanned:
                    on_replanned(s, reconf)
                self._work_s = []  # a new setup: its first step builds the engines again
        self._close_step()


# Steps whose per-stage reports a result keeps (the figures over the whole run are kept as they go).
REPORTS_KEPT = 200


def _replan_ranges(coordinator: Coordinator, on_replan, step: int, measured: list[float], workers: Sequence[str],
                   result: PipelineResult, fresh: Snapshot | None = None) -> Reconfiguration | None:
    """Graph slices: new block ranges from on_replan, stage k on workers[k] (the run's workers in
    their first order, less any lost)."""
    new_ranges = on_replan(step, measured)
    if new_ranges is None or [tuple(r) for r in new_ranges] == result.ranges:
        return None
    if not 1 <= len(new_ranges) <= len(workers):
        raise ValueError(f"on_replan returned {len(new_ranges)} stages for {len(workers)} workers")
    result.ranges = [tuple(r) for r in new_ranges]
    result.addresses = workers[:len(result.ranges)]
    return coordinator.reconfigure([StagePlacement(k, a, b, addr)
                                    for k, ((a, b), addr) in enumerate(zip(result.ranges, result.addresses))],
                                   state=None if fresh is None else fresh.state)


def _replan_bundles(coordinator: Coordinator, on_replan, step: int, measured: list[float],
                    address_of: Mapping[str, str], result: PipelineResult, fresh: Snapshot | None = None
                    ) -> tuple[Reconfiguration, Schedule] | None:
    """Bundles: a new plan from on_replan, written from the weights gathered here (at most once);
    what moved, and the new plan's schedule."""
    gathered = [fresh.state] if fresh is not None else []

    def weights() -> dict[str, np.ndarray]:
        if not gathered:
            gathered.append(coordinator.gather())
        return gathered[0].weights

    plan = on_replan(step, measured, weights)
    if plan is None:
        return None
    unknown = [d for d in plan.devices if d not in address_of]
    if unknown:
        raise ValueError(f"the new plan places stages on {unknown}, which have no worker (devices with workers: "
                         f"{sorted(address_of)})")
    if not gathered:
        raise ValueError("on_replan returned a new plan without gathering the weights to write it with")
    placements = [StagePlacement(k, a, b, address_of[d])
                  for k, ((a, b), d) in enumerate(zip(plan.ranges, plan.devices))]
    reconf = coordinator.reconfigure(placements, bundles=plan.bundles, devices=plan.devices, state=gathered[0])
    result.ranges = [tuple(r) for r in plan.ranges]
    result.devices = list(plan.devices)
    result.addresses = [address_of[d] for d in plan.devices]
    return reconf, plan.schedule


# --- the `confidant train-pipeline` job -----------------------------------------------------------

def train_pipeline_job(model: Path, data: Path, eval_path: Path | None, training: TrainingSettings,
                       pipeline: PipelineSettings, workers: Sequence[str] | None = None, local: int | None = None,
                       reporter: Reporter = Silent(), task: str = "ner") -> TrainingMetrics:
    """Cut `model` into one stage per worker (at `pipeline.cuts`, else evenly) and train it with the
    pipeline's schedule on the workers at `workers`, or on `local` worker processes started here;
    `task` is ner, seq-cls or causal-lm (jobs.pipeline_tasks). Everything that can be refused is
    checked before any worker starts."""
    training.check()
    pipeline.check(training.batch)
    if pipeline.checkpoint is not None:
        check_checkpoint_target(pipeline.checkpoint)
    M = pipeline.microbatches
    n_stages = len(workers) if workers else (local or 0)
    if n_stages < 1:
        raise JobError("need at least one worker (--workers ADDRESSES or --local N)")
    run_task = pipeline_task(task, model, data, eval_path, training, M, reporter)
    graph = run_task.graph
    cuts = list(pipeline.cuts) if pipeline.cuts else None
    meta = {"model": Path(model).name, "task": task, "schedule": pipeline.schedule, "microbatches": M,
            "batch": training.batch, "seq": training.seq, "optimizer": training.optimizer, "lr": training.lr,
            "seed": training.seed, "cuts": cuts, "model_path": str(Path(model).resolve()),
            "labels": list(run_task.labels), "lora": None if training.lora is None else asdict(training.lora)}
    start_step, weights, opt_state = 0, None, None
    if pipeline.resume:
        start_step, weights, opt_state, cuts, meta["losses"] = _resumed(pipeline.resume, meta, n_stages, graph, model)
        reporter.note(f"resuming from {pipeline.resume} at step {start_step}")
    try:
        ranges = stage_ranges(len(graph.blocks), n_stages, cuts)
        check_tied_schedule(graph, ranges, pipeline.schedule)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    tied = tied_parameters(graph, ranges)
    if tied:
        reporter.note(f"{len(tied)} weight(s) held by several stages ({', '.join(sorted(tied)[:3])}): their "
                      f"gradients are summed through the coordinator before every update")
    config = PipelineConfig(schedule=pipeline.schedule, microbatches=M, engine=training.engine,
                            threads=training.threads, optimizer=training.optimizer, lr=training.lr,
                            timeout_s=pipeline.timeout_s, activations=pipeline.activations)
    replanner = None
    if pipeline.replan_every is not None:
        replanner = TimingReplanner(graph, ranges, pipeline.schedule, M, training.optimizer,
                                    pipeline.replan_threshold, update_every=pipeline.update_every)
    faults = FaultPolicy(pipeline.on_failure, pipeline.failure_timeout_s, AUTO_SNAPSHOTS, pipeline.checkpoint_every,
                         state_on="peers")
    addresses, keys = (None, None) if local else parse_workers(workers, pipeline.keys, pipeline.insecure)
    reporter.start(f"train ({n_stages} stages, {pipeline.schedule}, {M} micro-batches)", training.steps)

    def on_step(step, loss, seconds, stage_seconds, done):
        busy = "/".join(f"{busy_fraction(d['seconds'], d.get('wall_s', 0.0)):.0%}" for d in done)
        reporter.step(step - start_step, loss=loss, **{"samples/s": training.batch / seconds, "busy": busy})

    def on_event(event):
        reporter.note(describe_event(event))
        if replanner is not None and event["event"] == "new_plan" and event.get("cause") == "lost":
            replanner.restart(event["ranges"])

    def metrics_of(result: PipelineResult, figures=None, replans=(), error: str | None = None) -> TrainingMetrics:
        stage_rss = [result.peak_rss_bytes.get(a) for a in result.addresses]
        return TrainingMetrics(
            "train-pipeline", str(model), training.batch, training.seq,
            steps_from(result.losses, result.step_seconds, training.batch, start_step + 1, result.state_seconds),
            tuple(DeviceFigures(f"stage{k}", k, a, b, rss)
                  for k, ((a, b), rss) in enumerate(zip(result.ranges, stage_rss))),
            microbatches=M, schedule=pipeline.schedule, eval=figures, coordinator_peak_rss_bytes=peak_rss_bytes(),
            replans=replans, events=tuple(result.events),
            settings={**asdict(training), **asdict(pipeline), "task": task}, error=error)

    started = None
    if local:
        pair = None if pipeline.insecure or pipeline.keys is None else coordinator_pair(pipeline.keys, note=reporter.note)
        started = LocalWorkers.start(local, training.threads, coordinator=pair, insecure=pipeline.insecure,
                                     failure_timeout_s=pipeline.failure_timeout_s)
        addresses, keys = started.addresses, started.keys
    failed = True
    try:
        result = train_pipeline(graph, None, len(run_task.labels), addresses,
                                config, training.steps, cuts=cuts, update_every=pipeline.update_every,
                                start_step=start_step, weights=weights, optimizer_state=opt_state,
                                listen=pipeline.listen, on_step=on_step, checkpoint_dir=pipeline.checkpoint, meta=meta,
                                replan_every=pipeline.replan_every, on_replan=replanner, keys=keys,
                                insecure=pipeline.insecure, faults=faults, on_event=on_event,
                                feeds_of_step=run_task.feeds_of_step)
        failed = False
    except (WorkerFailed, RecoveryImpossible) as exc:
        partial = getattr(exc, "result", None)
        raise RunFailed(str(exc), None if partial is None else metrics_of(partial, error=str(exc))) from None
    except BaseException as exc:  # Ctrl-C, or a fault of no known kind: the document is written all the same
        partial = getattr(exc, "result", None)
        if partial is not None:
            exc.metrics = metrics_of(partial, error=failure_text(exc))
        raise
    finally:
        if started:
            codes = started.finish(failed)
            if any(codes) and not failed:
                reporter.note(f"local workers exited with codes {codes}")
    stage_rss = [result.peak_rss_bytes.get(a) for a in result.addresses]
    reporter.note("per stage: " + "; ".join(f"stage {k} blocks {a}-{b} peak RSS {(rss or 0) / 2**20:.0f} MiB"
                                            for k, ((a, b), rss) in enumerate(zip(result.ranges, stage_rss))))
    replans = tuple({"step": step, "old_ranges": r.old_ranges, "new_ranges": r.new_ranges,
                     "moved_bytes": r.moved_bytes, "seconds": r.seconds} for step, r in result.replans)
    if replanner is not None:
        for step, decision in replanner.decisions:
            reporter.note(f"after step {step}: {decision.reason}")
    figures = run_task.evaluate(result.weights)
    if figures is not None:
        reporter.note(f"{run_task.headline(figures)} after pipeline training")
    metrics = metrics_of(result, figures, replans)
    planned = default_planned_bytes(graph, result.ranges, pipeline.schedule, M, training.optimizer,
                                    pipeline.update_every, training.engine)
    return check_memory(metrics, {f"stage{k}": b for k, b in enumerate(planned)}, {}, reporter, "the memory model",
                        over_plan=False)


def describe_event(event: Mapping) -> str:
    """One progress line for an event of `PipelineResult.events`."""
    kind = event["event"]
    if kind == "lost":
        return (f"lost {event['device']} (stage {event['stage']}) during step {event['step'] + 1}: detected "
                f"{event['detected_after_s']:.1f} s after its link went down ({event['reason']})")
    if kind == "new_plan":
        where = " | ".join(f"{d} {a}-{b}" for d, (a, b) in zip(event["devices"], event["ranges"]))
        left = f"; moved off {', '.join(event['left'])}" if event.get("left") else ""
        left += f"; took in {', '.join(event['joined'])}" if event.get("joined") else ""
        return f"new plan after step {event['step']} ({event['cause']}{left}): {where}"
    if kind == "recovered":
        return (f"recovered: step {event['step']} done {event['seconds']:.1f} s after the loss was detected, "
                f"{event['steps_replayed']} step(s) replayed")
    if kind == "checkpoint":
        return f"checkpoint after step {event['step']} in {event['directory']}"
    if kind == "memory_low":
        return f"{event['device']}: only {event['mem_available_bytes'] / 2**20:.0f} MiB free after step {event['step']}"
    if kind == "battery_low":
        return f"{event['device']}: battery at {event['battery_percent']:.0f}% after step {event['step']}"
    if kind == "stayed":
        return f"{', '.join(event['devices'])} running low ({', '.join(event['cause'])}) but kept: {event['reason']}"
    if kind == "joined":
        outcome = "taken in" if event.get("taken_in") else f"waits as a spare: {event.get('reason', 'not taken in')}"
        return f"{event['device']} is back after step {event['step']}: {outcome}"
    return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "at"))


def _resumed(folder: Path, meta: dict, n_stages: int, graph=None, model: Path | None = None):
    """(the step to continue from, weights, optimizer state per stage, the cuts, the losses of its
    steps) of a checkpoint,
    once it is one of this run's (same model, schedule, shape, optimizer, seed, stage count) and
    its tensors are `graph`'s trainable parameters by name and shape (a model of the same file name
    is not the same model). A torn or hand-broken checkpoint is refused by `load_checkpoint`."""
    saved, weights, opt_state = load_checkpoint(folder)
    for key in ("model", "task", "schedule", "microbatches", "batch", "seq", "optimizer", "seed", "lora"):
        # as JSON reads it back (tuples become lists); checkpoints from before tasks were NER
        was = saved.get(key, "ner" if key == "task" else None)
        if key == "lora" and isinstance(was, dict):  # from before --base-dtype: a float32 base
            was = {"base_dtype": "float32", **was}
        if was != json.loads(json.dumps(meta[key])):
            raise JobError(f"--resume {folder}: checkpoint has {key}={saved.get(key)!r}, this run {meta[key]!r}")
    if saved["stages"] != n_stages:
        raise JobError(f"--resume {folder}: checkpoint has {saved['stages']} stages, this run {n_stages}")
    if graph is not None:
        check_tensors_fit(folder, weights, opt_state, {p: graph.constants[p].shape for p in graph.params},
                          model or meta["model"], f"resume with the model it was trained from "
                          f"({saved.get('model_path') or saved.get('model')}), or train without --resume")
    step = int(saved["step"])
    return step, weights, opt_state, [r[0] for r in saved["ranges"][1:]], list(saved.get("losses") or [])[:step]
