"""Entity-level F1 of a model's weights on the evaluation sentences, on one MNN engine holding the
whole model: how every training command scores its result (and, for train-local, its start)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ir.backend import BackendSpec
from ir.graph import Graph
from jobs.metrics import EvalFigures
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from tasks.metrics import ClassScores, Scores
from tasks.ner import NerData
from tasks.trainer import TrainConfig, evaluate, evaluate_classes


def head_block(graph: Graph) -> int:
    """The block whose output is the logits (the one before the loss)."""
    return len(graph.blocks) - 2


def score(engine, graph: Graph, data: NerData, batch: int) -> Scores:
    """Entity F1 of `engine` (the whole model) on `data`'s evaluation sentences."""
    return evaluate(engine, data.dev_encoded, data.dev_tags, data.labels, TrainConfig(batch=batch, seq=data.seq),
                    head_block(graph))


def score_weights(graph: Graph, weights: Mapping[str, np.ndarray], data: NerData, batch: int,
                  threads: int = 1) -> Scores:
    """Entity F1 of `graph` with `weights` (a trained model's parameters by name)."""
    engine = make_engine(BackendSpec.cpu("mnn", threads), stage_spec(graph, 0, len(graph.blocks) - 1),
                         weights={**graph.constants, **weights}, cache_activations=False)
    return score(engine, graph, data, batch)


def eval_figures(after: Scores, before: Scores | None = None) -> EvalFigures:
    return EvalFigures(after.f1, after.precision, after.recall, None if before is None else before.f1,
                       {k: v.f1 for k, v in after.per_type.items()})


def score_classes(engine, graph: Graph, data, batch: int) -> ClassScores:
    """Accuracy and macro-F1 of `engine` (the whole model) on a sequence-classification run's
    evaluation examples (`tasks.seqcls.SeqClsData`)."""
    return evaluate_classes(engine, data.dev_encoded, data.dev_labels, data.labels,
                            TrainConfig(batch=batch, seq=data.seq), head_block(graph))


def class_figures(after: ClassScores, before: ClassScores | None = None) -> EvalFigures:
    return EvalFigures(after.accuracy, after.macro_precision, after.macro_recall,
                       None if before is None else before.accuracy, {k: v.f1 for k, v in after.per_label.items()},
                       metric="accuracy", macro_f1=after.macro_f1)
