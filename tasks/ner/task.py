"""NER as a `tasks.task.Task`: CoNLL files in, entity-level F1 out."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TextIO

from ir.graph import Graph, is_causal_lm, logits_shape
from tasks.classification import ClassificationTask, Prediction, head_block
from tasks.task import EvalFigures, TaskMismatch


@dataclass(frozen=True)
class NerTask(ClassificationTask):
    name: str = "ner"
    examples: str = "sentences"
    per_sequence: bool = False

    def read_data(self, model: Path, data: Path, eval_path: Path | None, seq: int, *,
                  tokenizer: Path | None = None, eval_limit: int | None = None,
                  note: Callable[[str], None] | None = None):
        from tasks.ner.data import load_ner_data

        return load_ner_data(data, eval_path, seq, tokenizer)

    def check_graph(self, model: Path, graph: Graph, data, eval_path: Path | None = None) -> None:
        if is_causal_lm(graph):
            raise TaskMismatch(f"{model} is a causal language model: train it with --task causal-lm")
        logits = logits_shape(graph)
        if len(logits) != 3:
            raise TaskMismatch(f"{model} labels whole sequences (logits {list(logits)}); train it with --task "
                               "seq-cls, or export a token classifier for NER")
        self.check_labels(model, graph, data, eval_path)

    def evaluate(self, engine, graph: Graph, data, batch: int) -> EvalFigures | None:
        """Entity F1 of `engine` on `data`'s evaluation sentences (`tasks.ner.data.NerData`)."""
        from tasks.trainer import TrainConfig, evaluate

        if not data.dev:
            return None
        scores = evaluate(engine, data.dev_encoded, data.dev_tags, data.labels, TrainConfig(batch=batch, seq=data.seq),
                          head_block(graph))
        return EvalFigures(scores.f1, scores.precision, scores.recall, None,
                           {k: v.f1 for k, v in scores.per_type.items()})

    def headline(self, figures: EvalFigures) -> str:
        return f"entity F1 {figures.after:.4f}"

    # --- confidant predict ---
    default_format = "conll"

    def default_labels(self, count: int) -> tuple[str, ...] | None:
        """CoNLL-2003's nine tags for a nine-label model whose export named none."""
        from tasks.tokenize import CONLL_LABELS

        return CONLL_LABELS if count == len(CONLL_LABELS) else None

    def predict(self, engine, graph: Graph, tokenizer, input_path: Path, names, batch: int, seq: int
                ) -> list[Prediction]:
        """The tags of every sentence of `input_path` (`tasks.ner.predict`)."""
        from tasks.ner.predict import predict_words, read_sentences

        return predict_words(engine, tokenizer, read_sentences(input_path), names, batch, seq, head_block(graph))

    def write_predictions(self, predictions: Sequence[Prediction], out: TextIO, fmt: str) -> None:
        from tasks.ner.predict import write_tags

        write_tags(predictions, out, fmt)


NER = NerTask()
