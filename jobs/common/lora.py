"""LoRA in a job: the model as lowered, with adapters when the settings ask for them."""
from __future__ import annotations

from pathlib import Path

import dataclasses

from ir.graph import Graph
from jobs.common.errors import JobError
from jobs.common.report import Reporter, Silent
from planner.cluster import Cluster
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


def read_mapped(model: str | Path, settings: LoraSettings | None, engine: str | None = None,
                activations: str | None = None) -> bool:
    """Whether a run reads `model` from a mapping of the file (`load_model(mapped=True)`): when it holds
    its frozen base below float32 (LoRA with --base-dtype other than float32) and the file stores that
    base float32. Then each float32 weight is resident only while it is quantized
    (`ir.precision.quantize_frozen` gives the pages back as it goes), and the set-up never holds the
    float32 file beside the quantized base (SmolLM2 int4 LoRA on one device: a 710-739 MiB set-up
    against 341-370 in training, the file read into memory first). Nothing trains such a graph's frozen
    arrays in place (LoRA engines copy what they are given), so read-only views are safe; full
    fine-tuning (`take_weights`) needs writable arrays of its own. A file `export --base-dtype` stored
    quantized is read into memory as before (its pieces are the quantized base already: no spike; mapped they
    stood beside the engine's copy, SmolLM2 int4: training 396 MiB against 340, helper h75), except on PyTorch
    per block, whose engine reads them in place and gives their pages back per block (below, helper h166).
    A float32 base too where `engine` is PyTorch recomputing `activations` per block: the engine reads the
    weights in place and gives each block's pages back after its use (`runtime.engines.pytorch`), so the run
    holds one block's frozen weights at a time (SmolLM2 LoRA: 848 -> 440 MiB, helper h155); or MNN recomputing
    exactly "per-block" (a hybrid "per-block+K" keeps caches and holds its base as constants): its engine writes
    each block's weights from the mapping into placeholders shared by a set of blocks before each use
    (`runtime.engines.mnn._FrozenStream`; SmolLM2 LoRA: 694 -> 424 MiB, helper h156)."""
    if settings is None:
        return False
    if settings.base_dtype == "float32" and not (engine in ("torch", "mnn") and activations == "per-block"):
        return False
    from planner.onnx_quantize import recorded_base_dtype

    stored = recorded_base_dtype(Path(model))
    if stored == "float32":
        return True
    # A base the file stores quantized at the run's precision (`export --base-dtype int4`) on PyTorch recomputing
    # per block: the engine widens each product's weight from the file's own codes and scales on the mapping
    # (`planner.onnx_weights.map_raw`'s stored pieces) and gives each block's pages back after its use, as it does
    # a float32 base's (`runtime.engines.pytorch`): one block of the packed base resident, not all of it. MNN
    # copies a quantized weight's parts into its constants (`mnn_kernels.widened_weight_parts`): held there.
    return stored == settings.base_dtype and engine == "torch" and activations == "per-block"


def base_on_mapping(model: str | Path, settings: LoraSettings | None, engine: str | None = None,
                    activations: str | None = None) -> bool:
    """Whether a run's frozen base stays on the file's mapping while it trains (`DeviceSpec.frozen_mapped`,
    what `planner.cost.maps_frozen` charges): read mapped (`read_mapped`) and not quantized at load (a float32
    base, or one the file stores at the run's precision); a base quantized from a float32 file is held."""
    if not read_mapped(model, settings, engine, activations):
        return False
    if settings.base_dtype == "float32":
        return True
    from planner.onnx_quantize import recorded_base_dtype

    return recorded_base_dtype(Path(model)) == settings.base_dtype


def load_adapted(model: str | Path, batch: int, seq: int, settings: LoraSettings | None,
                 reporter: Reporter = Silent(), loss: str = "auto", engine: str | None = None,
                 activations: str | None = None) -> Graph:
    """`adapted(load_model(model, batch, seq, loss=loss), settings)`, the file read mapped where a
    float32 file's frozen base is held quantized, or read in place one block at a time (`read_mapped`)."""
    mapped = read_mapped(model, settings, engine, activations)
    return adapted(load_model(model, batch, seq, loss=loss, mapped=mapped), settings, reporter)


def with_base_mapped(cluster: Cluster, float32_lora: bool) -> Cluster:
    """`cluster` with each device marked as reading a float32 LoRA base mapped (`DeviceSpec.frozen_mapped`)
    where the plan is written with its base weights file (`plan` always: base.safetensors beside the
    bundles): its workers hold that file (`train PLAN`'s local workers; a remote one started with
    `confidant worker --base`) and view a stage's frozen weights on a mapping of it, which a per-block
    engine reads a block at a time (runtime.pipeline.bundles.rebuild_weights); the cost model charges such
    a stage so only where its activations map (`planner.cost.maps_frozen`). MNN devices too, since its engine
    reads a mapped table's rows and a block's weights a file span at a time (`ir.mapped_pages.gather_rows`,
    `_BlockProgram.load_frozen`) and the charge holds what those reads keep (`planner.cost.mapped_read_bytes`):
    before, a SmolLM2 MNN stage's worker read 1.04-1.20 of the mapped charge (its first stage's lookup faulted
    44-52 MiB of the mapped table in, helpers h162 and h172). A plan run from memory (`train-pipeline`) ships
    whole bundles and is not marked. A worker started without the base file writes the weights it receives to
    a file chunk by chunk as they arrive and maps that (helper h176)."""
    if not float32_lora:
        return cluster
    return dataclasses.replace(cluster, devices=tuple(
        dataclasses.replace(d, frozen_mapped=True) if d.backend is not None else d for d in cluster.devices))
