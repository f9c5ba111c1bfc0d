"""Pipeline training: a plan's run over workers for a number of steps (`train_pipeline`, which training
from a plan uses too; with a whole model graph it makes the plan in memory, `PlanInMemory`), and the
`confidant train-pipeline` job around it.

Side effects live here (processes, sockets, files); the run controller (snapshots, recovery, fault
policy, result) is runtime.pipeline.session, the protocol runtime.pipeline.coordinator and
runtime.pipeline.worker, the schedules planner.schedule.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.bundle import load_bundle_dir, schedule_of_bundles
from ir.graph import tied_parameters
from ir.partition import even_ranges, ranges_at_cuts
from ir.plan import ASYNC_SCHEDULES, Schedule
from ir.training import TRAINING
from jobs.common.errors import FlagError, JobError
from jobs.common.memory_check import check_memory, default_planned_bytes
from jobs.train.pipeline_run import describe_event, progress, run_on_workers
from jobs.train.pipeline_tasks import pipeline_task, step_feeds
from jobs.common.metrics import DeviceFigures, TrainingMetrics, steps_from
from jobs.common.report import Reporter, Silent
from jobs.common.settings import PipelineSettings, TrainingSettings
from jobs.common.workers import LocalWorkers, coordinator_pair, parse_workers
from planner.cost import check_tied_schedule
from planner.schedule import make_schedule
from runtime.keys import ClusterKeys
from runtime.pipeline.checkpoints import check_checkpoint_target, check_tensors_fit, load_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement
from runtime.pipeline.session import (AUTO_SNAPSHOTS, FAILURE_POLICIES, REPLAY_BUDGET_S, SNAPSHOT_SHARE,  # noqa: F401
                                      STASH_SEGMENT_STEPS, FaultPolicy, PipelineResult, RecoveryImpossible, Snapshot,
                                      SurvivorPlan, run_session, snapshot_interval)
from runtime.pipeline.snapshots import peer_snapshot_bytes
from runtime.procfs import peak_rss_bytes
from runtime.transport.wire import Transport


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
        raise ValueError("stage graphs without their bundles: give the plan's bundles, or the whole model graph "
                         "(a plan is then emitted from it)")


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
                   plan_over=None, on_event=None, feeds_of_step=None, base=None,
                   per_stage: Sequence[StageChoice | None] | None = None,
                   in_memory: "PlanInMemory | None" = None, after_training=None) -> PipelineResult:
    """Train `steps` batches across the workers at `addresses`; stage k runs on addresses[k].
    Every run is a plan (issue 34): the workers get verified bundles and run their actions, and
    nothing is scheduled at run time. With `bundles` (one plan bundle per stage, of `devices`; a
    plan folder's, with their contents as `stage_graphs`) the block ranges and schedule are the
    plan's; without, `graph` is cut evenly or at `cuts` and emitted in memory with `config`'s
    schedule, engine, optimizer and activation choice, and what `per_stage` (a StageChoice per
    stage, or None) gives its stage's device (`PlanInMemory`).
    `transport` is the coordinator's (default: ZeroMQ at `listen`, secured with `keys`, or
    plaintext with `insecure`; tests pass an in-process one).

    Re-planning (flush schedules): every `replan_every` steps, between two steps, `on_replan` is
    called with the number of steps done so far and, per stage, its measured forward+backward
    seconds per step averaged since the last call; the coordinator then moves weights and
    optimizer state at this flush boundary, so training continues as if the new plan had been used
    from that step, and `on_replanned(step, Reconfiguration)` hears what moved.
    The first step after a setup (engines build their graphs and caches) is left out of the
    measured average whenever later steps were measured.
    `on_replan(step, measured, weights)` gets a third argument, a function that gathers the current
    parameters by name from the workers (once, at this boundary), and returns None or the new plan
    (planner.replan.ReplannedPlan: `devices`, `ranges`, `bundles`, `schedule`, made with those
    weights): one re-planner for both kinds of run (planner.replan.PlanReplanner). From bundles its
    devices may be any of `devices` and `spare_devices` (device name -> address of a worker that
    waits without a stage), in any order; from `graph`, the plan is made in memory by `in_memory`
    (a PlanInMemory over these workers, made here when not given), whose `measured_replans()` is the
    re-planner's on_replan, its devices named after the workers ("worker<k>").

    Lost devices (`faults`): the coordinator holds every stage's state from the last snapshot
    (every `faults.snapshot_every` steps); when a worker is lost mid-run the step is aborted on
    the survivors, `plan_over(step, snapshot, stages, candidates)` returns a SurvivorPlan over
    `candidates` (the live workers, in the run's first order) for the pipeline whose stages run
    on `stages` (default from `graph`: the planner's best cuts, in that order, emitted in memory;
    with bundles the caller must give one, e.g. planner.replan.PlanReplanner.without), the survivors are set
    up with the held state, and training goes on from the snapshot's step: no update is lost or
    applied twice. The same function moves off devices running low (candidates without them) and
    takes back devices that return (candidates with them; it may return None: no better plan).
    Every event (lost, recovered, steps replayed, new plan, joined, memory or battery low) goes
    to `on_event(dict)` and `result.events`.

    `base` (runtime.pipeline.bundles.BaseWeights, from bundles): the plan's base weights file; a
    worker holding it builds its stage's frozen weights from it instead of receiving them.

    The graph inputs of step k are NER `batches` (`step_feeds`, with `num_labels`), or
    `feeds_of_step(k)` (a list of one feed dict per micro-batch: a causal LM's, tasks.causal_lm.data).

    `after_training(coordinator)`: called once the last step's state is collected, before the workers
    stop (an evaluation on their trained weights, `Coordinator.forward_only`); its value is
    `result.after_training`."""
    _check_replanning(config, replan_every, on_replan, bundles, stage_graphs)
    faults.check()
    if checkpoint_dir is not None:  # before any step: a path no checkpoint can be written to loses the run
        check_checkpoint_target(checkpoint_dir)
    spare_devices = dict(spare_devices or {})
    if bundles is None:  # every run is a plan: the whole graph's, cut evenly or at `cuts`, emitted in memory
        ranges = stage_ranges(len(graph.blocks), len(addresses), cuts)
        if config.schedule in ASYNC_SCHEDULES:  # refused before anything is emitted
            _check_steady(make_schedule(config.schedule, len(ranges), config.microbatches, update_every), steps)
        if in_memory is None:
            in_memory = PlanInMemory(graph, config, update_every, list(addresses) + list(spare_devices.values()),
                                     sign=None if keys is None else _signer(keys), per_stage=per_stage)
        first = in_memory(ranges, list(addresses), weights)
        bundles, schedule = first.bundles, first.schedule
        stage_devices, stage_graphs = first.devices, [graph] * len(ranges)
        if plan_over is None:
            plan_over = _flops_plan_over(graph, config, update_every)
    else:  # a plan folder's bundles (train PLAN), loaded and verified by the caller or here
        in_memory = None
        contents = list(stage_graphs) if stage_graphs is not None else [load_bundle_dir(b) for b in bundles]
        ranges = [(c.first_block, c.last_block) for c in contents]
        stage_graphs = [c.graph for c in contents]
        stage_devices = devices
        if schedule is None:
            schedule = schedule_of_bundles(contents)
    _check_steady(schedule, steps)
    placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(ranges, addresses))]
    if transport is None:
        transport = coordinator_transport(listen, keys, insecure, faults.detect_s)
    try:
        coordinator = Coordinator(placements, config, transport, stage_graphs, optimizer_state=optimizer_state,
                                  spares=list(spare_devices.values()),
                                  worker_keys=None if keys is None else keys.workers, base=base)
    except BaseException:
        transport.close()
        raise
    if feeds_of_step is None:
        feeds_of_step = lambda k: step_feeds(batches, k, stage_graphs[0].batch, config.microbatches,  # noqa: E731
                                             num_labels)
    plan = SurvivorPlan(ranges, list(addresses), list(bundles), list(stage_devices), schedule)
    del bundles  # shipped by the session, which lets them go
    return run_session(coordinator, transport, plan, config, steps, feeds_of_step, start_step=start_step,
                       on_step=on_step, faults=faults, plan_over=plan_over, on_event=on_event,
                       checkpoint_dir=checkpoint_dir, meta=meta, spare_devices=spare_devices, emit=in_memory,
                       replan_every=replan_every, on_replan=on_replan, on_replanned=on_replanned,
                       after_training=after_training)


@dataclass(frozen=True)
class StageChoice:
    """What one stage's device runs in a plan made in memory, beside PipelineConfig's settings for
    all: its engine, its attention heads split across backends ({backend: heads}; MNN stages, flush
    schedules), its activation choice ("keep" or "recompute"). None: PipelineConfig's."""

    engine: str | None = None
    head_split: Mapping[str, int] | None = None
    activations: str | None = None


def _check_steady(schedule: Schedule, steps: int) -> None:
    """A ValueError when an asynchronous schedule cannot run `steps` steps from its lists (no steady state)."""
    from planner.compile import steady_state_refusal

    refusal = steady_state_refusal(schedule, steps)
    if refusal is not None:
        raise ValueError(refusal)


class PlanInMemory:
    """train-pipeline's plans (issue 34: every run is a plan): block ranges over workers, emitted as
    bundles in memory (planner.emit.emit_in_memory: built, verified, signed with `sign`, never
    written) with the schedule they carry, so the workers run a verified plan exactly as from a plan
    folder. Each worker is a device named after its first position ("worker<k>", stages then spares)
    and keeps what its first stage was given (`per_stage[k]`, a StageChoice: a device's engine, head
    split and activation choice, not a position's); workers new to the pipeline run `config`'s.

    Its measured re-plans are the one re-planner's (`replanner`: planner.replan.PlanReplanner over
    the plan in use, the workers in their order, FLOPs-priced profiles recalibrated from what each
    stage measured), emitted here in memory."""

    def __init__(self, graph, config: PipelineConfig, update_every: int, workers: Sequence[str], sign=None,
                 per_stage: Sequence[StageChoice | None] | None = None):
        self.graph, self.config, self.sign = graph, config, sign
        self.update_every = update_every if config.schedule in ASYNC_SCHEDULES else 1
        self.names = {a: f"worker{k}" for k, a in enumerate(dict.fromkeys(workers))}
        self.choice = {a: c for a, c in zip(workers, per_stage or ()) if c is not None}
        self.first = None  # the first plan's document (ir.documents.PlanDocument), once emitted
        self._replanner = None

    def name_of(self, address: str) -> str:
        if address not in self.names:
            self.names[address] = f"worker{len(self.names)}"
        return self.names[address]

    def __call__(self, ranges: Sequence[tuple[int, int]], addresses: Sequence[str],
                 weights: Mapping[str, np.ndarray] | None = None) -> SurvivorPlan:
        """The plan of stage k running ranges[k] on addresses[k], from `weights` (default: the graph's)."""
        from planner.replan import partition_of

        devices = [self.name_of(a) for a in addresses]
        loaded = self.emit(partition_of([tuple(r) for r in ranges], devices), None, weights)
        if self.first is None:
            self.first = loaded.plan
            loaded.contents = ()  # the run's first setup parses nothing: the graph is at hand
        elif self._replanner is not None:  # the run switched plans by itself (a loss, a device back)
            self._replanner.follow(devices, ranges)
        return SurvivorPlan([tuple(r) for r in ranges], list(addresses), list(loaded.files), devices, loaded.schedule,
                            loaded=loaded)

    def emit(self, partition, cluster=None, weights: Mapping[str, np.ndarray] | None = None):
        """The plan of `partition` (devices named as `name_of` names workers) emitted in memory from
        `weights`, as ir.bundle.LoadedPlan (verified once); `cluster` is not consulted: each worker
        runs what it was given."""
        from ir.partition import Partition, StageAssignment
        from planner.emit import emit_in_memory

        address_of = {n: a for a, n in self.names.items()}
        devices = list(partition.devices)
        choices = [self.choice.get(address_of.get(d), StageChoice()) for d in devices]
        graph = self.graph
        if weights:
            graph = replace(graph, constants={**graph.constants, **weights})
        schedule = make_schedule(self.config.schedule, len(devices), self.config.microbatches, self.update_every)
        partition = Partition(tuple(StageAssignment(k, d, st.first_block, st.last_block)
                                    for k, (d, st) in enumerate(zip(devices, partition.stages))), "manual")
        config = {"model": graph.name, "threads": self.config.threads, "optimizer": self.config.optimizer,
                  "lr": self.config.lr, "weight_decay": self.config.weight_decay,
                  "engine": {d: c.engine or self.config.engine for d, c in zip(devices, choices)},
                  "head_split": {d: {"heads": {str(b): int(h) for b, h in c.head_split.items()}}
                                 for d, c in zip(devices, choices) if c.head_split},
                  "activations": {d: c.activations or self.config.activations for d, c in zip(devices, choices)
                                  if c.activations or self.config.activations}}
        # deferred: each stage's weights file is put together as it is shipped, one stage at a time
        return emit_in_memory(graph, partition, schedule, config, sign=self.sign, with_base=False,
                              deferred=True).loaded()

    def replanner(self, threshold: float = TRAINING.replan_threshold):
        """The one re-planner (planner.replan.PlanReplanner) over the plan in use, made on first use
        (after the first plan): the workers in their order (`keep_order`: they are not named devices),
        each a device with FLOPs-only profiles (planner.replan.flops_cluster) that its measured
        forward+backward seconds recalibrate; its new plans emitted here, in memory."""
        from planner.replan import PlanReplanner, flops_cluster

        if self._replanner is None:
            if self.first is None:
                raise ValueError("no plan has been emitted yet to re-plan")
            self._replanner = PlanReplanner(None, self.first, self.graph, flops_cluster(self.graph, list(self.names.values())),
                                            threshold, keep_order=True, emit=self.emit)
        return self._replanner

    def measured_replans(self, threshold: float = TRAINING.replan_threshold):
        """train_pipeline's on_replan: `replanner(threshold)`'s, made once the first plan is."""
        def on_replan(step, measured, weights):
            return self.replanner(threshold)(step, measured, weights)

        return on_replan


def _signer(keys: ClusterKeys):
    from runtime.keys import signer

    return signer(keys.coordinator)


def _flops_plan_over(graph, config: PipelineConfig, update_every: int = 1):
    """plan_over of a plan emitted in memory (`Session._switch` emits the bundles): the planner's best
    cuts over the candidates, in their order (FLOPs-priced, as the re-planner starts out, with the
    run's update after every `update_every` backwards): planner.replan.replan_without when stages
    left, replan_with when workers came back (None unless that is predicted faster)."""
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


# --- the `confidant train-pipeline` job -----------------------------------------------------------

def train_pipeline_job(model: Path, data: Path, eval_path: Path | None, training: TrainingSettings,
                       pipeline: PipelineSettings, workers: Sequence[str] | None = None, local: int | None = None,
                       reporter: Reporter = Silent(), task: str = "ner") -> TrainingMetrics:
    """Cut `model` into one stage per worker (at `pipeline.cuts`, else evenly) and train it with the
    pipeline's schedule on the workers at `workers`, or on `local` worker processes started here;
    `task` is ner, seq-cls or causal-lm (jobs.train.pipeline_tasks). Everything that can be refused is
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
    if pipeline.schedule in ASYNC_SCHEDULES:  # refused before any worker starts: the fix is a flag
        try:
            _check_steady(make_schedule(pipeline.schedule, len(ranges), M, pipeline.update_every), training.steps)
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    tied = tied_parameters(graph, ranges)
    if tied:
        reporter.note(f"{len(tied)} weight(s) held by several stages ({', '.join(sorted(tied)[:3])}): their "
                      f"gradients are summed through the coordinator before every update")
    # one activation choice for all stages, or one per stage (each stage's device's, as a plan gives them)
    per_stage = None
    if isinstance(pipeline.activations, tuple):
        per_stage = tuple(StageChoice(activations=a) for a in pipeline.activations)
    config = PipelineConfig(schedule=pipeline.schedule, microbatches=M, engine=training.engine,
                            threads=training.threads, optimizer=training.optimizer, lr=training.lr,
                            timeout_s=pipeline.timeout_s, activations=None if per_stage else pipeline.activations)
    made: list[PlanInMemory] = []  # the run's plans in memory, whose re-planner's decisions are reported
    faults = FaultPolicy(pipeline.on_failure, pipeline.failure_timeout_s, AUTO_SNAPSHOTS, pipeline.checkpoint_every,
                         state_on="peers")
    addresses, keys = (None, None) if local else parse_workers(workers, pipeline.keys, pipeline.insecure)
    reporter.start(f"train ({n_stages} stages, {pipeline.schedule}, {M} micro-batches)", training.steps)

    def on_event(event):
        reporter.note(describe_event(event))

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

    def run() -> PipelineResult:
        in_memory = PlanInMemory(graph, config, pipeline.update_every, addresses,
                                 sign=None if keys is None else _signer(keys), per_stage=per_stage)
        made.append(in_memory)
        on_replan = None if pipeline.replan_every is None else in_memory.measured_replans(pipeline.replan_threshold)
        return train_pipeline(
            graph, None, len(run_task.labels), addresses, config, training.steps, cuts=cuts,
            update_every=pipeline.update_every, start_step=start_step, weights=weights, optimizer_state=opt_state,
            listen=pipeline.listen, on_step=progress(reporter, training.batch, start_step),
            checkpoint_dir=pipeline.checkpoint, meta=meta, replan_every=pipeline.replan_every, on_replan=on_replan,
            keys=keys, insecure=pipeline.insecure, faults=faults, on_event=on_event,
            feeds_of_step=run_task.feeds_of_step, in_memory=in_memory, after_training=run_task.evaluate_on_stages)

    result = run_on_workers(run, metrics_of, started, reporter)
    stage_rss = [result.peak_rss_bytes.get(a) for a in result.addresses]
    reporter.note("per stage: " + "; ".join(f"stage {k} blocks {a}-{b} peak RSS {(rss or 0) / 2**20:.0f} MiB"
                                            for k, ((a, b), rss) in enumerate(zip(result.ranges, stage_rss))))
    replans = tuple({"step": step, "old_ranges": r.old_ranges, "new_ranges": r.new_ranges,
                     "moved_bytes": r.moved_bytes, "seconds": r.seconds} for step, r in result.replans)
    if pipeline.replan_every is not None and made and made[0]._replanner is not None:
        for step, decision in made[0]._replanner.decisions:
            reporter.note(f"after step {step}: {decision.reason}")
    if run_task.evaluate_on_stages is not None:  # evaluated on the workers before they stopped
        figures = result.after_training
        if figures is not None:
            reporter.note(f"evaluated on the workers in {result.after_training_s:.1f} s")
    else:
        figures = run_task.evaluate(result.weights)
    if figures is not None:
        reporter.note(f"{run_task.headline(figures)} after pipeline training")
    metrics = metrics_of(result, figures, replans)
    # the LM head + loss charged for the most loss targets a micro-batch of this run has, as `plan --data` does
    from jobs.train.pipeline_tasks import task_target_positions

    targets = task_target_positions(run_task, training.steps)
    charged = replace(graph, target_positions=targets) if targets is not None else graph
    planned = default_planned_bytes(charged, result.ranges, pipeline.schedule, M, training.optimizer,
                                    pipeline.update_every, training.engine, pipeline.activations,
                                    training.lora.base_dtype if training.lora is not None else "float32")
    # the run keeps its snapshot copies on the workers (`faults.state_on`): what they hold of them is
    # charged beside the memory model's figure, as a plan's reserve is
    copies = peer_snapshot_bytes([0] * len(planned))
    return check_memory(metrics, {f"stage{k}": b + c for k, (b, c) in enumerate(zip(planned, copies))}, {}, reporter,
                        "the memory model + snapshot copies", over_plan=False)


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
