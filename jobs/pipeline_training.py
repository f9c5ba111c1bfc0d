"""Pipeline training: drive a coordinator over workers for a number of steps (`train_pipeline`, which
training from a plan uses too), and the `confidant train-pipeline` job around it.

Side effects live here (processes, sockets, files); the protocol is in runtime.pipeline.coordinator and
runtime.pipeline.worker, the schedules in planner.schedule.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.partition import even_ranges, ranges_at_cuts
from ir.plan import ASYNC_SCHEDULES, Schedule
from jobs.errors import JobError
from jobs.evaluation import eval_figures, score_weights
from jobs.lora import adapted
from jobs.metrics import DeviceFigures, TrainingMetrics, steps_from
from jobs.report import Reporter, Silent
from jobs.settings import PipelineSettings, TrainingSettings
from jobs.workers import LocalWorkers
from planner.onnx_import import load_model
from planner.replan import TimingReplanner
from planner.schedule import make_schedule
from runtime.pipeline.checkpoints import load_checkpoint, save_checkpoint
from runtime.pipeline.coordinator import Coordinator, PipelineConfig, Reconfiguration, StagePlacement, WorkerFailed
from runtime.pipeline.executor import busy_fraction
from runtime.procfs import peak_rss_bytes
from runtime.transport.wire import Transport
from tasks.ner import check_label_count, load_ner_data
from tasks.tokenize import make_batches, split_microbatches
from tasks.trainer import batch_feeds, pad_batch


@dataclass
class PipelineResult:
    losses: list[float]
    step_seconds: list[float]
    stage_busy: list[list[float]]
    stage_reports: list[list[dict]]
    weights: dict[str, np.ndarray]
    checkpoint: list[dict[str, np.ndarray]]
    ranges: list[tuple[int, int]]  # at the end (after any re-plan)
    replans: list[tuple[int, Reconfiguration]] = field(default_factory=list)  # (steps done before it, what moved)
    devices: list[str] | None = None  # with bundles: the device of each stage at the end


def stage_ranges(n_blocks: int, stages: int, cuts: Sequence[int] | None) -> list[tuple[int, int]]:
    if cuts:
        ranges = ranges_at_cuts(n_blocks, cuts)
        if len(ranges) != stages:
            raise ValueError(f"--cuts {','.join(map(str, cuts))} makes {len(ranges)} stages but there are {stages} workers")
        return ranges
    return even_ranges(n_blocks, stages)


def step_feeds(batches, step: int, micro_rows: int, microbatches: int, num_labels: int) -> list[dict[str, np.ndarray]]:
    """The graph inputs of every micro-batch of training step `step` (batches repeat in order)."""
    batch = pad_batch(batches[step % len(batches)], micro_rows * microbatches)
    return [batch_feeds(mb, num_labels, batch.n_labelled) for mb in split_microbatches(batch, microbatches)]


def _check_replanning(config: PipelineConfig, replan_every, on_replan, bundles, stage_graphs) -> None:
    if replan_every is None:
        return
    if not isinstance(replan_every, int) or replan_every < 1:
        raise ValueError(f"replan_every must be a whole number of steps >= 1, got {replan_every!r}")
    if on_replan is None:
        raise ValueError("replan_every needs on_replan, the function that chooses the new plan")
    if config.schedule == "1f1b-stash":
        raise ValueError("re-planning needs a flush schedule (1f1b-flush or gpipe): 1f1b-stash runs the whole "
                         "training as one schedule with weight versions in flight, so there is no step boundary "
                         "at which every stage holds the same weights")
    if bundles is None and stage_graphs is not None:
        raise ValueError("re-planning from graph slices without their bundles is not possible: give the bundles "
                         "(the new plan comes as bundles) or the whole model graph")


def train_pipeline(graph, batches, num_labels: int, addresses: Sequence[str], config: PipelineConfig, steps: int,
                   cuts: Sequence[int] | None = None, update_every: int = 1, start_step: int = 0,
                   weights=None, optimizer_state=None, listen: str = "tcp://127.0.0.1:0", on_step=None,
                   checkpoint_dir: Path | None = None, meta: dict | None = None,
                   bundles: Sequence[Path] | None = None, devices: Sequence[str] | None = None,
                   stage_graphs=None, replan_every: int | None = None, on_replan=None,
                   spare_devices: Mapping[str, str] | None = None, on_replanned=None,
                   schedule: Schedule | None = None, transport: Transport | None = None) -> PipelineResult:
    """Train `steps` batches across the workers at `addresses`; stage k runs on addresses[k].
    With `bundles` (one plan bundle per stage, of `devices`) the workers get verified bundles
    instead of graph slices, and the block ranges are the bundles'; `schedule` is then the plan's
    (flush schedules run it every step; without it the schedule is built from `config`).
    `transport` is the coordinator's (default: ZeroMQ at `listen`; tests pass an in-process one).

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
      `spare_devices` (device name -> address of a worker that waits without a stage), in any order."""
    _check_replanning(config, replan_every, on_replan, bundles, stage_graphs)
    if stage_graphs is not None:
        ranges = [(b.first_block, b.last_block) for b in stage_graphs]
        stage_graphs = [b.graph for b in stage_graphs]
        graph = stage_graphs[0]
    else:
        ranges = stage_ranges(len(graph.blocks), len(addresses), cuts)
    placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(ranges, addresses))]
    spare_devices = dict(spare_devices or {})
    if transport is None:
        from runtime.transport.zeromq import ZmqTransport

        transport = ZmqTransport("coordinator", listen, accept=())
    coordinator = Coordinator(graph, placements, config, transport, weights=weights, optimizer_state=optimizer_state,
                              stage_graphs=stage_graphs, spares=list(spare_devices.values()))
    run = _Run(coordinator, batches, num_labels, graph.batch, config, on_step,
               PipelineResult([], [], [], [], {}, [], ranges, devices=list(devices) if devices is not None else None))
    try:
        if bundles is not None:
            coordinator.setup_bundles(bundles, devices)
        else:
            coordinator.setup()
        if config.schedule in ASYNC_SCHEDULES:
            run.stash(start_step, steps, update_every)
        else:
            address_of = {**dict(zip(devices or (), addresses)), **spare_devices}
            if schedule is None:
                schedule = make_schedule(config.schedule, len(placements), config.microbatches)
            run.flush(start_step, steps, schedule, replan_every, bundles is not None, addresses, address_of,
                      on_replan, on_replanned)
        result = run.result
        result.checkpoint = coordinator.collect_checkpoint()
        for tensors in result.checkpoint:
            result.weights.update({k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")})
        if checkpoint_dir is not None:
            save_checkpoint(checkpoint_dir, result.checkpoint,
                            {**(meta or {}), "stages": coordinator.stages, "ranges": result.ranges,
                             "step": start_step + steps, "schedule": config.schedule,
                             "microbatches": config.microbatches, "losses": result.losses})
    finally:
        coordinator.stop()
        transport.close()
    return result


class _Run:
    """One training run's steps on a set-up coordinator, recorded into `result`."""

    def __init__(self, coordinator: Coordinator, batches, num_labels: int, micro_rows: int, config: PipelineConfig,
                 on_step, result: PipelineResult):
        self.coordinator, self.batches, self.num_labels = coordinator, batches, num_labels
        self.micro_rows, self.M, self.config, self.on_step, self.result = (micro_rows, config.microbatches, config,
                                                                           on_step, result)

    def feeds(self, step: int):
        return step_feeds(self.batches, step, self.micro_rows, self.M, self.num_labels)

    def _record(self, step: int, loss: float, seconds: float, done: list[dict]) -> None:
        self.result.losses.append(loss)
        self.result.step_seconds.append(seconds)
        if self.on_step:
            self.on_step(step, loss, seconds, [d["seconds"] for d in done], done)

    def _reports(self, done: list[dict]) -> None:
        self.result.stage_reports.append(done)
        self.result.stage_busy.append([busy_fraction(d["seconds"], d.get("wall_s", 0.0)) for d in done])

    def stash(self, start_step: int, steps: int, update_every: int) -> None:
        """1f1b-stash: the whole run is one schedule over steps x M micro-batches (PipeDream never
        flushes), whose actions go to the workers with the run, bundles or not."""
        M = self.M
        schedule = make_schedule("1f1b-stash", self.coordinator.stages, steps * M, update_every=update_every)
        feeds = [f for s in range(start_step, start_step + steps) for f in self.feeds(s)]
        start = time.perf_counter()
        losses, done = self.coordinator.run(schedule, feeds, start_step, send_actions=True)
        total = time.perf_counter() - start
        for i in range(steps):
            self._record(start_step + i + 1, float(sum(losses[i * M:(i + 1) * M])), total / steps, done)
        self._reports(done)

    def flush(self, start_step: int, steps: int, schedule: Schedule, replan_every: int | None, from_bundles: bool,
              addresses: Sequence[str], address_of: Mapping[str, str], on_replan, on_replanned) -> None:
        """Flush schedules: one schedule per step, and a re-plan check every `replan_every` steps."""
        # per step since the last re-plan check: F+B seconds per stage, and whether that step was
        # the first after a setup, which builds the engines' graphs and caches: not steady state,
        # so it is left out whenever later steps were measured
        window: list[list[float]] = []
        warm_up = True
        for s in range(start_step, start_step + steps):
            start = time.perf_counter()
            losses, done = self.coordinator.run(schedule, self.feeds(s), s)
            self._record(s + 1, float(sum(losses)), time.perf_counter() - start, done)
            self._reports(done)
            window.append([d["seconds"].get("F", 0.0) + d["seconds"].get("B", 0.0) for d in done])
            if warm_up and len(window) > 1:
                window.pop(0)
                warm_up = False
            if not (replan_every and (s + 1 - start_step) % replan_every == 0 and s + 1 < start_step + steps):
                continue
            measured = [sum(col) / len(window) for col in zip(*window)]
            window, warm_up = [], False
            if from_bundles:
                replanned = _replan_bundles(self.coordinator, on_replan, s + 1, measured, address_of, self.result)
                reconf, new_schedule = replanned if replanned is not None else (None, None)
            else:
                reconf = _replan_ranges(self.coordinator, on_replan, s + 1, measured, addresses, self.result)
                new_schedule = None if reconf is None else make_schedule(self.config.schedule,
                                                                         self.coordinator.stages, self.M)
            if reconf is not None:
                window, warm_up = [], True
                self.result.replans.append((s + 1, reconf))
                schedule = new_schedule
                if on_replanned:
                    on_replanned(s + 1, reconf)


