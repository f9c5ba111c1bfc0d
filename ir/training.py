"""How to train when nothing says otherwise: the one typed set of defaults that the command line's
flags, the jobs' settings, the planner's requests, the trainer and the runtime's coordinator read,
so that none of them spells a default of its own. Here, in `ir`, because it is the one layer all of
them may import (the runtime imports none of the others)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingSpec:
    """A training run's settings: the batch (`batch` rows of `seq` tokens, in `microbatches`
    micro-batches through the pipeline `schedule`, an update every `update_every` backwards on the
    asynchronous schedules), the optimizer and its learning rate, the optimizer steps, the seed, the
    engine with its threads, the LoRA rank offered where full fine-tuning does not fit and the
    adapters' alpha, and the least predicted throughput gain that makes a run re-plan."""

    schedule: str = "1f1b-flush"
    batch: int = 8
    seq: int = 128
    microbatches: int = 4
    update_every: int = 1
    optimizer: str = "adamw"
    lr: float = 5e-5  # BERT fine-tuning's usual
    steps: int = 60
    seed: int = 0
    engine: str = "mnn"
    threads: int = 1
    lora_rank: int = 8        # PEFT's usual first choice
    lora_alpha: float = 8.0   # PEFT's default
    replan_threshold: float = 0.1  # 10% more steps per second


TRAINING = TrainingSpec()
