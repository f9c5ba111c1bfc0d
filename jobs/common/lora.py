"""LoRA in a job: the model as lowered, with adapters when the settings ask for them."""
from __future__ import annotations

from ir.graph import Graph
from jobs.common.errors import JobError
from jobs.common.report import Reporter, Silent
from planner.lora import LoraSettings, add_lora


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
