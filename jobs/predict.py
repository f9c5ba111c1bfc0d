"""`confidant predict`: label new text with a fine-tuned model (a checkpoint folder or an ONNX file,
`jobs.common.trained`). Its task (`tasks.task.Task`, a classifier's) is the checkpoint's (`ner`,
`seq-cls`), else read off the logits ([B, S, labels]: tokens, [B, labels]: sequences;
`tasks.choice.task_of`). The task reads the input, labels it and writes the predictions
(`tasks.ner.predict`, `tasks.seqcls.predict`). Predictions run on one MNN engine holding the whole
model, in batches of `batch` rows of `seq` tokens (a long sentence is cut into windows and stitched
back, as in training).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence, TextIO

from ir.graph import logits_shape
from jobs.common.errors import JobError
from jobs.common.trained import TrainedModel, label_names, open_trained
from planner.onnx_import import load_model
from runtime.engines.factory import whole_model_engine
from runtime.pipeline.checkpoints import check_tensors_fit
from tasks.choice import TASK_NAMES, task_named, task_of
from tasks.classification import PREDICTION_FORMATS as FORMATS, Prediction


def _task_of(trained: TrainedModel, graph):
    """The classifier's task (`tasks.task.Task`): the checkpoint's, else the one the logits say."""
    recorded = trained.meta.get("task")
    task = task_named(recorded if recorded in TASK_NAMES else task_of(graph).task)
    if not hasattr(task, "predict"):
        raise JobError(f"{trained.model_path} is a {task.name} model: predict labels tokens or sequences; "
                       "`confidant generate` answers prompts with a causal LM")
    return task


def _engine(trained: TrainedModel, batch: int, seq: int, threads: int):
    graph = load_model(trained.model_path, batch, seq)
    if trained.weights:  # the ONNX file at model_path may have been replaced by another model's
        check_tensors_fit(trained.source, trained.weights, {}, {p: graph.constants[p].shape for p in graph.params},
                          trained.model_path, f"put the ONNX file it was trained from back at {trained.model_path}")
    engine = whole_model_engine(graph, "mnn", threads, weights=trained.weights, cache_activations=False)
    return graph, engine

def _input_text(path: Path) -> str:
    from tasks.classification import read_input_text

    return read_input_text(path)


def predict(model: Path, input_path: Path, labels: Sequence[str] | None = None, batch: int = 8, seq: int = 128,
            threads: int = 1, tokenizer: Path | None = None) -> tuple[str, list[Prediction]]:
    """(task, predictions) of a model or checkpoint on every sentence of `input_path`."""
    from tasks.models import default_tokenizer_path
    from tasks.tokenize import load_tokenizer

    trained = open_trained(model)
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"--input {input_path}: no such file")
    _input_text(input_path)  # an unreadable input is refused before the model is built
    graph, engine = _engine(trained, batch, seq, threads)
    task = _task_of(trained, graph)
    names = label_names(trained, logits_shape(graph)[-1], task, labels)
    tok = load_tokenizer(tokenizer or default_tokenizer_path())
    return task.name, task.predict(engine, graph, tok, input_path, names, batch, seq)


def write_predictions(task: str, predictions: Sequence[Prediction], out: TextIO, fmt: str | None = None) -> None:
    """CoNLL (word TAB tag, a blank line between sentences; text TAB label for sequences) or JSONL."""
    chosen = task_named(task)
    fmt = fmt or chosen.default_format
    if fmt not in FORMATS:
        raise JobError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    chosen.write_predictions(predictions, out, fmt)


def predict_to(model: Path, input_path: Path, output: Path | None, fmt: str | None = None, **kwargs) -> int:
    """`predict` written to `output` (or standard output); the number of inputs labelled."""
    task, predictions = predict(model, input_path, **kwargs)
    if output is None:
        write_predictions(task, predictions, sys.stdout, fmt)
    else:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            write_predictions(task, predictions, f, fmt)
    return len(predictions)
