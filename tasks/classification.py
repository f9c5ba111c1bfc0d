"""What token classification (`tasks.ner`) and sequence classification (`tasks.seqcls`) share as
tasks: batches of `tasks.tokenize.Batch`, their `targets` (one-hot / the whole batch's labelled
count, `tasks.trainer.batch_feeds`), the label set checked against the model's head, and the
before-training figure beside the after.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.errors import InputFileError
from ir.graph import Graph, logits_shape
from tasks.task import EvalFigures, before_after, loss_inputs_of


PREDICTION_FORMATS = ("conll", "jsonl")


@dataclass(frozen=True)
class Prediction:
    """One input's prediction (`confidant predict`): its words and tags (token models) or its label
    and the label probabilities (sequence models)."""

    words: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    text: str | None = None
    text_pair: str | None = None
    label: str | None = None
    scores: Mapping[str, float] = field(default_factory=dict)


def read_input_text(path: Path) -> str:
    """`predict`'s input as text (`tasks.text_files.read_utf8_text`)."""
    from tasks.text_files import read_utf8_text

    return read_utf8_text(path, "give a text, CoNLL or TSV/CSV file saved as UTF-8", f"--input {path}")


def head_block(graph: Graph) -> int:
    """The block whose output is the logits (the one before the loss)."""
    return len(graph.blocks) - 2


def check_label_count(model: Path, predicted: int, labels: Sequence[str], eval_only: Sequence[str] = (),
                      eval_path: Path | None = None) -> None:
    """A ValueError saying how to re-export when the model's head and the data disagree (and which
    labels only the evaluation file brings: `eval_only`, from `eval_path`)."""
    if predicted != len(labels):
        only = (f"; {list(eval_only)} appear only in --eval {eval_path}, which the training never sees: drop them "
                "from it or add training sentences with them" if eval_only else "")
        raise InputFileError(f"{model} predicts {predicted} labels but the data has {len(labels)} ({', '.join(labels)}); "
                             f"re-export with `confidant export --num-labels {len(labels)}`{only}")


def eval_only_labels(data) -> list[str]:
    """Labels of the evaluation examples that no training example has (NER tags, or sequence labels)."""
    def labels(rows) -> set[str]:
        return {t for r in rows for t in (r.tags if hasattr(r, "tags") else (r.label,))}

    return sorted(labels(data.dev) - labels(data.train))


@dataclass(frozen=True)
class ClassificationTask:
    """The part of `tasks.task.Task` both classification families share; each adds `read_data`,
    `check_graph` (through `check_labels`), `evaluate` and `headline`, and for `confidant predict`
    `predict` (labels of new text, `Prediction`s), `write_predictions`, `default_format` and
    `default_labels` (the label names of a model whose export named none)."""

    name: str
    examples: str
    per_sequence: bool  # one label per sequence (logits [batch, labels]), not one per token
    loss: str = "auto"  # the classifier's cross-entropy, as planner.onnx_import lowers it by default
    loss_inputs: tuple[str, ...] = loss_inputs_of("targets")

    def check_labels(self, model: Path, graph: Graph, data, eval_path: Path | None = None) -> None:
        check_label_count(model, logits_shape(graph)[-1], data.labels, eval_only_labels(data), eval_path)

    def batches(self, data, batch: int, seed: int) -> list:
        from tasks.tokenize import make_batches

        return make_batches(data.train_encoded, batch, data.seq, seed=seed, per_sequence=self.per_sequence)

    def feeds(self, data, batch, rows: int, microbatches: int) -> list[dict[str, np.ndarray]]:
        from tasks.tokenize import split_microbatches
        from tasks.trainer import batch_feeds, pad_batch

        batch = pad_batch(batch, rows)
        return [batch_feeds(micro, len(data.labels), batch.n_labelled)
                for micro in split_microbatches(batch, microbatches)]

    def with_before(self, after: EvalFigures, before: EvalFigures) -> EvalFigures:
        return before_after(after, before)
