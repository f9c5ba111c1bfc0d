"""The side files `confidant export` writes beside a model, read where a task is chosen or its labels
named: NAME.hf.json (what an encoder was exported for: its task, label names, transformers config)
and NAME.lm.json (a causal LM's export record, `tasks.causal_lm.generate.lm_metadata`)."""
from __future__ import annotations

import json
from pathlib import Path

from ir.versioned import check_header

HF_SIDECAR_SUFFIX = ".hf.json"
LM_SIDE_FILE_SUFFIX = ".lm.json"


def hf_sidecar_path(model_path: Path) -> Path:
    model_path = Path(model_path)
    return model_path.with_name(model_path.stem + HF_SIDECAR_SUFFIX)


def lm_side_file(model_path: Path) -> Path:
    """NAME.lm.json beside NAME.onnx: there only for a causal LM `confidant export` wrote."""
    return Path(model_path).with_suffix(LM_SIDE_FILE_SUFFIX)


def read_hf_sidecar(model_path: Path) -> dict | None:
    """The NAME.hf.json next to an exported NAME.onnx, or None (a file `confidant export` did not make)."""
    path = hf_sidecar_path(model_path)
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    check_header(doc, format="confidant-hf-export", versions=None, where=str(path),
                 redo="re-export the model (`confidant export`)")
    return doc
