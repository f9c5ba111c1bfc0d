"""What a training run asks of its task, whatever the task: the `Task` protocol and the figures a
task scores a model with. Which task a run trains is `tasks.choice`'s (`task_named`, `task_of`).

One `Task` per family, each in its subpackage:
- `tasks.ner`: token classification (NER on CoNLL files, entity F1);
- `tasks.seqcls`: sequence classification (GLUE-style TSV/CSV, accuracy and macro-F1);
- `tasks.causal_lm`: causal language modelling (JSONL instructions or plain text, dev perplexity).

The training jobs (train-local, train-pipeline, train PLAN) and `predict` ask the task object, found
by name or by the model (`tasks.choice`), instead of testing the task's name: reading the
data, checking the lowered graph against it, the graph inputs of each step's micro-batches, scoring
an engine that holds the whole model, and the one-line summary of the score.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ir.graph import Graph
from ir.ops import LOSS_INPUTS


class TaskMismatch(ValueError):
    """The model's head does not fit the task (token vs sequence classification, a causal LM): the
    message names the model and the flag or export that fits."""


@dataclass(frozen=True)
class EvalFigures:
    """The task's metric on the evaluation file, after training (and before, where measured):
    entity-level F1 (NER), accuracy with macro precision / recall / F1 (sequence classification),
    exact match of generated answers or the answers' perplexity (causal LM). The metrics document's
    `eval` (`jobs.common.metrics`)."""

    after: float
    precision: float
    recall: float
    before: float | None = None
    per_type: Mapping[str, float] = field(default_factory=dict)
    metric: str = "entity_f1"
    macro_f1: float | None = None
    perplexity: float | None = None  # causal LMs: the dev answers' perplexity after training
    perplexity_before: float | None = None


class Task(Protocol):
    """One family of training tasks. `data` is the family's own record of a run's data (`read_data`),
    a batch what `batches` makes of it."""

    name: str  # ner | seq-cls | causal-lm: --task, a checkpoint's meta.json, the metrics' settings
    loss: str  # the loss the model is lowered with (planner.onnx_import.load_model's `loss`)
    loss_inputs: tuple[str, ...]  # the graph inputs the loss reads, of ir.ops.LOSS_INPUTS
    examples: str  # what one training example is called in progress lines

    def read_data(self, model: Path, data: Path, eval_path: Path | None, seq: int, *,
                  tokenizer: Path | None = None, eval_limit: int | None = None,
                  note: Callable[[str], None] | None = None) -> Any:
        """The training (and evaluation) data encoded at `seq` tokens; bad files raise
        `ir.errors.InputFileError`s naming them."""

    def check_graph(self, model: Path, graph: Graph, data, eval_path: Path | None = None) -> None:
        """`TaskMismatch` or `ir.errors.InputFileError` when the lowered model does not fit the task or the data."""

    def batches(self, data, batch: int, seed: int) -> list:
        """The training batches of `batch` rows, shuffled by `seed` (cycled by the trainer)."""

    def feeds(self, data, batch, rows: int, microbatches: int) -> list[dict[str, np.ndarray]]:
        """The graph inputs of `batch` (padded to `rows` rows) as `microbatches` micro-batches, each
        normalised by the whole batch's count, so micro-batch losses and gradients sum to the batch's."""

    def evaluate(self, engine, graph: Graph, data, batch: int) -> EvalFigures | None:
        """The task's figures of `engine` (holding all of `graph`, lowered at `batch` rows) on the
        evaluation data; None without any."""

    def with_before(self, after: EvalFigures, before: EvalFigures) -> EvalFigures:
        """`after` with the figures measured before training beside it."""

    def headline(self, figures: EvalFigures) -> str:
        """The score in one line: `entity F1 0.8123`."""


def loss_inputs_of(*names: str) -> tuple[str, ...]:
    """`names`, each checked to be a graph input a loss reads (`ir.ops.LOSS_INPUTS`)."""
    unknown = [n for n in names if n not in LOSS_INPUTS]
    if unknown:
        raise ValueError(f"{unknown} are not loss inputs ({', '.join(LOSS_INPUTS)})")
    return tuple(names)


def before_after(after: EvalFigures, before: EvalFigures | None) -> EvalFigures:
    """`after` with the before-training figure (`before.after`) beside it, or as it is."""
    return after if before is None else replace(after, before=before.after)
