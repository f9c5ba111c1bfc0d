"""`confidant train-pipeline` and `confidant worker`: start or reach workers, drive a coordinator.

Side effects live here (processes, sockets, files); the protocol is in runtime.pipeline.coordinator and
runtime.pipeline.worker, the schedules in planner.schedule.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from planner.schedule import make_schedule
from runtime.pipeline.coordinator import (Coordinator, PipelineConfig, Reconfiguration, StagePlacement, load_checkpoint,
                                 save_checkpoint, split_at, split_even)
from runtime.procfs import peak_rss_bytes
from tasks.trainer import batch_feeds, pad_batch
from tasks.tokenize import split_microbatches


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
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        self.wait(10.0)


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
        ranges = split_at(n_blocks, cuts)
        if len(ranges) != stages:
            raise ValueError(f"--cuts {','.join(map(str, cuts))} makes {len(ranges)} stages but there are {stages} workers")
        return ranges
    return split_even(n_blocks, stages)


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
                   spare_devices: Mapping[str, str] | None = None, on_replanned=None) -> PipelineResult:
    """Train `steps` batches across the workers at `addresses`; stage k runs on addresses[k].
    With `bundles` (one plan bundle per stage, of `devices`) the workers get verified bundles
    instead of graph slices, and the block ranges are the bundles'.

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
      written with those weights). Its devices may be any of `devices` and `spare_devices`
      (device name -> address of a worker that waits without a stage), in any order."""
    from runtime.transport.zeromq import ZmqTransport

    _check_replanning(config, replan_every, on_replan, bundles, stage_graphs)
    if stage_graphs is not None:
        ranges = [(b.first_block, b.last_block) for b in stage_graphs]
        stage_graphs = [b.graph for b in stage_graphs]
        graph = stage_graphs[0]
    else:
        ranges = stage_ranges(len(graph.blocks), len(addresses), cuts)
    placements = [StagePlacement(k, a, b, addr) for k, ((a, b), addr) in enumerate(zip(ranges, addresses))]
    spare_devices = dict(spare_devices or {})
    address_of = {**dict(zip(devices or (), addresses)), **spare_devices}
    M = config.microbatches

    def feeds_of(step: int):
        return step_feeds(batches, step, graph.batch, M, num_labels)

    transport = ZmqTransport("coordinator", listen, accept=())
    coordinator = Coordinator(graph, placements, config, transport, weights=weights, optimizer_state=optimizer_state,
                              stage_graphs=stage_graphs, spares=list(spare_devices.values()))
    result = PipelineResult([], [], [], [], {}, [], ranges, devices=list(devices) if devices is not None else None)
    try:
        if bundles is not None:
            coordinator.setup_bundles(bundles, devices)
        else:
            coordinator.setup()
        if config.schedule == "1f1b-stash":
            schedule = make_schedule("1f1b-stash", len(placements), steps * M, update_every=update_every)
            feeds = [f for s in range(start_step, start_step + steps) for f in feeds_of(s)]
            start = time.perf_counter()
            losses, done = coordinator.run(schedule, feeds, start_step)
            total = time.perf_counter() - start
            for i in range(steps):
                result.losses.append(float(sum(losses[i * M:(i + 1) * M])))
                result.step_seconds.append(total / steps)
                if on_step:
                    on_step(start_step + i + 1, result.losses[-1], total / steps, [d["seconds"] for d in done], done)
            result.stage_reports.append(done)
            result.stage_busy.append([_busy(d) for d in done])
        else:
            schedule = make_schedule(config.schedule, len(placements), M)
            # per step since the last re-plan check: F+B seconds per stage, and whether that step was
            # the first after a setup, which builds the engines' graphs and caches: not steady state,
            # so it is left out whenever later steps were measured
            window: list[list[float]] = []
            warm_up = True
            for s in range(start_step, start_step + steps):
                start = time.perf_counter()
                losses, done = coordinator.run(schedule, feeds_of(s), s)
                seconds = time.perf_counter() - start
                result.losses.append(float(sum(losses)))
                result.step_seconds.append(seconds)
                result.stage_reports.append(done)
                result.stage_busy.append([_busy(d) for d in done])
                if on_step:
                    on_step(s + 1, result.losses[-1], seconds, [d["seconds"] for d in done], done)
                window.append([d["seconds"].get("F", 0.0) + d["seconds"].get("B", 0.0) for d in done])
                if warm_up and len(window) > 1:
                    window.pop(0)
                    warm_up = False
                if replan_every and (s + 1 - start_step) % replan_every == 0 and s + 1 < start_step + steps:
                    measured = [sum(col) / len(window) for col in zip(*window)]
                    window, warm_up = [], False
                    if bundles is not None:
                        reconf = _replan_bundles(coordinator, on_replan, s + 1, measured, address_of, result)
                    else:
                        reconf = _replan_ranges(coordinator, on_replan, s + 1, measured, addresses, result)
                    if reconf is not None:
                        window, warm_up = [], True
                        result.replans.append((s + 1, reconf))
                        schedule = make_schedule(config.schedule, coordinator.stages, M)
                        if on_replanned:
                            on_replanned(s + 1, reconf)
        result.checkpoint = coordinator.collect_checkpoint()
        for tensors in result.checkpoint:
            result.weights.update({k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")})
        if checkpoint_dir is not None:
            save_checkpoint(checkpoint_dir, result.checkpoint,
                            {**(meta or {}), "stages": coordinator.stages, "ranges": result.ranges,
                             "step": start_step + steps, "schedule": config.schedule, "microbatches": M,
                             "losses": result.losses})
    finally:
        coordinator.stop()
        transport.close()
    return result


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
                    address_of: Mapping[str, str], result: PipelineResult) -> Reconfiguration | None:
    """Bundles: a new plan from on_replan, written from the weights gathered here (at most once)."""
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
    return reconf


def _busy(done: dict) -> float:
    busy = sum(done["seconds"].get(k, 0.0) for k in ("F", "B", "UPDATE"))
    return busy / done["wall_s"] if done.get("wall_s") else 0.0