def _replan_ranges(coordinator: Coordinator, on_replan, step: int, measured: list[float], addresses: Sequence[str],
                   result: PipelineResult) -> Reconfiguration | None:
    """Graph slices: new block ranges from on_replan, stage k on addresses[k]."""
    new_ranges = on_replan(step, measured)
    if new_ranges is None or [tuple(r) for r in new_ranges] == result.ranges:
        return None
    if not 1 <= len(new_ranges) <= len(addresses):
        raise ValueError(f"on_replan returned {len(new_ranges)} stages for {len(addresses)} workers")
    result.ranges = [tuple(r) for r in new_ranges]
    return coordinator.reconfigure([StagePlacement(k, a, b, addr)
                                    for k, ((a, b), addr) in enumerate(zip(result.ranges, addresses))])


def _replan_bundles(coordinator: Coordinator, on_replan, step: int, measured: list[float],
                    address_of: Mapping[str, str], result: PipelineResult
                    ) -> tuple[Reconfiguration, Schedule] | None:
    """Bundles: a new plan from on_replan, written from the weights gathered here (at most once);
    what moved, and the new plan's schedule."""
    gathered = []

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
    return reconf, plan.schedule


# --- the `confidant train-pipeline` job -----------------------------------------------------------

def train_pipeline_job(model: Path, data: Path, eval_path: Path | None, training: TrainingSettings,
                       pipeline: PipelineSettings, workers: Sequence[str] | None = None, local: int | None = None,
                       reporter: Reporter = Silent()) -> TrainingMetrics:
    """Cut `model` into one stage per worker (at `pipeline.cuts`, else evenly) and train it with the
    pipeline's schedule on the workers at `workers`, or on `local` worker processes started here.
    Everything that can be refused is checked before any worker starts."""
    training.check()
    pipeline.check(training.batch)
    M = pipeline.microbatches
    n_stages = len(workers) if workers else (local or 0)
    if n_stages < 1:
        raise JobError("need at least one worker (--workers ADDRESSES or --local N)")
    ner = load_ner_data(data, eval_path, training.seq, training.tokenizer)
    graph = adapted(load_model(model, training.batch // M, training.seq), training.lora, reporter)
    check_label_count(model, graph.values[graph.blocks[-2].output].shape[-1], ner.labels)
    cuts = list(pipeline.cuts) if pipeline.cuts else None
    meta = {"model": Path(model).name, "schedule": pipeline.schedule, "microbatches": M, "batch": training.batch,
            "seq": training.seq, "optimizer": training.optimizer, "lr": training.lr, "seed": training.seed,
            "cuts": cuts, "model_path": str(Path(model).resolve()),
            "lora": None if training.lora is None else asdict(training.lora)}
    start_step, weights, opt_state = 0, None, None
    if pipeline.resume:
        start_step, weights, opt_state, cuts = _resumed(pipeline.resume, meta, n_stages)
        reporter.note(f"resuming from {pipeline.resume} at step {start_step}")
    try:
        ranges = stage_ranges(len(graph.blocks), n_stages, cuts)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    batches = make_batches(ner.train_encoded, training.batch, training.seq, seed=training.seed)
    config = PipelineConfig(schedule=pipeline.schedule, microbatches=M, engine=training.engine,
                            threads=training.threads, optimizer=training.optimizer, lr=training.lr,
                            timeout_s=pipeline.timeout_s)
    replanner = None
    if pipeline.replan_every is not None:
        replanner = TimingReplanner(graph, ranges, pipeline.schedule, M, training.optimizer,
                                    pipeline.replan_threshold)
    reporter.start(f"train ({n_stages} stages, {pipeline.schedule}, {M} micro-batches)", training.steps)

    def on_step(step, loss, seconds, stage_seconds, done):
        busy = "/".join(f"{busy_fraction(d['seconds'], d.get('wall_s', 0.0)):.0%}" for d in done)
        reporter.step(step - start_step, loss=loss, **{"samples/s": training.batch / seconds, "busy": busy})

    started = LocalWorkers.start(local, training.threads) if local else None
    failed = True
    try:
        result = train_pipeline(graph, batches, len(ner.labels), started.addresses if started else list(workers),
                                config, training.steps, cuts=cuts, update_every=pipeline.update_every,
                                start_step=start_step, weights=weights, optimizer_state=opt_state,
                                listen=pipeline.listen, on_step=on_step, checkpoint_dir=pipeline.checkpoint, meta=meta,
                                replan_every=pipeline.replan_every, on_replan=replanner)
        failed = False
    except WorkerFailed as exc:
        raise JobError(str(exc)) from None
    finally:
        if started:
            codes = started.finish(failed)
            if any(codes) and not failed:
                reporter.note(f"local workers exited with codes {codes}")
    stage_rss = [max(rep[k]["peak_rss_bytes"] for rep in result.stage_reports) for k in range(len(result.ranges))]
    reporter.note("per stage: " + "; ".join(f"stage {k} blocks {a}-{b} peak RSS {rss / 2**20:.0f} MiB"
                                            for k, ((a, b), rss) in enumerate(zip(result.ranges, stage_rss))))
    replans = tuple({"step": step, "old_ranges": r.old_ranges, "new_ranges": r.new_ranges,
                     "moved_bytes": r.moved_bytes, "seconds": r.seconds} for step, r in result.replans)
    if replanner is not None:
        for step, decision in replanner.decisions:
            reporter.note(f"after step {step}: {decision.reason}")
    figures = None
    if ner.dev:
        full = adapted(load_model(model, training.batch, training.seq), training.lora)
        scores = score_weights(full, result.weights, ner, training.batch, training.threads)
        figures = eval_figures(scores)
        reporter.note(f"entity F1 after pipeline training: {scores.f1:.4f}")
    return TrainingMetrics(
        "train-pipeline", str(model), training.batch, training.seq,
        steps_from(result.losses, result.step_seconds, training.batch, start_step + 1),
        tuple(DeviceFigures(f"stage{k}", k, a, b, rss) for k, ((a, b), rss) in enumerate(zip(result.ranges, stage_rss))),
        microbatches=M, schedule=pipeline.schedule, eval=figures, coordinator_peak_rss_bytes=peak_rss_bytes(),
        replans=replans, settings={**asdict(training), **asdict(pipeline)})


def _resumed(folder: Path, meta: dict, n_stages: int):
    """(the step to continue from, weights, optimizer state per stage, the cuts) of a checkpoint,
    once it is one of this run's (same model, schedule, shape, optimizer, seed, stage count)."""
    saved, weights, opt_state = load_checkpoint(folder)
    for key in ("model", "schedule", "microbatches", "batch", "seq", "optimizer", "seed", "lora"):
        # as JSON reads it back (tuples become lists)
        if saved.get(key) != json.loads(json.dumps(meta[key])):
            raise JobError(f"--resume {folder}: checkpoint has {key}={saved.get(key)!r}, this run {meta[key]!r}")
    if saved["stages"] != n_stages:
        raise JobError(f"--resume {folder}: checkpoint has {saved['stages']} stages, this run {n_stages}")
    return int(saved["step"]), weights, opt_state, [r[0] for r in saved["ranges"][1:]]
