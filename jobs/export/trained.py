"""`confidant export-trained`: a fine-tuned model out of Confidant, as an ONNX file with the trained
weights or a transformers checkpoint. ONNX keeps the file's graph and swaps its weights
(`planner.onnx_import.write_weights`); the transformers folder takes config.json from the export's
sidecar and each weight's name there (`jobs.export.encoder`), through the project's own safetensors
codec, and the model's tokenizer beside them (`jobs.common.hf_tokenizer`), so that
`AutoTokenizer.from_pretrained(folder)` is the real one.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ir.safetensors import save_safetensors
from jobs.common.errors import JobError
from jobs.common.trained import open_trained
from planner.onnx_import import write_weights


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
