"""The fine-tuned model out of Confidant: `confidant predict` (label new text) and `confidant
export-trained` (an ONNX file with the trained weights, or a transformers checkpoint).

A trained model is a checkpoint folder (`runtime.pipeline.checkpoints`, written by `train-local
--checkpoint` and `train-pipeline --checkpoint`: meta.json names the ONNX file it was trained from,
`model_path`) or, untrained, an ONNX file itself. Its task (`tasks.task.Task`, a classifier's) is
the checkpoint's (`ner`, `seq-cls`), else read off the logits ([B, S, labels]: tokens, [B, labels]:
sequences; `tasks.choice.task_of`); its label names are `--labels`, else the checkpoint's, else the
export's (NAME.hf.json), else the task's default (CoNLL-2003's nine for a nine-label token model).
The task reads the input, labels it and writes the predictions (`tasks.ner.predict`,
`tasks.seqcls.predict`).

Predictions run on one MNN engine holding the whole model, in batches of `batch` rows of `seq`
tokens (a long sentence is cut into windows and stitched back, as in training). Writing out:
ONNX keeps the file's graph and swaps its weights (`planner.onnx_import.write_weights`); the
transformers folder takes config.json from the export's sidecar and each weight's name there
(`jobs.export.encoder`), through the project's own safetensors codec, and the model's tokenizer beside them
(`jobs.common.hf_tokenizer`), so that `AutoTokenizer.from_pretrained(folder)` is the real one.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, TextIO

import numpy as np

from ir.errors import InputFileError
from ir.graph import logits_shape
from ir.safetensors import save_safetensors
from jobs.common.errors import JobError
from planner.onnx_import import load_model, write_weights
from runtime.engines.factory import whole_model_engine
from runtime.pipeline.checkpoints import check_tensors_fit, load_checkpoint
from tasks.choice import TASK_NAMES, task_named, task_of
from tasks.classification import PREDICTION_FORMATS as FORMATS, Prediction



@dataclass(frozen=True, eq=False)
class TrainedModel:
    """An ONNX file and the trained weights to run it with (none: as exported)."""

    model_path: Path
    weights: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping = field(default_factory=dict)
    source: Path | None = None  # the checkpoint folder, when there is one

    @property
    def sidecar(self) -> dict | None:
        from jobs.export.encoder import read_hf_sidecar

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


def _task_of(trained: TrainedModel, graph):
    """The classifier's task (`tasks.task.Task`): the checkpoint's, else the one the logits say."""
    recorded = trained.meta.get("task")
    task = task_named(recorded if recorded in TASK_NAMES else task_of(graph).task)
    if not hasattr(task, "predict"):
        raise JobError(f"{trained.model_path} is a {task.name} model: predict labels tokens or sequences; "
                       "`confidant generate` answers prompts with a causal LM")
    return task


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


def _engine(trained: TrainedModel, batch: int, seq: int, threads: int):
    graph = load_model(trained.model_path, batch, seq)
    if trained.weights:  # the ONNX file at model_path may have been replaced by another model's
        check_tensors_fit(trained.source, trained.weights, {}, {p: graph.constants[p].shape for p in graph.params},
                          trained.model_path, f"put the ONNX file it was trained from back at {trained.model_path}")
    engine = whole_model_engine(graph, "mnn", threads, weights=trained.weights, cache_activations=False)
    return graph, engine


# --- predict -----------------------------------------------------------------------------------

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


# --- export-trained ----------------------------------------------------------------------------

def export_trained_onnx(checkpoint: Path, output: Path) -> Path:
    """The ONNX file the checkpoint was trained from, with its trained weights, at `output`."""
    trained = open_trained(checkpoint)
    if not trained.weights:
        raise JobError(f"{checkpoint} is not a checkpoint folder (meta.json and stage files)")
    if Path(output).resolve() == trained.model_path.resolve():
        raise JobError(f"-o {output} is the model the checkpoint was trained from; write the trained model elsewhere")
    return write_weights(trained.model_path, output, trained.weights)


def export_trained_hf(checkpoint: Path, folder: Path, tokenizer: Path | None = None) -> Path:
    """A transformers checkpoint folder with the trained weights (config.json, model.safetensors) and
    the model's tokenizer (`jobs.common.hf_tokenizer`: `tokenizer`, else the one it was exported with), so
    transformers' Auto classes load both from the folder alone."""
    from jobs.common.hf_tokenizer import encoder_tokenizer, write_hf_tokenizer

    trained = open_trained(checkpoint)
    if not trained.weights:
        raise JobError(f"{checkpoint} is not a checkpoint folder (meta.json and stage files)")
    sidecar = trained.sidecar
    causal_lm = trained.meta.get("task") == "causal-lm" or trained.model_path.with_suffix(".lm.json").is_file()
    if sidecar is None and causal_lm:
        from jobs.export.llm import export_trained_causal_lm_hf

        return export_trained_causal_lm_hf(trained.model_path, trained.weights, folder, tokenizer)
    if sidecar is None:
        raise JobError(f"{trained.model_path} has no {trained.model_path.stem}.hf.json next to it: --hf needs the "
                       "transformers config and weight names `confidant export` writes there; re-export the model with "
                       "`confidant export` (and train it again), or use -o FILE.onnx")
    if sidecar.get("unplaced"):
        raise JobError(f"{trained.model_path.stem}.hf.json could not name every weight at export: "
                       f"{sidecar['unplaced']}; use -o FILE.onnx")
    names = sidecar["weights"]
    missing = sorted(set(trained.weights) - set(names))
    if missing:
        raise JobError(f"{checkpoint}: trained weights {missing[:4]} have no transformers name in "
                       f"{trained.model_path.stem}.hf.json (was it written for this model?)")
    tensors: dict[str, np.ndarray] = {}
    for ir_name, value in trained.weights.items():
        n = names[ir_name]
        value = np.asarray(value, np.float32)
        array = np.ascontiguousarray(value.T if n["transposed"] else value)
        if n["key"] in tensors and not np.array_equal(tensors[n["key"]], array):
            raise JobError(f"{checkpoint}: two trained weights are transformers' {n['key']!r} and differ")
        tensors[n["key"]] = array
    config = dict(sidecar["config"])
    config["architectures"] = [sidecar["architecture"]]
    labels = trained.meta.get("labels") or sidecar.get("labels")
    if labels and len(labels) == sidecar["num_labels"]:
        config["id2label"] = {str(i): name for i, name in enumerate(labels)}
        config["label2id"] = {name: i for i, name in enumerate(labels)}
    config["torch_dtype"] = "float32"
    # found before anything is written: a refusal leaves no half folder
    hf_tokenizer, _ = encoder_tokenizer(trained.model_path, sidecar, tokenizer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_hf_tokenizer(hf_tokenizer, folder)
    return folder
