"""What a pipeline run needs of its task: the graph lowered at micro-batch rows, the graph inputs of
each step's micro-batches, and the task's score of the trained weights.

`confidant train-pipeline --task ner|seq-cls|causal-lm` (jobs.pipeline_training) builds one with
`pipeline_task`; the pipeline itself (runtime.pipeline) knows nothing of tasks. Micro-batching is
exact for every task: NER and seq-cls losses are means over the whole batch's labelled tokens or
examples, and a causal LM's targets are weighted by 1 / the whole batch's target count
(tasks.lm_data.microbatch_feeds), so the micro-batch losses and gradients sum to the batch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ir.backend import BackendSpec
from ir.graph import Graph, logits_shape
from jobs.errors import JobError
from jobs.metrics import EvalFigures
from jobs.report import Reporter, Silent
from jobs.settings import TrainingSettings

TASKS = ("ner", "seq-cls", "causal-lm")


@dataclass(frozen=True)
class PipelineTask:
    """`graph`: the model at micro-batch rows (LoRA applied); `feeds_of_step(k)`: step k's feeds, one
    dict per micro-batch; `evaluate(weights)`: the task's figures for trained weights (None without
    an evaluation file); `headline(figures)`: its one-line summary; `labels`: the label names (NER,
    seq-cls), empty for a causal LM."""

    name: str
    graph: Graph
    feeds_of_step: Callable[[int], list[dict[str, np.ndarray]]]
    evaluate: Callable[[Mapping[str, np.ndarray]], EvalFigures | None]
    headline: Callable[[EvalFigures], str]
    labels: tuple[str, ...] = ()
    # distinct batches before `feeds_of_step` repeats them (one pass over the data); 0: not said
    batches: int = 0


def step_feeds(batches, step: int, micro_rows: int, microbatches: int, num_labels: int) -> list[dict[str, np.ndarray]]:
    """The graph inputs of every micro-batch of training step `step` of NER or seq-cls `batches`
    (they repeat in order)."""
    from tasks.tokenize import split_microbatches
    from tasks.trainer import batch_feeds, pad_batch

    batch = pad_batch(batches[step % len(batches)], micro_rows * microbatches)
    return [batch_feeds(mb, num_labels, batch.n_labelled) for mb in split_microbatches(batch, microbatches)]


def pipeline_task(task: str, model: Path, data: Path, eval_path: Path | None, training: TrainingSettings,
                  microbatches: int, reporter: Reporter = Silent()) -> PipelineTask:
    """The task's data read and its graph lowered for a pipeline of `microbatches` micro-batches of
    `training.batch // microbatches` rows; a JobError names a file or model that does not fit."""
    if task not in TASKS:
        raise JobError(f"--task {task!r} is not one of {', '.join(TASKS)}")
    if task == "causal-lm":
        return _causal_lm(model, data, eval_path, training, microbatches, reporter)
    return _classification(task, model, data, eval_path, training, microbatches, reporter)


def _classification(task: str, model: Path, data: Path, eval_path: Path | None, training: TrainingSettings,
                    microbatches: int, reporter: Reporter) -> PipelineTask:
    from jobs.evaluation import class_figures, eval_figures, score, score_classes
    from jobs.local_training import _task_data, check_task_shape
    from jobs.lora import adapted
    from planner.onnx_import import load_model
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from tasks.ner import check_label_count, eval_only_labels
    from tasks.tokenize import make_batches

    run = _task_data(task, model, data, eval_path, training)
    rows = training.batch // microbatches
    graph = adapted(load_model(model, rows, training.seq), training.lora, reporter)
    check_task_shape(model, graph, task)
    check_label_count(model, logits_shape(graph)[-1], run.labels, eval_only_labels(run),
                      eval_path)
    batches = make_batches(run.train_encoded, training.batch, training.seq, seed=training.seed,
                           per_sequence=task == "seq-cls")
    n_labels = len(run.labels)

    def evaluate(weights: Mapping[str, np.ndarray]) -> EvalFigures | None:
        if not run.dev:
            return None
        full = adapted(load_model(model, training.batch, training.seq), training.lora)
        engine = make_engine(BackendSpec.cpu("mnn", training.threads), stage_spec(full, 0, len(full.blocks) - 1),
                             weights={**full.constants, **weights}, cache_activations=False)
        if task == "seq-cls":
            return class_figures(score_classes(engine, full, run, training.batch))
        return eval_figures(score(engine, full, run, training.batch))

    def headline(f: EvalFigures) -> str:
        return f"accuracy {f.after:.4f}, macro-F1 {f.macro_f1:.4f}" if task == "seq-cls" else f"entity F1 {f.after:.4f}"

    return PipelineTask(task, graph, lambda k: step_feeds(batches, k, rows, microbatches, n_labels), evaluate,
                        headline, tuple(run.labels), len(batches))


def _causal_lm(model: Path, data: Path, eval_path: Path | None, training: TrainingSettings, microbatches: int,
               reporter: Reporter) -> PipelineTask:
    from dataclasses import replace

    from jobs.lm_training import dev_rows_of, lm_graph, lm_scores, lm_tokenizer, train_rows_of
    from tasks.lm_data import make_lm_batches, microbatch_feeds, pad_lm_batch

    tokenizer = lm_tokenizer(model, training)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    rows = train_rows_of(data, tokenizer, training.seq, reporter.note)
    dev, dev_rows = dev_rows_of(eval_path, tokenizer, training, reporter.note)
    graph, _ = lm_graph(model, replace(training, batch=training.batch // microbatches), reporter)
    batches = make_lm_batches(rows, training.batch, training.seq, pad_id, seed=training.seed)

    def feeds_of_step(k: int) -> list[dict[str, np.ndarray]]:
        return microbatch_feeds(pad_lm_batch(batches[k % len(batches)], training.batch, pad_id), microbatches)

    def evaluate(weights: Mapping[str, np.ndarray]) -> EvalFigures | None:
        if not dev:
            return None
        from jobs.lm_training import lm_figures

        return lm_figures(lm_scores(model, training, eval_path, dev_rows, weights))

    def headline(f: EvalFigures) -> str:
        return f"dev perplexity {f.perplexity:.3f}, exact match {f.after:.3f}"

    return PipelineTask("causal-lm", graph, feeds_of_step, evaluate, headline, batches=len(batches))
