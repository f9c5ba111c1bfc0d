"""The task a training command runs when `--task` is not given, and why.

The model's side files decide first (`confidant export` writes them): `NAME.lm.json` marks a causal LM,
`NAME.hf.json` records the task it was exported for. A file exported elsewhere has neither, and then
the training data's kind decides: JSONL is conversations for a causal LM, TSV/CSV is labelled
sentences, anything else is read as CoNLL (NER, the default before the task was inferred)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jobs.export import read_hf_sidecar

# the task names of the training commands, by the name `confidant export --task` records
_EXPORTED = {"token-classification": "ner", "seq-cls": "seq-cls", "causal-lm": "causal-lm"}
_BY_SUFFIX = {".jsonl": "causal-lm", ".tsv": "seq-cls", ".csv": "seq-cls"}


@dataclass(frozen=True)
class TaskChoice:
    task: str  # ner | seq-cls | causal-lm
    reason: str  # what decided it, for the progress line


def infer_task(model: Path, data: Path | None) -> TaskChoice:
    model = Path(model)
    if model.with_suffix(".lm.json").is_file():
        return TaskChoice("causal-lm", f"{model.with_suffix('.lm.json').name} beside the model")
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
