"""The metrics document every training command writes with `--metrics-out`: one schema, versioned.

    {"schema_version": 1, "format": "confidant-metrics",
     "command": "train-local" | "train-pipeline" | "train", "model": str, "plan": str | null,
     "schedule": str | null, "microbatches": int, "batch": int, "seq": int,
     "steps": [{"step", "loss", "seconds", "samples_per_s", "tokens_per_s", "state_seconds" (pipelines)}],
                                                                                one per optimizer step
     "devices": [{"name", "stage", "blocks": [first, last], "peak_rss_bytes", "planned_bytes" | null,
                  "budget_bytes" | null}],   one per stage at the end
     "peak_rss_bytes": the largest device's, "coordinator_peak_rss_bytes": int | null,
     "predicted_step_s": float | null, "measured_step_s": float, "state_share": float | null,
     "error": str (only a run that failed once started),
     "eval": null | {"metric": "entity_f1" | "accuracy" | "exact_match", "before": float | null, "after",
                     "precision", "recall", "per_type": {type or label: f1}, "macro_f1": float | null,
                     "perplexity": float | null, "perplexity_before": float | null},
     "replans": [...], "replan_checks": [...], "events": [...], "settings": {...}}

For NER (`entity_f1`) precision, recall and per_type are entity-level (conlleval); for sequence
classification (`accuracy`, `--task seq-cls`) `after`/`before` are accuracies, precision, recall and
macro_f1 are macro averages over the labels, per_type holds each label's F1. For a causal LM
(`exact_match`, `--task causal-lm`) `after`/`before` are the exact match of generated answers,
`perplexity`/`perplexity_before` the dev answers' perplexity, and precision, recall and per_type the
entity task's JSON scores (valid_json, precision, recall, f1) when the answers are its JSON, else null;
`perplexity` is null for the other tasks.

`step` counts from the start of training (a resumed run continues the count); `tokens_per_s` is
null where a command does not count tokens; `events` lists failures and recoveries as they happen
(empty when none), each {"event", "at" (time.time()), ...}: "lost" {step, stage, device, address,
detected_after_s, reason}, "new_plan" {step, cause ("lost" | "measured" | "memory_low" | "battery_low"),
old_ranges, ranges, devices, plan, seconds, sent_bytes (bundles and optimizer state sent to set the new
stages up), kept_bytes (weights the workers took from what they held instead); `left`: the devices moved
off when running low},
"recovered" {step, seconds (from detection to that step done), steps_replayed, ranges, devices},
"checkpoint" {step, directory}, "memory_low" {step, device, mem_available_bytes}, "battery_low" {step,
device, battery_percent}, "stayed" {step, devices, cause, reason: running low but nowhere to move}
(jobs.train.pipeline), "memory_over" {step, device, peak_rss_bytes, planned_bytes, budget_bytes, over:
"budget" | "plan"} at the end of a run whose device went over (jobs.common.memory_check). docs/metrics.md documents the same fields.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ir.versioned import check_header
from tasks.task import EvalFigures  # the task's figures, the document's `eval`

METRICS_SCHEMA_VERSION = 1
METRICS_FORMAT = "confidant-metrics"


@dataclass(frozen=True)
class StepFigures:
    step: int
    loss: float
    seconds: float
    samples_per_s: float
    tokens_per_s: float | None = None
    # of `seconds` (wall clock from the step's start to the next's): copying the state off the
    # devices and writing checkpoints, what the fault policy cost this step (pipelines only)
    state_seconds: float | None = None


@dataclass(frozen=True)
class DeviceFigures:
    name: str
    stage: int
    first_block: int
    last_block: int
    peak_rss_bytes: int | None
    # what the device was promised: the plan's figure (or the memory model's for a run planned in
    # memory) and its budget; None: unknown (jobs.common.memory_check)
    planned_bytes: int | None = None
    budget_bytes: int | None = None


@dataclass(frozen=True)
class TrainingMetrics:
    command: str
    model: str
    batch: int
    seq: int
    steps: tuple[StepFigures, ...]
    devices: tuple[DeviceFigures, ...]
    microbatches: int = 1
    schedule: str | None = None
    plan: str | None = None
    eval: EvalFigures | None = None
    predicted_step_s: float | None = None
    coordinator_peak_rss_bytes: int | None = None
    replans: tuple[Mapping[str, Any], ...] = ()
    replan_checks: tuple[Mapping[str, Any], ...] = ()
    events: tuple[Mapping[str, Any], ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    # why the run ended early (a loss beyond recovery, --on-failure stop, a worker's error); None: it finished
    error: str | None = None

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def measured_step_s(self) -> float:
        return sum(s.seconds for s in self.steps) / len(self.steps) if self.steps else math.nan

    @property
    def state_share(self) -> float | None:
        """The share of the steps' wall clock spent copying state off the devices and writing
        checkpoints (None where not measured)."""
        known = [s for s in self.steps if s.state_seconds is not None]
        total = sum(s.seconds for s in known)
        return sum(s.state_seconds for s in known) / total if known and total > 0 else None

    @property
    def peak_rss_bytes(self) -> int | None:
        known = [d.peak_rss_bytes for d in self.devices if d.peak_rss_bytes is not None]
        return max(known) if known else None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": METRICS_SCHEMA_VERSION, "format": METRICS_FORMAT, "command": self.command,
            "model": self.model, "plan": self.plan, "schedule": self.schedule, "microbatches": self.microbatches,
            "batch": self.batch, "seq": self.seq,
            "steps": [{"step": s.step, "loss": s.loss, "seconds": s.seconds, "samples_per_s": s.samples_per_s,
                       "tokens_per_s": s.tokens_per_s,
                       **({} if s.state_seconds is None else {"state_seconds": s.state_seconds})} for s in self.steps],
            "devices": [{"name": d.name, "stage": d.stage, "blocks": [d.first_block, d.last_block],
                         "peak_rss_bytes": d.peak_rss_bytes, "planned_bytes": d.planned_bytes,
                         "budget_bytes": d.budget_bytes} for d in self.devices],
            "peak_rss_bytes": self.peak_rss_bytes, "coordinator_peak_rss_bytes": self.coordinator_peak_rss_bytes,
            "predicted_step_s": self.predicted_step_s, "measured_step_s": _finite(self.measured_step_s),
            "state_share": self.state_share,
            "eval": None if self.eval is None else {
                "metric": self.eval.metric, "before": self.eval.before, "after": self.eval.after,
                "precision": self.eval.precision, "recall": self.eval.recall, "per_type": dict(self.eval.per_type),
                "macro_f1": self.eval.macro_f1, "perplexity": self.eval.perplexity,
                "perplexity_before": self.eval.perplexity_before},
            "replans": [dict(r) for r in self.replans], "replan_checks": [dict(c) for c in self.replan_checks],
            "events": [dict(e) for e in self.events], "settings": dict(self.settings),
            **({} if self.error is None else {"error": self.error}),
        }

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        return path


def read_metrics(path: str | Path) -> dict[str, Any]:
    """A metrics document written by `TrainingMetrics.write`, checked for its format and version."""
    doc = json.loads(Path(path).read_text())
    check_header(doc, format=METRICS_FORMAT, versions=METRICS_SCHEMA_VERSION, where=str(path))
    return doc


def steps_from(losses: Sequence[float], seconds: Sequence[float], rows: int, first_step: int = 1,
               state_seconds: Sequence[float] | None = None) -> tuple[StepFigures, ...]:
    """Step figures of a pipeline run: loss and wall time per step (from its start to the next
    step's), `rows` samples a step, and of that time the fault policy's state copies and checkpoints."""
    state = list(state_seconds) if state_seconds is not None else [None] * len(losses)
    return tuple(StepFigures(first_step + i, float(loss), float(sec), rows / sec if sec > 0 else math.nan,
                             state_seconds=None if st is None else float(st))
                 for i, (loss, sec, st) in enumerate(zip(losses, seconds, state)))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
