"""The settings a training job takes, as data (the command line builds them from its flags; tests and
library users build them directly). Each `check` raises JobError naming the flag and the fix."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ir.plan import ASYNC_SCHEDULES, FAILURE_POLICIES, FLUSH_SCHEDULES, check_optimizer_name, check_schedule_name
from ir.training import TRAINING
from jobs.common.errors import FlagError, JobError
from planner.lora import LoraSettings


@dataclass(frozen=True)
class TrainingSettings:
    """What every training command shares: steps, batch rows, tokens per row, optimizer, seed, the
    engine and its threads, and the tokenizer (None: the bundled MiniLM's)."""

    steps: int = TRAINING.steps
    batch: int = TRAINING.batch
    seq: int = TRAINING.seq
    lr: float = TRAINING.lr
    optimizer: str = TRAINING.optimizer
    seed: int = TRAINING.seed
    threads: int = TRAINING.threads
    engine: str = TRAINING.engine
    tokenizer: Path | None = None
    lora: LoraSettings | None = None  # None: full fine-tuning
    eval_limit: int | None = None  # causal LMs: generate for the first N evaluation conversations only
    # train-local: "keep", "recompute" or "per-block" (runtime.engines.factory.make_engine); None: the
    # engine's default (torch keeps, MNN recomputes)
    activations: str | None = None

    def check(self) -> "TrainingSettings":
        for flag, value in (("--steps", self.steps), ("--batch", self.batch), ("--threads", self.threads)):
            if value < 1:
                raise JobError(f"{flag} must be at least 1, got {value}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise JobError(f"--eval-limit must be at least 1, got {self.eval_limit}")
        if self.seq < 4:
            raise JobError(f"--seq must be at least 4 tokens, got {self.seq}")
        if not self.lr > 0:
            raise JobError(f"--lr must be a positive number, got {self.lr}")
        try:
            check_optimizer_name(self.optimizer)
        except ValueError as exc:
            raise JobError(f"--optimizer: {exc}") from None
        return self


@dataclass(frozen=True)
class PipelineSettings:
    """How `train-pipeline` cuts and schedules: the schedule and its micro-batches, backwards per
    update (1f1b-stash), the cuts (None: the even split), checkpoint and resume folders,
    re-planning, the coordinator's address and how long to wait on a silent worker."""

    schedule: str = TRAINING.schedule
    microbatches: int = TRAINING.microbatches
    update_every: int = TRAINING.update_every
    cuts: tuple[int, ...] | None = None
    checkpoint: Path | None = None
    resume: Path | None = None
    replan_every: int | None = None
    replan_threshold: float = TRAINING.replan_threshold
    listen: str = "tcp://127.0.0.1:0"
    timeout_s: float = 600.0
    keys: Path | None = None          # coordinator.key and the workers' NAME.pub (jobs.common.workers)
    insecure: bool = False            # plaintext links, no signatures
    on_failure: str = "replan"        # jobs.train.pipeline.FaultPolicy
    failure_timeout_s: float = 3.0
    checkpoint_every: int | None = None
    # "keep", "recompute" or "per-block" (MNN) on every stage, or one per stage (a plan's choices); None:
    # each engine's default
    activations: str | None | tuple[str | None, ...] = None

    def check(self, batch: int) -> "PipelineSettings":
        try:
            check_schedule_name(self.schedule)
        except ValueError as exc:
            raise FlagError(f"--schedule: {exc}") from None
        if self.microbatches < 1 or batch % self.microbatches:
            raise FlagError(f"--batch {batch} must be a multiple of --microbatches {self.microbatches}")
        if self.update_every < 1:
            raise FlagError(f"--update-every must be at least 1, got {self.update_every}")
        if self.update_every != 1 and self.schedule not in ASYNC_SCHEDULES:
            raise FlagError(f"--update-every applies to 1f1b-stash and 2bw only; {self.schedule} updates once per "
                            f"batch")
        if self.replan_every is not None and (self.replan_every < 1 or self.schedule not in FLUSH_SCHEDULES):
            raise FlagError(f"--replan-every needs a whole number of steps >= 1 and a flush schedule (1f1b-flush, "
                           f"gpipe or zb-h1), got {self.replan_every} with {self.schedule}")
        if not self.replan_threshold >= 0:
            raise FlagError(f"--replan-threshold must be a number >= 0 (0.1: 10% faster), got {self.replan_threshold}")
        if not self.timeout_s > 0:
            raise FlagError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        check_fault_flags(self.on_failure, self.failure_timeout_s, self.checkpoint_every, self.checkpoint)
        return self


def check_fault_flags(on_failure: str, failure_timeout_s: float, checkpoint_every: int | None,
                      checkpoint: Path | None) -> None:
    if on_failure not in FAILURE_POLICIES:
        raise JobError(f"--on-failure must be {' or '.join(FAILURE_POLICIES)}, not {on_failure!r}")
    if not failure_timeout_s > 0:
        raise JobError(f"--failure-timeout must be a positive number of seconds, got {failure_timeout_s}")
    if checkpoint_every is not None:
        if checkpoint_every < 1:
            raise JobError(f"--checkpoint-every must be at least 1 step, got {checkpoint_every}")
        if checkpoint is None:
            raise JobError("--checkpoint-every N needs --checkpoint DIR, the folder to write to")
