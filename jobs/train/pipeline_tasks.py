"""What a pipeline run needs of its task: the graph lowered at micro-batch rows, the graph inputs of
each step's micro-batches, and the task's score of the trained weights.

`confidant train-pipeline --task ner|seq-cls|causal-lm` (jobs.train.pipeline) builds one with
`pipeline_task`; the pipeline itself (runtime.pipeline) knows nothing of tasks. Micro-batching is
exact for every task: NER and seq-cls losses are means over the whole batch's labelled tokens or
examples, and a causal LM's targets are weighted by 1 / the whole batch's target count
(tasks.causal_lm.data.microbatch_feeds), so the micro-batch losses and gradients sum to the batch's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ir.graph import Graph
from jobs.common.metrics import EvalFigures
from jobs.common.report import Reporter, Silent
from jobs.common.settings import TrainingSettings
from jobs.common.task_choice import check_graph, task_for
from tasks.task import Task

# training rows whose answers a causal LM's generation on the workers drafts from (`answer_index`):
# enough for a task's answer skeleton, a bounded index however large the training set
ANSWER_ROWS = 256


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
    # the task's figures computed on the workers, which hold the trained weights, before they are
    # stopped: `evaluate_on_stages(coordinator)` (runtime.pipeline.session.run_session's
    # after_training; Coordinator.forward_only); None: `evaluate(weights)` on this process after
    evaluate_on_stages: Callable[[object], EvalFigures | None] | None = None


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
    from jobs.common.lora import adapted
    from planner.onnx_import import load_model

    chosen = task_for(task)
    run = chosen.read_data(model, data, eval_path, training.seq, tokenizer=training.tokenizer,
                           eval_limit=training.eval_limit, note=reporter.note)
    rows = training.batch // microbatches
    # mapped: the coordinator ships the weights in its plans and holds none of them resident after
    graph = adapted(load_model(model, rows, training.seq, loss=chosen.loss, mapped=True), training.lora, reporter)
    check_graph(chosen, model, graph, run, eval_path)
    on_stages = None
    if chosen.loss == "causal-lm":  # the exported file is at hand: generate from the trained weights too
        evaluate = _generating(model, eval_path, training, run)
        on_stages = lm_evaluation_on_stages(graph, training, run, reporter)
    else:
        def full() -> Graph:
            return adapted(load_model(model, training.batch, training.seq), training.lora)

        evaluate = weights_evaluation(chosen, full, run, training.batch, training.threads)
    made = task_run(chosen, graph, run, training.batch, microbatches, training.seed,
                    _file_unchanged(graph, run, evaluate, reporter))
    return replace(made, evaluate_on_stages=on_stages) if on_stages is not None else made


def _file_unchanged(graph: Graph, run, evaluate: Callable[[Mapping[str, np.ndarray]], EvalFigures | None],
                    reporter: Reporter) -> Callable[[Mapping[str, np.ndarray]], EvalFigures | None]:
    """`evaluate`, once the model file `graph`'s weights are mapped from is as it was mapped: the
    evaluation opens that file by its path again (lowering, ONNX Runtime), and a file changed under
    the run would score other weights than those trained (planner.onnx_weights.ModelFileChanged).
    Changed, the trained weights are kept and reported without figures, the reason in a note."""
    from planner.onnx_weights import ModelFileChanged, check_mapped_files

    def checked(weights: Mapping[str, np.ndarray]) -> EvalFigures | None:
        if not run.dev:
            return None
        try:
            check_mapped_files(graph.constants.values(), reopened=True)
        except ModelFileChanged as exc:
            reporter.note(f"not evaluated: {exc}")
            return None
        return evaluate(weights)

    return checked


def task_run(task: Task, graph: Graph, run, batch: int, microbatches: int, seed: int,
             evaluate: Callable[[Mapping[str, np.ndarray]], EvalFigures | None]) -> PipelineTask:
    """What a pipeline run needs of `task` on `run` (its data), batches of `batch` rows shuffled by
    `seed` and split into `microbatches`, `graph` the model at micro-batch rows."""
    batches = task.batches(run, batch, seed)

    def feeds_of_step(k: int) -> list[dict[str, np.ndarray]]:
        return task.feeds(run, batches[k % len(batches)], batch, microbatches)

    return PipelineTask(task.name, graph, feeds_of_step, evaluate, task.headline, tuple(run.labels), len(batches))


def weights_evaluation(task: Task, graph: Graph | Callable[[], Graph], run, batch: int, threads: int = 1
                       ) -> Callable[[Mapping[str, np.ndarray]], EvalFigures | None]:
    """evaluate(weights): the task's figures of trained weights, on one MNN engine holding the whole
    model (`graph`, or a function lowering it when first needed) at `batch` rows; None without
    evaluation data."""
    def evaluate(weights: Mapping[str, np.ndarray]) -> EvalFigures | None:
        if not run.dev:
            return None
        from runtime.engines.factory import whole_model_engine

        full = graph() if callable(graph) else graph
        engine = whole_model_engine(full, "mnn", threads, weights=weights, cache_activations=False)
        return task.evaluate(engine, full, run, batch)

    return evaluate


def _generating(model: Path, eval_path: Path | None, training: TrainingSettings, run
                ) -> Callable[[Mapping[str, np.ndarray]], EvalFigures | None]:
    """A causal LM's evaluate(weights) with the exported file at hand: the dev answers' perplexity
    and the exact match of answers generated from the trained weights (`jobs.train.causal_lm.lm_scores`)."""
    def evaluate(weights: Mapping[str, np.ndarray]) -> EvalFigures | None:
        if not run.dev:
            return None
        from jobs.train.causal_lm import lm_figures, lm_scores

        return lm_figures(lm_scores(model, training, eval_path, run.dev_rows, weights))

    return evaluate


def lm_evaluation_on_stages(graph: Graph, training: TrainingSettings, run, reporter: Reporter = Silent()
                            ) -> Callable[[object], EvalFigures | None]:
    """A causal LM's evaluate_on_stages(coordinator): what `_generating` scores, computed on the
    workers' engines, which hold the trained weights, so this process holds none of the model
    (issue 32: the coordinator's peak at most the largest worker's). The dev answers' perplexity:
    the dev rows forward only through the stages, the last returning each micro-batch's loss
    (`tasks.causal_lm.evaluation.staged_nll`). Generation: greedy, forward-only passes through the
    stages up to the LM head, that stage returning each row's next token and the argmax at each
    position of a drafted continuation (`StagedGreedyLM`: one or more tokens a pass), at most
    `ANSWER_TOKENS` new tokens as `_generating`'s, drafts from the row and from the first
    `ANSWER_ROWS` training answers. `graph` is the pipeline's (micro-batch rows). A worker lost or
    failing during it leaves the run trained and unevaluated, the reason in a note."""
    from jobs.train.causal_lm import ANSWER_TOKENS, lm_figures
    from tasks.causal_lm.evaluation import StagedGreedyLM, answer_index, evaluate_instructions, lookup_draft
    from tasks.causal_lm.generate import GenerationSettings

    rows, head = graph.batch, len(graph.blocks) - 2  # the LM head's block: the loss is the last

    def evaluate(coordinator) -> EvalFigures | None:
        if not run.dev:
            return None

        def scored(nll) -> EvalFigures:
            # drafts also from the training rows' answers (the first ANSWER_ROWS): the skeleton a
            # fine-tuned model's answers share, which its prompts do not hold
            index = answer_index([np.asarray(r.ids)[np.asarray(r.counted)] for r in run.train[:ANSWER_ROWS]])
            lm = StagedGreedyLM(lambda feeds, at: coordinator.forward_only(feeds, at, until_block=head), rows,
                                training.seq, run.pad_id,
                                draft=lambda sequence, limit: lookup_draft(sequence, limit, index=index))
            scores = evaluate_instructions(lm, run.tokenizer, run.dev, GenerationSettings(max_new_tokens=ANSWER_TOKENS),
                                           batch=max(1, len(run.dev)), perplexity=False)
            reporter.note(f"generation on the workers: {lm.tokens} tokens in {lm.passes} passes "
                          f"({lm.accepted} of {lm.drafted} drafted tokens kept)")
            return lm_figures((nll.perplexity, scores))

        return _on_stages(coordinator, run, rows, training.seq, scored, reporter.note)

    return evaluate


def lm_perplexity_on_stages(graph: Graph, run, note: Callable[[str], None] | None = None
                            ) -> Callable[[object], EvalFigures | None]:
    """A causal LM's dev perplexity (metric "perplexity", as `weights_evaluation` scores it) computed on
    the workers' engines before they stop (`staged_nll`), for a run with no exported file to generate
    from (`confidant train PLAN`): the coordinator builds no engine of the model. `graph`: the
    pipeline's (micro-batch rows)."""
    def evaluate(coordinator) -> EvalFigures | None:
        if not run.dev_rows:
            return None
        return _on_stages(coordinator, run, graph.batch, run.seq,
                          lambda nll: EvalFigures(nll.perplexity, None, None, metric="perplexity",
                                                  perplexity=nll.perplexity), note)

    return evaluate


def _on_stages(coordinator, run, rows: int, seq: int, figures, note: Callable[[str], None] | None
               ) -> EvalFigures | None:
    """`figures(nll)` of the dev rows' loss computed forward only through the stages
    (`tasks.causal_lm.evaluation.staged_nll`), or None, with a note, when a worker is lost or fails
    meanwhile (the run stays trained, unevaluated): what both evaluations on the workers share."""
    from runtime.pipeline.coordinator import WorkerFailed
    from tasks.causal_lm.evaluation import staged_nll

    try:
        return figures(staged_nll(coordinator.forward_only, run.dev_rows, rows, seq, run.pad_id))
    except WorkerFailed as exc:
        if note is not None:
            note(f"not evaluated: a worker failed during the evaluation on the workers: {exc}")
        return None


def task_target_positions(task: PipelineTask, steps: int | None = None) -> int | None:
    """`planner.targets.most_target_positions` of the micro-batches of `steps` training steps (None:
    one pass over the data); None for a task without per-position targets."""
    from planner.targets import most_target_positions

    count = task.batches if steps is None else (min(steps, task.batches) if task.batches else steps)
    return most_target_positions(feed for k in range(count) for feed in task.feeds_of_step(k))
