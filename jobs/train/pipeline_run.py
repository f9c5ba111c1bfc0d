"""What `confidant train PLAN` (jobs.train.from_plan) and `confidant train-pipeline`
(jobs.train.pipeline) share around a plan's run on workers: one progress line per step and per
event, and the run itself with its local worker processes finished however it ends, a lost or failed
worker turned into RunFailed carrying the metrics of the steps done."""
from __future__ import annotations

from typing import Callable, Mapping

from jobs.common.errors import RunFailed, VersionMismatch, failure_text
from jobs.common.report import Reporter
from runtime.pipeline.coordinator import WorkerFailed, WorkerLostBeforeFirstAnswer, WorkerVersionMismatch
from runtime.pipeline.executor import busy_fraction
from runtime.pipeline.session import PipelineResult, RecoveryImpossible


def progress(reporter: Reporter, samples_per_step: int, first_step: int = 0):
    """train_pipeline's on_step: the step (counted from `first_step`, a resume's), its loss, samples
    per second and each stage's busy share."""
    def on_step(step, loss, seconds, stage_seconds, done):
        busy = "/".join(f"{busy_fraction(d['seconds'], d.get('wall_s', 0.0)):.0%}" for d in done)
        reporter.step(step - first_step, loss=loss, **{"samples/s": samples_per_step / seconds, "busy": busy})

    return on_step


def run_on_workers(run: Callable[[], PipelineResult], metrics_of, local, reporter: Reporter) -> PipelineResult:
    """`run()` (a train_pipeline call); `local` (jobs.common.workers.LocalWorkers or None) finished after it,
    however it ends. A lost or failed worker ends the run as RunFailed with `metrics_of(the partial
    result, error=...)`, so the steps done and the events reach --metrics-out."""
    failed = True
    try:
        result = run()
        failed = False
        return result
    except (WorkerFailed, RecoveryImpossible) as exc:
        partial = getattr(exc, "result", None)
        # a worker lost before its first setup's answer most likely runs a tree before protocol 3
        mismatch = isinstance(exc, (WorkerVersionMismatch, WorkerLostBeforeFirstAnswer))
        kind = VersionMismatch if mismatch else RunFailed
        raise kind(str(exc), None if partial is None else metrics_of(partial, error=str(exc))) from None
    except BaseException as exc:  # Ctrl-C, or a fault of no known kind: the document is written all the same
        partial = getattr(exc, "result", None)
        if partial is not None:
            exc.metrics = metrics_of(partial, error=failure_text(exc))
        raise
    finally:
        if local is not None:
            codes = local.finish(failed)
            if any(codes) and not failed:
                reporter.note(f"local workers exited with codes {codes}")


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
