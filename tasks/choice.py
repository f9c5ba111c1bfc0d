"""Which task a run trains: by its `--task` name (`task_named`), or by the model (`task_of`: the
lowered graph's head, else the side files `confidant export` writes, else the data's kind)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ir.graph import Graph, is_causal_lm, is_sequence_classifier
from tasks.task import Task

TASK_NAMES = ("ner", "seq-cls", "causal-lm")


def task_named(name: str) -> Task:
    """The task called `name` (one of TASK_NAMES); a ValueError lists them otherwise."""
    if name == "ner":
        from tasks.ner.task import NER

        return NER
    if name == "seq-cls":
        from tasks.seqcls.task import SEQ_CLS

        return SEQ_CLS
    if name == "causal-lm":
        from tasks.causal_lm.task import CAUSAL_LM

        return CAUSAL_LM
    raise ValueError(f"--task {name!r} is not one of {', '.join(TASK_NAMES)}")


@dataclass(frozen=True)
class TaskChoice:
    task: str  # one of TASK_NAMES
    reason: str  # what decided it, for the progress line


# the task names of the training commands, by the name `confidant export --task` records
_EXPORTED = {"token-classification": "ner", "seq-cls": "seq-cls", "causal-lm": "causal-lm"}
_BY_SUFFIX = {".jsonl": "causal-lm", ".tsv": "seq-cls", ".csv": "seq-cls"}


def task_of(graph: Graph | None = None, *, model: Path | None = None, data: Path | None = None) -> TaskChoice:
    """The task a model is for, and why. A lowered `graph` decides by its head (a causal-LM loss,
    logits per sequence, per token). Without one (a training command chooses the task before it
    lowers the model, since a causal LM is lowered with its own loss) the model's side files decide
    (`confidant export` writes them): NAME.lm.json marks a causal LM, NAME.hf.json records the task it
    was exported for. A file exported elsewhere has neither, and then the training data's kind
    decides: JSONL is conversations for a causal LM, TSV/CSV is labelled sentences, anything else is
    read as CoNLL (NER, the default before the task was inferred)."""
    from tasks.side_files import lm_side_file, read_hf_sidecar

    if graph is not None:
        if is_causal_lm(graph):
            return TaskChoice("causal-lm", "the model's causal-LM loss")
        if is_sequence_classifier(graph):
            return TaskChoice("seq-cls", "the model's logits, one row per sequence")
        return TaskChoice("ner", "the model's logits, one row per token")
    if model is not None:
        model = Path(model)
        if lm_side_file(model).is_file():
            return TaskChoice("causal-lm", f"{lm_side_file(model).name} beside the model")
        try:
            sidecar = read_hf_sidecar(model)
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            sidecar = None  # an unreadable side file decides nothing; the data's kind does
        if sidecar is not None and sidecar.get("task") in _EXPORTED:
            return TaskChoice(_EXPORTED[sidecar["task"]], f"{model.stem}.hf.json beside the model")
    if data is not None and Path(data).suffix.lower() in _BY_SUFFIX:
        suffix = Path(data).suffix.lower()
        return TaskChoice(_BY_SUFFIX[suffix], f"a {suffix} data file")
    return TaskChoice("ner", "no side file says otherwise; CoNLL data")

