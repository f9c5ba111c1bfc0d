"""`confidant export --base-dtype int8|int4|bfloat16`: the exported files with their frozen weights
stored quantized (planner/onnx_quantize.py says how), so the model file is small and ONNX Runtime
still runs it (`confidant generate`), and `train-local` / `plan` hold the base at that precision.

What is quantized: every weight `ir.precision.quantizable` picks in the lowered model, i.e. 2-D
float weights only products and lookups read (an embedding table, and so a tied LM head, at int8
under int4, as llama.cpp's 4-bit files keep it); norms, biases and a classifier's freshly
initialised head (trained even under LoRA) stay float32. A causal LM's key/value-cache graph
(NAME.kv.onnx, the same weight names) gets the very same arrays, and NAME.lm.json records the
precision (`base_dtype`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jobs.common.errors import JobError


@dataclass(frozen=True)
class QuantizedExport:
    base_dtype: str
    weights: int               # how many weights are stored quantized
    float_bytes: int           # their bytes as float32
    stored_bytes: int          # their bytes as stored (codes, scales, offsets)
    files: tuple[Path, ...]    # the files rewritten


def quantize_export(model: Path, base_dtype: str, keep_head: bool = False) -> QuantizedExport:
    """Rewrite `model` (and NAME.kv.onnx when it shares the weight names) with its frozen weights at
    `base_dtype`; `keep_head`: a classifier's head block stays float32 (it trains under LoRA)."""
    from ir.precision import check_base_dtype
    from planner.onnx_import import load_model
    from planner.onnx_quantize import quantized_weights, write_quantized

    try:
        check_base_dtype(base_dtype)
    except ValueError as exc:
        raise JobError(f"--base-dtype: {exc}") from None
    model = Path(model)
    graph = load_model(model, 1, 8, with_loss=False)
    keep = {p for b in graph.blocks if keep_head and b.kind == "head" for p in b.params}
    weights = quantized_weights(graph, base_dtype, keep)
    del graph
    done = write_quantized(model, weights, base_dtype)
    files = [model]
    meta_path = model.with_suffix(".lm.json")
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        kv = model.parent / meta["kv_model"] if meta.get("kv_model") else None
        if kv is not None and kv.is_file():
            if not meta.get("kv_same_weight_names"):
                raise JobError(f"{kv.name} names its weights apart from {model.name} (the dynamo exporter): "
                               "--base-dtype needs the TorchScript exporter (drop --dynamo) or --no-kv-cache")
            kv_done = write_quantized(kv, {k: weights[k] for k in done}, base_dtype)
            if sorted(kv_done) != sorted(done):
                raise JobError(f"{kv.name} holds other weights than {model.name}: re-export both")
            files.append(kv)
        meta["base_dtype"] = base_dtype
        meta["stored_quantized"] = sorted(done)  # computed from stored arrays, not initializers
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    stored = {k: weights[k] for k in done}
    return QuantizedExport(base_dtype, len(stored), sum(4 * q.size for q in stored.values()),
                           sum(q.nbytes for q in stored.values()), tuple(files))
