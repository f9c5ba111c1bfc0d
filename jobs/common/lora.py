"""LoRA in a job: the model as lowered, with adapters when the settings ask for them."""
from __future__ import annotations

from pathlib import Path

from ir.graph import Graph
from jobs.common.errors import JobError
from jobs.common.report import Reporter, Silent
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model


def adapted(graph: Graph, settings: LoraSettings | None, reporter: Reporter = Silent()) -> Graph:
    """`graph` with LoRA adapters per `settings` (None: unchanged, full fine-tuning)."""
    if settings is None:
        return graph
    try:
        lora, adapters = add_lora(graph, settings)
    except ValueError as exc:
        raise JobError(str(exc) if str(exc).startswith("--") else f"--lora-targets: {exc}") from None
    trainable = sum(int(lora.constants[p].nbytes) for p in lora.params)
    frozen = sum(b.frozen_bytes for b in lora.blocks)
    reporter.note(f"LoRA r={settings.rank} alpha={settings.alpha:g} on {len(adapters)} projections "
                  f"({', '.join(sorted({a.role for a in adapters}))}); trainable {trainable / 2**20:.2f} MiB, "
                  f"frozen {frozen / 2**20:.1f} MiB"
                  + (f" (held {settings.base_dtype})" if settings.base_dtype != "float32" else ""))
    return lora


def quantized_base(settings: LoraSettings | None) -> bool:
    """Whether a run holds its frozen base below float32 (LoRA with --base-dtype other than float32):
    then the model file is read mapped (`load_model(mapped=True)`), each float32 weight resident only
    while it is quantized (`ir.precision.quantize_frozen` gives the pages back as it goes), so the
    set-up never holds the float32 file beside the quantized base (SmolLM2 int4 LoRA on one device:
    a 710 MiB set-up against 341 in training, when the file was read into memory first). Nothing
    trains such a graph's frozen arrays in place (LoRA engines copy what they are given), so the
    read-only views are safe; full fine-tuning (`take_weights`) needs writable arrays of its own."""
    return settings is not None and settings.base_dtype != "float32"


def load_adapted(model: str | Path, batch: int, seq: int, settings: LoraSettings | None,
                 reporter: Reporter = Silent(), loss: str = "auto") -> Graph:
    """`adapted(load_model(model, batch, seq, loss=loss), settings)`, the file read mapped where the
    frozen base is held quantized (`quantized_base`)."""
    return adapted(load_model(model, batch, seq, loss=loss, mapped=quantized_base(settings)), settings, reporter)
