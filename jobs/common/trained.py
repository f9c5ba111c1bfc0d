"""A trained model as the jobs that use it open it: a checkpoint folder (`runtime.pipeline.checkpoints`,
written by `train-local --checkpoint` and `train-pipeline --checkpoint`: meta.json names the ONNX file it was
trained from, `model_path`) or, untrained, an ONNX file itself; and its label names: `--labels`, else the
checkpoint's, else the export's (NAME.hf.json), else the task's default (CoNLL-2003's nine for a nine-label
token model). `confidant predict` (jobs.predict) and `confidant export-trained` (jobs.export.trained) read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.errors import InputFileError
from jobs.common.errors import JobError
from runtime.pipeline.checkpoints import load_checkpoint


@dataclass(frozen=True, eq=False)
class TrainedModel:
    """An ONNX file and the trained weights to run it with (none: as exported)."""

    model_path: Path
    weights: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping = field(default_factory=dict)
    source: Path | None = None  # the checkpoint folder, when there is one

    @property
    def sidecar(self) -> dict | None:
        from tasks.side_files import read_hf_sidecar

        return read_hf_sidecar(self.model_path)


def open_trained(path: Path) -> TrainedModel:
    """A checkpoint folder (with the ONNX file it names) or an ONNX file."""
    path = Path(path)
    if path.is_dir() and (path / "meta.json").is_file():
        meta, weights, _ = load_checkpoint(path)
        if meta.get("lora"):
            raise JobError(f"{path} is a LoRA run's checkpoint: write its adapters with `confidant export-adapter "
                           f"{path} -o DIR` (PEFT's format), or the merged model with `confidant export-adapter {path} "
                           "--merged -o FILE.onnx`, which predict takes")
        model = Path(meta.get("model_path") or "")
        if not meta.get("model_path"):
            raise JobError(f"{path}: its meta.json does not say which ONNX file it was trained from (a checkpoint "
                           f"of `train` from a plan made before plans recorded it: {meta.get('plan')}); re-plan and "
                           "train again, or train with train-local / train-pipeline")
        if not model.is_file():
            raise JobError(f"{path}: the model it was trained from ({meta.get('model_path')}) is not there; its "
                           "meta.json has `model_path`, put the ONNX file back there")
        return TrainedModel(model, weights, meta, path)
    if path.is_dir():
        raise InputFileError(f"{path}: a folder without meta.json is not a checkpoint; give a checkpoint folder "
                             "(train-local --checkpoint DIR) or an ONNX file")
    return TrainedModel(path)




def label_names(trained: TrainedModel, n_labels: int, task, given: Sequence[str] | None = None) -> tuple[str, ...]:
    """The model's label names in output order (see the module docstring)."""
    sidecar = trained.sidecar or {}
    for names in (given, trained.meta.get("labels"), sidecar.get("labels")):
        if names:
            if len(names) != n_labels:
                raise JobError(f"{len(names)} label names ({', '.join(names)}) for a model with {n_labels} outputs")
            return tuple(names)
    if task.default_labels(n_labels):
        return task.default_labels(n_labels)
    raise JobError(f"the model has {n_labels} labels but no names for them: pass --labels A,B,... (in output order)")
