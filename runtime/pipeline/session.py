"""A training run over set-up workers: the run controller (issue 34, step 2).

`run_session` drives a coordinator through a plan's steps: flush schedules step by step, 1f1b-stash
in segments of its plan's steady state unrolled; it holds every stage's state off the devices at the
boundaries the fault policy asks for (`FaultPolicy`: snapshots, checkpoints), recovers from a lost
worker (abort on the survivors, a plan over them, the held state restored, the lost steps replayed),
moves off devices running low, takes back devices that return, re-plans from measured times, and
records it all in a `PipelineResult` (steps, figures, events).

What a re-plan is, the session does not decide: the job injects it. `plan_over(step, snapshot,
stages, candidates)` returns the plan over the candidates (a `SurvivorPlan`), `on_replan` the
measured re-plan, and `emit(ranges, addresses, weights)`, for a plan made in memory, its bundles.
So the runtime imports no planner (tests/project/test_imports.py), and whoever computes a re-plan changes one
call. Every plan the session sets up is bundles: nothing here makes a schedule.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ir.plan import ASYNC_SCHEDULES, FAILURE_POLICIES, Schedule
from runtime.pipeline.checkpoints import TrainingState, merge_checkpoint, save_checkpoint
from runtime.pipeline.coordinator import (Coordinator, PipelineConfig, Reconfiguration, StagePlacement, WorkerFailed,
                                          WorkerLost)
from runtime.pipeline.executor import busy_fraction
from runtime.pipeline.restore import RestoredSnapshot, RestoreSpool
from runtime.pipeline.snapshots import FallbackCopies, PeerSnapshots


@dataclass
class PipelineResult:
    losses: list[float]
    step_seconds: list[float]  # wall clock from each step's start to the next's (state copies included)
    stage_busy: list[list[float]]
    stage_reports: list[list[dict]]
    weights: dict[str, np.ndarray]
    # every stage's state at the end: parameters, and the optimizer's state when a checkpoint is written
    checkpoint: list[dict[str, np.ndarray]]
    ranges: list[tuple[int, int]]  # at the end (after any re-plan)
    replans: list[tuple[int, Reconfiguration]] = field(default_factory=list)  # (steps done before it, what moved)
    devices: list[str] | None = None  # with bundles: the device of each stage at the end
    events: list[dict] = field(default_factory=list)  # failures and recoveries, as they happened (jobs.common.metrics)
    addresses: list[str] = field(default_factory=list)  # the worker of each stage at the end
    snapshot_seconds: list[float] = field(default_factory=list)  # each copy of the state to the coordinator
    state_seconds: list[float] = field(default_factory=list)  # per step: the part of step_seconds spent copying
    # the state to the coordinator and writing checkpoints (what the fault policy costs)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # worker address -> its peak over the run
    setup_bytes: int = 0  # what the first setup sent the workers (bundles or weights, optimizer state)
    base_bytes_held: int = 0  # frozen weights the first setup left to the workers' own base files
    state_bytes: int = 0  # every stage's trainable state at the end (parameters and optimizer state), as sent
    # what `run_session`'s `after_training(coordinator)` returned (an evaluation on the workers), and
    # its seconds
    after_training: object = None
    after_training_s: float = 0.0


STATE_PLACES = ("coordinator", "peers")

# The command line's snapshot policy (FaultPolicy.snapshot_every): chosen from measured costs.
AUTO_SNAPSHOTS = None
# What the state copies may cost of the wall-clock step under AUTO_SNAPSHOTS: half of issue 32's
# target (5%), since what a worker measures of a snapshot (runtime.pipeline.snapshots.StateCopies:
# gathering and copying its state, shipping, filing a neighbour's, the transport's I/O threads)
# leaves out what it does to the step's own work (caches, a core shared with the I/O threads).
SNAPSHOT_SHARE = 0.025
# At most this many seconds of steps replayed after a loss under AUTO_SNAPSHOTS: with a re-setup of
# a few seconds, a recovery stays within 10 s (issue 13's target).
REPLAY_BUDGET_S = 5.0
# 1f1b-stash without --checkpoint-every under AUTO_SNAPSHOTS: the run drains (and copies its state)
# every this many steps, so a loss replays at most these (issue 32: it replayed the run from step 0).
STASH_SEGMENT_STEPS = 8
# State on peers: a stage lost together with the neighbour holding its copy is recovered from a copy
# of every stage's state the coordinator spools to disk (FallbackCopies) every K steps, K chosen so
# that those copies cost at most FALLBACK_SHARE of the wall-clock step, and no more steps than run
# in FALLBACK_REPLAY_S (the replay of such a double loss). A run writing checkpoints uses them too.
FALLBACK_SHARE = 0.01
FALLBACK_REPLAY_S = 60.0


def snapshot_interval(copy_s: float, step_s: float, share: float = SNAPSHOT_SHARE,
                      replay_budget_s: float = REPLAY_BUDGET_S, copies_cpu_s: float = 0.0,
                      work_cpu_s: float = 0.0) -> int:
    """Steps between state copies so that a copy of `copy_s` seconds costs at most `share` of
    steps of `step_s` seconds (wall clock, copies left out), and, given them, so that what one
    snapshot costs all the workers together (`copies_cpu_s`, CPU seconds) is at most `share` of
    what a step's own work costs them together (`work_cpu_s`): workers that share cores pay for
    each other's copies, and a worker idle in the pipeline's bubbles has less CPU to lose to them
    than its wall clock says. The larger of the two intervals, but no more steps than replay in
    `replay_budget_s` (a recovery's bound wins: the copies then cost more than `share`)."""
    if not step_s > 0:
        return 1
    wanted = math.ceil(copy_s / (share * step_s)) if copy_s > 0 else 1
    if copies_cpu_s > 0 and work_cpu_s > 0:
        wanted = max(wanted, math.ceil(copies_cpu_s / (share * work_cpu_s)))
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
    # the new plan as read and verified once (ir.bundle.LoadedPlan), whose files `bundles` are: its
    # parsed bundles are not parsed again, and all of it is let go once shipped
    loaded: object | None = None


class RecoveryImpossible(RuntimeError):
    """The survivors cannot go on (no plan fits them, or the policy says stop); `checkpoint` is
    where the resumable state was written, if anywhere. `train_pipeline` gives it (and a
    WorkerFailed) the run's `result` so far, as `result`: the steps done and the events."""

    def __init__(self, message: str, checkpoint: Path | None = None, lost: WorkerLost | None = None):
        self.checkpoint = checkpoint
        self.lost = lost  # the loss the survivors could not go on from
        self.result: PipelineResult | None = None
        super().__init__(message + (f"; the state before the failed step is in {checkpoint} (resume with "
                                    f"--resume {checkpoint})" if checkpoint is not None else ""))


def stop_reason(exc: BaseException) -> str:
    """Why a run that raised `exc` stops, as the coordinator's stop order tells the workers (a survivor
    prints it): the stages lost, the user's interrupt, a worker's failure or the coordinator's own."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by the user"
    lost = exc if isinstance(exc, WorkerLost) else getattr(exc, "lost", None)
    if isinstance(lost, WorkerLost):
        return lost.stop_reason
    if isinstance(exc, WorkerFailed):  # a worker's error, or what it sent that the coordinator refused
        return str(exc)
    return f"the coordinator failed: {type(exc).__name__}: {exc}"


class _Returned(Exception):
    """Lost workers called back answered in the middle of a 1f1b-stash segment (`back`: their
    `here` reports), found once `steps_done` steps of it were done (Session.stash)."""

    def __init__(self, back: list[dict], steps_done: int):
        self.back, self.steps_done = back, steps_done
        super().__init__(f"{len(back)} worker(s) answered the call back")


class Session:
    """One training run's steps on a set-up coordinator, recorded into `result`, with the state
    snapshots a recovery restores from."""

    def __init__(self, coordinator: Coordinator, feeds_of_step, config: PipelineConfig, on_step,
                 result: PipelineResult, faults: FaultPolicy = FaultPolicy(), plan_over=None, on_event=None,
                 checkpoint_dir: Path | None = None, meta: dict | None = None, devices=None, spare_devices=None,
                 emit=None):
        self.coordinator, self.feeds_of_step = coordinator, feeds_of_step
        self.M, self.config, self.on_step, self.result = config.microbatches, config, on_step, result
        self.faults, self.plan_over, self.on_event = faults, plan_over, on_event
        # `emit(ranges, addresses, weights) -> SurvivorPlan`: the job's planner for a plan made in memory
        # (train-pipeline): a plan of ranges over workers (plan_over's, on_replan's) gets its bundles
        # from it; a plan folder's re-plans bring their own (None)
        self.emit = emit
        self.checkpoint_dir, self.meta = checkpoint_dir, meta
        self.start_step = 0  # the step this run started at (a resume's), set by `stash` / `flush`
        self.snapshot: Snapshot | None = None
        self.running_low: dict[str, str] = {}  # address -> "memory_low" | "battery_low", after the last step
        # state is held off the devices when a loss can be recovered from, or a stop must leave a checkpoint
        self.keep_state = (faults.on_failure == "replan" and plan_over is not None) or checkpoint_dir is not None
        self.held = PeerSnapshots.for_run(coordinator, faults, plan_over)  # None: snapshots on the coordinator
        # with the state on peers: the coordinator's copy for a loss of a stage and its copy's holder
        self.fallback = FallbackCopies() if self.held is not None else None
        # where a recovery's optimizer state waits for the new stages' setup (runtime.pipeline.restore):
        # the coordinator never holds the whole state at once
        self.restore_spool = RestoreSpool() if self.held is not None else None
        self._checkpointed: tuple[int, list] | None = None  # (step, ranges) of the last checkpoint written
        self._state_from = "coordinator"  # where the last recovery's state came from (its event says)
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
        return list(self.feeds_of_step(step))

    # --- events, snapshots, checkpoints ----------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        entry = {"event": kind, "at": time.time(), **fields}
        self.result.events.append(entry)
        if self.on_event:
            self.on_event(entry)
        return entry

    def take_snapshot(self, step: int, confirmed: bool = False) -> Snapshot:
        """Copy every stage's state after `step` steps. On peers the copies ship while the next step
        runs; with `confirmed`, this returns once every holder has its copy, shipped at once (a
        1f1b-stash drain: the next segment is STASH_SEGMENT_STEPS steps with no boundary, and a
        loss in it must not replay the segment before too)."""
        start = time.perf_counter()
        if self.held is not None:  # copied on the workers, shipped to neighbours while the next step runs
            if confirmed:  # ordered first: the copies ship while the coordinator takes its fallback copy
                self.snapshot = self.held.take(step, self.result.ranges, [])
                self._keep_fallback(step)
                self.held.wait_confirmed(self.snapshot)
            else:
                self._keep_fallback(step)
                self.snapshot = self.held.take(step, self.result.ranges, self._work_s)
            self._charge(time.perf_counter() - start)
            return self.snapshot
        per_stage = self.coordinator.collect_checkpoint()
        seconds = time.perf_counter() - start
        self.result.snapshot_seconds.append(seconds)
        self._charge(seconds)
        self.snapshot = Snapshot(step, per_stage, TrainingState(*merge_checkpoint(per_stage)), list(self.result.ranges))
        return self.snapshot

    def _keep_fallback(self, step: int, new_stages: bool = False,
                       restored: tuple[TrainingState, Mapping[int, dict]] | None = None) -> None:
        """State on peers: at the boundary after `step` steps, spool every stage's state to the
        coordinator's disk when the last copy (spooled or checkpointed) is K steps old or of other
        stages (`fallback_interval`); not where a checkpoint is written at this step, unless the
        stages were just set up (`new_stages`: no checkpoint of theirs follows). `restored`: the
        state the new stages were just set up from (held here, spooled) and the `own_state` of
        each new stage that read its kept parameters' optimizer state from its own copy: the copy
        is made of it, and only those moments come off the workers (`_restored_stages`)."""
        if self.fallback is None:
            return
        ranges = [tuple(r) for r in self.result.ranges]
        ckpt = self.faults.checkpoint_every if self.checkpoint_dir is not None else None
        if ckpt and step % ckpt == 0 and step != self.start_step and not new_stages:
            return  # the checkpoint written at this boundary is the copy
        copies = [c for c in ((self.fallback.step, self.fallback.ranges), self._checkpointed or (None, None))
                  if c[0] is not None and c[1] == ranges]
        if copies and step - max(c[0] for c in copies) < self.fallback_interval():
            return
        start = time.perf_counter()
        stages = self.coordinator.collect_stages() if restored is None else self._restored_stages(*restored)
        self.fallback.spool(step, ranges, stages)
        seconds = time.perf_counter() - start
        self.fallback.seconds.append(seconds)
        self._charge(seconds)

    def _restored_stages(self, state: TrainingState, own: Mapping[int, dict]):
        """Every new stage's state right after its setup, as `Coordinator.collect_stages` yields
        it, made of `state` (what the setups were sent: its weights in memory, its optimizer state
        spooled) and, for the parameters a survivor kept (`own`: new stage -> its `own_state`),
        their optimizer state collected off that worker, the only bytes that cross the wire (the
        setup sent the state as it is: collecting the rest would bring the same bytes back)."""
        from runtime.pipeline.kept_state import moment_param

        kept = {k: {"weights": False, "moments_of": list(o["params"])} for k, o in own.items() if o.get("params")}
        collected = self.coordinator.collect_stages(kept) if kept else iter(())
        for p in self.coordinator.placements:
            params = self.coordinator.stage_params(p.first_block, p.last_block)
            left = set(kept.get(p.stage, {}).get("moments_of", ()))
            known = [(f"param/{x}", state.weights[x]) for x in params if x in state.weights]
            known += [(f"opt/{kind}/{x}", per[x]) for kind, per in state.optimizer.items() for x in params
                      if x in per and x not in left]
            known += [(f"opt/{name}", arr) for name, arr in state.scalars.items()]
            rows, theirs = None, iter(())
            if p.stage in kept:
                stage, rows, theirs = next(collected)
                if stage != p.stage:
                    raise RuntimeError(f"collected stage {stage}'s kept state for stage {p.stage}")
                # the kept moments only: a worker that ignores the selection sends its whole state
                rows = {k: v for k, v in (rows or {}).items() if moment_param(k) in left} or None
                theirs = ((name, arr) for name, arr in theirs if moment_param(name) in left)
            yield p.stage, rows, itertools.chain(known, theirs)

    def fallback_interval(self) -> int:
        """Steps between the coordinator's fallback copies: each (collected and spooled, measured)
        costs at most FALLBACK_SHARE of the wall-clock step, and a double loss replays at most
        FALLBACK_REPLAY_S of steps."""
        steps = self.result.step_seconds[-8:]
        if not self.fallback.seconds or not steps:
            return 1
        return snapshot_interval(statistics.median(self.fallback.seconds[-3:]), statistics.median(steps),
                                 FALLBACK_SHARE, FALLBACK_REPLAY_S)

    def _fallback_snapshot(self) -> Snapshot | None:
        """The coordinator's newest copy of the current stages' state (spooled, or the run's last
        checkpoint), read back; None when it has none."""
        ranges = [tuple(r) for r in self.result.ranges]
        found = []
        if self.fallback is not None and self.fallback.step is not None and self.fallback.ranges == ranges:
            found.append((self.fallback.step, "coordinator", self.fallback.spooled))
        if self._checkpointed is not None and [tuple(r) for r in self._checkpointed[1]] == ranges:
            found.append((self._checkpointed[0], "checkpoint", lambda: FallbackCopies.checkpointed(self.checkpoint_dir)))
        if not found:
            return None
        _, source, read = max(found, key=lambda f: f[0])
        self._state_from = source
        if source == "coordinator":  # its spooled files, read back one tensor at a time as they are sent
            state = self.restore_spool.state_of(self.fallback.spooled_stages(), "the coordinator's copy")
            return RestoredSnapshot(self.fallback.step, state, list(self.fallback.ranges), lambda: read()[2])
        step, ranges, stages = FallbackCopies.checkpointed_stages(self.checkpoint_dir)  # a stage's file at a time
        state = self.restore_spool.state_of(stages, f"checkpoint {self.checkpoint_dir}")
        return RestoredSnapshot(step, state, list(ranges), lambda: read()[2])

    def close(self) -> None:
        """The run is over: its spooled copy goes."""
        if self.fallback is not None:
            self.fallback.close()
        if self.restore_spool is not None:
            self.restore_spool.close()

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
        if self.checkpoint_dir is not None and Path(directory) == Path(self.checkpoint_dir):
            self._checkpointed = (step, [tuple(r) for r in (ranges or self.result.ranges)])
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
        together = self.held.together() if self.held is not None else (0.0, 0.0)
        return snapshot_interval(statistics.median(copies), statistics.median(work[-8:]),
                                 copies_cpu_s=together[0], work_cpu_s=together[1])

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
                       state_from=r.get("state_from"), ranges=[list(x) for x in self.result.ranges],
                       devices=self._devices())
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
        except ValueError as exc:  # planner.partition.PlanDoesNotFit among them
            self.event("stayed", step=step, devices=names, cause=sorted(set(low.values())),
                       reason=f"the others cannot hold the model: {exc}")
            return False, None
        self.workers = [a for a in self.workers if a not in low]
        return True, self._switch(step, plan, snap, sorted(set(low.values()))[0], left=names).schedule

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
            except ValueError as exc:  # planner.partition.PlanDoesNotFit among them
                reason = f"no plan with it fits: {exc}"
            if plan is None and not reason:
                reason = "the plan with it is predicted no faster"
        for b in back:
            self.event("joined", step=step, device=self.device_of.get(b["address"], b["address"]),
                       address=b["address"], taken_in=plan is not None, reason=reason or "re-planned with it",
                       **{k: b[k] for k in ("mem_available_bytes", "battery_percent") if b.get(k) is not None})
        if plan is None:
            return False, None
        return True, self._switch(step, plan, snap, "joined", joined=[self.device_of.get(a, a) for a in joined]).schedule

    def _switch(self, step: int, plan: SurvivorPlan, snap: Snapshot, cause: str, lost: Sequence[str] = (),
                own_states: Mapping[int, dict] | None = None, **fields) -> SurvivorPlan:
        """Set the pipeline up as `plan` with the state of `snap` (held off the devices, or gathered at
        this boundary) and record the new plan (an event, result.ranges/addresses/devices/replans);
        returns the plan as set up (with its bundles and schedule)."""
        if plan.bundles is None:
            plan = self.emit(plan.ranges, plan.addresses, snap.state.weights)
        named = self.emit is None  # a plan folder's devices have names; train-pipeline's workers are addresses
        placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(plan.ranges, plan.addresses))]
        if named:
            self.device_of.update(dict(zip(plan.addresses, plan.devices)))
        reconf = self.coordinator.reconfigure(placements, bundles=plan.bundles, devices=plan.devices,
                                              state=snap.state, lost=lost, contents=_contents(plan),
                                              own_states=own_states)
        _release(plan)
        self._work_s = []  # a new setup: its first step builds the engines again
        old_ranges = list(self.result.ranges)
        self.result.ranges = [tuple(r) for r in plan.ranges]
        self.result.addresses = list(plan.addresses)
        if named:
            self.result.devices = list(plan.devices)
        self.result.replans.append((snap.step, reconf))
        self.event("new_plan", step=snap.step, cause=cause, **fields, old_ranges=[list(r) for r in old_ranges],
                   ranges=[list(r) for r in self.result.ranges], devices=self._devices(),
                   plan=None if plan.directory is None else str(plan.directory), seconds=reconf.seconds,
                   sent_bytes=reconf.sent_bytes, kept_bytes=reconf.kept_bytes)
        # the held state is the same, the stages are new: a checkpoint or a later recovery needs theirs
        if self.held is not None:
            self.held.reset()
            if self.keep_state:  # a copy of the new stages (the last is of others), made of the restored state
                self._keep_fallback(snap.step, new_stages=True, restored=(snap.state, dict(own_states or {})))
            if self.restore_spool is not None:  # the new stages hold the restored state now
                self.restore_spool.clear()
            self.snapshot = self.held.take(snap.step, self.result.ranges, []) if self.keep_state else None
            return plan
        if self.restore_spool is not None:
            self.restore_spool.clear()
        self.snapshot = Snapshot(snap.step, self.coordinator.collect_checkpoint(), snap.state,
                                 list(self.result.ranges)) if self.keep_state else None
        return plan

    def collect_final(self, step: int) -> None:
        """Every stage's state after the last step (`self.final`): the snapshot's when one was just
        taken, else collected now. A device lost here is a loss like any other (WorkerLost): the
        caller recovers and replays, because the last steps' updates live only on the devices."""
        if self.snapshot is not None and self.snapshot.step == step and (
                self.held is None or self.checkpoint_dir is not None):
            # the coordinator's copy of it (or, for a checkpoint, the peers' copies: the whole state
            # is wanted); a snapshot held on the peers is not fetched for weights alone
            self.final = self.snapshot.per_stage
            self.result.state_bytes = sum(int(v.nbytes) for stage in self.final for v in stage.values())
        else:
            # the optimizer state only for a checkpoint: the run's result is its weights, and the
            # moments (twice the weights under AdamW) would set the coordinator's peak (issue 31)
            self.final = (self.coordinator.collect_checkpoint() if self.checkpoint_dir is not None
                          else self.coordinator.collect_weights())
            self.result.state_bytes = getattr(self.coordinator, "state_bytes", 0)

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
            raise RecoveryImpossible(f"{lost} ({why})", self._rescue(snap), lost)
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
        self._state_from = "coordinator" if self.held is None else "peers"
        if self.held is not None:
            snap = self.held.restorable(list(lost.lost))
            if snap is None:  # a stage lost with the neighbour holding its copy: the coordinator's copy
                snap = self._fallback_snapshot()
            if snap is None:
                raise RecoveryImpossible(f"{lost} (no snapshot of the lost stages was held by a survivor, nor by "
                                         f"the coordinator)", lost=lost)
        self.coordinator.forget(lost.addresses)
        gone = lost.addresses + self.coordinator.lost_spares()
        self.coordinator.forget(gone)
        if self.faults.take_back:
            self.coordinator.call_back(gone)
        self.workers = [a for a in self.workers if a not in gone]
        from_peers = self.held is not None and self._state_from == "peers"
        if from_peers:  # the lost forgotten: from the survivors, their moments once the plan says which move
            snap = self._spooled(snap, list(lost.lost), moments=False)
        try:
            plan = self.plan_over(snap.step, snap, list(self.result.addresses), list(self.workers))
        except ValueError as exc:  # planner.partition.PlanDoesNotFit among them
            raise RecoveryImpossible(f"{lost}; the survivors cannot hold the model: {exc}", self._rescue(snap),
                                     lost) from None
        if plan is None:
            raise RuntimeError("plan_over returned no plan after a loss")
        own = self._moments_kept(snap, plan, list(lost.lost)) if from_peers else {}
        fields = {"state_fetched_bytes": self.restore_spool.bytes_in} if from_peers else {}
        plan = self._switch(snap.step, plan, snap, "lost", lost=gone, own_states=own, **fields)
        replayed = step - snap.step + (1 if mid_step else 0)
        self._truncate(snap.step, start_step)
        self._recovering = {"t0": t0, "replayed": replayed, "state_from": self._state_from}
        return plan.schedule

    def _spooled(self, snap, lost: Sequence[int] = (), moments: bool = True):
        """A snapshot held on the workers about to be restored, its state streamed off them a few
        tensors at a time (`lost` stages' from their holders): the weights kept here, the optimizer
        state spooled to disk until the new stages' setup sends it (runtime.pipeline.restore), so
        the coordinator never holds the whole state. Without `moments`, the surviving stages'
        optimizer state is left on them (`_moments_kept` fetches what moves); a lost stage's
        comes whole."""
        if snap is None:
            return None
        select = None if moments else {p.stage: ({} if p.stage in set(lost) else {"moments_of": []})
                                       for p in self.coordinator.placements}
        return snap.spooled(self.restore_spool, self.coordinator.fetch_held_stages(snap.sid, list(lost), select))

    def _moments_kept(self, snap, plan: SurvivorPlan, lost: Sequence[int]) -> dict[int, dict]:
        """After a loss, the surviving stages' optimizer state left on them (`_spooled(moments=False)`):
        the moved parameters' fetched into the restore spool now, and for each new stage whose
        worker keeps parameters of its old stage, the `own_state` its setup reads them from its own
        copy with (runtime.pipeline.kept_state)."""
        from runtime.pipeline.kept_state import survivors_moments

        old = self.coordinator.placements
        kept, fetch = survivors_moments([set(self.coordinator.stage_params(p.first_block, p.last_block)) for p in old],
                                        [p.address for p in old],
                                        [set(self.coordinator.stage_params(a, b)) for a, b in plan.ranges],
                                        list(plan.addresses), lost)
        if fetch:
            self.restore_spool.add_moments(snap.state, self.coordinator.fetch_held_stages(
                snap.sid, lost, {s: {"weights": False, "moments_of": params} for s, params in fetch.items()}),
                f"snapshot {snap.sid}")
        return self.coordinator.own_states(snap.sid, kept, lost)

    def _may_readmit(self, drain: int) -> bool:
        """Can a worker that answers its call back in the middle of the 1f1b-stash segment begun at
        the drain after `drain` steps be taken in at once (`readmit`)? When the state of that drain
        is held off the devices and the run re-plans."""
        return (self.faults.take_back and self.faults.on_failure == "replan" and self.plan_over is not None
                and self.snapshot is not None and self.snapshot.step == drain)

    def readmit(self, back: list[dict], step: int, start_step: int) -> Schedule:
        """Lost workers called back (`back`, their `here` reports) answered while step `step` of a
        1f1b-stash segment was under way. Only at a drain are the stages' weights one consistent
        state, and waiting for the next one could take a whole segment, so the segment is aborted on
        every stage and the run goes on from the drain it began at (`self.snapshot`, held off the
        devices): a `joined` event, re-planned with them when that is predicted faster, else on the
        same workers again; the steps since that drain are run again (no update lost or doubled:
        the run is one that switched plans at that drain) and the event says how many. Returns the
        schedule to go on with; the caller continues from `self.snapshot.step`."""
        drain = self.snapshot.step
        if self._open is not None and self._open["step"] > drain:
            self._open = None  # run again: reported when it is done again
        self._close_step()
        joined = [b["address"] for b in back]
        self.workers = [a for a in self.first_order if a in set(self.workers) | set(joined)]
        try:
            self.coordinator.abort(step, WorkerLost({}))
        except WorkerLost:
            for b in back:  # a loss meanwhile: its recovery plans over them (self.workers)
                self.event("joined", step=step, device=self.device_of.get(b["address"], b["address"]),
                           address=b["address"], taken_in=False, reason="a stage was lost meanwhile: the recovery "
                           "plans over the workers that are back")
            raise
        snap = self._spooled(self.held.restorable([])) if self.held is not None else self.snapshot
        plan, reason = None, ""
        try:
            plan = self.plan_over(drain, snap, list(self.result.addresses), list(self.workers))
        except ValueError as exc:  # planner.partition.PlanDoesNotFit among them
            reason = f"no plan with it fits: {exc}"
        if plan is None and not reason:
            reason = "the plan with it is predicted no faster"
        replayed = step - drain
        for b in back:
            self.event("joined", step=step, device=self.device_of.get(b["address"], b["address"]),
                       address=b["address"], taken_in=plan is not None, reason=reason or "re-planned with it",
                       from_step=drain, steps_replayed=replayed,
                       **{k: b[k] for k in ("mem_available_bytes", "battery_percent") if b.get(k) is not None})
        names = [self.device_of.get(a, a) for a in joined]
        if plan is not None:
            plan = self._switch(drain, plan, snap, "joined", joined=names)
        else:  # the same stages again, from the drain's state (theirs ran on past it)
            current = list(self.result.addresses)
            same = (SurvivorPlan(list(self.result.ranges), current) if self.emit is not None
                    else self.plan_over(drain, snap, current + [a for a in joined if a not in current], current))
            plan = self._switch(drain, same, snap, "restored", joined=names)
        self._truncate(drain, start_step)
        return plan.schedule

    def _rescue(self, snap: Snapshot | None) -> Path | None:
        """Write the held state where a resume finds it (the checkpoint folder)."""
        if snap is None or self.checkpoint_dir is None:
            return None
        self.save(self.checkpoint_dir, snap.step, snap.per_stage, snap.ranges)
        return self.checkpoint_dir

    # --- schedules -------------------------------------------------------------------------------
    def stash(self, start_step: int, steps: int, plan: Schedule) -> None:
        """1f1b-stash: PipeDream never flushes, so a segment of k steps is one schedule over k x M
        micro-batches: the plan's one-step lists with their steady state unrolled (`plan.for_steps(k)`;
        the workers unroll their bundles' alike). Segments end
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
            schedule = plan.for_steps(stop - s)
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
                # a lost worker that answers its call back is taken in now, not at the drain that ends
                # the segment (up to STASH_SEGMENT_STEPS steps away; issue 32: within 5 s of a heal)
                if (len(arrived) - 1) // M < stop - s - 1 and self._may_readmit(s) and self.coordinator.calling_back():
                    back = self.coordinator.returned()
                    if back:
                        raise _Returned(back, len(arrived) // M)

            try:
                losses, done = self.coordinator.run(schedule, feeds, s, steps=stop - s, on_loss=on_loss)
            except WorkerLost as lost:
                finished = len(arrived) // M  # the steps whose losses all came before the loss was found
                plan = self.recover(lost, s + finished, s + finished < stop, start_step)
                s = self.snapshot.step
                continue
            except _Returned as ret:
                try:
                    plan = self.readmit(ret.back, s + ret.steps_done, start_step)
                except WorkerLost as lost:
                    plan = self.recover(lost, s + ret.steps_done, True, start_step)
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
                # waits for the holders' confirmations (issue 32: a loss right after a drain whose copy
                # was still on its way replayed two segments)
                snap = self.take_snapshot(s, confirmed=True) if self.keep_state else None
                ckpt = self.faults.checkpoint_every
                if self.checkpoint_dir is not None and ckpt and s % ckpt == 0:
                    snap = snap or self.take_snapshot(s)
                    self.save(self.checkpoint_dir, s, snap.per_stage, snap.ranges)
                    self.event("checkpoint", step=s, directory=str(self.checkpoint_dir))
                # a drain is a boundary like a flush schedule's: a lost device that answered the
                # call back joins here (the next segment runs the plan with it); one that answers
                # in the middle of a segment aborts it (`readmit`)
                moved, new_plan = self.take_in(s)
                if moved:
                    plan = new_plan
            except WorkerLost as lost:
                plan = self.recover(lost, s, False, start_step)
                s = self.snapshot.step
        self._close_step()

    def flush(self, start_step: int, steps: int, schedule: Schedule, replan_every: int | None,
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
                schedule = self.recover(lost, s, True, start_step)
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
                schedule = self.recover(lost, s, False, start_step)
                s, window, warm_up = self.snapshot.step, [], True
                continue
            if s < end:
                moved, new_schedule = self.take_in(s)
                if not moved and self.running_low:
                    moved, new_schedule = self.move_off(s)
                if moved:
                    schedule = new_schedule
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
            replanned = _replan(self.coordinator, on_replan, s, measured, address_of, self.result, fresh,
                                named=self.emit is None)
            reconf, new_schedule = replanned if replanned is not None else (None, None)
            if reconf is not None:
                window, warm_up = [], True
                self.result.replans.append((s, reconf))
                self.event("new_plan", step=s, cause="measured", old_ranges=[list(r) for r in reconf.old_ranges],
                           ranges=[list(r) for r in reconf.new_ranges], devices=self._devices(),
                           seconds=reconf.seconds, sent_bytes=reconf.sent_bytes, kept_bytes=reconf.kept_bytes)
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


def _contents(plan) -> tuple | None:
    """A new plan's bundles as parsed when it was loaded (None: the coordinator parses them)."""
    loaded = getattr(plan, "loaded", None)
    return None if loaded is None or not loaded.contents else loaded.contents


def _release(plan) -> None:
    """The new plan is shipped: its bytes and parsed bundles go."""
    loaded = getattr(plan, "loaded", None)
    if loaded is not None:
        loaded.release()


def _replan(coordinator: Coordinator, on_replan, step: int, measured: list[float], address_of: Mapping[str, str],
            result: PipelineResult, fresh: Snapshot | None = None, named: bool = True
            ) -> tuple[Reconfiguration, Schedule] | None:
    """A measured re-plan: the new plan from on_replan (the job's re-planner, planner.replan.PlanReplanner,
    for a plan folder and a plan made in memory alike), made from the weights gathered here (at most
    once) and set up; what moved, and the new plan's schedule. `named`: the plan's devices are named
    in the result (a plan folder's; train-pipeline's workers are reported by address)."""
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
    reconf = coordinator.reconfigure(placements, bundles=plan.bundles, devices=plan.devices, state=gathered[0],
                                     contents=_contents(plan))
    _release(plan)
    result.ranges = [tuple(r) for r in plan.ranges]
    if named:
        result.devices = list(plan.devices)
    result.addresses = [address_of[d] for d in plan.devices]
    return reconf, plan.schedule


def _after_training(coordinator: Coordinator, result: PipelineResult, after_training) -> None:
    """`after_training(coordinator)` into `result`, with the workers' peaks over it."""
    started = time.perf_counter()
    coordinator.eval_done = []
    result.after_training = after_training(coordinator)
    result.after_training_s = time.perf_counter() - started
    by_stage = dict(enumerate(result.addresses))
    for d in coordinator.eval_done:
        address, peak = by_stage.get(d.get("stage")), d.get("peak_rss_bytes")
        if address is not None and isinstance(peak, int):
            result.peak_rss_bytes[address] = max(peak, result.peak_rss_bytes.get(address, 0))


def run_session(coordinator: Coordinator, transport, plan: SurvivorPlan, config: PipelineConfig, steps: int,
                feeds_of_step: Callable[[int], Sequence[Mapping[str, np.ndarray]]], *, start_step: int = 0,
                on_step=None, faults: FaultPolicy = FaultPolicy(), plan_over=None, on_event=None,
                checkpoint_dir: Path | None = None, meta: dict | None = None,
                spare_devices: Mapping[str, str] | None = None, emit=None, replan_every: int | None = None,
                on_replan=None, on_replanned=None, after_training=None) -> PipelineResult:
    """Set the workers up with `plan` (its bundles, stage k on plan.addresses[k], running
    plan.schedule) and train `steps` steps from `start_step`; then `after_training(coordinator)`
    when given (an evaluation on the workers' trained weights: `Coordinator.forward_only`; its
    value is `result.after_training`, each worker's peak over it joins the result's); then stop the
    workers and close `transport`. `emit` is None for a plan folder's plan (its devices have names, which the result
    and events use) and the job's planner for a plan made in memory (workers are named by address).
    See jobs.train.pipeline.train_pipeline for the rest."""
    spare_devices = dict(spare_devices or {})
    named = emit is None
    devices = list(plan.devices) if named else None
    run = Session(coordinator, feeds_of_step, config, on_step,
                  PipelineResult([], [], [], [], {}, [], [tuple(r) for r in plan.ranges], devices=devices,
                                 addresses=list(plan.addresses)),
                  faults, plan_over, on_event, checkpoint_dir, meta, devices, spare_devices, emit)
    stopping = "the run ended"  # what the workers are told at the end (`stop_reason`)
    try:
        coordinator.setup_bundles(plan.bundles, plan.devices)
        _release(plan)  # shipped: the coordinator keeps no bundle bytes for the run
        schedule, plan = plan.schedule, dataclasses.replace(plan, bundles=None, loaded=None)
        run.result.setup_bytes, run.result.base_bytes_held = coordinator.setup_bytes, coordinator.base_bytes_held
        if config.schedule in ASYNC_SCHEDULES:
            run.stash(start_step, steps, schedule)
        else:
            address_of = {**dict(zip(plan.devices, plan.addresses)), **spare_devices}
            run.flush(start_step, steps, schedule, replan_every, address_of, on_replan, on_replanned)
        if run.final is None:  # no step to run
            run.collect_final(start_step)
        result = run.result
        result.checkpoint = run.final
        for tensors in result.checkpoint:
            result.weights.update({k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")})
        if checkpoint_dir is not None:
            run.save(checkpoint_dir, start_step + steps, result.checkpoint)
        if after_training is not None:
            _after_training(coordinator, result, after_training)
    except BaseException as exc:  # a lost run, Ctrl-C, any fault: what it did reaches the metrics document
        stopping = stop_reason(exc)
        run._close_step()
        exc.result = run.result  # its steps and events
        raise
    finally:
        run.close()
        coordinator.stop(stopping)
        transport.close()
    return result
