"""Sequence classification as a `tasks.task.Task`: TSV/CSV files in, accuracy and macro-F1 out."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TextIO

from ir.graph import Graph, is_sequence_classifier, logits_shape
from tasks.classification import ClassificationTask, Prediction, head_block
from tasks.task import EvalFigures, TaskMismatch


@dataclass(frozen=True)
class SeqClsTask(ClassificationTask):
    name: str = "seq-cls"
    examples: str = "examples"
    per_sequence: bool = True

    def read_data(self, model: Path, data: Path, eval_path: Path | None, seq: int, *,
                  tokenizer: Path | None = None, eval_limit: int | None = None,
                  note: Callable[[str], None] | None = None):
        """The examples, labelled in the order the model's export recorded (its NAME.hf.json, when
        `model` is an exported file), else in `tasks.seqcls.data.label_order`."""
        from tasks.seqcls.data import load_seqcls_data
        from tasks.side_files import read_hf_sidecar

        sidecar = read_hf_sidecar(model) if Path(model).is_file() else None
        return load_seqcls_data(data, eval_path, seq, tokenizer, (sidecar or {}).get("labels"))

    def check_graph(self, model: Path, graph: Graph, data, eval_path: Path | None = None) -> None:
        if not is_sequence_classifier(graph):  # a causal LM's logits are per token too
            raise TaskMismatch(f"{model} labels tokens (logits {list(logits_shape(graph))}); for --task seq-cls "
                               "export a sequence classifier: `confidant export --task seq-cls --num-labels N`")
        self.check_labels(model, graph, data, eval_path)

    def evaluate(self, engine, graph: Graph, data, batch: int) -> EvalFigures | None:
        """Accuracy and macro-F1 of `engine` on `data`'s evaluation examples (`tasks.seqcls.data.SeqClsData`)."""
        from tasks.trainer import TrainConfig, evaluate_classes

        if not data.dev:
            return None
        scores = evaluate_classes(engine, data.dev_encoded, data.dev_labels, data.labels,
                                  TrainConfig(batch=batch, seq=data.seq), head_block(graph))
        return EvalFigures(scores.accuracy, scores.macro_precision, scores.macro_recall, None,
                           {k: v.f1 for k, v in scores.per_label.items()}, metric="accuracy", macro_f1=scores.macro_f1)

    def headline(self, figures: EvalFigures) -> str:
        return f"accuracy {figures.after:.4f}, macro-F1 {figures.macro_f1:.4f}"

    # --- confidant predict ---
    default_format = "jsonl"

    def default_labels(self, count: int) -> tuple[str, ...] | None:
        return None  # a sequence classifier's labels are its export's, or --labels

    def predict(self, engine, graph: Graph, tokenizer, input_path: Path, names, batch: int, seq: int
                ) -> list[Prediction]:
        """The label of every text of `input_path` (`tasks.seqcls.predict`)."""
        from tasks.seqcls.predict import predict_texts, read_texts

        return predict_texts(engine, tokenizer, read_texts(input_path), names, batch, seq, head_block(graph))

    def write_predictions(self, predictions: Sequence[Prediction], out: TextIO, fmt: str) -> None:
        from tasks.seqcls.predict import write_labels

        write_labels(predictions, out, fmt)


SEQ_CLS = SeqClsTask()
